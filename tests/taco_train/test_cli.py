"""Configuration and usage mistakes: one line on stderr, exit status 2, nothing prepared."""

import json
import os
import subprocess
import sys

import pytest
from train_testing import REPO, TINY, subprocess_env

from taco_models.config import ModelConfig
from taco_train.config import DEFAULT_PRESET, RunConfig, TrainConfig, load_config
from taco_train.main import bundled_configs, main

NOWHERE = "data.corpus='/nonexistent/corpus'"  # reached only if a check came too late


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "model.d_modl=3"], "unknown key model.d_modl"),
        (["--set", "optimizer.lr=abc"], "optimizer.lr='abc' does not match"),
        (["--set", "compression.fwd=zstd"], "compression.fwd='zstd' is not one of"),
        (["--set", "compression.impl=cuda"], "compression: unknown impl='cuda'"),
        (["--set", "parallel.tp=3"], "model.n_kv_heads=8 is not a multiple of parallel.tp=3"),
        (
            [
                "--set",
                "parallel.mode=shard_map",
                "--set",
                "parallel.tp=4",
                "--set",
                "parallel.dp=4",
            ],
            "needs 16 devices, 8 visible; on a CPU, set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=16",
        ),
        (["--set", "nosection"], "is not of the form section.key=value"),
    ],
)
def test_config_errors_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", TINY, "--set", NOWHERE, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("taco-train: error: "), err
    assert message in err


@pytest.mark.parametrize(
    "corpus, overrides, message",
    [
        ("nowhere", [], "data.corpus='{}/nowhere' does not exist"),
        (
            "short.txt",
            [],
            "the training split's n=8 tokens cannot fill one window of model.seq_len + 1=33 tokens",
        ),
        (
            "long.txt",
            ["data.val_fraction=0.01"],
            "the validation split's n=3 tokens cannot fill "
            "one window of model.seq_len + 1=33 tokens; give data.corpus more text, or lower "
            "model.seq_len or raise data.val_fraction",
        ),
    ],
)
def test_data_errors_are_one_line(corpus, overrides, message, capsys, tmp_path):
    (tmp_path / "short.txt").write_text("abcdefgh")  # train: 7 bytes + EOT; val: 1 + EOT
    (tmp_path / "long.txt").write_text("x" * 200)  # val: the last 2 bytes + EOT
    args = ["--config", TINY, "--set", f"data.cache_dir={str(tmp_path / 'cache')!r}"]
    for override in [f"data.corpus={str(tmp_path / corpus)!r}", *overrides]:
        args += ["--set", override]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("taco-train: error: ") and message.format(tmp_path) in last, err
    assert "Traceback" not in err


def test_without_the_train_extra_is_one_line_naming_it():
    """flax missing (made unimportable in a fresh process): one line naming the extra, exit 2."""
    code = "import sys; sys.modules['flax'] = None; from taco_train.main import main; main([])"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=subprocess_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "taco-train: error: the training application needs the `train` extra (no module 'flax'): "
        'pip install -c constraints.txt -e ".[train]" in the repository, or pip install '
        '"taco-jax[train]"\n'
    )


def test_missing_config_file_is_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(tmp_path / "nope.toml")])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err
        == f"taco-train: error: config file {str(tmp_path / 'nope.toml')!r} does not exist\n"
    )


def test_dev_null_or_a_pipe_as_config_is_the_defaults_and_the_sets(capsys):
    """`--config /dev/null` (as benchmarks/checkpoint_pause.py passes) overrides nothing: the
    dataclass defaults plus the --set values; a pipe (`<(...)`) is read as a file."""
    main(["--config", "/dev/null", "--set", "run.steps=7", "--print-config"])
    defaults = TrainConfig(ModelConfig.preset(DEFAULT_PRESET), run=RunConfig(steps=7))
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(defaults.to_dict()))
    read, write = os.pipe()
    os.write(write, b"[run]\nsteps = 5\n")
    os.close(write)
    try:
        main(["--config", f"/dev/fd/{read}", "--set", "optimizer.lr=1e-3", "--print-config"])
    finally:
        os.close(read)
    printed = json.loads(capsys.readouterr().out)
    assert printed["run"]["steps"] == 5 and printed["optimizer"]["lr"] == 1e-3
    assert printed["model"] == json.loads(json.dumps(defaults.to_dict()["model"]))


def test_a_directory_as_config_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """A directory is not read as a config: one line naming it, whether given as a path or a
    bare name; a directory named like a bundled config does not hide it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "tiny").mkdir()
    for name in (str(tmp_path), "mine", f"mine{os.sep}"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--config", name])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == (
            f"taco-train: error: --config {name!r} is a directory, not a TOML file\n"
        )
    main(["--config", "tiny", "--print-config"])
    assert json.loads(capsys.readouterr().out) == json.loads(
        json.dumps(load_config(TINY).to_dict())
    )


def test_a_bundled_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch, capsys):
    """`--config tiny` (or tiny.toml) is the bundled configs/tiny.toml where no such file is in
    the working directory, and a file of that name there wins; a name that is neither is one
    line listing the bundled ones."""
    monkeypatch.chdir(tmp_path)
    bundled = json.loads(json.dumps(load_config(TINY).to_dict()))
    for name in ("tiny", "tiny.toml"):
        main(["--config", name, "--print-config"])
        assert json.loads(capsys.readouterr().out) == bundled
    (tmp_path / "tiny").write_text("[run]\nsteps = 7\n")  # a path still means the file
    main(["--config", "tiny", "--print-config"])
    assert json.loads(capsys.readouterr().out)["run"]["steps"] == 7
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "tinny"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "taco-train: error: --config 'tinny': no such file, and no bundled config of that name "
        f"(bundled: {', '.join(bundled_configs())})\n"
    )
    assert "tiny" in bundled_configs() and "default" in bundled_configs()


@pytest.mark.parametrize(
    "change, named",
    [
        ("model.n_layers=3", "(model.n_layers: 2 -> 3);"),
        ("data.seed=1", "(data.seed: 0 -> 1);"),
        ("data.val_fraction=0.1", "(data.val_fraction: 0.05 -> 0.1);"),
        ("run.seed=1", "(run.seed: 0 -> 1);"),
        ("optimizer.sharded=true", "(optimizer.sharded: False -> True);"),
    ],
)
def test_resuming_with_another_model_data_or_seed_is_refused_before_anything_changes(
    change, named, capsys, tmp_path
):
    """A run directory keeps its config: another model, data, seed or optimizer state is one
    line naming the key, and the run directory is left as it was."""
    run = ["--config", TINY, "--set", f"run.out_dir={str(tmp_path)!r}", "--set", NOWHERE]
    earlier = json.dumps(load_config(TINY, [f"run.out_dir={str(tmp_path)!r}", NOWHERE]).to_dict())
    (tmp_path / "config.json").write_text(earlier)  # what an earlier run left: its config
    (tmp_path / "checkpoints" / "6").mkdir(parents=True)  # and a checkpoint to resume
    with pytest.raises(SystemExit):
        main([*run, "--set", change, "--set", "run.steps=9", "--set", "optimizer.lr=0.01"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err
    assert "run.steps" not in err and "optimizer.lr" not in err  # those may change
    assert "run.resume=false" in err and "another run.out_dir" in err
    assert (tmp_path / "config.json").read_text() == earlier


def test_resuming_a_sharded_optimizer_on_another_dp_is_refused_in_one_line(capsys, tmp_path):
    """What orbax cannot reshard is refused before anything changes, naming it: ZeRO-1 splits
    the optimizer state over the (dp, pp, tp) slices (docs/training.md, "Resume")."""
    out, sharded = f"run.out_dir={str(tmp_path)!r}", "optimizer.sharded=true"
    earlier = json.dumps(load_config(TINY, [out, NOWHERE, sharded]).to_dict())
    (tmp_path / "config.json").write_text(earlier)
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)  # a run to resume (its step directory)
    with pytest.raises(SystemExit):
        main(
            [
                "--config",
                TINY,
                "--set",
                out,
                "--set",
                NOWHERE,
                "--set",
                sharded,
                "--set",
                "parallel.dp=2",
            ]
        )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(dp, pp, tp) slices (1, 1, 1) -> (2, 1, 1)" in err, err
    assert (tmp_path / "config.json").read_text() == earlier
