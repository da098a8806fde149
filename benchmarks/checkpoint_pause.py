"""How long a checkpoint save holds up the training loop (docs/decisions/018-background-
checkpoints.md).

Runs `python -m taco_train` twice in the repository, `run.async_checkpoint=false` then `true`:
GPT-1.3B on one device, 8 x 2048 tokens a step (`--batch-size 4` fits an 80 GB GPU), bf16
compute with fp32 weights and Adam moments (~15.6 GB saved), saves at steps 45 and 90, the byte
tokenizer on docs/*.md. It records each save's "checkpoint" record of metrics.jsonl:
`blocked_s`, the loop's pause, and of it `finite_s` (the check that the state is finite) and
`previous_s` (waiting for the save before); the rest is orbax's save call (asynchronous: the
copy of the state to host memory, what still blocks), with each run's wall time as its
end-of-run line prints it. The asynchronous run's end waits for its last save: orbax's line
saying how long is kept (`printed_note`), and so is each run's start-up line on pinning host
memory for the saves beside the compiles (`pinned_printed`; GPUs only).

    python -m benchmarks.checkpoint_pause --out $OUT               # the record (one GPU)
    python -m benchmarks.checkpoint_pause --smoke --out /tmp/pause # CPU check: tiny GPT, 4 steps
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import _common

RUN = (
    "model.preset=gpt_1p3b",
    "parallel.tp=1",
    "parallel.mode=shard_map",
    "parallel.compute_dtype=bfloat16",
    "compression.fwd=none",
    "data.corpus='docs/*.md'",
    "data.tokenizer=byte",
    "data.batch_size=8",
    "run.steps=90",
    "run.checkpoint_every=45",
    "run.keep_checkpoints=1",
    "run.eval_every=1000",
    "run.eval_batches=2",
    "run.log_every=15",
    "run.progress=false",
    "run.tensorboard=false",
)
# The CPU check: the same run on the tiny GPT, saves at steps 2 and 4.
SMOKE = RUN + (
    "model.preset=gpt_tiny",
    "parallel.compute_dtype=float32",
    "data.batch_size=4",
    "run.steps=4",
    "run.checkpoint_every=2",
    "run.log_every=2",
)
MODES = {"sync": "false", "async": "true"}
WALL = re.compile(r"\| wall ([\d.]+) s \|")
ORBAX_WAIT = re.compile(r"Waiting for previous save to complete took [\d.]+ seconds")
PINNED = re.compile(r"^(?:pinned [\d.]+ GiB of|host memory for checkpoints not pinned).*$", re.M)


def run(overrides: tuple[str, ...], asynchronous: str, out_dir: Path) -> dict:
    """One training run; its checkpoint records, printed wall time and orbax's end wait."""
    own = (f"run.async_checkpoint={asynchronous}", f"run.out_dir='{out_dir}'", "run.resume=false")
    argv = [sys.executable, "-m", "taco_train", "--config", "/dev/null"]
    argv += [arg for override in (*overrides, *own) for arg in ("--set", override)]
    done = subprocess.run(argv, cwd=_common.REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out_dir)  # GPT-1.3B's checkpoints are ~16 GB each: free the disk for the next
    wall = WALL.search(done.stderr)
    waited = ORBAX_WAIT.search(done.stderr)
    pinned = PINNED.search(done.stderr)
    return {
        "saves": [r for r in records if r["kind"] == "checkpoint"],
        "wall_s": float(wall[1]) if wall else None,
        "orbax_wait": waited[0] if waited else None,
        "pinned": pinned[0] if pinned else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory of the JSON record")
    parser.add_argument("--smoke", action="store_true", help="CPU check: tiny GPT, 4 steps")
    parser.add_argument("--suffix", default="")
    parser.add_argument("--batch-size", type=int, help="sequences a step (default 8; 4 fits 80 GB)")
    args = parser.parse_args()
    overrides = SMOKE if args.smoke else RUN
    overrides += (f"data.batch_size={args.batch_size}",) if args.batch_size else ()
    results = {}
    with tempfile.TemporaryDirectory(prefix="checkpoint_pause-") as scratch:
        for mode, asynchronous in MODES.items():
            results[mode] = run(overrides, asynchronous, Path(scratch) / mode)
            pauses = ", ".join(f"{s['blocked_s']:.2f} s" for s in results[mode]["saves"])
            print(f"{mode}: saves blocked the loop {pauses}; run {results[mode]['wall_s']} s")
    waited = results["async"]["orbax_wait"]
    _common.write_record(
        "checkpoint_pause",
        args.out,
        suffix=args.suffix + ("-smoke" if args.smoke else ""),
        what=(
            "blocked_s: how long each save held up the training loop (metrics.jsonl "
            "'checkpoint' records); of it finite_s, the finite check, and previous_s, the wait "
            "for the save before; the rest is orbax's save call"
        ),
        overrides=list(overrides),
        runs={mode: r["saves"] for mode, r in results.items()},
        wall_s_printed={mode: r["wall_s"] for mode, r in results.items()},
        printed_note=f"async run's end: orbax '{waited}'" if waited else "",
        pinned_printed={mode: r["pinned"] for mode, r in results.items()},
    )


if __name__ == "__main__":
    main()
