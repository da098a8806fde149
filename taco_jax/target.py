"""The platform an op is traced for: a small frozen `Target`, probed once where the op is traced.

Every choice that depends on the platform reads a `Target`, never the machine itself: which
kernel runs a codec op (`pallas_kernels.registry.select`), whether the fused exchange can run,
what the "auto" policy reads (`taco_jax.policy.choose`). The collectives call `probe` once per
traced call, with their axis and `link` option; `pallas_kernels`' ops call it with no axis.

`assume(**facts)` replaces the probes' answers for the ops traced inside it: lowering a program
for a Hopper GPU from another host (`jax.jit(...).trace(x).lower(lowering_platforms=("cuda",))`),
or a test that runs the GPU's choices on the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import jax
import numpy as np

from taco_jax import policy
from taco_jax.jax_workarounds import concrete_mesh

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")
FOUND_LINKS = ("nvlink", "shm", "socket")


@dataclasses.dataclass(frozen=True)
class Target:
    """What the platform is, as far as the choices of what runs go.

    backend: JAX's backend ("gpu", "cpu", "tpu").
    hopper: the GPU is a Hopper one (compute capability 9.x: wgmma, TMA), which the Mosaic GPU
      kernels need.
    triton_missing: why JAX's Pallas has no Triton lowering here; None: it has one.
    real_link: the op's axis is a `jax.shard_map` mesh axis of GPUs, so bytes really move (not a
      `jax.vmap` axis, where a TP group is emulated on one device).
    link: where `real_link`, the link those bytes move over ("nvlink", "shm", "socket": the
      collectives' `link` option, or what "auto" found, `taco_jax.policy.resolve_link`); on a
      mesh axis of other devices (the CPU's) too, where a table measured on this machine may
      be read (`taco_jax.policy.reads_link_off_gpu`); else None.
    peer_stores: a kernel may store into the peers' memory along the axis: one mesh axis of GPUs
      joined by NVLink, driven by one process, not PCIe cards, in a mesh whose devices are in
      row-major order where that is known (Mosaic GPU's rule). Over shared memory or sockets
      the link is NCCL's transport, which peer stores would bypass.
    """

    backend: str = "cpu"
    hopper: bool = False
    triton_missing: str | None = None
    real_link: bool = False
    link: str | None = None
    peer_stores: bool = False

    def __post_init__(self):
        if self.link not in (None, *FOUND_LINKS):
            raise ValueError(f"Target.link={self.link!r} must be None or one of {FOUND_LINKS}")
        if self.peer_stores and not (self.real_link and self.link == "nvlink"):
            raise ValueError(
                f"Target.peer_stores=True needs real_link=True and link='nvlink', got "
                f"real_link={self.real_link}, link={self.link!r}"
            )

    @property
    def gpu(self) -> bool:
        return self.backend == "gpu"

    @property
    def fused_exchange_possible(self) -> bool:
        """Whether the fused encode + exchange kernels (`pallas_kernels.exchange_mosaic`, Mosaic
        GPU) can run here: a Hopper GPU whose peers' memory a kernel may store into. Whether they
        take a codec, dtype and shape is `pallas_kernels.registry.select`'s to say."""
        return self.gpu and self.hopper and self.peer_stores


def wants_kernels(impl: str, target: Target) -> bool:
    """Whether `impl` asks for the fused kernels on `target`: "pallas" and "pallas_interpret"
    always, "auto" on a GPU; "xla" (and "auto" elsewhere) runs the jnp reference."""
    if impl not in IMPLS:
        raise ValueError(f"unknown {impl=}; choose one of {IMPLS}")
    return impl in ("pallas", "pallas_interpret") or (impl == "auto" and target.gpu)


_ASSUMED: contextvars.ContextVar[tuple] = contextvars.ContextVar("taco_jax_target", default=())
FIELDS = tuple(f.name for f in dataclasses.fields(Target))


@contextlib.contextmanager
def assume(**facts) -> Iterator[None]:
    """Ops traced inside take `facts` (fields of `Target`) for what the probes would find, e.g.
    `assume(backend="gpu", hopper=True)`; the facts not given are still probed (a real link,
    the link, peer stores: from the traced axis and the `link` option). Nests."""
    unknown = sorted(set(facts) - set(FIELDS))
    if unknown:
        raise TypeError(f"unknown target fact(s) {unknown}; valid: {list(FIELDS)}")
    token = _ASSUMED.set((*_ASSUMED.get(), *facts.items()))
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def probe(axis_name=None, link: str = "auto", *, mesh: jax.sharding.Mesh | None = None) -> Target:
    """The `Target` of an op along `axis_name` (None: no axis) traced now, with the collectives'
    `link` option: what the probes find, or what `assume` says. With `mesh`, that of a
    collective along `axis_name` of `mesh` under `jax.shard_map` (for a summary before any
    op is traced)."""
    facts = dict(_ASSUMED.get())

    def fact(name, find):
        return facts[name] if name in facts else find()

    backend = fact("backend", jax.default_backend)
    hopper = fact("hopper", lambda: backend == "gpu" and _hopper_device())
    triton_missing = fact("triton_missing", _triton_missing)
    real = fact("real_link", lambda: backend == "gpu" and _mesh_axis(axis_name, mesh))
    found = fact("link", lambda: _link(link, axis_name, mesh, real))
    peers = fact(
        "peer_stores", lambda: real and found == "nvlink" and _peers_reachable(axis_name, mesh)
    )
    return Target(backend, hopper, triton_missing, real, found, peers)


def _hopper_device() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x)."""
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


@functools.cache
def _triton_missing() -> str | None:
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError as error:  # a JAX whose Pallas no longer has the Triton lowering
        return f"jax {jax.__version__} has no Pallas Triton lowering ({error})"
    return None


def _names(axis_name) -> tuple:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _mesh_axis(axis_name, mesh) -> bool:
    """Whether `axis_name` names `shard_map` mesh axes: of `mesh`, or manual in the trace."""
    if axis_name is None:
        return False
    axes = mesh.axis_names if mesh is not None else jax.sharding.get_abstract_mesh().manual_axes
    return all(name in axes for name in _names(axis_name))


def _link(link: str, axis_name, mesh, real: bool) -> str | None:
    """`Target.link`: found on a real link, and on another mesh axis where a table measured on
    this machine may be read (elsewhere no choice reads it: nothing to find or log)."""
    off_gpu = not real and _mesh_axis(axis_name, mesh) and policy.reads_link_off_gpu()
    return _resolve_link(link, axis_name, mesh) if real or off_gpu else None


def _resolve_link(link: str, axis_name, mesh) -> str:
    if mesh is not None and link == "auto":
        return policy.mesh_link(mesh, axis_name).name
    return policy.resolve_link(link, axis_name)


def _peers_reachable(axis_name, mesh) -> bool:
    """Whether peer stores reach the GPUs along `axis_name` (the link being NVLink): one mesh
    axis, one process, not PCIe cards, and the mesh in row-major device order where known."""
    return (
        isinstance(axis_name, str)
        and jax.process_count() == 1
        and "pcie" not in jax.devices()[0].device_kind.lower()
        and _in_device_order(mesh if mesh is not None else concrete_mesh())
    )


def _in_device_order(mesh) -> bool:
    """False if `mesh` is known and its devices are not 0, 1, ... in row-major order. Under
    `shard_map(mesh=...)` jax 0.11.2 does not expose the concrete mesh while tracing (only
    under `jax.set_mesh`); such a mesh must follow the rule itself, or Mosaic GPU refuses it
    when the program is compiled."""
    if mesh is None:
        return True
    ids = mesh.device_ids.ravel()
    return bool((ids == np.arange(ids.size)).all())
