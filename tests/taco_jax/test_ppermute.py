"""`compressed_ppermute` on 8 fake CPU devices (shard_map) and under vmap emulation.

What it must equal: on every destination, the receiver's decode of what the source encoded:
for a stage codec `tahquant.roundtrip(codec, x_source, fold_in(key, source))` (the source folds
in its index), for a TP codec `codecs.roundtrip`, each compiled here as a program of its own
(`assert_decoded` says how near: two programs need not round alike); zeros on ranks that receive
nothing; `codec="none"` is `lax.ppermute` bit for bit (it calls it: pure data movement). The
codecs' own error bounds are tested in test_tahquant.py and test_codecs.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from tp_testing import MODES, run_tp

import taco_jax as tj
from taco_jax import codecs, tahquant, tahquant_adaptive, telemetry

KEY = jax.random.key(11)
CYCLE4 = [(0, 1), (1, 2), (2, 3), (3, 0)]
CHAIN4 = [(0, 1), (1, 2), (2, 3)]  # a pipeline's forward sends: rank 0 receives nothing


def _ranks(n, shape, seed=0):
    return jax.random.normal(jax.random.key(seed), (n, *shape), jnp.float32)


def _expected(codec_name, x, perm, key=KEY):
    """What every rank must hold: the decoded source message, zeros where nothing arrives."""
    out = np.zeros(x.shape, np.float32)
    for source, destination in perm:
        if codec_name == "none":
            out[destination] = np.asarray(x[source])
        elif codec_name in tahquant.STAGE_CODEC_NAMES + tahquant_adaptive.CODEC_NAMES:
            codec = tj.ppermute.resolve_codec(codec_name)
            module = tahquant if codec_name in tahquant.STAGE_CODEC_NAMES else tahquant_adaptive
            row, size = codecs.pad_to_multiple(x[source].reshape(1, -1), codec.group_size)
            roundtrip = jax.jit(
                lambda r, k, codec=codec, module=module: module.decode_wire(
                    codec, module.encode_wire(codec, r, k), r.shape[-1]
                )
            )
            decoded = roundtrip(row, jax.random.fold_in(key, source))
            out[destination] = np.asarray(decoded[0, :size]).reshape(x.shape[1:])
        else:
            decoded = codecs.roundtrip(codec_name, x[source].reshape(1, -1))
            out[destination] = np.asarray(decoded).reshape(x.shape[1:])
    return out.reshape(x.shape)


# Rounding ties: how many groups of one message may land on another code in the replay.
MAX_TIES = 2


def assert_decoded(out, want, group_size: int) -> None:
    """`out` is the decode of the message `want` decodes, compiled in another program: the same
    operations on the same values, but XLA may order a transform's sums or contract a multiply
    and an add into an FMA differently, so a value may differ by a few fp32 roundings of its
    group's magnitude (8 ulps of the group's largest value: the scale's division and the
    transform's log2(G) <= 7 butterfly levels, one rounding each). Where that moves a value
    across a rounding boundary of the code grid, the group's decode moves by one code step:
    at most 2/15 of the group's largest value (int4's grid, the coarsest; E4M3's is 2^-3
    relative), spread over the group by a Hadamard (each entry of which is <= 1). So: every
    group within 8 ulps, but at most MAX_TIES groups a quarter of their largest value away. A
    misrouted or re-encoded message moves every group by O(1). Measured: bit for bit, every
    codec, both modes (jax 0.11.2, CPU)."""
    out, want = np.asarray(out, np.float32).reshape(-1), np.asarray(want, np.float32).reshape(-1)
    pad = -out.size % group_size
    diff = np.abs(np.pad(out - want, (0, pad))).reshape(-1, group_size).max(axis=1)
    largest = np.abs(np.pad(want, (0, pad))).reshape(-1, group_size).max(axis=1)
    fp32_level = diff <= 8 * 2.0**-24 * largest
    assert int(np.sum(~fp32_level)) <= MAX_TIES, diff[~fp32_level]
    assert bool(np.all(diff <= (0.25 + 8 * 2.0**-24) * largest))


def _group_size(name: str) -> int:
    return tj.ppermute.resolve_codec(name).group_size if name != "none" else 1


# Every codec over the cycle; over the chain (a partial permutation) one codec per kind:
# none, a fixed-bit stage codec, the adaptive one, a TP codec.
def _receiver_case(name, perm):
    # The fast tier: the cycle with no codec, a stage codec and a TP codec, and the chain with
    # the stage codec; the other variants, and the adaptive codec (its host-side grouping makes
    # its cases the slowest of this file), run in the slow tier.
    route = "cycle" if perm is CYCLE4 else "chain"
    fast = (name, route) in FAST_RECEIVERS
    marks = () if fast else pytest.mark.slow
    return pytest.param(name, perm, id=f"{name}-{route}", marks=marks)


FAST_RECEIVERS = {("tahquant", "cycle"), ("taco", "cycle"), ("tahquant", "chain")}
CYCLE_CODECS = ("none", "tahquant", "tahquant_sym", "tahquant4", "tahquant_adaptive", "taco")
CHAIN_CODECS = ("none", "tahquant", "tahquant_adaptive", "taco")
RECEIVER_CASES = [_receiver_case(name, CYCLE4) for name in CYCLE_CODECS] + [
    _receiver_case(name, CHAIN4) for name in CHAIN_CODECS
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,perm", RECEIVER_CASES)
def test_receivers_hold_the_decoded_message(mode, perm, name):
    x = _ranks(4, (3, 100), seed=1)  # 300 elements: not a multiple of any group size
    fn = lambda v: tj.compressed_ppermute(v, "pp", perm, codec=name, key=KEY)  # noqa: E731
    out = run_tp(fn, x, tp=4, mode=mode, axis_name="pp")
    want = _expected(name, x, perm)
    if name == "none":  # lax.ppermute itself: data movement, exact
        np.testing.assert_array_equal(out, want)
    else:
        for rank in range(4):  # each rank's message, in groups of the codec's size
            assert_decoded(out[rank], want[rank], _group_size(name))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["tahquant"])  # the other codecs: test_tahquant_kernel.py
def test_fused_kernels_carry_the_same_message(mode, name):
    """impl="pallas_interpret" runs the fused TAH-Quant kernels (`pallas_kernels.tahquant_kernel`)
    in Pallas' CPU interpreter: the same codes as the reference (the kernel calls the reference's
    tile functions; tests/pallas_kernels/test_tahquant_kernel.py), decoded within the kernel
    decode's bound 8 * 32 * 2^-24 of a group's largest value (derived there)."""
    x = _ranks(4, (3, 100), seed=2)
    fn = lambda v: tj.compressed_ppermute(  # noqa: E731
        v, "pp", CYCLE4, codec=name, key=KEY, impl="pallas_interpret"
    )
    out = run_tp(fn, x, tp=4, mode=mode, axis_name="pp")
    expected = _expected(name, x, CYCLE4)
    atol = 8 * 32 * 2.0**-24 * np.abs(expected).max()
    np.testing.assert_allclose(out, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("mode", MODES)
def test_none_equals_lax_ppermute_with_gradients(mode):
    x = _ranks(4, (64,), seed=2)

    def both(v):
        ours = lambda u: jnp.sum(tj.compressed_ppermute(u, "pp", CYCLE4, codec="none") ** 3)  # noqa: E731
        theirs = lambda u: jnp.sum(lax.ppermute(u, "pp", CYCLE4) ** 3)  # noqa: E731
        return jax.grad(ours)(v), jax.grad(theirs)(v)

    ours, theirs = run_tp(both, x, tp=4, mode=mode, axis_name="pp")
    # codec "none" calls lax.ppermute: one program, the same operations on the same values.
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_is_the_compressed_inverse_send(mode):
    """d/dx of sum(c * ppermute(x)) is ppermute(c) along the inverse permutation: with
    `tahquant` forward, the backward sends c with the symmetric variant and key fold_in(key, 1);
    sources that sent nothing get zero."""
    x = _ranks(4, (256,), seed=3)
    c = _ranks(4, (256,), seed=4)

    def grad(args):
        v, ct = args
        loss = lambda u: jnp.sum(ct * tj.compressed_ppermute(u, "pp", CHAIN4, key=KEY))  # noqa: E731
        return jax.grad(loss)(v)

    out = run_tp(grad, (x, c), tp=4, mode=mode, axis_name="pp")
    inverse = [(d, s) for s, d in CHAIN4]
    want = _expected("tahquant_sym", c, inverse, key=jax.random.fold_in(KEY, 1))
    for rank in range(4):
        assert_decoded(out[rank], want[rank], _group_size("tahquant_sym"))
    np.testing.assert_array_equal(out[3], 0.0)  # nothing sent: zeros, exactly


def test_under_jit_scan_and_remat():
    """A pipeline-like loop: microbatches sent along the chain inside lax.scan, remat'd."""
    x = _ranks(4, (3, 128), seed=5)

    def per_rank(v):
        def step(carry, micro):
            sent = jax.checkpoint(lambda u: tj.compressed_ppermute(u, "pp", CHAIN4, codec="taco"))(
                micro
            )
            return carry + jnp.sum(sent**2), sent

        return lax.scan(step, 0.0, v)

    fn = lambda v: jax.grad(lambda u: per_rank(u)[0])(v)  # noqa: E731
    grads = run_tp(fn, x, tp=4, mode="shard_map", axis_name="pp")
    sent = run_tp(lambda v: per_rank(v)[1], x, tp=4, mode="shard_map", axis_name="pp")
    # d sum(sent^2) / dx_s = compressed send back of 2 sent_d: within two taco quantizations.
    want = np.zeros_like(np.asarray(x))
    want[:3] = 2 * np.asarray(sent)[1:]
    err = np.linalg.norm(np.asarray(grads) - want) / np.linalg.norm(want)
    assert err <= 2 * 2.0**-4  # two E4M3 round trips (u = 2^-4 each, to first order)
    np.testing.assert_array_equal(np.asarray(grads)[3], 0.0)


def test_nonfinite_values_stay_visible():
    x = _ranks(4, (256,), seed=6).at[1, 5].set(jnp.nan).at[2, 200].set(jnp.inf)
    out = run_tp(
        lambda v: tj.compressed_ppermute(v, "pp", CYCLE4, key=KEY),
        x,
        tp=4,
        mode="vmap",
        axis_name="pp",
    )
    assert bool(jnp.all(jnp.isnan(out[2, :128]))) and bool(jnp.all(jnp.isnan(out[3, 128:])))
    assert bool(jnp.all(jnp.isfinite(out[2, 128:]))) and bool(jnp.all(jnp.isfinite(out[0])))


@pytest.mark.parametrize(
    "mode,perm", [("vmap", CHAIN4), ("vmap", CYCLE4), ("shard_map", CYCLE4), ("shard_map", CHAIN4)]
)
def test_telemetry_records_the_stage_error_of_receivers(mode, perm):
    """Over the ranks that receive (the others hold exact zeros in both, adding nothing to the
    sums), also under vmap with a full permutation. Asymmetric INT8 of N(0, 1) groups of 128: step
    (max - min) / 255 ~ 5.2 / 255 = 0.0204, stochastic rounding error variance <= step^2 / 4 and,
    for uniform fractions, step^2 / 6: RMS 0.0083-0.0102 of the values' RMS."""
    telemetry.drain()
    x = _ranks(4, (4096,), seed=7)
    fn = lambda v: tj.compressed_ppermute(v, "pp", perm, key=KEY, telemetry=True, name="pp")  # noqa: E731
    run_tp(fn, x, tp=4, mode=mode, axis_name="pp")
    recorded = telemetry.drain()
    assert set(recorded) == {"pp/fwd"} and 0.0075 < recorded["pp/fwd"].error < 0.0105


def test_errors_name_the_offending_value():
    x = jnp.zeros((4, 128))
    send = lambda perm, **kw: run_tp(
        lambda v: tj.compressed_ppermute(v, "pp", perm, **kw), x, tp=4, mode="vmap", axis_name="pp"
    )
    with pytest.raises(ValueError, match=r"pair \(3, 4\)"):
        send([(3, 4)], key=KEY)
    with pytest.raises(ValueError, match="a source appears twice"):
        send([(0, 1), (0, 2)], key=KEY)
    with pytest.raises(ValueError, match="a destination appears twice"):
        send([(0, 1), (2, 1)], key=KEY)
    with pytest.raises(ValueError, match="pairs"):
        send([0, 1], key=KEY)
    with pytest.raises(ValueError, match="pass key="):
        send(CYCLE4)
    with pytest.raises(ValueError, match="'tahquant7'"):
        send(CYCLE4, codec="tahquant7")
    with pytest.raises(TypeError, match="int32"):
        run_tp(
            lambda v: tj.compressed_ppermute(v.astype(jnp.int32), "pp", CYCLE4),
            x,
            tp=4,
            mode="vmap",
            axis_name="pp",
        )
