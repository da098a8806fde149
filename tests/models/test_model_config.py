"""Presets, parameter counts and the FLOP formula."""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest

from taco_models import ModelConfig, init_params
from taco_models.config import PRESETS, RopeScaling
from taco_models.parallel import abstract_params, logical_axes, weight_decay_mask


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", ["gpt_tiny", "qwen2_tiny", "llama_tiny"])
def test_num_params_counts_initialized_leaves(name):
    cfg = ModelConfig.preset(name)
    assert _count(init_params(cfg, jax.random.key(0))) == cfg.num_params()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_counts_abstract_leaves(name):
    cfg = ModelConfig.preset(name)
    assert _count(abstract_params(cfg)) == cfg.num_params()


@pytest.mark.parametrize(("name", "tied"), [("qwen2_tiny", True), ("gpt_tiny", False)])
def test_tie_embeddings_overrides_the_arch_default(name, tied):
    """Qwen2.5 up to 3B ties its head, GPT-2 checkpoints may untie theirs: the head exists
    exactly when untied, and the counts follow the leaves."""
    cfg = ModelConfig.preset(name, tie_embeddings=tied)
    params = init_params(cfg, jax.random.key(0))
    assert ("lm_head" in params) == (not tied) and cfg.tied_embeddings == tied
    assert _count(params) == cfg.num_params()
    head = 0 if tied else cfg.padded_vocab * cfg.d_model
    positions = cfg.seq_len * cfg.d_model if cfg.arch == "gpt" else 0
    assert cfg.matmul_params() == cfg.num_params() - positions - head


def test_qwen25_0p5b_counts_as_published():
    """Qwen2.5-0.5B's config.json geometry (tied): 494M parameters as its model card says
    (0.49B); its vocabulary 151936 is a multiple of 128, so nothing is padded."""
    cfg = ModelConfig(
        vocab_size=151936,
        seq_len=32768,
        d_model=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        d_ff=4864,
        arch="qwen2",
        tie_embeddings=True,
    )
    assert cfg.padded_vocab == cfg.vocab_size
    assert round(cfg.num_params() / 1e6) == 494


def test_llama_has_no_qkv_bias():
    """Llama is Qwen2's layout without the QKV bias: one tensor fewer per layer."""
    llama = init_params(ModelConfig.preset("llama_tiny"), jax.random.key(0))["blocks"]["attn"]
    qwen2 = init_params(ModelConfig.preset("qwen2_tiny"), jax.random.key(0))["blocks"]["attn"]
    assert set(qwen2) - set(llama) == {"bqkv"}


def test_rope_scaling_from_a_dict_round_trips():
    """A saved run's config.json holds `dataclasses.asdict(cfg)`: the scaling comes back."""
    cfg = ModelConfig.preset("llama_tiny")
    assert ModelConfig(**dataclasses.asdict(cfg)) == cfg
    assert isinstance(ModelConfig(**dataclasses.asdict(cfg)).rope_scaling, RopeScaling)


@pytest.mark.parametrize(
    ("name", "billions"),
    # Nominal sizes (GPT-3 table 2.1; Qwen2.5-7B reports 7.61B with its 152064-entry vocab).
    [
        ("gpt_125m", 0.125),
        ("gpt_350m", 0.35),
        ("gpt_1p3b", 1.3),
        ("gpt_2p7b", 2.7),
        ("gpt_6p7b", 6.7),
        ("gpt_13b", 13.0),
        ("qwen25_7b", 7.61),
    ],
)
def test_presets_have_their_nominal_size(name, billions):
    # GPT-3's counts exclude the positions and round; 5% covers both.
    assert abs(ModelConfig.preset(name).num_params() / 1e9 - billions) <= 0.05 * billions


def test_qwen25_7b_geometry():
    cfg = ModelConfig.preset("qwen25_7b")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (3584, 28, 28, 4)
    assert (cfg.d_ff, cfg.vocab_size, cfg.head_dim) == (18944, 152064, 128)


def test_flops_per_token_is_palm_formula():
    cfg = ModelConfig.preset("gpt_1p3b")
    n = cfg.num_params() - cfg.seq_len * cfg.d_model  # tied table is the head: it counts
    attn = 12 * cfg.n_layers * cfg.d_model * cfg.seq_len  # 12 L H Q T with H Q = D
    assert cfg.flops_per_token() == 6 * n + attn


def test_unknown_preset_names_it():
    with pytest.raises(ValueError, match="'gpt_7b'"):
        ModelConfig.preset("gpt_7b")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(n_heads=5), "d_model=64 is not a multiple of n_heads=5"),
        (dict(n_kv_heads=2), "n_kv_heads=2 must equal n_heads=8"),
        (dict(arch="mamba"), "arch='mamba'"),
        (dict(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16)), "arch='gpt' learns them"),
        (
            dict(
                rope_scaling=dict(
                    factor=8.0,
                    low_freq_factor=4.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=16,
                )
            ),
            "low_freq_factor=4.0 <",
        ),
        (dict(d_ff=0), "d_ff=0"),
    ],
)
def test_bad_model_configs_name_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.preset("gpt_tiny", **overrides)


def test_padded_vocab_is_a_multiple_of_128():
    assert ModelConfig.preset("gpt_tiny", vocab_size=257).padded_vocab == 384
    assert ModelConfig.preset("gpt_125m").padded_vocab == 50304


def test_weight_decay_mask_skips_norms_and_biases():
    cfg = ModelConfig.preset("gpt_tiny")
    mask = weight_decay_mask(cfg)
    assert mask["wte"] and mask["blocks"]["attn"]["wqkv"] and mask["blocks"]["mlp"]["w_down"]
    assert not mask["blocks"]["norm_attn"]["scale"] and not mask["blocks"]["attn"]["bqkv"]
    assert logical_axes(cfg)["blocks"]["attn"]["wqkv"][0] == "layers"
