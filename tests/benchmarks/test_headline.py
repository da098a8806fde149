"""`python -m benchmarks.headline --dry`: the headline's command end to end on the CPU (8 fake
devices, tiny sizes, two rounds), its records, and the tables it previews with them."""

import json

import pytest
from process_testing import run_module

from benchmarks import headline, tables
from taco_jax import timing

PARTS = {  # record written by each part of the dry run
    "collectives-nvlink": "collectives-*-headline-nvlink.json",
    "step-nvlink": "train_step-*-headline-nvlink.json",
    "collectives-shm": "collectives-*-headline-shm.json",
    "step-shm": "train_step-*-headline-shm.json",
    "collectives-socket": "collectives-*-headline-socket.json",
    "step-socket": "train_step-*-headline-socket.json",
    "kernels": "kernels-*-headline.json",
    "vmap": "collectives-*-headline-vmap.json",
    "step-gpt_tiny": "train_step-*-headline-tp2-vmap.json",
}


def test_dry_plan_names_every_part():
    """The plan the slow test runs: every link's all-reduce and step, then the one-GPU parts."""
    args = headline.parser().parse_args(["--dry"])
    assert [part.name for part in headline.plan(args)] == list(PARTS)


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    run_module("benchmarks.headline", "--dry", "--out", str(tmp_path), timeout=900)
    records = {}
    for part, pattern in PARTS.items():
        (path,) = tmp_path.glob(pattern)
        records[part] = json.loads(path.read_text())
        assert records[part]["comparisons"], part  # the harness's raw times
    # The kernels ran on buffers other than the copy's: their rounds timed a placement control.
    assert all(timing.PLACED in c["times_s"] for c in records["kernels"]["comparisons"])
    # Each link's process ran with that link's NCCL variables.
    assert records["collectives-socket"]["env"]["NCCL_SHM_DISABLE"] == "1"
    assert records["step-shm"]["env"]["NCCL_P2P_DISABLE"] == "1"
    # The tables previewed with the dry records show their rows, each record named.
    preview = (tmp_path / "tables.md").read_text()
    for pattern in PARTS.values():
        assert f"`{next(tmp_path.glob(pattern)).name}`" in preview, pattern
    rows = [line for line in preview.splitlines() if line.startswith("| CPU devices, 8 |")]
    assert rows and all("`taco auto`" in r or "`int6_hadamard auto`" in r for r in rows), rows
    assert any(
        "gpt_tiny tp=8 (shard_map): taco auto / none" in line for line in preview.splitlines()
    )
    # ... and the committed documents were left alone.
    texts, _ = tables.rendered()
    committed = (tables.REPO / "BENCHMARKS.md").read_text()
    assert tables.unmarked(committed) == tables.unmarked(texts["BENCHMARKS.md"])
