"""Writes a run's trained model as a Hugging Face directory:
`python -m taco_train.export RUN_DIR OUT_DIR [--force]`.

Reads RUN_DIR/config.json and the parameters of the newest good checkpoint of
RUN_DIR/checkpoints as NumPy arrays, on no device (`checkpointing.read_arrays`): any machine
exports any run, whatever layout and number of devices trained it. Saves the fp32 parameters
with `taco_models.hf.save` (with the sharded optimizer, its fp32 master weights, not the
compute-dtype replica), and the tokenizer the run trained with: RUN_DIR/tokenizer.json with a
tokenizer_config.json and a generation_config.json naming its end-of-text token, so that
transformers' `AutoTokenizer` and `AutoModelForCausalLM` load the directory; a run started
from a checkpoint (model.init_from) gets that directory's tokenizer and generation files.
OUT_DIR must be absent or empty unless `--force` (`overwrite=True`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Files of a Hugging Face directory that describe the tokenizer and generation, copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def restore_params(run_dir: str | Path):
    """(TrainConfig, full-layout fp32 parameters as NumPy arrays, step) of the newest good
    checkpoint of the run in `run_dir`; a newer one that is not good is named in one line on
    stderr and left where it is."""
    from taco_train.checkpointing import damage, read_arrays
    from taco_train.config import ConfigError, from_saved
    from taco_train.steps import unshard_master

    run_dir = Path(run_dir)
    saved = run_dir / "config.json"
    if not saved.is_file():
        raise ConfigError(f"{saved}: no such file (RUN_DIR is a run's run.out_dir)")
    cfg = from_saved(json.loads(saved.read_text()))
    sharded = cfg.optimizer.sharded
    checkpoints = run_dir / "checkpoints"
    steps = sorted((int(p.name) for p in checkpoints.glob("*") if p.name.isdigit()), reverse=True)
    for step in steps:
        reason = damage(checkpoints / str(step))
        if reason is None:
            try:
                keys = ("opt_state", "master") if sharded else ("params",)
                arrays = read_arrays(checkpoints / str(step), keys)
            except Exception as error:  # noqa: BLE001 -- a damaged checkpoint, whatever broke
                reason = f"reading it failed ({type(error).__name__}: {error})"
            else:
                params = unshard_master(arrays, cfg.model, cfg.parallel) if sharded else arrays
                return cfg, params, step
        print(f"checkpoint {step} of {run_dir} is skipped: {reason}", file=sys.stderr)
    raise ConfigError(f"{checkpoints}: no usable checkpoint")


def export(run_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> int:
    """Saves the newest good checkpoint of `run_dir` to `out_dir` with the run's tokenizer;
    returns its step. Refuses a non-empty `out_dir` unless `overwrite`."""
    from taco_models import hf
    from taco_train.config import ConfigError

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if held and not overwrite:
        names = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ConfigError(
            f"OUT_DIR {out_dir} is not empty ({names}); choose another, or pass "
            "--force to write over it"
        )
    cfg, params, step = restore_params(run_dir)
    hf.save(cfg.model, params, out_dir)
    if cfg.init_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(cfg.init_from) / name).is_file():
                shutil.copy2(Path(cfg.init_from) / name, out_dir / name)
    elif (run_dir / "tokenizer.json").is_file():
        write_tokenizer(run_dir / "tokenizer.json", cfg, out_dir)
    else:
        print(
            f"{run_dir} holds no tokenizer.json (a run writes it when it starts): the export "
            "has no tokenizer",
            file=sys.stderr,
        )
    return step


def write_tokenizer(tokenizer_file: Path, cfg, out_dir: Path) -> None:
    """The run's tokenizer.json, and the tokenizer_config.json and generation_config.json that
    tell transformers its class and its end-of-text token (which ends every document)."""
    from tokenizers import Tokenizer

    shutil.copy2(tokenizer_file, out_dir / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eot = end_of_text_id(tokenizer, cfg.data.tokenizer)
    eot_token = tokenizer.id_to_token(eot)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.model.seq_len,
        "eos_token": eot_token,
        "bos_token": eot_token,
    }
    generation = {"bos_token_id": eot, "eos_token_id": eot}
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "generation_config.json", generation)


def end_of_text_id(tokenizer, kind: str) -> int:
    """The id that ends documents: the byte tokenizer's NUL (0), else "<|endoftext|>"."""
    from taco_train.data import BYTE_EOT_ID, EOT

    return BYTE_EOT_ID if kind == "byte" else tokenizer.token_to_id(EOT)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="taco_train.export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run's directory (its run.out_dir)")
    parser.add_argument("out_dir", help="the Hugging Face directory to write")
    parser.add_argument("--force", action="store_true", help="write over a non-empty OUT_DIR")
    args = parser.parse_args(argv)
    from taco_train.config import ConfigError

    try:
        step = export(args.run_dir, args.out_dir, overwrite=args.force)
    except ConfigError as error:
        print(f"taco-train export: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"exported step {step} of {args.run_dir} to {args.out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
