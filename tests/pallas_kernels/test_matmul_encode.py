"""The matmul with the encode in its epilogue (`pallas_kernels.matmul_encode_mosaic`): its wire
order, the weight's folded Hadamard, its unfused path, when it applies, its lowering for CUDA
on any machine, and its values on a Hopper GPU (Mosaic GPU's interpreter cannot run its
warp-specialized pipeline).

Tolerances (u = 2^-24):
- The fold: b' = bf16(b S) per group; the fp32 sum of 128 exact +-b terms errs by at most
  127 u sum|b|, and the rounding to bf16 by half a step, 2^-8 of |b S|, so
  |b' - b S| <= 2^-8 |b S| + 2^-17 sum|b| (127 u < 2^-17).
- The kernel's codes: it encodes v = a @ b' summed in fp32 over K terms, off the exact value by
  at most K u (|a| @ |b'|) per element; the encode scales v by its group's stored factor (one
  more rounding: u |v|). So each code is the quantization of a value within
  tol = f (K u (|a| @ |b'|) + 2 u |v|) of the ideal f v (v exact, f the stored factor), and
  quantize is monotone: the code lies between quantize(ideal - tol) and quantize(ideal + tol).
- Its fp32 scales: amax moves by at most the largest error above, so rtol
  K u max(|a| @ |b'|) / amax + 2 u per group.
- With the Hadamard in the epilogue the kernel encodes v = S bf16(a @ b), as the unfused path:
  its fp32 product is within e = K u (|a| @ |b|) of the exact y, so it rounds to bf16(y) or,
  where a rounding edge lies within e (+ the fp32 conversion's 2 u |y|) of y, to the
  neighbouring bf16 value: off by d_j, that neighbour's distance, else 0. S has +-1 entries, so
  each of a group's outputs moves by at most sum_j d_j, plus the fp32 sum of 128 terms,
  128 u sum_j |bf16(y_j)|; the codes as above with that bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import tiered

import pallas_kernels as pk
from pallas_kernels import _pallas, config
from pallas_kernels import matmul_encode_mosaic as mem
from taco_jax import codecs

U = 2.0**-24
CODECS = ("taco", "taco_e5m2", "taco_no_ds", "fp8", "int8", "int8_hadamard")
hopper = pytest.mark.skipif(not _pallas.hopper_gpu(), reason="needs a Hopper GPU")


def _operands(m, k, h, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (0.05 * jax.random.normal(kb, (k, h), jnp.float32)).astype(jnp.bfloat16)
    return a, b


def test_tile_major_takes_128_by_128_tiles_row_block_first():
    m, h = 256, 512
    y = jnp.arange(m * h, dtype=jnp.float32).reshape(m, h)
    flat = mem.tile_major(y)
    tile = 128 * 128
    np.testing.assert_array_equal(flat[:tile].reshape(128, 128), y[:128, :128])
    np.testing.assert_array_equal(flat[tile : 2 * tile].reshape(128, 128), y[:128, 128:256])
    np.testing.assert_array_equal(flat[4 * tile : 5 * tile].reshape(128, 128), y[128:, :128])
    np.testing.assert_array_equal(mem.from_tile_major(flat, m, h), y)
    np.testing.assert_array_equal(mem.from_tile_major(jnp.stack([flat, flat]), m, h)[1], y)


@pytest.mark.parametrize("name", ["taco", "fp8"])
def test_the_folded_weight_carries_the_hadamard(name):
    codec = codecs.get_codec(name)
    _, b = _operands(128, 192, 512)
    folded = np.asarray(mem.fold_hadamard(codec, b), np.float64)
    b64 = np.asarray(b, np.float64)
    if not codec.hadamard:
        np.testing.assert_array_equal(folded, b64)
        return
    signs = codecs.signs_matrix(128).astype(np.float64)
    exact = (b64.reshape(192, 4, 128) @ signs).reshape(192, 512)
    row_l1 = np.repeat(np.abs(b64).reshape(192, 4, 128).sum(-1), 128, axis=-1)
    bound = 2.0**-8 * np.abs(exact) + 2.0**-17 * row_l1  # module docstring
    assert (np.abs(folded - exact) <= bound).all()
    assert (folded != b64).any()  # the signs were applied


def test_the_unfused_path_is_the_reference_off_hopper():
    """Off a Hopper GPU "auto" runs XLA's matmul then the encode (the jnp reference on a CPU):
    exactly `matmul_encode_reference`."""
    if _pallas.hopper_gpu():
        pytest.skip("checks the unfused path of a machine without wgmma")
    codec = codecs.get_codec("taco")
    a, b = _operands(256, 64, 512)
    got = pk.matmul_encode(codec, a, b)
    assert got.shape == (1, codec.wire_bytes(256 * 512))
    np.testing.assert_array_equal(got, pk.matmul_encode_reference(codec, a, b))
    np.testing.assert_array_equal(pk.matmul_encode(codec, a, b, backend="unfused"), got)


@pytest.mark.parametrize(
    "name,shapes,reason",
    [
        ("taco", ((256, 64), (64, 512)), None),
        ("taco_e8m0", ((256, 64), (64, 512)), "scale_format='e8m0'"),
        ("int6_hadamard", ((256, 64), (64, 512)), "element='int6'"),
        ("taco", ((200, 64), (64, 512)), "M=200"),
        ("taco", ((256, 64), (64, 384)), "H=384"),
        ("taco", ((256, 96), (96, 512)), "K=96"),
        ("taco", ((256, 64), (32, 512)), "b of shape=(32, 512)"),
    ],
)
def test_unsupported_names_the_value(name, shapes, reason):
    codec = codecs.get_codec(name)
    a, b = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes)
    got = mem.unsupported(codec, a, b, need_hopper=False)
    assert got is None if reason is None else reason in got, got
    fp32 = jax.ShapeDtypeStruct(shapes[0], jnp.float32)
    if reason is None:
        assert "a.dtype=float32" in mem.unsupported(codec, fp32, b, need_hopper=False)


def test_mosaic_backend_off_hopper_says_why_and_backends_are_named():
    codec = codecs.get_codec("taco")
    a, b = _operands(256, 64, 512)
    with pytest.raises(ValueError, match="backend='triton'"):
        pk.matmul_encode(codec, a, b, backend="triton")
    with pytest.raises(ValueError, match=r"a.shape=\(200, 64\), b.shape=\(64, 512\)"):
        pk.matmul_encode(codec, a[:200], b)  # not whole tiles: named, not reshaped wrongly
    if not _pallas.hopper_gpu():
        with pytest.raises(ValueError, match="not a Hopper GPU"):
            pk.matmul_encode(codec, a, b, backend="mosaic")


def test_auto_fuses_from_the_size_table(monkeypatch):
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    codec = codecs.get_codec("taco")
    a, b = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 64), (64, 512)))
    assert config.MATMUL_ENCODE_FROM_ELEMENTS > 256 * 512
    assert not mem.preferred(codec, a, b)
    monkeypatch.setattr(mem, "MATMUL_ENCODE_FROM_ELEMENTS", 256 * 512)
    assert mem.preferred(codec, a, b)
    assert not mem.preferred(codecs.get_codec("taco_e8m0"), a, b)  # does not apply
    assert config.MATMUL_ENCODE_CODECS == ("taco",)
    assert not mem.preferred(codecs.get_codec("int8_hadamard"), a, b)  # applies, not measured


@pytest.mark.parametrize("name", tiered(CODECS, ("taco",)))
@pytest.mark.parametrize("hadamard", mem.HADAMARDS)
def test_lowers_for_cuda(monkeypatch, name, hadamard):
    """Mosaic GPU's lowering (layouts, the warp-specialized pipeline, TMA boxes), built for CUDA
    on any machine."""
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    codec = codecs.get_codec(name)
    a, b = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((512, 192), (192, 512)))
    op = lambda a, b: mem.matmul_encode_kernel(codec, a, b, hadamard=hadamard)  # noqa: E731
    text = jax.jit(op).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("order", [None, (0, 16), (0, 4), (1, 4), (0, 3)])
@pytest.mark.parametrize("m_tiles,n_tiles", [(4, 3), (17, 2), (64, 8), (33, 3)])
def test_the_programs_take_every_output_tile_once(monkeypatch, order, m_tiles, n_tiles):
    """`config.MATMUL_ENCODE_GRID_ORDER`: rows, or snaking bands with a partial last band
    (17, 33 row blocks) or none full (4 for bands of 16)."""
    monkeypatch.setattr(mem, "MATMUL_ENCODE_GRID_ORDER", order)
    index = jnp.arange(m_tiles * n_tiles, dtype=jnp.int32)
    rows, cols = jax.vmap(lambda i: mem._output_tile(i, m_tiles, n_tiles))(index)
    taken = sorted(zip(np.asarray(rows).tolist(), np.asarray(cols).tolist(), strict=True))
    assert taken == [(r, c) for r in range(m_tiles) for c in range(n_tiles)]


def test_the_snake_order_lowers_for_cuda(monkeypatch):
    """Full bands of 16 row blocks and a partial one (17 row blocks)."""
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    monkeypatch.setattr(mem, "MATMUL_ENCODE_GRID_ORDER", (0, 16))
    codec = codecs.get_codec("taco")
    a, b = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((17 * 128, 192), (192, 512)))
    op = lambda a, b: mem.matmul_encode_kernel(codec, a, b, hadamard="epilogue")  # noqa: E731
    assert "mosaic_gpu" in jax.jit(op).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()


def test_the_hadamard_is_folded_or_in_the_epilogue():
    codec = codecs.get_codec("taco")
    a, b = _operands(256, 64, 512)
    with pytest.raises(ValueError, match="hadamard='weights'"):
        mem.matmul_encode_kernel(codec, a, b, hadamard="weights")
    assert config.MATMUL_ENCODE_HADAMARD in mem.HADAMARDS


# ------------------------------------------------------------------------------------------
# On a Hopper GPU.


def _folded_product(codec, a, b):
    """(v, its error bound) of the folded kernel: a @ b' exactly, K u (|a| @ |b'|)."""
    k = a.shape[1]
    folded = np.asarray(mem.fold_hadamard(codec, b), np.float64)
    a64 = np.asarray(a, np.float64)
    v = mem.tile_major(a64 @ folded).reshape(-1, 128)  # numpy: float64 throughout
    return v, k * U * mem.tile_major(np.abs(a64) @ np.abs(folded)).reshape(-1, 128)


def _rounded_product(codec, a, b):
    """(v, its error bound) of the epilogue Hadamard: S bf16(a @ b) (module docstring)."""
    k = a.shape[1]
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    y = a64 @ b64
    e = k * U * (np.abs(a64) @ np.abs(b64)) + 2 * U * np.abs(y)
    to_bf16 = lambda t: np.asarray(jnp.asarray(t, jnp.float32).astype(jnp.bfloat16), np.float64)  # noqa: E731
    rounded, flip = to_bf16(y), to_bf16(y + e) - to_bf16(y - e)  # flip: 0, or the step there
    rounded, flip = (mem.tile_major(t).reshape(-1, 128) for t in (rounded, np.abs(flip)))
    if not codec.hadamard:
        return rounded, flip + U * np.abs(rounded)
    signs = codecs.signs_matrix(128).astype(np.float64)
    bound = flip.sum(-1, keepdims=True) + 128 * U * np.abs(rounded).sum(-1, keepdims=True)
    return rounded @ signs, np.broadcast_to(bound, rounded.shape)


def _assert_encodes(codec, wire, n, v, err):
    """The kernel's codes and fp32 scales against the ideal encode of v [groups, 128] (exact),
    each value of the kernel's v within `err` of it (module docstring)."""
    payload = codecs.unpack(codec, wire, n)
    unit = codecs.hadamard_unit(128) if codec.hadamard else 1.0
    alpha = np.asarray(payload.prescales, np.float64).reshape(-1) if codec.prescale else 1.0
    factor = np.broadcast_to(unit * alpha, v.shape[:1])  # y = v unit alpha (`encode_groups`)
    if codec.postscale:
        scales = np.asarray(payload.scales, np.float64).reshape(-1)
        amax = np.abs(v).max(-1)
        want = amax * factor / codec.qmax  # s = max|y| / qmax
        rtol = err.max(-1) / amax + 2 * U
        np.testing.assert_array_less(np.abs(scales - want), rtol * want * (1 + 1e-9))
        factor = factor / scales
    ideal = v * factor[:, None]
    tol = factor[:, None] * (err + 2 * U * np.abs(v))
    codes = np.asarray(payload.codes).reshape(v.shape)
    got = np.asarray(codecs.dequantize(codec, jnp.asarray(codes)), np.float64)
    qmax = codec.qmax
    lo, hi = (
        np.asarray(codecs.dequantize(codec, codecs.quantize(
            codec, jnp.asarray(np.clip(ideal + d, -qmax, qmax), jnp.float32))), np.float64)
        for d in (-tol, tol)
    )  # fmt: skip
    bad = ~((lo <= got) & (got <= hi))
    assert not bad.any(), f"{int(bad.sum())} of {got.size} codes off their ideal {ideal[bad][:4]}"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "name,shape",
    [("taco", (512, 256, 512)), ("taco", (1024, 192, 768)), ("int8_hadamard", (512, 256, 512)),
     ("fp8", (512, 256, 512))],
)  # fmt: skip
def test_encodes_its_product_on_the_gpu(name, shape):
    """Fewer output tiles than SMs (8 at 512 x 512; 24 at 1024 x 768, three K steps); two
    inputs in a row, so that an unwritten byte would keep the first's value."""
    codec = codecs.get_codec(name)
    m, k, h = shape
    for seed in range(2):
        a, b = _operands(m, k, h, seed)
        wire = mem.matmul_encode_kernel(codec, a, mem.fold_hadamard(codec, b), hadamard="folded")
        assert wire.shape == (1, codec.wire_bytes(m * h))
        _assert_encodes(codec, wire, m * h, *_folded_product(codec, a, b))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", ["taco", "int8_hadamard", "fp8"])
def test_the_epilogue_hadamard_encodes_the_rounded_product_on_the_gpu(name):
    codec = codecs.get_codec(name)
    for seed, shape in enumerate([(512, 256, 512), (1024, 192, 768)]):
        a, b = _operands(*shape, seed)
        wire = mem.matmul_encode_kernel(codec, a, b, hadamard="epilogue")
        _assert_encodes(codec, wire, a.shape[0] * b.shape[1], *_rounded_product(codec, a, b))


@pytest.mark.gpu
@hopper
def test_a_non_finite_token_stays_visible_on_the_gpu():
    codec = codecs.get_codec("taco")
    a, b = _operands(512, 256, 512)
    a = a.at[7].set(jnp.nan)
    wire = pk.matmul_encode(codec, a, b, backend="mosaic")
    decoded = mem.from_tile_major(pk.decode_reference(codec, wire, 512 * 512)[0], 512, 512)
    nan_rows = np.isnan(np.asarray(decoded)).all(-1)
    np.testing.assert_array_equal(nan_rows, np.arange(512) == 7)
    assert np.isfinite(np.asarray(decoded)[~nan_rows]).all()


@pytest.mark.gpu
@hopper
def test_batches_under_vmap_on_the_gpu():
    codec = codecs.get_codec("taco")
    pairs = [_operands(512, 256, 512, seed) for seed in range(2)]
    a, b = (jnp.stack(x) for x in zip(*pairs, strict=True))
    batched = jax.vmap(lambda a, b: pk.matmul_encode(codec, a, b, backend="mosaic"))(a, b)
    for i, (ai, bi) in enumerate(pairs):
        np.testing.assert_array_equal(batched[i], pk.matmul_encode(codec, ai, bi, backend="mosaic"))
