"""Training-step speed: step time, tokens/s and MFU of the bf16 GPT, and what compression changes.

Cases (`--only TEXT [TEXT ...]` keeps those whose label contains one of them):
  1. Uncompressed GPT-125M and GPT-1.3B on one device (`make_steps`, tp = 1): step time,
     tokens/s and MFU = flops_per_token x tokens/s / peak, flops_per_token = 6 N + 12 L H Q T
     (PaLM appendix B; `ModelConfig.flops_per_token`), peak the device's dense bf16 rate.
  2. TP = `--emulate-tp` emulated on the same device (`jax.vmap(axis_name="tp")`, model
     `--emulate-preset`): every TP collective uncompressed ("none"), then `taco` and each of
     `--tp-codecs` with each of `--emulate-algorithms` (and each `--emulate-attention`).
  3. With >= 2 devices, real TP over all of them (`shard_map`, NCCL, `--tp-preset`): "none"
     and each codec with the defaults ("auto": `taco_jax.policy` decides), with and without
     sequence parallelism ("sp").
  4. Pipelines: with >= 2 devices pp = devices, with `--pp-emulate N` pp = N emulated on one
     device ("(emulate)"); each of `--schedules` x `--microbatches` x `--pp-codecs` (the stage
     sends, `taco_jax.compressed_ppermute`), against the same batch on one device ("pp-ref").
  5. With >= 2 devices (or `--dp-emulate N`), data parallelism (`--dp-preset`): replicated
     AdamW, then ZeRO-1 uncompressed and with SDP4Bit (TLq-HS gradients, qWD weights).
The cases are timed in groups, each against its baseline (`group_key`), every case of a group
compiled and resident at once, one step of each per round, interleaved with an A/A control
(`taco_jax.timing.compare`: at least `--min-repeats` rounds, more until the ratios are stable or
`--budget-s` is spent). A row keeps its step times, one a round, and XLA's account of the
compiled step's memory; with `--profile-steps N`, N more steps under `jax.profiler` give the
GPU kernels' time per kind (`_common.device_time_by_kernel`). Tokens are random (speed does not
depend on them). A case that fails to build (e.g. out of memory) is recorded with its error.
Writes `train_step-<date><suffix>.json` to `--out` after each group.

    python -m benchmarks.train_step                       # every case the machine can run
    python -m benchmarks.train_step --only "tp=4 (vmap)"  # the emulated-TP cases only
    python -m benchmarks.train_step --smoke               # CPU check: tiny preset, 2 rounds
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback

import jax
import numpy as np
import optax

import taco_jax
from benchmarks._common import (
    compare_options,
    device_time_by_kernel,
    timed_script_options,
    write_record,
)
from taco_jax import timing
from taco_models import ModelConfig, ParallelConfig, layers
from taco_models.parallel import SCHEDULES
from taco_models.pipeline import StageCodecs
from taco_train import metrics as run_metrics
from taco_train.steps import make_steps
from taco_train.zero import ZeroConfig

EMULATED_ALGORITHMS = ("auto", "one_shot", "two_shot")  # of the emulated-TP all-reduces


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    preset: str
    batch: int
    parallel: ParallelConfig
    codec: str = "none"
    impl: str = "auto"
    overrides: tuple = ()
    algorithm: str = "auto"  # of the all-reduces (taco_jax.CommConfig.algorithm)
    stage_codec: str = "none"  # of pipeline stage traffic (parallel.pp > 1)
    sharded: ZeroConfig | None = None  # ZeRO-1 over dp and its codecs (case 5)

    def model(self) -> ModelConfig:
        return ModelConfig.preset(self.preset, **dict(self.overrides))


def default_cases(args) -> list[Case]:
    one = ParallelConfig(remat=args.remat, scan_layers=not args.unroll)
    if args.smoke:
        tiny = ParallelConfig(tp=2, mode="vmap", scan_layers=not args.unroll)
        # pp = 2 on fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2+)
        pp = pipeline_cases(args, 2, preset="gpt_tiny", overrides=(("n_layers", 4),))
        return [
            Case("gpt_tiny", "gpt_tiny", 4, one),
            Case("gpt_tiny tp=2 (vmap) none", "gpt_tiny", 4, tiny, "none"),
            Case("gpt_tiny tp=2 (vmap) taco", "gpt_tiny", 4, tiny, "taco", args.impl),
            *(pp if jax.device_count() >= 2 else []),
        ]
    # GPT-125M: 16 x 2048 tokens, activations ~20 GB without remat. GPT-1.3B: 8 x 2048 tokens,
    # ~2 MB of saved activations per token (~35 GB) and 21 GB of fp32 weights and Adam moments.
    cases = [Case("gpt_125m", "gpt_125m", args.batch_125m, one)]
    cases += [Case("gpt_1p3b", "gpt_1p3b", args.batch_1p3b, one), *emulated_tp_cases(args)]
    n_devices = jax.device_count()
    if n_devices >= 2:  # real TP over every GPU of the machine (NCCL), with and without SP
        real = ParallelConfig(tp=n_devices, remat=args.remat, scan_layers=not args.unroll)
        for sp in (False, True):
            parallel = dataclasses.replace(real, sequence_parallel=sp)
            label = f"{args.tp_preset} tp={n_devices}{' sp' if sp else ''} (shard_map)"
            run = dict(preset=args.tp_preset, batch=args.batch_1p3b, parallel=parallel)
            cases.append(Case(f"{label} none", **run))
            codecs = dict.fromkeys(("taco", *args.tp_codecs))
            cases += [Case(f"{label} {c} auto", codec=c, impl=args.impl, **run) for c in codecs]
        cases += pipeline_cases(args, n_devices, args.pp_preset)
        cases += data_parallel_cases(args, n_devices)
    if args.dp_emulate:
        cases += data_parallel_cases(args, args.dp_emulate, mode="emulate")
    if args.pp_emulate:
        emulated_pp = pipeline_cases(args, args.pp_emulate, args.pp_preset, mode="emulate")
        cases += [c for c in emulated_pp if n_devices < 2 or "pp-ref" not in c.label]
    return cases


def emulated_tp_cases(args) -> list[Case]:
    """Case 2: `--emulate-preset` with TP = `--emulate-tp` under vmap, uncompressed, then `taco`
    and each of `--tp-codecs` with each of `--emulate-algorithms` (all-reduces only; "auto"
    runs two-shot where no bytes move, `taco_jax.policy`)."""
    emulated = ParallelConfig(
        tp=args.emulate_tp, mode="vmap", remat=args.remat, scan_layers=not args.unroll
    )
    cases = []
    for attention in args.emulate_attention:
        label = f"{args.emulate_preset} tp={args.emulate_tp} (vmap)"
        label += "" if attention == "auto" else f" attention={attention}"
        parallel = dataclasses.replace(emulated, attention=attention)
        run = dict(preset=args.emulate_preset, batch=args.batch_tp, parallel=parallel)
        cases.append(Case(f"{label} none", codec="none", **run))
        for codec in dict.fromkeys(("taco", *args.tp_codecs)):
            for algorithm in args.emulate_algorithms:
                tag = "" if algorithm == "auto" else f" {algorithm}"
                case = Case(f"{label} {codec}{tag}", codec=codec, impl=args.impl, **run)
                cases.append(dataclasses.replace(case, algorithm=algorithm))
    return cases


def data_parallel_cases(args, n_devices: int, mode: str = "shard_map") -> list[Case]:
    """Case 5: dp = n_devices (emulated on one device with mode="emulate"): replicated AdamW,
    then ZeRO-1 without and with SDP4Bit, in the library's buckets."""
    parallel = ParallelConfig(
        dp=n_devices, remat=args.remat, scan_layers=not args.unroll, mode=mode
    )
    label = f"{args.dp_preset} dp={n_devices}" + (" (emulate)" if mode == "emulate" else "")
    run = dict(preset=args.dp_preset, batch=args.dp_batch, parallel=parallel)
    sdp4bit = ZeroConfig(grad_codec="tlq_hs", param_codec="qwd")
    return [
        Case(f"{label} replicated", **run),
        Case(f"{label} zero1 none", sharded=ZeroConfig(), **run),
        Case(f"{label} zero1 sdp4bit", sharded=sdp4bit, **run),
    ]


def pipeline_cases(
    args, n_devices: int, preset: str = "gpt_1p3b", overrides=(), mode: str = "shard_map"
) -> list[Case]:
    """Case 4: the one-device reference, then each schedule (`--schedules`) x M
    (`--microbatches`) x stage codec at pp = n_devices (with mode="emulate", the stages
    emulated on one device). The batch is `--pp-batch`, or with `--pp-rows-per-microbatch R`
    R x M sequences (a reference per batch)."""
    base = ParallelConfig(remat=args.remat, scan_layers=not args.unroll)
    cases, references = [], set()
    for microbatches in args.microbatches:
        rows = args.pp_rows_per_microbatch
        batch = rows * microbatches if rows else args.pp_batch
        run = dict(preset=preset, batch=batch, overrides=overrides)
        if batch not in references:
            references.add(batch)
            tag = f" batch={batch}" if rows else ""
            cases.append(Case(f"{preset} pp-ref{tag} (1 device)", parallel=base, **run))
        for schedule in args.schedules:
            parallel = dataclasses.replace(
                base,
                pp=n_devices,
                microbatches=microbatches,
                schedule=schedule,
                repeats=2 if schedule == "circular" else 1,
                mode=mode,
            )
            label = f"{preset} pp={n_devices} {schedule} M={microbatches}"
            label += " (emulate)" if mode == "emulate" else ""
            cases += [
                Case(f"{label} {codec}", parallel=parallel, stage_codec=codec, **run)
                for codec in args.pp_codecs
            ]
    return cases


def baseline_of(case: Case) -> bool:
    """Whether `case` is its group's baseline: nothing compressed, no ZeRO, one stage."""
    plain = (case.codec, case.stage_codec) == ("none", "none")
    return plain and case.sharded is None and case.parallel.pp == 1


def group_key(case: Case) -> tuple:
    """The cases timed together, interleaved, against one baseline: a pipeline's runs with the
    same batch on one device ("pp-ref"); a dp layout's with its replicated AdamW; a TP layout's
    codecs with its uncompressed step; every other case alone."""
    p = case.parallel
    if p.pp > 1 or "pp-ref" in case.label:
        return ("pp", case.preset, case.batch, case.overrides)
    if p.dp > 1:
        return ("dp", case.preset, case.batch, p.dp, p.mode)
    if p.tp > 1:
        return ("tp", case.preset, case.batch, case.overrides, p)
    return ("one", case.label)


def groups(cases: list[Case]) -> list[list[Case]]:
    """`cases` by `group_key`, in the order of their first case, the baseline first."""
    by_key: dict[tuple, list[Case]] = {}
    for case in cases:
        by_key.setdefault(group_key(case), []).append(case)
    return [sorted(g, key=lambda c: not baseline_of(c)) for g in by_key.values()]


def peak_flops() -> float | None:
    """Dense bf16 peak of one device (`taco_train.metrics.PEAK_FLOPS`), None if unknown."""
    return run_metrics.peak_flops(jax.devices()[0].device_kind)


@dataclasses.dataclass
class Built:
    """A compiled case, ready to step: its state carried from one step to the next."""

    case: Case
    step: object  # () -> (state, metrics)
    info: dict  # compile time, memory
    carry: dict


def build(case: Case) -> Built:
    """Compiles `case`'s training step and places its state and batch."""
    cfg = case.model()
    comm = taco_jax.TPComm.create("tp", fwd=case.codec, impl=case.impl, algorithm=case.algorithm)
    stages = StageCodecs(forward=case.stage_codec)
    optimizer = optax.adamw(1e-4, weight_decay=0.1)
    built = make_steps(cfg, case.parallel, comm, optimizer, stages, sharded=case.sharded)
    state = built.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (case.batch, cfg.seq_len + 1), dtype=np.int32)
    tokens = jax.device_put(tokens, built.batch_sharding)
    start = time.perf_counter()
    compiled = built.train_step.lower(state, tokens).compile()
    info = {"compile_s": time.perf_counter() - start, **_compiled_memory(compiled)}
    carry = {"state": state}

    def step():  # each step trains on from the state the previous one left
        carry["state"], carry["metrics"] = compiled(carry["state"], tokens)
        return carry["state"], carry["metrics"]

    return Built(case, step, info, carry)


def run_group(group: list[Case], args) -> tuple[list[dict], dict | None]:
    """Compiles the group's cases, times them interleaved against the first (the baseline)
    with an A/A control (`timing.compare`), then profiles each with `--profile-steps`; a case
    that fails to build is recorded with its error. (rows, the comparison)."""
    built, rows = [], {}
    for case in group:
        print(f"building {case.label} ...", flush=True)
        try:
            built.append(build(case))
        except Exception as err:  # noqa: BLE001 - record (e.g. OOM) and go on
            traceback.print_exc()
            rows[case.label] = {"label": case.label, "error": f"{type(err).__name__}: {err}"}
    if not built:
        return list(rows.values()), None
    samplers = {b.case.label: timing.wall(b.step) for b in built}
    compare = compare_options(args) | dict(warmup=args.warmup)
    try:
        result = timing.compare(samplers, built[0].case.label, **compare)
    except Exception as err:  # noqa: BLE001 - e.g. out of memory with every case resident
        traceback.print_exc()
        error = f"{type(err).__name__}: {err}"
        return [*rows.values(), *({"label": b.case.label, "error": error} for b in built)], None
    for b in built:
        profile = device_time_by_kernel(b.step, args.profile_steps) if args.profile_steps else None
        row = rows[b.case.label] = row_of(b, result, profile)
        ratio, versus = row["vs_baseline"], ""
        if ratio:
            lo, hi = ratio["interval"]
            versus = f", {ratio['median']:.3f}x [{lo:.3f}, {hi:.3f}] {ratio['verdict']}"
        print(f"  {b.case.label}: {1e3 * row['median_step_s']:.1f} ms{versus}", flush=True)
    return [rows[c.label] for c in group if c.label in rows], result


def row_of(b: Built, result: dict, profile: dict | None) -> dict:
    case, cfg = b.case, b.case.model()
    times = result["times_s"][case.label]
    median = statistics.median(times)
    tokens_per_step = case.batch * cfg.seq_len
    flops_per_step = cfg.flops_per_token() * tokens_per_step
    # shard_map spreads the step over dp x pp x tp devices; vmap emulation runs it all on one.
    devices = case.parallel.num_devices if case.parallel.mode == "shard_map" else 1
    peak = peak_flops() * devices if peak_flops() else None
    summary = result["summary"].get(case.label)
    memory = jax.devices()[0].memory_stats() or {}
    return {
        **b.info,
        "label": case.label,
        "model": dataclasses.asdict(cfg),
        "parallel": dataclasses.asdict(case.parallel),
        "codec": case.codec,
        "stage_codec": case.stage_codec,
        "sharded": dataclasses.asdict(case.sharded) if case.sharded else None,
        "algorithm": case.algorithm,
        "impl": case.impl,
        "batch": case.batch,
        "tokens_per_step": tokens_per_step,
        "num_params": cfg.num_params(),
        "flops_per_token": cfg.flops_per_token(),
        "step_times_s": times,
        "median_step_s": median,
        # baseline step / this step, paired by round: > 1 faster (`taco_jax.timing`)
        "vs_baseline": summary and {"baseline": result["baseline"], **summary},
        "tokens_per_s": tokens_per_step / median,
        "mfu": flops_per_step / median / peak if peak else None,
        "final_loss": float(b.carry["metrics"]["loss"]),
        # The allocator's peak since the process started: an upper bound for this case's.
        "peak_bytes_in_use_so_far": memory.get("peak_bytes_in_use"),
        "device_time": profile,
    }


def _compiled_memory(compiled) -> dict:
    """XLA's static account of the compiled step's device memory (bytes): its temporaries
    (activations and what the backward keeps), arguments and outputs."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports it
        return {}
    fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    return {"memory_analysis": {f: getattr(analysis, f, None) for f in fields}}


def attention_check() -> tuple[str, str]:
    """Runs one small causal bf16 attention the way the model does: (implementation, note)."""
    q = jax.numpy.ones((1, 128, 2, 64), jax.numpy.bfloat16)
    try:
        jax.block_until_ready(jax.jit(layers.attention)(q, q, q))
    except Exception as err:  # noqa: BLE001 - report any failure, then fall back
        return "xla", f"cuDNN attention failed: {type(err).__name__}: {err}"
    return ("cudnn" if layers.uses_cudnn(q) else "xla"), ""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg = p.add_argument
    arg("--smoke", action="store_true", help="tiny preset, 2 rounds (CPU check)")
    arg("--warmup", type=int, default=2, help="untimed rounds of steps")
    timed_script_options(p, budget_s=60.0, max_repeats=20)
    arg("--batch-125m", type=int, default=16)
    arg("--batch-1p3b", type=int, default=8)
    arg("--tp-preset", default="gpt_1p3b", help="model of the real-TP runs")
    arg("--tp-codecs", nargs="*", default=[], help="codecs beside taco in the TP cases")
    arg("--emulate-preset", default="gpt_125m", help="model of the emulated-TP runs")
    arg("--emulate-tp", type=int, default=4, help="TP of the emulated-TP runs")
    arg("--batch-tp", type=int, default=8, help="batch of the emulated-TP runs")
    arg("--emulate-attention", nargs="+", default=["auto"], choices=("auto", "xla", "cudnn"))
    arg("--emulate-algorithms", nargs="+", default=["auto"], choices=EMULATED_ALGORITHMS)
    arg("--pp-preset", default="gpt_1p3b", help="model of the pipelined runs")
    arg("--pp-batch", type=int, default=8, help="batch of the pipelined runs")
    arg("--microbatches", type=int, nargs="+", default=[8], help="of the pipelined runs, each")
    arg("--pp-rows-per-microbatch", type=int, default=0, help="batch R x M, not --pp-batch")
    arg("--schedules", nargs="+", default=["gpipe", "circular"], choices=SCHEDULES)
    arg("--pp-codecs", nargs="+", default=["none", "tahquant", "taco"], help="stage codecs")
    arg("--pp-emulate", type=int, default=0, help="also pp = N emulated on the first device")
    arg("--dp-preset", default="gpt_350m", help="model of the data-parallel runs")
    arg("--dp-batch", type=int, default=8, help="batch of the data-parallel runs")
    arg("--dp-emulate", type=int, default=0, help="also dp = N emulated on the first device")
    arg("--impl", default="auto", help="codec kernels: auto|xla|pallas")
    arg("--remat", action="store_true")
    arg("--unroll", action="store_true", help="unrolled layers instead of scan")
    arg("--profile-steps", type=int, default=0, help="then profile: device time per kernel")
    arg("--only", nargs="+", default=None, help="only the cases whose label holds one of these")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.smoke:
        args.pp_batch, args.microbatches = 4, [2]
        args.warmup, args.min_repeats, args.max_repeats = 1, 2, 2
    attention, attention_note = attention_check()
    cases = [
        c for c in default_cases(args) if not args.only or any(t in c.label for t in args.only)
    ]
    if attention == "xla":  # cuDNN unavailable: every case runs XLA attention
        cases = [
            dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, attention="xla"))
            for c in cases
        ]
    rows, comparisons = [], []
    for group in groups(cases):
        group_rows, result = run_group(group, args)
        rows += group_rows
        if result is not None:
            comparisons.append({"labels": [r["label"] for r in group_rows], **result})
        write_record(  # after each group: a run cut short keeps what it measured
            "train_step",
            args.out,
            suffix=("-smoke" if args.smoke else "") + args.suffix,
            xla_flags=os.environ.get("XLA_FLAGS", ""),
            attention=attention,
            attention_note=attention_note,
            peak_bf16_flops=peak_flops(),
            results=rows,
            comparisons=comparisons,
        )
        jax.clear_caches()
    failed = [r["label"] for r in rows if "error" in r]
    if failed:  # recorded with their errors; the exit status tells a caller (the headline)
        sys.exit(f"{len(failed)} of {len(rows)} cases failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
