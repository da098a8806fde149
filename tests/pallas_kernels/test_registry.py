"""`pallas_kernels.registry.select`: what runs each compressed op, a pure function of the op,
codec, sizes, dtype, `impl` and the `Target`: Triton wherever JAX has Pallas' Triton lowering,
Mosaic GPU on Hopper where it has not, the fused exchange where a Hopper GPU stores into its
peers; the reference with one warning where that kernel cannot take a call (an error naming it
under an explicit impl="pallas"), and the collectives and pipeline sends padding their rows so
that the kernels take every call they make.

On the CPU each target is constructed (or, for the collectives, assumed: `target.assume`) and the
kernels' launches are read from the traced program, not run; what the kernels compute is tested
in their own files, and on a GPU at the end of this one.
"""

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import taco_jax
from pallas_kernels import encode_mosaic, exchange_mosaic, registry
from taco_jax import _backends, codecs, collectives, sdp4bit, tahquant, target
from taco_jax.target import Target

TACO = codecs.get_codec("taco")
TILES_ROW = encode_mosaic.row_multiple(TACO)  # 16384: two tiles of 64 groups of 128
NO_TRITON = "jax 9.9 has no Pallas Triton lowering"
GPU = Target(backend="gpu")
HOPPER = Target(backend="gpu", hopper=True)
HOPPER_NO_TRITON = Target(backend="gpu", hopper=True, triton_missing=NO_TRITON)
HOPPER_PEERS = Target(backend="gpu", hopper=True, real_link=True, link="nvlink", peer_stores=True)


@pytest.fixture(autouse=True)
def fresh_warnings():
    registry.forget_reference()
    yield
    registry.forget_reference()


def launches(fn, *args) -> list[str]:
    """The names of the kernels `fn(*args)` launches, in order, read from its traced program."""
    return re.findall(r"name=((?:taco|tahquant)_\w+)", str(jax.make_jaxpr(fn)(*args)))


def lowerings(names: list[str]) -> list[str]:
    return ["mosaic" if "_mosaic_" in name else "triton" for name in names]


def _ops(codec, rows: int, n: int, target: Target, dtype=jnp.bfloat16):
    """Each public op on `rows` rows of n elements, for `target`: () -> its launches."""
    x = jnp.ones((rows, n), dtype)
    wire = jnp.zeros((rows, codec.wire_bytes(n)), jnp.uint8)
    return [
        lambda: launches(lambda: pk.encode(codec, x, target=target)),
        lambda: launches(lambda: pk.decode(codec, wire, n, dtype, target=target)),
        lambda: launches(lambda: pk.decode_sum(codec, wire, n, dtype, target=target)),
        lambda: launches(lambda: pk.decode_sum_reencode(codec, wire, n, target=target)),
    ]


@pytest.mark.parametrize(
    "op,codec,impl,where,n,rows,dtype,kernel,multiple",
    [
        # Triton wherever JAX has the lowering, whatever the GPU; whole groups.
        ("encode", "taco", "auto", HOPPER, None, 1, None, "triton", 128),
        ("decode_sum", "taco", "pallas", GPU, 384, 8, jnp.float32, "triton", 128),
        ("encode", "int6_hadamard", "auto", HOPPER_NO_TRITON, None, 1, None, "reference", 128),
        # Mosaic GPU on Hopper without it, for the FP8-Hadamard codecs: whole Mosaic rows.
        ("encode", "taco", "auto", HOPPER_NO_TRITON, None, 1, None, "mosaic", TILES_ROW),
        ("decode_sum", "taco", "auto", HOPPER_NO_TRITON, TILES_ROW, 2, None, "mosaic", TILES_ROW),
        (
            "decode_sum",
            "taco",
            "auto",
            HOPPER_NO_TRITON,
            TILES_ROW,
            4,
            None,
            "mosaic_peer_steps",
            TILES_ROW,
        ),
        ("encode", "taco", "auto", HOPPER_NO_TRITON, 384, 1, None, "reference", 128),
        ("encode", "taco", "auto", HOPPER_NO_TRITON, TILES_ROW, 1, jnp.float32, "reference", 128),
        # The reference where asked for, off a GPU under "auto", and for "none".
        ("encode", "taco", "xla", HOPPER, None, 1, None, "reference", 128),
        ("encode", "taco", "auto", Target(), None, 1, None, "reference", 128),
        ("encode", "taco", "pallas_interpret", Target(), None, 1, None, "triton", 128),
        ("encode", "none", "pallas", HOPPER_NO_TRITON, None, 1, None, "reference", 128),
        # The stage codecs: Triton, their groups beyond the kernels' on the reference.
        ("encode", "tahquant", "auto", HOPPER, None, 1, None, "triton", 128),
        ("decode", "qwd", "auto", GPU, None, 1, None, "triton", 2048),
        ("decode", "wide", "auto", GPU, None, 1, None, "reference", 4096),
        # The fused exchange: only where a Hopper GPU stores into its peers, for taco on bf16.
        (
            "encode_all_gather",
            "taco",
            "auto",
            HOPPER_PEERS,
            None,
            1,
            None,
            "exchange_mosaic",
            exchange_mosaic.ROW_MULTIPLE,
        ),
        (
            "encode_all_to_all",
            "taco",
            "pallas",
            HOPPER_PEERS,
            4 * TILES_ROW,
            2,
            jnp.bfloat16,
            "exchange_mosaic",
            exchange_mosaic.ROW_MULTIPLE,
        ),
        ("encode_all_gather", "taco", "auto", HOPPER, None, 1, None, None, None),
        ("encode_all_gather", "taco", "pallas_interpret", HOPPER_PEERS, None, 1, None, None, None),
        ("encode_all_gather", "taco", "xla", HOPPER_PEERS, None, 1, None, None, None),
        ("encode_all_gather", "fp8", "auto", HOPPER_PEERS, None, 1, None, None, None),
        ("encode_all_gather", "taco", "auto", HOPPER_PEERS, None, 1, jnp.float32, None, None),
        ("encode_all_gather", "taco", "auto", HOPPER_PEERS, 384, 1, None, None, None),
    ],
)
def test_select_is_a_function_of_its_inputs(
    op, codec, impl, where, n, rows, dtype, kernel, multiple
):
    """What runs, and the row multiple it needs, from the op, codec, sizes, dtype, impl and
    target alone (selecting says nothing: a fallback warns when its kernel runs)."""
    codec = _codec(codec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = registry.select(op, codec, impl=impl, target=where, n=n, rows=rows, dtype=dtype)
    if kernel is None:
        assert chosen is None
        return
    assert (chosen.name, chosen.row_multiple) == (kernel, multiple)
    assert (chosen.fallback is not None) == (kernel == "reference" and impl == "auto" and where.gpu)


def _codec(name: str):
    if name == "qwd":
        return sdp4bit.QWD
    if name == "wide":
        return tahquant.TahQuant("wide", bits=8, group_size=4096, pivot=False, stochastic=False)
    if name in tahquant.STAGE_CODEC_NAMES:
        return tahquant.get_stage_codec(name)
    return codecs.get_codec(name)


@pytest.mark.parametrize("name", ["taco", "taco_e5m2", "fp8", "int8_hadamard", "int6_hadamard"])
def test_hopper_runs_triton_for_every_codec(name):
    """Triton for every op of every codec, at a small and a large row (the Mosaic kernels were
    slower or level at the sizes a TP step sends: docs/decisions/004)."""
    codec = codecs.get_codec(name)
    ran = [op() for n in (TILES_ROW, 64 * TILES_ROW) for op in _ops(codec, 8, n, HOPPER)]
    assert [lowerings(names) for names in ran] == [["triton"]] * 8


@pytest.mark.parametrize("peers", [2, 4, 8])
def test_hopper_without_triton_runs_mosaic_for_the_fp8_hadamard_codecs(peers):
    """Every op of `taco` on Mosaic GPU where JAX has no Triton lowering, whatever the size: the
    sums of more than two peers with one peer's tile a step."""
    ran = [
        op() for n in (TILES_ROW, 64 * TILES_ROW) for op in _ops(TACO, peers, n, HOPPER_NO_TRITON)
    ]
    steps = "_peer_steps" if peers > 2 else ""
    assert ran == 2 * [
        ["taco_encode_mosaic_taco_g128"],
        ["taco_decode_mosaic_taco_g128"],
        [f"taco_decode_sum{steps}_mosaic_taco_g128"],
        [f"taco_decode_sum_reencode{steps}_mosaic_taco_g128"],
    ]


def test_other_gpus_run_triton():
    ran = [op() for op in _ops(TACO, 2, TILES_ROW, GPU)]
    assert [lowerings(names) for names in ran] == [["triton"]] * 4


def test_mosaic_takes_bf16_in_and_fp32_or_bf16_out():
    """Other dtypes run the reference, saying so."""
    x32 = jnp.ones((2, TILES_ROW), jnp.float32)
    wire = jnp.zeros((2, TACO.wire_bytes(TILES_ROW)), jnp.uint8)
    with pytest.warns(
        RuntimeWarning, match=r"encode of taco .*float32\) runs the jnp reference.*bfloat16"
    ):
        assert launches(lambda: pk.encode(TACO, x32, target=HOPPER_NO_TRITON)) == []
    decode = lambda dtype: pk.decode(TACO, wire, TILES_ROW, dtype, target=HOPPER_NO_TRITON)  # noqa: E731
    assert lowerings(launches(lambda: decode(jnp.float32))) == ["mosaic"]
    with pytest.warns(RuntimeWarning, match=r"decode of taco .*float16\) runs the jnp reference"):
        assert launches(lambda: decode(jnp.float16)) == []


def test_where_mosaic_cannot_take_a_row_the_reference_runs_with_one_warning():
    """A row of 3 groups is not whole Mosaic tiles: the reference's bytes, said once."""
    x = jax.random.normal(jax.random.key(0), (2, 384), jnp.float32).astype(jnp.bfloat16)
    call = r"encode of taco \(rows \[2, n=384\], bfloat16\)"
    with pytest.warns(RuntimeWarning, match=call + " runs the jnp reference.*n=384"):
        wire = pk.encode(TACO, x, target=HOPPER_NO_TRITON)
    np.testing.assert_array_equal(wire, codecs.encode_wire(TACO, x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(pk.encode(TACO, x, target=HOPPER_NO_TRITON), wire)
    with pytest.warns(RuntimeWarning, match=r"decode_sum of taco .* runs the jnp reference"):
        total = pk.decode_sum(TACO, wire, 384, target=HOPPER_NO_TRITON)
    np.testing.assert_array_equal(total, codecs.decode_sum_wire(TACO, wire, 384))
    # Listed for the summary a run prints (taco_jax.reference_ops), each call with its reason.
    listed = taco_jax.reference_ops()
    assert list(listed) == [
        "encode of taco (rows [2, n=384], bfloat16)",
        "decode_sum of taco (rows [2, n=384], float32)",
    ]
    assert all(why.startswith("the Mosaic GPU kernels cannot take") for why in listed.values())


def test_an_explicit_pallas_refuses_the_call_the_kernel_cannot_take():
    """Asked for the kernels (fallback=False: the collectives' impl="pallas"), a row of 3 groups
    raises, naming the call and the way to the reference; nothing is listed."""
    x = jnp.ones((2, 384), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"impl='pallas': encode of taco \(rows \[2, n=384\]"):
        pk.encode(TACO, x, fallback=False, target=HOPPER_NO_TRITON)
    wire = jnp.zeros((4, TACO.wire_bytes(384)), jnp.uint8)
    ops = _backends.get_ops("pallas", HOPPER_NO_TRITON)
    with pytest.raises(ValueError, match=r"decode_sum of taco \(rows \[4, n=384\].*impl='auto'"):
        ops.decode_sum(TACO, wire, 384, jnp.float32)
    interpreted = _backends.get_ops("pallas_interpret", Target(triton_missing=NO_TRITON))
    with pytest.raises(ValueError, match=f"impl='pallas_interpret': encode of taco .*{NO_TRITON}"):
        interpreted.encode(TACO, x)
    assert taco_jax.reference_ops() == {}


def test_a_jax_without_the_triton_lowering():
    """Every Triton op runs the reference, saying why once; asked for the kernels, an error
    names why they cannot run."""
    no_triton = Target(backend="gpu", triton_missing=NO_TRITON)
    x = jnp.ones((1, TILES_ROW), jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match=NO_TRITON):
        wire = pk.encode(TACO, x, target=no_triton)
    np.testing.assert_array_equal(wire, codecs.encode_wire(TACO, x))
    codec = tahquant.get_stage_codec("tahquant")
    key = jax.random.key(2)
    y = jax.random.normal(jax.random.key(1), (2, 1024), jnp.float32)
    with pytest.raises(ValueError, match="impl='pallas': encode of the tahquant stage codec"):
        _backends.stage_ops("pallas", no_triton).encode(codec, y, key)
    with pytest.warns(RuntimeWarning, match="the tahquant stage codec .* runs the jnp reference"):
        wire = _backends.stage_ops("auto", no_triton).encode(codec, y, key)
    np.testing.assert_array_equal(wire, tahquant.encode_wire(codec, y, key))
    assert "encode of the tahquant stage codec (groups of 128)" in taco_jax.reference_ops()


def test_stage_groups_beyond_the_kernels_are_said_or_refused():
    """A TAH-Quant grid of groups the kernels cannot hold: the reference with one warning and a
    line in the summary, or, asked for the kernels, an error naming the codec."""
    wide = _codec("wide")
    y = jax.random.normal(jax.random.key(1), (1, 4096), jnp.float32)
    with pytest.raises(ValueError, match=r"the wide stage codec \(groups of 4096\).*at most 2048"):
        _backends.stage_ops("pallas", GPU).encode(wide, y, None)
    with pytest.warns(RuntimeWarning, match="the wide stage codec .* runs the jnp reference"):
        wire = _backends.stage_ops("auto", GPU).encode(wide, y, None)
    np.testing.assert_array_equal(wire, tahquant.encode_wire(wide, y, None))
    listed = taco_jax.reference_ops()
    assert "at most 2048" in listed["encode of the wide stage codec (groups of 4096)"]


def test_unknown_ops_are_named():
    with pytest.raises(ValueError, match="op='gather'"):
        registry.select("gather", TACO, impl="auto", target=GPU)
    with pytest.raises(ValueError, match="op='decode_sum' for codec 'tahquant'"):
        registry.select("decode_sum", _codec("tahquant"), impl="auto", target=GPU)


def test_collectives_pad_rows_to_whole_mosaic_rows():
    """A 4-rank two-shot all-reduce of 3000 elements a rank (rows of 750): each row padded to
    one `TILES_ROW`, every op Mosaic's; on other platforms rows of whole groups."""
    assert _backends.row_multiple("pallas", TACO, HOPPER) == TACO.group_size
    assert _backends.row_multiple("pallas", TACO, HOPPER_NO_TRITON) == TILES_ROW
    assert _backends.row_multiple("xla", TACO, HOPPER_NO_TRITON) == TACO.group_size
    fp8 = codecs.get_codec("fp8")
    assert _backends.row_multiple("auto", fp8, HOPPER_NO_TRITON) == 128

    def psum(x):
        return collectives.compressed_psum(x, "tp", impl="pallas", algorithm="two_shot")

    x = jnp.zeros((4, 3, 1000), jnp.bfloat16)
    with (
        warnings.catch_warnings(),
        target.assume(backend="gpu", hopper=True, triton_missing=NO_TRITON),
    ):
        warnings.simplefilter("error", RuntimeWarning)  # no op falls to the reference
        assert launches(jax.vmap(psum, axis_name="tp"), x) == [
            "taco_encode_mosaic_taco_g128",
            "taco_decode_sum_reencode_peer_steps_mosaic_taco_g128",
            "taco_decode_mosaic_taco_g128",
        ]


@pytest.mark.parametrize(
    "codec, triton, lowering",
    [("taco", False, "mosaic"), ("taco", True, "triton"), ("fp8", True, "triton")],
)
def test_pipeline_sends_pad_rows_to_whole_kernel_rows(codec, triton, lowering):
    """A compressed_ppermute of 1000 elements a rank with a TP codec: its row padded to whole
    Mosaic rows where the Mosaic kernels run `taco` (before: whole groups, and the reference with
    a warning), whole groups for Triton; every op a kernel's, none the reference."""

    def send(x):
        return taco_jax.compressed_ppermute(x, "pp", [(0, 1), (1, 0)], codec=codec, impl="pallas")

    x = jnp.zeros((2, 1000), jnp.bfloat16)
    missing = None if triton else NO_TRITON
    with (
        warnings.catch_warnings(),
        target.assume(backend="gpu", hopper=True, triton_missing=missing),
    ):
        warnings.simplefilter("error", RuntimeWarning)  # no op falls to the reference
        assert lowerings(launches(jax.vmap(send, axis_name="pp"), x)) == [lowering, lowering]
    assert taco_jax.reference_ops() == {}


# ------------------------------------------------------------------------------------------
# On a Hopper GPU: what the registry's kernels compute inside the collectives.


@pytest.mark.gpu
@pytest.mark.skipif(not target.probe().hopper, reason="needs a Hopper GPU")
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
