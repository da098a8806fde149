"""The bundled training script: `python -m taco_train [--config FILE] [--set k=v ...]`.

Parses the configuration and calls `taco_train.trainer.train_and_evaluate`; see docs/training.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

DEFAULT_CONFIG = "configs/default.toml"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="taco-train", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        default=None,
        help=f"TOML file of overrides (default: {DEFAULT_CONFIG} if it exists, else built-ins)",
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


def _run(args: argparse.Namespace) -> None:
    import json
    import os

    from taco_train.config import load_config

    path = args.config or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    cfg = load_config(path, args.overrides)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=1, default=str))
        return
    from taco_train.trainer import train_and_evaluate

    train_and_evaluate(cfg)
