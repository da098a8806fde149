"""Models as MaxText, Levanter and `nnx.scan` write them (docs/gspmd.md): parameters stacked over
layers, the block run under `lax.scan` inside `jax.checkpoint`, on a ("data", "fsdp", "tensor")
mesh of 8 CPU devices with the weights sharded over fsdp and tensor as they come, under
`jax.jit(jax.value_and_grad(...))`, on `Auto` and `Explicit` axes.

- Codec "none": loss and gradients equal the plain GSPMD model's bit for bit (dyadic values:
  every product and sum below is exact in fp32, in any order).
- Codec "taco": each layer's compressed sums stay within the all-reduce bound of
  test_gspmd.py (module doc there), forward (g) and backward (f), checked layer by layer on the
  values the scanned program itself saw; the weight gradients, computed from those values by
  the uncompressed matmuls, within fp32 dot-product rounding.
- An optax step keeps every parameter's and gradient's sharding, and the compiled step moves
  uint8 over "tensor" and nothing else.
- Scanned or unrolled, a tanh model with codec "taco" computes its layers, loss and gradients
  within those bounds, each program on its own (two programs need not round alike).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo_testing import collectives
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tiers import tiered

import taco_jax as tj
from taco_jax.gspmd import column_parallel_dense, row_parallel_dense

U = 2.0**-4  # E4M3's relative rounding error (test_collectives.py)
AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
slow = pytest.mark.slow
LAYERS, BATCH, D, F = 2, 8, 16, 32
SPECS = {  # MaxText's layout: the layer axis unsharded, fsdp on the embedding, tensor on F
    "w_up": P(None, "fsdp", "tensor"),  # [L, D, F]
    "w_down": P(None, "tensor", "fsdp"),  # [L, F, D]
}
BATCH_SPEC = P(("data", "fsdp"))
POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
    "save_names": jax.checkpoint_policies.save_only_these_names("tp_reduce", "tp_copy"),
}


def _mesh(axis_type, shape=(2, 2, 2), names=("data", "fsdp", "tensor")):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def _dyadic(key, shape):
    """Values in {-1, -1/2, 0, 1/2, 1}."""
    return (jax.random.randint(key, shape, -2, 3) / 2).astype(jnp.float32)


def _problem():
    keys = jax.random.split(jax.random.key(59), 4)
    params = {"w_up": _dyadic(keys[0], (LAYERS, D, F)), "w_down": _dyadic(keys[1], (LAYERS, F, D))}
    return params, _dyadic(keys[2], (BATCH, D)), _dyadic(keys[3], (BATCH, D))  # params, x, ct


def _put(mesh, params, *batch, batch_spec=BATCH_SPEC):
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
    return params, *(jax.device_put(b, NamedSharding(mesh, batch_spec)) for b in batch)


def _plain_block(x, w_up, w_down):  # GSPMD's own: the compiler all-reduces over tensor
    explicit = jax.sharding.get_abstract_mesh().are_all_axes_explicit
    if explicit:  # FSDP's all-gather of the weights, a typed choice on Explicit axes
        w_up = jax.sharding.reshard(w_up, P(None, "tensor"))
        w_down = jax.sharding.reshard(w_down, P("tensor", None))
    h = jax.nn.relu(x @ w_up)
    return x + jnp.matmul(h, w_down, out_sharding=jax.typeof(x).sharding.spec if explicit else None)


def _taco_block(comm):
    def block(x, w_up, w_down):  # x [B, D], w_up [D, F], w_down [F, D]
        h = jax.nn.relu(column_parallel_dense(x, w_up, comm))
        return x + row_parallel_dense(h, w_down, comm)

    return block


def _model(block, policy):
    """loss(params, x, ct, probes): the scanned, rematerialized stack; `probes` [L, B, D] are
    zeros added to each layer's input, so that their gradients are the cotangents there. The
    auxiliary output holds each layer's input."""

    def loss(params, x, ct, probes):
        def body(x, layer):
            x = x + layer["probe"]
            return block(x, layer["w_up"], layer["w_down"]), x

        body = jax.checkpoint(body, policy=policy)
        y, inputs = lax.scan(body, x, dict(params, probe=probes))
        return jnp.sum(y * ct), inputs

    return loss


def _step(mesh, block, policy):
    grads = jax.value_and_grad(_model(block, policy), argnums=(0, 1, 3), has_aux=True)
    return jax.jit(grads)


def _run(mesh, block, policy=POLICIES["nothing_saveable"], batch_spec=BATCH_SPEC):
    params, x, ct = _problem()
    with jax.set_mesh(mesh):
        params, x, ct = _put(mesh, params, x, ct, batch_spec=batch_spec)
        probes = jnp.zeros((LAYERS, BATCH, D))
        probes = jax.device_put(probes, NamedSharding(mesh, P(None, *batch_spec)))
        (loss, inputs), grads = _step(mesh, block, policy)(params, x, ct, probes)
    return jax.tree.map(np.asarray, (loss, inputs, grads))


def _cases():
    cases = [(a, p) for a in (EXPLICIT, AUTO) for p in POLICIES]
    return tiered(
        cases, fast=[(EXPLICIT, "checkpoint_dots")], ids=lambda c: f"{c[0].name.lower()}-{c[1]}"
    )


@pytest.mark.parametrize(("axis_type", "policy"), _cases())
def test_scanned_model_none_equals_plain_gspmd(axis_type, policy):
    mesh = _mesh(axis_type)
    comm = tj.TPComm.create("tensor", fwd="none")
    ours = _run(mesh, _taco_block(comm), POLICIES[policy])
    theirs = _run(mesh, _plain_block, POLICIES[policy])
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)


def _all_reduce_bound(parts):
    """test_gspmd.py's two-shot all-reduce bound of sum(parts)."""
    norm = lambda a: float(np.linalg.norm(a.ravel()))
    return U * (1 + U) * sum(map(norm, parts)) + U * norm(sum(parts))


def _dot_bound(a, b):
    """|fl(a @ b) - a @ b| <= gamma_n |a| @ |b| elementwise, gamma_n = n u / (1 - n u), fp32's
    unit roundoff u = 2^-24, n the contraction length (Higham, Accuracy and Stability, 3.5)."""
    n, u = a.shape[-1], 2.0**-24
    return n * u / (1 - n * u) * (np.abs(a) @ np.abs(b))


@slow
@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO])
def test_scanned_model_taco_within_bound_layer_by_layer(axis_type):
    """Layer l, with input x_l (what the scan saw) and output cotangent c_l (the probe's
    gradient at layer l+1, ct after the last): forward g sums the ranks' partials
    relu(x_l W1_r) W2_r, backward f sums ((c_l W2_r^T) * relu'(x_l W1_r)) W1_r^T; each within
    the all-reduce bound of its partials. Weight gradients from x_l and c_l within fp32
    rounding of their matmuls."""
    mesh = _mesh(axis_type)
    comm = tj.TPComm.create("tensor", fwd="taco", bwd="taco")
    loss, inputs, (dparams, dx, dprobes) = _run(mesh, _taco_block(comm))
    params, x, ct = (jax.tree.map(lambda a: np.asarray(a, np.float64), v) for v in _problem())
    tp = mesh.shape["tensor"]
    outputs = list(inputs[1:])  # layer l's output is layer l+1's input
    cts = list(dprobes[1:]) + [ct]  # the cotangent of layer l's output
    final = None
    for layer in range(LAYERS):
        xl, cl = np.asarray(inputs[layer], np.float64), np.asarray(cts[layer], np.float64)
        w1s = np.split(params["w_up"][layer], tp, 1)
        w2s = np.split(params["w_down"][layer], tp, 0)
        fwd = [np.maximum(xl @ a, 0) @ b for a, b in zip(w1s, w2s, strict=True)]
        out = xl + sum(fwd)
        ours = outputs[layer] if layer + 1 < LAYERS else None
        if ours is not None:
            err = np.linalg.norm(ours - out)
            assert 0 < err <= 1.01 * _all_reduce_bound(fwd), (layer, err)
        else:
            final = (out, _all_reduce_bound(fwd))
        bwd = [((cl @ b.T) * (xl @ a > 0)) @ a.T for a, b in zip(w1s, w2s, strict=True)]
        err = np.linalg.norm(dprobes[layer] - (cl + sum(bwd)))
        assert 0 < err <= 1.01 * _all_reduce_bound(bwd), (layer, err)
        w_up, w_down = params["w_up"][layer], params["w_down"][layer]
        h = np.maximum(xl @ w_up, 0)
        dh = (cl @ w_down.T) * (h > 0)
        # The program's h and dh carry their own matmuls' rounding into the weight gradients.
        h_err, dh_err = _dot_bound(xl, w_up), _dot_bound(cl, w_down.T)
        up_bound = np.abs(xl.T) @ dh_err + _dot_bound(xl.T, np.abs(dh) + dh_err)
        down_bound = h_err.T @ np.abs(cl) + _dot_bound((h + h_err).T, cl)
        assert np.all(np.abs(dparams["w_up"][layer] - xl.T @ dh) <= 1.01 * up_bound), layer
        assert np.all(np.abs(dparams["w_down"][layer] - h.T @ cl) <= 1.01 * down_bound), layer
    out, bound = final
    flat = lambda a: a.reshape(1, -1)  # the loss, a dot product of y and ct, and its rounding
    loss_bound = bound * np.linalg.norm(ct) + _dot_bound(flat(out), flat(ct).T).item()
    assert 0 < abs(float(loss) - float(np.sum(out * ct))) <= 1.01 * loss_bound
    np.testing.assert_array_equal(dx, dprobes[0])  # x enters as layer 0's input


def _train_step(mesh, block, policy):
    """An AdamW step of the scanned model (mean squared error to a target)."""
    optimizer = optax.adamw(1e-2)

    def loss_fn(params, x, target):
        def body(x, layer):
            return block(x, layer["w_up"], layer["w_down"]), None

        y, _ = lax.scan(jax.checkpoint(body, policy=policy), x, params)
        return jnp.mean((y - target) ** 2)

    @jax.jit
    def step(params, opt_state, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return optimizer, step


def _spec(a) -> P:
    return P(*a.sharding.spec)


@pytest.mark.parametrize("axis_type", [EXPLICIT, pytest.param(AUTO, marks=slow)])
def test_optax_step_keeps_shardings_and_moves_uint8_over_tensor(axis_type):
    """Every parameter, gradient and optimizer moment keeps the parameter's sharding through
    a jitted AdamW step (on `Auto` axes the compiler's choice; on `Explicit` ones the type); the
    compiled step's collectives over "tensor" move uint8 codes only (two-shot: all-to-all then
    all-gather of the wire), all else is the compiler's FSDP and data-parallel traffic."""
    mesh = _mesh(axis_type)
    comm = tj.TPComm.create("tensor", fwd="taco")
    optimizer, step = _train_step(mesh, _taco_block(comm), POLICIES["checkpoint_dots"])
    params, x, target = _problem()
    with jax.set_mesh(mesh):
        params, x, target = _put(mesh, params, x, target)
        opt_state = optimizer.init(params)
        compiled = step.lower(params, opt_state, x, target).compile()
        new_params, new_state, loss, grads = compiled(params, opt_state, x, target)
    assert np.isfinite(float(loss))
    for tree in (new_params, grads, new_state[0].mu, new_state[0].nu):
        assert {k: _spec(v) for k, v in tree.items()} == SPECS
    over_tensor = {
        (op, types)
        for op, axes, types in collectives(compiled.as_text(), mesh)
        if "tensor" in axes.split(",")
    }
    assert over_tensor == {("all-to-all", frozenset({"u8"})), ("all-gather", frozenset({"u8"}))}


def test_minimal_scan_grad_on_a_data_tensor_mesh():
    """The smallest case that a nested per-device map with checked types failed to lower
    (taco_jax/_local.py): g with codec "taco" in a shard_map manual over "tensor", inside
    `lax.scan`, a free "data" axis of size 4, under `jit(value_and_grad)`. The scan and the same
    layers unrolled in a Python loop are two programs, which need not round alike (their losses
    differed by an ulp on an AVX-512 CPU): each is checked on its own, with `_check_tanh_layers`,
    against the exact model on the activations it computed."""
    mesh = _mesh(AUTO, (4, 2), ("data", "tensor"))
    comm = tj.TPComm.create("tensor", fwd="taco")

    def layer(x, w):
        specs = (P(None, "tensor"), P("tensor", None))
        g = lambda x, w: tj.reduce_from_tp(x @ w, comm)
        return jax.shard_map(g, in_specs=specs, out_specs=P(), axis_names={"tensor"})(x, w)

    def scanned(ws, x):
        def body(x, w):
            y = jnp.tanh(layer(x, w))
            return y, y

        y, ys = lax.scan(body, x, ws)
        return jnp.sum(y**2), ys

    def unrolled(ws, x):
        ys = []
        for w in ws:
            x = jnp.tanh(layer(x, w))
            ys.append(x)
        return jnp.sum(x**2), jnp.stack(ys)

    ws, x = _dyadic(jax.random.key(1), (3, 16, 16)) / 4, _dyadic(jax.random.key(2), (8, 16))
    with jax.set_mesh(mesh):
        ws_placed = jax.device_put(ws, NamedSharding(mesh, P(None, "tensor")))
        x_placed = jax.device_put(x, NamedSharding(mesh, P("data")))
        for f in (scanned, unrolled):
            (loss, ys), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(ws_placed, x_placed)
            _check_tanh_layers(np.asarray(ws), np.asarray(x), loss, ys, grads, data=4, tp=2)


def _check_tanh_layers(ws, x, loss, ys, grads, data: int, tp: int) -> None:
    """A program's y_l = tanh(g(y_(l-1) @ w_l)) (y_0 = x), loss = sum(y_L^2) and d loss / d w_l
    against float64 math on the activations `ys` it computed, layer by layer (test_gspmd.py's
    bounds): y_l within the two-shot all-reduce bound of its partial products (one all-reduce
    per data shard, over `tp` ranks; tanh is 1-Lipschitz), their own matmul rounding (Higham's
    gamma_n, `_dot_bound`) and 8 ulps of tanh's approximation; the loss within gamma_n of
    its sum of squares; each gradient within the rounding of its own backward pass, computed
    from the program's activations: g's backward is the identity, so no codec touches it."""
    u = 2.0**-24
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    ys = np.asarray(ys, np.float64)
    inputs = [np.asarray(x, np.float64), *ys[:-1]]
    for w, y_in, y_out in zip(ws, inputs, ys, strict=True):
        rows = np.split(np.arange(len(y_in)), data)  # each data shard's own all-reduce
        cols = np.split(np.arange(w.shape[0]), tp)  # each tensor rank's slice of the sum
        bound = 0.0
        for r in rows:
            parts = [y_in[np.ix_(r, c)] @ w[c] for c in cols]
            rounding = sum(np.linalg.norm(_dot_bound(y_in[np.ix_(r, c)], w[c])) for c in cols)
            bound += _all_reduce_bound(parts) + rounding
        bound += 8 * u * np.linalg.norm(y_out)
        assert np.linalg.norm(y_out - np.tanh(y_in @ w)) <= 1.01 * bound
    final = ys[-1]
    assert abs(float(loss) - np.sum(final**2)) <= 1.01 * (gamma(final.size) + u) * np.sum(final**2)
    dy, dy_err = 2 * final, np.zeros_like(final)  # 2 y: exact in fp32
    for layer in reversed(range(len(ws))):
        y_in, y_out, w = inputs[layer], ys[layer], ws[layer]
        dz = dy * (1 - y_out**2)
        # JAX's tanh derivative (g + g y)(1 - y): four roundings, <= 4 u |g| (1 + |y|) |1 - y|
        # to first order (5 u with the second), beside the error dy carries in.
        dz_err = dy_err * (1 - y_out**2) + 5 * u * (np.abs(dy) + dy_err) * (1 + np.abs(y_out)) * (
            np.abs(1 - y_out)
        )
        dz_abs = np.abs(dz) + dz_err
        dw_bound = np.abs(y_in).T @ dz_err + gamma(len(y_in)) * (np.abs(y_in).T @ dz_abs)
        dw_error = np.abs(np.asarray(grads[layer], np.float64) - y_in.T @ dz)
        assert np.all(dw_error <= 1.01 * dw_bound), layer
        dy, dy_err = dz @ w.T, dz_err @ np.abs(w).T + gamma(w.shape[1]) * (dz_abs @ np.abs(w).T)


@slow
@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO])
def test_leading_pipeline_style_axes(axis_type):
    """A mesh as MaxText builds it, ("stage", "data", "fsdp", "tensor") = (1, 2, 2, 2) with a
    size-1 leading axis, and (2, 1, 2, 2) with the batch over ("stage", "data", "fsdp"): codec
    "none" equals the plain model bit for bit."""
    names = ("stage", "data", "fsdp", "tensor")
    comm = tj.TPComm.create("tensor", fwd="none")
    for shape in ((1, 2, 2, 2), (2, 1, 2, 2)):
        mesh, batch_spec = _mesh(axis_type, shape, names), P(("stage", "data", "fsdp"))
        ours = _run(mesh, _taco_block(comm), batch_spec=batch_spec)
        theirs = _run(mesh, _plain_block, batch_spec=batch_spec)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_array_equal(a, b)
