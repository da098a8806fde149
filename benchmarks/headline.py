"""Re-measures the harness tables of BENCHMARKS.md in one call, and shows them with the new records.

    python -m benchmarks.headline                 # every GPU of the machine, ~9 minutes
    python -m benchmarks.headline --dry           # CPU: 8 fake devices, tiny sizes, few rounds

On N >= 2 GPUs, for each link BENCHMARKS.md names (`--links`: NCCL's default, NVLink here;
`NCCL_P2P_DISABLE=1`, host shared memory; and `NCCL_SHM_DISABLE=1` too, sockets), one process
each with those variables set: the all-reduce of `taco` and `int6_hadamard` with their defaults
(`algorithm="auto"`) against `lax.psum` at 16 MiB to 1 GiB per rank, TP = N
(`collectives.py`), then the GPT-1.3B training step with TP = N uncompressed and with `taco`
(`int6_hadamard` too off NVLink) (`train_step.py`). On one GPU, what one GPU allows: the
kernels the registry picks against a copy (`kernels.py`), `compressed_psum` under `vmap`
against `lax.psum` (`collectives.py --emulate 4`), and the emulated steps of GPT-125M at TP = 4
and GPT-1.3B at TP = 2, `taco` one-shot against uncompressed, with the device time of the
codec's kernels in a profile of two steps (`train_step.py`). Every comparison is interleaved
with its A/A control (`taco_jax.timing`). The parts share `--budget-s`: each gets a deadline,
after which its comparisons stop at their minimum rounds, and a part still running at the end
of the budget is stopped (what it recorded stays). Records go to `--out`
(`<script>-<date>-headline-<part>.json`), and `<out>/tables.md` shows every table of their
kind with them added: a record joins BENCHMARKS.md by its name in `benchmarks/tables.py`. Set
`TACO_JAX_COMMIT` where the tree has no .git, so that the records name their commit.

`--dry` runs both sets of parts on the CPU (8 fake devices, the kernels in Pallas' interpreter)
with tiny sizes and two rounds, into `--out` (a temporary directory by default): the command is
known to work before it runs on GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from benchmarks import tables

LINKS = {  # BENCHMARKS.md's links of one machine: the NCCL variables that select each
    "nvlink": {},
    "shm": {"NCCL_P2P_DISABLE": "1"},
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}
BASE_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off, as every record since 2026-11-30
DRY_DEVICES = 8
DRY_TIMING = ("--min-repeats", "2", "--max-repeats", "2")


@dataclasses.dataclass(frozen=True)
class Part:
    """One process of the run: `python -m benchmarks.<script> <argv>` with `env` added, its
    share of the budget in `weight`."""

    name: str
    script: str
    argv: tuple[str, ...]
    env: dict = dataclasses.field(default_factory=dict)
    weight: float = 1.0


def multi_gpu_parts(n: int, links, dry: bool) -> list[Part]:
    """Per link: the all-reduce at TP = n, then the GPT-1.3B step at TP = n."""
    sizes, inner = ("0.0625", "2") if dry else ("16 64 256 1024", "5")
    preset = "gpt_tiny" if dry else "gpt_1p3b"
    parts = []
    for link in links:
        collectives = f"--tp {n} --sizes-mib {sizes} --codecs taco int6_hadamard --algorithms auto"
        collectives += f" --ops all_reduce --inner {inner} --suffix=-headline-{link}"
        parts.append(
            Part(f"collectives-{link}", "collectives", tuple(collectives.split()), LINKS[link])
        )
        codecs = ("taco",) if link == "nvlink" else ("taco", "int6_hadamard")
        only = [
            f"{preset} tp={n} (shard_map) {c}" for c in ("none", *(f"{c} auto" for c in codecs))
        ]
        argv = ("--tp-preset", preset, "--tp-codecs", *codecs[1:], "--only", *only)
        argv += (f"--suffix=-headline-{link}",)
        parts.append(Part(f"step-{link}", "train_step", argv, LINKS[link], weight=2.0))
    return parts


def one_gpu_parts(dry: bool) -> list[Part]:
    """The registry's kernels, a collective under vmap, the emulated steps."""
    kernels = "--interpret --sizes-mib 0.0625 --calls 2" if dry else "--sizes-mib 16 64 256 1024"
    vmap = f"--emulate 4 --sizes-mib {'0.0625' if dry else '16 64'} --codecs taco --ops all_reduce"
    vmap += f" --inner {2 if dry else 5} --suffix=-headline-vmap"
    parts = [
        Part("kernels", "kernels", (*kernels.split(), "--suffix=-headline")),
        Part("vmap", "collectives", tuple(vmap.split()), weight=0.5),
    ]
    # (preset, TP, sequences per rank): GPT-1.3B's two steps held at once fit an 80 GB GPU at 2
    steps = [("gpt_tiny", "2", "4")] if dry else [("gpt_125m", "4", "8"), ("gpt_1p3b", "2", "2")]
    for preset, tp, batch in steps:
        argv = f"--emulate-preset {preset} --emulate-tp {tp} --batch-tp {batch}"
        argv += f" --emulate-algorithms one_shot --suffix=-headline-tp{tp}-vmap"
        argv += "" if dry else " --profile-steps 2"  # the codec kernels' share of the step
        only = ("--only", f"tp={tp} (vmap) none", f"tp={tp} (vmap) taco one_shot")
        parts.append(Part(f"step-{preset}", "train_step", (*argv.split(), *only), weight=1.5))
    return parts


def run_parts(parts: list[Part], out: pathlib.Path, budget_s: float, dry: bool) -> dict:
    """Runs `parts` one after another, each with a deadline from its share of what is left;
    {part: exit status} (None: stopped at the end of the budget)."""
    end = time.time() + budget_s
    status = {}
    for i, part in enumerate(parts):
        share = part.weight / sum(p.weight for p in parts[i:])
        deadline = time.time() + (end - time.time()) * share
        argv = [*part.argv, "--out", str(out), "--deadline", f"{deadline:.0f}"]
        argv += [*DRY_TIMING, "--warmup", "1"] if dry and part.script == "train_step" else []
        argv += DRY_TIMING if dry and part.script != "train_step" else []
        env = {**os.environ, **BASE_ENV, **part.env}
        if dry:
            env |= {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DRY_DEVICES}"}
            env |= {"JAX_PLATFORMS": "cpu"}
        variables = " ".join(f"{k}={v}" for k, v in part.env.items())
        print(f"== {part.name}: {variables} python -m benchmarks.{part.script} {' '.join(argv)}")
        try:
            done = subprocess.run(
                [sys.executable, "-m", f"benchmarks.{part.script}", *argv],
                env=env,
                cwd=tables.REPO,
                timeout=max(end - time.time(), 1),
            )
            status[part.name] = done.returncode
        except subprocess.TimeoutExpired:
            status[part.name] = None
    return status


KIND = re.compile(r"([a-z_]+)-\d{4}-")  # a record's kind: the script that wrote it


def preview(out: pathlib.Path) -> str:
    """Every table with the records of `out` added to those of their kind (markdown)."""
    new = sorted(p.name for p in out.glob("*.json"))
    records, text = tables.Records([tables.RESULTS, out]), []
    for name, table in tables.TABLES.items():
        kind = KIND.match(table.records[0])[1]
        if added := tuple(n for n in new if KIND.match(n) and KIND.match(n)[1] == kind):
            table = dataclasses.replace(table, records=table.records + added)
            text.append(f"## {name}\n\n{tables.render_table(table, records)}\n")
    return "\n".join(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="CPU: 8 fake devices, tiny sizes")
    p.add_argument("--devices", type=int, default=None, help="GPUs to plan for (default: all)")
    p.add_argument("--links", nargs="+", default=list(LINKS), choices=tuple(LINKS))
    p.add_argument("--budget-s", type=float, default=540.0, help="for every part together")
    p.add_argument("--out", default=None, help="default: results/; --dry: a temporary directory")
    return p


def gpus() -> int:
    """The GPUs JAX sees, asked of a process of its own: this one must not hold GPU memory
    while the parts run."""
    probe = "import jax; print(jax.device_count() if jax.default_backend() == 'gpu' else 0)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return int(done.stdout.strip() or 0)


def plan(args) -> list[Part]:
    if args.dry:
        return multi_gpu_parts(DRY_DEVICES, args.links, dry=True) + one_gpu_parts(dry=True)
    devices = args.devices if args.devices is not None else gpus()
    if devices < 1:
        sys.exit("the headline is measured on GPUs: run on a GPU machine, or --dry on a CPU")
    return multi_gpu_parts(devices, args.links, dry=False) if devices > 1 else one_gpu_parts(False)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out = pathlib.Path(
        args.out or (tempfile.mkdtemp(prefix="headline-") if args.dry else tables.RESULTS)
    )
    status = run_parts(plan(args), out, args.budget_s, args.dry)
    print(
        "== parts:",
        ", ".join(f"{k} {'stopped' if v is None else f'exit {v}'}" for k, v in status.items()),
    )
    if out.resolve() != tables.RESULTS.resolve():
        (out / "tables.md").write_text(preview(out))
        print(f"== {out / 'tables.md'}: the tables with these records")
    print("== a record joins BENCHMARKS.md by its name in benchmarks/tables.py's tuple of its kind")
    return 0 if all(v == 0 for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
