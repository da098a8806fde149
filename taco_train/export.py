"""Writes a run's trained model as a Hugging Face directory:
`python -m taco_train.export RUN_DIR OUT_DIR`.

Reads RUN_DIR/config.json, restores the newest good checkpoint of RUN_DIR/checkpoints on the
run's own layout (as many devices as it used; on a CPU, `XLA_FLAGS=
--xla_force_host_platform_device_count=N`), and saves its fp32 parameters with
`models.hf.save` (the sharded optimizer's fp32 master weights, not its compute-dtype replica).
A run started from a checkpoint (model.init_from) also gets that directory's tokenizer and
generation files, so that transformers can load the export as it loaded the original.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

# Files of a Hugging Face directory that describe the tokenizer and generation, copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def export(run_dir: str | Path, out_dir: str | Path) -> int:
    """Saves the newest good checkpoint of `run_dir` to `out_dir`; returns its step."""
    import jax

    from models import hf
    from models.parallel import check_devices
    from taco_train.checkpointing import Checkpointer, abstract_state
    from taco_train.config import ConfigError, from_saved
    from taco_train.steps import full_params
    from taco_train.trainer import build_steps

    run_dir = Path(run_dir)
    saved = run_dir / "config.json"
    if not saved.is_file():
        raise ConfigError(f"{saved}: no such file (RUN_DIR is a run's run.out_dir)")
    cfg = from_saved(json.loads(saved.read_text()))
    try:
        check_devices(cfg.parallel)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    steps = build_steps(cfg)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.run.keep_checkpoints)
    try:
        target = abstract_state(steps.init, steps.state_sharding, jax.random.key(cfg.run.seed))
        restored = ckpt.restore_newest_good(target)
    finally:
        ckpt.close()
    if restored is None:
        raise ConfigError(f"{run_dir / 'checkpoints'}: no usable checkpoint to export")
    state, step = restored
    params = full_params(state, cfg.model, cfg.parallel, cfg.optimizer.sharded)
    hf.save(cfg.model, params, out_dir)
    if cfg.init_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(cfg.init_from) / name).is_file():
                shutil.copy2(Path(cfg.init_from) / name, Path(out_dir) / name)
    return step


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="taco_train.export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run's directory (its run.out_dir)")
    parser.add_argument("out_dir", help="the Hugging Face directory to write")
    args = parser.parse_args(argv)
    from taco_train.config import ConfigError

    try:
        step = export(args.run_dir, args.out_dir)
    except ConfigError as error:
        print(f"taco-train export: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"exported step {step} of {args.run_dir} to {args.out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
