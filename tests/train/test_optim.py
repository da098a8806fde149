"""The learning-rate schedule and the weight-decay mask."""

import jax.numpy as jnp
import numpy as np

from taco_jax import optim
from taco_jax.config import OptimizerConfig


def test_schedule_warmup_peak_and_floor():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    s = optim.lr_schedule(cfg, 100)
    assert float(s(0)) == 0.0
    np.testing.assert_allclose(float(s(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(s(10)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(s(100)), 1e-4, rtol=1e-6)
    assert float(s(50)) < 1e-3


def test_decay_mask_skips_norms_and_biases():
    params = {
        "wte": {"embedding": jnp.zeros((8, 4))},
        "block": {
            "ln_1": {"scale": jnp.ones((3, 4)), "bias": jnp.zeros((3, 4))},  # stacked layers
            "attn": {"kernel": jnp.zeros((4, 4)), "bias": jnp.zeros(4)},
        },
        "final_norm": {"weight": jnp.ones(4)},
    }
    mask = optim.decay_mask(params)
    assert mask["wte"]["embedding"] and mask["block"]["attn"]["kernel"]
    assert not mask["block"]["ln_1"]["scale"] and not mask["block"]["ln_1"]["bias"]
    assert not mask["block"]["attn"]["bias"] and not mask["final_norm"]["weight"]
