"""Model geometry: a frozen dataclass with named presets, parameter count and FLOPs per token.

Presets: the GPT-3 paper's table 2.1 geometries (Brown et al. 2020) trained at sequence length 2048
with the GPT-2 vocabulary padded to 50304 (nanoGPT), Qwen2.5-7B (its `config.json`), and tiny
presets that compile in seconds on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

# Megatron pads the vocabulary so that every TP degree that divides it gets an equal shard
# (`--make-vocab-size-divisible-by 128`); padded logits are masked out of the loss.
VOCAB_MULTIPLE = 128
ARCHS = ("gpt", "qwen2", "llama", "mistral")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (transformers' rope_type "llama3").

    Frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor are
    divided by `factor`, those below original_max_position_embeddings / high_freq_factor kept,
    those between interpolated smoothly (`taco_models.layers.rotary_frequencies`).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope_scaling needs 0 < low_freq_factor={self.low_freq_factor} < "
                f"high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings} must be >= 1"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer.

    arch "gpt": LayerNorm, GELU MLP (tanh approximation, GPT-2's "gelu_new"), learned
    positions, tied input/output embeddings, biases on every linear layer (GPT-2 / Megatron GPT).
    arch "qwen2": RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, bias on QKV
    only, untied output embedding (Qwen2.5-7B; the smaller Qwen2.5 models tie it).
    arch "llama": qwen2 without the QKV bias (Llama 2 / 3, TinyLlama, SmolLM2); "mistral": the
    same model under Mistral's name (Mistral without a sliding window).
    tie_embeddings: the output head is the input embedding; None is the arch's default (gpt
    tied, the others untied).
    rope_scaling: Llama 3.1's scaling of the rotary frequencies (a `RopeScaling`, or a dict of
    its fields); None is plain rotary embeddings.
    """

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    arch: Literal["gpt", "qwen2", "llama", "mistral"] = "gpt"
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    init_std: float = 0.02
    tie_embeddings: bool | None = None
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} must be one of {ARCHS}")
        if isinstance(self.rope_scaling, dict):  # from TOML or a saved run's config.json
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if not isinstance(self.rope_scaling, RopeScaling | None):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be a RopeScaling or a dict")
        for name in (
            "vocab_size",
            "seq_len",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "d_ff",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.arch == "gpt" and self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"arch='gpt' is multi-head attention: n_kv_heads={self.n_kv_heads} must equal "
                f"n_heads={self.n_heads}"
            )
        if self.rotary and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim=}")
        if self.rope_scaling is not None and not self.rotary:
            raise ValueError(
                f"rope_scaling is for rotary positions; arch={self.arch!r} learns them"
            )

    @property
    def rotary(self) -> bool:
        """Rotary positions (every arch but gpt, which learns them)."""
        return self.arch != "gpt"

    @property
    def qkv_bias(self) -> bool:
        """A bias on the QKV projection (gpt, qwen2; Llama and Mistral have none)."""
        return self.arch in ("gpt", "qwen2")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def tied_embeddings(self) -> bool:
        return self.arch == "gpt" if self.tie_embeddings is None else self.tie_embeddings

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """The named geometry with `overrides` applied (e.g. `vocab_size=8192`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def num_params(self) -> int:
        """Parameters the model holds (padded vocabulary included). Equals the leaf sizes of
        `taco_models.parallel.init_params` (tested)."""
        d, f, v, hd = self.d_model, self.d_ff, self.padded_vocab, self.head_dim
        qkv_heads = self.n_heads + 2 * self.n_kv_heads
        if self.arch == "gpt":
            attn = d * qkv_heads * hd + qkv_heads * hd + self.n_heads * hd * d + d
            mlp = d * f + f + f * d + d
            norms = 2 * 2 * d
            embed = self.seq_len * d
            final = 2 * d
        else:
            bias = qkv_heads * hd if self.qkv_bias else 0
            attn = d * qkv_heads * hd + bias + self.n_heads * hd * d
            mlp = 3 * d * f
            norms = 2 * d
            embed = 0
            final = d
        embed += v * d if self.tied_embeddings else 2 * v * d
        return embed + self.n_layers * (attn + mlp + norms) + final

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul: all but the input-embedding table (a gather)
        and the learned positions; the output projection counts (tied or not)."""
        positions = self.seq_len * self.d_model if self.arch == "gpt" else 0
        gathered = 0 if self.tied_embeddings else self.padded_vocab * self.d_model  # tied: the head
        return self.num_params() - positions - gathered

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token, forward + backward: 6 N + 12 L H Q T.

        PaLM (Chowdhery et al. 2022, appendix B) and nanoGPT's `estimate_mfu`: 6 FLOPs per matmul
        parameter per token (2 forward, 4 backward) plus the attention score and value matmuls,
        12 L H Q T with H heads of size Q over T positions. Like both, this counts attention as
        non-causal; N is `matmul_params()` (the input embedding is a gather, not a matmul).
        """
        t = self.seq_len if seq_len is None else seq_len
        attn = 12 * self.n_layers * self.n_heads * self.head_dim * t
        return 6 * self.matmul_params() + attn


_GPT3_VOCAB = 50304  # GPT-2's 50257 BPE tokens padded to a multiple of 128 (nanoGPT)


def _gpt(d_model: int, n_layers: int, n_heads: int, **kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=kw.pop("vocab_size", _GPT3_VOCAB),
        seq_len=kw.pop("seq_len", 2048),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        d_ff=4 * d_model,
        arch="gpt",
        **kw,
    )


_QWEN2_TINY = ModelConfig(
    vocab_size=256,
    seq_len=32,
    d_model=64,
    n_layers=2,
    n_heads=8,
    n_kv_heads=4,
    d_ff=160,
    arch="qwen2",
    norm_eps=1e-6,
    rope_theta=1e6,
)

PRESETS: dict[str, ModelConfig] = {
    # Tiny shapes for CPU tests: compile in seconds, still exercise every code path.
    "gpt_tiny": _gpt(64, 2, 8, vocab_size=256, seq_len=32),
    # The README's laptop run: ~8M parameters at vocab 8192.
    "gpt_small_cpu": _gpt(256, 4, 8, vocab_size=8192, seq_len=128),
    # GPT-3 table 2.1. Two rows of that table are inconsistent (1.3B: 24 heads x 128 != 2048;
    # 13B: d_model 5140 is not 40 x 128); we use the Megatron-LM geometries 16 x 128 and 5120.
    "gpt_125m": _gpt(768, 12, 12),
    "gpt_350m": _gpt(1024, 24, 16),
    "gpt_1p3b": _gpt(2048, 24, 16),
    "gpt_2p7b": _gpt(2560, 32, 32),
    "gpt_6p7b": _gpt(4096, 32, 32),
    "gpt_13b": _gpt(5120, 40, 40),
    "qwen2_tiny": _QWEN2_TINY,
    # Llama 3.1's layout (no QKV bias, untied head, "llama3" rotary scaling) at qwen2_tiny's size.
    "llama_tiny": dataclasses.replace(
        _QWEN2_TINY,
        arch="llama",
        norm_eps=1e-5,
        rope_theta=10_000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16),
    ),
    # Qwen2.5-7B config.json: hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944,
    # vocab 152064, rms_norm_eps 1e-6, rope_theta 1e6. Sequence length 4096 for training.
    "qwen25_7b": ModelConfig(
        vocab_size=152064,
        seq_len=4096,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        d_ff=18944,
        arch="qwen2",
        norm_eps=1e-6,
        rope_theta=1e6,
    ),
}
