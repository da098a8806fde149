"""The user's journeys through several features at once, as the README and docs/ lead them:

- fine-tune a Llama and a Qwen2 checkpoint with each tokenizer choice (`data.tokenizer` byte,
  bpe, hf), export the run, and continue a prompt from the export: the text is the run
  directory's, greedy, token for token;
- an error budget moves a call site off its codec, and a resume with compression off runs
  uncompressed (the fallbacks held for the settings that chose them);
- a damaged checkpoint: one line naming the file, and a retry with a good copy is not blocked.

The checkpoints are the tiny transformers-made fixtures of tests/models/fixtures/hf/ (256-entry
vocabularies), widened to 320 entries for the bpe tokenizer, whose vocabulary needs 257 or
more. The installed wheel's journey is in tests/test_install.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from train_testing import REPO, TINY, tiny_overrides

pytest.importorskip("safetensors")

from taco_models import hf  # noqa: E402
from taco_train import comm_error, data, metrics, sample, trainer  # noqa: E402
from taco_train.export import main as export_main  # noqa: E402
from taco_train.main import main  # noqa: E402

FIXTURES = REPO / "tests" / "models" / "fixtures" / "hf"
LLAMA = FIXTURES / "llama_tied"  # no tokenizer; generation_config: bos 1, eos 2
QWEN = FIXTURES / "qwen2_tied"  # a tokenizer.json: the bytes, "<|endoftext|>" = 255
PROMPT = "KING. Now"
NEW_TOKENS = 12
SHORT = (
    "model.seq_len=16",
    "run.steps=2",
    "run.eval_every=2",
    "run.checkpoint_every=2",
    "run.log_every=1",
    "run.tensorboard=false",
)


def _cli(tmp_path: Path, cache: Path, out: Path, *extra: str) -> None:
    """Runs the trainer's command line on the fixture corpus (tests read its output with
    capsys)."""
    jax.clear_caches()  # each run lowers its programs as a fresh process would
    args = ["--config", TINY]  # its model replaced by the --set model.init_from of each test
    for override in tiny_overrides(out, cache, *extra):
        args += ["--set", override]
    main(args)


def _widened(fixture: Path, vocab_size: int, out: Path) -> Path:
    """`fixture` with `vocab_size` entries: its embedding rows, then new random ones (its
    tokenizer files copied beside, unchanged)."""
    cfg, params = hf.load(fixture)
    wide = dataclasses.replace(cfg, vocab_size=vocab_size)
    wte = np.zeros((wide.padded_vocab, cfg.d_model), np.float32)
    wte[: cfg.vocab_size] = params["wte"][: cfg.vocab_size]
    rng = np.random.default_rng(0)
    wte[cfg.vocab_size : vocab_size] = 0.02 * rng.standard_normal(
        (vocab_size - cfg.vocab_size, cfg.d_model)
    )
    hf.save(wide, {**params, "wte": wte}, out)
    for name in ("tokenizer.json", "generation_config.json"):
        if (fixture / name).is_file():
            shutil.copy(fixture / name, out / name)
    return out


def _with_tokenizer(fixture: Path, tokenizer_from: Path, out: Path) -> Path:
    """A copy of `fixture` holding `tokenizer_from`'s tokenizer.json (a Llama with a tokenizer
    of its own, as SmolLM2 is)."""
    shutil.copytree(fixture, out)
    shutil.copy(tokenizer_from / "tokenizer.json", out / "tokenizer.json")
    return out


def _checkpoint(arch: str, tokenizer: str, tmp_path: Path) -> Path:
    fixture = {"llama": LLAMA, "qwen2": QWEN}[arch]
    if tokenizer == "bpe":
        return _widened(fixture, 320, tmp_path / f"{arch}_320")
    if tokenizer == "hf" and arch == "llama":
        return _with_tokenizer(LLAMA, QWEN, tmp_path / "llama_with_tokenizer")
    return fixture


def _sample(source: Path) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        sample.main([str(source), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)])
    return printed.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["byte", "bpe", "hf"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_finetune_export_sample_is_the_runs_text(arch, tokenizer, tmp_path, cache):
    """The export holds the tokenizer the run trained with, whatever the checkpoint held
    (a "byte" or "bpe" run on a checkpoint with a tokenizer of its own writes its own), with
    end-of-text ids inside the vocabulary in config.json and generation_config.json; the
    export continues a prompt greedily as the run directory does."""
    checkpoint = _checkpoint(arch, tokenizer, tmp_path)
    run, export = tmp_path / "run", tmp_path / "export"
    _cli(
        tmp_path,
        cache,
        run,
        f"model.init_from={str(checkpoint)!r}",
        f"data.tokenizer={tokenizer!r}",
        *SHORT,
    )
    export_main([str(run), str(export)])

    ours = data.Tokenizer.load(run / "tokenizer.json" if tokenizer != "byte" else Path("byte"))
    from tokenizers import Tokenizer

    written = Tokenizer.from_file(str(export / "tokenizer.json"))
    assert written.encode(PROMPT).ids == ours.encode([PROMPT])[0].tolist()
    config = json.loads((export / "config.json").read_text())
    generation = json.loads((export / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    assert eos[0] == ours.eot_id  # the token that ended every training document
    assert config["eos_token_id"] == generation["eos_token_id"]
    assert config["bos_token_id"] == generation["bos_token_id"]
    for i in [*eos, generation["bos_token_id"]]:
        assert 0 <= i < config["vocab_size"]
    tokenizer_config = json.loads((export / "tokenizer_config.json").read_text())
    if tokenizer == "hf":  # the checkpoint's ids stay where the vocabulary holds them
        assert eos == [255] + ([2] if arch == "llama" else [])
    else:  # nothing of the checkpoint's tokenizer: ours, described by ours
        assert eos == [ours.eot_id] and tokenizer_config["tokenizer_class"] == (
            "PreTrainedTokenizerFast"
        )

    from_run, from_export = _sample(run), _sample(export)
    assert from_run.startswith(PROMPT) and len(from_run) > len(PROMPT) + 1
    assert from_export == from_run


@pytest.mark.slow
def test_a_checkpoint_without_a_tokenizer_exports_the_runs(tmp_path, cache):
    """A Llama directory without a tokenizer, fine-tuned on the byte tokenizer: the export
    holds the byte tokenizer and its end-of-text (0), not the checkpoint's eos id (2), and
    `taco_train.sample` reads it."""
    run, export = tmp_path / "run", tmp_path / "export"
    _cli(tmp_path, cache, run, f"model.init_from={str(LLAMA)!r}", "data.tokenizer='byte'", *SHORT)
    export_main([str(run), str(export)])
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == data.BYTE_EOT_ID == generation["bos_token_id"]
    assert _sample(export) == _sample(run)


@pytest.mark.slow
def test_export_refuses_a_run_without_its_tokenizer_in_one_line(tmp_path, cache, capsys):
    run = tmp_path / "run"
    _cli(tmp_path, cache, run, f"model.init_from={str(LLAMA)!r}", "data.tokenizer='byte'", *SHORT)
    (run / "tokenizer.json").unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        export_main([str(run), str(tmp_path / "export")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"taco-train export: error: {run / 'tokenizer.json'}: no such file, so the tokenizer "
        "the run trained with (data.tokenizer='byte') cannot be written; a run writes it when "
        "it starts: nothing exported"
    ]
    assert not (tmp_path / "export").exists()


# ---------------------------------------------------------------------------------------------
# The error budget across a resume with other settings.


def _outlier_checkpoint(path: Path) -> Path:
    """tests/taco_train/test_comm_error.py's tiny GPT whose layer 1 writes outlier features,
    over the budget of INT8 there."""
    from test_comm_error import _outlier_checkpoint as make

    make(path)
    return path


@pytest.mark.slow
def test_budget_fallback_then_resume_with_compression_off_is_uncompressed(tmp_path, cache, capsys):
    """INT8 with a budget: layer 1's MLP output falls back after step 2 and the checkpoint of
    step 4 records it. Resumed with compression off, the start-up line says the fallback is
    dropped and why, and every measuring step after it moves 0% of the TP bytes compressed."""
    checkpoint = _outlier_checkpoint(tmp_path / "hf")
    run = tmp_path / "run"
    measured = ("run.comm_error_every=2", "run.checkpoint_every=2", "run.tensorboard=false")
    budget = ("compression.error_budget=0.02", f"model.init_from={str(checkpoint)!r}")
    capsys.readouterr()
    _cli(tmp_path, cache, run, "compression.fwd='int8'", *budget, *measured, "run.steps=4")
    assert "over compression.error_budget=0.02: layer_01/mlp_out/fwd" in capsys.readouterr().out
    records = metrics.read_jsonl(run / "metrics.jsonl")
    before = [r["tp_bytes_compressed"] for r in records if r["kind"] == "comm"]
    assert len(before) == 2 and all(0.85 < share <= 1 for share in before)

    off = ("compression.fwd='none'", *budget, *measured, "run.steps=8")
    _cli(tmp_path, cache, run, *off)
    printed = capsys.readouterr()
    err = printed.err
    assert (
        "the error budget's fallbacks saved with the checkpoint (layer_01/mlp_out/fwd -> none) "
        "are dropped: compression.fwd 'int8' -> 'none'; every call site starts from the "
        "configured codecs"
    ) in err
    records = metrics.read_jsonl(run / "metrics.jsonl")
    after = [r for r in records if r["kind"] == "comm" and r["step"] > 4]
    assert [r["step"] for r in after] == [6, 8]
    assert all(r["tp_bytes_compressed"] == 0 for r in after)
    assert "TP bytes compressed 0.0%" in printed.out  # the measuring steps' lines

    saved = json.loads((run / "checkpoints" / "8" / "_CHECKPOINT_METADATA").read_text())
    assert saved["custom_metadata"][comm_error.METADATA_KEY] == {}


# ---------------------------------------------------------------------------------------------
# A damaged Hugging Face checkpoint.


def _truncated(fixture: Path, out: Path) -> Path:
    shutil.copytree(fixture, out)
    weights = out / hf.SINGLE_FILE
    weights.write_bytes(weights.read_bytes()[:-1000])  # a download cut short
    return out


def test_a_truncated_safetensors_file_is_one_line_from_every_entry_point(tmp_path, capsys):
    damaged = _truncated(LLAMA, tmp_path / "damaged")
    shutil.copy(QWEN / "tokenizer.json", damaged)
    file = damaged / hf.SINGLE_FILE
    with pytest.raises(hf.CheckpointError) as info:
        hf.load(damaged)
    message = str(info.value)
    assert message.startswith(f"{file}: not a readable safetensors file (")
    assert "\n" not in message
    with pytest.raises(SystemExit) as exit_info:
        sample.main([str(damaged), "--prompt", "a"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"taco-train sample: error: {message}\n"
    sharded = tmp_path / "sharded"  # a cut-short index of a sharded checkpoint, and config.json
    shutil.copytree(QWEN, sharded)
    index = sharded / hf.INDEX_FILE
    index.write_text(index.read_text()[:50])
    with pytest.raises(hf.CheckpointError, match=rf"^{index}: not a weight map \(JSONDecodeError"):
        hf.load(sharded)
    (sharded / hf.CONFIG_FILE).write_text("{")
    with pytest.raises(hf.CheckpointError, match=rf"^{sharded / hf.CONFIG_FILE}: not valid JSON"):
        hf.load(sharded)


@pytest.mark.slow
def test_a_failed_start_does_not_block_the_retry(tmp_path, cache, capsys):
    """The trainer names the damaged file in one line; the retry with a good copy (another
    model.init_from) starts, though the failed start wrote the run's config.json."""
    damaged = _truncated(LLAMA, tmp_path / "damaged")
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        _cli(tmp_path, cache, run, f"model.init_from={str(damaged)!r}", *SHORT)
    assert info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("taco-")]
    assert len(err) == 1 and err[0].startswith(
        f"taco-train: error: model.init_from={str(damaged)!r}: {damaged / hf.SINGLE_FILE}: "
        "not a readable safetensors file ("
    )
    assert (run / "config.json").is_file() and not trainer.holds_checkpoints(run)
    _cli(tmp_path, cache, run, f"model.init_from={str(LLAMA)!r}", *SHORT)
    assert (run / "checkpoints" / "2").is_dir()
    assert json.loads((run / "config.json").read_text())["model"]["init_from"] == str(LLAMA)


# ---------------------------------------------------------------------------------------------
# A save the process did not finish.


@pytest.mark.slow
def test_a_resume_after_a_killed_save_says_it_in_a_line_of_ours(tmp_path, cache, capsys, caplog):
    """A process killed while orbax wrote step 6 leaves `6.orbax-checkpoint-tmp`; the resume
    removes it in one line of ours (not orbax's warning when it writes step 6 again) and
    ends with a good checkpoint 6."""
    run = tmp_path / "run"
    short = ("run.checkpoint_every=3", "run.tensorboard=false", "run.progress=false")
    args = ["--config", TINY]
    for override in tiny_overrides(run, cache, *short):
        args += ["--set", override]
    jax.clear_caches()
    main([*args, "--set", "run.steps=3"])
    unfinished = run / "checkpoints" / "6.orbax-checkpoint-tmp"
    shutil.copytree(run / "checkpoints" / "3", unfinished)  # what a killed save leaves, or like
    capsys.readouterr()
    jax.clear_caches()
    main([*args, "--set", "run.steps=6"])
    err = capsys.readouterr().err
    assert (
        f"removed {unfinished}: the save of step 6 that the earlier run did not finish (it "
        "ended while writing it)"
    ) in err
    assert "temporary directory" not in err + caplog.text
    assert trainer.holds_checkpoints(run) and not unfinished.exists()
    from taco_train.checkpointing import damage

    assert damage(run / "checkpoints" / "6") is None
