"""Flax NNX GPT / Qwen2.5-style models with Megatron tensor parallelism over taco_jax operators.

ModelConfig                         (config.py: geometry, presets, parameter count, FLOPs)
Transformer                         (model.py: the per-device model)
ParallelConfig, TrainState, Steps,
make_steps, init_params, ...        (parallel.py: shard_map / vmap / unsharded runners)
"""

from models.config import ModelConfig
from models.model import Transformer
from models.parallel import (
    ParallelConfig,
    Steps,
    TrainState,
    init_params,
    make_logits,
    make_loss_and_grads,
    make_steps,
    param_specs,
    reference_logits,
    reference_loss_and_grads,
    shard_params,
    unshard_params,
    weight_decay_mask,
)

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "Steps",
    "TrainState",
    "Transformer",
    "init_params",
    "make_logits",
    "make_loss_and_grads",
    "make_steps",
    "param_specs",
    "reference_logits",
    "reference_loss_and_grads",
    "shard_params",
    "unshard_params",
    "weight_decay_mask",
]
