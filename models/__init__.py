"""Flax NNX GPT / Qwen2.5 / Llama models with Megatron tensor parallelism over taco_jax operators.

ModelConfig                         (config.py: geometry, presets, parameter count, FLOPs)
Transformer                         (model.py: the per-device model)
ParallelConfig, init_params,
make_loss_and_grads, ...            (parallel.py: shard_map / vmap / unsharded runners)
StageCodecs,
make_pipeline_loss_and_grads        (pipeline.py: GPipe / circular stages over "pp", with TP, DP)
hf.load, hf.save                    (hf.py: Hugging Face GPT-2 / Qwen2 / Llama / Mistral
                                     checkpoints, safetensors;
                                     `from taco_models import hf`, needs the train extra)
generate.generate                   (generate.py: decoding with a key / value cache, greedy or
                                     sampled; `from taco_models.generate import generate`)

The optimizer side (train state, jitted steps) lives in the training application, `taco_train`.
"""

from taco_models.config import ModelConfig
from taco_models.model import Transformer
from taco_models.parallel import (
    ParallelConfig,
    init_params,
    make_logits,
    make_loss,
    make_loss_and_grads,
    param_specs,
    reference_logits,
    reference_loss_and_grads,
    shard_params,
    unshard_params,
    weight_decay_mask,
)
from taco_models.pipeline import (
    StageCodecs,
    make_pipeline_loss,
    make_pipeline_loss_and_grads,
    pipeline_param_specs,
)

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "StageCodecs",
    "Transformer",
    "init_params",
    "make_logits",
    "make_loss",
    "make_loss_and_grads",
    "make_pipeline_loss",
    "make_pipeline_loss_and_grads",
    "param_specs",
    "pipeline_param_specs",
    "reference_logits",
    "reference_loss_and_grads",
    "shard_params",
    "unshard_params",
    "weight_decay_mask",
]
