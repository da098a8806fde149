"""Regenerates every table of BENCHMARKS.md and README.md from the records in benchmarks/results/.

    python -m benchmarks.tables            # rewrite the tables in the documents
    python -m benchmarks.tables --check    # exit 1 where a document differs from its records

A generated block sits between `<!-- table: NAME -->` and `<!-- /table -->`; the prose around
it is written by hand. Each NAME is a function of `TABLES`, which reads its records through
`Records` (so the set of records the tables read is known: every file in results/ must be one,
tests/benchmarks/test_tables.py). A record of the harness (`taco_jax.timing`: it holds "comparisons")
gives each ratio its median, interval and verdict, recomputed here from its raw times; an older
record gives one median per side and no verdict, which the tables mark. A headline cell shows
the newest harness record that measured it, else the older record; the other tables list the
harness's records beside the older ones. A row says when and on which commit it was measured,
and whether the kernels' code has changed since (`_common.kernels_fingerprint`).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import statistics
import sys
import textwrap
from collections.abc import Callable

from benchmarks._common import kernels_fingerprint
from taco_jax import timing

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = ("BENCHMARKS.md", "README.md")
MiB = 1 << 20
# Records written before the harness carry no fingerprint of the kernels; every one of them
# predates this commit, which replaced the kernels (docs/decisions/004-one-kernel-per-op.md).
KERNELS_REPLACED = "175561a"
# A block's markers stand on lines of their own, or inline: the opening one ends a line or
# starts the text, the closing one ends the text (a sentence's figures, a paragraph's end).
BLOCK = re.compile(r"(<!-- table: (\S+) -->)(.*?)(<!-- /table -->)", re.S)


class Records:
    """The records of one or more results directories, by file name; remembers what it read."""

    def __init__(self, dirs=(RESULTS,), cpu_ok: bool = False):
        self.paths = {p.name: p for d in map(pathlib.Path, dirs) for p in sorted(d.glob("*.json"))}
        self.cpu_ok = cpu_ok
        self.read: set[str] = set()
        self._cache: dict[str, dict] = {}

    def __call__(self, name: str) -> dict:
        """The record `name`, counted as read."""
        if name not in self.paths:
            raise KeyError(f"a table reads {name!r}, which is not in benchmarks/results/")
        self.read.add(name)
        return self._load(name)

    def _load(self, name: str) -> dict:
        if name not in self._cache:
            record = json.loads(self.paths[name].read_text())
            self._cache[name] = record | {"name": name}
        return self._cache[name]

    def harness(self, prefix: str, where: Callable[[dict], bool] = lambda r: True) -> list[dict]:
        """Harness records whose name starts with `prefix`, on a GPU (or any device with
        `cpu_ok`), that `where` accepts; newest first."""
        found = []
        for name in self.paths:
            if not name.startswith(prefix):
                continue
            record = self._load(name)
            gpu = record.get("backend") == "gpu" or self.cpu_ok
            if "comparisons" in record and gpu and where(record):
                found.append(self(name))
        return sorted(found, key=lambda r: (r["date"], r["name"]), reverse=True)


# Formatting ---------------------------------------------------------------------------------


def table(header: str, rows: list[list[str]]) -> str:
    """A markdown table: `header` is its cells joined by " | "."""
    lines = [f"| {header} |", "|" + "---|" * len(header.split(" | "))]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def size(nbytes: int) -> str:
    if nbytes < MiB:
        return f"{nbytes / 1024:g} KiB"
    return f"{nbytes // (1 << 30)} GiB" if nbytes >= 1 << 30 else f"{nbytes / MiB:g} MiB"


def seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    return f"{s * 1e3:.{2 if s < 1e-2 else 1 if s < 1 else 0}f} ms"


def x(v: float) -> str:
    return f"{v:.2f}x"


def span(values: list[float], fmt=x) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo).rstrip('x%')}-{fmt(hi)}"


def pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def judged(summary: dict, fmt=x) -> str:
    """A ratio of the harness: median [interval] verdict."""
    lo, hi = (fmt(v).rstrip("x%") for v in summary["interval"])
    return f"{fmt(summary['median'])} [{lo}, {hi}] {summary['verdict']}"


def record_link(record: dict) -> str:
    """The link a run's NCCL variables select (BENCHMARKS.md, the three links)."""
    env = record.get("env", {})
    if env.get("NCCL_SHM_DISABLE") == "1":
        return "socket"
    return "shm" if env.get("NCCL_P2P_DISABLE") == "1" else "nvlink"


LINK_NAMES = {"nvlink": "NVLink", "shm": "shared memory", "socket": "sockets"}


NO_AA, KERNELS_CHANGED = "\u2020", "\u2021"  # the marks of `when`
LEGEND = (
    f"{NO_AA} before the harness: one median per side, no A/A control, no verdict; the commit "
    "named is the one that added the record. "
    f"{KERNELS_CHANGED} the kernels' code has changed since (for records before the "
    f"harness: replaced in `{KERNELS_REPLACED}`, docs/decisions/004-one-kernel-per-op.md)."
)


def marks(record: dict) -> str:
    """{NO_AA} for a record before the harness, {KERNELS_CHANGED} where the kernels' code
    differs from the tree's (records before the harness predate `KERNELS_REPLACED`)."""
    out = "" if "comparisons" in record else NO_AA
    if record.get("kernels") != kernels_fingerprint():
        out += KERNELS_CHANGED
    return out


def when(records: list[dict]) -> str:
    """When and on which commit `records` were measured, with their marks: "2026-11-30
    (`abc1234`, `def5678`) \u2020\u2021". Records before the harness name the commit that
    added them."""
    dates = list(dict.fromkeys(r["date"] for r in records))
    commits = list(
        dict.fromkeys(c for r in records if (c := r.get("commit") or r.get("committed_in")))
    )
    text = ", ".join(dates) + (f" ({', '.join(f'`{c}`' for c in commits)})" if commits else "")
    flags = "".join(dict.fromkeys("".join(marks(r) for r in records)))
    return text + (f" {flags}" if flags else "")


def source(record: dict, strip: str = "") -> str:
    """A table's record cell: the file name (less `strip`, which the header names) and its
    marks (the harness's: also its date)."""
    text = f"`{record['name'].removeprefix(strip)}`"
    if "comparisons" in record:
        text += f" {when([record])}"
    elif flags := marks(record):
        text += f" {flags}"
    return text


# Harness ratios, from the raw times --------------------------------------------------------


def comparison_of(record: dict, *labels: str, **fields) -> dict | None:
    """The comparison of a harness record whose times hold `labels` and whose fields match."""
    for c in record.get("comparisons", []):
        if all(label in c["times_s"] for label in labels) and all(
            c.get(k) == v for k, v in fields.items()
        ):
            return c
    return None


def harness_ratio(comparison: dict, reference: str, name: str) -> dict:
    """`reference` time / `name` time of a comparison, recomputed from its raw times."""
    times = comparison["times_s"]
    aa = timing.summarize(times)[timing.AA_RATIO]
    return timing.ratio(times, reference, name, aa)


def median_time(comparison: dict, name: str) -> float:
    return statistics.median(comparison["times_s"][name])


# The headline ------------------------------------------------------------------------------

HEADLINE_COLLECTIVES = [  # (codec, tp, {link: the record before the harness}, its algorithm)
    (
        "taco",
        2,
        {
            "nvlink": "collectives-2026-11-30-x2-nvlink-auto-fused.json",
            "shm": "collectives-2026-11-30-x2-shm-auto.json",
            "socket": "collectives-2026-11-30-x2-socket-auto.json",
        },
        "auto",
    ),
    (
        "int6_hadamard",
        2,
        {
            "shm": "collectives-2026-11-30-x2-shm-subbyte.json",
            "socket": "collectives-2026-11-30-x2-socket-subbyte.json",
        },
        "one_shot",
    ),
    ("taco", 4, {"shm": "collectives-2026-11-30-x4-shm.json"}, "auto"),
]
B1 = "gpt_1p3b tp=2 (shard_map)"  # the labels of train_step.py's GPT-1.3B TP = 2 steps
HEADLINE_STEPS = [  # (preset, codec, tp, {link: (record, baseline label, label)}) before it
    (
        "gpt_1p3b",
        "taco",
        2,
        {
            "nvlink": (
                "train_step-2026-11-30-tp2-nvlink-fused.json",
                f"{B1} none",
                f"{B1} taco auto",
            ),
            "shm": ("train_step-2026-11-30-tp2-shm.json", f"{B1} none", f"{B1} taco auto"),
            "socket": ("train_step-2026-11-30-tp2-socket.json", f"{B1} none", f"{B1} taco"),
        },
    ),
    (
        "gpt_1p3b",
        "int6_hadamard",
        2,
        {
            "shm": (
                "train_step-2026-11-30-tp2-shm-int6.json",
                f"{B1} none",
                f"{B1} int6_hadamard auto",
            )
        },
    ),
]
HEADLINE_FROM = 16 * MiB  # the all-reduce's headline sizes: from 16 MiB (all, where none is)
PRESETS = {"gpt_125m": "GPT-125M", "gpt_350m": "GPT-350M", "gpt_1p3b": "GPT-1.3B"}
STEP_LABEL = re.compile(r"(\S+) tp=(\d+) \(shard_map\) (\S+) auto$")  # a real-TP step's label


def _verdict_span(points: list[tuple[int, dict]]) -> str:
    """Harness ratios over sizes: "1.12-1.30x faster", or the sizes of each verdict."""
    text = span([s["median"] for _, s in points])
    verdicts = {s["verdict"] for _, s in points}
    if len(verdicts) == 1:
        return f"{text} {verdicts.pop()}"
    by = {v: [size(b) for b, s in points if s["verdict"] == v] for v in sorted(verdicts)}
    return text + " (" + "; ".join(f"{v}: {', '.join(sizes)}" for v, sizes in by.items()) + ")"


def _sizes_note(sizes: list[int]) -> str:
    """The sizes a span covers, where they are not the headline's 16 MiB-1 GiB."""
    if (min(sizes), max(sizes)) == (HEADLINE_FROM, 1 << 30):
        return ""
    return f" ({size(min(sizes))}-{size(max(sizes))})" if len(sizes) > 1 else f" ({size(sizes[0])})"


def _headline_collective_cell(records: Records, codec: str, tp: int, link: str, legacy, algo):
    """(cell, record) of the all-reduce row on `link`: the newest harness record of this
    codec and TP on the link, else the record before the harness."""

    def fits(r):
        return (
            not r.get("emulated")
            and record_link(r) == link
            and any(row["codec"] == codec and row["tp"] == tp for row in r["rows"])
        )

    name = f"{codec} auto"
    for record in records.harness("collectives-", fits):
        compared = [
            c
            for c in record["comparisons"]
            if c["tp"] == tp and c["op"] == "all_reduce" and name in c["times_s"]
        ]
        large = [c for c in compared if c["bytes"] >= HEADLINE_FROM] or compared
        points = [(c["bytes"], harness_ratio(c, "lax", name)) for c in large]
        if points:
            return _verdict_span(points) + _sizes_note([b for b, _ in points]), record
    if link not in legacy:
        return "-", None
    record = records(legacy[link])
    rows = [
        r
        for r in record["rows"]
        if r["op"] == "all_reduce"
        and r["codec"] == codec
        and r["tp"] == tp
        and r["bytes"] >= HEADLINE_FROM
        and r["algorithm"].split(":")[0] == algo
    ]
    sizes, ratios = [r["bytes"] for r in rows], [r["speedup"] for r in rows]
    if len(sizes) == 2 and tp > 2:  # two sizes: each
        note = f" ({size(sizes[0]).split()[0]} / {size(sizes[1])})"
        return " / ".join(x(v) for v in ratios) + note, record
    return span(ratios) + _sizes_note(sizes), record


def _headline_step_cell(records: Records, preset: str, codec: str, tp: int, link: str, legacy):
    """(cell, record) of the step row on `link`: the newest harness record, else the older."""
    base = f"{preset} tp={tp} (shard_map) none"
    label = f"{preset} tp={tp} (shard_map) {codec} auto"

    def fits(r):
        return record_link(r) == link and comparison_of(r, base, label) is not None

    for record in records.harness("train_step-", fits):
        return judged(harness_ratio(comparison_of(record, base, label), base, label)), record
    if link not in legacy:
        return "-", None
    name, base, label = legacy[link]
    record = records(name)
    return x(_legacy_ratio(record, base, label)), record


def _legacy_ratio(record: dict, base: str, label: str) -> float:
    steps = {r["label"]: r["median_step_s"] for r in record["results"] if "error" not in r}
    return steps[base] / steps[label]


def _headline_keys(records: Records) -> tuple[set, set]:
    """The all-reduce (codec, tp) and step (preset, codec, tp) rows that harness records
    measured on real links."""
    collectives, steps = set(), set()
    for r in records.harness("collectives-", lambda r: not r.get("emulated")):
        collectives |= {
            (row["codec"], row["tp"])
            for row in r["rows"]
            if row["codec"] != "lax" and row["op"] == "all_reduce"
        }
    for r in records.harness("train_step-"):
        for row in r["results"]:
            if m := STEP_LABEL.match(row["label"]):
                steps.add((m.group(1), m.group(3), int(m.group(2))))
    return collectives, steps


def headline_rows(records: Records, readme: bool = False) -> list[list[str]]:
    """The headline's rows: each all-reduce (codec, TP) and step row, its cell per link and
    when it was measured. The README keeps the TP = 2 all-reduces and the `taco` step."""
    measured_collectives, measured_steps = _headline_keys(records)
    collectives = list(HEADLINE_COLLECTIVES) + [
        (codec, tp, {}, "auto")
        for codec, tp in sorted(measured_collectives)
        if not any((c, t) == (codec, tp) for c, t, _, _ in HEADLINE_COLLECTIVES)
    ]
    steps = list(HEADLINE_STEPS) + [
        (preset, codec, tp, {})
        for preset, codec, tp in sorted(measured_steps)
        if not any((p, c, t) == (preset, codec, tp) for p, c, t, _ in HEADLINE_STEPS)
    ]
    doc = "BENCHMARKS.md" if readme else ""
    rows = []
    for codec, tp, legacy, algo in collectives:
        if readme and tp != 2:
            continue
        cells = [
            _headline_collective_cell(records, codec, tp, link, legacy, algo) for link in LINK_NAMES
        ]
        what = f"[all-reduce]({doc}#collectives), TP = {tp}, `{codec}`"
        what += ", defaults" if algo == "auto" else ", one-shot"
        rows.append([what, *(c for c, _ in cells), when([r for _, r in cells if r])])
    for preset, codec, tp, legacy in steps:
        if readme and (codec, tp) != ("taco", 2):
            continue
        cells = [
            _headline_step_cell(records, preset, codec, tp, link, legacy) for link in LINK_NAMES
        ]
        what = f"[{PRESETS.get(preset, preset)} training step]({doc}#training-step), TP = {tp}"
        rows.append(
            [f"{what}, `{codec}`", *(c for c, _ in cells), when([r for _, r in cells if r])]
        )
    return rows


HEADLINE_HEADER = "measured | NVLink | PCIe-class (shared memory) | sockets | measured on"


def headline(records: Records) -> str:
    """The headline: all-reduce and GPT-1.3B step speedups per link, when and on which
    commit each row was measured."""
    return table(HEADLINE_HEADER, headline_rows(records)) + "\n\n" + fill(LEGEND)


def readme_measured(records: Records) -> str:
    """The README's "Measured results": its headline rows and the accuracy paragraph."""
    intro = (
        "NVIDIA H200s, jax 0.11.2; one 2-GPU machine's three links: NVLink, host shared memory "
        "(PCIe-class), sockets (network-class). Speedup = NCCL's bf16 time / the compressed "
        "time, same run."
    )
    legend = (
        f"{NO_AA} one median per side, no A/A control, the commit that added the record; "
        f"{KERNELS_CHANGED} kernels changed since."
    )
    rows = headline_rows(records, readme=True)
    return "\n\n".join(
        [fill(intro), table(HEADLINE_HEADER, rows), fill(f"{legend} {accuracy(records)}")]
    )


def benchmarks_accuracy(records: Records) -> str:
    return fill(accuracy(records, doc=""))


def fill(text: str) -> str:
    return textwrap.fill(text, width=98, break_long_words=False, break_on_hyphens=False)


# Convergence --------------------------------------------------------------------------------

SEEDS_TP4 = (
    "convergence-2026-11-29.json",
    "convergence-2026-11-30-subbyte.json",
    "convergence-2026-12-01-seeds.json",
)
SEEDS_TP8 = ("convergence-2026-12-01-tp8-seeds.json",)


def _runs(records: Records, names_: tuple[str, ...]) -> list[dict]:
    """The runs of several records, each with its record's name and layout."""
    return [
        dict(run, record=name, layout=run.get("layout") or f"tp{run['tp']}")
        for name in names_
        for run in records(name)["runs"]
    ]


def paired(runs: list[dict], layout: str, codec: str) -> dict:
    """Validation loss of `codec` against the bf16 run of the same seed in the same record
    (% of it), per seed (a seed once: the first record's), their mean and standard error, and
    the spread between seeds of those bf16 runs: (max - min) / mean of their final losses."""
    base = {
        (r["record"], r["seed"]): r["final_val_loss"]
        for r in runs
        if r["layout"] == layout and r["codec"] == "none"
    }
    pairs: dict[int, tuple[float, float]] = {}
    for r in runs:
        key = (r["record"], r["seed"])
        if r["layout"] == layout and r["codec"] == codec and key in base:
            pairs.setdefault(r["seed"], (r["final_val_loss"], base[key]))
    seeds = sorted(pairs)
    diffs = [(pairs[s][0] - pairs[s][1]) / pairs[s][1] * 100 for s in seeds]
    baselines = [pairs[s][1] for s in seeds]
    return {
        "seeds": seeds,
        "per_seed": diffs,
        "mean": statistics.mean(diffs),
        "se": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None,
        "spread": (max(baselines) - min(baselines)) / statistics.mean(baselines) * 100,
    }


def _pm(p: dict) -> str:
    if p["se"] is None:
        return f"{p['mean']:+.2f}%"
    if len(p["per_seed"]) <= 2:
        return ", ".join(f"{d:+.2f}%" for d in p["per_seed"])
    return f"{p['mean']:+.2f}% +- {p['se']:.2f}"


def accuracy(records: Records, doc: str = "BENCHMARKS.md") -> str:
    """The accuracy sentence: five seeds at TP = 4 and 8, paired, and the seeds' spread."""
    tp4, tp8 = _runs(records, SEEDS_TP4), _runs(records, SEEDS_TP8)
    p = {
        (c, t): paired(runs, f"tp{t}", c)
        for c in ("taco", "int6_hadamard")
        for t, runs in ((4, tp4), (8, tp8))
    }
    spreads = [p[(c, t)]["spread"] for c in ("taco", "int6_hadamard") for t in (4, 8)]
    return (
        f"Validation loss ([Convergence]({doc}#convergence), a 30M GPT, five seeds, each "
        "paired with the bf16 run of its seed, mean +- s.e.): `taco` "
        f"{_pm(p[('taco', 4)])}% at TP = 4 and {_pm(p[('taco', 8)])}% at TP = 8, "
        f"`int6_hadamard` {_pm(p[('int6_hadamard', 4)])}% and {_pm(p[('int6_hadamard', 8)])}%; "
        f"the bf16 loss itself moves {min(spreads):.1f}-{max(spreads):.1f}% between seeds (the "
        "TACO paper: +0.25%)."
    )


C = "convergence-2026-"  # the records' names, less their date
CONVERGENCE = [  # (layout, codec label, records, codec in the runs, layout in the runs)
    ("TP = 4", "`taco`", SEEDS_TP4, "taco", "tp4"),
    ("TP = 8", "`taco`", SEEDS_TP8, "taco", "tp8"),
    ("TP = 4", "`int6_hadamard`", SEEDS_TP4, "int6_hadamard", "tp4"),
    ("TP = 8", "`int6_hadamard`", SEEDS_TP8, "int6_hadamard", "tp8"),
    ("TP = 4", "`int5_hadamard`", (f"{C}11-30-subbyte.json",), "int5_hadamard", "tp4"),
    ("TP = 4", "`int4_hadamard`", (f"{C}11-30-subbyte.json",), "int4_hadamard", "tp4"),
    ("TP = 4", "`fp8` (no ASH)", (f"{C}11-29.json",), "fp8", "tp4"),
    ("TP = 4", "`int8_hadamard`", (f"{C}11-29.json",), "int8_hadamard", "tp4"),
    ("TP = 4", "`taco_no_ds` (no DS)", (f"{C}11-29.json",), "taco_no_ds", "tp4"),
    ("TP = 8", "`taco_no_ds` (no DS)", (f"{C}11-29.json",), "taco_no_ds", "tp8"),
    ("pp = 2", "`tahquant` sends", (f"{C}11-30-dp-pp.json",), "tahquant", "pp2"),
    (
        "pp = 2",
        "`tahquant` + `taco` shared-gradient sum",
        (f"{C}11-30-pp-grads.json",),
        "tahquant+grads=taco",
        "pp2",
    ),
    (
        "pp = 2",
        "`tahquant` + `int6_hadamard` sum",
        (f"{C}11-30-pp-grads.json",),
        "tahquant+grads=int6_hadamard",
        "pp2",
    ),
    ("dp = 2", "`sdp4bit`", (f"{C}11-30-dp-pp.json",), "sdp4bit", "dp2"),
    (
        "TP 4 x PP 2 x DP 2",
        "all three",
        (f"{C}12-01-3d.json",),
        "tp=taco+pp=tahquant+dp=sdp4bit",
        "3ddp2pp2tp4",
    ),
    (
        "same, 91.5M GPT",
        "all three",
        (f"{C}12-01-3d-91m.json",),
        "tp=taco+pp=tahquant+dp=sdp4bit",
        "3ddp2pp2tp4",
    ),
    ("same, 91.5M GPT", "`taco` on TP alone", (f"{C}12-01-3d-91m.json",), "tp=taco", "3ddp2pp2tp4"),
    (
        "same, 91.5M GPT",
        "`tahquant4` on TP (TAH-Quant's 4 bits)",
        (f"{C}12-01-3d-91m.json",),
        "tp=tahquant4",
        "3ddp2pp2tp4",
    ),
]


TRAFFIC = {
    "tp_reduce_fwd": "TP fwd",
    "tp_copy_bwd": "TP bwd",
    "pp": "PP fwd",
    "pp_bwd": "PP bwd",
    "pp_grads": "PP sum",
    "dp_grad": "DP grad",
    "dp_param": "DP param",
}


def _errors(runs: list[dict], layout: str, codec: str) -> str:
    """Mean relative error per compressed collective over the runs, by traffic."""
    errs: dict[str, list[float]] = {}
    for r in runs:
        if r["layout"] == layout and r["codec"] == codec:
            for k, v in r["comm_rel_err"].items():
                errs.setdefault(TRAFFIC.get(k.split(":")[0], k), []).append(v)
    return ", ".join(f"{k} {statistics.mean(v):.3f}" for k, v in errs.items())


def convergence(records: Records) -> str:
    rows = []
    for layout, label, names_, codec, run_layout in CONVERGENCE:
        runs = _runs(records, names_)
        p = paired(runs, run_layout, codec)
        rows.append(
            [
                layout,
                label,
                str(len(p["seeds"])),
                _pm(p),
                "-" if len(p["seeds"]) < 2 else f"{p['spread']:.2f}%",
                _errors(runs, run_layout, codec),
                ", ".join(f"`{n.removeprefix('convergence-')}`" for n in names_),
            ]
        )
    header = (
        "layout | codec | seeds | validation loss vs bf16, paired (mean +- s.e.) | "
        "bf16 spread between seeds | error per collective | records (`convergence-…`)"
    )
    return table(header, rows)


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


# Kernels ------------------------------------------------------------------------------------

KERNEL_SIZES = tuple(s * MiB for s in (16, 64, 256, 1024))  # a TP step's messages
K = "kernels-2026-12-"  # the records' names, less their date
LOWERINGS = [  # (codec label, peers, record, ops, an earlier run's record) before the harness
    ("`taco`", 8, f"{K}04-widened.json", None, f"{K}02-register-operands.json"),
    ("`taco`", 2, f"{K}04-p2-widened.json", None, f"{K}04-p2.json"),
    ("`taco_e5m2`", 8, "kernels-taco_e5m2-2026-12-03.json", ("encode", "decode"), None),
    ("`fp8`", 8, "kernels-fp8-2026-12-02-regload.json", None, None),
    ("`int8`", 8, "kernels-int8-2026-12-02-mosaic.json", None, None),
    ("`int8_hadamard`", 8, "kernels-int8_hadamard-2026-12-02-mosaic.json", None, None),
    ("`int6_hadamard`", 8, "kernels-int6_hadamard-2026-12-03.json", None, None),
    ("`int4_hadamard`", 8, "kernels-int4_hadamard-2026-12-03.json", None, None),
]
OPS = ("encode", "decode", "decode_sum", "decode_sum_reencode")
OP_NAMES = {
    "encode": "encode",
    "decode": "decode",
    "decode_sum": "decode-sum",
    "decode_sum_reencode": "re-encode",
}
MOSAIC_CODECS = ("`taco`", "`taco_e5m2`")  # the registry's Mosaic codecs among the rows


def _mosaic_name(op: str, peers: int, row: dict) -> str:
    """The Mosaic kernel the registry runs: the sums of more than two peers with peer steps."""
    steps = f"{op}_mosaic_steps"
    return steps if op in OPS[2:] and peers > 2 and steps in row else f"{op}_mosaic"


def kernels(records: Records) -> str:
    """Triton / Mosaic, % of the copy's bandwidth in one program, the registry's in bold."""
    sizes = " | ".join(size(s) for s in KERNEL_SIZES)
    header = f"codec, peers, op: Triton / Mosaic | {sizes} | record (`kernels-…`)"
    rows = []
    both = lambda r: {"triton", "mosaic"} <= set(r["backends"])
    for record in records.harness("kernels", both):
        rows += _harness_kernel_rows(record)
    for label, peers, name, ops, earlier in LOWERINGS:
        record = records(name)
        runs = [
            {b["bytes"]: b for b in r["bench"]} for r in (record, earlier and records(earlier)) if r
        ]
        for op in ops or OPS:
            cells = []
            for s in KERNEL_SIZES:
                pairs = [
                    [row.get(f"{op}_triton"), row.get(_mosaic_name(op, peers, row))]
                    for row in (run.get(s, {}) for run in runs)
                ]
                cell = _pair_cell(pairs[0], mosaic=label in MOSAIC_CODECS)
                if len(pairs) > 1 and _pair_cell(pairs[1], None) != "-":
                    cell += f" ({_pair_cell(pairs[1], None)})"
                cells.append(cell)
            if any(c != "-" for c in cells):
                rows.append(
                    [f"{label}, {peers}, {OP_NAMES[op]}", *cells, source(record, "kernels-")]
                )
    earlier = [
        f"{source(records(e), 'kernels-')} ({label}, {peers} peers)"
        for label, peers, _, _, e in LOWERINGS
        if e
    ]
    return table(header, rows) + "\n\nIn parentheses, an earlier run: " + ", ".join(earlier) + "."


def _pair_cell(pair, mosaic: bool | None) -> str:
    """ "Triton / Mosaic" % of copy, the registry's in bold (`mosaic` None: neither)."""
    if pair[0] is None and pair[1] is None:
        return "-"
    t, m = (pct(v["in_program_of_copy"]).rstrip("%") if v else "-" for v in pair)
    if mosaic is None:
        return f"{t} / {m}"
    return f"{t} / **{m}**" if mosaic else f"**{t}** / {m}"


def _harness_kernel_rows(record: dict) -> list[list[str]]:
    """A harness record of both lowerings: Triton / Mosaic % of copy per op and size, the
    registry's in bold, with the verdict of Mosaic against Triton (paired, A/A-controlled)."""
    mosaic = record["registry"]["encode"].startswith("mosaic")
    rows = []
    for op in OPS:
        cells = []
        for nbytes in KERNEL_SIZES:
            bench = next((b for b in record["bench"] if b["bytes"] == nbytes), {})
            c = next((c for c in record["comparisons"] if c["bytes"] == nbytes), None)
            pair = [f"{op}_triton", f"{op}_mosaic"]
            if c is None or not all(name in c["times_s"] for name in pair):
                cells.append("-")
                continue
            verdict = harness_ratio(c, *pair)["verdict"]
            cells.append(f"{_pair_cell([bench[n] for n in pair], mosaic)} {verdict}")
        if any(cell != "-" for cell in cells):
            label = f"`{record['codec']}`, {record['peers']}, {OP_NAMES[op]}"
            rows.append([label, *cells, source(record, "kernels-")])
    return rows


def registry_kernels(records: Records) -> str:
    """The registry's kernels with the harness: % of the copy [interval] per op and size, the
    newest record of each codec and peer count."""
    newest: dict[tuple, dict] = {}
    for record in records.harness("kernels", lambda r: "auto" in r["backends"]):
        newest.setdefault((record["codec"], record["peers"]), record)
    if not newest:
        return "(no record of the harness yet: `python -m benchmarks.headline` on one GPU)"
    rows = []
    for record in newest.values():
        for b in record["bench"]:
            c = next(c for c in record["comparisons"] if c["bytes"] == b["bytes"])
            aa = timing.summarize(c["times_s"])[timing.AA_RATIO]
            cells = [_of_copy(b[op]) if op in b else "-" for op in OPS]
            kernels_ = "/".join(dict.fromkeys(record["registry"].values()))
            what = f"`{record['codec']}`, {record['peers']}, {size(b['bytes'])} ({kernels_})"
            rows.append([what, *cells, judged_aa(aa), source(record, "kernels-")])
    ops = " | ".join(OP_NAMES[op] for op in OPS)
    header = f"codec, peers, message (kernels) | {ops} | copy A/A | record (`kernels-…`)"
    return table(header, rows)


def _of_copy(op: dict) -> str:
    lo, hi = op["of_copy_interval"]
    return f"{pct(op['in_program_of_copy'])} [{pct(lo).rstrip('%')}, {pct(hi)}]"


def judged_aa(aa: dict) -> str:
    lo, hi = aa["interval"]
    return f"[{lo:.3f}, {hi:.3f}]"


LAUNCH_SWEEPS = (
    "launch_sweep-2026-12-03-wave-r1.json",
    "launch_sweep-2026-12-04-decode_sum-p8-widened.json",
    "launch_sweep-2026-12-04-decode_sum-p2-sizes.json",
)


def launches(records: Records) -> str:
    """The Mosaic launch sweeps the kernels' tuning cites: over the sizes swept, the Triton and
    Mosaic defaults of the day and the fastest launch swept, % of the copy (ranges)."""
    rows = []
    for name in LAUNCH_SWEEPS:
        record = records(name)
        by_size: dict[int, list[dict]] = {}
        for row in record["rows"]:
            by_size.setdefault(row["bytes"], []).append(row)
        triton, mosaic, best = [], [], []
        for candidates in by_size.values():
            triton += [r["of_copy"] for r in candidates if r["label"].startswith("Triton default")]
            defaults = [r for r in candidates if r["label"].startswith("Mosaic default")]
            mosaic.append(max(r["of_copy"] for r in defaults))
            best.append(
                max(r["of_copy"] for r in candidates if not r["label"].startswith("Triton"))
            )
        peers = record["rows"][0]["peers"]
        sizes = f"{size(min(by_size))}-{size(max(by_size))}, {len(by_size)} sizes"
        rows.append(
            [
                f"{record['op']}, {peers}",
                sizes,
                span(triton, pct),
                span(mosaic, pct),
                span(best, pct),
                source(record, "launch_sweep-"),
            ]
        )
    header = (
        "op, peers | messages | Triton default | Mosaic default then | fastest swept | "
        "record (`launch_sweep-…`)"
    )
    return table(header, rows)


def stage_kernels(records: Records) -> str:
    """The TAH-Quant and SDP4Bit kernels: % of the copy, ranges over sizes, and their speedup
    over the jnp references."""
    found = records.harness("stage_kernels")
    sources = (
        [found[0]]
        if found
        else [
            records("stage_kernels-2026-12-01.json"),
            records("stage_kernels-2026-12-01-qwd.json"),
        ]
    )
    rows = []
    for record in sources:
        codecs = [k for k in record["results"][0] if isinstance(record["results"][0][k], dict)]
        for codec in codecs:
            cells = []
            for data in ("gaussian", "outlier_channels"):
                per = [r[codec] for r in record["results"] if r["data"] == data]
                cells.append(
                    " / ".join(
                        span([p[op]["of_copy"] for p in per], pct) for op in ("encode", "decode")
                    )
                    if per
                    else "-"
                )
            every = [r[codec] for r in record["results"]]
            speed = " / ".join(
                span([p[op]["speedup_over_ref"] for p in every], lambda v: f"{v:.1f}x")
                for op in ("encode", "decode")
            )
            rows.append(
                [f"`{codec}`", f"{every[0]['bits_per_element']:.2f}", *cells, speed, source(record)]
            )
    header = (
        "codec | bits / element | Gaussian: encode / decode, % of copy | "
        "outlier channels: encode / decode | vs jnp reference (enc / dec) | record"
    )
    return table(header, rows)


# Collectives --------------------------------------------------------------------------------

X2 = "collectives-2026-11-30-x2"  # the records' names, less their link
COLLECTIVES = {  # link: (the named algorithms' record, the defaults' record) before the harness
    "nvlink": (f"{X2}-nvlink-fused.json", f"{X2}-nvlink-auto-fused.json"),
    "shm": (f"{X2}-shm.json", f"{X2}-shm-auto.json"),
    "socket": (f"{X2}-socket.json", f"{X2}-socket-auto.json"),
}
ALGORITHMS = ("one_shot", "two_shot", "fused")


def _rows_of(record: dict, op: str = "all_reduce", **fields) -> list[dict]:
    return [
        r
        for r in record["rows"]
        if r["op"].startswith(op[:3]) and all(r.get(k) == v for k, v in fields.items())
    ]


def _defaults_cell(row: dict) -> str:
    """The defaults' speedup and what they chose; "level" where they chose the plain
    collective: both sides ran `lax.psum`, so the ratio is the run's noise."""
    chose = row["algorithm"].split(":")[-1]
    if chose == "plain":
        return "level (plain: both `lax.psum`)"
    return f"{x(row['speedup'])} ({chose.replace('_', '-')})"


def plain_noise(records: Records) -> str:
    """Inline: the range of the ratios the defaults' records read where the policy chose the
    plain collective, so both sides ran `lax.psum` (an A/A pair before the harness)."""
    ratios = [
        row["speedup"]
        for _, auto in COLLECTIVES.values()
        for row in records(auto)["rows"]
        if row["algorithm"].endswith(":plain")
    ]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def collectives(records: Records) -> str:
    """TP = 2, `taco`, against `lax.psum` per link and size (the records before the harness)."""
    rows = []
    for link, (named, auto) in COLLECTIVES.items():
        named_r, auto_r = records(named), records(auto)
        smallest = 4 * MiB if link == "nvlink" else 16 * MiB  # NVLink's plain row: the noise
        for nbytes in sorted({r["bytes"] for r in named_r["rows"] if r["bytes"] >= smallest}):
            ar = {r["algorithm"]: r for r in _rows_of(named_r, bytes=nbytes, tp=2)}
            defaults = _rows_of(auto_r, bytes=nbytes, tp=2, codec="taco")
            pair = {
                r["algorithm"]: r
                for r in _rows_of(named_r, "reduce", bytes=nbytes, tp=2)
                if r["codec"] != "lax"
            }
            cells = [x(ar[a]["speedup"]) if a in ar else "-" for a in ALGORITHMS]
            pair_cell = " / ".join(
                x(pair[a]["speedup"]) if a in pair else "-" for a in ("-", "fused")
            )
            rows.append(
                [
                    LINK_NAMES[link],
                    size(nbytes),
                    seconds(ar["-"]["seconds"]),
                    *cells,
                    _defaults_cell(defaults[0]) if defaults else "-",
                    pair_cell,
                ]
            )
    header = (
        "link | message | `lax.psum` | one-shot | two-shot | fused | defaults (chose) | "
        "RS + AG pair: NCCL / fused"
    )
    return table(header, rows)


SUBBYTE = [("shm", 2, f"{X2}-shm-subbyte.json"), ("socket", 2, f"{X2}-socket-subbyte.json")]


def collectives_subbyte(records: Records) -> str:
    """One-shot with the sub-byte codecs at TP = 2; four GPUs over shared memory at N = 4."""
    rows = []
    for link, tp, name in SUBBYTE:
        record = records(name)
        for nbytes in sorted({r["bytes"] for r in record["rows"]}):
            ar = {r["codec"]: r for r in _rows_of(record, bytes=nbytes, tp=tp)}
            pair = {r["codec"]: r for r in _rows_of(record, "reduce", bytes=nbytes, tp=tp)}
            cells = [
                f"{x(ar[c]['speedup'])} / {x(pair[c]['speedup'])}"
                for c in ("taco", "int6_hadamard", "int4_hadamard")
            ]
            rows.append(
                [
                    f"{LINK_NAMES[link]}, {tp}",
                    size(nbytes),
                    seconds(ar["lax"]["seconds"]),
                    *cells,
                    f"`{name.removeprefix('collectives-')}`",
                ]
            )
    record = records("collectives-2026-11-30-x4-shm.json")
    for nbytes in sorted({r["bytes"] for r in record["rows"]}):
        ar = {r["algorithm"].split(":")[0]: r for r in _rows_of(record, bytes=nbytes, tp=4)}
        pair = _rows_of(record, "reduce", bytes=nbytes, tp=4, algorithm="auto")
        cell = (
            f"one-shot {x(ar['one_shot']['speedup'])}, two-shot {x(ar['two_shot']['speedup'])}"
            f", defaults {x(ar['auto']['speedup'])} / {x(pair[0]['speedup'])}"
        )
        rows.append(
            [
                "shared memory, 4",
                size(nbytes),
                seconds(ar["-"]["seconds"]),
                cell,
                "-",
                "-",
                "`2026-11-30-x4-shm.json`",
            ]
        )
    header = (
        "link, N | message | `lax.psum` | `taco`: all-reduce / pair | `int6_hadamard` | "
        "`int4_hadamard` | record (`collectives-…`)"
    )
    return table(header, rows)


def collectives_harness(records: Records) -> str:
    """Every harness record of collectives.py: each compressed all-reduce's speedup over
    `lax.psum` with its interval and verdict, and the run's A/A interval."""
    rows = []
    for record in records.harness("collectives-"):
        where = "vmap, one GPU" if record.get("emulated") else LINK_NAMES[record_link(record)]
        for c in record["comparisons"]:
            aa = timing.summarize(c["times_s"])[timing.AA_RATIO]
            variants = [n for n in c["times_s"] if n not in ("lax", timing.AA)]
            cells = "; ".join(f"`{n}` {judged(harness_ratio(c, 'lax', n))}" for n in variants)
            rows.append(
                [
                    f"{where}, N = {c['tp']}",
                    size(c["bytes"]),
                    c["op"],
                    seconds(median_time(c, "lax")),
                    cells,
                    judged_aa(aa),
                    str(c["repeats"]),
                    source(record),
                ]
            )
    if not rows:
        return "(no record of the harness yet: `python -m benchmarks.headline`)"
    header = "where | message | op | `lax` | speedup [interval] verdict | A/A | rounds | record"
    return table(header, rows)


# Training steps ----------------------------------------------------------------------------

T = "train_step-2026-11-30-tp2"  # the records' names, less their suffix
STEP_TP2 = [  # (row, record, baseline label, {column: label})
    (
        "TP = 2, NVLink",
        f"{T}-nvlink-fused.json",
        f"{B1} none",
        {"taco": f"{B1} taco auto", "fused forced": f"{B1} taco fused forced"},
    ),
    (
        "TP = 2 + sequence parallelism, NVLink",
        f"{T}-sp-nvlink.json",
        "gpt_1p3b tp=2 sp (shard_map) none",
        {"taco": "gpt_1p3b tp=2 sp (shard_map) taco auto"},
    ),
    (
        "TP = 2, NVLink, two batch chunks (`parallel.overlap_chunks=2`)",
        f"{T}-nvlink-overlap.json",
        f"{B1} none chunks=2",
        {"taco": f"{B1} taco auto chunks=2"},
    ),
    ("TP = 2, shared memory", f"{T}-shm.json", f"{B1} none", {"taco": f"{B1} taco auto"}),
    (
        "TP = 2, shared memory, second run",
        f"{T}-shm-int6.json",
        f"{B1} none",
        {"taco": f"{B1} taco auto", "int6": f"{B1} int6_hadamard auto"},
    ),
    (
        "same, two batch chunks",
        f"{T}-shm-chunks.json",
        f"{B1} none chunks=2",
        {"taco": f"{B1} taco auto chunks=2", "int6": f"{B1} int6_hadamard auto chunks=2"},
    ),
    ("TP = 2, sockets", f"{T}-socket.json", f"{B1} none", {"taco": f"{B1} taco"}),
]


def _steps(record: dict) -> dict[str, dict]:
    return {r["label"]: r for r in record["results"] if "error" not in r}


def _step_cell(record: dict, base: str, label: str) -> str:
    """A step's time and the baseline's time over it: from the harness, paired by round with
    its interval and verdict; before it, the ratio of the two medians."""
    steps = _steps(record)
    if label not in steps:
        return "-"
    c = comparison_of(record, base, label)
    ms = f"{steps[label]['median_step_s'] * 1e3:.1f} ms"
    if c is not None:
        return f"{ms} ({judged(harness_ratio(c, base, label))})"
    return f"{ms} ({x(steps[base]['median_step_s'] / steps[label]['median_step_s'])})"


def step_tp2(records: Records) -> str:
    one = _steps(records("train_step-2026-11-29.json"))["gpt_1p3b"]
    rows = [
        [
            "one H200, no TP",
            f"{one['median_step_s'] * 1e3:.1f} ms ({pct(one['mfu'])} MFU)",
            "-",
            "-",
            source(records("train_step-2026-11-29.json")),
        ]
    ]
    for link in LINK_NAMES:
        for record in records.harness(
            "train_step-",
            lambda r, k=link: (
                record_link(r) == k and any("(shard_map)" in row["label"] for row in r["results"])
            ),
        ):
            steps = _steps(record)
            for base in (lb for lb in steps if lb.endswith("(shard_map) none")):
                stem = base.removesuffix(" none")
                cells = [
                    _step_cell(record, base, f"{stem} {c} auto") for c in ("taco", "int6_hadamard")
                ]
                preset, tp = stem.split()[:2]
                rows.append(
                    [
                        f"{PRESETS.get(preset, preset)}, TP = {tp[3:]}, {LINK_NAMES[link]}",
                        f"{steps[base]['median_step_s'] * 1e3:.1f} ms",
                        *cells,
                        source(record),
                    ]
                )
    for row, name, base, labels in STEP_TP2:
        record = records(name)
        base_ms = f"{_steps(record)[base]['median_step_s'] * 1e3:.1f} ms"
        taco = _step_cell(record, base, labels["taco"])
        if "fused forced" in labels:
            forced = _step_cell(record, base, labels["fused forced"])
            taco += f"; fused forced {forced.split('(')[1][:-1]}"
        int6 = _step_cell(record, base, labels["int6"]) if "int6" in labels else "-"
        rows.append([row, base_ms, taco, int6, source(record)])
    header = (
        "step (GPT-1.3B, 8 x 2048) | uncompressed | `taco`, defaults | "
        "`int6_hadamard`, defaults | record"
    )
    return table(header, rows)


V2, V4 = "gpt_1p3b tp=2 (vmap)", "gpt_125m tp=4 (vmap)"  # emulated steps' labels
EMULATED = [  # (row, record, baseline label, label, attention)
    (
        "GPT-1.3B, TP = 2, 4 x 2048",
        "train_step-2026-12-04-tp2-b4-sum-mosaic.json",
        f"{V2} none",
        f"{V2} taco one_shot",
        "cuDNN",
    ),
    (
        "GPT-1.3B, TP = 2, 4 x 2048",
        "train_step-2026-12-02-tp2-vmap-cudnn-b4.json",
        f"{V2} attention=xla none",
        f"{V2} attention=xla taco one_shot",
        "XLA",
    ),
    (
        "GPT-1.3B, TP = 2, 8 x 2048",
        "train_step-2026-12-03-tp2-vmap-b8-wave.json",
        f"{V2} none",
        f"{V2} taco one_shot",
        "cuDNN",
    ),
    (
        "GPT-125M, TP = 4, 8 x 2048",
        "train_step-2026-12-03-tp4-wave.json",
        f"{V4} none",
        f"{V4} taco",
        "cuDNN",
    ),
    (
        "GPT-125M, TP = 4, 8 x 2048",
        "train_step-2026-12-02-tp4-cudnn.json",
        f"{V4} attention=xla none",
        f"{V4} attention=xla taco",
        "XLA",
    ),
]
CODEC_KERNELS = ("encode", "decode", "exchange")  # kernel names of the codec (the profile's kinds)


def codec_kernels_ms(row: dict) -> float | None:
    """The codec's kernels in a profiled step: device time per step of the kernels whose name
    holds an op of the codec, ms."""
    profile = row.get("device_time")
    if not profile:
        return None
    kinds = profile["by_kind_us"]
    return sum(v for k, v in kinds.items() if any(w in k for w in CODEC_KERNELS)) / 1e3


def _emulated_row(row_name: str, record: dict, base: str, label: str, attention: str) -> list:
    steps = _steps(record)
    base_s, step_s = steps[base]["median_step_s"], steps[label]["median_step_s"]
    c = comparison_of(record, base, label)
    if c is not None:
        r = harness_ratio(c, base, label)
        added = (
            f"{1 / r['median'] - 1:+.1%} [{1 / r['interval'][1] - 1:+.1%}, "
            f"{1 / r['interval'][0] - 1:+.1%}] ({r['verdict']})"
        )
    else:
        added = f"{step_s / base_s - 1:+.1%}"
    kernels_ms = codec_kernels_ms(steps[label])
    share = (
        "-" if kernels_ms is None else f"{kernels_ms:.2f} ms ({kernels_ms / (base_s * 1e3):.1%})"
    )
    # XLA's temporaries of the compiled step, not the device's peak: the harness holds both
    # steps of a comparison at once, so a peak would count the other's too
    temp = (steps[base].get("memory_analysis") or {}).get("temp_size_in_bytes")
    return [
        row_name,
        attention,
        f"{base_s * 1e3:.1f} ms",
        added,
        share,
        "-" if temp is None else f"{temp / 2**30:.1f} GiB",
        source(record),
    ]


def step_emulated(records: Records) -> str:
    """Emulated TP on one GPU: `taco` against uncompressed, the codec's kernels; of the
    harness's records the newest of each step, batch and profile."""
    rows, seen = [], set()
    vmapped = lambda r: any("(vmap)" in row["label"] for row in r["results"])
    for record in records.harness("train_step-", vmapped):
        steps = _steps(record)
        for base in (lb for lb in steps if "(vmap)" in lb and lb.endswith(" none")):
            stem = base.removesuffix(" none")
            for label in (lb for lb in steps if lb.startswith(stem + " taco")):
                key = (label, steps[base]["batch"], bool(steps[label].get("device_time")))
                if key in seen:
                    continue
                seen.add(key)
                preset, tp = stem.split()[:2]
                what = (
                    f"{PRESETS.get(preset, preset)}, TP = {tp[3:]}, {steps[base]['batch']} x "
                    f"{steps[base]['model']['seq_len']}, {label.split()[-1]}"
                )
                rows.append(_emulated_row(what, record, base, label, "auto"))
    for row_name, name, base, label, attention in EMULATED:
        rows.append(_emulated_row(row_name, records(name), base, label, attention))
    header = (
        "emulated step | attention | uncompressed | `taco` adds | codec kernels (of the step) | "
        "XLA temporaries | record"
    )
    return table(header, rows)


PP = [  # (row, record)
    ("NVLink, layers unrolled", "train_step-2026-11-30-pp2-nvlink-unroll.json"),
    ("NVLink, scanned", "train_step-2026-11-30-pp2-nvlink.json"),
    ("sockets, scanned", "train_step-2026-11-30-pp2-socket.json"),
]
PP_LABEL = "gpt_1p3b pp=2 gpipe M=8"


def step_pp2(records: Records) -> str:
    rows = []
    for row, name in PP:
        steps = _steps(records(name))
        base = steps[f"{PP_LABEL} none"]["median_step_s"]
        cells = [
            f"{steps[f'{PP_LABEL} {c}']['median_step_s'] * 1e3:.1f} ms "
            f"({x(base / steps[f'{PP_LABEL} {c}']['median_step_s'])})"
            for c in ("tahquant", "taco")
        ]
        rows.append([row, f"{base * 1e3:.1f} ms", *cells, source(records(name))])
    name = "train_step-2026-11-30-pp2-socket-grads-subbyte.json"
    steps = _steps(records(name))
    base = steps[f"{PP_LABEL} none"]["median_step_s"]
    for sends in ("none", "tahquant"):
        cells = [
            f"{steps[f'{PP_LABEL} {sends} grads={c}']['median_step_s'] * 1e3:.1f} "
            f"({x(base / steps[f'{PP_LABEL} {sends} grads={c}']['median_step_s'])})"
            for c in ("taco", "int6_hadamard", "int4_hadamard")
        ]
        sent = "bf16" if sends == "none" else "`tahquant`"
        rows.append(
            [
                f"sockets, {sent} sends, gradient sum `taco` / `int6` / `int4`",
                f"{base * 1e3:.1f} ms",
                " / ".join(cells),
                "-",
                source(records(name)),
            ]
        )
    header = (
        "step (GPipe, M = 8) | bf16 sends, exact sums | `tahquant` sends | `taco` sends | record"
    )
    return table(header, rows)


PP_EMULATED = (
    "train_step-2026-12-02-pp2-emulate-schedules.json",
    "train_step-2026-12-02-pp2-emulate-codecs.json",
)


def bubble(parallel: dict) -> float:
    """A schedule's idle share, (P - 1) / (M V + P - 1) (`ParallelConfig.bubble_fraction`)."""
    pp = parallel["pp"]
    return (pp - 1) / (parallel["microbatches"] * parallel["repeats"] + pp - 1)


def _over_bound(record: dict, label: str, ref: str) -> str:
    """The emulated step over the one-device step times (1 - bubble): 1 means the schedule
    costs only its bubble."""
    steps = _steps(record)
    keep = 1 - bubble(steps[label]["parallel"])
    c = comparison_of(record, ref, label)
    if c is not None:
        r = harness_ratio(c, ref, label)
        lo, hi = r["interval"]
        return f"{keep / r['median']:.2f}x [{keep / hi:.2f}, {keep / lo:.2f}]"
    return f"{steps[label]['median_step_s'] * keep / steps[ref]['median_step_s']:.2f}x"


def step_pp2_emulated(records: Records) -> str:
    """Both stages of pp = 2 on one GPU, each schedule against its bubble bound."""
    rows = []
    found = records.harness(
        "train_step-", lambda r: any("(emulate)" in row["label"] for row in r["results"])
    )
    for record in [*found, *(records(n) for n in PP_EMULATED)]:
        steps = _steps(record)
        memory = record.get("pipeline_memory", {})
        for label, row in steps.items():
            if "(emulate)" not in label:
                continue
            batch = row["batch"]
            ref = next((lb for lb in steps if "pp-ref" in lb and steps[lb]["batch"] == batch), None)
            temp = memory.get(label, {}).get("temp_gib")  # the step's own (a peak is the group's)
            ref_ms = "-" if ref is None else f"{steps[ref]['median_step_s'] * 1e3:.1f} ms"
            rows.append(
                [
                    label.removeprefix("gpt_1p3b ").replace(" (emulate)", ""),
                    f"{row['median_step_s'] * 1e3:.1f} ms",
                    ref_ms,
                    "-" if ref is None else _over_bound(record, label, ref),
                    "-" if temp is None else f"{temp} GiB",
                    source(record),
                ]
            )
    header = (
        "emulated pp = 2 step (GPT-1.3B) | step | one device, same batch | x bound | "
        "XLA temporaries | record"
    )
    return table(header, rows)


DP = (
    ("NVLink", "train_step-2026-11-30-dp2-nvlink.json"),
    ("shared memory", "train_step-2026-11-30-dp2-shm.json"),
    ("sockets", "train_step-2026-11-30-dp2-socket.json"),
)


def step_dp2(records: Records) -> str:
    rows = []
    for link, name in DP:
        steps = _steps(records(name))
        t = {
            k: steps[f"gpt_350m dp=2 {k}"]["median_step_s"]
            for k in ("replicated", "zero1 none", "zero1 sdp4bit")
        }
        rows.append(
            [
                link,
                *(f"{v * 1e3:.1f} ms" for v in t.values()),
                x(t["replicated"] / t["zero1 sdp4bit"]),
                source(records(name)),
            ]
        )
    header = "link | replicated AdamW | ZeRO-1 | ZeRO-1 + SDP4Bit | SDP4Bit vs replicated | record"
    return table(header, rows)


def checkpoint(records: Records) -> str:
    record = records("checkpoint_pause-2026-12-02.json")
    rows = []
    for mode, runs in record["runs"].items():
        pauses = [m["blocked_s"] for m in runs if m["kind"] == "checkpoint"]
        rows.append(
            [
                f"`run.async_checkpoint={'true' if mode == 'async' else 'false'}`",
                " and ".join(f"{p:.1f} s" for p in pauses),
                f"{record['wall_s_printed'][mode]:.1f} s",
            ]
        )
    note = f"`{record['name']}`; {record['printed_note']}."
    return table("saves (steps 45 and 90) | training held up | run", rows) + "\n\n" + fill(note)


# Codec error, the model ------------------------------------------------------------------


def codec_error(records: Records) -> str:
    record = records("codec_error-2026-11-30.json")
    results, tps = record["results"], [str(t) for t in record["tp"]]
    rows = []
    for codec, bits in record["bits_per_element"].items():
        cells = [
            " / ".join(f"{results[t][codec][data]['rel_l2']:.4f}" for t in tps)
            for data in ("gaussian", "student_t2", "outlier_channels")
        ]
        collapse = " / ".join(
            f"{100 * results[tps[-1]][codec][d]['zero_collapse']:.2f}%"
            for d in ("gaussian", "student_t2", "outlier_channels")
        )
        rows.append([f"`{codec}`", f"{bits:g}", *cells, collapse])
    header = (
        "codec | bits | Gaussian | Student-t (2 dof) | Gaussian + 1% outlier channels | "
        f"zero collapse, TP = {tps[-1]}"
    )
    return table(header, rows)


def stage_codec_error(records: Records) -> str:
    record = records("stage_codec_error-2026-11-30.json")
    rows = [
        [
            f"`{r['codec']}`",
            f"{r['bits_per_element']:.2f}",
            *(f"{r[d]:.4f}" for d in ("gaussian", "student_t3", "outlier_channels")),
        ]
        for r in record["results"]
    ]
    return table("codec | bits / element | Gaussian | Student-t (3) | outlier channels", rows)


def model_3d(records: Records) -> str:
    """The model of the 3D layout (not a measurement): step time per compressor and link."""
    record = records("model_3d-2026-12-01.json")
    for name in record["records"]:  # the records it adds up
        for link in ("nvlink", "shm", "socket"):
            records(name.format(link=link))
    variants = list(record["scenarios"][0]["variants"])
    rows = [
        [
            f"{LINK_NAMES[s['inside_node']]} / {LINK_NAMES[s['between_nodes']]}",
            *(
                f"{s['variants'][v]['step_ms']:.0f} ms ({x(s['variants'][v]['speedup'])})"
                for v in variants
            ),
        ]
        for s in record["scenarios"]
    ]
    return table(" | ".join(["TP and PP link / DP link", *variants]), rows)


def noise_floor(records: Records) -> str:
    """The A/A interval of every comparison of the harness records: the noise a ratio must
    clear, by script and what was timed."""
    rows = []
    for prefix in ("kernels", "collectives-", "stage_kernels", "train_step-"):
        for record in records.harness(prefix):
            intervals = [
                timing.summarize(c["times_s"])[timing.AA_RATIO]["interval"]
                for c in record["comparisons"]
            ]
            widest = max(intervals, key=lambda iv: iv[1] - iv[0])
            rounds = [c["repeats"] for c in record["comparisons"]]
            rows.append(
                [
                    f"`{record['name']}`",
                    record["device"],
                    str(len(intervals)),
                    span(rounds, str),
                    f"[{widest[0]:.3f}, {widest[1]:.3f}]",
                    when([record]),
                ]
            )
    if not rows:
        return "(no record of the harness yet: `python -m benchmarks.headline`)"
    header = "record | device | comparisons | rounds | widest A/A interval | measured"
    return table(header, rows)


TABLES: dict[str, Callable[[Records], str]] = {
    f.__name__: f
    for f in (
        headline,
        readme_measured,
        benchmarks_accuracy,
        default_run,
        noise_floor,
        kernels,
        registry_kernels,
        launches,
        plain_noise,
        collectives,
        collectives_subbyte,
        collectives_harness,
        step_tp2,
        step_emulated,
        step_pp2,
        step_pp2_emulated,
        step_dp2,
        checkpoint,
        convergence,
        codec_error,
        stage_codec_error,
        stage_kernels,
        model_3d,
    )
}


# Documents ---------------------------------------------------------------------------------


def render(text: str, records: Records) -> str:
    """`text` with every generated block replaced by what its table makes of the records."""

    def block(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r}; the tables are {sorted(TABLES)}")
        lead, trail = (
            "\n" if edge else ""
            for edge in (match.group(3).startswith("\n"), match.group(3).endswith("\n"))
        )
        return f"{match.group(1)}{lead}{TABLES[name](records)}{trail}{match.group(4)}"

    return BLOCK.sub(block, text)


def rendered(results=(RESULTS,), cpu_ok: bool = False) -> tuple[dict[str, str], Records]:
    """{document: its text with the tables regenerated}, and the records they read."""
    records = Records(results, cpu_ok)
    return {doc: render((REPO / doc).read_text(), records) for doc in DOCS}, records


def write(results=(RESULTS,), docs_dir=REPO, cpu_ok: bool = False) -> list[pathlib.Path]:
    """Regenerates the documents into `docs_dir` (the repository: in place)."""
    texts, _ = rendered(results, cpu_ok)
    pathlib.Path(docs_dir).mkdir(parents=True, exist_ok=True)
    paths = []
    for doc, text in texts.items():
        path = pathlib.Path(docs_dir) / doc
        path.write_text(text)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a document differs")
    args = parser.parse_args(argv)
    if not args.check:
        for path in write():
            print(f"wrote {path}")
        return 0
    texts, _ = rendered()
    stale = [doc for doc, text in texts.items() if (REPO / doc).read_text() != text]
    for doc in stale:
        print(f"{doc}: a table differs from its records; run python -m benchmarks.tables")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
