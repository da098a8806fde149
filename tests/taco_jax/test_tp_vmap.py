"""Megatron's operators under `jax.grad` around `jax.vmap(..., axis_name="tp")` (a TP group
emulated on one device) equal the same program under `jax.grad` around `jax.shard_map`, where an
input the vmap shares (`in_axes=None`) is a replicated input (`P()`) and a batched one each
rank's own block (`P("tp")`): JAX's pvary transposes to a psum there, so a shared input gets the
ranks' summed gradient once, and each rank's own copy gets it whole
(docs/decisions/022-copy-to-tp-around-vmap.md).

Values are dyadic and every matmul is exact, so codec "none" agrees bit for bit (exact in any
order, any program), and so do the gradients no codec touches. With "taco" the two programs run
the codec's encode, exchange and decode-sum on the same values, but two programs need not round
alike (XLA may order the Hadamard's sums or contract an FMA differently): each program's
gradients are checked against the exact ones within the codec's bound (`_taco_bounds`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj

N = 4


def _dyadic(key, shape):
    return (jax.random.randint(key, shape, -2, 3) / 2).astype(jnp.float32)


def _copy(x, w, comm):  # x [B, D] -> [B, F/N]: f, then a column-parallel matmul
    return tj.copy_to_tp(x, comm) @ w


def _gather(x, w, comm):  # x [B, T/N, D] -> [B, T, F]: the sequence-parallel entry
    return tj.gather_from_sp(x, comm, axis=1) @ w


def _scatter(x, w, comm):  # x [B, T, D] -> [B, T/N, F]: the sequence-parallel exit
    return tj.scatter_to_sp(x @ w, comm, axis=1)


def _reduce(x, w, comm):  # x [B, D] -> [B, F]: a row-parallel matmul, then g
    return tj.reduce_from_tp(x @ w, comm)


OPS = {  # op, x's shape per rank, w's shape per rank
    "copy_to_tp": (_copy, (4, 8), (8, 6)),
    "gather_from_sp": (_gather, (2, 3, 8), (8, 6)),
    "scatter_to_sp": (_scatter, (2, 4 * N, 8), (8, 6)),
    "reduce_from_tp": (_reduce, (4, 8), (8, 6)),
}


def _problem(op, batched):
    fn, x_shape, w_shape = OPS[op]
    keys = jax.random.split(jax.random.key(len(op)), 3)
    x = _dyadic(keys[0], ((N,) if batched else ()) + x_shape)
    ws = _dyadic(keys[1], (N, *w_shape))
    comm = tj.TPComm.create(fwd="none")
    ranks = lambda x, ws: jax.vmap(lambda w: fn(x, w, comm), axis_name="tp")(ws)
    cts = _dyadic(keys[2], jax.eval_shape(ranks, jnp.zeros(x_shape), ws).shape)  # [N, ...]
    return fn, x, ws, cts


def _around_vmap(fn, comm, batched):
    def loss(x, ws, cts):
        per_rank = lambda x, w, ct: jnp.sum(fn(x, w, comm) * ct)
        return jnp.sum(
            jax.vmap(per_rank, in_axes=(0 if batched else None, 0, 0), axis_name="tp")(x, ws, cts)
        )

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _around_shard_map(fn, comm, batched):
    mesh = jax.make_mesh((N,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:N])
    x_spec = P("tp") if batched else P()

    def per_rank(x, w, ct):
        x = x[0] if batched else x
        return jnp.sum(fn(x, w[0], comm) * ct[0])[None]

    def loss(x, ws, cts):
        mapped = jax.shard_map(
            per_rank, mesh=mesh, in_specs=(x_spec, P("tp"), P("tp")), out_specs=P("tp")
        )
        return jnp.sum(mapped(x, ws, cts))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))

    def run(x, ws, cts):
        with jax.set_mesh(mesh):
            placed = (
                jax.device_put(x, NamedSharding(mesh, x_spec)),
                *jax.device_put((ws, cts), NamedSharding(mesh, P("tp"))),
            )
            return grads(*placed)

    return run


def _cases():
    """Every operator, shared and batched, with "none"; with "taco" every operator batched, and
    shared where no further sum follows the codec (a shared x's gradient under the SP operators
    sums the ranks' decoded cotangents once more, which the "none" cases check)."""
    cases = [(op, b, "none") for op in OPS for b in (False, True)]
    cases += [(op, True, "taco") for op in OPS]
    cases += [(op, False, "taco") for op in ("copy_to_tp", "reduce_from_tp")]
    fast = {
        ("copy_to_tp", False, "none"),
        ("copy_to_tp", True, "none"),
        ("gather_from_sp", False, "none"),
    }
    return [
        pytest.param(
            *c,
            id=f"{c[0]}-{'batched' if c[1] else 'shared'}-{c[2]}",
            marks=() if c in fast else pytest.mark.slow,
        )
        for c in cases
    ]


U = 2.0**-4  # E4M3's relative rounding error (tests/taco_jax/test_collectives.py)


def _taco_bounds(op, batched, x, ws, cts) -> tuple[float, float]:
    """Bounds on ||taco gradient - exact gradient|| (Frobenius; dx, dw) with the bounds of
    test_collectives.py's module doc: an all-gather errs by <= U ||x||, a reduce-scatter by
    <= U sum_r ||x_r||, a two-shot all-reduce by <= U (1 + U) sum_r ||x_r|| + U ||sum_r x_r||;
    a matmul after the codec multiplies its error by at most the other factor's norm. The loss
    is linear in the output, so a forward codec (g, the reduce-scatter of scatter_to_sp) moves
    no gradient; 0: no codec on that gradient (exact, dyadic)."""
    norm = lambda a: float(np.linalg.norm(np.asarray(a, np.float64)))  # noqa: E731
    x, ws, cts = (np.asarray(a, np.float64) for a in (x, ws, cts))
    xs = x if batched else np.broadcast_to(x, (N, *x.shape))  # each rank's x
    if op == "copy_to_tp":  # backward: the all-reduce of ct_r w_r^T, each rank's (or once)
        parts = [cts[r] @ ws[r].T for r in range(N)]
        reduce = U * (1 + U) * sum(map(norm, parts)) + U * norm(sum(parts))
        return (np.sqrt(N) if batched else 1) * reduce, 0.0
    if op == "gather_from_sp":  # forward all-gather of x; backward reduce-scatter of ct_r w_r^T
        scattered = U * sum(norm(cts[r] @ ws[r].T) for r in range(N))
        return (1 if batched else np.sqrt(N)) * scattered, U * norm(xs) * norm(cts)
    if op == "scatter_to_sp":  # backward: the all-gather of ct, then @ w_r^T and x_r^T @
        gathered = U * norm(cts)
        dx = gathered * (norm(ws) if batched else sum(norm(w) for w in ws))
        return dx, gathered * norm(xs)
    return 0.0, 0.0  # reduce_from_tp: g's backward is the identity


@pytest.mark.parametrize(("op", "batched", "codec"), _cases())
def test_grad_around_vmap_equals_grad_around_shard_map(op, batched, codec):
    comm = tj.TPComm.create(fwd=codec, min_compress_bytes=0)
    fn, x, ws, cts = _problem(op, batched)
    ours = _around_vmap(fn, comm, batched)(x, ws, cts)
    theirs = _around_shard_map(fn, comm, batched)(x, ws, cts)
    if codec == "none":
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        return
    exact = _around_vmap(fn, tj.TPComm.create(fwd="none"), batched)(x, ws, cts)
    bounds = _taco_bounds(op, batched, x, ws, cts)
    for a, b, e, bound in zip(ours, theirs, exact, bounds, strict=True):
        for program in (a, b):
            error = float(np.linalg.norm(np.asarray(program, np.float64) - np.asarray(e)))
            if bound == 0:
                np.testing.assert_array_equal(np.asarray(program), np.asarray(e))
            else:
                assert 0 < error <= 1.01 * bound, (error, bound)


def test_shared_input_gets_the_summed_gradient_once():
    """copy_to_tp's x shared by the vmap: dx is sum_r ct_r @ w_r^T, not N times it."""
    comm = tj.TPComm.create(fwd="none")
    fn, x, ws, cts = _problem("copy_to_tp", batched=False)
    dx, _ = _around_vmap(fn, comm, batched=False)(x, ws, cts)
    expected = sum(np.asarray(cts[r]) @ np.asarray(ws[r]).T for r in range(N))
    np.testing.assert_array_equal(np.asarray(dx), expected)
