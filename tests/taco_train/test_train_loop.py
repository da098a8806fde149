"""End to end on configs/tiny.toml: the CLI's outputs, and resume == uninterrupted, bit for bit."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_testing import REPO, tiny_overrides

from taco_train import metrics
from taco_train.main import main

TINY = str(REPO / "configs" / "tiny.toml")


def _cli(out_dir, cache_dir, *extra):
    args = ["--config", TINY]
    for override in tiny_overrides(out_dir, cache_dir, *extra):
        args += ["--set", override]
    main(args)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("full")
    _cli(out, cache)
    return out


def _final_params(out_dir, step):
    manager = ocp.CheckpointManager((out_dir / "checkpoints").absolute())
    restored = manager.restore(step, args=ocp.args.StandardRestore())
    manager.close()
    return restored


def test_cli_writes_metrics_plot_and_config(full_run):
    records = metrics.read_jsonl(full_run / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in evals] == [3, 6]
    for r in train:
        assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) and r["lr"] > 0
    assert "tokens_per_s" in train[-1] and "mfu" in train[-1]
    assert (full_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((full_run / "config.json").read_text())
    assert config["run"]["steps"] == 6 and config["model"]["d_model"] == 64


def test_resume_reproduces_the_uninterrupted_run(full_run, cache, tmp_path):
    _cli(tmp_path, cache, "run.stop_at=3")  # "interrupted" after the step-3 checkpoint
    first = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    assert max(r["step"] for r in first) == 3
    _cli(tmp_path, cache)  # resumes from step 3
    drop_timing = lambda rs: [
        {k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in rs
    ]
    resumed = drop_timing(metrics.read_jsonl(tmp_path / "metrics.jsonl"))
    assert resumed == drop_timing(metrics.read_jsonl(full_run / "metrics.jsonl"))
    a, b = _final_params(full_run, 6), _final_params(tmp_path, 6)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
