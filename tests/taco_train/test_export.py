"""`python -m taco_train.export`: any run, on any number of devices, with its tokenizer.

A TP = 2 run under shard_map (two of the session's devices) is exported by a process with one
CPU device; the export loads back with `taco_models.hf` and its tokenizer with `tokenizers`, and,
where a Python with torch and transformers is at hand (`TACO_HF_PYTHON`), with transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from train_testing import (
    HF_PYTHON,
    REPO,
    TEXT,
    subprocess_env,
    tiny_args,
    transformers_loads,
)

pytest.importorskip("safetensors")

from taco_models import hf  # noqa: E402
from taco_train import data  # noqa: E402
from taco_train.checkpointing import read_arrays  # noqa: E402
from taco_train.config import ConfigError  # noqa: E402
from taco_train.export import export  # noqa: E402
from taco_train.export import main as export_main  # noqa: E402
from taco_train.main import main  # noqa: E402

# A BPE vocabulary (the tiny preset's 256 ids hold only the byte tokenizer), TP = 2 on devices.
TP2_BPE = (
    "parallel.mode='shard_map'",
    "parallel.tp=2",
    "data.tokenizer='bpe'",
    "model.vocab_size=320",
    "run.steps=2",
    "run.eval_every=2",
)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("tp2")
    jax.clear_caches()
    main(tiny_args(out, cache, *TP2_BPE))
    return out


def _export_on_one_cpu(run, out) -> subprocess.CompletedProcess:
    env = subprocess_env(
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
    )
    command = [sys.executable, "-m", "taco_train.export", str(run), str(out)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_tp2_run_exports_on_one_device_with_its_tokenizer(tp2_run, tmp_path):
    done = _export_on_one_cpu(tp2_run, tmp_path / "export")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith(f"exported step 2 of {tp2_run} to {tmp_path / 'export'}")
    cfg, params = hf.load(tmp_path / "export")
    final = read_arrays(tp2_run / "checkpoints" / "2", ("params",))
    final["wte"][cfg.vocab_size :] = 0  # the padding rows are not exported (they load as 0)
    assert jax.tree.all(jax.tree.map(np.array_equal, final, params))
    from tokenizers import Tokenizer

    theirs = Tokenizer.from_file(str(tmp_path / "export" / "tokenizer.json"))
    ours = data.Tokenizer.load(tp2_run / "tokenizer.json")
    assert theirs.encode(TEXT).ids == ours.encode([TEXT])[0].tolist()
    eot = ours.eot_id
    for name in ("generation_config.json", "tokenizer_config.json"):
        written = json.loads((tmp_path / "export" / name).read_text())
        assert written.get("eos_token_id", eot) == eot
        assert written.get("eos_token", data.EOT) == data.EOT
    if HF_PYTHON:
        transformers_loads(tmp_path / "export", cfg, params, ours, tmp_path)


def test_a_non_empty_out_dir_is_refused_in_one_line(tmp_path, capsys):
    """Before anything is read or written: the run directory need not even exist."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as info:
        export_main([str(tmp_path / "no_run"), str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"taco-train export: error: OUT_DIR {tmp_path / 'out'} is not empty "
        "(notes.txt); choose another, or pass --force to write over it"
    ]
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="no_run/config.json: no such file"):
        export(tmp_path / "no_run", tmp_path / "out", overwrite=True)  # --force goes on


def test_export_help_says_what_it_does_in_a_sentence(capsys):
    with pytest.raises(SystemExit) as info:
        export_main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert (
        "Writes a run's trained model as a Hugging Face directory, with the tokenizer it "
        "trained with." in " ".join(out.split())
    )
