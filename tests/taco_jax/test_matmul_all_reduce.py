"""`taco_jax.reduce_matmul_from_tp`: Megatron g of a row-parallel product whose encode runs in
the product's matmul (`collectives.matmul_all_reduce`). Where the matmul and the encode run
unfused (here, on the CPU: XLA's matmul, then the encode) it is the one-shot compressed
all-reduce of the product with its groups in another order: every group is encoded, gathered
and summed alone, so the result is the same bits as `reduce_from_tp(x @ w)`, and so are the
gradients (both are the matmul's backward of the cotangent)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tp_testing import MODES, run_tp, tp_mesh

import taco_jax as tj
from taco_jax import _backends, codecs

TP = 2


@pytest.fixture
def encodes(monkeypatch):
    """The calls of `_backends.matmul_encode` (the product encoded by its matmul's path)."""
    calls = []
    encode = _backends.matmul_encode
    monkeypatch.setattr(_backends, "matmul_encode", lambda *a: calls.append(a) or encode(*a))
    return calls


def _problem(m, k, h, dtype=jnp.bfloat16):
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (TP, m, k), jnp.float32).astype(dtype)  # per rank: its K slice
    w = (0.1 * jax.random.normal(kw, (TP, k, h), jnp.float32)).astype(dtype)
    ct = jax.random.normal(kc, (m, h), jnp.float32).astype(dtype)
    return x, w, ct


def _out_and_grads(reduce, x, w, ct, mode):
    """Per rank, the reduced product and the gradients of sum(product * ct) (the loss itself is
    not compared: XLA may sum it in another order, fusing `from_tile_major`'s transpose)."""

    def per_rank(xw):
        loss = lambda x, w: jnp.sum((reduce(x, w) * ct).astype(jnp.float32))  # noqa: E731
        return reduce(*xw), jax.grad(loss, argnums=(0, 1))(*xw)

    return run_tp(per_rank, (x, w), tp=TP, mode=mode)


@pytest.mark.parametrize(
    "mode,codec,impl",
    [(mode, codec, "xla") for mode in MODES for codec in ("taco", "int8")]
    + [("vmap", "taco", "pallas_interpret")],  # the kernels' decode-sum, put back in place
)
def test_is_g_of_the_product_bit_for_bit_where_unfused(mode, codec, impl, encodes):
    comm = tj.TPComm.create(fwd=codec, algorithm="one_shot", min_compress_bytes=0, impl=impl)
    x, w, ct = _problem(256, 64, 384)  # 2 x 3 tiles of 128 x 128
    fused = _out_and_grads(lambda x, w: tj.reduce_matmul_from_tp(x, w, comm), x, w, ct, mode)
    plain = _out_and_grads(lambda x, w: tj.reduce_from_tp(x @ w, comm), x, w, ct, mode)
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(got, want)
    assert encodes, "the product was not encoded by its matmul's path"
    exact = tj.TPComm.create(fwd="none")
    exact_out, _ = _out_and_grads(lambda x, w: tj.reduce_from_tp(x @ w, exact), x, w, ct, mode)
    assert not np.array_equal(fused[0], exact_out)  # the product was compressed


def test_its_wire_holds_the_product_tile_major():
    """The wire `_backends.matmul_encode` sends (the unfused path) is the encode of the product
    in `codecs.tile_major` order: 128 x 128 tiles, row block first."""
    codec = codecs.get_codec("taco")
    x, w, _ = _problem(256, 64, 256)
    y = x[0] @ w[0]
    wire = _backends.matmul_encode("xla", codec, x[0], w[0])
    decoded = codecs.decode_wire(codec, wire, 256 * 256, jnp.float32)[0]
    first_tile = decoded[: 128 * 128].reshape(128, 128)
    want = codecs.decode_wire(codec, codecs.encode_wire(codec, y[:128, :128].reshape(1, -1)),
                              128 * 128, jnp.float32)[0]  # fmt: skip
    np.testing.assert_array_equal(first_tile.reshape(-1), want)
    np.testing.assert_array_equal(codecs.from_tile_major(codecs.tile_major(y), 256, 256), y)


@pytest.mark.parametrize(
    "shape,overrides",
    [
        ((200, 64, 384), {}),  # rows not whole tiles: the product's own one-shot all-reduce
        ((256, 64, 384), {"slices": 2}),  # slices: the product's own all-reduce
        ((256, 64, 384), {"algorithm": "two_shot"}),
    ],
)
def test_falls_back_to_the_products_all_reduce(shape, overrides, encodes):
    options = {"algorithm": "one_shot", "min_compress_bytes": 0, **overrides}
    comm = tj.TPComm.create(fwd="taco", **options)
    x, w, ct = _problem(*shape)
    fused = _out_and_grads(lambda x, w: tj.reduce_matmul_from_tp(x, w, comm), x, w, ct, "vmap")
    plain = _out_and_grads(lambda x, w: tj.reduce_from_tp(x @ w, comm), x, w, ct, "vmap")
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not encodes  # the product's own all-reduce, not the matmul's path


@pytest.mark.parametrize("x_varies", [True, False])
def test_the_sum_is_typed_replicated_under_check_vma(x_varies, encodes):
    """Under `shard_map(check_vma=True)` the sum is replicated wherever the product varies: x
    (a row-parallel layer's slice) or only w, as `lax.psum`'s; the gradients type-check."""
    mesh = tp_mesh(TP)
    comm = tj.TPComm.create(fwd="taco", algorithm="one_shot", min_compress_bytes=0)
    x, w, ct = _problem(256, 64, 256)
    x_in, x_spec = (x, P("tp")) if x_varies else (x[0], P())

    def per_rank(op):
        def run(x, w):
            x = x[0] if x_varies else x
            loss = lambda x, w: jnp.sum((op(x, w[0]) * ct).astype(jnp.float32))  # noqa: E731
            return op(x, w[0]), jax.grad(loss)(x, w)

        return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(x_spec, P("tp")),
                                     out_specs=(P(), x_spec), check_vma=True))  # fmt: skip

    fused = per_rank(lambda x, w: tj.reduce_matmul_from_tp(x, w, comm))(x_in, w)
    plain = per_rank(lambda x, w: tj.reduce_from_tp(x @ w, comm))(x_in, w)
    assert encodes
    for got, want in zip(fused, plain, strict=True):
        np.testing.assert_array_equal(got, want)


def test_bad_operands_are_named():
    comm = tj.TPComm.create(fwd="taco")
    x, w = jnp.zeros((4, 64)), jnp.zeros((32, 8))
    with pytest.raises(ValueError, match=r"x.shape=\(4, 64\), w.shape=\(32, 8\)"):
        tj.reduce_matmul_from_tp(x, w, comm)
    with pytest.raises(ValueError, match=r"copy_matmul_to_tp .* w.shape=\(32, 8\)"):
        tj.copy_matmul_to_tp(x, w, comm)


def test_leading_dims_are_tokens():
    comm = tj.TPComm.create(fwd="taco", algorithm="one_shot", min_compress_bytes=0)
    x, w, _ = _problem(256, 64, 256)
    x3 = x.reshape(TP, 2, 128, 64)
    out = run_tp(lambda xw: tj.reduce_matmul_from_tp(*xw, comm), (x3, w), tp=TP, mode="vmap")
    flat = run_tp(lambda xw: tj.reduce_matmul_from_tp(*xw, comm), (x, w), tp=TP, mode="vmap")
    assert out.shape == (TP, 2, 128, 256)
    np.testing.assert_array_equal(out.reshape(flat.shape), flat)


@pytest.mark.parametrize("mode", MODES)
def test_copy_matmul_is_f_then_the_product_bit_for_bit_where_unfused(mode):
    """`copy_matmul_to_tp(x, w)`: forward `copy_to_tp(x) @ w`; backward the all-reduce of the
    input gradient ct @ w^T with its product encoded by the matmul's path (here unfused: the
    same groups in another order), the weight's gradient as autodiff's."""
    comm = tj.TPComm.create(fwd="none", bwd="taco", algorithm="one_shot", min_compress_bytes=0)
    kx, kw, kc = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (256, 128), jnp.float32).astype(jnp.bfloat16)  # replicated
    w = (0.1 * jax.random.normal(kw, (TP, 128, 256), jnp.float32)).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (TP, 256, 256), jnp.float32).astype(jnp.bfloat16)

    def per_rank(op):
        def run(wct):
            w, ct = wct
            loss = lambda x, w: jnp.sum((op(x, w) * ct).astype(jnp.float32))  # noqa: E731
            return op(x, w), jax.grad(loss, argnums=(0, 1))(x, w)

        return run

    fused = run_tp(per_rank(lambda x, w: tj.copy_matmul_to_tp(x, w, comm)), (w, ct), tp=TP,
                   mode=mode)  # fmt: skip
    plain = run_tp(per_rank(lambda x, w: tj.copy_to_tp(x, comm) @ w), (w, ct), tp=TP, mode=mode)
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(got, want)
    exact = tj.TPComm.create(fwd="none")
    exact_dx = run_tp(per_rank(lambda x, w: tj.copy_to_tp(x, exact) @ w), (w, ct), tp=TP,
                      mode=mode)[1][0]  # fmt: skip
    assert not np.array_equal(fused[1][0], exact_dx)  # the input gradient was compressed


def test_a_mixed_precision_product_keeps_its_dtype(encodes):
    """bf16 x and an fp32 weight: the product, its sum and the gradients are fp32, as those of
    `reduce_from_tp(x @ w)`, and the same bits."""
    comm = tj.TPComm.create(fwd="taco", algorithm="one_shot", min_compress_bytes=0)
    x, w, ct = _problem(256, 64, 256)
    w, ct = w.astype(jnp.float32), ct.astype(jnp.float32)
    fused = _out_and_grads(lambda x, w: tj.reduce_matmul_from_tp(x, w, comm), x, w, ct, "vmap")
    plain = _out_and_grads(lambda x, w: tj.reduce_from_tp(x @ w, comm), x, w, ct, "vmap")
    assert encodes and fused[0].dtype == jnp.float32
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
