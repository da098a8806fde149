"""The learning-rate schedule and the masked weight decay."""

import jax.numpy as jnp
import numpy as np
import optax

from taco_train import optim
from taco_train.config import OptimizerConfig


def test_schedule_warmup_peak_and_floor():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    s = optim.lr_schedule(cfg, 100)
    assert float(s(0)) == 0.0
    np.testing.assert_allclose(float(s(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(s(10)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(s(100)), 1e-4, rtol=1e-6)
    assert 1e-4 < float(s(50)) < 1e-3


def test_decay_only_where_the_mask_says():
    cfg = OptimizerConfig(lr=0.1, warmup_steps=0, weight_decay=0.5, min_lr_ratio=1.0)
    params = {"kernel": jnp.ones((2, 2)), "scale": jnp.ones(2)}
    opt = optim.make_optimizer(cfg, 10, {"kernel": True, "scale": False})
    zero_grads = {k: jnp.zeros_like(v) for k, v in params.items()}
    updates, _ = opt.update(zero_grads, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    # With zero gradients AdamW's only update is -lr * wd * p on decayed leaves: 1 - 0.05.
    np.testing.assert_allclose(new["kernel"], 0.95, rtol=1e-6)
    np.testing.assert_array_equal(new["scale"], 1.0)
