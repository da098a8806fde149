"""The public collectives inside a partial `shard_map` of a GSPMD program (docs/gspmd.md).

A (dp, tp) mesh of 8 CPU devices; plain `jax.jit` with in/out shardings; the collectives run in
`jax.shard_map(..., axis_names={"tp"})`, dp left to the compiler, on meshes of `Auto` and of
`Explicit` axes (`jax.make_mesh`'s default). Codec "none" must equal the lax collectives bit
for bit; "taco" must stay within the per-rank bounds of test_collectives.py (module doc there):
a dp block is a disjoint set of elements, and by Minkowski's inequality the per-block bounds
sum_r ||x_{r,b}|| + ||s_b|| combine, in quadrature over the blocks b, to at most the same bound
written with the whole arrays, sum_r ||x_r|| + ||s||; so the bounds below use whole arrays.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_testing import collectives
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax.collectives import varies_along

U = 2.0**-4  # E4M3's relative rounding error (test_collectives.py)
AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
slow = pytest.mark.slow
# (dp, tp, axis type): one fast layout, the others in the slow tier.
LAYOUTS = [
    pytest.param(2, 4, EXPLICIT, id="dp2-tp4-explicit"),
    pytest.param(2, 4, AUTO, id="dp2-tp4-auto", marks=slow),
    pytest.param(4, 2, EXPLICIT, id="dp4-tp2-explicit", marks=slow),
    pytest.param(4, 2, AUTO, id="dp4-tp2-auto", marks=slow),
]


def _mesh(dp, tp, axis_type):
    return jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(axis_type, axis_type))


def _dyadic(key, shape):
    """Values in {-1, -1/2, 0, 1/2, 1}: every fp32 product and sum below is exact."""
    return (jax.random.randint(key, shape, -2, 3) / 2).astype(jnp.float32)


def _norm(a) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64).ravel()))


# ------------------------------------------------------------------------ a Megatron MLP


def _mlp_problem(batch=8, d=16, f=64):
    keys = jax.random.split(jax.random.key(3), 4)
    shapes = [(batch, d), (d, f), (f, d), (batch, d)]
    return tuple(_dyadic(k, s) for k, s in zip(keys, shapes, strict=True))  # x, w1, w2, ct


def _mlp_step(mesh, codec):
    """jit(value_and_grad) of sum(MLP(x) * ct): f, column-parallel W1, ReLU, row-parallel W2,
    g inside a shard_map manual over tp; the batch sharded over dp by the compiler."""
    comm = None if codec == "lax" else tj.TPComm.create(fwd=codec)

    def block(x, w1, w2):  # x [B, D] (dp left to the compiler), w1 [D, F/N], w2 [F/N, D]
        if comm is None:  # shard_map's implicit pvary of x transposes to lax.psum (Megatron f)
            return lax.psum(jax.nn.relu(x @ w1) @ w2, "tp")
        return tj.reduce_from_tp(jax.nn.relu(tj.copy_to_tp(x, comm) @ w1) @ w2, comm)

    mlp = jax.shard_map(
        block,
        mesh=mesh,
        in_specs=(P(), P(None, "tp"), P("tp", None)),
        out_specs=P(),
        axis_names={"tp"},
    )

    def loss(x, w1, w2, ct):
        return jnp.sum(mlp(x, w1, w2) * ct)

    specs = (P("dp", None), P(None, "tp"), P("tp", None), P("dp", None))
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    grads = jax.value_and_grad(loss, argnums=(0, 1, 2))
    return jax.jit(grads, in_shardings=shardings, out_shardings=(None, shardings[:3])), shardings


def _run_mlp(mesh, codec):
    step, shardings = _mlp_step(mesh, codec)
    args = jax.device_put(_mlp_problem(), shardings)
    with jax.set_mesh(mesh):
        loss, grads = step(*args)
    return np.asarray(loss), [np.asarray(g) for g in grads]


@pytest.mark.parametrize(("dp", "tp", "axis_type"), LAYOUTS)
def test_megatron_mlp_none_equals_lax(dp, tp, axis_type):
    mesh = _mesh(dp, tp, axis_type)
    loss, grads = _run_mlp(mesh, "none")
    ref_loss, ref_grads = _run_mlp(mesh, "lax")
    np.testing.assert_array_equal(loss, ref_loss)
    for ours, theirs in zip(grads, ref_grads, strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(("dp", "tp", "axis_type"), LAYOUTS)
def test_megatron_mlp_taco_within_bound(dp, tp, axis_type):
    """As test_collectives.test_megatron_mlp_gradients_with_taco, on the GSPMD mesh."""
    loss, (dx, dw1, dw2) = _run_mlp(_mesh(dp, tp, axis_type), "taco")
    x, w1, w2, ct = (np.asarray(a, np.float64) for a in _mlp_problem())
    w1s, w2s = np.split(w1, tp, 1), np.split(w2, tp, 0)
    partials = [np.maximum(x @ a, 0) @ b for a, b in zip(w1s, w2s, strict=True)]
    y = sum(partials)
    # The loss is linear in y and g's backward is the identity: dL/dy = ct exactly, and the
    # weight gradients see no compression (dyadic values: exact sums).
    np.testing.assert_array_equal(dw1, (x.T @ ((ct @ w2.T) * (x @ w1 > 0))).astype(np.float32))
    np.testing.assert_array_equal(dw2, (np.maximum(x @ w1, 0).T @ ct).astype(np.float32))
    y_bound = U * (1 + U) * sum(map(_norm, partials)) + U * _norm(y)
    assert 0 < abs(float(loss) - float(np.sum(y * ct))) <= 1.01 * y_bound * _norm(ct)
    dx_parts = [((ct @ b.T) * (x @ a > 0)) @ a.T for a, b in zip(w1s, w2s, strict=True)]
    dx_bound = U * (1 + U) * sum(map(_norm, dx_parts)) + U * _norm(sum(dx_parts))
    assert 0 < _norm(dx - sum(dx_parts)) <= 1.01 * dx_bound


# ------------------------------------------------------------------------ every collective


def _collectives(codec, tp):
    """Per tp rank: psum, psum_scatter, all_gather and ppermute of v [B, 2N, D], with codec
    (or lax itself for "lax")."""
    shift = [(r, (r + 1) % tp) for r in range(tp)]
    if codec == "lax":
        return (
            lambda v: lax.psum(v, "tp"),
            lambda v: lax.psum_scatter(v, "tp", scatter_dimension=1, tiled=True),
            lambda v: lax.all_gather(v, "tp", axis=1, tiled=True),
            lambda v: lax.ppermute(v, "tp", shift),
        )
    return (
        lambda v: tj.compressed_psum(v, "tp", codec=codec),
        lambda v: tj.compressed_psum_scatter(v, "tp", scatter_dimension=1, codec=codec),
        lambda v: tj.compressed_all_gather(v, "tp", axis=1, tiled=True, codec=codec),
        lambda v: tj.compressed_ppermute(v, "tp", shift, codec=codec),
    )


def _scanned(op):
    """op applied to x and x / 2 as two layers of a `lax.scan` whose body is rematerialized
    (`jax.checkpoint`), the two outputs summed: the layout of a scanned model, whose backward
    partially evaluates the collective's own shard_map."""

    def body(carry, x):
        return carry, op(x)

    def scanned(x):
        _, ys = lax.scan(jax.checkpoint(body), 0.0, jnp.stack([x, x / 2]))
        return ys[0] + ys[1]

    return scanned


def _collective_vjps(mesh, codec, xs, cts, *, scanned=False):
    """Each collective's output and input cotangent, per tp rank: xs[i] and cts[i] are
    [N, B, ...] (rank r's block at [r], B sharded over dp); `scanned`: through `_scanned`."""
    tp = mesh.shape["tp"]

    def per_rank(op, x, ct):
        out, vjp = jax.vjp(_scanned(op) if scanned else op, x[0])
        ct = ct[0]
        if not varies_along(out, "tp"):  # psum's output is typed replicated:
            # its cotangent must be too; rank 0's, exactly (a sum with zeros)
            ct = lax.psum(jnp.where(lax.axis_index("tp") == 0, ct, 0), "tp")
        return out[None], vjp(ct)[0][None]

    def body(xs, cts):
        ops = _collectives(codec, tp)
        return tuple(per_rank(*args) for args in zip(ops, xs, cts, strict=True))

    spec = P("tp")  # manual over tp; the batch's dp sharding is the compiler's
    mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, axis_names={"tp"})
    sharding = NamedSharding(mesh, P("tp", "dp"))
    step = jax.jit(mapped, in_shardings=sharding, out_shardings=sharding)
    with jax.set_mesh(mesh):
        outs = step(*jax.device_put((tuple(xs), tuple(cts)), sharding))
    return [tuple(np.asarray(a) for a in out) for out in outs]


def _collective_problem(tp, batch=8, d=24):
    keys = jax.random.split(jax.random.key(tp), 8)
    rows = 2 * tp
    in_shapes = [(batch, rows, d), (batch, rows, d), (batch, 2, d), (batch, rows, d)]
    ct_shapes = [(batch, rows, d), (batch, 2, d), (batch, rows, d), (batch, rows, d)]
    xs = [jax.random.normal(k, (tp, *s)) for k, s in zip(keys[:4], in_shapes, strict=True)]
    cts = [jax.random.normal(k, (tp, *s)) for k, s in zip(keys[4:], ct_shapes, strict=True)]
    return xs, cts


SCANNED = [pytest.param(False, id="plain"), pytest.param(True, id="scanned")]


@pytest.mark.parametrize("scanned", SCANNED)
@pytest.mark.parametrize(("dp", "tp", "axis_type"), LAYOUTS)
def test_every_collective_none_equals_lax(dp, tp, axis_type, scanned):
    """The lax reference runs on the `Auto` mesh of the same devices: on `Explicit` axes jax
    0.11.2 cannot lower `lax.psum_scatter` (nor all_gather's transpose) in a partial shard_map
    (`_reduce_scatter_lowering`), where the compressed ops run (on each device's block)."""
    xs, cts = _collective_problem(tp)
    ours = _collective_vjps(_mesh(dp, tp, axis_type), "none", xs, cts, scanned=scanned)
    theirs = _collective_vjps(_mesh(dp, tp, AUTO), "lax", xs, cts, scanned=scanned)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scanned", SCANNED)
@pytest.mark.parametrize(("dp", "tp", "axis_type"), LAYOUTS)
def test_every_collective_taco_within_bound(dp, tp, axis_type, scanned):
    """Bounds per collective (module doc of test_collectives.py), forward and backward.
    Scanned (`_scanned`), the op runs on x and on x / 2 (halving is exact) with the same
    cotangent, each within its bound, which is linear in the inputs' norms: 1.5 times one."""
    mesh = _mesh(dp, tp, axis_type)
    xs, cts = _collective_problem(tp)
    ours = _collective_vjps(mesh, "taco", xs, cts, scanned=scanned)
    exact = _collective_vjps(_mesh(dp, tp, AUTO), "lax", xs, cts, scanned=scanned)  # as above
    layers = 1.5 if scanned else 1.0
    (x_ps, x_rs, x_ag, x_pp), (_, ct_rs, ct_ag, ct_pp) = xs, cts

    def ranks(a):  # sum_r ||a_r||
        return sum(_norm(a[r]) for r in range(tp))

    # Where every rank holds the same result (psum, all-gather), the error over the N ranks'
    # outputs is sqrt(N) times one rank's.
    copies = math.sqrt(tp)
    two_shot = U * (1 + U) * ranks(x_ps) + U * _norm(exact[0][0][0])
    bounds = [
        # psum: two-shot forward; backward the identity (its output is typed replicated).
        (copies * two_shot, 0.0),
        # psum_scatter: one quantization per rank; backward an all-gather of every rank's ct.
        (U * ranks(x_rs), copies * U * _norm(ct_rs)),
        # all_gather: every rank decodes the whole gathered x, ||err|| <= u ||x||; backward a
        # reduce-scatter.
        (copies * U * _norm(x_ag), U * ranks(ct_ag)),
        # ppermute: one quantization each way.
        (U * ranks(x_pp), U * ranks(ct_pp)),
    ]
    for name, (out, grad), (ref_out, ref_grad), (out_bound, grad_bound) in zip(
        ("psum", "psum_scatter", "all_gather", "ppermute"), ours, exact, bounds, strict=True
    ):
        out_bound, grad_bound = layers * out_bound, layers * grad_bound
        out_err, grad_err = _norm(out - ref_out), _norm(grad - ref_grad)
        assert 0 < out_err <= 1.01 * out_bound, (name, out_err, out_bound)
        assert grad_err <= 1.01 * grad_bound, (name, grad_err, grad_bound)
        assert grad_bound == 0 or grad_err > 0, name  # rounding really happened


# ------------------------------------------------------------------------ the compiled program


@pytest.mark.parametrize("axis_type", [EXPLICIT, pytest.param(AUTO, marks=slow)])
def test_hlo_u8_over_tp_and_the_compilers_own_over_dp(axis_type):
    """The MLP's step moves u8 wire over tp only (TACO) and lets the compiler reduce the
    gradients over dp (f32); nothing else crosses devices. (Before the codec ran on each
    device's block, an `Auto` dp axis gathered the wire across dp.)"""
    mesh = _mesh(2, 4, axis_type)
    step, shardings = _mlp_step(mesh, "taco")
    with jax.set_mesh(mesh):
        hlo = step.lower(*jax.device_put(_mlp_problem(), shardings)).compile().as_text()
    found = collectives(hlo, mesh)
    assert found == {
        ("all-to-all", "tp", frozenset({"u8"})),
        ("all-gather", "tp", frozenset({"u8"})),
        ("all-reduce", "dp", frozenset({"f32"})),
    }, found


# ------------------------------------------------------------------------ taco_jax.gspmd


def _dense_mlp(codec):
    comm = tj.TPComm.create(fwd=codec)

    def loss(x, w1, w2, ct):
        h = jax.nn.relu(tj.gspmd.column_parallel_dense(x, w1, comm))
        return jnp.sum(tj.gspmd.row_parallel_dense(h, w2, comm) * ct)

    return loss


def _plain_mlp(x, w1, w2, ct):
    # Explicit axes make GSPMD's reduction over tp a typed choice: y is replicated over tp.
    explicit = jax.sharding.get_abstract_mesh().are_all_axes_explicit
    y = jnp.matmul(jax.nn.relu(x @ w1), w2, out_sharding=P("dp", None) if explicit else None)
    return jnp.sum(y * ct)


@pytest.mark.parametrize("axis_type", [EXPLICIT, pytest.param(AUTO, marks=slow)])
def test_dense_layers_equal_plain_jax(axis_type):
    """With codec "none" the dense layers are `x @ w` and its gradients, bit for bit (dyadic
    values: every sum exact, in any order); with "taco" the loss moves within the all-reduce
    bound of the MLP test above, and dx within the backward all-reduce's."""
    mesh = _mesh(2, 4, axis_type)
    specs = (P("dp", None), P(None, "tp"), P("tp", None), P("dp", None))
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    args = jax.device_put(_mlp_problem(), shardings)
    results = {}
    with jax.set_mesh(mesh):
        for name, fn in (
            ("plain", _plain_mlp),
            ("none", _dense_mlp("none")),
            ("taco", _dense_mlp("taco")),
        ):
            step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)), in_shardings=shardings)
            results[name] = jax.tree.map(np.asarray, step(*args))
    for ours, theirs in zip(
        jax.tree.leaves(results["none"]), jax.tree.leaves(results["plain"]), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)
    x, w1, w2, ct = (np.asarray(a, np.float64) for a in _mlp_problem())
    w1s, w2s = np.split(w1, 4, 1), np.split(w2, 4, 0)
    partials = [np.maximum(x @ a, 0) @ b for a, b in zip(w1s, w2s, strict=True)]
    y_bound = U * (1 + U) * sum(map(_norm, partials)) + U * _norm(sum(partials))
    loss, (dx, _, _) = results["taco"]
    assert 0 < abs(float(loss) - float(results["plain"][0])) <= 1.01 * y_bound * _norm(ct)
    dx_parts = [((ct @ b.T) * (x @ a > 0)) @ a.T for a, b in zip(w1s, w2s, strict=True)]
    dx_bound = U * (1 + U) * sum(map(_norm, dx_parts)) + U * _norm(sum(dx_parts))
    assert 0 < _norm(dx - results["plain"][1][0]) <= 1.01 * dx_bound


def test_dense_layers_name_bad_shapes():
    comm = tj.TPComm.create(fwd="none")
    with pytest.raises(ValueError, match=r"x.shape=\(2, 3\) @ w.shape=\(4, 8\)"):
        tj.gspmd.row_parallel_dense(jnp.ones((2, 3)), jnp.ones((4, 8)), comm)


@slow
def test_telemetry_records_on_an_explicit_mesh():
    """telemetry=True runs the exact psum beside the compressed one and reports their relative
    error (its sums need no reshape of the dp-sharded arrays); two-shot's bound over its size."""
    mesh = _mesh(2, 4, EXPLICIT)
    x = jax.device_put(
        jax.random.normal(jax.random.key(5), (4, 8, 64)), NamedSharding(mesh, P("tp", "dp"))
    )
    psum = lambda v: tj.compressed_psum(v[0], "tp", telemetry=True, name="gspmd")[None]
    step = jax.jit(
        jax.shard_map(psum, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), axis_names={"tp"})
    )
    tj.telemetry.drain()
    with jax.set_mesh(mesh):
        step(x).block_until_ready()
    recorded = tj.telemetry.drain()
    parts = np.asarray(x, np.float64)
    bound = (U * (1 + U) * sum(map(_norm, parts)) + U * _norm(parts.sum(0))) / _norm(parts.sum(0))
    assert set(recorded) == {"gspmd/fwd"} and 0 < recorded["gspmd/fwd"].error <= 1.01 * bound
