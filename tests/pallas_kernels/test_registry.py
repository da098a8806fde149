"""`pallas_kernels.registry`: one kernel per (op, codec family, platform): Triton wherever JAX
has Pallas' Triton lowering, Mosaic GPU on Hopper where it has not; the reference with one
warning where that kernel cannot take a call (an error naming it under an explicit
impl="pallas"), and the collectives and pipeline sends padding their rows so that the kernels
take every call they make.

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
import taco_jax
from pallas_kernels import _pallas, encode_mosaic, registry
from taco_jax import _backends, codecs, collectives, tahquant

TACO = codecs.get_codec("taco")
TILES_ROW = encode_mosaic.row_multiple(TACO)  # 16384: two tiles of 64 groups of 128


@pytest.fixture(autouse=True)
def fresh_warnings():
    registry._warn_once.cache_clear()
    registry._ON_REFERENCE.clear()
    yield
    registry._warn_once.cache_clear()
    registry._ON_REFERENCE.clear()


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)


@pytest.fixture
def no_triton(monkeypatch):
    """A JAX whose Pallas has no Triton lowering (its deprecation's end)."""
    monkeypatch.setattr(_pallas, "pltriton", None)


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


def _ops(codec, rows: int, n: int, dtype=jnp.bfloat16):
    """Each public op on `rows` rows of n elements (wire of zeros: launches only)."""
    x = jnp.ones((rows, n), dtype)
    wire = jnp.zeros((rows, codec.wire_bytes(n)), jnp.uint8)
    return [
        lambda: pk.encode(codec, x),
        lambda: pk.decode(codec, wire, n, dtype),
        lambda: pk.decode_sum(codec, wire, n, dtype),
        lambda: pk.decode_sum_reencode(codec, wire, n),
    ]


@pytest.mark.parametrize("name", ["taco", "taco_e5m2", "fp8", "int8_hadamard", "int6_hadamard"])
def test_hopper_runs_triton_for_every_codec(hopper, launches, name):
    """Triton for every op of every codec, at a small and a large row (the Mosaic kernels were
    slower or level at the sizes a TP step sends: docs/decisions/004)."""
    codec = codecs.get_codec(name)
    for n in (TILES_ROW, 64 * TILES_ROW):
        for op in _ops(codec, 8, n):
            op()
    assert [lowering for lowering, _ in launches] == ["triton"] * 8


@pytest.mark.parametrize("peers", [2, 4, 8])
def test_hopper_without_triton_runs_mosaic_for_the_fp8_hadamard_codecs(
    hopper, no_triton, launches, peers
):
    """Every op of `taco` on Mosaic GPU where JAX has no Triton lowering, whatever the size: the
    sums of more than two peers with one peer's tile a step."""
    for n in (TILES_ROW, 64 * TILES_ROW):
        for op in _ops(TACO, peers, n):
            op()
    steps = "_peer_steps" if peers > 2 else ""
    assert launches == 2 * [
        ("mosaic", "taco_encode_mosaic_taco_g128"),
        ("mosaic", "taco_decode_mosaic_taco_g128"),
        ("mosaic", f"taco_decode_sum{steps}_mosaic_taco_g128"),
        ("mosaic", f"taco_decode_sum_reencode{steps}_mosaic_taco_g128"),
    ]


def test_other_platforms_run_triton(launches):
    """The CPU stands for any GPU that is not a Hopper one: Triton for every op."""
    for op in _ops(TACO, 2, TILES_ROW):
        op()
    assert [lowering for lowering, _ in launches] == ["triton"] * 4


def test_mosaic_takes_bf16_in_and_fp32_or_bf16_out(hopper, no_triton, launches):
    """Other dtypes run the reference, saying so."""
    x32 = jnp.ones((2, TILES_ROW), jnp.float32)
    wire = jnp.zeros((2, TACO.wire_bytes(TILES_ROW)), jnp.uint8)
    with pytest.warns(
        RuntimeWarning, match=r"encode of taco .*float32\) runs the jnp reference.*bfloat16"
    ):
        pk.encode(TACO, x32)
    pk.decode(TACO, wire, TILES_ROW, jnp.float32)
    with pytest.warns(RuntimeWarning, match=r"decode of taco .*float16\) runs the jnp reference"):
        pk.decode(TACO, wire, TILES_ROW, jnp.float16)
    assert [lowering for lowering, _ in launches] == ["mosaic"]


def test_where_mosaic_cannot_take_a_row_the_reference_runs_with_one_warning(
    hopper, no_triton, launches
):
    """A row of 3 groups is not whole Mosaic tiles: the reference's bytes, said once."""
    x = jax.random.normal(jax.random.key(0), (2, 384), jnp.float32).astype(jnp.bfloat16)
    call = r"encode of taco \(rows \[2, n=384\], bfloat16\)"
    with pytest.warns(RuntimeWarning, match=call + " runs the jnp reference.*n=384"):
        wire = pk.encode(TACO, x)
    np.testing.assert_array_equal(wire, codecs.encode_wire(TACO, x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(pk.encode(TACO, x), wire)  # no second warning
    with pytest.warns(RuntimeWarning, match=r"decode_sum of taco .* runs the jnp reference"):
        total = pk.decode_sum(TACO, wire, 384)
    np.testing.assert_array_equal(total, codecs.decode_sum_wire(TACO, wire, 384))
    assert launches == []
    # Listed for the summary a run prints (taco_jax.reference_ops), each call with its reason.
    listed = taco_jax.reference_ops()
    assert list(listed) == [
        "encode of taco (rows [2, n=384], bfloat16)",
        "decode_sum of taco (rows [2, n=384], float32)",
    ]
    assert all(why.startswith("the Mosaic GPU kernels cannot take") for why in listed.values())


def test_an_explicit_pallas_refuses_the_call_the_kernel_cannot_take(hopper, no_triton, launches):
    """Asked for the kernels (fallback=False: the collectives' impl="pallas"), a row of 3 groups
    raises, naming the call and the way to the reference; nothing runs, nothing is listed."""
    x = jnp.ones((2, 384), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"impl='pallas': encode of taco \(rows \[2, n=384\]"):
        pk.encode(TACO, x, fallback=False)
    wire = jnp.zeros((4, TACO.wire_bytes(384)), jnp.uint8)
    ops = _backends.get_ops("pallas")
    with pytest.raises(ValueError, match=r"decode_sum of taco \(rows \[4, n=384\].*impl='auto'"):
        ops.decode_sum(TACO, wire, 384, jnp.float32)
    assert launches == [] and taco_jax.reference_ops() == {}


def test_a_jax_without_the_triton_lowering(monkeypatch):
    """Every Triton op runs the reference, saying why once; asking for a Triton kernel directly
    names why it cannot."""
    monkeypatch.setattr(_pallas, "pltriton", None)
    monkeypatch.setattr(_pallas, "TRITON_IMPORT_ERROR", "jax 9.9 has no Pallas Triton lowering")
    x = jnp.ones((1, TILES_ROW), jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="jax 9.9 has no Pallas Triton lowering"):
        np.testing.assert_array_equal(pk.encode(TACO, x), codecs.encode_wire(TACO, x))
    with pytest.raises(ValueError, match="jax 9.9 has no Pallas Triton lowering"):
        pk.encode_kernel.encode(TACO, x)
    codec = tahquant.get_stage_codec("tahquant")
    key = jax.random.key(2)
    y = jax.random.normal(jax.random.key(1), (2, 1024), jnp.float32)
    with pytest.raises(ValueError, match="impl='pallas': the tahquant stage codec"):
        _backends.get_stage_ops("pallas").encode(codec, y, key)
    with pytest.warns(RuntimeWarning, match="the tahquant stage codec .* runs the jnp reference"):
        assert registry.stage_kernel(codec) == "reference"  # "auto"'s choice
    assert "the tahquant stage codec (groups of 128)" in taco_jax.reference_ops()


def test_stage_groups_beyond_the_kernels_are_said_or_refused():
    """A TAH-Quant grid of groups the kernels cannot hold: the reference with one warning and a
    line in the summary, or, asked for the kernels, an error naming the codec (before, it ran
    the reference with no word)."""
    wide = tahquant.TahQuant("wide", bits=8, group_size=4096, pivot=False, stochastic=False)
    y = jax.random.normal(jax.random.key(1), (1, 4096), jnp.float32)
    with pytest.raises(ValueError, match=r"the wide stage codec \(groups of 4096\).*at most 2048"):
        _backends.get_stage_ops("pallas").encode(wide, y, None)
    with pytest.warns(RuntimeWarning, match="the wide stage codec .* runs the jnp reference"):
        assert registry.stage_kernel(wide) == "reference"
    assert "at most 2048" in taco_jax.reference_ops()["the wide stage codec (groups of 4096)"]


def test_unknown_ops_are_named():
    with pytest.raises(ValueError, match="op='gather'"):
        registry.kernel_for("gather", TACO, n=TILES_ROW, dtype=jnp.bfloat16)


def test_rows_of_whole_groups_where_triton_runs(hopper):
    assert _backends.kernel_row_multiple("pallas", TACO) == TACO.group_size


def test_collectives_pad_rows_to_whole_mosaic_rows(hopper, no_triton, launches):
    """A 4-rank two-shot all-reduce of 3000 elements a rank (rows of 750): each row padded to
    one `TILES_ROW`, every op Mosaic's; on other platforms rows of whole groups."""
    assert _backends.kernel_row_multiple("pallas", TACO) == TILES_ROW
    assert _backends.kernel_row_multiple("xla", TACO) == TACO.group_size
    assert _backends.kernel_row_multiple("pallas", codecs.get_codec("fp8")) == 128

    def psum(x):
        return collectives.compressed_psum(x, "tp", impl="pallas", algorithm="two_shot")

    x = jax.ShapeDtypeStruct((4, 3, 1000), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no op falls to the reference
        out = jax.eval_shape(jax.vmap(psum, axis_name="tp"), x)
    assert out.shape == x.shape
    assert launches == [
        ("mosaic", "taco_encode_mosaic_taco_g128"),
        ("mosaic", "taco_decode_sum_reencode_peer_steps_mosaic_taco_g128"),
        ("mosaic", "taco_decode_mosaic_taco_g128"),
    ]


@pytest.mark.parametrize(
    "codec, triton, lowering",
    [("taco", False, "mosaic"), ("taco", True, "triton"), ("fp8", True, "triton")],
)
def test_pipeline_sends_pad_rows_to_whole_kernel_rows(
    hopper, launches, monkeypatch, codec, triton, lowering
):
    """A compressed_ppermute of 1000 elements a rank with a TP codec: its row padded to whole
    Mosaic rows where the Mosaic kernels run `taco` (before: whole groups, and the reference with
    a warning), whole groups for Triton; every op a kernel's, none the reference."""
    if not triton:
        monkeypatch.setattr(_pallas, "pltriton", None)

    def send(x):
        return taco_jax.compressed_ppermute(x, "pp", [(0, 1), (1, 0)], codec=codec, impl="pallas")

    x = jax.ShapeDtypeStruct((2, 1000), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no op falls to the reference
        out = jax.eval_shape(jax.vmap(send, axis_name="pp"), x)
    assert out.shape == x.shape
    assert [lowering for lowering, _ in launches] == [lowering, lowering]
    assert taco_jax.reference_ops() == {}


# ------------------------------------------------------------------------------------------
# On a Hopper GPU: what the registry's kernels compute inside the collectives.


@pytest.mark.gpu
@pytest.mark.skipif(not _pallas.hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("algorithm", ["two_shot", "one_shot"])
def test_collectives_through_the_registry_on_the_gpu(algorithm):
    """The all-reduce of 4 emulated ranks through the registry's kernels (no op on the
    reference) against the reference codec, up to rounding.

    Tolerance, as in test_collectives_pallas.py: both quantize the same values and differ where
    a code sits at a rounding tie (one code step of a group, <= 2^-3 of its l2 norm, in each of
    the two quantizations) and else by fp32 sums of G terms (4 G 2^-24 max|out|) and the bf16
    output's rounding of those (2^-8 max|out|). Ties: at most 3 codes in 16384 (the GPU checks
    of benchmarks/kernels.py), of the 5 x 64000 codes a two-shot all-reduce quantizes
    here (each rank's message, then the sums), so at most 59 of rank 0's 500 groups beyond the
    latter (every rank holds the same output)."""
    group = TACO.group_size
    x = jax.random.normal(jax.random.key(3), (4, 16, 4000), jnp.float32).astype(jnp.bfloat16)
    max_tie_groups = math.ceil(3 * 5 * x[0].size / 16384)

    def psum(impl):
        fn = lambda v: collectives.compressed_psum(v, "tp", impl=impl, algorithm=algorithm)  # noqa: E731
        return jax.jit(jax.vmap(fn, axis_name="tp"))

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs the jnp reference.*")
        got = np.asarray(psum("pallas")(x), np.float64)[0]
    want = np.asarray(psum("xla")(x), np.float64)[0]
    norms = np.linalg.norm(want.reshape(-1, group), axis=-1).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * 2.0**-3 * norms)
    noise = (4 * group * 2.0**-24 + 2.0**-8) * np.abs(want).max()
    beyond = (np.abs(got - want).reshape(-1, group).max(axis=-1) > noise).sum()
    assert beyond <= max_tie_groups, f"{beyond} groups beyond rounding"
