"""Re-measures the headline of README.md and BENCHMARKS.md in one call, then regenerates the tables.

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
codec's kernels in a profile of two steps (`train_step.py`). Every comparison is
interleaved with its A/A control (`taco_jax.timing`). The parts share `--budget-s`: each gets a
deadline, after which its comparisons stop at their minimum rounds, and a part still
running at the end of the budget is stopped (what it recorded stays). Records go to `--out`
(`<script>-<date>-headline-<part>.json`); then `tables.py` regenerates every table from
benchmarks/results/. Set `TACO_JAX_COMMIT` where the tree has no .git, so that the records
name their commit.

`--dry` runs both sets of parts on the CPU (8 fake devices, the kernels in Pallas'
interpreter) with tiny sizes and two rounds, records into `--out` (a temporary directory by
default) and regenerates the tables from the committed records and these into copies of the
documents there: the command is known to work before it runs on GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
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
SIZES_MIB = ("16", "64", "256", "1024")
DRY_DEVICES = 8


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
    parts = []
    for link in links:
        env = LINKS[link]
        sizes = ("0.0625",) if dry else SIZES_MIB
        parts.append(
            Part(
                f"collectives-{link}",
                "collectives",
                (
                    "--tp",
                    str(n),
                    "--sizes-mib",
                    *sizes,
                    "--codecs",
                    "taco",
                    "int6_hadamard",
                    "--algorithms",
                    "auto",
                    "--ops",
                    "all_reduce",
                    "--inner",
                    "2" if dry else "5",
                    f"--suffix=-headline-{link}",
                ),
                env,
                weight=1.0,
            )
        )
        codecs = () if link == "nvlink" else ("int6_hadamard",)
        preset = "gpt_tiny" if dry else "gpt_1p3b"
        only = [f"{preset} tp={n} (shard_map) {codec} auto" for codec in ("taco", *codecs)]
        parts.append(
            Part(
                f"step-{link}",
                "train_step",
                (
                    "--tp-preset",
                    preset,
                    "--tp-codecs",
                    *codecs,
                    "--only",
                    f"{preset} tp={n} (shard_map) none",
                    *only,
                    f"--suffix=-headline-{link}",
                ),
                env,
                weight=2.0,
            )
        )
    return parts


def one_gpu_parts(dry: bool) -> list[Part]:
    """The registry's kernels, a collective under vmap, the emulated steps."""
    kernels = (
        ("--interpret", "--sizes-kib", "64", "--sizes-mib", "", "--calls", "2")
        if dry
        else ("--sizes-kib", "", "--sizes-mib", ",".join(SIZES_MIB))
    )
    vmap_sizes = ("0.0625",) if dry else ("16", "64")
    steps = [("gpt_tiny", "2", "4")] if dry else [("gpt_125m", "4", "8"), ("gpt_1p3b", "2", "4")]
    parts = [
        Part("kernels", "kernels", ("--skip-check", *kernels, "--suffix=-headline")),
        Part(
            "vmap",
            "collectives",
            (
                "--emulate",
                "4",
                "--sizes-mib",
                *vmap_sizes,
                "--codecs",
                "taco",
                "--ops",
                "all_reduce",
                "--inner",
                "2" if dry else "5",
                "--suffix=-headline-vmap",
            ),
            weight=0.5,
        ),
    ]
    for preset, tp, batch in steps:
        parts.append(
            Part(
                f"step-{preset}",
                "train_step",
                (
                    "--emulate-preset",
                    preset,
                    "--emulate-tp",
                    tp,
                    "--batch-tp",
                    batch,
                    "--emulate-algorithms",
                    "one_shot",
                    "--only",
                    f"tp={tp} (vmap) none",
                    f"tp={tp} (vmap) taco one_shot",
                    f"--suffix=-headline-tp{tp}-vmap",
                    *(() if dry else ("--profile-steps", "2")),  # the codec kernels' share
                ),
                weight=1.5,
            )
        )
    return parts


DRY_TIMING = ("--min-repeats", "2", "--max-repeats", "2")


def run_parts(parts: list[Part], out: pathlib.Path, budget_s: float, dry: bool) -> dict:
    """Runs `parts` one after another, each with a deadline from its share of what is left;
    {part: exit status} (None: stopped at the end of the budget)."""
    end = time.time() + budget_s
    status = {}
    for i, part in enumerate(parts):
        left = end - time.time()
        weights = sum(p.weight for p in parts[i:])
        deadline = time.time() + left * part.weight / weights
        argv = [*part.argv, "--out", str(out), "--deadline", f"{deadline:.0f}"]
        argv += [*DRY_TIMING, "--warmup", "1"] if dry and part.script == "train_step" else []
        argv += DRY_TIMING if dry and part.script != "train_step" else []
        env = {**os.environ, **BASE_ENV, **part.env}
        if dry:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DRY_DEVICES}"
            env["JAX_PLATFORMS"] = "cpu"
        print(
            f"== {part.name}: {' '.join(f'{k}={v}' for k, v in part.env.items())} "
            f"python -m benchmarks.{part.script} {' '.join(argv)}",
            flush=True,
        )
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="CPU: 8 fake devices, tiny sizes")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="GPUs to plan for (default: those JAX sees; --dry: 8 and 1 both)",
    )
    p.add_argument("--links", nargs="+", default=list(LINKS), choices=tuple(LINKS))
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="seconds for every part together (one 10-minute call less the start)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="records (default: benchmarks/results; --dry: a temporary directory)",
    )
    p.add_argument("--no-tables", action="store_true", help="do not regenerate the tables")
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
    if args.no_tables:
        pass
    elif args.dry:  # the committed records and these, into copies of the documents
        written = tables.write(results=[tables.RESULTS, out], docs_dir=out, cpu_ok=True)
        print("== tables:", ", ".join(str(p) for p in written))
    elif out.resolve() != tables.RESULTS.resolve():
        print(
            f"== tables: copy the records of {out} into {tables.RESULTS}, then run "
            "python -m benchmarks.tables"
        )
    else:
        print("== tables:", ", ".join(str(p) for p in tables.write()))
    return 0 if all(v == 0 for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
