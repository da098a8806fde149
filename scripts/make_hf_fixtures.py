"""Makes the tiny Hugging Face checkpoints of tests/models/fixtures/hf/ with transformers.

Each fixture directory holds a randomly initialized model saved with `save_pretrained`
(safetensors), `tokens.npy` (a fixed [2, 16] batch), `logits.npy` (transformers' fp32 logits
of that batch), against which tests/models/test_hf.py checks `models.hf.load`, and `greedy.npy`
(transformers' greedy continuation of each row, `GREEDY_TOKENS` tokens), against which
tests/models/test_generate.py checks `models.generate`.
Needs torch and transformers, which the project does not depend on. Run it under transformers
4.x (the committed fixtures: 4.57.6, torch 2.11) for gpt2, qwen2_untied and qwen2_tied, whose
config.json holds `rope_theta`, and under 5.x for qwen2_untied_v5 (5.24.0), the same model as
5.x writes it (`rope_parameters`), and for llama3_untied, llama_tied, mistral and
llama31_rope_frequencies.npy (5.25.0, torch 2.13):

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch "transformers<5" safetensors numpy
    /tmp/hf/bin/python scripts/make_hf_fixtures.py [OUT_DIR]

`--greedy` writes only greedy.npy, beside the fixtures already there (the committed ones:
transformers 4.57.6, torch 2.13, for gpt2, qwen2_untied and qwen2_tied).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

OUT = Path(__file__).resolve().parents[1] / "tests" / "models" / "fixtures" / "hf"
BATCH, LENGTH = 2, 16
GREEDY_TOKENS = 16  # the GPT-2 fixture's 32 positions hold the prompt and this many more


def _gpt2() -> transformers.PreTrainedModel:
    # vocab 250: not a multiple of 128, so our padded vocabulary is exercised.
    config = transformers.GPT2Config(
        vocab_size=250,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_inner=128,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def _qwen2(tied: bool) -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(
        vocab_size=256,
        max_position_embeddings=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=tied,
        use_sliding_window=False,
    )
    return transformers.Qwen2ForCausalLM(config)


def _llama3() -> transformers.PreTrainedModel:
    """Llama 3.1's layout: GQA, untied head, rope_scaling "llama3". Head size 8 has the
    frequencies 1, 0.1, 0.01, 0.001 (theta 1e4), of wavelengths 6.3, 63, 628 and 6283; with
    original_max_position_embeddings 128 and frequency factors 1 and 4 the first is kept
    (< 128 / 4), the second interpolated (between 32 and 128) and the others divided by 8
    (> 128 / 1): every case of the scaling moves the logits."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 1e4,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    config = transformers.LlamaConfig(
        vocab_size=256,
        max_position_embeddings=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _llama_tied() -> transformers.PreTrainedModel:
    """SmolLM2's (and Llama 3.2 1B's) tied head, GQA 4:1, unscaled rotary embeddings."""
    config = transformers.LlamaConfig(
        vocab_size=256,
        max_position_embeddings=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


def _mistral() -> transformers.PreTrainedModel:
    """Mistral 7B v0.2+'s layout: no sliding window, GQA 4:1, untied head."""
    config = transformers.MistralConfig(
        vocab_size=256,
        max_position_embeddings=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        sliding_window=None,
        tie_word_embeddings=False,
    )
    return transformers.MistralForCausalLM(config)


def _llama31_frequencies(out: Path) -> None:
    """transformers' rotary frequencies for Llama 3.1 8B's config.json (head size 128, theta
    5e5, rope_scaling "llama3": factor 8, frequency factors 1 and 4, original length 8192)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = transformers.LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters=rope,
    )
    frequencies, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert attention_factor == 1.0  # "llama3" scales the frequencies only
    np.save(out / "llama31_rope_frequencies.npy", frequencies.numpy())


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter ~ N(0, 0.1^2), norms ~ 1 + N(0, 0.1^2): nothing left at an initial
    value (zero biases, unit norms) that would hide a wrong mapping."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if "ln" in name or "norm" in name else noise)


def _byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer of 256 ids for the 256-entry fixture vocabulary: 255 of the byte
    symbols (the last in sorted order, a non-ASCII byte, left out) and "<|endoftext|>" (id 255),
    which the trainer ends documents with."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet[:255])}
    vocab["<|endoftext|>"] = 255
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def make(name: str, model: transformers.PreTrainedModel, seed: int, out: Path, **save) -> None:
    _randomize(model, seed)
    model.eval()
    directory = out / name
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True, **save)
    vocab = model.config.vocab_size
    tokens = np.random.default_rng(seed).integers(0, vocab, (BATCH, LENGTH), dtype=np.int32)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    np.save(directory / "tokens.npy", tokens)
    np.save(directory / "logits.npy", logits)
    write_greedy(directory)
    print(f"{directory}: {sorted(p.name for p in directory.iterdir())}")


def write_greedy(directory: Path) -> None:
    """greedy.npy: transformers' greedy `generate` after each row of tokens.npy, [2, 16] int32
    (no fixture's end-of-text id is in its vocabulary, so every row runs the whole budget)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = torch.from_numpy(np.load(directory / "tokens.npy")).long()
    with torch.no_grad():
        out = model.generate(
            tokens,
            attention_mask=torch.ones_like(tokens),
            do_sample=False,
            max_new_tokens=GREEDY_TOKENS,
            pad_token_id=0,
        )
    greedy = out[:, tokens.shape[1] :].numpy().astype(np.int32)
    assert greedy.shape == (BATCH, GREEDY_TOKENS), greedy.shape
    np.save(directory / "greedy.npy", greedy)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--greedy"]
    out = Path(args[0]) if args else OUT
    torch.manual_seed(0)
    v5 = int(transformers.__version__.split(".")[0]) >= 5
    if "--greedy" in sys.argv:
        names = ["qwen2_untied_v5"] if v5 else ["gpt2", "qwen2_untied", "qwen2_tied"]
        for name in names:
            write_greedy(out / name)
        return
    if v5:
        make("qwen2_untied_v5", _qwen2(tied=False), 2, out)
        make("llama3_untied", _llama3(), 4, out)
        make("llama_tied", _llama_tied(), 5, out)
        make("mistral", _mistral(), 6, out)
        _llama31_frequencies(out)
        return
    make("gpt2", _gpt2(), 1, out)
    make("qwen2_untied", _qwen2(tied=False), 2, out)
    # Tied like Qwen2.5-0.5B, sharded (model.safetensors.index.json), with a tokenizer.json.
    make("qwen2_tied", _qwen2(tied=True), 3, out, max_shard_size="100KB")
    _byte_tokenizer().save(str(out / "qwen2_tied" / "tokenizer.json"))


if __name__ == "__main__":
    main()
