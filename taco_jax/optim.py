"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, masked decay."""

from __future__ import annotations

import jax
import optax

from taco_jax.config import OptimizerConfig

# Parameters whose path has one of these components (or a component containing "norm") are
# norm gains / biases: weight decay would pull them toward 0 rather than regularise a projection.
_NO_DECAY_NAMES = ("bias", "scale", "b", "g", "gamma", "beta")


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """0 -> lr linearly over `warmup_steps`, then cosine to `lr * min_lr_ratio` at `total_steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def decays(path, leaf) -> bool:
    """Whether weight decay applies to the parameter at `path` (matrices and embeddings only)."""
    names = [_key_name(k).lower() for k in path]
    if any(n in _NO_DECAY_NAMES or "norm" in n or n.startswith("ln") for n in names):
        return False
    return getattr(leaf, "ndim", 0) >= 2


def decay_mask(params):
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            lr_schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        ),
    )
