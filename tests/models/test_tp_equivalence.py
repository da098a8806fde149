"""The TP model equals the unsharded model: logits, loss and every parameter gradient.

Runs on 8 fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`), under
`shard_map` over a ("dp", "tp") mesh and under `jax.vmap(axis_name="tp")` emulation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerances import BATCH, exact_tolerance

import taco_jax
from taco_models import (
    ModelConfig,
    ParallelConfig,
    init_params,
    make_logits,
    make_loss_and_grads,
    reference_logits,
    reference_loss_and_grads,
)

# Taco tolerance. One E4M3 rounding (3 mantissa bits, round to nearest) has relative error
# uniform in +-2^-4 / m for mantissa m in [1, 2); with m log-uniform, E[1/m^2] = 3 / (8 ln 2),
# so its RMS is 2^-4 sqrt(E[1/m^2] / 3) = 0.0265. The Hadamard rotation is orthonormal and the
# per-group scales cancel, so a group's relative L2 error is the same. The two-shot all-reduce
# rounds twice (partials, then the sum): EPS_ALLREDUCE = sqrt(2) x 0.0265 = 0.0375 of its output.
# (Corroborated by taco_jax.telemetry on this model: 0.025-0.026 per reduce-scatter / all-gather,
# 0.035-0.036 per all-reduce.)
EPS_E4M3_RMS = 2.0**-4 * math.sqrt(3 / (8 * math.log(2)) / 3)
EPS_ALLREDUCE = math.sqrt(2) * EPS_E4M3_RMS


def _taco_tolerances(cfg: ModelConfig) -> tuple[float, float]:
    """(logits, gradients) relative-L2 tolerances with every TP collective compressed.

    Each compressed collective adds an independent error of relative size EPS_ALLREDUCE to a
    contribution no larger than the residual stream (at init), so C of them on the path to an
    output add in quadrature: EPS_ALLREDUCE sqrt(C). Logits: the embedding's g plus two per
    block, C = 2 L + 1. Gradients see those plus the backward all-reduces of the f operators
    (two per block plus the head): C = 2 (2 L + 1).
    """
    c_fwd = 2 * cfg.n_layers + 1
    return EPS_ALLREDUCE * math.sqrt(c_fwd), EPS_ALLREDUCE * math.sqrt(2 * c_fwd)


def _tokens(cfg: ModelConfig, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (BATCH, cfg.seq_len + 1), 0, cfg.vocab_size)


def _run_tp(cfg, parallel, comm, params, tokens):
    """(logits, loss, grads) of the TP model in one compiled function."""
    logits_fn = make_logits(cfg, parallel, comm)
    grads_fn = make_loss_and_grads(cfg, parallel, comm)
    return jax.jit(lambda p, t: (logits_fn(p, t[:, :-1]), *grads_fn(p, t)))(params, tokens)


def _run_reference(cfg, params, tokens):
    def fn(p, t):
        return (reference_logits(cfg, p, t[:, :-1]), *reference_loss_and_grads(cfg, p, t))

    return jax.jit(fn)(params, tokens)


@pytest.fixture(scope="module")
def reference_cache():
    return {}


def _reference(cache, cfg):
    if cfg not in cache:
        params = init_params(cfg, jax.random.key(0))
        tokens = _tokens(cfg)
        cache[cfg] = (params, tokens, _run_reference(cfg, params, tokens))
    return cache[cfg]


def _normwise_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _relative_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _needs_devices(n: int):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices; set XLA_FLAGS=--xla_force_host_platform_device_count=8")


GPT_VOCAB_200 = ModelConfig.preset("gpt_tiny", vocab_size=200)  # padded to 256: masked columns
GPT = ModelConfig.preset("gpt_tiny")
QWEN = ModelConfig.preset("qwen2_tiny")  # GQA: 8 query heads over 4 KV heads
LLAMA = ModelConfig.preset("llama_tiny")  # no QKV bias, "llama3" rotary scaling

# Every TP size under both runners, SP on and off under both, and GQA under both.
SLOW = pytest.mark.slow  # > ~10 s each on the 2-core CPU: the slow tier
# The fast tier keeps one vmap case (shard_map with sequence parallelism, 16 s on two cores, is
# slow's; the compressed test below runs shard_map in the fast tier).
EXACT_CASES = [
    pytest.param("shard_map", 2, False, GPT, {}, marks=SLOW),
    pytest.param("shard_map", 4, True, GPT, {}, marks=SLOW),
    pytest.param("shard_map", 8, False, GPT_VOCAB_200, {}, marks=SLOW),
    pytest.param("vmap", 2, True, GPT_VOCAB_200, {}, marks=SLOW),
    ("vmap", 4, False, GPT, {}),
    pytest.param("vmap", 8, True, GPT, {}, marks=SLOW),
    pytest.param("shard_map", 4, False, QWEN, {}, marks=SLOW),
    pytest.param("vmap", 2, True, QWEN, {}, marks=SLOW),
    pytest.param("vmap", 4, True, LLAMA, {}, marks=SLOW),
]


# The batch split into independent chunks through the blocks (compute / communication overlap):
# the same function, so the same tolerance; with and without scanned layers.
CHUNKED_CASES = [
    pytest.param("shard_map", 2, True, GPT, dict(overlap_chunks=2), marks=SLOW),
    pytest.param("vmap", 4, False, QWEN, dict(overlap_chunks=2, scan_layers=False), marks=SLOW),
]


@pytest.mark.parametrize(("mode", "tp", "sp", "cfg", "layout"), EXACT_CASES + CHUNKED_CASES)
def test_uncompressed_tp_equals_unsharded(reference_cache, mode, tp, sp, cfg, layout):
    _needs_devices(tp if mode == "shard_map" else 1)
    params, tokens, (ref_logits, ref_loss, ref_grads) = _reference(reference_cache, cfg)
    parallel = ParallelConfig(
        tp=tp, mode=mode, sequence_parallel=sp, compute_dtype="float32", **layout
    )
    comm = taco_jax.TPComm.create("tp", fwd="none")
    logits, loss, grads = _run_tp(cfg, parallel, comm, params, tokens)
    tol = exact_tolerance(cfg)
    assert _normwise_error(logits, ref_logits) <= tol
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
    errors = jax.tree.map(_normwise_error, grads, ref_grads)
    worst = max(jax.tree_util.tree_leaves_with_path(errors), key=lambda kv: kv[1])
    assert worst[1] <= tol, f"gradient {jax.tree_util.keystr(worst[0])}: {worst[1]:.3g} > {tol:.3g}"


def test_reference_loss_is_cross_entropy_over_unpadded_vocab(reference_cache):
    params, tokens, (logits, loss, _) = _reference(reference_cache, GPT_VOCAB_200)
    expected = optax.softmax_cross_entropy_with_integer_labels(
        logits[..., : GPT_VOCAB_200.vocab_size], tokens[:, 1:]
    ).mean()
    assert abs(float(loss) - float(expected)) <= exact_tolerance(GPT_VOCAB_200) * float(expected)


@pytest.mark.parametrize(
    ("mode", "sp", "cfg", "chunks"),
    [
        ("shard_map", False, GPT, 1),
        pytest.param("vmap", True, QWEN, 1, marks=SLOW),
        pytest.param("shard_map", False, GPT, 2, marks=SLOW),
    ],
)
def test_taco_tp_close_to_unsharded(reference_cache, mode, sp, cfg, chunks):
    _needs_devices(4 if mode == "shard_map" else 1)
    params, tokens, (ref_logits, ref_loss, ref_grads) = _reference(reference_cache, cfg)
    parallel = ParallelConfig(
        tp=4, mode=mode, sequence_parallel=sp, compute_dtype="float32", overlap_chunks=chunks
    )
    comm = taco_jax.TPComm.create("tp", fwd="taco", impl="xla")
    logits, loss, grads = _run_tp(cfg, parallel, comm, params, tokens)
    tol_logits, tol_grads = _taco_tolerances(cfg)
    logits_error = _relative_l2(logits, ref_logits)
    assert logits_error <= tol_logits
    # The codec really rounds to FP8 (docs/method.md "Traps": XLA may elide an f32 -> f8 -> f32
    # round trip): at least a quarter of one all-reduce's expected error reaches the logits.
    assert logits_error >= EPS_ALLREDUCE / 4
    # Cross-entropy's gradient in the logits, softmax - onehot, has L1 norm <= 2, so the loss
    # moves by at most 2 max|dlogits| (mean value theorem); plus fp32 slack.
    max_dz = float(np.max(np.abs(np.asarray(logits) - np.asarray(ref_logits))))
    slack = exact_tolerance(cfg) * float(ref_loss)
    assert abs(float(loss) - float(ref_loss)) <= 2 * max_dz + slack
    errors = jax.tree.map(_relative_l2, grads, ref_grads)
    worst = max(jax.tree_util.tree_leaves_with_path(errors), key=lambda kv: kv[1])
    assert worst[1] <= tol_grads, f"{jax.tree_util.keystr(worst[0])}: {worst[1]:.3g}"


def test_vmap_rank_view_matches_named_sharding_shards():
    from taco_models.parallel import make_mesh, param_specs, shard_params

    _needs_devices(4)
    cfg, tp = QWEN, 4
    params = init_params(cfg, jax.random.key(0))
    view, in_axes = shard_params(params, cfg, tp)
    mesh = make_mesh(ParallelConfig(tp=tp))
    specs = param_specs(cfg)
    placed = jax.device_put(params, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs))
    for leaf, v, axis in zip(
        jax.tree.leaves(placed),
        jax.tree.leaves(view),
        jax.tree.leaves(in_axes, is_leaf=lambda x: x is None),
        strict=True,
    ):
        for shard in leaf.addressable_shards:
            rank = mesh.devices.tolist()[0].index(shard.device)
            expected = v if axis is None else jnp.take(v, rank, axis=axis)
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(expected))


def test_the_mesh_is_the_devices_in_order_whatever_hosts_they_are_on(monkeypatch):
    """(dp, tp) row-major over the devices in id order (JAX numbers them host by host, so TP
    stays inside a host), without `jax.make_mesh`, which refuses GPUs of several hosts."""
    from taco_models.parallel import make_mesh

    _needs_devices(8)
    refuse = lambda *args, **kwargs: pytest.fail("jax.make_mesh refuses several hosts")  # noqa: E731
    monkeypatch.setattr(jax, "make_mesh", refuse)
    mesh = make_mesh(ParallelConfig(dp=2, tp=4))
    assert mesh.axis_names == ("dp", "tp") and mesh.devices.shape == (2, 4)
    assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in jax.devices())[:8]


def test_overlap_chunks_must_divide_the_batch():
    params = init_params(GPT, jax.random.key(0))
    parallel = ParallelConfig(tp=2, mode="vmap", overlap_chunks=3)
    comm = taco_jax.TPComm.create("tp", fwd="none")
    with pytest.raises(ValueError, match=r"overlap_chunks=3 .* per-device batch 4"):
        make_loss_and_grads(GPT, parallel, comm)(params, _tokens(GPT)[:4])
    with pytest.raises(ValueError, match="overlap_chunks=0"):
        ParallelConfig(overlap_chunks=0)
