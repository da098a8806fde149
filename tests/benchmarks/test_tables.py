"""The tables of BENCHMARKS.md and README.md are what their records say, the figures are drawn
from records that exist, a kernel change marks rows without failing a document, and a new
record joins its tables by one line (`benchmarks/tables.py`, `benchmarks/figures.py`)."""

import dataclasses
import json
import math
import pathlib
import re

import pytest

from benchmarks import _common, figures, tables
from taco_jax import timing

BENCHMARKS = tables.REPO / "benchmarks"
MAX_RECORDS, MAX_SCRIPTS, MAX_LINES, MAX_TABLES_LINES = 80, 10, 2500, 500


@pytest.fixture(scope="module")
def rendered():
    return tables.rendered()


def test_documents_are_what_the_records_say(rendered):
    texts, _ = rendered
    for doc, text in texts.items():
        committed = tables.unmarked((tables.REPO / doc).read_text())
        assert committed == tables.unmarked(text), f"{doc}: run python -m benchmarks.tables"


def test_a_figure_edited_by_hand_is_caught():
    """Rendering a document whose figures were typed over restores the records' (a table's
    cell and a sentence's)."""
    records = tables.Records()
    ratio = re.search(r"\| (\d\.\d\d)x \[", (tables.REPO / "BENCHMARKS.md").read_text())
    typed_over = f"| {float(ratio[1]) + 0.11:.2f}x ["
    for doc, old, new in (
        ("BENCHMARKS.md", ratio[0], typed_over),
        ("README.md", "`taco` +0.01% +- 0.03%", "`taco` +0.00% +- 0.03%"),
    ):
        committed = (tables.REPO / doc).read_text()
        edited = committed.replace(old, new, 1)
        assert edited != committed
        assert tables.unmarked(tables.render(edited, records)) == tables.unmarked(committed)


def test_a_kernel_change_marks_rows_but_fails_no_document():
    """Against other kernels than a record's every harness row of it is marked, against its own
    none, and the check ignores the mark."""
    record = json.loads((tables.RESULTS / tables.KERNELS[0]).read_text())
    own, _ = tables.rendered(kernels=record["kernels"])
    other, _ = tables.rendered(kernels="0" * 12)

    def rows(texts):
        lines = texts["BENCHMARKS.md"].splitlines()
        return [line for line in lines if line.startswith("|") and f"-{record['date']}-" in line]

    assert rows(other) and all(line.endswith(f"{tables.CHANGED} |") for line in rows(other))
    assert not any(tables.CHANGED in line for line in rows(own))
    assert tables.unmarked(other["BENCHMARKS.md"]) == tables.unmarked(own["BENCHMARKS.md"])


def frozen_records(text: str) -> set[str]:
    """The records BENCHMARKS.md's frozen section ("Earlier measurements") names."""
    return set(re.findall(r"`([\w.+-]+\.json)`", text[text.index(tables.FROZEN) :]))


def test_every_record_is_cited(rendered):
    """results/ holds the records the tables and figures read and those the frozen section
    names, no other; each of those exists."""
    texts, records = rendered
    for name in figures.FIGURES:
        for record in figures.FIGURES[name].records:
            records(record)
    frozen = frozen_records(texts["BENCHMARKS.md"])
    files = {p.name for p in tables.RESULTS.iterdir()}
    assert frozen <= files, f"named but missing: {sorted(frozen - files)}"
    assert not files - records.read - frozen, (
        f"cited nowhere: {sorted(files - records.read - frozen)}"
    )
    assert len(files) <= MAX_RECORDS
    assert not records.read & frozen, "a record is either read or frozen"


def test_benchmarks_md_is_reference_form(rendered):
    texts, _ = rendered
    lines = texts["BENCHMARKS.md"].splitlines()
    assert len(lines) <= 500
    assert all(len(line) <= 200 for line in lines), max(lines, key=len)
    assert len(texts["README.md"].splitlines()) <= 150


def test_benchmarks_fit_their_budget():
    """benchmarks/ keeps the scripts a user reruns and the code that makes the documents."""
    sources = sorted(BENCHMARKS.glob("*.py"))
    scripts = [p for p in sources if 'if __name__ == "__main__":' in p.read_text()]
    assert len(scripts) <= MAX_SCRIPTS, [p.name for p in scripts]
    assert sum(len(p.read_text().splitlines()) for p in sources) <= MAX_LINES
    assert len((BENCHMARKS / "tables.py").read_text().splitlines()) <= MAX_TABLES_LINES


def test_default_run_figures_are_its_record(rendered):
    record = json.loads((tables.RESULTS / "default-run-2026-11-30.json").read_text())
    final = [m for m in record["metrics"] if m["kind"] == "train"][-1]["loss"]
    assert f"training loss 7.8 -> {final:.1f}" in rendered[0]["README.md"]


def test_paired_losses_reproduce_the_convergence_script():
    """`tables.paired` on one record equals what benchmarks/convergence.py wrote into it (its
    paired mean and the bf16 runs' spread between seeds)."""
    record = tables.Records()("convergence-2026-12-01-tp8-seeds.json")
    runs = tables.runs_of([record])
    for row in (r for r in record["comparison"] if r["codec"] != "none"):
        p = tables.paired(runs, row["layout"], row["codec"])
        assert math.isclose(p["mean"], row["paired_pct_vs_bf16"], rel_tol=1e-9)
        assert math.isclose(p["spread"], row["baseline_seed_spread_pct"], rel_tol=1e-9)


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_figures_redraw_from_their_records(tmp_path, name):
    """Each figure's records exist, and the command draws it (not compared byte for byte: a
    PNG differs between matplotlib versions)."""
    records = tables.Records()
    path = figures.draw(name, records, tmp_path)
    assert set(figures.FIGURES[name].records) <= records.read
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_every_figure_is_in_the_tree_and_linked(rendered):
    drawn = {p.stem for p in figures.FIGURES_DIR.glob("*")}
    assert drawn == set(figures.FIGURES)
    for name in figures.FIGURES:
        assert f"](docs/figures/{name}.png)" in rendered[0]["BENCHMARKS.md"]


# A new record: one line in the tuple of its kind ---------------------------------------------


def _rounds(names: dict[str, float], jitter_seed: int, rounds: int = 8) -> dict[str, list]:
    """Raw times of a harness comparison: the first name the baseline (and A'), each name
    taking its seconds, 1-2% of multiplicative noise."""
    times = {n: [] for n in [next(iter(names)), timing.AA, *list(names)[1:]]}
    for r in range(rounds):
        jitter = 1 + 0.02 * math.sin(7 * jitter_seed + 3 * r)
        for n, seconds in names.items():
            times[n].append(seconds * jitter)
        times[timing.AA].append(next(iter(names.values())) / jitter)
    return times


def _kernels_record(tmp_path: pathlib.Path) -> str:
    """`kernels.py --backends auto triton mosaic --peers 2 4 8` at 8-64 MiB: Mosaic 1.2x
    Triton's speed, the registry's kernel Mosaic's."""
    bench, comparisons = [], []
    for peers in (2, 4, 8):
        for i, nbytes in enumerate(s << 20 for s in (8, 16, 32, 64)):
            names = {"copy": 1e-4}
            for op in tables.OPS:
                names |= {op: 1e-4 / 0.9, f"{op}_triton": 1.2e-4 / 0.9, f"{op}_mosaic": 1e-4 / 0.9}
            comparisons.append({"bytes": nbytes, "peers": peers, "times_s": _rounds(names, i)})
            share = {"in_program_of_copy": 0.9, "of_copy_interval": [0.88, 0.92]}
            bench.append({"bytes": nbytes, "peers": peers, "copy_in_program_tbps": 1.5})
            bench[-1] |= {n: share for n in names if n != "copy"}
            bench[-1]["registry"] = {op: "mosaic" for op in tables.OPS}
    record = {"date": "2099-01-01", "commit": "abc1234", "device": "1 x GPU", "codec": "taco"}
    record |= {"kernels": _common.kernels_fingerprint(), "bench": bench, "comparisons": comparisons}
    (tmp_path / "kernels-2099-01-01-peers.json").write_text(json.dumps(record))
    return "kernels-2099-01-01-peers.json"


def test_a_kernels_record_of_both_lowerings_is_one_line(tmp_path):
    """The record joins the kernel tables and the figure by its name alone (in `KERNELS`, or
    `LOWERINGS` for the table of both lowerings)."""
    name = _kernels_record(tmp_path)
    records = tables.Records([tables.RESULTS, tmp_path])
    kernels = tables.KERNELS + (name,)  # the one line
    lowerings = tables.render_table(
        dataclasses.replace(tables.TABLES["lowerings"], records=tables.LOWERINGS + (name,)),
        records,
    )
    for peers in (2, 4, 8):
        assert f"| `taco`, {peers}, 64 MiB (mosaic) | {'90%/90% 1.20x faster | ' * 4}[" in lowerings
    assert lowerings.count(" faster |") == 3 * 4 * 4
    registry = tables.render_table(
        dataclasses.replace(tables.TABLES["kernels"], records=kernels), records
    )
    assert "| `taco`, 4, 8 MiB (mosaic) | 90% [88, 92%] |" in registry
    figure = dataclasses.replace(figures.FIGURES["kernels"], records=kernels)
    figures.FIGURES["kernels"], saved = figure, figures.FIGURES["kernels"]
    try:
        assert figures.draw("kernels", records, tmp_path).stat().st_size > 10_000
    finally:
        figures.FIGURES["kernels"] = saved


@pytest.mark.parametrize("same_kernels", [True, False])
def test_a_collectives_record_on_a_link_is_one_line(tmp_path, same_kernels):
    """A harness record of `taco` on the shared-memory link, 1.5x faster: its rows say where,
    the verdict, and the mark where its kernels differ from the tree's."""
    comparisons = [
        {"tp": 2, "bytes": s << 20, "op": "all_reduce", "repeats": 8}
        | {"times_s": _rounds({"lax": 1e-3, "taco auto": 1e-3 / 1.5}, i)}
        for i, s in enumerate((16, 64))
    ]
    kernels = _common.kernels_fingerprint() if same_kernels else "0" * 12
    record = {"date": "2099-01-01", "commit": "abc1234", "kernels": kernels, "device": "2 x GPU"}
    record |= {"env": {"NCCL_P2P_DISABLE": "1"}, "emulated": False, "comparisons": comparisons}
    (tmp_path / "collectives-2099-01-01-shm.json").write_text(json.dumps(record))
    table = dataclasses.replace(
        tables.TABLES["collectives"],
        records=(*tables.COLLECTIVES, "collectives-2099-01-01-shm.json"),
    )
    text = tables.render_table(table, tables.Records([tables.RESULTS, tmp_path]))
    rows = [line for line in text.splitlines() if "2099" in line]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| shared memory, 2", "16 MiB"],
        ["| shared memory, 2", "64 MiB"],
    ]
    assert all("| `taco auto` | 1.50x [" in row and "] faster |" in row for row in rows)
    assert all(
        row.endswith(f"(`abc1234`){'' if same_kernels else ' ' + tables.CHANGED} |") for row in rows
    )
