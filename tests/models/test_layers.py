"""Attention under vmapped ranks: `layers.attention_over_vmapped_axes` folds every vmapped axis
into the batch, forward and backward, and must give what plain vmapped attention gives.

On the CPU it runs with XLA's attention inside (cuDNN, what it exists for, needs a GPU:
the `gpu` test below), which exercises the folding itself: custom_vmap rules nested once per
vmap, the custom_vjp around them, unbatched operands broadcast, and grad inside and outside
the vmaps. XLA's attention batches under vmap where cuDNN's does not, so one test swaps in an
XLA attention that refuses to be batched, as cuDNN's does: only the fold can run it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import tiered

from taco_models import layers

B, T, N, K, H = 2, 16, 4, 2, 8  # grouped-query: two query heads per KV head


def _qkv(ranks: tuple[int, ...], dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(*ranks, B, T, N, H), (*ranks, B, T, K, H), (*ranks, B, T, K, H)]
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True)]


def _loss(attend):
    # A weighted sum, so that every output element has its own cotangent.
    def loss(q, k, v):
        out = attend(q, k, v)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out * weights.astype(out.dtype))

    return loss


def _plain(q, k, v, implementation="xla"):
    return layers.attention(q, k, v, implementation)


def _folded(q, k, v, implementation="xla"):
    return layers.attention_over_vmapped_axes(q, k, v, implementation)


def _values_and_grads(attend, q, k, v, vmaps):
    fn = jax.value_and_grad(_loss(attend), argnums=(0, 1, 2))
    for _ in range(vmaps):
        fn = jax.vmap(fn)
    return jax.jit(fn)(q, k, v)


# Same operations on the same values, only the batch axis laid out differently: XLA's CPU dots
# compute each batch element alone, so the results agree to the last bit or within a few ulps
# of fp32 where a different blocking reorders a sum of T terms. u sqrt(T) x 8 (as
# tests/tolerances.py) is ~2e-6 for T = 16; 1e-5 relative to the largest value leaves room.
RTOL = 1e-5


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(np.max(np.abs(np.asarray(w))))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=RTOL * scale)


@pytest.mark.parametrize("vmaps", tiered([0, 1, 2], [0]))  # nested vmaps: the slow tier
def test_folded_attention_equals_vmapped_attention(vmaps):
    """One emulated TP axis (vmaps=1) and two (a (dp, tp) mesh emulated, as models/spmd.py)."""
    q, k, v = _qkv((3, 2)[:vmaps])
    _assert_close(
        _values_and_grads(_folded, q, k, v, vmaps), _values_and_grads(_plain, q, k, v, vmaps)
    )


def test_an_unbatched_operand_is_broadcast_over_the_ranks():
    """k and v the same on every rank (in_axes None): their gradients sum over the ranks."""
    q, _, _ = _qkv((3,))
    _, k, v = _qkv(())
    in_axes = (0, None, None)
    got = jax.jit(jax.grad(lambda *a: jax.vmap(_loss(_folded), in_axes)(*a).sum(), (0, 1, 2)))
    want = jax.jit(jax.grad(lambda *a: jax.vmap(_loss(_plain), in_axes)(*a).sum(), (0, 1, 2)))
    _assert_close(got(q, k, v), want(q, k, v))


def test_grad_outside_the_vmap_inside_a_scan():
    """The emulated model's layout: ranks vmapped inside the loss, layers scanned, grad outside."""
    q, k, v = _qkv((2,))

    def loss(attend, q, k, v):
        def layer(carry, _):
            return jax.vmap(attend)(carry, k, v), None

        out, _ = jax.lax.scan(layer, q, None, length=2)
        return jnp.sum(out * jnp.sin(out))

    got = jax.jit(jax.value_and_grad(lambda *a: loss(_folded, *a), (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(_plain, *a), (0, 1, 2)))(q, k, v)
    _assert_close(got, want)


def _refusing_vmap(fn):
    """`fn`, but under jax.vmap it raises, as cuDNN's attention batching rule does for the
    batch axes a vmapped backward hands it."""
    refusing = jax.custom_batching.custom_vmap(fn)

    @refusing.def_vmap
    def _refuse(axis_size, in_batched, *args):
        raise NotImplementedError("this attention does not batch (as cuDNN's)")

    return refusing


def _unbatchable_attention(q, k, v, implementation):
    """XLA's causal attention, forward and backward, each refusing to run under vmap."""

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def grads(q, k, v, g):
        return jax.vjp(attend, q, k, v)[1](g)

    forward = jax.custom_vjp(_refusing_vmap(attend))
    forward.defvjp(
        lambda q, k, v: (forward(q, k, v), (q, k, v)), lambda res, g: _refusing_vmap(grads)(*res, g)
    )
    return forward(q, k, v)


def test_the_fold_runs_an_attention_that_refuses_vmap(monkeypatch):
    """With the attention underneath refusing vmap (as cuDNN's does), plain vmapped attention
    fails and the fold runs it, equal to XLA's own vmapped attention: grad inside and outside
    two vmaps, and under remat."""
    q, k, v = _qkv((3, 2))
    want = _values_and_grads(_plain, q, k, v, vmaps=2)
    remat_loss = jax.checkpoint(lambda *a: jax.vmap(jax.vmap(_loss(_folded)))(*a).sum())
    want_remat = jax.jit(
        jax.grad(lambda *a: jax.vmap(jax.vmap(_loss(_plain)))(*a).sum(), (0, 1, 2))
    )(q, k, v)
    monkeypatch.setattr(layers, "_causal_attention", _unbatchable_attention)
    with pytest.raises(NotImplementedError, match="does not batch"):
        _values_and_grads(_plain, q, k, v, vmaps=2)
    _assert_close(_values_and_grads(_folded, q, k, v, vmaps=2), want)
    _assert_close(jax.jit(jax.grad(remat_loss, (0, 1, 2)))(q, k, v), want_remat)


@pytest.mark.gpu
def test_cudnn_attention_over_vmapped_ranks_equals_xla():
    """On a GPU, bf16: cuDNN through the fold against XLA's attention, two vmapped axes, values
    and gradients. Both round bf16 inputs' products in fp32 and differ in summation order and in
    flash attention's online softmax; the outputs are rounded to bf16 (2^-8 relative): a few
    bf16 ulps of the largest value bound the difference, 4 x 2^-8."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v = _qkv((2, 2), jnp.bfloat16)
    got = _values_and_grads(lambda *a: _folded(*a, "cudnn"), q, k, v, vmaps=2)
    want = _values_and_grads(_plain, q, k, v, vmaps=2)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=0, atol=4 * 2.0**-8 * float(np.max(np.abs(w))))
