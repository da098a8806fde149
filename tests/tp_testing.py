"""Run a per-device function on a TP group: fake CPU devices under shard_map, or vmap emulation."""

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MODES = ("shard_map", "vmap")


def tp_mesh(tp: int, axis_name: str = "tp") -> jax.sharding.Mesh:
    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} devices, have {jax.device_count()}")
    return jax.make_mesh(
        (tp,), (axis_name,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:tp]
    )


def run_tp(per_device_fn, stacked, *, tp: int, mode: str, axis_name: str = "tp"):
    """Runs `per_device_fn(x_r)` on every rank r, with `stacked[r]` (a pytree) as rank r's input.

    Returns the per-rank outputs stacked along a new leading axis, in either mode:
    "shard_map" on `tp` fake devices, or "vmap" with `axis_name` on one device.
    """
    return run_on_mesh(per_device_fn, stacked, (tp,), (axis_name,), mode)


def run_on_mesh(fn, stacked, shape, names, mode):
    """`fn(rank's input)` on every rank of a mesh `shape` x `names` (fake CPU devices under
    shard_map, or nested vmaps with those axis names); inputs and outputs are pytrees stacked
    [*shape, ...]."""
    if mode == "vmap":
        for name in reversed(names):
            fn = jax.vmap(fn, axis_name=name)
        return jax.jit(fn)(stacked)
    count = 1
    for size in shape:
        count *= size
    if jax.device_count() < count:
        pytest.skip(f"needs {count} devices, have {jax.device_count()}")
    mesh = jax.make_mesh(
        shape,
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(names),
        devices=jax.devices()[:count],
    )
    spec = P(*names)
    lead = (0,) * len(names)

    def body(block):
        out = fn(jax.tree.map(lambda a: a[lead], block))
        return jax.tree.map(lambda a: a[(None,) * len(names)], out)

    placed = jax.device_put(stacked, NamedSharding(mesh, spec))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(mapped)(placed)
