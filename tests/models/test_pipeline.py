"""The pipelined model (GPipe, circular and 1F1B schedules over "pp", with TP and DP in one
shard_map, or that mesh emulated on one device) equals the unsharded model: loss and every
parameter gradient, uncompressed in fp32; within derived bounds with each stage codec. 8 fake
CPU devices.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import numpy as np
import pytest
from tolerances import BATCH, exact_tolerance

import taco_jax
from taco_models import ModelConfig, ParallelConfig, init_params, reference_loss_and_grads
from taco_models.pipeline import (
    StageCodecs,
    _SavedForward,
    from_stages,
    make_pipeline_loss,
    make_pipeline_loss_and_grads,
    pp_replicated_mask,
    to_stages,
)

GPT = ModelConfig.preset("gpt_tiny", n_layers=4)  # tied embeddings: the first and last stage
GPT8 = ModelConfig.preset("gpt_tiny", n_layers=8)  # circular: pp x repeats chunks
QWEN = ModelConfig.preset("qwen2_tiny", n_layers=4)
KEY = jax.random.key(3)

# Per-send relative error of each stage codec (RMS error / RMS of the values), for groups of
# N(0, 1)-like activations. Stochastic rounding to a grid of step q has error variance <= q^2/4.
# tahquant (asymmetric INT8, G = 128): q = range / 255, E[range] ~ 5.2 sigma -> 0.0102;
# tahquant4 (symmetric INT4, G = 32): q = absmax / 7, E[absmax] ~ 2.2 sigma -> 0.157;
# taco: one E4M3 rounding, RMS 0.0265 (tests/models/test_tp_equivalence.py);
# int8_hadamard: round to nearest, q = absmax / 127 after the Hadamard (~2.6 sigma) -> 0.0059.
# A factor 2 covers groups whose range is twice the Gaussian one (activations are not Gaussian).
EPS_SEND = {"tahquant": 0.0102, "tahquant4": 0.157, "taco": 0.0265, "int8_hadamard": 0.0059}
MARGIN = 2.0


def _tokens(cfg, seed=1):
    return jax.random.randint(jax.random.key(seed), (BATCH, cfg.seq_len + 1), 0, cfg.vocab_size)


def _needs_devices(n):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices; set XLA_FLAGS=--xla_force_host_platform_device_count=8")


def _parallel(dp, pp, tp, microbatches, sp=False, repeats=1, mode="shard_map", schedule=None):
    schedule = schedule or ("circular" if repeats > 1 else "gpipe")
    return ParallelConfig(
        dp=dp,
        tp=tp,
        pp=pp,
        microbatches=microbatches,
        schedule=schedule,
        repeats=repeats,
        sequence_parallel=sp,
        compute_dtype="float32",
        mode=mode,
    )


def _run(
    cfg,
    dp,
    pp,
    tp,
    microbatches,
    codec="none",
    sp=False,
    key=None,
    repeats=1,
    shared_grads="none",
    mode="shard_map",
    schedule=None,
):
    _needs_devices(_parallel(dp, pp, tp, microbatches, sp, repeats, mode, schedule).num_devices)
    fn = _compiled(cfg, dp, pp, tp, microbatches, codec, sp, repeats, shared_grads, mode, schedule)
    return fn(init_params(cfg, jax.random.key(0)), _tokens(cfg), key)


@functools.cache
def _compiled(cfg, dp, pp, tp, microbatches, codec, sp, repeats, shared_grads, mode, schedule):
    """The jitted loss and gradients of one layout (tests that vary only the key share it)."""
    parallel = _parallel(dp, pp, tp, microbatches, sp, repeats, mode, schedule)
    comm = taco_jax.TPComm.create("tp", fwd="none")
    codecs = StageCodecs(codec, shared_grads=shared_grads)
    return jax.jit(make_pipeline_loss_and_grads(cfg, parallel, comm, codecs))


SLOW = pytest.mark.slow  # > ~10 s on the 2-core CPU: the slow tier


class _References(dict):
    """The unsharded loss and gradients of each model, computed when a test first asks (the
    fast tier needs GPT's only)."""

    def __missing__(self, cfg):
        params = init_params(cfg, jax.random.key(0))
        self[cfg] = jax.jit(lambda p: reference_loss_and_grads(cfg, p, _tokens(cfg)))(params)
        return self[cfg]


@pytest.fixture(scope="module")
def references():
    return _References()


def _normwise(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize(
    "cfg,dp,pp,tp,microbatches,sp,repeats,mode",
    [
        (GPT, 1, 2, 1, 1, False, 1, "shard_map"),
        pytest.param(GPT, 2, 2, 2, 2, False, 1, "shard_map", marks=SLOW),
        pytest.param(GPT, 1, 4, 2, 4, False, 1, "shard_map", marks=SLOW),
        pytest.param(GPT, 1, 4, 2, 1, True, 1, "shard_map", marks=SLOW),
        pytest.param(QWEN, 2, 2, 2, 1, False, 1, "shard_map", marks=SLOW),
        pytest.param(QWEN, 1, 2, 4, 4, True, 1, "shard_map", marks=SLOW),
        pytest.param(GPT8, 1, 2, 2, 2, False, 2, "shard_map", marks=SLOW),  # circular
        pytest.param(GPT8, 1, 4, 2, 4, True, 2, "shard_map", marks=SLOW),
        # M > P: microbatches wait in the store
        pytest.param(GPT8, 1, 2, 2, 4, False, 2, "shard_map", marks=SLOW),
        pytest.param(GPT8, 2, 2, 1, 2, False, 4, "shard_map", marks=SLOW),
        # The mesh emulated on one device (models/spmd.py), up to the paper's 16 ranks.
        pytest.param(GPT, 2, 2, 4, 2, True, 1, "emulate", marks=SLOW),
        pytest.param(GPT8, 1, 2, 2, 4, False, 2, "emulate", marks=SLOW),
    ],
)
def test_uncompressed_pipeline_equals_unsharded(
    references, cfg, dp, pp, tp, microbatches, sp, repeats, mode, check_replicas
):
    """Same function, reductions reassociated (TP partial sums, microbatch means, the psum of
    the tied embedding's two gradient parts): the fp32 bound of tests/tolerances.py. Emulated,
    every rank's copy of the replicated outputs must be the same bits too."""
    check_replicas(mode == "emulate")
    ref_loss, ref_grads = references[cfg]
    loss, grads = _run(cfg, dp, pp, tp, microbatches, sp=sp, repeats=repeats, mode=mode)
    tol = exact_tolerance(cfg)
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
    errors = jax.tree.map(_normwise, grads, ref_grads)
    worst = max(jax.tree_util.tree_leaves_with_path(errors), key=lambda kv: kv[1])
    assert worst[1] <= tol, f"gradient {jax.tree_util.keystr(worst[0])}: {worst[1]:.3g} > {tol:.3g}"


# Every codec at pp = 2; pp = 4 (three sends on each path) with the INT8 and INT4 stage codecs.
# Emulated on one device too: the stochastic codec's noise keyed per rank under vmap.
# All in the slow tier (12-14 s each); the fast tier sends stage codes in test_ppermute.py.
PP4_CASES = (
    ("tahquant", 4, "shard_map"),
    ("tahquant4", 4, "shard_map"),
    ("tahquant", 4, "emulate"),
)
STAGE_CASES = [pytest.param(codec, 2, "shard_map", marks=SLOW) for codec in sorted(EPS_SEND)]
STAGE_CASES += [pytest.param(*case, marks=SLOW) for case in PP4_CASES]


@pytest.mark.parametrize("codec,pp,mode", STAGE_CASES)
def test_stage_codecs_within_their_bound(references, codec, pp, mode):
    """P - 1 sends lie on each forward path and P - 1 on each backward path; independent errors
    add in quadrature: the gradients move by at most MARGIN EPS sqrt(2 (P - 1)) in relative L2.
    (The loss, a mean over many tokens of a smooth function, moves far less; not bounded here.)"""
    _, ref_grads = references[GPT]
    _, grads = _run(GPT, 1, pp, 2, 4 if pp == 4 else 2, codec=codec, key=KEY, mode=mode)
    eps = MARGIN * EPS_SEND[codec]
    err = np.linalg.norm(_flat(grads) - _flat(ref_grads)) / np.linalg.norm(_flat(ref_grads))
    assert 0 < err <= eps * math.sqrt(2 * (pp - 1))


@SLOW  # three pipelined runs (~16 s); the codec's own reproducibility is in the fast tier
def test_stochastic_stage_codec_is_reproducible_from_its_key():
    first = _run(GPT, 1, 2, 2, 2, codec="tahquant", key=KEY)
    again = _run(GPT, 1, 2, 2, 2, codec="tahquant", key=KEY)
    other = _run(GPT, 1, 2, 2, 2, codec="tahquant", key=jax.random.key(4))
    # The same program run twice on the same inputs (and key): deterministic, bit for bit.
    np.testing.assert_array_equal(_flat(first), _flat(again))
    assert not np.array_equal(_flat(first), _flat(other))


@pytest.mark.slow
def test_circular_with_a_stage_codec_within_its_bound(references):
    """The circular schedule sends every microbatch through P V - 1 stage boundaries (the wrap
    included): the bound of test_stage_codecs_within_their_bound with that many sends."""
    _, ref_grads = references[GPT8]
    _, grads = _run(GPT8, 1, 2, 2, 2, codec="tahquant", key=KEY, repeats=2)
    eps, sends = MARGIN * EPS_SEND["tahquant"], 2 * 2 - 1
    err = np.linalg.norm(_flat(grads) - _flat(ref_grads)) / np.linalg.norm(_flat(ref_grads))
    assert 0 < err <= eps * math.sqrt(2 * sends)


# One two-shot `taco` all-reduce (what the policy runs off a real link): each stage's part
# rounded once, the sum once more, each an E4M3 rounding after the Hadamard (which makes a
# group's values Gaussian-like whatever they were) of RMS 0.0265 of the group's norm
# (EPS_SEND). With parts of comparable norm that do not cancel: 0.0265 sqrt(2) of the sum's
# norm; MARGIN covers partial cancellation between the two stages' parts of the tied embedding
# (their norms' sum up to twice the sum's).
EPS_SHARED_SUM = MARGIN * EPS_SEND["taco"] * math.sqrt(2)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [GPT, QWEN], ids=["tied", "untied"])
def test_compressed_shared_gradient_sum(cfg):
    """`shared_grads` compresses only the sum over stages of the pp-replicated parameters'
    gradients: the loss and the blocks' gradients stay those of the exact pipeline (another
    program, so within `exact_tolerance`'s reassociation, not bit for bit), the others move
    by one compressed all-reduce's error (and do move)."""
    exact_loss, exact = _run(cfg, 1, 2, 2, 2)
    loss, grads = _run(cfg, 1, 2, 2, 2, shared_grads="taco")
    tol = exact_tolerance(cfg)
    assert abs(float(loss) - float(exact_loss)) <= tol * abs(float(exact_loss))
    for name in grads:
        if name == "blocks":
            a, b = _flat(grads[name]), _flat(exact[name])
            assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b)
            continue
        a, b = _flat(grads[name]), _flat(exact[name])
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert 0 < err <= EPS_SHARED_SUM, f"{name}: {err:.3g}"
        for leaf in jax.tree.leaves(grads[name]):  # every stage holds the same bytes
            replicas = {}
            for shard in leaf.addressable_shards:
                replicas.setdefault(str(shard.index), []).append(np.asarray(shard.data))
            for copies in replicas.values():
                assert len(copies) >= 2  # one per stage
                for other in copies[1:]:  # one program decoding the same bytes on each stage
                    np.testing.assert_array_equal(other, copies[0])


@pytest.mark.slow
def test_loss_only_equals_the_loss_of_loss_and_grads():
    _needs_devices(8)
    parallel = _parallel(2, 2, 2, 2)
    comm = taco_jax.TPComm.create("tp", fwd="none")
    params, tokens = init_params(GPT, jax.random.key(0)), _tokens(GPT)
    loss = jax.jit(make_pipeline_loss(GPT, parallel, comm))(params, tokens)
    with_grads = jax.jit(make_pipeline_loss_and_grads(GPT, parallel, comm))(params, tokens)[0]
    # Two programs computing one forward: equal within the reassociation `exact_tolerance`
    # allows (bit for bit where XLA happens to order both alike).
    assert abs(float(loss) - float(with_grads)) <= exact_tolerance(GPT) * abs(float(with_grads))


def test_stages_are_a_free_reshape_of_the_full_layout():
    parallel = _parallel(1, 2, 1, 2, repeats=2)
    params = init_params(GPT8, jax.random.key(0))
    staged = to_stages(params, GPT8, parallel)
    w = params["blocks"]["mlp"]["w_up"]  # [L, D, F]
    chunk = staged["blocks"]["mlp"]["w_up"]  # [V, P, L / 4, D, F]: chunk v P + p
    np.testing.assert_array_equal(chunk[1, 0], w[4:6])  # chunk 2: layers 4-5 on stage 0
    np.testing.assert_array_equal(_flat(from_stages(staged, GPT8)), _flat(params))


def test_bubble_fraction():
    assert _parallel(1, 4, 1, 8).bubble_fraction == 3 / 11
    assert _parallel(1, 4, 1, 8, repeats=2).bubble_fraction == 3 / 19
    assert _parallel(1, 1, 1, 1).bubble_fraction == 0


def test_errors_name_the_offending_value():
    with pytest.raises(ValueError, match="n_layers=4 is not a multiple of pp x repeats=3"):
        _run(GPT, 1, 3, 1, 1)
    with pytest.raises(ValueError, match="microbatches=3"):
        _run(GPT, 1, 2, 1, 3)
    with pytest.raises(ValueError, match="pass key="):
        _run(GPT, 1, 2, 1, 1, codec="tahquant")
    with pytest.raises(ValueError, match="microbatches >= pp"):
        _parallel(1, 4, 1, 2, repeats=2)
    with pytest.raises(ValueError, match="repeats=2 needs schedule='circular'"):
        ParallelConfig(pp=2, repeats=2)
    with pytest.raises(ValueError, match="schedule='zero_bubble'"):
        ParallelConfig(pp=2, schedule="zero_bubble")
    with pytest.raises(ValueError, match="repeats=2 needs schedule='circular'"):
        ParallelConfig(pp=2, repeats=2, microbatches=2, schedule="1f1b")
    with pytest.raises(ValueError, match="mode='vmap'"):
        ParallelConfig(tp=2, pp=2, mode="vmap")
    with pytest.raises(ValueError, match="needs 32 devices"):
        make_pipeline_loss_and_grads(
            GPT, ParallelConfig(dp=4, tp=4, pp=2), taco_jax.TPComm.create("tp")
        )


# 1F1B: each stage's forward and backward run explicitly (`jax.vjp` per microbatch, residuals in
# a ring of 2 P - 1 slots), not by differentiating the schedule.
@pytest.mark.parametrize(
    "cfg,dp,pp,tp,microbatches,sp,mode",
    [
        # M > 2 P - 1: slots are reused. Slow (~14 s): the fast tier keeps GPipe's equivalence
        # and 1F1B's memory test.
        pytest.param(GPT, 1, 2, 4, 4, False, "shard_map", marks=SLOW),
        pytest.param(QWEN, 1, 4, 2, 4, True, "shard_map", marks=pytest.mark.slow),  # untied
        pytest.param(GPT, 2, 2, 2, 2, True, "emulate", marks=SLOW),
    ],
)
def test_one_f_one_b_equals_unsharded(
    references, cfg, dp, pp, tp, microbatches, sp, mode, check_replicas
):
    """As test_uncompressed_pipeline_equals_unsharded: the same function with its reductions
    reassociated (microbatch gradients summed in the schedule's order), the fp32 bound."""
    check_replicas(mode == "emulate")
    ref_loss, ref_grads = references[cfg]
    loss, grads = _run(cfg, dp, pp, tp, microbatches, sp=sp, mode=mode, schedule="1f1b")
    tol = exact_tolerance(cfg)
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
    errors = jax.tree.map(_normwise, grads, ref_grads)
    worst = max(jax.tree_util.tree_leaves_with_path(errors), key=lambda kv: kv[1])
    assert worst[1] <= tol, f"gradient {jax.tree_util.keystr(worst[0])}: {worst[1]:.3g} > {tol:.3g}"


@pytest.mark.parametrize(
    "codec,pp,mode",
    [
        pytest.param("tahquant", 2, "shard_map", marks=SLOW),
        pytest.param("tahquant", 4, "emulate", marks=SLOW),
    ],
)
def test_one_f_one_b_stage_codecs_within_their_bound(references, codec, pp, mode):
    """1F1B sends each microbatch through the same P - 1 boundaries each way as GPipe: the
    bound of test_stage_codecs_within_their_bound."""
    _, ref_grads = references[GPT]
    _, grads = _run(GPT, 1, pp, 2, 4, codec=codec, key=KEY, mode=mode, schedule="1f1b")
    eps = MARGIN * EPS_SEND[codec]
    err = np.linalg.norm(_flat(grads) - _flat(ref_grads)) / np.linalg.norm(_flat(ref_grads))
    assert 0 < err <= eps * math.sqrt(2 * (pp - 1))


@pytest.mark.slow
def test_one_f_one_b_stochastic_sends_are_reproducible_from_their_key():
    first = _run(GPT, 1, 2, 2, 4, codec="tahquant", key=KEY, schedule="1f1b")
    again = _run(GPT, 1, 2, 2, 4, codec="tahquant", key=KEY, schedule="1f1b")
    other = _run(GPT, 1, 2, 2, 4, codec="tahquant", key=jax.random.key(4), schedule="1f1b")
    # The same program run twice on the same inputs (and key): deterministic, bit for bit.
    np.testing.assert_array_equal(_flat(first), _flat(again))
    assert not np.array_equal(_flat(first), _flat(other))


def _kept_residuals(monkeypatch, rows: int, remat: bool) -> list[jax.ShapeDtypeStruct]:
    """The leaves 1F1B keeps per microbatch in its ring, for microbatches of `rows` rows (bf16,
    tp = 2), traced without running."""
    found = []
    original = _SavedForward.of.__func__

    def record(cls, *args):
        saved = original(cls, *args)
        found.append(saved.kept)
        return saved

    monkeypatch.setattr(_SavedForward, "of", classmethod(record))
    parallel = ParallelConfig(tp=2, pp=2, microbatches=2, schedule="1f1b", remat=remat)
    _needs_devices(parallel.num_devices)
    fn = make_pipeline_loss_and_grads(GPT, parallel, taco_jax.TPComm.create("tp", fwd="none"))
    tokens = jax.ShapeDtypeStruct((2 * rows, GPT.seq_len + 1), np.int32)
    jax.eval_shape(fn, init_params(GPT, jax.random.key(0)), tokens)
    return found[0]


@pytest.mark.parametrize("remat", [False, True])
def test_one_f_one_b_keeps_activations_not_weights(monkeypatch, remat):
    """What a ring slot holds grows with the microbatch: bytes(rows) = a rows + c, where c is
    what does not scale with it. c must stay below one layer's weights in bf16 (kept, the
    forward's casts of the weights would put all the stage's there, per slot); what may sit in
    c is the attention's causal mask, [layers, heads, T, T] booleans."""
    size = lambda kept: sum(math.prod(s.shape) * s.dtype.itemsize for s in kept)  # noqa: E731
    one, two = (
        size(_kept_residuals(monkeypatch, 1, remat)),
        size(_kept_residuals(monkeypatch, 2, remat)),
    )
    constant = 2 * one - two
    layer = GPT.d_model * (4 * GPT.d_model + 2 * GPT.d_ff) // 2  # one TP rank's share
    assert 0 <= constant < 2 * layer  # bf16: 2 bytes per weight
    assert two > one


@pytest.mark.slow
def test_one_f_one_b_memory_does_not_grow_with_microbatches():
    """XLA's temporaries of the compiled 1F1B step (pp = 2, microbatches of one sequence, fp32)
    at M = 2 and M = 8: beyond the ring, which holds 2P - 1 microbatches at any M, only the
    first stage's embedded inputs [M, b, T, D] and their gradients may grow with M, 2 b T D
    fp32 values per microbatch (plus a microbatch's tokens); 1.5x for XLA's buffer assignment.
    Keeping every microbatch's residuals, as GPipe does, adds several times that per
    microbatch (on this CPU: 4.1 MB from M = 2 to 8 for GPipe)."""
    _needs_devices(2)
    comm = taco_jax.TPComm.create("tp", fwd="none")
    params = init_params(GPT, jax.random.key(0))

    def temporaries(m: int) -> int:
        parallel = ParallelConfig(pp=2, microbatches=m, schedule="1f1b", compute_dtype="float32")
        tokens = jax.ShapeDtypeStruct((m, GPT.seq_len + 1), np.int32)
        fn = jax.jit(make_pipeline_loss_and_grads(GPT, parallel, comm))
        return fn.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    added = 8 - 2
    per_microbatch = 2 * GPT.seq_len * GPT.d_model * 4 + 2 * (GPT.seq_len + 1) * 4
    assert temporaries(8) - temporaries(2) <= 1.5 * added * per_microbatch


def _computations(hlo: str) -> dict[str, str]:
    """The compiled HLO module's computations by name."""
    blocks = re.split(r"\n(?=\S)", hlo)
    return {m.group(1): b for b in blocks if (m := re.match(r"(?:ENTRY )?%?([\w.\-]+)", b))}


def _called(name: str, computations: dict[str, str], seen: set[str]) -> set[str]:
    """`name` and every computation it calls, transitively."""
    if name in seen or name not in computations:
        return seen
    seen.add(name)
    for callee in re.findall(r"%([\w.\-]+)", computations[name].split("\n", 1)[-1]):
        _called(callee, computations, seen)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("repeats", [1, 2], ids=["gpipe", "circular"])
def test_the_tables_gradient_is_not_computed_inside_the_schedules_loops(repeats):
    """The embedding runs before the schedule's steps and the head after them: no loop of the
    compiled step computes a value of the table's shape (its gradient's zero fill, scatter,
    matmul and sum at every step, as when both ran inside the steps). A vocabulary of 384 makes
    that shape, [384, 64], no other parameter's."""
    cfg = ModelConfig.preset("gpt_tiny", n_layers=4, vocab_size=384)
    parallel = _parallel(1, 2, 1, 4, repeats=repeats)
    _needs_devices(parallel.num_devices)
    fn = jax.jit(make_pipeline_loss_and_grads(cfg, parallel, taco_jax.TPComm.create("tp")))
    tokens = jax.ShapeDtypeStruct((4, cfg.seq_len + 1), np.int32)
    hlo = fn.lower(init_params(cfg, jax.random.key(0)), tokens).compile().as_text()
    computations = _computations(hlo)
    shape = rf"f32\[{cfg.padded_vocab},{cfg.d_model}\](?:\{{[^}}]*\}})?"
    passed_through = "parameter|get-tuple-element|tuple|copy"  # not computed: carried along
    table = re.compile(rf"= {shape} (?!{passed_through})[\w-]+\(")
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    assert bodies  # the schedule's steps are loops
    for body in bodies:
        inside = _called(body, computations, set())
        assert not any(table.search(computations[c]) for c in inside), body


@SLOW  # 20-35 s each
@pytest.mark.parametrize(
    "cfg,schedule,repeats", [(GPT, "gpipe", 1), (GPT, "1f1b", 1), (GPT8, "circular", 2)]
)
def test_each_site_reports_once_per_microbatch_and_rank_under_every_schedule(
    cfg, schedule, repeats
):
    """Measuring every collective of a pipelined step (pp = 2, tp = 2, M = 2): a layer's call
    site reports once per microbatch and TP rank (`SiteError.calls`), none dropped, none from
    the bubble steps (they compute and discard: their reports are dropped), none repeated by
    the backward; the stage sends report once per step of the schedule and rank (each step
    sends, bubble or not: M V + P - 1 steps a direction); the embedding and head once per rank
    of their stage (1F1B: the embedding runs again for its gradient, the head per
    microbatch); the stages' sum of the shared gradients once per shared leaf and rank."""
    pp, tp, m = 2, 2, 2
    _needs_devices(pp * tp)
    parallel = _parallel(1, pp, tp, m, repeats=repeats, schedule=schedule)
    comm = taco_jax.TPComm.create("tp", fwd="taco", telemetry=True)
    codecs = StageCodecs("tahquant", telemetry=True, shared_grads="taco")
    step = jax.jit(make_pipeline_loss_and_grads(cfg, parallel, comm, codecs))
    taco_jax.telemetry.drain()
    jax.block_until_ready(step(init_params(cfg, jax.random.key(0)), _tokens(cfg), KEY))
    calls = {site: e.calls for site, e in taco_jax.telemetry.drain().items()}
    one_f_one_b = schedule == "1f1b"
    steps = m * repeats + pp - 1
    sends = ("pp_send/fwd", "pp_send_grads/fwd" if one_f_one_b else "pp_send/bwd")
    shared = sum(jax.tree.leaves(pp_replicated_mask(cfg)))
    want = {
        f"layer_{layer:02d}/{op}": m * tp
        for layer in range(cfg.n_layers)
        for op in ("attn_in/bwd", "attn_out/fwd", "mlp_in/bwd", "mlp_out/fwd")
    }
    want |= dict.fromkeys(sends, steps * pp * tp)
    want |= {
        "embed/fwd": tp * (2 if one_f_one_b else 1),
        "head_in/bwd": tp * (m if one_f_one_b else 1),
        "pp_grads/fwd": shared * pp * tp,
    }
    assert calls == want
