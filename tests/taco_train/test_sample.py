"""`python -m taco_train.sample` and the default run's closing sample; the default run's export
in transformers (where a Python with torch and transformers is at hand, `TACO_HF_PYTHON`).

The default run here is configs/default.toml on the fixture corpus, shortened to a few steps.
"""

from __future__ import annotations

import contextlib
import io
import shutil

import jax
import numpy as np
import pytest
from train_testing import HF_PYTHON, REPO, tiny_overrides, transformers_loads

pytest.importorskip("safetensors")

from taco_models import hf  # noqa: E402
from taco_models.generate import generate  # noqa: E402
from taco_train import data, sample, trainer  # noqa: E402
from taco_train.export import export  # noqa: E402
from taco_train.main import main  # noqa: E402

FIXTURES = REPO / "tests" / "models" / "fixtures" / "hf"
DEFAULT = str(REPO / "configs" / "default.toml")
SHORT = ("run.steps=4", "run.eval_every=4", "data.batch_size=4")


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, cache):
    """(run directory, stdout) of the shortened default run."""
    out = tmp_path_factory.mktemp("default")
    args = ["--config", DEFAULT]
    for override in tiny_overrides(out, cache, *SHORT):
        args += ["--set", override]
    jax.clear_caches()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(args)
    return out, printed.getvalue()


def _cli(capsys, *args) -> str:
    sample.main([str(a) for a in args])
    return capsys.readouterr().out


@pytest.mark.slow
def test_the_default_run_ends_with_a_sample_of_its_final_checkpoint(default_run):
    """The closing sample is what `taco_train.sample` decodes from the run directory with the
    trainer's settings (run.sample_tokens = 64 in configs/default.toml)."""
    out, printed = default_run
    header = (
        f"sample (64 tokens at most, temperature {trainer.SAMPLE_TEMPERATURE}, top-k "
        f"{trainer.SAMPLE_TOP_K}; python -m taco_train.sample {out} --prompt ... for "
        "more):\n"
    )
    assert header in printed
    text = printed.split(header, 1)[1]
    model, params, tokenizer, eos = sample.load(out)
    expected = sample.complete(
        model,
        params,
        tokenizer,
        eos,
        "",
        64,
        seed=0,
        top_k=40,
        temperature=trainer.SAMPLE_TEMPERATURE,
    )
    assert text == expected + "\n" and expected.strip()


@pytest.mark.slow
def test_sample_continues_a_prompt_of_the_default_run(default_run, capsys):
    out, _ = default_run
    printed = _cli(capsys, out, "--prompt", "To be", "--max-new-tokens", 12)
    model, params, tokenizer, eos = sample.load(out)
    ids = tokenizer.encode("To be").ids
    new = np.asarray(generate(model, params, np.asarray([ids]), 12))[0]
    assert not set(eos) & set(new.tolist())  # else the text would stop short of the budget
    assert printed == "To be" + tokenizer.decode(new.tolist()) + "\n"


@pytest.mark.slow
def test_the_default_runs_export_loads_in_transformers(default_run, tmp_path):
    if not HF_PYTHON:
        pytest.skip("TACO_HF_PYTHON (a Python with torch and transformers) is not set")
    out, _ = default_run
    export(out, tmp_path / "export")
    cfg, params = hf.load(tmp_path / "export")
    tokenizer = data.Tokenizer.load(out / "tokenizer.json")
    transformers_loads(tmp_path / "export", cfg, params, tokenizer, tmp_path)


def test_sample_reads_a_hugging_face_directory(capsys):
    """Greedy by default: the prompt, then `taco_models.generate`'s tokens decoded."""
    directory = FIXTURES / "qwen2_tied"  # with a tokenizer.json (bytes, "<|endoftext|>" 255)
    from tokenizers import Tokenizer

    printed = _cli(capsys, directory, "--prompt", "ab", "--max-new-tokens", 6)
    model, params = hf.load(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    new = np.asarray(generate(model, params, np.asarray([tokenizer.encode("ab").ids]), 6))[0]
    assert 255 not in new.tolist()
    assert printed == "ab" + tokenizer.decode(new.tolist()) + "\n"


def test_sample_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        sample.main([str(tmp_path)])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"taco-train sample: error: {tmp_path / 'tokenizer.json'}: no such file (a run writes it "
        "when it starts; a Hugging Face directory holds its tokenizer there)\n"
    )
    gpt2 = tmp_path / "gpt2"  # 32 learned positions
    shutil.copytree(FIXTURES / "gpt2", gpt2)
    shutil.copy(FIXTURES / "qwen2_tied" / "tokenizer.json", gpt2)
    with pytest.raises(SystemExit):
        sample.main([str(gpt2), "--prompt", "abc", "--max-new-tokens", "30"])
    assert capsys.readouterr().err == (
        "taco-train sample: error: a prompt of 3 tokens and max_new_tokens=30 need 33 "
        "positions; the model's learned positions end at seq_len=32: at most 29 new tokens\n"
    )
