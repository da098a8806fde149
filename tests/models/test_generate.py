"""taco_models.generate: KV-cache decoding against the full forward and transformers.

The fixtures (tests/models/fixtures/hf/, scripts/make_hf_fixtures.py) are tiny random GPT-2 and
Qwen2 models (tied and untied heads, GQA) with a [2, 16] prompt (tokens.npy) and transformers'
greedy continuation of it (greedy.npy, 16 tokens).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")

from taco_models import hf  # noqa: E402
from taco_models.generate import generate  # noqa: E402
from taco_models.parallel import reference_logits  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = ("gpt2", "qwen2_untied", "qwen2_tied")  # the transformers 4.x fixtures (greedy.npy)
NEW = 16


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    cfg, params = hf.load(FIXTURES / request.param)
    return request.param, cfg, params, np.load(FIXTURES / request.param / "tokens.npy")


def _full_logits(cfg, params, tokens) -> np.ndarray:
    logits = reference_logits(cfg, params, jnp.asarray(tokens), dtype="float32")
    return np.asarray(logits)[..., : cfg.vocab_size]


# Two programs' fp32 logits of one model (the cache's and the full forward's; ours and
# transformers', tests/models/test_hf.py's LOGITS_RTOL) differ by at most this share of the
# largest logit: the same arithmetic in other orders. Where the best logit leads the second by
# more than twice that, both programs pick the same token: token equality is then guaranteed.
LOGITS_RTOL = 1e-4


def _assert_decided(logits: np.ndarray) -> None:
    """Every position's best logit leads its second by more than 2 LOGITS_RTOL of the largest
    logit (else two programs could pick different tokens, and comparing tokens would say
    nothing about the code)."""
    top2 = np.sort(logits, axis=-1)[..., -2:]
    margin = top2[..., 1] - top2[..., 0]
    assert np.all(margin > 2 * LOGITS_RTOL * np.abs(logits).max()), margin.min()


def test_greedy_is_the_argmax_of_the_full_forward_token_by_token(fixture):
    """Every new token is the argmax, at its position, of the full forward (no cache) of the
    prompt and the tokens before it (two programs: equal where the argmax is decided)."""
    _, cfg, params, prompt = fixture
    new = np.asarray(generate(cfg, params, prompt, NEW))
    sequence = np.concatenate([prompt, new], axis=1)
    logits = _full_logits(cfg, params, sequence[:, :-1])[:, prompt.shape[1] - 1 :]
    _assert_decided(logits)
    np.testing.assert_array_equal(logits.argmax(-1), new)


def test_greedy_equals_transformers(fixture):
    """transformers' greedy tokens, stored from another machine: equal where every step's
    argmax is decided beyond the two libraries' logit difference."""
    name, cfg, params, prompt = fixture
    theirs = np.load(FIXTURES / name / "greedy.npy")
    ours = np.asarray(generate(cfg, params, prompt, NEW))
    sequence = np.concatenate([prompt, ours], axis=1)
    _assert_decided(_full_logits(cfg, params, sequence[:, :-1])[:, prompt.shape[1] - 1 :])
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.slow
def test_sampling_draws_from_the_tempered_top_k_softmax():
    """4096 draws of the first new token (one row each, the same prompt) against
    softmax(logits / T) over the top k: each token's frequency within 5 standard deviations
    of a binomial count, sqrt(p (1 - p) / n), of its probability (a false alarm per token
    below 1e-6); a token outside the top k is never drawn."""
    cfg, params = hf.load(FIXTURES / "qwen2_untied")
    prompt = np.load(FIXTURES / "qwen2_untied" / "tokens.npy")[:1]
    n, temperature, k = 4096, 1.5, 3
    drawn = np.asarray(
        generate(
            cfg, params, np.repeat(prompt, n, axis=0), 1, temperature=temperature, top_k=k, seed=3
        )
    )[:, 0]
    logits = _full_logits(cfg, params, prompt)[0, -1] / temperature
    top = np.argsort(logits)[-k:]
    p = np.exp(logits[top] - logits[top].max())
    p /= p.sum()
    assert set(np.unique(drawn)) <= set(top)
    frequency = np.array([(drawn == token).mean() for token in top])
    assert np.all(np.abs(frequency - p) <= 5 * np.sqrt(p * (1 - p) / n))


@pytest.mark.slow
def test_a_seed_gives_the_same_sample_and_only_real_ids():
    """The GPT-2 fixture pads its 250 ids to 256 rows: a hot sample never picks the padding."""
    cfg, params = hf.load(FIXTURES / "gpt2")
    prompt = np.load(FIXTURES / "gpt2" / "tokens.npy")
    hot = lambda seed: np.asarray(generate(cfg, params, prompt, NEW, temperature=5.0, seed=seed))  # noqa: E731
    assert np.array_equal(hot(7), hot(7)) and not np.array_equal(hot(7), hot(8))
    assert hot(7).max() < cfg.vocab_size
    one = generate(cfg, params, prompt, NEW, temperature=2.0, top_k=1, seed=7)
    np.testing.assert_array_equal(one, generate(cfg, params, prompt, NEW))  # top-1 is greedy


def test_learned_positions_bound_the_budget_and_say_how_many_fit():
    cfg, params = hf.load(FIXTURES / "gpt2")  # n_positions 32
    prompt = np.load(FIXTURES / "gpt2" / "tokens.npy")
    with pytest.raises(ValueError, match=r"need 33 positions; .* seq_len=32: at most 16 new"):
        generate(cfg, params, prompt, 17)
    with pytest.raises(ValueError, match=r"at least one token, got shape=\(2, 0\)"):
        generate(cfg, params, prompt[:, :0], 4)
    with pytest.raises(ValueError, match=r"top_k=0 in \[1, vocab_size=250\]"):
        generate(cfg, params, prompt, 4, temperature=1.0, top_k=0)
