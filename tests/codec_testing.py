"""Codec test data across magnitudes and the per-group error bound, shared by the codec, kernel
and collective tests.

The bound (round to nearest, p mantissa bits; derivations as in test_codecs.py):
- E4M3 (p=3) / E5M2 (p=2): ||err||_group <= 2^-(p+1) ||x||_group, plus the subnormal codes'
  half step (2^-10 E4M3, 2^-17 E5M2, in units of the group scale) times sqrt(G);
- integer grids (INT8 .. INT4): ||err||_group <= sqrt(G) s / 2 with s = max|H x| / qmax
  (qmax = 2^(bits - 1) - 1: 127, 31, 15, 7);
- the scale s = max|H x| / qmax, doubled at most by E8M0's round-up to a power of two;
- the Hadamard is orthonormal, so group-norm errors carry over between the domains.
Everything here is computed in float64, so the bound itself never under- or overflows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax import codecs
from taco_jax.codecs import Codec

# Group magnitudes of the range tests: 1e-30 .. 1e30, inside every codec's documented range
# (docs/method.md, "Range").
DECADES = tuple(range(-30, 31, 5))
MANTISSA_ULP_HALF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
SUBNORMAL_HALF_STEP = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}


def mixed_magnitudes(key, shape, group_size: int, decades=DECADES, dtype=jnp.float32):
    """N(0, 1) values whose consecutive groups of `group_size` are scaled by 10^d, d cycling
    through `decades`: every magnitude sits next to every other one in one message."""
    x = np.asarray(jax.random.normal(key, shape, jnp.float32), np.float64)
    groups = x.reshape(-1, group_size)
    scales = 10.0 ** np.resize(np.asarray(decades, np.float64), groups.shape[0])
    return jnp.asarray((groups * scales[:, None]).reshape(shape), jnp.float32).astype(dtype)


def groups64(x, group_size: int) -> np.ndarray:
    """x as float64 groups [M, G]."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64).reshape(-1, group_size)


def group_error_bound(codec: Codec, x) -> np.ndarray:
    """The per-group bound on ||decode(encode(x)) - x|| (module docstring), float64 [M]."""
    g = codec.group_size
    groups = groups64(x, g)
    rotated = groups @ codecs.hadamard_matrix(g).astype(np.float64) if codec.hadamard else groups
    scale = np.abs(rotated).max(axis=-1) / codec.qmax
    if codec.is_integer:
        return np.sqrt(g) * scale / 2
    if codec.scale_format == "e8m0":
        scale = 2 * scale
    subnormal = np.sqrt(g) * SUBNORMAL_HALF_STEP[codec.element] * scale
    return MANTISSA_ULP_HALF[codec.element] * np.linalg.norm(groups, axis=-1) + subnormal


def group_errors(codec: Codec, x, decoded) -> np.ndarray:
    """||decoded - x|| per group, float64 [M]."""
    g = codec.group_size
    return np.linalg.norm(groups64(decoded, g) - groups64(x, g), axis=-1)
