"""The tables and figures of BENCHMARKS.md and README.md, from the records in benchmarks/results/.

    python -m benchmarks.tables            # rewrite the tables, redraw the figures
    python -m benchmarks.tables --check    # exit 1 where a table differs from its records

A table sits between `<!-- table: NAME -->` and `<!-- /table -->`, the prose around it written
by hand. NAME is a declaration of `TABLES` (its records, their rows, the baseline of their
ratios, its columns), all rendered by `render_table`, or a sentence of `TEXTS`; the figures
(`benchmarks/figures.py`) are declared alike and drawn by the same command. A new record is one
line: its file name in the tuple of its kind below. Ratios of the timing harness
(`taco_jax.timing`) are recomputed from the raw times. \u2021 marks a row whose kernels' code
differs from the tree's (`_common.kernels_fingerprint`); the check ignores the mark, so a kernel
change fails no document. Records from before the harness are not read: BENCHMARKS.md freezes
their tables (decision 030).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import statistics
import sys
import textwrap
from collections.abc import Callable

from benchmarks._common import REPO, RESULTS, MiB, kernels_fingerprint
from taco_jax import timing

DOCS = ("BENCHMARKS.md", "README.md")
CHANGED = "\u2021"
BLOCK = re.compile(r"(<!-- table: (\S+) -->)(.*?)(<!-- /table -->)", re.S)
FROZEN = "\n## Earlier measurements"  # BENCHMARKS.md's static section, to its end

# The records of each kind, one line each.
KERNELS = ("kernels-2026-12-06-headline.json",)
LOWERINGS = (  # both lowerings at a TP step's sizes
    "kernels-2026-12-06-per-device.json",
    "kernels-2026-12-06-per-device-16-32.json",
)
COLLECTIVES = ("collectives-2026-12-06-headline-vmap.json",)
STEPS = (
    "train_step-2026-12-06-headline-tp2-vmap.json",
    "train_step-2026-12-06-headline-tp4-vmap.json",
    "train_step-2026-12-05-pp2-emulate.json",
)
CONVERGENCE = (  # a 30M GPT; a seed pairs once, in the first record that holds it
    "convergence-2026-12-01-seeds.json",
    "convergence-2026-12-01-tp8-seeds.json",
    "convergence-2026-11-29.json",
    "convergence-2026-11-30-subbyte.json",
    "convergence-2026-11-30-dp-pp.json",
    "convergence-2026-11-30-pp-grads.json",
    "convergence-2026-12-01-3d.json",
)
CHECKPOINT_SAVES = (  # GPT-1.3B, fp32 weights and Adam moments: ~15.6 GB a save
    "checkpoint_pause-2026-12-06-r4.json",
    "checkpoint_pause-2026-12-06-r5.json",
    "checkpoint_pause-2026-12-06-r6.json",
)
CONVERGENCE_91M = ("convergence-2026-12-01-3d-91m.json",)  # the 3D layout, a 91.5M GPT


class Records:
    """Records by file name, from one or more directories; remembers which were read.
    `kernels`: the fingerprint of the kernels' code that rows are marked against."""

    def __init__(self, dirs=(RESULTS,), kernels: str | None = None):
        self.paths = {p.name: p for d in dirs for p in sorted(pathlib.Path(d).glob("*.json"))}
        self.kernels = kernels_fingerprint() if kernels is None else kernels
        self.read: set[str] = set()
        self._cache: dict[str, dict] = {}

    def __call__(self, name: str) -> dict:
        if name not in self.paths:
            raise KeyError(f"a table reads {name!r}, which is not in benchmarks/results/")
        self.read.add(name)
        if name not in self._cache:
            self._cache[name] = json.loads(self.paths[name].read_text()) | {"name": name}
        return self._cache[name]

    def source(self, record: dict) -> str:  # its name (and date), commit, kernels' mark
        commit = f" (`{record['commit']}`)" if record.get("commit") else ""
        changed = record.get("kernels") not in (None, self.kernels)
        return f"`{record['name']}`{commit}" + f" {CHANGED}" * changed


def size(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):g} GiB"
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / 1024:g} KiB"


def seconds(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.{2 if s < 1e-2 else 1}f} ms"


def judged(r: dict) -> str:
    """A harness ratio (> 1: faster than the baseline): median [interval] verdict."""
    return f"{r['median']:.2f}x [{r['interval'][0]:.2f}, {r['interval'][1]:.2f}] {r['verdict']}"


def interval(summary: dict) -> str:
    return "[{:.3f}, {:.3f}]".format(*summary["interval"])


def of_copy(op: dict) -> str:
    """An op's bandwidth over the copy's in its program: median [interval]."""
    lo, hi = op["of_copy_interval"]
    return f"{op['in_program_of_copy']:.0%} [{lo * 100:.0f}, {hi:.0%}]"


def where(record: dict, mode: str = "shard_map") -> str:
    """One GPU (ranks emulated), or the link the record's NCCL variables select."""
    env = record.get("env", {})
    if record.get("emulated") or mode != "shard_map" or record["device"].startswith("1 x"):
        return "1 GPU"
    if record.get("backend") == "cpu":
        return "CPU devices"
    if env.get("NCCL_SHM_DISABLE") == "1":
        return "sockets"
    return "shared memory" if env.get("NCCL_P2P_DISABLE") == "1" else "NVLink"


CODEC_KERNELS = ("encode", "decode", "exchange")  # in the names of a codec's kernels


def step_fields(row: dict, base: dict) -> dict:
    """A training step's (`row`) and its baseline's times, the device time of the codec's
    kernels where profiled (and its share of the baseline's), XLA's temporaries of the step
    (a device peak would count every step resident)."""
    profile = (row.get("device_time") or {}).get("by_kind_us", {})
    us = sum(v for k, v in profile.items() if any(w in k for w in CODEC_KERNELS))
    temp = (row.get("memory_analysis") or {}).get("temp_size_in_bytes")
    return {
        "step": f"{row['median_step_s'] * 1e3:.1f}" if row else "-",
        "base_step": f"{base['median_step_s'] * 1e3:.1f} ms" if base else "-",
        "kernels": f"{us / 1e3:.2f} ms ({us / 1e6 / base['median_step_s']:.1%})" if us else "-",
        "temp": "-" if temp is None else f"{temp / 2**30:.1f} GiB",
    }


@dataclasses.dataclass(frozen=True)
class Table:
    """records: file names; rows(records, baseline): the rows, dicts of fields ("record": the
    one each came from); baseline: the series every ratio divides (None: each comparison's
    first); columns: header -> `str.format` of a row's fields (and "source": its record)."""

    records: tuple[str, ...]
    rows: Callable[[list[dict], str | None], list[dict]]
    columns: dict[str, str]
    baseline: str | None = None


def render_table(table: Table, records: Records) -> str:
    rows = table.rows([records(name) for name in table.records], table.baseline)
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    for row in rows:
        source = records.source(row["record"])
        cells = (f.format(**row, source=source) for f in table.columns.values())
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if rows else "(no record yet)"


def ratios(records: list[dict], baseline: str | None) -> list[dict]:
    """Per comparison of each harness record and variant: baseline / variant, the comparison's
    A/A control, and a training step's `step_fields`."""
    rows = []
    for record in records:
        labelled = {r["label"]: r for r in record.get("results", [])}
        for c in record["comparisons"]:
            times = c["times_s"]
            base = baseline or next(iter(times))
            floor = timing.noise_floor(timing.summarize(times))
            for name in (n for n in times if n not in (base, timing.AA, timing.PLACED)):
                ratio = judged(timing.ratio(times, base, name, floor))
                words = [w for w, v in zip(name.split(), base.split(), strict=False) if w == v]
                shared = " ".join(words) if name.startswith(" ".join(words)) else ""
                pair = dict(shared=shared, ours=name[len(shared) :], theirs=base[len(shared) :])
                mode = labelled.get(name, {}).get("parallel", {}).get("mode", "shard_map")
                rows.append(
                    dict(record=record, c=c, base=base, name=name, ratio=ratio)
                    | dict(where=where(record, mode))
                    | {k: v.strip() for k, v in pair.items()}
                    | dict(aa=interval(floor), size=size(c.get("bytes", 0)))
                    | dict(base_s=seconds(statistics.median(times[base])))
                    | step_fields(labelled.get(name, {}), labelled.get(base, {}))
                )
    return rows


OPS = {"encode": "encode", "decode": "decode", "decode_sum": "decode-sum"}
OPS["decode_sum_reencode"] = "re-encode"


def kernel_sizes(records: list[dict], baseline: str | None = None) -> list[dict]:
    """Per message size and peer count of each kernels record (`bench` and its `comparisons`,
    in one order): each op's bandwidth over the copy's, the copy's, its noise floor."""
    rows = []
    for record in records:
        for b, c in zip(record["bench"], record["comparisons"], strict=True):
            registry = b.get("registry") or record["registry"]  # per peer count, where several
            aa = timing.noise_floor(timing.summarize(c["times_s"]))
            rows.append(
                dict(record=record, b=b, c=c, codec=record["codec"], registry=registry)
                | dict(peers=b.get("peers", record.get("peers")), size=size(b["bytes"]))
                | dict(kernels="/".join(dict.fromkeys(registry.values())), aa_summary=aa)
                | {op: of_copy(b[op]) if op in b else "-" for op in OPS}
                | dict(copy=f"{b['copy_in_program_tbps']:.2f}", aa=interval(aa))
            )
    return rows


def lowerings(records: list[dict], baseline: str | None) -> list[dict]:
    """Per size and peer count timed on both lowerings, each op: Triton's and Mosaic's % of the
    copy, and Mosaic's speedup over Triton with its verdict against the row's noise floor."""
    return [row | {f"{op}_versus": versus(row, op) for op in OPS} for row in kernel_sizes(records)]


def versus(row: dict, op: str) -> str:
    times, b = row["c"]["times_s"], row["b"]
    triton, mosaic = f"{op}_triton", f"{op}_mosaic"
    if triton not in times or mosaic not in times:
        return "-"
    r = timing.ratio(times, triton, mosaic, row["aa_summary"])
    percent = f"{b[triton]['in_program_of_copy']:.0%}/{b[mosaic]['in_program_of_copy']:.0%}"
    return f"{percent} {r['median']:.2f}x {r['verdict']}"


def checkpoint_saves(records: list[dict], baseline: str | None) -> list[dict]:
    """Per record and mode: how long each save held up the loop, of it the wait for the save
    before (where recorded), and the run's wall time."""
    rows = []
    for record in records:
        settings = " ".join(record.get("overrides", [])) or record["command"]  # the last wins
        batch = re.findall(r"data.batch_size=(\d+)", settings)
        for mode, runs in record["runs"].items():
            saves = [r for r in runs if r["kind"] == "checkpoint"]
            waits = [s["previous_s"] for s in saves if "previous_s" in s]
            rows.append(
                dict(record=record, mode=f"`run.async_checkpoint={mode == 'async'}`".lower())
                | dict(batch=batch[-1] if batch else "?")
                | dict(held=" and ".join(f"{s['blocked_s']:.1f} s" for s in saves))
                | dict(waited=" and ".join(f"{w:.1f} s" for w in waits) if waits else "-")
                | dict(wall=f"{record['wall_s_printed'][mode]:.1f} s")
            )
    return rows


# Convergence: each run against the bf16 run of its seed in its record -----------------------


def layout_of(run: dict) -> str:
    """A convergence run's layout, e.g. "tp4" (records before the dp and pp layouts hold "tp")."""
    return run.get("layout") or f"tp{run['tp']}"


def runs_of(records: list[dict]) -> list[dict]:
    return [
        run | {"record": r["name"], "layout": layout_of(run)} for r in records for run in r["runs"]
    ]


def pairs(runs: list[dict], layout: str, codec: str) -> dict[int, tuple[dict, dict]]:
    """{seed: (the run of `codec`, the bf16 run of its seed and record)}, a seed once: the
    first record's."""
    base = {
        (r["record"], r["seed"]): r for r in runs if (r["layout"], r["codec"]) == (layout, "none")
    }
    out: dict[int, tuple[dict, dict]] = {}
    for r in runs:
        if (r["layout"], r["codec"]) == (layout, codec) and (r["record"], r["seed"]) in base:
            out.setdefault(r["seed"], (r, base[(r["record"], r["seed"])]))
    return out


def paired(runs: list[dict], layout: str, codec: str) -> dict:
    """Final validation loss of `codec` over its seed's bf16 run (%) per seed, their mean and
    standard error, and the spread of those bf16 runs: (max - min) / mean."""
    both = pairs(runs, layout, codec)
    ours, bf16 = ([p[i]["final_val_loss"] for p in both.values()] for i in (0, 1))
    diffs = [(a - b) / b * 100 for a, b in zip(ours, bf16, strict=True)]
    return {
        "seeds": sorted(both),
        "per_seed": diffs,
        "mean": statistics.mean(diffs),
        "se": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None,
        "spread": (max(bf16) - min(bf16)) / statistics.mean(bf16) * 100,
    }


def pm(p: dict) -> str:
    if len(p["per_seed"]) <= 2:
        return ", ".join(f"{d:+.2f}%" for d in p["per_seed"])
    return f"{p['mean']:+.2f}% +- {p['se']:.2f}"


def layout_name(layout: str) -> str:
    if m := re.fullmatch(r"3ddp(\d+)pp(\d+)tp(\d+)", layout):
        return f"TP {m[3]} x PP {m[2]} x DP {m[1]}"
    return f"{'TP' if layout.startswith('tp') else layout[:2]} = {layout[2:]}"


TRAFFIC = {"tp_reduce_fwd": "TP fwd", "tp_copy_bwd": "TP bwd", "pp": "PP fwd", "pp_bwd": "PP bwd"}
TRAFFIC |= {"pp_grads": "PP sum", "dp_grad": "DP grad", "dp_param": "DP param"}


def convergence_rows(records: list[dict], baseline: str | None) -> list[dict]:
    """Per layout (in the order the records first hold them) and codec with a bf16 run of its
    seed: the paired comparison, the mean error of each compressed collective, the records."""
    runs = runs_of(records)
    keys = list(dict.fromkeys((r["layout"], r["codec"]) for r in runs if r["codec"] != baseline))
    layouts = list(dict.fromkeys(layout for layout, _ in keys))
    rows = []
    for layout, codec in sorted(keys, key=lambda key: layouts.index(key[0])):
        mine = [run for run, _ in pairs(runs, layout, codec).values()]  # the runs paired
        if not mine:
            continue
        errors: dict[str, list[float]] = {}
        for k, v in ((k, v) for r in mine for k, v in r["comm_rel_err"].items()):
            errors.setdefault(TRAFFIC.get(k.split(":")[0], k), []).append(v)
        p = paired(runs, layout, codec)
        names = sorted({r["record"].removeprefix("convergence-2026-") for r in mine})
        rows.append(
            dict(record=records[0], layout=layout_name(layout), codec=codec, p=pm(p))
            | dict(seeds=len(p["seeds"]), spread=f"{p['spread']:.2f}%" if len(mine) > 1 else "-")
            | dict(errors=", ".join(f"{k} {statistics.mean(v):.3f}" for k, v in errors.items()))
            | dict(names=", ".join(f"`{n}`" for n in names))
        )
    return rows


DATA = ("gaussian", "student_t2", "outlier_channels")  # codec_error.py's data sets


def codec_errors(records: list[dict], baseline: str | None) -> list[dict]:
    """Per codec: its error per data set at each TP size, its zero collapse at the largest."""
    rows = []
    for r in records:
        for codec, bits in r["bits_per_element"].items():
            at = [res[codec] for _, res in sorted(r["results"].items(), key=lambda t: int(t[0]))]
            cells = {d: " / ".join(f"{v[d]['rel_l2']:.4f}" for v in at) for d in DATA}
            collapse = " / ".join(f"{at[-1][d]['zero_collapse']:.2%}" for d in DATA)
            rows.append(dict(record=r, codec=codec, bits=bits, collapse=collapse, **cells))
    return rows


# Declarations ------------------------------------------------------------------------------

RATIO = {"speedup [interval] verdict": "{ratio}", "A/A": "{aa}", "rounds": "{c[repeats]}"}
CONVERGENCE_COLUMNS = {"layout": "{layout}", "codec": "`{codec}`", "seeds": "{seeds}"} | {
    "validation loss vs bf16, paired (mean +- s.e.)": "{p}",
    "bf16 spread between seeds": "{spread}",
    "error per collective": "{errors}",
    "records (`convergence-2026-…`)": "{names}",
}
TABLES = {
    "kernels": Table(
        KERNELS,
        kernel_sizes,
        {"codec, peers, message (kernels)": "`{codec}`, {peers}, {size} ({kernels})"}
        | {name: f"{{{op}}}" for op, name in OPS.items()}
        | {"copy TB/s": "{copy}", "noise floor": "{aa}", "record": "{source}"},
    ),
    "lowerings": Table(
        LOWERINGS,
        lowerings,
        {"codec, peers, message (registry)": "`{codec}`, {peers}, {size} ({kernels})"}
        | {name: f"{{{op}_versus}}" for op, name in OPS.items()}
        | {"noise floor": "{aa}", "record": "{source}"},
    ),
    "collectives": Table(
        COLLECTIVES,
        ratios,
        {"where, N": "{where}, {c[tp]}", "message": "{size}", "op": "{c[op]}"}
        | {"`lax`": "{base_s}", "compressed": "`{name}`", **RATIO, "record": "{source}"},
        baseline="lax",
    ),
    "steps": Table(
        STEPS,
        ratios,
        {"where, step: variant / baseline": "{where}, {shared}: {ours} / {theirs}"}
        | {"times": "{step} / {base_step}", "codec kernels": "{kernels}"}
        | {"XLA temporaries": "{temp}", "speedup [interval] verdict": "{ratio}"}
        | {"record": "{source}"},
    ),
    "convergence": Table(CONVERGENCE, convergence_rows, CONVERGENCE_COLUMNS, baseline="none"),
    "convergence_91m": Table(CONVERGENCE_91M, convergence_rows, CONVERGENCE_COLUMNS, "none"),
    "checkpoint_saves": Table(
        CHECKPOINT_SAVES,
        checkpoint_saves,
        {"device, sequences a step": "{record[device]}, {batch}", "saves": "{mode}"}
        | {"training held up (steps 45, 90)": "{held}", "of it, the save before": "{waited}"}
        | {"run": "{wall}", "record": "{source}"},
    ),
    "codec_error": Table(
        ("codec_error-2026-11-30.json",),
        codec_errors,
        {"codec": "`{codec}`", "bits": "{bits:g}", "Gaussian": "{gaussian}"}
        | {"Student-t (2 dof)": "{student_t2}", "1% outlier channels": "{outlier_channels}"}
        | {"zero collapse at the largest TP": "{collapse}"},
    ),
    "stage_codec_error": Table(
        ("stage_codec_error-2026-11-30.json",),
        lambda records, _: [row | {"record": r} for r in records for row in r["results"]],
        {"codec": "`{codec}`", "bits / element": "{bits_per_element:.2f}"}
        | {"Gaussian": "{gaussian:.4f}", "Student-t (3)": "{student_t3:.4f}"}
        | {"outlier channels": "{outlier_channels:.4f}"},
    ),
}


def accuracy(records: Records, doc: str = "") -> str:
    """The accuracy sentence: `taco` and `int6_hadamard` at TP = 4 and 8, paired with bf16."""
    runs = runs_of([records(name) for name in CONVERGENCE])
    p = {(c, t): paired(runs, f"tp{t}", c) for c in ("taco", "int6_hadamard") for t in (4, 8)}
    seeds, spreads = {len(v["seeds"]) for v in p.values()}, [v["spread"] for v in p.values()]
    text = (
        f"Validation loss ([Convergence]({doc}#convergence), a 30M GPT, {min(seeds)} seeds, each "
        "paired with the bf16 run of its seed, mean +- s.e.): `taco` "
        f"{pm(p[('taco', 4)])}% at TP = 4 and {pm(p[('taco', 8)])}% at TP = 8, `int6_hadamard` "
        f"{pm(p[('int6_hadamard', 4)])}% and {pm(p[('int6_hadamard', 8)])}%; the bf16 loss "
        f"itself moves {min(spreads):.1f}-{max(spreads):.1f}% between seeds (the TACO paper: "
        "+0.25%)."
    )
    return textwrap.fill(text, width=98, break_long_words=False, break_on_hyphens=False)


def default_run(records: Records) -> str:
    """The README's figures of the default run (inline), from its record."""
    record = records("default-run-2026-11-30.json")
    train = [m for m in record["metrics"] if m["kind"] == "train"]
    evals = [m for m in record["metrics"] if m["kind"] == "eval"]
    return (
        f"training loss {train[0]['loss']:.1f} -> {train[-1]['loss']:.1f} and validation loss "
        f"{evals[0]['val_loss']:.1f} -> {evals[-1]['val_loss']:.1f} in {train[-1]['step']} steps "
        f"(`benchmarks/results/{record['name']}`)"
    )


TEXTS: dict[str, Callable[[Records], str]] = {
    "accuracy": accuracy,
    "readme_accuracy": lambda records: accuracy(records, "BENCHMARKS.md"),
    "default_run": default_run,
}


# Documents ---------------------------------------------------------------------------------


def render(text: str, records: Records) -> str:
    """`text` with every block replaced by what its table or sentence makes of the records."""

    def block(match: re.Match) -> str:
        name, body = match.group(2), match.group(3)
        if name not in TABLES | TEXTS:
            raise KeyError(f"unknown table {name!r}; the tables are {sorted(TABLES | TEXTS)}")
        made = render_table(TABLES[name], records) if name in TABLES else TEXTS[name](records)
        made = "\n" * body.startswith("\n") + made + "\n" * body.endswith("\n")
        return match.group(1) + made + match.group(4)

    return BLOCK.sub(block, text)


def rendered(dirs=(RESULTS,), kernels: str | None = None) -> tuple[dict[str, str], Records]:
    """{document: its text with the tables regenerated}, and the records they read."""
    records = Records(dirs, kernels)
    return {doc: render((REPO / doc).read_text(), records) for doc in DOCS}, records


def unmarked(text: str) -> str:
    """`text` without the marks of changed kernels: what the check compares."""
    return re.sub(f" ?{CHANGED}", "", text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a document differs")
    args = parser.parse_args(argv)
    texts, records = rendered()
    if args.check:
        stale = [d for d, t in texts.items() if unmarked((REPO / d).read_text()) != unmarked(t)]
        for doc in stale:
            print(f"{doc}: a table differs from its records; run python -m benchmarks.tables")
        return 1 if stale else 0
    for doc, text in texts.items():
        (REPO / doc).write_text(text)
        print(f"wrote {REPO / doc}")
    from benchmarks import figures  # matplotlib, only to draw

    for name in figures.FIGURES:
        print(f"drew {figures.draw(name, records)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
