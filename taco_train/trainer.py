"""The training loop: data, optimizer, `taco_train.steps.make_steps`, eval, checkpoints, metrics.

`train_and_evaluate(cfg)` is the whole run. It starts from `cfg.init_from`'s Hugging Face
checkpoint (`taco_models.hf`) or from a random initialization, and resumes from the newest good
checkpoint in `cfg.run.out_dir` when there is one; because the batch of step k is a pure function of
(data seed, k) and the state is restored bit for bit, a resumed run reproduces the uninterrupted
run exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

import taco_jax
from taco_jax import telemetry
from taco_models.parallel import (
    PP_AXIS,
    ParallelConfig,
    check_devices,
    make_mesh,
    weight_decay_mask,
)
from taco_train import comm_error, data, metrics, optim, tuning
from taco_train.checkpointing import (
    Checkpointer,
    abstract_state,
    from_process_0,
    saved_steps,
    set_aside,
)
from taco_train.config import ConfigError, TrainConfig, resolve_model
from taco_train.steps import make_steps, state_split
from taco_train.stopping import Stopped, StopRequests


def maybe_initialize_distributed(mode: str) -> None:
    """`jax.distributed.initialize` for multi-process runs (before any other JAX call).

    "auto": only when `JAX_COORDINATOR_ADDRESS` is set, with `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID` from the environment; "on": let JAX auto-detect the cluster (SLURM, Open MPI,
    ...); "off": never.
    """
    if not spans_processes(mode):
        return
    if mode == "auto":
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()


def spans_processes(mode: str) -> bool:
    """Whether `run.distributed=mode` makes the run one of several processes."""
    return mode == "on" or (mode == "auto" and "JAX_COORDINATOR_ADDRESS" in os.environ)


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


class _Run:
    """The per-run pieces the loop needs, built once."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.out = Path(cfg.run.out_dir)
        tokenizer_file = None
        if cfg.data.tokenizer == "hf":
            tokenizer_file = Path(cfg.init_from) / "tokenizer.json"
        try:
            self.dataset = data.prepare_dataset(
                cfg.data.corpus,
                tokenizer=cfg.data.tokenizer,
                vocab_size=cfg.model.vocab_size,
                val_fraction=cfg.data.val_fraction,
                seed=cfg.data.seed,
                cache_dir=cfg.data.cache_dir,
                tokenizer_file=tokenizer_file,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from error
        b, t = cfg.data.batch_size, cfg.model.seq_len
        seed = cfg.data.seed
        self.train_batches = data.Batches(self.dataset.train, b, t, seed, "training split")
        self.val_batches = data.Batches(self.dataset.val, b, t, seed, "validation split")
        self.schedule = optim.lr_schedule(cfg.optimizer, cfg.run.steps)
        self.links = resolve_links(cfg)
        self.prediction = None  # the step's predicted collective time (`taco_train.tuning`)
        self.over_budget: dict[str, list[int]] = {}  # the error budget's `comm_error.tally`
        self.build({})
        self.n_devices = self.steps.mesh.devices.size
        device_kind = self.steps.mesh.devices.flat[0].device_kind
        self.peak = metrics.peak_flops(device_kind, cfg.run.peak_tflops)
        self.tokens_per_step = b * t

    def build(self, fallbacks: dict[str, str]) -> None:
        """The run's jitted steps with the error budget's `fallbacks` ({call site: codec}), and
        the measuring step beside the train step where `run.comm_error_every` asks for one."""
        self.fallbacks = dict(fallbacks)
        self.steps = build_steps(self.cfg, self.fallbacks, links=self.links)
        self.measure_step = None
        if self.cfg.run.comm_error_every:
            measuring = build_steps(self.cfg, self.fallbacks, measure=True, links=self.links)
            self.measure_step = measuring.train_step

    def compile_ahead(self, state) -> None:
        """Compiles the train step and, where there is one, the measuring step for `state`, so
        that neither compiles (or runs out of memory compiling) hours into the run, and the
        evaluation and the finite check before each save (else compiled in the first save's
        pause); where the measuring step (its exact fp32 collectives) needs more device memory
        than the train step, says so in one line. The calls then reuse these programs."""
        rows = self.train_batches.train(0)
        batch = jax.ShapeDtypeStruct(rows.shape, rows.dtype, sharding=self.steps.batch_sharding)
        train = self.steps.train_step.lower(state, batch).compile()
        self.steps.eval_step.lower(state, batch).compile()
        self.steps.is_finite.lower(state).compile()
        if self.measure_step is None:
            return
        measuring = self.measure_step.lower(state, batch).compile()
        more = _device_bytes(measuring) - _device_bytes(train)
        if more > 0:
            _say(
                f"the measuring step (run.comm_error_every={self.cfg.run.comm_error_every}) needs "
                f"{_size(more)} more device memory than the train step "
                f"({_size(_device_bytes(measuring))} per device): its exact fp32 collectives"
            )

    def measures(self, step: int) -> bool:
        """Whether (1-based) `step` is a measuring step."""
        every = self.cfg.run.comm_error_every
        return every > 0 and step % every == 0

    def global_batch(self, rows: np.ndarray) -> jax.Array:
        """The global [B, T + 1] batch as one array laid out by `batch_sharding`. Every process
        draws all the rows (a function of the step); each of its devices takes the rows it
        holds, whatever the layout: split over dp, the same on every pipeline stage, also
        where the stages are different processes."""
        return jax.make_array_from_callback(
            rows.shape, self.steps.batch_sharding, lambda index: rows[index]
        )

    def evaluate(self, state) -> float:
        n = self.cfg.run.eval_batches
        losses = [
            self.steps.eval_step(state, self.global_batch(self.val_batches.eval(i, n)))["loss"]
            for i in range(n)
        ]
        return float(np.mean(jax.device_get(losses)))


def _device_bytes(compiled) -> int:
    """The device memory a compiled program holds while it runs, per device, from XLA's memory
    analysis: its arguments, outputs not aliased to them, and temporaries (0 where the backend
    gives no analysis)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return 0
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def _size(nbytes: int) -> str:
    """`nbytes` in the largest binary unit that keeps a whole part: "5.9 MiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} bytes"


def _fresh_state(run: _Run, key: jax.Array):
    """Step 0: the parameters of `init_from`, each device reading its own slices, or random."""
    cfg = run.cfg
    if cfg.init_from is None:
        return run.steps.init(key)
    from taco_models import hf

    _say(f"starting from the Hugging Face checkpoint {cfg.init_from}")
    try:
        shardings = run.steps.state_sharding.params
        _, params = hf.load(cfg.init_from, shardings=shardings, seq_len=cfg.model.seq_len)
    except hf.CheckpointError as error:
        raise ConfigError(f"model.init_from={cfg.init_from!r}: {error}") from None
    return run.steps.start(params)


def resolve_links(cfg: TrainConfig) -> dict[str, taco_jax.policy.Link]:
    """{"link" / "pp_link": the link of the TP groups / pipeline stages} where the config leaves
    it at "auto" and that axis spans real devices: from the devices of the run's mesh
    (`taco_jax.policy.mesh_link`: their hosts, NVML). config.json keeps "auto"."""
    p, comp = cfg.parallel, cfg.compression
    if p.mode != "shard_map":
        return {}
    axes = {"link": ("tp", p.tp)}
    if comp.pp_grads != "none":  # the one collective that reads pp_link
        axes["pp_link"] = (PP_AXIS, p.pp)
    wanted = {
        key: axis for key, (axis, size) in axes.items() if getattr(comp, key) == "auto" and size > 1
    }
    if not wanted:
        return {}
    mesh = make_mesh(p)
    return {key: taco_jax.policy.mesh_link(mesh, axis) for key, axis in wanted.items()}


def _say_reference_ops() -> None:
    """One line naming every codec op of the compiled steps that runs the jnp reference where
    the fused kernels were asked for (`taco_jax.reference_ops`), and why: not only a warning."""
    slow = taco_jax.reference_ops()
    if slow:
        ops = "; ".join(f"{call}: {why}" for call, why in slow.items())
        _say(f"on the jnp reference, far slower than the fused kernels: {ops}")


def _say_links(links: dict[str, taco_jax.policy.Link]) -> None:
    """One line per link "auto" resolved: which, and why."""
    for key, link in links.items():
        advice = f" (set compression.{key} to choose it)" if link.assumed else ""
        _say(f"compression.{key}=auto -> {link.name}: {link.why}{advice}")


def build_steps(
    cfg: TrainConfig,
    fallbacks: dict[str, str] | None = None,
    measure: bool = False,
    links: dict[str, taco_jax.policy.Link] | None = None,
):
    """The jitted steps of the run `cfg` (`taco_train.steps.make_steps`), the call sites of
    `fallbacks` on their fallback codecs; `measure`: with the collectives' measurement on
    (`taco_jax.telemetry`), for the measuring steps (`taco_train.comm_error`); the `links` of
    `resolve_links` in place of "auto"."""
    if links:
        resolved = {key: link.name for key, link in links.items()}
        cfg = dataclasses.replace(cfg, compression=dataclasses.replace(cfg.compression, **resolved))
    mask = weight_decay_mask(cfg.model)
    comp, sites = cfg.compression, {"measure": measure, "fallbacks": fallbacks}
    sharded = None
    if cfg.optimizer.sharded:  # ZeRO-1: the sharded step clips over its shards itself
        sharded = comp.zero_config(
            cfg.optimizer.grad_clip, cfg.parallel.dp_axis, cfg.optimizer.bucket_elements, **sites
        )
    make_optimizer = optim.make_adamw if sharded else optim.make_optimizer
    optimizer = make_optimizer(cfg.optimizer, cfg.run.steps, mask)
    return make_steps(
        cfg.model,
        cfg.parallel,
        comp.make_comm(**sites),
        optimizer,
        comp.stage_codecs(**sites),
        cfg.run.seed,
        sharded,
    )


def _init_or_restore(run: _Run, ckpt: Checkpointer):
    """The newest good checkpoint's state and step, or a fresh state at step 0; a restored
    run takes up the error budget's fallbacks saved with its checkpoint while the compression
    settings that chose them hold (`comm_error.resumed_fallbacks`)."""
    key = jax.random.key(run.cfg.run.seed)
    if not run.cfg.run.resume or not from_process_0(ckpt.steps()):
        return _fresh_state(run, key), 0
    target = abstract_state(run.steps.init, run.steps.state_sharding, key)
    restored = ckpt.restore_newest_good(target)
    if restored is None:
        raise ConfigError(
            f"no checkpoint in {ckpt.directory} is usable (each was set aside, see above); set "
            "run.resume=false to start over (the earlier run is archived first), or use another "
            "run.out_dir"
        )
    state, step = restored
    _say(f"resuming from {ckpt.directory} at step {step}")
    cfg = run.cfg
    saved = ckpt.metadata(step)
    fallbacks, said = comm_error.resumed_fallbacks(saved, cfg.compression, cfg.run.reset_fallbacks)
    run.over_budget = comm_error.resumed_streaks(saved, cfg.compression, cfg.run.reset_fallbacks)
    if said:
        _say(said)
    if fallbacks:
        run.build(fallbacks)
    return state, step


def _config_json(cfg: TrainConfig) -> dict[str, Any]:
    return json.loads(json.dumps(cfg.to_dict(), default=str))


# What a resumed run must share with the run that wrote the checkpoints (prefixes of
# "section.key"): the model, the data and its order, the seed, and the optimizer state's form.
# Settings that change only the math of later steps may change, and are recorded
# (`RECORDED_KEYS`); layout, logging and where the data cache lives change silently
# (checkpoints are portable across TP sizes; the sharded optimizer's are not, see
# `check_resumable`).
RESUME_KEYS = ("model.", "data.", "run.seed", "optimizer.sharded")
RESUME_EXEMPT = ("data.cache_dir",)
RECORDED_KEYS = ("run.steps", "optimizer.", "compression.", "parallel.")
HISTORY = "config_history.jsonl"


def _flat(tree: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, section in tree.items() for k, v in section.items()}


def check_resumable(cfg: TrainConfig, out: Path) -> dict[str, tuple[Any, Any]]:
    """Refuses, before anything is overwritten, to resume a run directory whose saved config
    differs from `cfg` in `RESUME_KEYS`; the message names the keys and the ways out. Returns
    the changes of `RECORDED_KEYS` as {key: (old, new)}, which `record_changes` reports. A
    directory without a checkpoint holds nothing to resume (a start that failed before its
    first one): its config.json is simply replaced."""
    saved_path = out / "config.json"
    if not cfg.run.resume or not saved_path.exists() or not holds_checkpoints(out):
        return {}
    old, new = _flat(json.loads(saved_path.read_text())), _flat(_config_json(cfg))
    changed = [k for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    differing = [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in changed
        if key.startswith(RESUME_KEYS) and key not in RESUME_EXEMPT
    ]
    if cfg.optimizer.sharded and _shard_layout(old) != _shard_layout(new):
        differing.append(
            f"(dp, pp, tp) slices {_shard_layout(old)} -> {_shard_layout(new)} "
            "(optimizer.sharded splits the state over them)"
        )
    if differing:
        raise ConfigError(
            f"{out} holds a run with another configuration ({'; '.join(differing)}); use another "
            "run.out_dir, or set run.resume=false to start over in this one"
        )
    return {k: (old.get(k), new.get(k)) for k in changed if k.startswith(RECORDED_KEYS)}


def holds_checkpoints(out: Path) -> bool:
    """Whether `out/checkpoints` holds a step directory, good or not (what a resume reads)."""
    checkpoints = out / "checkpoints"
    return checkpoints.is_dir() and any(p.name[:1].isdigit() for p in checkpoints.iterdir())


def record_changes(changes: dict[str, tuple[Any, Any]], step: int, out: Path) -> None:
    """Says each change of a resumed run in one line and appends them, with the step after
    which they apply, to `out/config_history.jsonl` (config.json then holds the new values)."""
    if not changes or step == 0 or jax.process_index() != 0:
        return  # from step 0 the new values are simply the run's configuration
    for key, (old, new) in changes.items():
        _say(f"from step {step + 1}: {key} {old!r} -> {new!r}")
    entry = {
        "after_step": step,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "changes": {key: {"old": old, "new": new} for key, (old, new) in changes.items()},
    }
    with open(out / HISTORY, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _shard_layout(flat_config: dict[str, Any]) -> tuple[int, int, int]:
    """`steps.state_split` of a flattened config's parallel section."""
    fields = {
        k.removeprefix("parallel."): v for k, v in flat_config.items() if k.startswith("parallel.")
    }
    return state_split(ParallelConfig(**fields))


# The run's tokenizer (`data.Tokenizer.save`), beside its config: what export and sample read.
TOKENIZER_FILE = "tokenizer.json"
# What a run writes into run.out_dir (docs/training.md, "Outputs"): what `run.resume=false`
# moves into the archive, so that the new run neither resumes nor mixes with the old one.
RUN_OUTPUTS = (
    "config.json",
    "config_history.jsonl",
    "metrics.jsonl",
    "metrics.after-step-*.jsonl",  # a resume's records of later steps (`metrics.MetricsWriter`)
    "loss.png",
    "checkpoints",
    "tensorboard",
    "comm_error.png",
    "profile",
    "collectives_policy.txt",
    TOKENIZER_FILE,
)


def archive_previous_run(out: Path) -> Path | None:
    """Moves the outputs of an earlier run in `out` (`RUN_OUTPUTS`, names or patterns) into
    `out/archive/<UTC time>/`; returns that folder, or None when there was nothing to move."""
    present = [path for name in RUN_OUTPUTS for path in sorted(out.glob(name))]
    if not present:
        return None
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    target, n = out / "archive" / stamp, 1
    while target.exists():  # two starts over within one second
        target, n = out / "archive" / f"{stamp}-{n}", n + 1
    target.mkdir(parents=True)
    for path in present:
        path.rename(target / path.name)
    return target


# What orbax names a step directory while it writes it (`<step>.orbax-checkpoint-tmp...`).
UNFINISHED_SAVE = "*.orbax-checkpoint-tmp*"


def remove_unfinished_saves(checkpoints: Path) -> None:
    """Removes the step directories a save left unfinished (the process ended while orbax wrote
    them: never a checkpoint), saying so in one line each; orbax would otherwise warn about
    each when it saves that step again."""
    if jax.process_index() == 0 and checkpoints.is_dir():
        for path in sorted(checkpoints.glob(UNFINISHED_SAVE)):
            shutil.rmtree(path)
            step = path.name.partition(".")[0]
            _say(
                f"removed {path}: the save of step {step} that the earlier run did not finish "
                "(it ended while writing it)"
            )
    if jax.process_count() > 1:  # nobody saves before it is gone
        multihost_utils.sync_global_devices("unfinished saves removed")


def _start_over(cfg: TrainConfig, out: Path) -> None:
    """Where this run starts from step 0 in a directory holding an earlier one, the earlier run
    is archived first, said in one line: with `run.resume=false`, or where no checkpoint is left
    to resume from (a run stopped before its first save); a start over never truncates its
    metrics or TensorBoard history. Refuses to resume where every checkpoint was set aside as
    unusable (that start from step 0 takes `run.resume=false`). Process 0 reads the directory
    and decides for every process."""
    plan = from_process_0(_start_plan(cfg, out) if jax.process_index() == 0 else None)
    if "refuse" in plan:
        raise ConfigError(plan["refuse"])
    if "archive" not in plan:
        return
    if jax.process_index() == 0:
        archived = archive_previous_run(out)
        if archived is not None:
            _say(f"{plan['archive']}: the earlier run in {out} was moved to {archived}")
    if jax.process_count() > 1:  # nobody reads the directory before it is moved
        multihost_utils.sync_global_devices("earlier run archived")


def _start_plan(cfg: TrainConfig, out: Path) -> dict[str, str]:
    """{"archive": why} where this run starts over in `out`, {"refuse": why} where it must
    not, {} where it resumes or `out` holds no earlier run."""
    if not cfg.run.resume:
        return {"archive": "run.resume=false"}
    checkpoints = out / "checkpoints"
    if saved_steps(checkpoints):
        return {}
    if unusable := set_aside(checkpoints):
        return {
            "refuse": f"every checkpoint in {checkpoints} was set aside as unusable "
            f"({', '.join(unusable)}) and resuming would start from step 0; set "
            "run.resume=false to start over (the earlier run is archived first), or use another "
            "run.out_dir"
        }
    return {"archive": f"no checkpoint in {checkpoints} to resume from"}


def _write_config(cfg: TrainConfig, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config_json(cfg), indent=1))


def _say_policy(cfg: TrainConfig, out: Path, link: str = "auto") -> None:
    """Where the collectives' "auto" policy compresses on this machine's link, when it decides
    (TP over real GPUs with min_compress_bytes unset, docs/method.md "The auto policy"), from
    which table (this machine's tuned one, or the shipped one), "fused" only where its kernel
    runs on this machine's TP groups (`taco_jax.algorithms.fused_kernel_runs` of their target):
    printed, and kept in `collectives_policy.txt` beside the run's config, so a run recorded as
    `taco` says where it really compressed. link: the TP link (`resolve_links`'s, or the
    config's)."""
    comp = cfg.compression
    real_tp = cfg.parallel.tp > 1 and cfg.parallel.mode == "shard_map"
    if not real_tp or comp.min_compress_bytes is not None:
        return
    tp = taco_jax.target.probe("tp", link, mesh=make_mesh(cfg.parallel))
    if tp.real_link:  # GPUs: the policy decides from its table (elsewhere it compresses all)
        name = comp.fwd if comp.fwd != "none" else comp.bwd  # as the tuning's line names it
        codec = taco_jax.collectives.collective_codec(name, comp.group_size)
        fused = taco_jax.algorithms.fused_kernel_runs(tp, codec, comp.impl)
        text = taco_jax.policy.summary(
            tp.link, cfg.parallel.tp, codec=codec, fused=fused, impl=comp.impl
        )
        _say(
            "collectives (auto policy, by message bytes per rank; set "
            "compression.min_compress_bytes=0 to compress every one):\n" + text
        )
        if jax.process_index() == 0:
            (out / "collectives_policy.txt").write_text(text + "\n")


def train_and_evaluate(cfg: TrainConfig) -> dict[str, Any]:
    """Runs `cfg.run.steps` optimizer steps (resuming if possible); returns the last records."""
    started = time.perf_counter()
    maybe_initialize_distributed(cfg.run.distributed)
    cfg = resolve_model(cfg, required=True)  # model.init_from's geometry
    try:  # before the dataset is prepared
        check_devices(cfg.parallel)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    changes = check_resumable(cfg, Path(cfg.run.out_dir))
    _start_over(cfg, Path(cfg.run.out_dir))
    run = _Run(cfg)
    lead = jax.process_index() == 0
    if lead:
        _write_config(cfg, run.out)
        run.dataset.tokenizer.save(run.out / TOKENIZER_FILE)  # the export's and sample's
    remove_unfinished_saves(run.out / "checkpoints")
    ckpt = Checkpointer(run.out / "checkpoints", cfg.run.keep_checkpoints, cfg.run.async_checkpoint)
    state, start = _init_or_restore(run, ckpt)
    record_changes(changes, start, run.out)
    board = run.out / "tensorboard" if cfg.run.tensorboard else None
    writer = metrics.MetricsWriter(run.out / "metrics.jsonl", start, lead, board)
    params = cfg.model.num_params()
    comp = cfg.compression
    layout = f"tp={cfg.parallel.tp} ({cfg.parallel.mode}) dp={cfg.parallel.dp}"
    if cfg.parallel.pp > 1:
        layout += f" pp={cfg.parallel.pp} ({cfg.parallel.schedule})"
    codecs = f"compression fwd={comp.fwd} bwd={comp.bwd or comp.fwd}"
    if cfg.parallel.pp > 1:
        codecs += f" pp={comp.pp}"
    if cfg.optimizer.sharded:
        layout += " (sharded optimizer)"
        codecs += f" dp_grad={comp.dp_grad} dp_param={comp.dp_param}"
    _say(
        f"model {params / 1e6:.2f}M params | {layout} | {codecs} | train tokens "
        f"{run.dataset.train.size:,} | steps {start} -> {cfg.run.steps} | out {run.out}"
    )
    _say_links(run.links)
    end = cfg.run.steps if cfg.run.stop_at is None else cfg.run.stop_at
    if start < end:  # before the steps are traced: the table the policy reads is then final
        run.prediction = tuning.start_up(run, state, build_steps)
    _say_policy(cfg, run.out, run.links["link"].name if "link" in run.links else comp.link)
    if start >= end:
        _say(
            f"the run in {run.out} is at step {start}, the end of this one ({end}): nothing to "
            "train; raise run.steps to go on"
        )
    elif run.peak is None:
        kind = run.steps.mesh.devices.flat[0].device_kind
        _say(
            f"MFU not reported: the peak FLOP/s of a {kind!r} device is unknown (set "
            "run.peak_tflops)"
        )
    if start < end:
        ckpt.reserve_host_memory(state)  # beside the compiles
        try:
            run.compile_ahead(state)
        finally:  # before the first step donates the state the thread reads
            reserved = ckpt.host_memory_reserved()
        if reserved:
            _say(reserved)
        _say_reference_ops()
    try:
        with StopRequests() as stops:
            last = _loop(run, state, start, ckpt, writer, stops)
    finally:  # Also after a non-finite loss: the plot shows where it went wrong.
        ckpt.close()
        writer.close()
        tuning.finish()
        if lead:
            records = metrics.read_jsonl(run.out / "metrics.jsonl")
            metrics.plot_losses(records, run.out / "loss.png", str(run.out))
            comm_error.write_png(records, run.out / "comm_error.png", comp.error_budget)
    if start < end:
        if lead and (table := comm_error.table(records, comp.error_budget)):
            _say(table)
        _say(_summary(run, start, end, last, time.perf_counter() - started))
        if cfg.run.sample_tokens and lead:
            _print_sample(cfg, run.out)
    return last


# The end-of-run sample: tempered, from the likeliest tokens (greedy text from a small model
# tends to repeat itself), the same for the same run (seeded by run.seed).
SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 40


def _print_sample(cfg: TrainConfig, out: Path) -> None:
    """A sample of `run.sample_tokens` tokens from the final checkpoint, after an end-of-text
    token (a new document), on stdout: the text `python -m taco_train.sample RUN_DIR
    --temperature 0.8 --top-k 40 --seed SEED` prints."""
    from taco_train import sample

    model, params, tokenizer, eos = sample.load(out)
    budget = cfg.run.sample_tokens
    if model.arch == "gpt":  # the learned positions hold the start token and seq_len - 1 more
        budget = min(budget, model.seq_len - 1)
    top_k = min(SAMPLE_TOP_K, model.vocab_size)
    text = sample.complete(
        model,
        params,
        tokenizer,
        eos,
        "",
        budget,
        seed=cfg.run.seed,
        temperature=SAMPLE_TEMPERATURE,
        top_k=top_k,
    )
    how = f"{budget} tokens at most, temperature {SAMPLE_TEMPERATURE}, top-k {top_k}"
    more = f"python -m taco_train.sample {out} --prompt ... for more"
    print(f"sample ({how}; {more}):\n{text}", flush=True)


def _summary(run: _Run, start: int, end: int, last: dict[str, Any], seconds: float) -> str:
    """The end-of-run line: steps, final train and validation loss, tokens/s, wall time, where
    the outputs are."""
    parts = [f"done: steps {start} -> {end}"]
    if "train" in last:
        parts.append(f"train loss {last['train']['loss']:.4f}")
    if "eval" in last:
        parts.append(f"val loss {last['eval']['val_loss']:.4f}")
    steps_timed, seconds_timed = last.get("timed", (0, 0.0))
    if steps_timed:
        parts.append(f"{steps_timed * run.tokens_per_step / seconds_timed:,.0f} tok/s")
    parts += [f"wall {seconds:.1f} s", f"outputs in {run.out}"]
    return " | ".join(parts)


def _loop(run: _Run, state, start: int, ckpt: Checkpointer, writer, stops) -> dict[str, Any]:
    cfg = run.cfg.run
    bar = _progress_bar(start, cfg.steps, enabled=cfg.progress and jax.process_index() == 0)
    end = cfg.steps if cfg.stop_at is None else cfg.stop_at
    profiler = _StepProfiler(cfg.profile_start, cfg.profile_steps, run.out / "profile")
    try:
        return _steps(run, state, start, end, ckpt, writer, bar, profiler, stops)
    finally:
        profiler.close()


class Diverged(RuntimeError):
    """Training cannot go on from the state it has (one line on the command line, exit 1)."""


class _SkipWatch:
    """Reads the device's count of skipped (non-finite) updates at each log step: a few skips
    are reported, a whole interval of them stops the run, naming the steps and what to try."""

    def __init__(self, run: _Run, state, start: int):
        self.run, self.seen, self.since = run, int(jax.device_get(state.skipped)), start

    def check(self, record: dict[str, Any], bar) -> None:
        skipped, step = int(record["skipped_steps"]), record["step"]
        new, steps = skipped - self.seen, step - self.since
        first = self.since + 1
        self.seen, self.since = skipped, step
        if new and new == steps:
            opt = self.run.cfg.optimizer
            raise Diverged(
                f"the loss or gradient was not finite at every step from {first} to {step}; "
                f"their updates were skipped (the state is that of step {first - 1}, and every "
                f"checkpoint in run.out_dir is finite); try a lower optimizer.lr (now "
                f"{opt.lr:g}) or optimizer.grad_clip (now {opt.grad_clip:g})"
            )
        if new and jax.process_index() == 0:
            bar.write(
                f"skipped {new} update(s) with a non-finite loss or gradient in steps "
                f"{first}-{step}"
            )


def _steps(run: _Run, state, start, end, ckpt, writer, bar, profiler, stops) -> dict[str, Any]:
    cfg = run.cfg.run
    last: dict[str, Any] = {}
    t_mark, steps_since = None, 0
    compiles = True  # the next train step compiles its program: time from its end
    skips = _SkipWatch(run, state, start)
    previous = None  # the outputs of the step before
    for step in range(start, end):
        batch = run.global_batch(run.train_batches.train(step))
        done = step + 1
        measuring = run.measures(done)
        if measuring:  # not training time: its compile, the exact collectives, the host work
            jax.block_until_ready(state)
            paused = time.perf_counter()
        profiler.before(done)
        state, out = (run.measure_step if measuring else run.steps.train_step)(state, batch)
        stops.dispatched(done, out)
        profiler.after(done, out)
        if measuring:
            if _after_measuring(run, done, writer, bar):  # call sites switched codecs
                run.compile_ahead(state)  # the new programs, before the next step
                compiles = True
            if t_mark is not None:
                t_mark += time.perf_counter() - paused
        elif compiles:
            jax.block_until_ready(out)
            t_mark, steps_since, compiles = time.perf_counter(), 0, False
        else:
            steps_since += 1
        bar.update(1)
        if done % cfg.log_every == 0 or done == cfg.steps:
            jax.block_until_ready(out)
            seconds = 0.0 if t_mark is None else time.perf_counter() - t_mark
            record = _train_record(run, done, out, seconds, steps_since)
            timed = last.get("timed", (0, 0.0))
            last["timed"] = (timed[0] + steps_since, timed[1] + seconds)  # for the summary
            t_mark, steps_since = time.perf_counter(), 0
            last["train"] = _emit(record, writer, bar)
            tuning.measured(run, record, writer, bar)  # after warm-up: beside the prediction
            skips.check(record, bar)
        evaluate = done % cfg.eval_every == 0 or done == cfg.steps
        if evaluate:
            record = {"kind": "eval", "step": done, "val_loss": run.evaluate(state)}
            last["eval"] = _emit(record, writer, bar)
            if not metrics.is_finite(record["val_loss"]):
                raise Diverged(f"validation loss {record['val_loss']} at step {done}")
        # At most two steps in flight (one running, the next queued): a signal stops the run
        # within a step of its arrival (`taco_train.stopping`).
        jax.block_until_ready(previous)
        previous = out
        save = done % cfg.checkpoint_every == 0 or done in (cfg.steps, end)
        if save:  # before deciding to stop: the processes wait for each other there
            _save(run, ckpt, done, state, writer)
        stop = stops.decide(done)
        if stop is not None and not save:
            _save(run, ckpt, done, state, writer)
            save = True
        if stop is not None and done < end:
            bar.close()
            raise Stopped(stop, done)
        if evaluate or save:  # Evaluation and checkpointing are not training time.
            jax.block_until_ready(state)
            t_mark, steps_since = time.perf_counter(), 0
    bar.close()
    return last


def _save(run: _Run, ckpt: Checkpointer, step: int, state, writer) -> None:
    """Checks the state is finite, saves it, and records how long the loop was blocked (the
    finite check and `Checkpointer.save`, after the step itself is done) as a "checkpoint"
    record in metrics.jsonl: the pause per save, synchronous or asynchronous, and of it the
    finite check (`finite_s`) and the wait for the save before (`previous_s`); the rest is
    orbax's (asynchronous: the state's copy to host memory)."""
    jax.block_until_ready(state)  # the step's own time is not the checkpoint's
    started = time.perf_counter()
    if not bool(run.steps.is_finite(state)):  # never a checkpoint to resume into NaN
        raise Diverged(f"the train state is not finite at step {step}; not saved")
    checked = time.perf_counter()
    ckpt.save(
        step,
        state,
        comm_error.checkpoint_metadata(run.fallbacks, run.cfg.compression, run.over_budget),
    )
    blocked = time.perf_counter() - started
    writer.write(
        {
            "kind": "checkpoint",
            "step": step,
            "blocked_s": blocked,
            "finite_s": checked - started,
            "previous_s": ckpt.previous_wait_s,
            "async": run.cfg.run.async_checkpoint,
        }
    )


class _StepProfiler:
    """Traces train steps `first` .. `first + count - 1` (1-based, as logged) with
    `jax.profiler` into `directory`: a trace TensorBoard's profile plugin and Perfetto open, to
    see whether the codec overlaps the communication. count 0 traces nothing."""

    def __init__(self, first: int, count: int, directory):
        self.first, self.last, self.directory = first, first + count - 1, directory
        self.active = False

    def before(self, step: int) -> None:
        if step == self.first and self.last >= self.first:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, out) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(out)  # the traced steps' device work belongs in the trace
            self.close()
            _say(f"profile of steps {self.first}-{self.last} written to {self.directory}")

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def _train_record(run: _Run, step: int, out, seconds: float, steps_timed: int) -> dict[str, Any]:
    values = {k: v.item() for k, v in jax.device_get(out).items()}  # float loss, int counts
    record = {"kind": "train", "step": step, **values, "lr": float(run.schedule(step - 1))}
    if steps_timed > 0:
        tokens_per_s = steps_timed * run.tokens_per_step / seconds
        flops = run.cfg.model.flops_per_token()
        record["tokens_per_s"] = tokens_per_s
        record["mfu"] = metrics.mfu(tokens_per_s, flops, run.n_devices, run.peak)
    return record


def _after_measuring(run: _Run, step: int, writer, bar) -> bool:
    """After measuring step `step`: its "comm" record, line and picture, then the error
    budget (`taco_train.comm_error`). Returns whether call sites switched codecs (the steps
    are then rebuilt: every rank takes the new program from the next step)."""
    errors = telemetry.drain(all_processes=True)  # every process decides from the same sums
    record = comm_error.record(step, errors)
    writer.write(record)
    if jax.process_index() == 0:
        bar.write(comm_error.line(record))
        budget = run.cfg.compression.error_budget
        figure = writer.wants_figures and comm_error.figure(writer.records(), budget)
        if figure:
            writer.write_figure("comm/error_by_layer_and_op", figure, step)
    budget = run.cfg.compression.error_budget
    if budget is None:
        return False
    comp = run.cfg.compression
    streaks = comm_error.tally(run.over_budget, step, errors, budget)
    new = comm_error.due(streaks, comp.error_budget_consecutive, run.fallbacks, comp.fallback_codec)
    run.over_budget = {site: steps for site, steps in streaks.items() if site not in new}
    if not new:
        return False
    if jax.process_index() == 0:  # with the measuring steps' lines, not across the bar
        bar.write(comm_error.switch_line(step, new, errors, budget, streaks))
    writer.write(comm_error.fallback_record(step, new, errors, streaks))
    run.build({**run.fallbacks, **new})
    return True


def _emit(record: dict[str, Any], writer, bar) -> dict[str, Any]:
    writer.write(record)
    if jax.process_index() == 0:
        bar.write(metrics.format_line(record))
        sys.stdout.flush()  # a line per record also when the console is a pipe or a file
    return record


def _progress_bar(start: int, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=start,
        desc="train",
        unit="step",
        disable=not enabled or None,
        file=sys.stderr,
        dynamic_ncols=True,
    )
