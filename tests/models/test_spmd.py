"""`taco_models.spmd.emulated_shard_map` runs a shard_map program on one device: the same outputs as
`jax.shard_map` over 8 fake CPU devices, for every collective the models use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from taco_models import spmd

SIZES = {"dp": 2, "pp": 2, "tp": 2}


def _program(x, w, key):
    """Each collective once, over single axes and a tuple of axes, on rank-dependent values."""
    rank = lax.axis_index("tp") + 10 * lax.axis_index("pp") + 100 * lax.axis_index("dp")
    summed = lax.psum(x * jnp.sum(w), "tp")
    gathered = lax.all_gather(summed, "dp", tiled=True)
    return {
        "scattered": lax.psum_scatter(gathered, "pp", scatter_dimension=0, tiled=True),
        "sent": lax.ppermute(x, "pp", [(0, 1), (1, 0)]) + rank,
        "swapped": lax.all_to_all(x, "tp", 0, 0, tiled=True),
        "mean": lax.pmean(jnp.sum(x), ("dp", "pp", "tp")),
        "noise": jax.random.randint(jax.random.fold_in(key, rank), (3,), 0, 1000),
        "stacked": x[None],
    }


IN_SPECS = (P(("dp", "pp"), "tp"), P("tp"), P())
OUT_SPECS = {
    "scattered": P("pp", "tp"),
    "sent": P(("dp", "pp"), "tp"),
    "swapped": P(("pp", "dp"), "tp"),  # a tuple in another order than the mesh's
    "mean": P(),
    "noise": P("tp"),  # differs over dp and pp: both keep rank 0's copy
    "stacked": P("dp", ("pp", "tp")),
}


def test_emulation_equals_shard_map():
    """Integer-valued fp32 data: every sum is exact, so the two must agree bit for bit."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices; set XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = jax.make_mesh((2, 2, 2), tuple(SIZES), (jax.sharding.AxisType.Auto,) * 3)
    x = jnp.arange(16 * 12, dtype=jnp.float32).reshape(16, 12)
    w = jnp.arange(6, dtype=jnp.float32)
    key = jax.random.key(7)
    want = jax.jit(
        jax.shard_map(_program, mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=False)
    )(x, w, key)
    got = jax.jit(
        spmd.emulated_shard_map(_program, axis_sizes=SIZES, in_specs=IN_SPECS, out_specs=OUT_SPECS)
    )(x, w, key)
    assert jax.devices()[0] in got["sent"].devices() and len(got["sent"].devices()) == 1
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_a_spec_that_does_not_fit_names_the_array():
    emulated = spmd.emulated_shard_map(
        lambda x: x, axis_sizes=SIZES, in_specs=(P("tp"),), out_specs=P("tp")
    )
    with pytest.raises(ValueError, match=r"shape \(3, 4\) does not split into 2 blocks"):
        emulated(jnp.zeros((3, 4)))
    unknown = spmd.emulated_shard_map(
        lambda x: x, axis_sizes=SIZES, in_specs=(P("ep"),), out_specs=P()
    )
    with pytest.raises(ValueError, match="names axis 'ep', not one of"):
        unknown(jnp.zeros((4,)))
    twice = spmd.emulated_shard_map(
        lambda x: x, axis_sizes=SIZES, in_specs=(P("tp", "tp"),), out_specs=P()
    )
    with pytest.raises(ValueError, match="names a mesh axis twice"):
        twice(jnp.zeros((4, 4)))


def test_replica_check_catches_copies_that_differ(check_replicas):
    """With `replicas_checked`, an output whose copies along the axes its spec leaves out differ
    (here the noise, drawn per rank) raises; copies made equal by a collective pass."""
    check_replicas(True)
    x = jnp.arange(16 * 12, dtype=jnp.float32).reshape(16, 12)
    w = jnp.arange(6, dtype=jnp.float32)

    def run(out_specs):
        program = lambda *a: {k: _program(*a)[k] for k in out_specs}  # noqa: E731
        emulated = spmd.emulated_shard_map(
            program, axis_sizes=SIZES, in_specs=IN_SPECS, out_specs=out_specs
        )
        jax.block_until_ready(jax.jit(emulated)(x, w, jax.random.key(7)))
        jax.effects_barrier()

    run({"mean": P(), "scattered": P("pp", "tp")})
    with pytest.raises(Exception, match="differs between the ranks"):
        run({"noise": P("tp")})


def test_in_specs_may_be_one_spec_for_every_argument():
    emulated = spmd.emulated_shard_map(
        lambda a, b: a + b, axis_sizes={"tp": 2}, in_specs=P("tp"), out_specs=P("tp")
    )
    np.testing.assert_array_equal(emulated(jnp.arange(4.0), jnp.ones(4)), jnp.arange(4.0) + 1)
