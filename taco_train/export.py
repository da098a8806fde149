"""Writes a run's trained model as a Hugging Face directory, with the tokenizer it trained with.

`python -m taco_train.export RUN_DIR OUT_DIR [--force]` reads RUN_DIR/config.json and the
parameters of the newest good checkpoint of RUN_DIR/checkpoints as NumPy arrays, on no device
(`checkpointing.read_arrays`): any machine exports any run, whatever layout and number of
devices trained it. Saves the fp32 parameters with `taco_models.hf.save` (with the sharded
optimizer, its fp32 master weights, not the compute-dtype replica), and the tokenizer the run
trained with (`run_tokenizer`): RUN_DIR/tokenizer.json, a tokenizer_config.json and a
generation_config.json, and config.json's bos_token_id / eos_token_id, all naming its
end-of-text token, so that transformers' `AutoTokenizer` and `AutoModelForCausalLM` load the
directory. A run on a checkpoint's tokenizer (data.tokenizer "hf") keeps that checkpoint's
tokenizer_config.json and generation settings; a run on its own ("byte", "bpe") never takes a
checkpoint's, model.init_from or not. A run whose tokenizer cannot be written is refused in one
line, and so is a non-empty OUT_DIR unless `--force` (`overwrite=True`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# A checkpoint's files that describe its tokenizer beside tokenizer.json, which an export of a
# run on that tokenizer (data.tokenizer "hf") keeps as they are: its special tokens, chat
# template, and the like.
CHECKPOINT_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
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
    """Saves the newest good checkpoint of `run_dir` to `out_dir` with the tokenizer the run
    trained with (`run_tokenizer`); returns its step. Refuses, before writing anything, a
    non-empty `out_dir` unless `overwrite`, and a run whose tokenizer cannot be written."""
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
    tokens = run_tokenizer(run_dir, cfg)
    hf.save(cfg.model, params, out_dir, token_ids=tokens.token_ids())
    write_tokenizer(tokens, cfg, out_dir)
    return step


@dataclasses.dataclass(frozen=True)
class RunTokenizer:
    """The tokenizer a run trained with, as its export writes it and `taco_train.sample` reads
    it from the run directory.

    file: RUN_DIR/tokenizer.json (for data.tokenizer "hf", the checkpoint's, as the run read it).
    eos_ids: the ids that end a text, the run's end-of-text first (it ended every training
      document), then the checkpoint's other end tokens inside the vocabulary ("hf" only).
    bos_id: the checkpoint's begin token ("hf", inside the vocabulary), else the end-of-text.
    source: the checkpoint directory whose tokenizer_config.json, special_tokens_map.json and
      generation_config.json the export keeps ("hf" only, while it holds them), or None: the
      export writes its own.
    """

    file: Path
    eos_ids: tuple[int, ...]
    bos_id: int
    source: Path | None

    def token_ids(self) -> dict[str, int | list[int]]:
        """config.json's and generation_config.json's bos_token_id and eos_token_id."""
        eos = self.eos_ids[0] if len(self.eos_ids) == 1 else list(self.eos_ids)
        return {"bos_token_id": self.bos_id, "eos_token_id": eos}


def run_tokenizer(run_dir: str | Path, cfg) -> RunTokenizer:
    """The tokenizer the run in `run_dir` (config `cfg`) trained with: its own tokenizer.json
    whatever started the run ("byte" and "bpe" runs ignore a checkpoint's tokenizer files); a
    checkpoint's only where it trained with it (data.tokenizer "hf"). ConfigError (one line)
    where it cannot be written: no tokenizer.json, or ids beyond the model's vocabulary."""
    from tokenizers import Tokenizer

    from taco_train.config import ConfigError
    from taco_train.data import BYTE_EOT_ID, EOT

    file = Path(run_dir) / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(
            f"{file}: no such file, so the tokenizer the run trained with (data.tokenizer="
            f"{cfg.data.tokenizer!r}) cannot be written; a run writes it when it starts: nothing "
            "exported"
        )
    tokenizer = Tokenizer.from_file(str(file))
    vocab = cfg.model.vocab_size
    if tokenizer.get_vocab_size() > vocab:
        raise ConfigError(
            f"{file}: the tokenizer's {tokenizer.get_vocab_size()} ids do not fit the model's "
            f"vocab_size={vocab}: nothing exported"
        )
    eot = BYTE_EOT_ID if cfg.data.tokenizer == "byte" else tokenizer.token_to_id(EOT)
    if eot is None:
        raise ConfigError(f"{file}: the tokenizer has no {EOT!r} token: nothing exported")
    source = Path(cfg.init_from) if cfg.data.tokenizer == "hf" and cfg.init_from else None
    if source is None or not (source / "tokenizer.json").is_file():
        return RunTokenizer(file, (eot,), eot, None)
    theirs = generation_ids(source)
    inside = lambda i: isinstance(i, int) and 0 <= i < vocab  # noqa: E731
    others = tuple(i for i in theirs.get("eos", ()) if inside(i) and i != eot)
    bos = next((i for i in theirs.get("bos", ()) if inside(i)), eot)
    return RunTokenizer(file, (eot, *others), bos, source)


def generation_ids(directory: Path) -> dict[str, list]:
    """{"bos": [...], "eos": [...]}: the ids of generation_config.json, else config.json."""
    found: dict[str, list] = {}
    for name in ("config.json", "generation_config.json"):  # the latter wins
        path = directory / name
        values = json.loads(path.read_text()) if path.is_file() else {}
        for key in ("bos", "eos"):
            ids = values.get(f"{key}_token_id")
            if ids is not None:
                found[key] = ids if isinstance(ids, list) else [ids]
    return found


def write_tokenizer(tokens: RunTokenizer, cfg, out_dir: Path) -> None:
    """The run's tokenizer.json, a tokenizer_config.json that tells transformers its class and
    its end-of-text token, and a generation_config.json with `tokens`' ids; for a run on a
    checkpoint's tokenizer ("hf"), the checkpoint's own `CHECKPOINT_TOKENIZER_FILES`, and its
    generation_config.json with those ids set."""
    from tokenizers import Tokenizer

    shutil.copy2(tokens.file, out_dir / "tokenizer.json")
    generation: dict[str, Any] = {}
    if tokens.source is not None:
        for name in CHECKPOINT_TOKENIZER_FILES:
            if (tokens.source / name).is_file():
                shutil.copy2(tokens.source / name, out_dir / name)
        kept = tokens.source / "generation_config.json"
        generation = json.loads(kept.read_text()) if kept.is_file() else {}
    if not (out_dir / "tokenizer_config.json").is_file():
        eot_token = Tokenizer.from_file(str(tokens.file)).id_to_token(tokens.eos_ids[0])
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": cfg.model.seq_len,
            "eos_token": eot_token,
            "bos_token": eot_token,
        }
        _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "generation_config.json", generation | tokens.token_ids())


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
