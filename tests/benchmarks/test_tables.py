"""The tables of BENCHMARKS.md and README.md are what the records say (`benchmarks/tables.py`),
results/ holds only records a table reads, and a harness record reaches the headline."""

import json
import math
import re

import pytest

from benchmarks import _common, tables
from taco_jax import timing

MAX_RECORDS = 80


@pytest.fixture(scope="module")
def rendered():
    return tables.rendered()


def test_documents_are_what_the_records_say(rendered):
    texts, _ = rendered
    for doc, text in texts.items():
        committed = (tables.REPO / doc).read_text()
        assert committed == text, f"{doc} differs from its records: python -m benchmarks.tables"


def test_a_figure_edited_by_hand_is_caught(rendered):
    """Rendering a document whose headline figure was typed over restores the record's."""
    committed = (tables.REPO / "README.md").read_text()
    edited = committed.replace("| 1.25x |", "| 1.35x |", 1)
    assert edited != committed
    assert tables.render(edited, tables.Records()) == committed


def test_every_record_is_read_by_a_table(rendered):
    _, records = rendered
    files = sorted(
        p.relative_to(tables.RESULTS).as_posix() for p in tables.RESULTS.rglob("*") if p.is_file()
    )
    unread = sorted(set(files) - records.read)
    assert not unread, f"records no table reads (remove them, decision 020): {unread}"
    assert len(files) <= MAX_RECORDS


def test_benchmarks_md_is_reference_form(rendered):
    texts, _ = rendered
    lines = texts["BENCHMARKS.md"].splitlines()
    assert len(lines) <= 500
    assert all(len(line) <= 200 for line in lines), max(lines, key=len)
    assert "development_history" not in texts["BENCHMARKS.md"]
    assert len(texts["README.md"].splitlines()) <= 150


def test_identical_programs_read_level(rendered):
    """Where the defaults chose the plain collective both sides ran `lax.psum`: "level", not a
    speedup (the NVLink row at 4 MiB)."""
    block = _block(rendered[0]["BENCHMARKS.md"], "collectives")
    (row,) = [line for line in block.splitlines() if line.startswith("| NVLink | 4 MiB |")]
    assert "level (plain" in row


def test_rows_before_the_harness_are_marked(rendered):
    rows = [
        line
        for line in _block(rendered[0]["README.md"], "readme_measured").splitlines()
        if line.startswith("| [")
    ]
    assert rows and all(line.endswith(f"{tables.NO_AA}{tables.KERNELS_CHANGED} |") for line in rows)


def test_default_run_figures_are_its_record(rendered):
    record = json.loads((tables.RESULTS / "default-run-2026-11-30.json").read_text())
    final = [m for m in record["metrics"] if m["kind"] == "train"][-1]["loss"]
    assert f"training loss 7.8 -> {final:.1f}" in rendered[0]["README.md"]


def test_paired_losses_reproduce_the_convergence_script():
    """`tables.paired` on one record equals what benchmarks/convergence.py wrote into it (its
    paired mean and the bf16 runs' spread between seeds)."""
    records = tables.Records()
    name = "convergence-2026-12-01-tp8-seeds.json"
    runs = tables._runs(records, (name,))
    for row in records(name)["comparison"]:
        if row["codec"] == "none":
            continue
        p = tables.paired(runs, row["layout"], row["codec"])
        assert math.isclose(p["mean"], row["paired_pct_vs_bf16"], rel_tol=1e-9)
        assert math.isclose(p["spread"], row["baseline_seed_spread_pct"], rel_tol=1e-9)


def _block(text: str, name: str) -> str:
    return re.search(rf"<!-- table: {name} -->(.*?)<!-- /table -->", text, re.S).group(1)


def _harness_record(tmp_path, kernels: str) -> None:
    """A collectives record of the harness on the shared-memory link: `taco` 1.5x faster at
    16 MiB-1 GiB, 2% noise, 8 rounds."""
    comparisons = []
    for i, nbytes in enumerate(s << 20 for s in (16, 64, 256, 1024)):
        times = {"lax": [], timing.AA: [], "taco auto": []}
        for r in range(8):
            jitter = 1 + 0.02 * math.sin(7 * i + 3 * r)
            times["lax"].append(1e-3 * jitter)
            times[timing.AA].append(1e-3 / jitter)
            times["taco auto"].append(1e-3 / 1.5 * jitter**0.5)
        comparisons.append(
            {"tp": 2, "bytes": nbytes, "op": "all_reduce", "repeats": 8, "times_s": times}
        )
    rows = [{"tp": 2, "op": "all_reduce", "codec": c, "bytes": 16 << 20} for c in ("lax", "taco")]
    record = {
        "date": "2099-01-01",
        "commit": "abc1234",
        "kernels": kernels,
        "backend": "gpu",
        "device": "2 x GPU",
        "env": {"NCCL_P2P_DISABLE": "1"},
        "emulated": False,
        "rows": rows,
        "comparisons": comparisons,
    }
    (tmp_path / "collectives-2099-01-01-headline-shm.json").write_text(json.dumps(record))


@pytest.mark.parametrize("same_kernels", [True, False])
def test_a_harness_record_takes_its_headline_row(tmp_path, same_kernels):
    kernels = _common.kernels_fingerprint() if same_kernels else "0" * 12
    _harness_record(tmp_path, kernels)
    records = tables.Records([tables.RESULTS, tmp_path])
    (row,) = [
        r for r in tables.headline_rows(records) if "`taco`, defaults" in r[0] and "TP = 2" in r[0]
    ]
    assert row[2] == "1.50x faster"  # shared memory: the harness's verdict, every size
    assert row[1].startswith("1.15-1.28x")  # NVLink: still the older record
    assert "2099-01-01" in row[4] and "`abc1234`" in row[4]
    record = records("collectives-2099-01-01-headline-shm.json")
    assert tables.marks(record) == ("" if same_kernels else tables.KERNELS_CHANGED)


def test_a_kernels_record_of_both_lowerings(tmp_path):
    """A harness record timing the registry's kernel (Mosaic for `taco`) and both lowerings:
    Mosaic 1.2x Triton's speed, 1% noise, reads "faster" beside the two shares of the copy."""
    bench, comparisons = [], []
    for i, nbytes in enumerate(s << 20 for s in (16, 64)):
        times = {"copy": [], timing.AA: []}
        for r in range(8):
            jitter = 1 + 0.01 * math.sin(5 * i + 3 * r)
            times["copy"].append(1e-4 * jitter)
            times[timing.AA].append(1e-4 / jitter)
            for op in tables.OPS:
                times.setdefault(f"{op}_triton", []).append(1.2e-4 * jitter)
                times.setdefault(op, []).append(1e-4 / jitter)
                times.setdefault(f"{op}_mosaic", []).append(1e-4 / jitter)
        share = {"in_program_of_copy": 0.9, "of_copy_interval": [0.88, 0.92]}
        bench.append({"bytes": nbytes, **{n: share for n in times if n not in ("copy", "A'")}})
        comparisons.append({"bytes": nbytes, "repeats": 8, "times_s": times})
    record = {
        "date": "2099-01-01",
        "commit": "abc1234",
        "backend": "gpu",
        "device": "1 x GPU",
        "kernels": _common.kernels_fingerprint(),
        "codec": "taco",
        "peers": 8,
        "backends": ["auto", "triton", "mosaic"],
        "bench": bench,
        "comparisons": comparisons,
        "registry": {op: "mosaic" for op in tables.OPS},
    }
    (tmp_path / "kernels-2099-01-01.json").write_text(json.dumps(record))
    records = tables.Records([tables.RESULTS, tmp_path])
    lowerings = tables.kernels(records).splitlines()
    encode = next(line for line in lowerings if line.startswith("| `taco`, 8, encode |"))
    assert "| 90 / **90** faster | 90 / **90** faster | - | - |" in encode
    registry = tables.registry_kernels(records)
    assert "| `taco`, 8, 16 MiB (mosaic) | 90% [88, 92%] |" in registry
