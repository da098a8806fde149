"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, masked decay."""

from __future__ import annotations

from typing import Any

import optax

from taco_train.config import OptimizerConfig


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """0 -> lr linearly over `warmup_steps`, then cosine to `lr * min_lr_ratio` at `total_steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_adamw(
    cfg: OptimizerConfig, total_steps: int, decay_mask: Any
) -> optax.GradientTransformation:
    """AdamW with the schedule; `decay_mask` (a pytree of bools like the params, e.g.
    `taco_models.parallel.weight_decay_mask`) says which leaves are decayed: matrices and
    embeddings, not norms and biases (GPT-3 / Megatron). No clipping: a sharded optimizer
    (`taco_train.zero`) clips by the global norm across its shards itself."""
    return optax.adamw(
        lr_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int, decay_mask: Any
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (`make_adamw`)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip), make_adamw(cfg, total_steps, decay_mask)
    )
