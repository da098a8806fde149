"""The installed package beside a user's project: the wheel, installed into a fresh virtual
environment, trains and samples from a directory that holds packages of its own named `models`
and `configs` (common in ML repositories), and `--config tiny` finds the bundled config.

Nothing is downloaded: the wheel is built without build isolation (setuptools from the `test`
extra), installed with `--no-deps --no-index`, and the fresh environment reaches the
dependencies through a .pth line naming this environment's site-packages (a plain directory on
sys.path: the editable install's own .pth files there are not run, so the repository stays
out of reach).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from train_testing import FIXTURE_CORPUS, REPO, subprocess_env

# What the wheel is built from: pyproject.toml's packages (with their package-dir) and readme.
SOURCES = ("pyproject.toml", "README.md", "taco_jax", "pallas_kernels", "models")
SOURCES += ("taco_train", "configs")


def _build_wheel(tmp_path: Path) -> Path:
    """The project's wheel, built from a copy of its sources (the repository stays untouched)."""
    pytest.importorskip("setuptools", reason="the `test` extra's setuptools builds the wheel")
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*command, "--no-index", "-w", wheels, source], check=True, timeout=300)
    (wheel,) = wheels.glob("taco_jax-*.whl")
    return wheel


def _fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A virtual environment holding the wheel; its dependencies are this environment's."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps"]
    subprocess.run([*install, "--no-index", wheel], check=True, timeout=300)
    return python


def _users_project(root: Path) -> Path:
    """A directory with its own `models` and `configs` packages (neither is ours)."""
    for package in ("models", "configs"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text(f"OWNER = 'the user, {package}'\n")
    return root


@pytest.mark.slow
def test_the_wheel_trains_and_samples_beside_a_users_models_package(tmp_path):
    wheel = _build_wheel(tmp_path)
    python = _fresh_venv(tmp_path, wheel)
    project = _users_project(tmp_path / "project")
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [python, *args], cwd=project, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr
        return done

    where = run(
        "-c",
        "import models, configs, taco_jax, taco_models, taco_train, taco_train.configs as c; "
        "print(models.OWNER, configs.OWNER, taco_models.__file__, c.__file__, sep='|')",
    ).stdout.strip()
    users_models, users_configs, ours, bundled = where.split("|")
    assert (users_models, users_configs) == ("the user, models", "the user, configs")
    site = str(python.parent.parent)
    assert ours.startswith(site) and bundled.startswith(site)  # the wheel's, not the repository's

    cache, out = tmp_path / "cache", project / "runs" / "tiny"
    overrides = [
        f"data.corpus={str(FIXTURE_CORPUS)!r}",
        f"data.cache_dir={str(cache)!r}",
        f"run.out_dir={str(out)!r}",
        "run.steps=2",
        "run.eval_every=2",
        "run.checkpoint_every=2",
        "run.progress=false",
    ]
    trained = run("-m", "taco_train", "--config", "tiny", *(f"--set={o}" for o in overrides))
    assert f"outputs in {out}" in trained.stderr
    sampled = run("-m", "taco_train.sample", str(out), "--prompt", "To be", "--max-new-tokens", "8")
    assert sampled.stdout.startswith("To be")
