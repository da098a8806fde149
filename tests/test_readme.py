"""The README's example runs as written, and computes what it says (docs that match the code)."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).parents[1] / "README.md"

# One E4M3 rounding has relative error at most 2^-4 per element (3 mantissa bits, round to
# nearest); the Hadamard is orthonormal and the group scales cancel, so a group's L2 error is
# at most 2^-4 of its norm. A two-shot all-reduce rounds twice (the partials, then their sum):
# its output's L2 error is at most (1 + 2^-4)^2 - 1 < 2^-3 of the exact sum's norm.
ALLREDUCE_BOUND = 2.0**-3
GELU_SLOPE_MAX = 1.13  # max |gelu'(z)| over z (tanh approximation: 1.129 at z ~ 1.5)


def _example_namespace():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    return namespace


def _exact(w_in, w_out, x):
    def loss_fn(w_in, w_out, x):
        return jnp.mean((x + jax.nn.gelu(x @ w_in) @ w_out) ** 2)

    return jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(w_in, w_out, x)


def _norm(a, order=None):
    return float(np.linalg.norm(np.asarray(a, np.float64), order))


def test_readme_example_matches_plain_jax(capsys):
    ns = _example_namespace()
    assert capsys.readouterr().out.startswith("loss ")
    w_in, w_out, x = (np.asarray(ns[k]) for k in ("w_in", "w_out", "x"))
    loss, grads = ns["loss"], (ns["g_in"], ns["g_out"], ns["g_x"])
    exact_loss, exact_grads = _exact(w_in, w_out, x)
    h = np.asarray(jax.nn.gelu(x @ w_in))
    y = h @ w_out
    n = x.size
    # Forward: y carries e with ||e|| <= B ||y||. L = mean((x + y)^2) moves by at most
    # (2 ||x + y|| ||e|| + ||e||^2) / n (Cauchy-Schwarz).
    e = ALLREDUCE_BOUND * _norm(y)
    assert abs(float(loss) - float(exact_loss)) <= (2 * _norm(x + y) * e + e**2) / n
    # Backward: the cotangent c = 2 (x + y) / n moves by dc = 2 ||e|| / n; g is the identity
    # backward, so g_out = h^T c moves by at most ||h||_2 dc, and g_in = x^T (gelu'(x w_in) *
    # (c w_out^T)) by at most ||x||_2 max|gelu'| ||w_out||_2 dc. g_x adds to both the
    # compressed all-reduce of f's backward: at most B of what it sums, itself within the
    # propagated error of the exact sum s = (gelu' * (c w_out^T)) w_in^T.
    dc = 2 * e / n
    dh = GELU_SLOPE_MAX * _norm(w_out, 2) * dc
    c = 2 * (x + y) / n
    s = (np.asarray(jax.grad(lambda z: jnp.sum(jax.nn.gelu(z) * (c @ w_out.T)))(x @ w_in))) @ w_in.T
    bounds = (
        _norm(x, 2) * dh,
        _norm(h, 2) * dc,
        dc + _norm(w_in, 2) * dh + ALLREDUCE_BOUND * (_norm(s) + _norm(w_in, 2) * dh),
    )
    for name, got, want, bound in zip(
        ("g_in", "g_out", "g_x"), grads, exact_grads, bounds, strict=True
    ):
        assert _norm(np.asarray(got) - np.asarray(want)) <= bound, name
    # ... and the compression is real: the outputs are not the exact ones.
    assert float(loss) != float(exact_loss)
