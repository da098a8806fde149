"""With the Triton lowering off (`TACO_JAX_TRITON=0`, or a JAX whose Pallas has none), "auto"
lowers no kernel through Triton: Mosaic GPU wherever its kernel takes the call, the jnp
reference (with a warning naming why) elsewhere; the collectives pad rows to the Mosaic kernels'
multiple so that those take every row.

On the CPU the launches are recorded instead of built (`launches`), with the GPU taken for a
Hopper one where a test says so; what the kernels compute is tested in their own files, and on a
GPU at the end of this one.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _pallas, decode_mosaic, encode_mosaic
from taco_jax import _backends, codecs, collectives, tahquant

TACO = codecs.get_codec("taco")
TILES_ROW = encode_mosaic.row_multiple(TACO)  # 16384: two tiles of 64 groups of 128


@pytest.fixture
def triton_off(monkeypatch):
    monkeypatch.setenv(pk.TRITON_ENV, "0")
    _pallas._warn_reference.cache_clear()
    _backends._warn_stage_reference.cache_clear()
    yield
    _pallas._warn_reference.cache_clear()
    _backends._warn_stage_reference.cache_clear()


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)


@pytest.fixture
def launches(monkeypatch):
    """The (lowering, kernel name) of each kernel launched, in order; each returns zeros."""
    seen = []

    def recorder(lowering):
        def launch(*args, out_shape, name, **kwargs):
            seen.append((lowering, name))
            return jnp.zeros(out_shape.shape, out_shape.dtype)

        return launch

    monkeypatch.setattr(_pallas, "call", recorder("triton"))
    monkeypatch.setattr(_pallas, "mosaic_kernel", recorder("mosaic"))
    return seen


def _taco_ops(rows: int, n: int):
    """Each public op of `taco` on `rows` rows of n elements (wire of zeros: launches only)."""
    x = jnp.ones((rows, n), jnp.bfloat16)
    wire = jnp.zeros((rows, TACO.wire_bytes(n)), jnp.uint8)
    return [
        lambda: pk.encode(TACO, x),
        lambda: pk.decode(TACO, wire, n, jnp.bfloat16),
        lambda: pk.decode_sum(TACO, wire, n, jnp.bfloat16),
        lambda: pk.decode_sum_reencode(TACO, wire, n),
    ]


def test_auto_takes_mosaic_for_every_op_where_triton_is_off(hopper, launches, monkeypatch):
    """At 4 x 16384 elements, below every size where "auto" prefers Mosaic: Triton with the
    lowering on (so the record tells them apart), Mosaic GPU with it off."""
    monkeypatch.delenv(pk.TRITON_ENV, raising=False)
    for op in _taco_ops(4, TILES_ROW):
        op()
    assert [lowering for lowering, _ in launches] == ["triton"] * 4
    launches.clear()
    monkeypatch.setenv(pk.TRITON_ENV, "off")
    for op in _taco_ops(4, TILES_ROW):
        op()
    assert launches == [
        ("mosaic", "taco_encode_mosaic_taco_g128"),
        ("mosaic", "taco_decode_mosaic_taco_g128"),
        ("mosaic", "taco_decode_sum_mosaic_taco_g128"),  # small: every peer's tile a step
        ("mosaic", "taco_decode_sum_reencode_peer_steps_mosaic_taco_g128"),
    ]


def test_the_sums_take_peer_steps_where_they_measured_faster():
    def wire(nbytes):
        return jax.ShapeDtypeStruct((8, nbytes // 8), jnp.uint8)

    below, at = (
        wire(pk.config.MOSAIC_PEER_STEPS_FROM_BYTES - 8),
        wire(pk.config.MOSAIC_PEER_STEPS_FROM_BYTES),
    )
    assert not decode_mosaic.default_peer_steps("decode_sum", TACO, below)
    assert decode_mosaic.default_peer_steps("decode_sum", TACO, at)
    assert decode_mosaic.default_peer_steps("decode_sum_reencode", TACO, below)
    three_peers = jax.ShapeDtypeStruct((3, at.shape[1] * 8 // 3), jnp.uint8)
    for op in ("decode_sum", "decode_sum_reencode"):  # fewer than four peers: every peer a step
        assert not decode_mosaic.default_peer_steps(op, TACO, three_peers)
    for name in ("taco_e8m0", "int6_hadamard"):  # byte scales, bit planes: no peer steps
        codec = codecs.get_codec(name)
        assert not decode_mosaic.default_peer_steps("decode_sum", codec, at)


def test_where_mosaic_cannot_the_reference_runs_with_one_warning(triton_off):
    """The CPU is no Hopper GPU: every op is the reference's, bit for bit, and says why once."""
    n = TILES_ROW
    x = jax.random.normal(jax.random.key(0), (2, n), jnp.float32).astype(jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="encode runs the jnp reference.*not a Hopper GPU"):
        wire = pk.encode(TACO, x)
    np.testing.assert_array_equal(wire, codecs.encode_wire(TACO, x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(pk.encode(TACO, x), wire)  # no second warning
    with pytest.warns(RuntimeWarning, match="decode_sum runs the jnp reference"):
        total = pk.decode_sum(TACO, wire, n)
    np.testing.assert_array_equal(total, codecs.decode_sum_wire(TACO, wire, n))


def test_the_reference_names_what_mosaic_does_not_take(hopper, triton_off, launches):
    """On a Hopper GPU: `taco_e8m0`'s byte scales have no Mosaic encode; a row of 3 groups is
    not whole tiles. Neither launches a kernel."""
    x = jnp.ones((2, TILES_ROW), jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="scale_format='e8m0'"):
        pk.encode(codecs.get_codec("taco_e8m0"), x)
    with pytest.warns(RuntimeWarning, match="n=384"):
        pk.encode(TACO, jnp.ones((2, 384), jnp.bfloat16))
    assert launches == []


def test_an_unknown_setting_is_named(monkeypatch):
    monkeypatch.setenv(pk.TRITON_ENV, "maybe")
    with pytest.raises(ValueError, match="TACO_JAX_TRITON='maybe'"):
        pk.encode(TACO, jnp.ones((1, 128), jnp.bfloat16))


def test_a_jax_without_the_triton_lowering(hopper, launches, monkeypatch):
    """ "auto" then behaves as with the lowering off; asking for Triton names why it cannot."""
    monkeypatch.setattr(_pallas, "pltriton", None)
    monkeypatch.setattr(_pallas, "_TRITON_IMPORT_ERROR", "jax 9.9 has no Pallas Triton lowering")
    assert pk.triton_unavailable() == "jax 9.9 has no Pallas Triton lowering"
    x = jnp.ones((1, TILES_ROW), jnp.bfloat16)
    pk.encode(TACO, x)
    assert launches == [("mosaic", "taco_encode_mosaic_taco_g128")]
    for options in (dict(backend="triton"), dict(interpret=True)):
        with pytest.raises(ValueError, match="jax 9.9 has no Pallas Triton lowering"):
            pk.encode(TACO, x, **options)


def test_tahquant_stages_take_their_reference(triton_off):
    """The TAH-Quant kernels are Triton-lowered only: with Triton off, their reference runs."""
    codec = tahquant.get_stage_codec("tahquant")
    x = jax.random.normal(jax.random.key(1), (2, 1024), jnp.float32)
    key = jax.random.key(2)
    stage = _backends.get_stage_ops("pallas")
    with pytest.warns(RuntimeWarning, match="'tahquant' runs its jnp reference.*TACO_JAX_TRITON=0"):
        wire = stage.encode(codec, x, key)
    np.testing.assert_array_equal(wire, tahquant.encode_wire(codec, x, key))


def test_collectives_pad_rows_to_whole_mosaic_rows(hopper, triton_off, launches):
    """A 4-rank two-shot all-reduce of 64000 elements a rank: rows of 16000, padded to one
    `TILES_ROW` (2.4% more), every op Mosaic's; with Triton on, rows of whole groups."""
    assert _backends.kernel_row_multiple("pallas", TACO) == TILES_ROW
    assert _backends.kernel_row_multiple("xla", TACO) == TACO.group_size

    def psum(x):
        return collectives.compressed_psum(x, "tp", impl="pallas", algorithm="two_shot")

    x = jax.ShapeDtypeStruct((4, 16, 4000), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no op falls to the reference
        out = jax.eval_shape(jax.vmap(psum, axis_name="tp"), x)
    assert out.shape == x.shape
    assert launches == [
        ("mosaic", "taco_encode_mosaic_taco_g128"),
        ("mosaic", "taco_decode_sum_reencode_peer_steps_mosaic_taco_g128"),
        ("mosaic", "taco_decode_mosaic_taco_g128"),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(pk.TRITON_ENV, "1")
        assert _backends.kernel_row_multiple("pallas", TACO) == TACO.group_size


def test_rows_far_below_a_mosaic_row_keep_their_groups(hopper, triton_off, launches):
    """3000 elements a rank (rows of 750): a Mosaic row would be 22 times the row, more than
    `collectives.MAX_MOSAIC_PADDING` allows, so the rows keep whole groups and the reference
    runs (saying so); nothing launches."""
    x = jax.ShapeDtypeStruct((4, 3, 1000), jnp.bfloat16)
    fn = lambda v: collectives.compressed_psum(v, "tp", impl="pallas", algorithm="two_shot")  # noqa: E731
    with pytest.warns(RuntimeWarning, match="n=768"):
        jax.eval_shape(jax.vmap(fn, axis_name="tp"), x)
    assert launches == []


# ------------------------------------------------------------------------------------------
# On a Hopper GPU: what the Mosaic-only path computes, and that nothing warns of Triton.

TRITON_DEPRECATION = ".*Pallas Triton backend is deprecated.*"


@pytest.mark.gpu
@pytest.mark.skipif(not _pallas.hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("algorithm", ["two_shot", "one_shot"])
def test_collectives_without_triton_on_the_gpu(triton_off, algorithm):
    """The all-reduce of 4 emulated ranks through Mosaic GPU only (no Triton deprecation warning,
    no op on the reference while it lowers) against the reference codec, up to rounding.

    Tolerance, as in test_collectives_pallas.py: both quantize the same values and differ where
    a code sits at a rounding tie (one code step of a group, <= 2^-3 of its l2 norm, in each of
    the two quantizations) and else by fp32 sums of G terms (4 G 2^-24 max|out|) and the bf16
    output's rounding of those (2^-8 max|out|). Ties: at most 3 codes in 16384 (the GPU checks
    of docs/development_history.md), of the 5 x 64000 codes a two-shot all-reduce quantizes here
    (each rank's message, then the sums), so at most 59 of rank 0's 500 groups beyond the latter
    (every rank holds the same output)."""
    group = TACO.group_size
    x = jax.random.normal(jax.random.key(3), (4, 16, 4000), jnp.float32).astype(jnp.bfloat16)
    max_tie_groups = math.ceil(3 * 5 * x[0].size / 16384)

    def psum(impl):
        fn = lambda v: collectives.compressed_psum(v, "tp", impl=impl, algorithm=algorithm)  # noqa: E731
        return jax.jit(jax.vmap(fn, axis_name="tp"))

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=TRITON_DEPRECATION)
        warnings.filterwarnings("error", message=".*runs the jnp reference.*")
        got = np.asarray(psum("pallas")(x), np.float64)[0]
    want = np.asarray(psum("xla")(x), np.float64)[0]
    norms = np.linalg.norm(want.reshape(-1, group), axis=-1).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * 2.0**-3 * norms)
    noise = (4 * group * 2.0**-24 + 2.0**-8) * np.abs(want).max()
    beyond = (np.abs(got - want).reshape(-1, group).max(axis=-1) > noise).sum()
    assert beyond <= max_tie_groups, f"{beyond} groups beyond rounding"
