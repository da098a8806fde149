"""Training-step speed: step time, tokens/s and MFU of the bf16 GPT, and the cost of TACO in TP.

Cases (`--only TEXT [TEXT ...]` keeps those whose label contains one of them):
  1. Uncompressed bf16 GPT-125M and GPT-1.3B on one device, no TP (`make_steps` with tp = 1):
     step time, tokens/s and MFU = flops_per_token x tokens/s / peak, with flops_per_token
     = 6 N + 12 L H Q T (PaLM appendix B, nanoGPT's `estimate_mfu`; `ModelConfig.flops_per_token`)
     and peak the device's dense bf16 rate (H100 / H200 SXM: 989.4 TFLOP/s).
  2. GPT-125M with TP = 4 emulated on the same device (`jax.vmap(axis_name="tp")`; other
     models and TP with `--emulate-preset`, `--emulate-tp`): the step time with every TP
     collective uncompressed ("none") and compressed ("taco", and each of `--tp-codecs`, with
     each of `--emulate-algorithms`; with `--emulate-attention`, each attention), and the
     ratio; on a GPU with `--impl auto` also "taco" through the XLA reference codec.
  3. With >= 2 devices, GPT-1.3B with real TP over all of them (`shard_map`, NCCL): "none",
     "taco auto" (the defaults: `taco_jax.policy` compresses where it measured a gain on this
     link) and "taco ... forced" (every collective compressed, `min_compress_bytes=0`); the
     same with sequence parallelism ("sp").
  4. With >= 2 devices, GPT-1.3B pipelined over all of them (pp = devices, `--pp-batch` sequences
     in each of `--microbatches` microbatch counts, or `--pp-rows-per-microbatch` sequences per
     microbatch): each of `--schedules` (GPipe, circular with 2 chunks per stage, 1F1B),
     each with stage traffic uncompressed ("none"), "tahquant" and "taco" (`--pp-codecs`)
     (`taco_jax.compressed_ppermute`), and with `--pp-grads CODEC` the stages' sum of the
     pp-replicated gradients compressed too ("grads=CODEC", `StageCodecs.shared_grads`, with
     bf16 and "tahquant" sends); beside them the same batch unpipelined on one device
     ("pp-ref"); with `--pp-emulate N`, pp = N emulated on one device ("(emulate)"). Printed
     and recorded per pipelined row on real devices: its overhead over an even split,
     1 - t_ref / (P t_pp) (the share of the step beyond the one-device step divided over P
     stages: idle steps, smaller microbatches, stage sends, the circular schedule's regroup),
     next to the schedule's bubble (P - 1) / (M V + P - 1). The bubble itself comes from two
     runs at different M (BENCHMARKS.md, "Pipelined step").
  5. With >= 2 devices, data parallelism over all of them (`--dp-preset`, default GPT-350M,
     `--dp-batch` sequences): replicated AdamW (an fp32 all-reduce of the gradients), ZeRO-1
     uncompressed, and ZeRO-1 with SDP4Bit (TLq-HS gradients, qWD weights; `taco_train.zero`),
     the ZeRO-1 rows with their collectives per bucket of leaves (`--dp-bucket-elements`:
     40 M, the default, and 1, "per-leaf"). With `--dp-emulate N`, the same with dp = N
     emulated on one device.
Timing: the cases are timed in groups, each against its baseline (`group_key`: a TP layout's
compressed steps against its uncompressed one, the pipelined ones against the same batch on
one device, ZeRO-1 against replicated AdamW), every case of a group compiled and resident at
once, one step of each per round, interleaved with an A/A control (`timing.compare`: at
least `--min-repeats` rounds, more until the ratios are stable or `--budget-s` is spent). A row
keeps its step times (one per round), their median and `vs_baseline`: baseline step / its
step, paired by round, with its interval and verdict. With `--profile-steps N`, N more steps of
each run under `jax.profiler` and the row gets their GPU kernels' time per kind
(`_common.device_time_by_kernel`). Memory per row: XLA's account of the compiled step
(`memory_analysis`: temporaries, arguments, outputs) and the device's peak bytes in use while
its group ran (an upper bound for its own). Tokens are random (speed does not depend on them).
A case that fails to build (e.g. out of memory) is recorded with its error and the run goes on.
Writes `train_step-<date><suffix>.json` to `--out` after each group and prints a table.

    python -m benchmarks.train_step                       # every case the machine can run
    python -m benchmarks.train_step --only "tp=4 (vmap)"  # the emulated-TP cases only
    python -m benchmarks.train_step --smoke               # CPU check: tiny preset, 2 rounds
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import time
import traceback

import jax
import numpy as np
import optax

import taco_jax
from benchmarks._common import collective_windows, device_time_by_kernel, write_record
from taco_jax import timing
from taco_models import ModelConfig, ParallelConfig, layers
from taco_models.parallel import SCHEDULES
from taco_models.pipeline import StageCodecs
from taco_train import metrics as run_metrics
from taco_train.steps import make_steps
from taco_train.zero import BUCKET_ELEMENTS, ZeroConfig

RESULTS = pathlib.Path(__file__).parent / "results"


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
    min_compress_bytes: int | None = None  # None: taco_jax.policy decides
    stage_codec: str = "none"  # of pipeline stage traffic (parallel.pp > 1)
    shared_grads: str = "none"  # of the pipeline's sum of pp-replicated gradients (StageCodecs)
    sharded: ZeroConfig | None = None  # ZeRO-1 over dp and its codecs (case 5)
    latency_hiding: bool = False  # compile with the latency-hiding option (else XLA's default)

    def model(self) -> ModelConfig:
        return ModelConfig.preset(self.preset, **dict(self.overrides))


def default_cases(args) -> list[Case]:
    remat = args.remat
    one = ParallelConfig(remat=remat, scan_layers=not args.unroll)
    emulated = ParallelConfig(
        tp=args.emulate_tp, mode="vmap", remat=remat, scan_layers=not args.unroll
    )
    if args.smoke:
        tiny = ParallelConfig(tp=2, mode="vmap", scan_layers=not args.unroll)
        return [
            Case("gpt_tiny", "gpt_tiny", 4, one),
            Case("gpt_tiny tp=2 (vmap) none", "gpt_tiny", 4, tiny, "none"),
            Case("gpt_tiny tp=2 (vmap) taco", "gpt_tiny", 4, tiny, "taco", args.impl),
            # pp = 2 on fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2+)
            *(
                pipeline_cases(args, 2, preset="gpt_tiny", overrides=(("n_layers", 4),))
                if jax.device_count() >= 2
                else []
            ),
        ]
    cases = [
        # 16 x 2048 tokens; activations ~20 GB without remat.
        Case("gpt_125m", "gpt_125m", args.batch_125m, one),
        # 8 x 2048 tokens: ~2 MB of saved activations per token without remat (24 layers x
        # ~40 D bytes), ~35 GB, plus 21 GB of fp32 weights, gradients and Adam moments.
        Case("gpt_1p3b", "gpt_1p3b", args.batch_1p3b, one),
        *emulated_tp_cases(args, emulated),
    ]
    n_devices = jax.device_count()
    if n_devices >= 2:
        # Real TP over every GPU of the machine (NCCL), GPT-1.3B: bf16 psum vs compressed.
        real = ParallelConfig(tp=n_devices, remat=remat, scan_layers=not args.unroll)
        label = f"{args.tp_preset} tp={n_devices} (shard_map)"
        run = dict(preset=args.tp_preset, batch=args.batch_1p3b, parallel=real, impl=args.impl)
        cases += [
            Case(f"{label} none", codec="none", **run),
            # The defaults: taco_jax.policy compresses where it measured a gain on this link.
            Case(f"{label} taco auto", codec="taco", **run),
            # Every collective compressed, whatever the link: what the policy chooses against.
            Case(
                f"{label} taco two_shot forced",
                codec="taco",
                algorithm="two_shot",
                min_compress_bytes=0,
                **run,
            ),
        ]
        # Sequence parallelism: the reduce-scatter / all-gather pair instead of all-reduces.
        sp = dataclasses.replace(real, sequence_parallel=True)
        sp_label = f"{args.tp_preset} tp={n_devices} sp (shard_map)"
        sp_run = dict(run, parallel=sp)
        cases += [
            Case(f"{sp_label} none", codec="none", **sp_run),
            Case(f"{sp_label} taco auto", codec="taco", **sp_run),
        ]
        for codec in args.tp_codecs:  # other codecs through the same policy (e.g. sub-byte)
            cases += [
                Case(f"{label} {codec} auto", codec=codec, **run),
                Case(f"{sp_label} {codec} auto", codec=codec, **sp_run),
            ]
        if n_devices == 2:  # where one-shot sends the bytes of two-shot
            cases += [
                Case(
                    f"{label} taco {algorithm} forced",
                    codec="taco",
                    algorithm=algorithm,
                    min_compress_bytes=0,
                    **run,
                )
                for algorithm in ("one_shot", "fused")
            ]
            # The other codecs one-shot too, so that a variant cannot switch algorithms.
            cases += [
                Case(
                    f"{label} {codec} one_shot forced",
                    codec=codec,
                    algorithm="one_shot",
                    min_compress_bytes=0,
                    **run,
                )
                for codec in args.tp_codecs
                if codec != "taco"
            ]
    if n_devices >= 2:
        cases += pipeline_cases(args, n_devices, args.pp_preset)  # case 4
        cases += data_parallel_cases(args, n_devices)  # case 5
    if args.dp_emulate:
        cases += data_parallel_cases(args, args.dp_emulate, mode="emulate")
    if args.pp_emulate:
        emulated_pp = pipeline_cases(args, args.pp_emulate, args.pp_preset, mode="emulate")
        cases += [c for c in emulated_pp if n_devices < 2 or "pp-ref" not in c.label]
    if args.impl == "auto" and jax.default_backend() == "gpu":
        # The XLA (pure jnp) codec next to the Pallas kernels that "auto" picks on a GPU.
        label = f"{args.emulate_preset} tp={args.emulate_tp} (vmap) taco xla"
        cases.append(Case(label, args.emulate_preset, args.batch_tp, emulated, "taco", "xla"))
    return cases


def emulated_tp_cases(args, emulated: ParallelConfig) -> list[Case]:
    """Case 2: `--emulate-preset` with TP = `--emulate-tp` under vmap, uncompressed, then `taco`
    and each of `--tp-codecs` with each of `--emulate-algorithms` (all-reduces only; "auto"
    runs two-shot where no bytes move, `taco_jax.policy`)."""
    cases = []
    for attention in args.emulate_attention:
        label = f"{args.emulate_preset} tp={args.emulate_tp} (vmap)"
        label += "" if attention == "auto" else f" attention={attention}"
        parallel = dataclasses.replace(emulated, attention=attention)
        run = dict(preset=args.emulate_preset, batch=args.batch_tp, parallel=parallel)
        cases.append(Case(f"{label} none", codec="none", **run))
        for codec in ("taco", *(c for c in args.tp_codecs if c != "taco")):
            for algorithm in args.emulate_algorithms:
                tag = "" if algorithm == "auto" else f" {algorithm}"
                cases.append(
                    Case(
                        f"{label} {codec}{tag}",
                        codec=codec,
                        impl=args.impl,
                        algorithm=algorithm,
                        **run,
                    )
                )
    return cases


PIPELINE_CODECS = ("none", "tahquant", "taco")


def data_parallel_cases(args, n_devices: int, mode: str = "shard_map") -> list[Case]:
    """Case 5: dp = n_devices (emulated on one device with mode="emulate"), replicated AdamW,
    then ZeRO-1 without and with SDP4Bit, each with its collectives in buckets of each of
    `--dp-bucket-elements` (default: 40 M, the library's default, and 1, a bucket per leaf)."""
    parallel = ParallelConfig(
        dp=n_devices, remat=args.remat, scan_layers=not args.unroll, mode=mode
    )
    label = f"{args.dp_preset} dp={n_devices}" + (" (emulate)" if mode == "emulate" else "")
    run = dict(preset=args.dp_preset, batch=args.dp_batch, parallel=parallel)
    cases = [Case(f"{label} replicated", **run)]
    for name, codecs in (("none", {}), ("sdp4bit", dict(grad_codec="tlq_hs", param_codec="qwd"))):
        for limit in args.dp_bucket_elements:
            suffix = " per-leaf" if limit == 1 else f" buckets={limit / 1e6:g}M"
            sharded = ZeroConfig(**codecs, bucket_elements=limit)
            cases.append(Case(f"{label} zero1 {name}{suffix}", sharded=sharded, **run))
    return cases


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
        batch = (
            args.pp_rows_per_microbatch * microbatches
            if args.pp_rows_per_microbatch
            else (args.pp_batch)
        )
        run = dict(preset=preset, batch=batch, overrides=overrides)
        if batch not in references:
            references.add(batch)
            tag = f" batch={batch}" if args.pp_rows_per_microbatch else ""
            cases.append(Case(f"{preset} pp-ref{tag} (1 device)", parallel=base, **run))
        for schedule in args.schedules:
            repeats = 2 if schedule == "circular" else 1
            parallel = dataclasses.replace(
                base,
                pp=n_devices,
                microbatches=microbatches,
                schedule=schedule,
                repeats=repeats,
                mode=mode,
            )
            label = f"{preset} pp={n_devices} {schedule} M={microbatches}"
            label += " (emulate)" if mode == "emulate" else ""
            cases += [
                Case(f"{label} {codec}", parallel=parallel, stage_codec=codec, **run)
                for codec in args.pp_codecs
            ]
            # The stages' shared-gradient sum compressed too (0.4 GB of fp32 for GPT-1.3B's
            # tied embedding), without and with compressed sends.
            cases += [
                Case(
                    f"{label} {codec} grads={grads}",
                    parallel=parallel,
                    stage_codec=codec,
                    shared_grads=grads,
                    **run,
                )
                for grads in args.pp_grads
                for codec in ("none", "tahquant")
            ]
    return cases


def baseline_of(case: Case) -> bool:
    """Whether `case` is its group's baseline: nothing compressed, no ZeRO, one stage."""
    plain = (case.codec, case.stage_codec, case.shared_grads) == ("none", "none", "none")
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
        return ("tp", case.preset, case.batch, case.overrides, p, case.latency_hiding)
    return ("one", case.label)


def groups(cases: list[Case]) -> list[list[Case]]:
    """`cases` by `group_key`, in the order of their first case, the baseline first."""
    by_key: dict[tuple, list[Case]] = {}
    for case in cases:
        by_key.setdefault(group_key(case), []).append(case)
    return [sorted(g, key=lambda c: not baseline_of(c)) for g in by_key.values()]


def vs_baseline(rows: list[dict]) -> dict[str, dict]:
    """Per row with a baseline: baseline step / its step (median of the paired rounds, the
    interval and verdict, `taco_jax.timing`)."""
    return {r["label"]: r["vs_baseline"] for r in rows if r.get("vs_baseline")}


def split_overheads(rows: list[dict]) -> dict[str, dict]:
    """Per pipelined row on real devices: 1 - t_ref / (P t_pp) beside the schedule's bubble
    (P - 1) / (M V + P - 1), t_ref / t_pp the paired median."""
    out = {}
    for r in rows:
        if "error" in r or r["parallel"]["pp"] == 1 or r["parallel"]["mode"] == "emulate":
            continue  # emulated: every stage on one device, no split to judge
        if not r.get("vs_baseline"):
            continue
        parallel = ParallelConfig(**r["parallel"])
        measured = 1 - r["vs_baseline"]["median"] / parallel.pp
        out[r["label"]] = {"over_even_split": measured, "schedule_bubble": parallel.bubble_fraction}
    return out


def emulated_over_bubble(rows: list[dict]) -> dict[str, dict]:
    """Per emulated pipelined row: its step over the one-device step of the same batch, times
    1 - bubble (median and interval of the paired rounds). Emulated, every stage runs on one
    device, the bubble steps too, so a schedule that costs only its bubble gives 1."""
    out = {}
    for r in rows:
        if "error" in r or r["parallel"]["mode"] != "emulate" or not r.get("vs_baseline"):
            continue
        keep = 1 - ParallelConfig(**r["parallel"]).bubble_fraction
        ratio = r["vs_baseline"]  # t_ref / t_pp
        lo, hi = ratio["interval"]
        out[r["label"]] = {"median": keep / ratio["median"], "interval": [keep / hi, keep / lo]}
    return out


def pipeline_memory(rows: list[dict]) -> dict[str, dict]:
    """Per pipelined or reference row: XLA's temporaries of the compiled step and the device's
    peak bytes in use while its group ran (an upper bound for the row's own), in GiB."""
    gib = lambda b: None if b is None else round(b / 2**30, 2)  # noqa: E731
    out = {}
    for r in rows:
        if "error" in r or (r["parallel"]["pp"] == 1 and "pp-ref" not in r["label"]):
            continue
        temp = (r.get("memory_analysis") or {}).get("temp_size_in_bytes")
        out[r["label"]] = {"peak_gib": gib(r["peak_bytes_in_use_so_far"]), "temp_gib": gib(temp)}
    return out


def peak_flops() -> float | None:
    """Dense bf16 peak of one device (`taco_train.metrics.PEAK_FLOPS`), None if unknown."""
    return run_metrics.peak_flops(jax.devices()[0].device_kind)


@dataclasses.dataclass
class Built:
    """A compiled case, ready to step: its state carried from one step to the next."""

    case: Case
    step: object  # () -> (state, metrics)
    info: dict  # compile time, memory, collective windows
    carry: dict


def build(case: Case) -> Built:
    """Compiles `case`'s training step and places its state and batch."""
    cfg = case.model()
    comm = taco_jax.TPComm.create(
        "tp",
        fwd=case.codec,
        impl=case.impl,
        algorithm=case.algorithm,
        min_compress_bytes=case.min_compress_bytes,
    )
    stages = StageCodecs(forward=case.stage_codec, shared_grads=case.shared_grads)
    optimizer = optax.adamw(1e-4, weight_decay=0.1)
    built = make_steps(cfg, case.parallel, comm, optimizer, stages, sharded=case.sharded)
    state = built.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (case.batch, cfg.seq_len + 1), dtype=np.int32)
    tokens = jax.device_put(tokens, built.batch_sharding)
    start = time.perf_counter()
    options = {"xla_gpu_enable_latency_hiding_scheduler": True} if case.latency_hiding else {}
    compiled = built.train_step.lower(state, tokens).compile(compiler_options=options)
    info = {
        "compile_s": time.perf_counter() - start,
        "compiler_options": options,
        **_compiled_memory(compiled),
        "collective_windows": collective_windows(compiled.as_text()),
    }
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
    baseline = built[0].case.label
    try:
        result = timing.compare(
            samplers,
            baseline,
            warmup=args.warmup,
            budget_s=args.budget_s,
            min_repeats=args.min_repeats,
            max_repeats=args.max_repeats,
            deadline=args.deadline,
        )
    except Exception as err:  # noqa: BLE001 - e.g. out of memory with every case resident
        traceback.print_exc()
        error = f"{type(err).__name__}: {err}"
        return [*rows.values(), *({"label": b.case.label, "error": error} for b in built)], None
    for b in built:
        profile = device_time_by_kernel(b.step, args.profile_steps) if args.profile_steps else None
        rows[b.case.label] = row_of(b, result, profile)
        print(f"  {b.case.label}: {1e3 * rows[b.case.label]['median_step_s']:.1f} ms", flush=True)
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
    memory = jax.devices()[0].memory_stats() or {}
    summary = result["summary"].get(case.label)
    return {
        **b.info,
        "label": case.label,
        "model": dataclasses.asdict(cfg),
        "parallel": dataclasses.asdict(case.parallel),
        "codec": case.codec,
        "stage_codec": case.stage_codec,
        "shared_grads": case.shared_grads,
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
        "model_tflops_per_s": flops_per_step / median / 1e12,
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
    fields = (
        "temp_size_in_bytes",
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
    )
    return {"memory_analysis": {f: getattr(analysis, f, None) for f in fields}}


def attention_check() -> tuple[str, str]:
    """Runs one small causal bf16 attention the way the model does: (implementation, note)."""
    q = jax.numpy.ones((1, 128, 2, 64), jax.numpy.bfloat16)
    try:
        jax.block_until_ready(jax.jit(layers.attention)(q, q, q))
    except Exception as err:  # noqa: BLE001 - report any failure, then fall back
        return "xla", f"cuDNN attention failed: {type(err).__name__}: {err}"
    return ("cudnn" if layers.uses_cudnn(q) else "xla"), ""


def table(rows: list[dict]) -> str:
    lines = [
        "| config | batch x T | median step (ms) | vs baseline | tokens/s | MFU | compile (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | - | error: {r['error'].splitlines()[0][:80]} | | | | |")
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        v = r.get("vs_baseline")
        versus = (
            "-"
            if not v
            else (
                f"{v['median']:.3f}x [{v['interval'][0]:.3f}, "
                f"{v['interval'][1]:.3f}] {v['verdict']}"
            )
        )
        lines.append(
            f"| {r['label']} | {r['batch']} x {r['model']['seq_len']} | "
            f"{1e3 * r['median_step_s']:.1f} | {versus} | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{r['compile_s']:.1f} |"
        )
    return "\n".join(lines)


def overlap_variants(cases: list[Case], args) -> list[Case]:
    """Each real-TP case once per (latency-hiding option, overlap_chunks) asked for, labelled
    with them ("lhs", "chunks=K") where they differ from the defaults."""
    hiding = {"off": (False,), "on": (True,), "both": (False, True)}[args.latency_hiding]
    out = []
    for case in cases:
        p = case.parallel
        if p.mode != "shard_map" or p.tp == 1 or p.pp > 1:
            out.append(case)
            continue
        for lhs in hiding:
            for chunks in args.overlap_chunks:
                tags = (" lhs" if lhs else "") + (f" chunks={chunks}" if chunks > 1 else "")
                parallel = dataclasses.replace(p, overlap_chunks=chunks)
                out.append(
                    dataclasses.replace(
                        case, label=case.label + tags, parallel=parallel, latency_hiding=lhs
                    )
                )
    return out


def save(rows: list[dict], comparisons: list[dict], args, attention: str, note: str) -> None:
    """Writes the record of the rows so far (again after each group, so that a run cut short
    by a time limit keeps what it measured)."""
    write_record(
        "train_step",
        args.out,
        suffix=("-smoke" if args.smoke else "") + args.suffix,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        attention=attention,
        attention_note=note,
        peak_bf16_flops=peak_flops(),
        flops_formula="6 N + 12 L H Q T per token (PaLM app. B; N = matmul parameters)",
        timing="interleaved rounds with an A/A control per group (benchmarks/timing.py)",
        results=rows,
        comparisons=comparisons,
        vs_baseline=vs_baseline(rows),
        pipeline_over_even_split=split_overheads(rows),
        pipeline_memory=pipeline_memory(rows),
        emulated_pipeline_over_bubble=emulated_over_bubble(rows),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny preset, 2 rounds (CPU check)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds of steps")
    parser.add_argument("--budget-s", type=float, default=60.0, help="timing budget a group")
    parser.add_argument(
        "--min-repeats",
        type=int,
        default=timing.MIN_REPEATS,
        help="rounds of steps a group, at least",
    )
    parser.add_argument("--max-repeats", type=int, default=20, help="rounds a group, at most")
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="time.time() after which groups stop at their minimum rounds",
    )
    parser.add_argument("--tp-preset", default="gpt_1p3b", help="model of the real-TP runs")
    parser.add_argument("--batch-125m", type=int, default=16)
    parser.add_argument("--batch-1p3b", type=int, default=8)
    parser.add_argument("--batch-tp", type=int, default=8, help="batch of the emulated-TP runs")
    parser.add_argument("--emulate-tp", type=int, default=4, help="TP of the emulated-TP runs")
    parser.add_argument("--emulate-preset", default="gpt_125m", help="emulated-TP runs' model")
    parser.add_argument(
        "--emulate-attention",
        nargs="+",
        default=["auto"],
        choices=("auto", "xla", "cudnn"),
        help="emulated-TP runs' ParallelConfig.attention",
    )
    parser.add_argument(
        "--emulate-algorithms",
        nargs="+",
        default=["auto"],
        choices=("auto", "one_shot", "two_shot"),
        help="all-reduce algorithms of the compressed emulated-TP runs (auto: two-shot under vmap)",
    )
    parser.add_argument("--pp-batch", type=int, default=8, help="batch of the pipelined runs")
    parser.add_argument("--pp-preset", default="gpt_1p3b", help="model of the pipelined runs")
    parser.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        default=[8],
        help="of the pipelined runs (each value its own rows)",
    )
    parser.add_argument(
        "--pp-rows-per-microbatch",
        type=int,
        default=0,
        help="pipelined runs of this many sequences per microbatch (batch R x M, "
        "a reference per batch) instead of --pp-batch",
    )
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["gpipe", "circular"],
        choices=SCHEDULES,
        help="of the pipelined runs (circular: 2 chunks)",
    )
    parser.add_argument(
        "--pp-codecs",
        nargs="+",
        default=list(PIPELINE_CODECS),
        help="stage codecs of the pipelined runs",
    )
    parser.add_argument(
        "--pp-grads",
        nargs="*",
        default=[],
        help="pipelined cases with the shared-gradient sum compressed by these "
        "TP codecs (compression.pp_grads), with the collective's defaults "
        "(the policy, on the link NCCL's switches name)",
    )
    parser.add_argument("--dp-preset", default="gpt_350m", help="model of the data-parallel runs")
    parser.add_argument("--dp-batch", type=int, default=8, help="batch of the data-parallel runs")
    parser.add_argument(
        "--pp-emulate", type=int, default=0, help="also case 4, pp = N emulated on the first device"
    )
    parser.add_argument(
        "--dp-emulate", type=int, default=0, help="also case 5, dp = N emulated on the first device"
    )
    parser.add_argument(
        "--dp-bucket-elements",
        type=int,
        nargs="+",
        default=[BUCKET_ELEMENTS, 1],
        help="ZeRO-1 rows with these bucket sizes (1: per leaf)",
    )
    parser.add_argument("--suffix", default="", help="appended to the record's file name")
    parser.add_argument(
        "--tp-codecs",
        nargs="*",
        default=[],
        help="codecs beside taco in the real- and emulated-TP cases",
    )
    parser.add_argument("--impl", default="auto", help="codec kernels for taco: auto|xla|pallas")
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--unroll", action="store_true", help="unrolled layers instead of scan")
    parser.add_argument(
        "--latency-hiding",
        choices=("off", "on", "both"),
        default="off",
        help="real-TP cases compiled with the latency-hiding scheduler "
        "option set (off: no option passed, XLA's default)",
    )
    parser.add_argument(
        "--overlap-chunks",
        type=int,
        nargs="+",
        default=[1],
        help="real-TP cases with these ParallelConfig.overlap_chunks",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after timing, profile this many steps: device time per kind of "
        "kernel (_common.device_time_by_kernel)",
    )
    parser.add_argument(
        "--only", nargs="+", default=None, help="run only configs whose label contains one of these"
    )
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS))
    args = parser.parse_args(argv)
    if args.smoke:
        args.pp_batch, args.microbatches = 4, [2]
        args.warmup, args.min_repeats, args.max_repeats = 1, 2, 2
    attention, attention_note = attention_check()
    cases = [
        c
        for c in overlap_variants(default_cases(args), args)
        if not args.only or any(text in c.label for text in args.only)
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
        save(rows, comparisons, args, attention, attention_note)
        jax.clear_caches()
    device = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    print(f"\n{device}, jax {jax.__version__}, attention: {attention}\n")
    print(table(rows))
    for label, memory in pipeline_memory(rows).items():
        print(f"{label}: peak {memory['peak_gib']} GiB, XLA temporaries {memory['temp_gib']} GiB")
    for label, ratio in emulated_over_bubble(rows).items():
        print(f"{label}: {ratio['median']:.3f} x the reference step / (1 - bubble)")
    for label, bubble in split_overheads(rows).items():
        print(
            f"{label}: {bubble['over_even_split']:.3f} over an even split "
            f"(schedule bubble {bubble['schedule_bubble']:.3f})"
        )


if __name__ == "__main__":
    main()
