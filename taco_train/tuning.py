"""`compression.tune`: the TP collectives timed on this machine before training, and what they
will save.

At start-up (`start_up`), where the policy decides the TP collectives (TP > 1, a compressing
codec, `min_compress_bytes` or `algorithm` left to "auto"): the step's collectives are counted
from its traced program (`taco_jax.tune.step_collectives`: each op and message size x how often
one step runs it, scans and the backward pass included); "auto" times them with
`taco_jax.tune.measure` (about a minute) where TP runs over real GPUs and this machine's policy
file has no time for one of them, "force" always (on the CPU or under vmap too: the codec's
cost), "off" never. The times go into the policy file, which every process then reads as
process 0 does (`taco_jax.policy` decides from it); the start-up lines name the table, and per
op and size what runs with its measured ratio, and the predicted collective time of a step,
plain and as chosen. After warm-up (`measured`) the measured step time is printed beside the
prediction, and both go into metrics.jsonl as a "tune" record.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import jax

from taco_jax import _tuned, collectives, policy, target, tune
from taco_train.checkpointing import from_process_0

BUDGET_S = tune.BUDGET_S  # the timed rounds of a start-up tuning ("about a minute")


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


def policy_decides(cfg) -> bool:
    """Whether the "auto" policy decides some TP collective of the run `cfg`."""
    comp, p = cfg.compression, cfg.parallel
    compresses = comp.fwd != "none" or (comp.bwd or comp.fwd) != "none"
    asks = comp.min_compress_bytes is None or comp.algorithm == "auto"
    return p.tp > 1 and compresses and asks


def tp_link(run) -> str:
    """The TP group's link as the policy names it: "vmap" for a group emulated on a device."""
    cfg = run.cfg
    if cfg.parallel.mode != "shard_map":  # "vmap", "emulate": no bytes move
        return _tuned.EMULATED
    if "link" in run.links:
        return run.links["link"].name
    if cfg.compression.link != "auto":
        return cfg.compression.link
    return policy.mesh_link(run.steps.mesh, "tp").name


def agreed_table() -> _tuned.Table | None:
    """This machine's policy file as process 0 reads it, installed on every process (so that
    every process compiles the same collectives)."""
    path = _tuned.default_path()
    text = None
    if jax.process_index() == 0 and _tuned.read(path) is not None:
        text = path.read_text()
    text = from_process_0(text)
    table = None if text is None else _tuned.from_json(json.loads(text), str(path), trusted=True)
    _tuned.install(table)
    return table


def finish() -> None:
    """The run's table is this process's no more (the next run, or the library, reads the
    file again)."""
    _tuned.uninstall()


def _step_calls(run, state, build_steps: Callable) -> list[tuple[policy.Call, int]]:
    """The TP collectives of one train step with their counts, from a trace of a fresh build of
    the steps (the run's own are traced when compiled, after the table is final)."""
    steps = build_steps(run.cfg, run.fallbacks, links=run.links)
    rows = run.train_batches.train(0)
    batch = jax.ShapeDtypeStruct(rows.shape, rows.dtype, sharding=steps.batch_sharding)
    with policy.recording() as calls:
        traced = steps.train_step.trace(state, batch)
    counted = tune.step_collectives(traced.jaxpr, calls)
    return [(call, n) for call, n in counted if call.axis_name == "tp"]


def _unmeasured(counted, table: _tuned.Table | None, link: str, n_ranks: int) -> dict:
    """{op: [bytes]} of the step's collectives the table has no time for."""
    entry = (table.entry(n_ranks, link) if table is not None else None) or {}
    missing: dict[str, set[int]] = {}
    for call, _ in counted:
        cell = entry.get(call.op, {}).get(call.nbytes, {})
        # the identity codec needs only the plain collective's time, which any codec's holds
        if not cell if call.cfg.codec.is_identity else call.codec not in cell:
            missing.setdefault(call.op, set()).add(call.nbytes)
    return {op: sorted(sizes) for op, sizes in missing.items()}


def start_up(run, state, build_steps: Callable) -> tune.Prediction | None:
    """`compression.tune` before the steps are compiled (see the module doc); the prediction,
    or None where nothing is predicted."""
    cfg = run.cfg
    comp = cfg.compression
    table = agreed_table()
    if not policy_decides(cfg):
        return None
    link, n_ranks = tp_link(run), cfg.parallel.tp
    real = link != _tuned.EMULATED and target.probe("tp", link, mesh=run.steps.mesh).real_link
    has_entry = table is not None and table.entry(n_ranks, link) is not None
    if comp.tune == "off" or (comp.tune == "auto" and not real and not has_entry):
        if link != _tuned.EMULATED:
            _say(_policy_line(run, link, real))
        return None
    counted = _step_calls(run, state, build_steps)
    missing = _unmeasured(counted, table, link, n_ranks)
    if comp.tune == "force" or (real and missing):
        sizes = _sizes(counted) if comp.tune == "force" else missing
        table = _tune(run, link, sizes, {c.cfg.codec for c, _ in counted})
    if link != _tuned.EMULATED:
        _say(_policy_line(run, link, real))
    else:
        _say(
            "compression.tune: a TP group emulated under vmap moves no bytes: every message is "
            "compressed, and the times below are the codec's cost"
        )
    if table is None:
        return None
    prediction = tune.predict(counted, table, link)
    for line in prediction.lines:
        _say(f"  {line}")
    _say(prediction.line())
    return prediction


def _sizes(counted) -> dict[str, list[int]]:
    sizes: dict[str, set[int]] = {}
    for call, _ in counted:
        sizes.setdefault(call.op, set()).add(call.nbytes)
    return {op: sorted(s) for op, s in sizes.items()}


def _policy_line(run, link: str, real: bool) -> str:
    """Which table the TP collectives' policy reads (`policy.source`); `real`: TP over GPUs."""
    comp = run.cfg.compression
    codec = comp.fwd if comp.fwd != "none" else comp.bwd
    key = _tuned.codec_key(collectives.collective_codec(codec, comp.group_size), comp.impl)
    where = policy.source(run.cfg.parallel.tp, link, key, real_link=real)
    return f"compression.tune={comp.tune}: the TP collectives' policy: {where}"


def _tune(run, link: str, sizes: dict[str, list[int]], codec_set) -> _tuned.Table | None:
    """Times `sizes` ({op: bytes}) on the run's TP groups (every process together), writes
    the policy file, and installs it as process 0 reads it."""
    cfg = run.cfg
    mesh = None if link == _tuned.EMULATED else run.steps.mesh
    group = tune.Group(cfg.parallel.tp, link, mesh, "tp")
    total = sum(len(s) for s in sizes.values())
    _say(
        f"compression.tune={cfg.compression.tune}: timing {total} TP collective size(s) of the "
        f"step on N = {group.n_ranks} ({link}), about {BUDGET_S:.0f} s"
    )
    ops = tune.measure(
        group,
        sizes,
        sorted(codec_set, key=_tuned.codec_key),
        impl=cfg.compression.impl,
        budget_s=BUDGET_S,
        say=lambda line: _say(f"  {line}"),
    )
    command = f"python -m taco_train (compression.tune={cfg.compression.tune})"
    _tuned.write(_tuned.default_path(), {(group.n_ranks, link): ops}, command)
    return agreed_table()


def measured(run, record: dict[str, Any], writer, bar) -> None:
    """After warm-up (the first train record with a measured step time): the measured step
    beside the prediction, printed and written as a "tune" record."""
    prediction = getattr(run, "prediction", None)
    if prediction is None or not prediction.lines or "tokens_per_s" not in record:
        return
    run.prediction = None  # once
    step_s = run.tokens_per_step / record["tokens_per_s"]
    entry = {
        "kind": "tune",
        "step": record["step"],
        "step_s": step_s,
        "collectives_plain_s": prediction.plain_s,
        "collectives_chosen_s": prediction.chosen_s,
        "predicted_saving_s": prediction.saving_s,
    }
    writer.write(entry)
    if jax.process_index() == 0:
        measured_at = f"step {step_s * 1e3:.1f} ms measured at step {record['step']}"
        bar.write(f"{measured_at}; {prediction.line(step_s)}")
