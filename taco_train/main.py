"""The bundled training script: `python -m taco_train [--config FILE|NAME] [--set k=v ...]`.

Parses the configuration and calls `taco_train.trainer.train_and_evaluate`; see docs/training.md.
`--config` takes a TOML file, or the name of a config bundled with the trainer (the repository's
configs/, installed as the package data `taco_train.configs`), found wherever the trainer is
installed and run from.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Sequence

DEFAULT_CONFIG = "default"  # the bundled configs/default.toml


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="taco-train", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        default=None,
        help="TOML file of overrides, or the name of a bundled one: "
        f"{', '.join(bundled_configs())} (default: the bundled {DEFAULT_CONFIG})",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one value, e.g. --set optimizer.lr=3e-4 --set parallel.tp=4",
    )
    parser.add_argument("--print-config", action="store_true", help="print the config and exit")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Configuration and usage errors print one line and exit with status 2 (as argparse does),
    a diverged run or a checkpoint that failed to restore one line and status 1, a run stopped
    by SIGTERM or SIGINT one line and 128 + the signal's number; anything else keeps its
    traceback."""
    args = parse_args(argv)
    try:
        _main(args)
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in TRAIN_EXTRA_MODULES:
            raise
        print(
            f"taco-train: error: the training application needs the `train` extra (no module "
            f'{error.name!r}): pip install -c constraints.txt -e ".[train]" in the '
            'repository, or pip install "taco-jax[train]"',
            file=sys.stderr,
        )
        raise SystemExit(2) from None


# What the `train` extra of pyproject.toml installs, as imported.
TRAIN_EXTRA_MODULES = ("flax", "optax", "orbax", "tokenizers", "matplotlib", "tqdm", "tensorboardX")


def _main(args: argparse.Namespace) -> None:
    from taco_train.checkpointing import RestoreError
    from taco_train.config import ConfigError
    from taco_train.data import DataError
    from taco_train.trainer import Diverged, Stopped

    try:
        _run(args)
    except (ConfigError, DataError, Diverged, RestoreError) as error:
        print(f"taco-train: error: {error}", file=sys.stderr)
        raise SystemExit(1 if isinstance(error, Diverged | RestoreError) else 2) from None
    except Stopped as stopped:
        print(f"taco-train: {stopped}", file=sys.stderr)
        raise SystemExit(stopped.exit_status) from None
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (preparing data, at the end)
        print(
            "taco-train: SIGINT: interrupted outside the training loop; the checkpoints "
            "complete so far stay good (run the same command to resume)",
            file=sys.stderr,
        )
        raise SystemExit(128 + signal.SIGINT) from None


def bundled_configs() -> list[str]:
    """The names of the configs bundled with the trainer (`taco_train.configs`)."""
    from importlib import resources

    files = resources.files("taco_train.configs").iterdir()
    return sorted(f.name.removesuffix(".toml") for f in files if f.name.endswith(".toml"))


def config_file(name: str):
    """The TOML file `--config name` means: `name` where it names a file (a path, as given;
    `/dev/null` or a pipe too: no overrides), else the bundled config of that name (`tiny` or
    `tiny.toml`: `taco_train.configs/tiny.toml`); ConfigError naming a directory as such, else
    naming the bundled configs, where it is neither."""
    import os
    from importlib import resources
    from pathlib import Path

    from taco_train.config import ConfigError

    if os.path.exists(name) and not os.path.isdir(name):
        return Path(name)
    bundled = bundled_configs()
    stem = name.removesuffix(".toml")
    if os.sep not in name and stem in bundled:
        return resources.files("taco_train.configs") / f"{stem}.toml"
    if os.path.isdir(name):
        raise ConfigError(f"--config {name!r} is a directory, not a TOML file")
    if os.sep in name:
        raise ConfigError(f"config file {name!r} does not exist")
    raise ConfigError(
        f"--config {name!r}: no such file, and no bundled config of that name (bundled: "
        f"{', '.join(bundled)})"
    )


def _run(args: argparse.Namespace) -> None:
    import json
    from importlib import resources

    from taco_train.config import load_config

    with resources.as_file(config_file(args.config or DEFAULT_CONFIG)) as path:
        cfg = load_config(path, args.overrides)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=1, default=str))
        return
    from taco_train.native_output import without_gloo_connected_lines
    from taco_train.trainer import spans_processes, train_and_evaluate

    several = spans_processes(cfg.run.distributed)  # on the CPU, Gloo connects the processes
    with without_gloo_connected_lines() if several else contextlib.nullcontext():
        train_and_evaluate(cfg)
