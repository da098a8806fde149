"""Convergence study: the same GPT, data order and schedule under every compression codec.

Each run is `taco_train.trainer.train_and_evaluate` on one config (default
`configs/h200_convergence.toml`) with the compressed traffic, the layout and the seeds
overridden (`layout_overrides`):
- `--tp N`: the codec on every TP collective (`compression.fwd/bwd`), TP emulated with
  `vmap(axis_name="tp")` so one GPU runs every TP size;
- `--dp N`: data parallelism over N devices with the sharded optimizer (ZeRO-1); codec "none",
  or "sdp4bit" (TLq-HS gradients, qWD weights);
- `--pp N`: a pipeline over N devices (GPipe, 4 microbatches); the codec on the stage sends
  (`compression.pp`, e.g. "tahquant"), and after "+grads=" the codec of the stages' sum of the
  shared parameters' gradients (`compression.pp_grads`, e.g. "tahquant+grads=taco");
- `--emulate-3d DP PP TP`: the whole (dp, pp, tp) mesh emulated on one device
  (`parallel.mode=emulate`), GPipe with 4 microbatches, ZeRO-1 over dp; the codec names each
  dimension's traffic, "+"-joined: "tp=<TP codec>", "pp=<stage codec>", "dp=sdp4bit" (e.g.
  "tp=taco+pp=tahquant+dp=sdp4bit"; "none": nothing compressed).
Telemetry logs each compressed collective's relative error. The baseline (`none`) runs with
several seeds: the spread of its final validation loss is the noise floor a codec's difference
must exceed, and each codec is compared with the baseline of its own seed and layout.

Writes `<out>/convergence-<date>.json` (per run: final train/val loss, tokens, steps, wall
time, mean relative error per compressed collective, the validation curve) and prints the
paired comparison; `python -m benchmarks.tables` makes its table and draws the curves.
`--merge FILE ...` keeps the runs of earlier records (runs already there are not repeated), so
a study can be split over machines and sessions; `--report-only` trains nothing and only
merges and compares.

    python -m benchmarks.convergence --tp 4 --codecs none taco fp8 taco_no_ds int8 \
        --baseline-seeds 0 1 --set run.steps=600
    python -m benchmarks.convergence --dp 2 --codecs none sdp4bit --baseline-seeds 0
    python -m benchmarks.convergence --emulate-3d 2 2 4 --codecs none tp=taco \
        tp=taco+pp=tahquant+dp=sdp4bit --baseline-seeds 0
    python -m benchmarks.convergence --report-only --merge part1.json part2.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import time

from benchmarks import tables
from benchmarks._common import write_record
from taco_train import comm_error, metrics
from taco_train.config import ConfigError, load_config
from taco_train.trainer import train_and_evaluate

DEFAULT_CODECS = ["none", "taco", "fp8", "taco_no_ds", "int8", "int8_hadamard", "taco_e8m0"]
# Paper figures to compare against (TACO, arXiv 2604.24088, GPT-350M; sources in docs/method.md):
# % of validation loss over the bf16 baseline.
PAPER = {"taco": 0.25, "tah_quant_path": 2.9}


DP_CODECS = {"none": ("none", "none"), "sdp4bit": ("tlq_hs", "qwd")}
PP_MICROBATCHES = 4
# Measuring steps (`run.comm_error_every`): each codec's error per op, beside its loss.
COMM_ERROR_EVERY = 50
PP_GRADS = "+grads="  # "<stage codec>+grads=<TP codec>": the shared-gradient sum compressed too


def run_key(codec: str, layout: str, seed: int) -> str:
    return f"{codec}/{layout}/seed{seed}"


def unique_runs(runs: list[dict]) -> list[dict]:
    """`runs` with each run once (records that merged the same earlier record hold its runs
    each); raises if two copies of one run differ."""
    kept = {}
    for r in runs:
        key = run_key(r["codec"], tables.layout_of(r), r["seed"])
        if key in kept and kept[key] != r:
            raise SystemExit(f"two different results for {key} in the merged records")
        kept.setdefault(key, r)
    return list(kept.values())


def three_d_layout(dp: int, pp: int, tp: int) -> str:
    """The 3D study's layout label (and `layout_overrides`' size), e.g. "dp2pp2tp4"."""
    return f"dp{dp}pp{pp}tp{tp}"


def three_d_overrides(size: str, codec: str) -> list[str]:
    """The overrides of `codec` ("none", or "+"-joined "tp=...", "pp=...", "dp=sdp4bit") on
    the emulated layout `size` (`three_d_layout`)."""
    dp, pp, tp = map(int, re.fullmatch(r"dp(\d+)pp(\d+)tp(\d+)", size).groups())
    pairs = [] if codec == "none" else [part.partition("=")[::2] for part in codec.split("+")]
    parts = dict(pairs)
    if set(parts) - {"tp", "pp", "dp"} or not all(parts.values()) or len(parts) < len(pairs):
        raise SystemExit(f"--emulate-3d codec {codec!r}: name parts tp=..., pp=..., dp=...")
    if parts.get("dp", "none") not in DP_CODECS:
        raise SystemExit(f"--emulate-3d dp codecs are {sorted(DP_CODECS)}, not {parts['dp']!r}")
    grad, param = DP_CODECS[parts.get("dp", "none")]
    tp_codec = parts.get("tp", "none")
    return [
        "parallel.mode='emulate'",
        f"parallel.dp={dp}",
        f"parallel.pp={pp}",
        f"parallel.tp={tp}",
        f"parallel.microbatches={PP_MICROBATCHES}",
        "parallel.scan_layers=false",
        "optimizer.sharded=true",
        f"compression.fwd={tp_codec}",
        f"compression.bwd={tp_codec}",
        f"compression.pp={parts.get('pp', 'none')}",
        f"compression.dp_grad={grad}",
        f"compression.dp_param={param}",
    ]


def layout_overrides(dim: str, size: int | str, codec: str) -> list[str]:
    """The config overrides that run `codec` on the traffic of `dim` over `size` ranks (for
    "3d", the `three_d_layout` label)."""
    if dim == "3d":
        return three_d_overrides(size, codec)
    if dim == "tp":
        return [f"compression.fwd={codec}", f"compression.bwd={codec}", f"parallel.tp={size}"]
    real = ["parallel.mode='shard_map'", "parallel.tp=1", "compression.fwd=none"]
    if dim == "dp":
        if codec not in DP_CODECS:
            raise SystemExit(f"--dp runs codecs {sorted(DP_CODECS)}, not {codec!r}")
        grad, param = DP_CODECS[codec]
        return [
            *real,
            f"parallel.dp={size}",
            "optimizer.sharded=true",
            f"compression.dp_grad={grad}",
            f"compression.dp_param={param}",
        ]
    sends, _, grads = codec.partition(PP_GRADS)
    return [
        *real,
        f"parallel.pp={size}",
        f"parallel.microbatches={PP_MICROBATCHES}",
        "parallel.scan_layers=false",
        f"compression.pp={sends}",
        f"compression.pp_grads={grads or 'none'}",
    ]


def run_config(args, codec: str, dim: str, size: int, seed: int, out_root: pathlib.Path):
    """The config of one run (`load_config` raises on a codec or layout it cannot take)."""
    out_dir = out_root / run_key(codec, f"{dim}{size}", seed).replace("/", "_")
    overrides = [
        *layout_overrides(dim, size, codec),
        f"run.comm_error_every={COMM_ERROR_EVERY}",
        f"run.seed={seed}",
        f"data.seed={seed}",
        f"run.out_dir={out_dir}",
        "run.resume=false",
        "run.progress=false",
        *args.set,
    ]
    return load_config(args.config, overrides)


def one_run(args, codec: str, dim: str, size: int, seed: int, out_root: pathlib.Path) -> dict:
    layout = f"{dim}{size}"
    cfg = run_config(args, codec, dim, size, seed, out_root)
    out_dir = pathlib.Path(cfg.run.out_dir)
    start = time.perf_counter()
    diverged = None
    try:
        train_and_evaluate(cfg)
    except FloatingPointError as error:  # a codec that diverges is a result, not a crash
        diverged = str(error)
    wall = time.perf_counter() - start
    records = metrics.read_jsonl(out_dir / "metrics.jsonl")
    return summarize(records, codec, layout, seed, wall, cfg) | {"diverged": diverged}


def summarize(records: list[dict], codec: str, layout: str, seed: int, wall: float, cfg) -> dict:
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "eval"]
    errors = {}  # per op (the call site without its layer), over layers and measuring steps
    for r in records:
        if r.get("kind") == "comm":
            for site, value in comm_error.site_errors(r).items():
                errors.setdefault(comm_error.op_of(site), []).append(value)
    tail = train[-5:] if train else []
    return {
        "codec": codec,
        "layout": layout,
        "tp": cfg.parallel.tp,
        "seed": seed,
        "steps": cfg.run.steps,
        "tokens": cfg.run.steps * cfg.data.batch_size * cfg.model.seq_len,
        "wall_s": wall,
        "final_train_loss": statistics.mean(r["loss"] for r in tail) if tail else None,
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "val_curve": [(r["step"], r["val_loss"]) for r in val],
        "comm_rel_err": {k: statistics.mean(v) for k, v in errors.items()},
    }


def report(runs: list[dict]) -> None:
    """Prints each codec's final validation loss against the bf16 run of its seed and layout,
    the paired comparison of BENCHMARKS.md (`tables.paired`: the seed moves the loss far more
    than a working codec does); a run that diverged, as such."""
    finished = [r for r in runs if not r.get("diverged")]
    runs_of = tables.runs_of([{"name": "this study", "runs": finished}])
    for r in (r for r in runs if r.get("diverged")):
        print(f"{tables.layout_of(r)} {r['codec']:14s} seed {r['seed']} diverged")
    for layout, codec in sorted({(r["layout"], r["codec"]) for r in runs_of}):
        if codec != "none" and tables.pairs(runs_of, layout, codec):
            p = tables.paired(runs_of, layout, codec)
            print(f"{layout} {codec:14s} {tables.pm(p)} vs bf16, seeds {p['seeds']}")


def write_results(args, runs: list[dict], out: pathlib.Path, sources: list[dict]) -> None:
    # A merge that trains nothing ran on no accelerator: the merged files name their devices.
    extra = {"device": "see sources"} if args.report_only else {}
    write_record(
        "convergence",
        str(out),
        **extra,
        config=args.config,
        overrides=args.set,
        merged_from=args.merge,
        sources=sources,
        paper_pct_vs_bf16=PAPER,
        runs=runs,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/h200_convergence.toml")
    parser.add_argument("--codecs", nargs="+", default=DEFAULT_CODECS)
    parser.add_argument("--tp", type=int, nargs="+", default=[], help="TP sizes (default 4)")
    parser.add_argument("--dp", type=int, nargs="+", default=[], help="dp sizes (GPUs)")
    parser.add_argument("--pp", type=int, nargs="+", default=[], help="pipeline sizes (GPUs)")
    parser.add_argument(
        "--emulate-3d",
        type=int,
        nargs=3,
        metavar=("DP", "PP", "TP"),
        help="a (dp, pp, tp) layout emulated on one device",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every compressed run")
    parser.add_argument("--baseline-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--runs-dir", default="runs/convergence")
    parser.add_argument("--merge", nargs="+", default=[], help="earlier results JSON to extend")
    parser.add_argument("--report-only", action="store_true", help="train nothing: merge")
    args = parser.parse_args()

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    merged = {path: json.loads(pathlib.Path(path).read_text()) for path in args.merge}
    runs = unique_runs([r for record in merged.values() for r in record["runs"]])
    # Where each merged file's runs came from, so that the merged record stands alone.
    sources = [
        {k: record.get(k) for k in ("date", "device", "versions", "command")}
        | {"path": path}
        | ({"sources": record["sources"]} if record.get("sources") else {})
        for path, record in merged.items()
    ]
    done = {run_key(r["codec"], tables.layout_of(r), r["seed"]) for r in runs}
    three_d = [three_d_layout(*args.emulate_3d)] if args.emulate_3d else []
    sizes = {"tp": args.tp, "dp": args.dp, "pp": args.pp, "3d": three_d}
    if not any(sizes.values()):
        sizes["tp"] = [4]
    plan = [
        (c, dim, size, s)
        for dim, layouts in sizes.items()
        for size in layouts
        for c in args.codecs
        for s in (args.baseline_seeds if c == "none" else [args.seed])
        if not args.report_only and run_key(c, f"{dim}{size}", s) not in done
    ]
    for codec, dim, size, seed in plan:  # every run's config is checked before the first trains
        try:
            run_config(args, codec, dim, size, seed, pathlib.Path(args.runs_dir))
        except ConfigError as error:
            raise SystemExit(f"{run_key(codec, f'{dim}{size}', seed)}: {error}") from None
    for codec, dim, size, seed in plan:
        result = one_run(args, codec, dim, size, seed, pathlib.Path(args.runs_dir))
        runs.append(result)
        print(
            f"{run_key(codec, result['layout'], seed):28s} val {result['final_val_loss']} "
            f"train {result['final_train_loss']} {result['wall_s']:.0f} s "
            f"diverged {result['diverged']} err {result['comm_rel_err']}",
            flush=True,
        )
        write_results(args, runs, out, sources)  # after every run: a killed study keeps its results
    write_results(args, runs, out, sources)
    report(runs)


if __name__ == "__main__":
    main()
