"""Runs the per-device model three ways, and builds the jitted train / eval steps.

Parameter layout: every parameter is stored in its full (unsharded) shape, fp32, with logical axis
names; "vocab", "kv_heads", "heads" and "mlp" map to the TP mesh axis. The same arrays therefore
serve all three runners, and checkpoints are portable across TP sizes (orbax restores into
whatever `state_sharding` asks for):
  - shard_map over a ("dp", "tp") mesh: `NamedSharding(mesh, param_specs(cfg))` places each rank's
    shard; `shard_map` hands the per-device function local shards.
  - vmap emulation: `shard_params` splits each TP axis into (tp, local) with a free reshape and
    `jax.vmap(axis_name="tp", in_axes=that axis)` maps the ranks; `unshard_params` undoes it.
  - tp = 1: the per-device function with `TPContext()` (no collectives) is the unsharded model.

Gradient convention (docs/method.md, "Traps"): `value_and_grad` runs inside the per-device function,
every TP rank computes the same replicated loss, and the Megatron operators carry the TP
gradients; then `lax.pmean` over "dp". With sequence parallelism the replicated parameters (norms,
output biases, positions) see only T / tp positions per rank, so their gradients are summed over
TP (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models").
The optimizer runs outside the per-device function on the full, NamedSharding-placed arrays, so
global-norm clipping sees the whole gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax
from taco_models import layers, spmd
from taco_models.config import VOCAB_MULTIPLE, ModelConfig
from taco_models.layers import TPContext
from taco_models.model import Transformer

TP_LOGICAL_AXES = ("vocab", "kv_heads", "heads", "mlp")  # split across the TP axis
DP_AXIS = "dp"
DP_LEVELS = ("dp_inter", "dp_intra")  # dp in two levels: across groups (outer), within (inner)
COMPUTE_DTYPES = ("bfloat16", "float32", "float16")


PP_AXIS = "pp"
SCHEDULES = ("gpipe", "circular", "1f1b")
MODES = ("shard_map", "vmap", "emulate")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the model is laid out over devices.

    dp / tp: sizes of the mesh axes "dp" and "tp". mode "shard_map": dp x pp x tp devices; mode
    "vmap": TP emulated on each device with `jax.vmap(axis_name="tp")`, dp devices; mode
    "emulate": the whole (dp, pp, tp) mesh emulated on one device (`taco_models.spmd`: one vmap per
    mesh axis), for studying layouts with more ranks than devices. remat:
    recompute each block in the backward pass, keeping the TP collective outputs. scan_layers:
    one compiled block under `lax.scan` (fast compiles) or an unrolled loop. attention: "auto"
    (cuDNN flash attention for bf16 on GPU, XLA elsewhere; under vmap emulation cuDNN runs over
    the emulated ranks' batches merged, `layers.attention_over_vmapped_axes`), "xla" or "cudnn".
    pp, microbatches, schedule, repeats: pipeline stages along a "pp" mesh axis
    (`taco_models.pipeline`; shard_map or emulate), microbatches per dp rank and step, "gpipe",
    "circular" with `repeats` chunks per stage, or "1f1b" (activations of at most 2 pp - 1
    microbatches held per stage, whatever `microbatches`).
    dp_intra: dp ranks of one inner data-parallel group; with pp and tp under shard_map the
    group spans dp_intra x pp x tp consecutive devices (for one node: its GPUs / (pp tp)). Above
    1 the mesh splits "dp" into ("dp_inter", "dp_intra") (`dp_axes`), and SDP4Bit's gradient
    reduce-scatter (`compression.dp_grad="tlq_hs"`) runs in two levels: 8-bit codes within a
    group, 4-bit across (docs/method.md, "Data-parallel codecs").
    overlap_chunks: the blocks run each device's batch (each microbatch with pp) as this many
    independent chunks, so that XLA can run one chunk's TP collectives while it computes another
    chunk's matmuls (docs/method.md, "Overlapping TP collectives with compute": two chunks paid
    over host shared memory, compressed or not, and cost a few percent on NVLink).
    """

    dp: int = 1
    tp: int = 1
    mode: Literal["shard_map", "vmap", "emulate"] = "shard_map"
    sequence_parallel: bool = False
    remat: bool = False
    compute_dtype: str = "bfloat16"
    scan_layers: bool = True
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    pp: int = 1
    microbatches: int = 1
    schedule: Literal["gpipe", "circular", "1f1b"] = "gpipe"
    repeats: int = 1
    overlap_chunks: int = 1
    dp_intra: int = 1

    def __post_init__(self):
        if self.dp < 1 or self.tp < 1 or self.pp < 1:
            raise ValueError(f"dp={self.dp}, tp={self.tp} and pp={self.pp} must be >= 1")
        if self.dp_intra < 1 or self.dp % self.dp_intra:
            raise ValueError(f"dp_intra={self.dp_intra} must be >= 1 and divide dp={self.dp}")
        if self.overlap_chunks < 1:
            raise ValueError(f"overlap_chunks={self.overlap_chunks} must be >= 1")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is not one of {COMPUTE_DTYPES}")
        if self.attention not in ("auto", "xla", "cudnn"):
            raise ValueError(f"attention={self.attention!r} must be 'auto', 'xla' or 'cudnn'")
        self._check_pipeline()

    def _check_pipeline(self):
        if self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches} must be >= 1")
        if self.pp == 1 and self.microbatches > 1:
            raise ValueError(
                f"microbatches={self.microbatches} splits pipeline steps: needs pp > 1"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}")
        if self.schedule != "circular" and self.repeats != 1:
            raise ValueError(f"repeats={self.repeats} needs schedule='circular'")
        if self.schedule == "circular" and (self.repeats < 2 or self.microbatches < self.pp):
            raise ValueError(
                f"schedule='circular' needs repeats >= 2 (got {self.repeats}) and microbatches "
                f">= pp (got microbatches={self.microbatches}, pp={self.pp})"
            )
        if self.pp > 1 and self.mode == "vmap":
            raise ValueError(
                f"pipelining (pp={self.pp}) runs with mode 'shard_map' or 'emulate', not "
                f"mode={self.mode!r}"
            )

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """The data-parallel mesh axes: ("dp",), or the two levels (outer, inner) with
        dp_intra > 1."""
        return DP_LEVELS if self.dp_intra > 1 else (DP_AXIS,)

    @property
    def dp_axis(self) -> str | tuple[str, ...]:
        """`dp_axes` as the dp collectives, the batch's and the sharded state's specs name it."""
        return self.dp_axes if self.dp_intra > 1 else DP_AXIS

    @property
    def dp_shape(self) -> tuple[int, ...]:
        """Sizes of the mesh axes of `dp_axis`."""
        return (self.dp // self.dp_intra, self.dp_intra) if self.dp_intra > 1 else (self.dp,)

    @property
    def num_devices(self) -> int:
        return {"shard_map": self.dp * self.pp * self.tp, "vmap": self.dp, "emulate": 1}[self.mode]

    @property
    def pipeline_steps(self) -> int:
        """Steps of the pipeline schedule: M V + P - 1."""
        return self.microbatches * self.repeats + self.pp - 1

    @property
    def bubble_fraction(self) -> float:
        """The idle share of each stage's steps: (P - 1) / (M V + P - 1); for 1F1B as for
        GPipe (its P - 1 forward-only and P - 1 backward-only ticks cost P - 1 whole steps)."""
        return (self.pp - 1) / self.pipeline_steps


def check_config(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Raises ValueError naming the value when `model` cannot be split `parallel.tp` ways (and
    staged pp x repeats ways)."""
    chunks = parallel.pp * parallel.repeats
    if model.n_layers % chunks:
        raise ValueError(
            f"model.n_layers={model.n_layers} is not a multiple of pp x repeats={chunks}"
        )
    tp = parallel.tp
    for name, size in (
        ("n_kv_heads", model.n_kv_heads),
        ("n_heads", model.n_heads),
        ("d_ff", model.d_ff),
    ):
        if size % tp:
            raise ValueError(f"model.{name}={size} is not a multiple of parallel.tp={tp}")
    if model.padded_vocab % tp:
        fits = math.lcm(VOCAB_MULTIPLE, tp)  # a vocabulary of a multiple of it pads to a split
        raise ValueError(
            f"model.vocab_size={model.vocab_size} is padded to {model.padded_vocab} rows (a "
            f"multiple of {VOCAB_MULTIPLE}), which parallel.tp={tp} does not split: set "
            f"model.vocab_size to a multiple of {fits} (e.g. "
            f"{math.ceil(model.vocab_size / fits) * fits}) or parallel.tp to a divisor of "
            f"{model.padded_vocab}"
        )
    if parallel.sequence_parallel and model.seq_len % tp:
        raise ValueError(
            f"parallel.sequence_parallel splits model.seq_len={model.seq_len}, which is not a "
            f"multiple of parallel.tp={tp}"
        )


# --------------------------------------------------------------------------------------------
# Parameters: creation, logical axes, shardings, vmap layout.


def create_model(model: ModelConfig, key: jax.Array) -> Transformer:
    return Transformer(model, rngs=nnx.Rngs(params=key))


def init_params(model: ModelConfig, key: jax.Array) -> dict:
    """Full fp32 parameters as a nested dict of arrays; independent of any parallel layout."""
    return nnx.to_pure_dict(nnx.state(create_model(model, key), nnx.Param))


@functools.cache
def _abstract(model: ModelConfig):
    abstract = nnx.eval_shape(lambda: create_model(model, jax.random.key(0)))
    graphdef, state = nnx.split(abstract)
    return graphdef, state


def graphdef(model: ModelConfig):
    return _abstract(model)[0]


def abstract_params(model: ModelConfig) -> dict:
    """`jax.ShapeDtypeStruct`s of `init_params` (no computation)."""
    return nnx.to_pure_dict(_abstract(model)[1])


def logical_axes(model: ModelConfig) -> dict:
    """Logical axis names of every parameter; the stacked blocks gain a leading "layers"."""
    flat = {}
    for path, var in nnx.to_flat_state(_abstract(model)[1]):
        axes = var.get_metadata("axes")
        flat[path] = ("layers", *axes) if path[0] == "blocks" else axes
    return _unflatten(flat)


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _tp_dim(axes: tuple) -> int | None:
    dims = [i for i, name in enumerate(axes) if name in TP_LOGICAL_AXES]
    if len(dims) > 1:
        raise ValueError(f"parameter axes {axes} split more than one axis across TP")
    return dims[0] if dims else None


def _map_axes(fn, model: ModelConfig, *trees):
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)
    return jax.tree.map(fn, logical_axes(model), *trees, is_leaf=is_axes)


def param_specs(model: ModelConfig, tp_axis: str = "tp") -> dict:
    """PartitionSpecs of the full parameters over a mesh with a `tp_axis` axis."""
    return _map_axes(
        lambda axes: P(*(tp_axis if name in TP_LOGICAL_AXES else None for name in axes)), model
    )


def replicated_mask(model: ModelConfig) -> dict:
    """True for parameters that every TP rank holds whole (norms, output biases, positions)."""
    return _map_axes(lambda axes: _tp_dim(axes) is None, model)


def weight_decay_mask(model: ModelConfig) -> dict:
    """True for weight matrices and embeddings (decayed), False for norms and biases, as in
    GPT-3 and Megatron-LM. Weights are the parameters named `w*` or `lm_head`."""
    flat = {
        path: path[-1].startswith("w") or path[-1] == "lm_head"
        for path, _ in nnx.to_flat_state(_abstract(model)[1])
    }
    return _unflatten(flat)


def shard_params(params: dict, model: ModelConfig, tp: int) -> tuple[dict, dict]:
    """Full params -> (TP view, vmap in_axes): each TP axis of size n becomes (tp, n / tp) at the
    same position (a free reshape), and in_axes names that position; replicated leaves keep
    their shape with in_axes None. `jax.vmap(f, in_axes=(in_axes,), axis_name="tp")` then gives
    rank r the shard that `NamedSharding(mesh, param_specs(model))` puts on TP rank r."""

    def split(axes, x):
        dim = _tp_dim(axes)
        if dim is None:
            return x
        return x.reshape(x.shape[:dim] + (tp, x.shape[dim] // tp) + x.shape[dim + 1 :])

    return _map_axes(split, model, params), _map_axes(_tp_dim, model)


def unshard_params(stacked: dict, model: ModelConfig, tp: int) -> dict:
    """Inverse of `shard_params` for per-rank outputs of vmap (out_axes = `vmap_out_axes`):
    TP axes are merged back; replicated leaves, identical on every rank, keep rank 0's copy."""

    def merge(axes, x):
        dim = _tp_dim(axes)
        if dim is None:
            return x[0]
        return x.reshape(x.shape[:dim] + (tp * x.shape[dim + 1],) + x.shape[dim + 2 :])

    return _map_axes(merge, model, stacked)


def tp_split_dims(model: ModelConfig) -> dict:
    """Per parameter, the axis TP splits, or -1 where every TP rank holds it whole."""
    return _map_axes(lambda axes: -1 if _tp_dim(axes) is None else _tp_dim(axes), model)


def vmap_out_axes(model: ModelConfig) -> dict:
    """vmap out_axes for per-rank parameter-shaped outputs (gradients): see `unshard_params`."""
    return _map_axes(lambda axes: 0 if _tp_dim(axes) is None else _tp_dim(axes), model)


# --------------------------------------------------------------------------------------------
# The per-device function and its three runners.


def _context(parallel: ParallelConfig, comm: taco_jax.TPComm | None) -> TPContext:
    emulated = parallel.mode in ("emulate", "vmap")  # "vmap" wraps the ranks even at tp = 1
    return TPContext(
        comm,
        parallel.sequence_parallel,
        jnp.dtype(parallel.compute_dtype),
        parallel.attention,
        parallel.overlap_chunks,
        ranks_vmapped=emulated,
    )


def _logits(model, parallel, ctx, params, inputs):  # inputs [B, T] -> [B, T, V_local]
    net = nnx.merge(graphdef(model), params)
    return net(inputs, ctx, remat=parallel.remat, scan_layers=parallel.scan_layers)


def _loss(model, parallel, ctx, params, tokens):  # tokens [B, T + 1] -> replicated scalar
    logits = _logits(model, parallel, ctx, params, tokens[:, :-1])
    return layers.vocab_parallel_cross_entropy(logits, tokens[:, 1:], ctx, model.vocab_size)


def _loss_and_grads(model, parallel, ctx, params, tokens):
    loss_fn = lambda p: _loss(model, parallel, ctx, p, tokens)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    if ctx.sharded and ctx.sequence_parallel:
        axis = ctx.comm.axis_name
        grads = jax.tree.map(
            lambda g, rep: lax.psum(g, axis) if rep else g, grads, replicated_mask(model)
        )
    return loss, grads


def check_tokens(model: ModelConfig, parallel: ParallelConfig, tokens: jax.Array) -> None:
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [global_batch, seq_len + 1], got shape={tokens.shape}")
    if tokens.shape[0] % parallel.dp:
        raise ValueError(f"global batch {tokens.shape[0]} is not a multiple of dp={parallel.dp}")
    t = tokens.shape[1] - 1
    if t > model.seq_len:
        raise ValueError(f"sequence length {t} exceeds model.seq_len={model.seq_len}")
    if parallel.sequence_parallel and t % parallel.tp:
        raise ValueError(f"sequence parallelism needs T={t} to be a multiple of tp={parallel.tp}")


def check_devices(parallel: ParallelConfig) -> None:
    """Raises ValueError, with the ways out, when fewer devices are visible than `parallel` uses."""
    n, visible = parallel.num_devices, jax.device_count()
    if n > visible:
        raise ValueError(
            f"parallel.dp={parallel.dp} x pp={parallel.pp} x tp={parallel.tp} "
            f"(mode={parallel.mode}) needs {n} "
            f"devices, {visible} visible; on a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting, or emulate "
            "the ranks on one device with parallel.mode=emulate (TP alone: parallel.mode=vmap)"
        )


def mesh_axes(parallel: ParallelConfig, tp_axis: str = "tp") -> dict[str, int]:
    """The mesh's axes, name -> size: ("dp", tp_axis), ("dp", "pp", tp_axis) with pipeline
    stages, or ("dp",) with TP under vmap; "dp" is ("dp_inter", "dp_intra") where
    `parallel.dp_intra` > 1 (an inner group: dp_intra dp ranks, whose dp_intra x pp x tp
    devices are consecutive)."""
    axes = dict(zip(parallel.dp_axes, parallel.dp_shape, strict=True))
    if parallel.mode != "vmap" and parallel.pp > 1:
        axes[PP_AXIS] = parallel.pp
    if parallel.mode != "vmap":
        axes[tp_axis] = parallel.tp
    return axes


def make_mesh(parallel: ParallelConfig, tp_axis: str = "tp") -> jax.sharding.Mesh:
    """The mesh of `mesh_axes` over its devices; under mode "emulate" over one device, every
    axis of size 1 (`spmd_map` emulates the sizes).

    The devices in id order, row-major: the order `jax.make_mesh` gives GPUs and CPUs, in which
    JAX numbers the devices host by host, so that the last axes (TP, then the stages) stay
    inside a host. Built directly, because `jax.make_mesh` refuses devices of several hosts
    (JAX numbers each host's GPUs as a "slice" and refuses multi-slice meshes)."""
    check_devices(parallel)
    devices = sorted(jax.devices(), key=lambda d: d.id)[: parallel.num_devices]
    axes = mesh_axes(parallel, tp_axis)
    names = tuple(axes)
    shape = (1,) * len(axes) if parallel.mode == "emulate" else tuple(axes.values())
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names, axis_types=auto)


def spmd_map(parallel: ParallelConfig, f, *, mesh: jax.sharding.Mesh, in_specs, out_specs):
    """`jax.shard_map(f, mesh=mesh, ..., check_vma=False)`, or under mode "emulate" its
    emulation on one device with the sizes the layout gives `mesh`'s axes (`taco_models.spmd`)."""
    if parallel.mode != "emulate":
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    sizes = mesh_axes(parallel, mesh.axis_names[-1])  # `make_mesh`'s axes: the last is TP's
    if tuple(sizes) != mesh.axis_names:
        raise ValueError(
            f"mesh axes {mesh.axis_names} are not the layout's "
            f"{tuple(sizes)} (make_mesh builds them)"
        )
    return spmd.emulated_shard_map(f, axis_sizes=sizes, in_specs=in_specs, out_specs=out_specs)


def _mapped(model, parallel, comm, fn, out_kind: str, mesh):
    """Maps a per-device `fn(ctx, params, tokens)` over TP and DP.

    out_kind: "loss" (a replicated scalar, pmean over dp), "loss_grads" (scalar and parameter
    gradients, pmean over dp), "loss_local_grads" (the scalar pmean over dp, every dp rank's
    own gradients stacked on a leading dp axis) or "logits" ([B, T, V] with V gathered over TP,
    B over dp). Returns a function of (full params, tokens) usable under jit.
    """
    ctx = _context(parallel, comm)
    dp = parallel.dp_axis
    tp_axis = comm.axis_name
    specs = param_specs(model, tp_axis)

    def dp_reduce(out):
        if out_kind == "logits":
            return out
        if out_kind == "loss_local_grads":
            loss, grads = out
            return lax.pmean(loss, dp), jax.tree.map(lambda g: g[None], grads)
        return jax.tree.map(lambda x: lax.pmean(x, dp), out)

    if parallel.mode != "vmap":
        out_specs = {
            "loss": P(),
            "loss_grads": (P(), specs),
            "loss_local_grads": (P(), jax.tree.map(lambda spec: P(dp, *spec), specs)),
            "logits": P(dp, None, tp_axis),
        }[out_kind]
        return spmd_map(
            parallel,
            lambda params, tokens: dp_reduce(fn(ctx, params, tokens)),
            mesh=mesh,
            in_specs=(specs, P(dp)),
            out_specs=out_specs,
        )

    tp = parallel.tp
    grad_axes = (0, vmap_out_axes(model))
    out_axes = {"loss": 0, "loss_grads": grad_axes, "loss_local_grads": grad_axes, "logits": 2}[
        out_kind
    ]

    def per_dp(params, tokens):
        view, in_axes = shard_params(params, model, tp)
        out = jax.vmap(
            lambda p, t: fn(ctx, p, t),
            in_axes=(in_axes, None),
            out_axes=out_axes,
            axis_name=tp_axis,
        )(view, tokens)
        if out_kind == "loss":
            out = out[0]
        elif out_kind in ("loss_grads", "loss_local_grads"):
            out = (out[0][0], unshard_params(out[1], model, tp))
        else:  # [B, T, tp, V_local] -> [B, T, V]
            out = out.reshape(out.shape[:2] + (-1,))
        return dp_reduce(out)

    out_specs = {"logits": P(dp), "loss_local_grads": (P(), P(dp))}.get(out_kind, P())
    return jax.shard_map(
        per_dp, mesh=mesh, in_specs=(P(), P(dp)), out_specs=out_specs, check_vma=False
    )


def _runner(model, parallel, comm, mesh, per_device, out_kind: str):
    """`_mapped` of `per_device(model, parallel, ctx, params, tokens)` over `mesh` (default
    `make_mesh`), after checking that the model splits `parallel.tp` ways."""
    check_config(model, parallel)
    if parallel.pp > 1:
        raise ValueError(f"pp={parallel.pp}: pipelined runs are taco_models.pipeline's")
    mesh = make_mesh(parallel, comm.axis_name) if mesh is None else mesh
    fn = lambda ctx, p, t: per_device(model, parallel, ctx, p, t)
    return _mapped(model, parallel, comm, fn, out_kind, mesh)


def make_loss_and_grads(
    model: ModelConfig, parallel: ParallelConfig, comm: taco_jax.TPComm, mesh=None
) -> Callable[[dict, jax.Array], tuple[jax.Array, dict]]:
    """(full params, tokens [B, T + 1]) -> (mean loss, full-layout gradients averaged over dp).
    Not jitted; place inputs with `NamedSharding`s over `mesh` (default `make_mesh`)."""
    return _runner(model, parallel, comm, mesh, _loss_and_grads, "loss_grads")


def make_loss_and_local_grads(
    model: ModelConfig, parallel: ParallelConfig, comm: taco_jax.TPComm, mesh=None
) -> Callable[[dict, jax.Array], tuple[jax.Array, dict]]:
    """(full params, tokens) -> (mean loss, each dp rank's own full-layout gradients of its
    share of the batch, stacked on a leading dp axis): for a sharded optimizer that averages
    them itself (`taco_train.zero`). Not jitted."""
    return _runner(model, parallel, comm, mesh, _loss_and_grads, "loss_local_grads")


def make_loss(
    model: ModelConfig, parallel: ParallelConfig, comm: taco_jax.TPComm, mesh=None
) -> Callable[[dict, jax.Array], jax.Array]:
    """(full params, tokens [B, T + 1]) -> mean loss over the global batch. Not jitted."""
    return _runner(model, parallel, comm, mesh, _loss, "loss")


def make_logits(
    model: ModelConfig, parallel: ParallelConfig, comm: taco_jax.TPComm, mesh=None
) -> Callable[[dict, jax.Array], jax.Array]:
    """(full params, inputs [B, T]) -> logits [B, T, padded_vocab] of the TP model. Not jitted."""
    return _runner(model, parallel, comm, mesh, _logits, "logits")


def reference_logits(model: ModelConfig, params: dict, inputs: jax.Array, dtype="float32"):
    """The unsharded model: logits [B, T, padded_vocab] with no collectives at all."""
    parallel = ParallelConfig(compute_dtype=dtype)
    return _logits(model, parallel, _context(parallel, None), params, inputs)


def reference_loss_and_grads(model: ModelConfig, params: dict, tokens: jax.Array, dtype="float32"):
    """The unsharded model's loss and gradients."""
    parallel = ParallelConfig(compute_dtype=dtype)
    return _loss_and_grads(model, parallel, _context(parallel, None), params, tokens)
