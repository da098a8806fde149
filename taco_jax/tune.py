"""Tuning "auto" on this machine: the collectives timed on the user's own mesh, into a policy file.

For each TP group size and op (all-reduce, reduce-scatter, all-gather) at the message sizes a
run sends (or a ladder), `measure` times the plain `lax` collective against each compressed
algorithm that runs there (all-reduce: one-shot, two-shot, and fused where its kernel runs,
`algorithms.fused_kernel_runs` of the group's `taco_jax.target.Target`; the other two: their
exchange through NCCL ("-") and the fused one where it runs), with the run's codecs,
interleaved with an A/A control (`taco_jax.timing`), and checks each result against the plain
one. `policy` then decides from it (`policy.tuned_cell`: level means plain). A sample is one
jitted program of a few dependent calls of the op (each call's input through an optimization
barrier with the previous output, `timing.chained`), so that the op is timed as it runs inside
a step, dispatch spread over the calls.

With several processes (`jax.distributed`) every process runs the same programs in the same
order, and each sample is the slowest process's (a collective finishes when its last rank does):
every process sees the same times, stops after the same rounds, and reaches the same table,
which each writes (`_tuned.write`: atomically, so one shared file ends up whole).

Where no link carries the collectives (one device: the N ranks under `jax.vmap`), the times are
the codec's own cost beside the plain collective's, under the link name "vmap"; "auto" never
reads those (nothing moves there), the trainer's prediction does.

`step_collectives` counts the collectives of a traced step (with `policy.recording`): each
`policy.Call` x how often it runs, through `lax.scan` lengths and remat; `predict` turns those
counts and the measured times into the step's predicted collective time, plain and as chosen.

    python -m taco_jax.tune --tp 2 4          # on each process of a jax.distributed run
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax import _tuned, algorithms, codecs, collectives, policy, tahquant, timing
from taco_jax import target as platform
from taco_jax.telemetry import relative_error

OPS = ("all_reduce", "reduce_scatter", "all_gather")
MiB = 1 << 20
LADDER = tuple(s * MiB for s in (1, 4, 16, 64))
BUDGET_S = 60.0
# A compressed result off the plain one by more than this many times the codec's own round
# trip error on the same message is wrong, and never chosen. One-shot quantizes each input once
# (about the round trip's error, the sum of N independent errors over the sum of N signals);
# two-shot quantizes twice (about sqrt(2) times that): 3x leaves margin for the data. A kernel
# that drops one rank's part of a sum of N is off by ~1/sqrt(N) (0.35 at N = 8), above 3x
# `taco`'s 3.6% (docs/api.md, "Codec error").
WRONG_FACTOR = 3.0
# The fewest calls of the op a timed program holds (dispatch spread over them), and the most;
# in between, enough for ~16 MiB of messages.
MIN_CALLS, MAX_CALLS, CALL_BYTES = 2, 8, 16 * MiB


@dataclasses.dataclass(frozen=True)
class Group:
    """Where one TP group size is measured: along `axis` of `mesh` (every group of the mesh at
    once, as in a run), or with `mesh` None as `n_ranks` ranks under `jax.vmap` on one device
    (link "vmap")."""

    n_ranks: int
    link: str
    mesh: jax.sharding.Mesh | None = None
    axis: str = "tp"


def groups_of(sizes: Sequence[int], emulate: bool = False) -> list[Group]:
    """A `Group` per TP size over this run's devices (a (devices / N, N) mesh of axes
    ("dp", "tp"), in device order), or emulated under vmap (`emulate`, or a single device)."""
    devices = jax.devices()
    out = []
    for n in sizes:
        if n < 2:
            raise ValueError(f"TP size {n}: a group needs at least 2 ranks")
        if emulate or len(devices) == 1:
            out.append(Group(n, _tuned.EMULATED))
            continue
        if len(devices) % n:
            raise ValueError(f"TP size {n} does not divide this run's {len(devices)} devices")
        grid = np.array(devices).reshape(-1, n)
        mesh = jax.sharding.Mesh(grid, ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        out.append(Group(n, policy.mesh_link(mesh, "tp").name, mesh))
    return out


def variants(op: str, group: Group, codec, impl: str = "auto") -> list[str]:
    """The compressed algorithms timed for `op` with `codec` on `group`: see the module doc."""
    if group.mesh is None:  # under vmap: no peers to store into
        fused = False
    else:
        group_target = platform.probe(group.axis, group.link, mesh=group.mesh)
        fused = algorithms.fused_kernel_runs(group_target, codec, impl)
    names = ["one_shot", "two_shot"] if op == "all_reduce" else ["-"]
    return names + (["fused"] if fused else [])


def _op(op: str, axis: str, codec=None, algorithm: str = "-", impl: str = "auto"):
    """One rank's `op` along `axis` of a flat message: the lax collective (codec None), or the
    compressed one forced to compress with `algorithm` ("-": the exchange through NCCL)."""
    options = dict(
        codec=codec,
        impl=impl,
        min_compress_bytes=0,
        algorithm="one_shot" if algorithm == "-" else algorithm,
    )
    if op == "all_reduce":
        if codec is None:
            return lambda v: lax.psum(v, axis)
        return lambda v: collectives.compressed_psum(v, axis, **options)
    if op == "reduce_scatter":
        if codec is None:
            return lambda v: lax.psum_scatter(v, axis, scatter_dimension=0, tiled=True)
        return lambda v: collectives.compressed_psum_scatter(v, axis, **options)
    if op == "all_gather":
        if codec is None:
            return lambda v: lax.all_gather(v, axis, axis=0, tiled=True)
        return lambda v: collectives.compressed_all_gather(v, axis, tiled=True, **options)
    raise ValueError(f"unknown op {op!r}; choose one of {OPS}")


def _elements(op: str, nbytes: int, n_ranks: int) -> int:
    """bf16 elements of one rank's input for a message of `nbytes` as `policy.choose` counts it
    (the all-gather's output), a multiple of N (the reduce-scatter's scatter)."""
    per_rank = nbytes // 2 // (n_ranks if op == "all_gather" else 1)
    return max(n_ranks, math.ceil(per_rank / n_ranks) * n_ranks)


def _message(group: Group, elements: int, seed: int) -> jax.Array:
    """Every rank's bf16 N(0, 1) block: [ranks, elements] on one device (vmap), or one row per
    device of the mesh, each process making its own rows."""
    if group.mesh is None:
        return jax.random.normal(jax.random.key(seed), (group.n_ranks, elements), jnp.bfloat16)
    sharding = NamedSharding(group.mesh, P(group.mesh.axis_names))
    shape = (group.mesh.devices.size, elements)

    def rows(index):
        picked = range(shape[0])[index[0]]
        block = [np.random.default_rng([seed, r]).standard_normal(elements) for r in picked]
        return np.asarray(block, jnp.bfloat16)

    return jax.make_array_from_callback(shape, sharding, rows)


def _program(fn, group: Group, calls: int):
    """The jitted program of `calls` dependent `fn` calls on every rank (`timing.chained`);
    its outputs: one [ranks, ...] array per call."""
    body = timing.chained(fn, calls)
    if group.mesh is None:
        return jax.jit(jax.vmap(body, axis_name=group.axis))
    spec = P(group.mesh.axis_names)

    def per_device(block):
        return [out[None] for out in body(block[0])]

    mapped = jax.shard_map(
        per_device, mesh=group.mesh, in_specs=spec, out_specs=spec, check_vma=False
    )
    return jax.jit(mapped)


def _scalar(x: jax.Array) -> float:
    """A replicated scalar's value on every process."""
    return float(np.asarray(x.addressable_data(0)))


@jax.jit
def _error(approx: jax.Array, exact: jax.Array) -> jax.Array:
    return relative_error(approx, exact)


def _roundtrip_error(codec, x: jax.Array) -> float:
    """The relative error of one encode + decode of every rank's block with `codec`."""
    if isinstance(codec, tahquant.TahQuant):  # its collectives draw noise from the message

        def one(v):
            rows = codecs.pad_to_multiple(v[None], codec.group_size)[0]
            key = tahquant.message_key(rows) if codec.stochastic else None
            return tahquant.roundtrip(codec, rows, key)[0, : v.size].astype(v.dtype)

        trip = jax.jit(jax.vmap(one))
    else:
        trip = jax.jit(jax.vmap(lambda v: codecs.roundtrip(codec, v)))
    return _scalar(_error(trip(x), x))


def _slowest(seconds: float) -> float:
    """The largest of every process's `seconds` (this process's alone where it is the only)."""
    if jax.process_count() == 1:
        return seconds
    return float(np.max(multihost_utils.process_allgather(np.float32(seconds))))


class _Clock:
    """Seconds since it was made, the slowest process's: every process reads the same, so that
    `timing.compare` stops every process after the same round."""

    def __init__(self):
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("taco_jax.tune")
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return _slowest(time.perf_counter() - self.start)


def measure(
    group: Group,
    sizes: Mapping[str, Sequence[int]],
    codec_list: Sequence,
    *,
    impl: str = "auto",
    budget_s: float = BUDGET_S,
    calls: int | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """{op: {bytes: {codec_key: comparison}}} of `group` (see `_tuned`) for `sizes` ({op:
    message bytes per rank, as `policy.choose` counts them}) and each codec of `codec_list`
    (names or codecs; for the identity codec only the plain collective is timed). The rounds of
    all comparisons share `budget_s`, their compiles included (each runs at least
    `timing.MIN_REPEATS` rounds, so a budget spent early still times the later ones);
    `calls`: the op's calls per timed program (default: by size, `MIN_CALLS`..`MAX_CALLS`).
    `say`: a progress line per comparison, on process 0."""
    codec_list = list(dict.fromkeys(collectives.collective_codec(c) for c in codec_list))
    work = [(op, int(size)) for op in OPS for size in sorted(set(sizes.get(op, ())))]
    clock, ops = _Clock(), {}
    for index, (op, size) in enumerate(work):
        left = max(budget_s - clock(), 0.0) / (len(work) - index)
        result = _compare(group, op, size, codec_list, impl, left, calls, clock)
        ops.setdefault(op, {})[size] = result
        if jax.process_index() == 0:
            say(f"[{index + 1}/{len(work)}] {_progress(group, op, size, result)}")
    return ops


def _compare(group, op, size, codec_list, impl, budget_s, calls, clock) -> dict:
    """One op and size: the plain collective against every codec's algorithms."""
    x = _message(group, _elements(op, size, group.n_ranks), seed=size % (1 << 31))
    calls = calls or int(np.clip(CALL_BYTES // max(size, 1), MIN_CALLS, MAX_CALLS))
    programs = _programs(group, op, codec_list, impl, calls)
    return _checked_times(programs, x, codec_list, calls, budget_s, clock, impl)


def _programs(group, op, codec_list, impl, calls) -> dict:
    """{"plain": the lax collective's program, (codec key, algorithm): each algorithm's that
    runs here (`variants`)}: `_program`s of `calls` calls of `op` on `group`."""
    programs = {"plain": _program(_op(op, group.axis), group, calls)}
    for codec in (c for c in codec_list if not c.is_identity):
        for algorithm in variants(op, group, codec, impl):
            fn = _op(op, group.axis, codec, algorithm, impl)
            programs[(_tuned.codec_key(codec, impl), algorithm)] = _program(fn, group, calls)
    return programs


def _checked_times(programs, x, codec_list, calls, budget_s, clock, impl="auto") -> dict:
    """{codec key: comparison} of `programs` (`_programs`) on x: each timed against "plain"
    with an A/A control, and its result checked against plain's (`_comparisons`)."""
    exact = programs["plain"](x)[0]
    errors = {key: _scalar(_error(p(x)[0], exact)) for key, p in programs.items() if key != "plain"}
    roundtrip = {
        _tuned.codec_key(c, impl): _roundtrip_error(c, x) for c in codec_list if not c.is_identity
    }
    samplers = {
        _name(key): _agreed(timing.wall(lambda p=p: p(x), per=calls)) for key, p in programs.items()
    }
    result = timing.compare(
        samplers, "plain", budget_s=budget_s, max_repeats=30, precision=0.02, clock=clock
    )
    keys = [_tuned.codec_key(c, impl) for c in codec_list]
    return _comparisons(result, keys, errors, roundtrip)


def _name(key) -> str:
    return key if key == "plain" else f"{key[0]} {key[1]}"


def _agreed(sampler: timing.Sampler) -> timing.Sampler:
    return lambda: _slowest(sampler())


def _median(values: Sequence[float]) -> float:
    return float(np.median(values))


def _comparisons(result: dict, keys: Sequence[str], errors: dict, roundtrip: dict) -> dict:
    """{codec_key: comparison} of one `timing.compare` result for the codecs `keys` (the plain
    collective's seconds and the A/A interval shared; the identity codec's has no variant); a
    variant whose result is off by more than `WRONG_FACTOR` x its codec's round trip is
    "wrong"."""
    times, summary = result["times_s"], result["summary"]
    out = {
        key: {
            "plain_s": _median(times["plain"]),
            "aa": summary[timing.AA_RATIO]["interval"],
            "repeats": result["repeats"],
            "variants": {},
        }
        for key in keys
    }
    for (codec, algorithm), error in errors.items():
        stats = summary[f"{codec} {algorithm}"]
        verdict = stats["verdict"]
        if not error <= WRONG_FACTOR * roundtrip[codec]:  # NaN too
            verdict = "wrong"
        out[codec]["roundtrip_err"] = roundtrip[codec]
        out[codec]["variants"][algorithm] = {
            "seconds": _median(times[f"{codec} {algorithm}"]),
            "median": stats["median"],
            "interval": stats["interval"],
            "verdict": verdict,
            "rel_err": error,
        }
    return out


def _progress(group: Group, op: str, size: int, result: dict) -> str:
    first = next(iter(result.values()))
    lo, hi = first["aa"]
    parts = [f"plain {first['plain_s'] * 1e6:.1f} us (A/A [{lo:.2f}, {hi:.2f}])"]
    for codec, comparison in result.items():
        for algorithm, stats in comparison["variants"].items():
            measured = f"{policy.describe_ratio(stats)} {stats['verdict']}"
            parts.append(f"{codec} {algorithm} {stats['seconds'] * 1e6:.1f} us {measured}")
    where = f"N = {group.n_ranks} {group.link} {op} {policy.describe_size(size)}"
    return f"{where}: " + ", ".join(parts)


# Counting a step's collectives ---------------------------------------------------------------

_TOKEN = re.compile(re.escape(policy.SCOPE_PREFIX) + r"(\d+)")


def step_collectives(
    jaxpr, calls: Mapping[int, list[policy.Call]]
) -> list[tuple[policy.Call, int]]:
    """Each collective of a traced program (its `jaxpr`, traced in `policy.recording()`, whose
    `calls` these are) with how many times one run of the program runs it: the equations of
    each call carry its scope's token, and where they appear counts, times the lengths of the
    `lax.scan`s around them. A call counts once per (sub)program that holds some of its
    equations computed from the program's inputs (`_count`): the forward and the backward pass
    each. A `cond` counts its branch of the most calls; a `while` loop its body once.
    Not seen: a remat's recomputation of a collective (each is a `custom_vjp` op, whose primal
    JAX traces without the caller's scopes); the models' remat keeps the collectives' outputs
    (`REMAT_SAVED_NAMES`), so none of theirs is recomputed."""
    counts: collections.Counter = collections.Counter()
    root = jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr
    _count(root, 1, None, calls, counts)
    return [(calls[t][0], n) for t, n in sorted(counts.items()) if calls.get(t)]


def _innermost(eqn) -> int | None:
    tokens = _TOKEN.findall(str(eqn.source_info.name_stack))
    return int(tokens[-1]) if tokens else None


def _sub_jaxprs(eqn) -> list[tuple[object, int]]:
    """(sub-jaxpr, how many times it runs per run of `eqn`) of an equation."""
    out = []
    factor = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                out.append((item.jaxpr, factor))
            elif isinstance(item, jex_core.Jaxpr):
                out.append((item, factor))
    return out


def _count(jaxpr, times: int, parent, calls, counts: collections.Counter) -> None:
    """Counts into `counts` the calls run by `times` runs of `jaxpr`, inside the call `parent`
    (its token, or None). Only equations that depend on the program's inputs count: a
    computation of constants alone (a codec's Hadamard matrix, an axis index) may have been
    hoisted out of a loop, and runs once."""
    live = {id(v) for v in jaxpr.invars}
    seen = set()
    for eqn in jaxpr.eqns:
        if not any(id(v) in live for v in eqn.invars):
            continue
        live.update(id(v) for v in eqn.outvars)
        token = _innermost(eqn)
        token = parent if token is None else token
        if token != parent and token not in seen and calls.get(token):
            seen.add(token)
            counts[token] += times
        subs = _sub_jaxprs(eqn)
        if eqn.primitive.name == "cond":
            branches = []
            for sub, _ in subs:
                branch: collections.Counter = collections.Counter()
                _count(sub, times, token, calls, branch)
                branches.append(branch)
            counts.update(max(branches, key=lambda b: sum(b.values()), default={}))
            continue
        for sub, factor in subs:
            _count(sub, times * factor, token, calls, counts)


# The prediction ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A step's collectives priced by a tuned table: seconds a step with every one plain, and
    with each as "auto" chooses; `lines`: per op and size, what runs and its measured ratio;
    `unmeasured`: the collectives the table has no time for (left out of both sums)."""

    plain_s: float
    chosen_s: float
    lines: tuple[str, ...]
    unmeasured: tuple[str, ...]

    @property
    def saving_s(self) -> float:
        return self.plain_s - self.chosen_s

    def line(self, step_s: float | None = None) -> str:
        if not self.lines:
            return f"TP collectives: the table has no time for a size of this step ({self.missing})"
        text = (
            f"TP collectives {self.plain_s * 1e3:.2f} ms -> {self.chosen_s * 1e3:.2f} ms a step "
            f"(predicted {(self.chosen_s - self.plain_s) * 1e3:+.2f} ms"
        )
        if step_s:
            share = (self.chosen_s - self.plain_s) / step_s
            text += f", {share:+.1%} of a {step_s * 1e3:.1f} ms step"
        text += ")"
        if self.unmeasured:
            text += f"; not measured: {self.missing}"
        return text

    @property
    def missing(self) -> str:
        return ", ".join(self.unmeasured)


def _chosen_variant(call: policy.Call, choice: policy.Choice, variants_: dict) -> str:
    """The measured variant that runs for `call` under `choice`."""
    if call.op == "all_reduce":
        return choice.algorithm
    return "fused" if call.fused_available and "fused" in variants_ else "-"


def predict(
    counted: Sequence[tuple[policy.Call, int]], table: _tuned.Table, link: str
) -> Prediction:
    """The step of `counted` collectives (`step_collectives`) of TP groups on `link` ("vmap":
    emulated) priced by `table`: per collective its count x the measured seconds of the plain
    collective and of what `policy.redecide` chooses now, at the call's exact size (a size or
    an algorithm the table did not measure is named in `unmeasured`, and left out of both)."""
    plain = chosen = 0.0
    lines, unmeasured = [], []
    grouped: dict = collections.defaultdict(int)
    for call, count in counted:
        grouped[call] += count
    for call, count in grouped.items():
        what = f"{call.op} {policy.describe_size(call.nbytes)} x {count}"
        priced = _priced(call, table.entry(call.n_ranks, link) or {})
        if priced is None:
            unmeasured.append(what)
            continue
        plain_s, seconds, label = priced
        plain += count * plain_s
        chosen += count * seconds
        where = f"{call.codec}, N = {call.n_ranks} on {link}"
        lines.append(f"{what} ({where}): {label}, {plain_s * 1e6:.1f} -> {seconds * 1e6:.1f} us")
    return Prediction(plain, chosen, tuple(lines), tuple(unmeasured))


def _priced(call: policy.Call, entry: dict) -> tuple[float, float, str] | None:
    """(plain seconds, seconds of what runs, what runs with its measured ratio) of one call,
    or None where the entry has no time for it. The identity codec's calls take the plain
    time of any codec's comparison of their op and size."""
    cell = entry.get(call.op, {}).get(call.nbytes, {})
    comparison = cell.get(call.codec)
    if comparison is None and call.cfg.codec.is_identity:
        comparison = next(iter(cell.values()), None)
    if comparison is None:
        return None
    plain_s, variants_ = comparison["plain_s"], comparison["variants"]
    choice = policy.redecide(call)
    if not choice.compress:
        right = {a: s for a, s in variants_.items() if s["verdict"] != "wrong"}
        if not right:
            return plain_s, plain_s, "plain"
        best = max(right, key=lambda a: right[a]["median"])
        stats = right[best]
        return plain_s, plain_s, f"plain ({best} {policy.describe_ratio(stats)} {stats['verdict']})"
    name = _chosen_variant(call, choice, variants_)
    if name not in variants_:
        return None
    stats = variants_[name]
    return plain_s, stats["seconds"], f"{name} {policy.describe_ratio(stats)} {stats['verdict']}"


# The command ---------------------------------------------------------------------------------


def _initialize_distributed(mode: str) -> None:
    """`jax.distributed.initialize` as the trainer's `run.distributed` does: "auto" where
    `JAX_COORDINATOR_ADDRESS` is set (with `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), "on" (JAX
    detects the cluster: SLURM, Open MPI, ...), "off"."""
    if mode == "auto" and "JAX_COORDINATOR_ADDRESS" in os.environ:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    elif mode == "on":
        jax.distributed.initialize()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m taco_jax.tune", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", help="TP group sizes (default: 2, 4, 8 that fit)")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[s / MiB for s in LADDER])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--codecs", nargs="+", default=[codecs.DEFAULT_CODEC])
    p.add_argument("--impl", default="auto")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="timed rounds, all groups")
    p.add_argument("--calls", type=int, default=None, help="op calls per timed program")
    p.add_argument("--emulate", action="store_true", help="N ranks under vmap on one device")
    p.add_argument("--out", default=None, help="the policy file (default: the cache's)")
    p.add_argument("--distributed", default="auto", choices=("auto", "on", "off"))
    return p


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    _initialize_distributed(args.distributed)
    devices = jax.device_count()
    if devices == 1 and not args.emulate:
        _say(
            "a TP link needs two GPUs (devices): this machine has one, so no link is measured; "
            "timing the codec's cost beside the plain collective with the ranks under vmap"
        )
    groups = groups_of(args.tp or [n for n in (2, 4, 8) if devices % n == 0] or [2], args.emulate)
    sizes = {op: [int(s * MiB) for s in args.sizes_mib] for op in args.ops}
    entries = {}
    for group in groups:
        _say(f"tuning N = {group.n_ranks} on {group.link} ({', '.join(args.codecs)})")
        entries[(group.n_ranks, group.link)] = measure(
            group,
            sizes,
            args.codecs,
            impl=args.impl,
            budget_s=args.budget_s / len(groups),
            calls=args.calls,
            say=_say,
        )
    command = "python -m taco_jax.tune " + " ".join(sys.argv[1:] if argv is None else argv)
    path = _tuned.write(Path(args.out) if args.out else _tuned.default_path(), entries, command)
    _say_choices(entries)
    _say(f"wrote {path}")


def _say_choices(entries: dict) -> None:
    """What "auto" now decides at each measured size (a group under vmap: nothing moves there,
    every message is compressed; its times are the codec's cost)."""
    for (n, link), ops in entries.items():
        if link == _tuned.EMULATED:
            _say(f"N = {n} under vmap: the codec's cost; 'auto' compresses every message there")
            continue
        for op, per_size in ops.items():
            for size, cell in per_size.items():
                for codec, comparison in cell.items():
                    if not comparison["variants"]:
                        continue
                    fused = "fused" in comparison["variants"]  # timed only where it runs
                    where = f"N = {n} on {link}, {op} {policy.describe_size(size)}"
                    choice = policy.tuned_cell(op, comparison, fused, where)
                    _say(f"{codec} -> {policy.describe_choice(choice)}: {choice.reason}")


if __name__ == "__main__":
    main()
