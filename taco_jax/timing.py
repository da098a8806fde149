"""Timing with its own noise floor: interleaved repeats, an A/A control, ratios with intervals.

The harness that every benchmark of the repository times with (BENCHMARKS.md), here so that a
step of the library can measure on the user's own machine; JAX, NumPy and the standard library.

`compare(samplers, baseline)` times every sampler (a zero-argument callable returning one
sample's seconds, e.g. `wall(step)` or `in_program(op, inputs, calls)`) in rounds. A round
times the baseline, each variant, then the baseline again (A'), in that order on even rounds
and reversed on odd ones, so that no variant always follows the same neighbour. Rounds go on
until every ratio's interval is within `precision` of its median (the median is stable),
`budget_s` is spent or `max_repeats` rounds ran, never fewer than `min_repeats`.

A ratio is the median over rounds of the round's baseline time over the variant's (> 1: the
variant is faster), the baseline's time in a round being the geometric mean of A and A'. Its
interval is the distribution-free confidence interval of a median from order statistics: the
k-th smallest and k-th largest of n values cover the true median with probability
1 - 2 P(Binomial(n, 1/2) < k) (Conover, Practical Nonparametric Statistics, 3rd ed., 3.2),
k the largest that keeps it >= `CONFIDENCE`; 6 rounds are the fewest that reach 95%. The A/A
ratio (A over A' in each round) is the run's noise floor. It is the floor of one program on one
set of buffers: the same computation on buffers of its own ran 0.81x of itself, steadily, on an
H100 at 8-64 MiB (docs/decisions/033-placement-control.md), which A/A cannot see. Where the
variants run on buffers other than the baseline's, `compare(..., placement=...)` times the
baseline's computation on buffers of its own in every round too, and the floor (`noise_floor`)
spans the A/A interval, that control's and its reciprocal. That control is one draw of the
baseline's placement; each variant's is another, so a choice that rests on a verdict near the
floor wants a second run on other buffers. The verdict: "faster" when the interval lies above 1
and above the floor, "slower" when below both, else "level".

The record of a comparison keeps the raw per-round seconds (`times_s`) with the summary;
`summarize` recomputes the summary from them, which the tables of BENCHMARKS.md do.

    from taco_jax import timing
    out = timing.compare({"plain": timing.wall(plain), "taco": timing.wall(taco)}, "plain")
    out["summary"]["taco"]  # {"median": 1.31, "interval": [1.27, 1.35], "verdict": "faster", ...}
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import jax
from jax import lax

CONFIDENCE = 0.95
MIN_REPEATS = 6  # the fewest rounds whose order-statistic interval covers >= 95%
AA = "A'"  # the baseline's second timing in each round, in `times_s`
AA_RATIO = "A/A"  # the control ratio's name in a summary
PLACED = "A, other buffers"  # the placement control's timing in each round, in `times_s`
PLACED_RATIO = "A/A, other buffers"  # its ratio's name in a summary

Sampler = Callable[[], float]


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    """Median of `values` and its order-statistic interval: {"median", "interval": [lo, hi],
    "coverage"}. With too few values for `confidence` the interval is [min, max] and
    "coverage" says what it covers (below `confidence`)."""
    if not values:
        raise ValueError("median_interval of no values")
    ordered = sorted(values)
    n = len(ordered)
    k, coverage = 1, 1 - 2 * 0.5**n  # [min, max]
    while k < n // 2 and 1 - 2 * _binomial_cdf(k, n) >= confidence:
        k += 1
        coverage = 1 - 2 * _binomial_cdf(k - 1, n)
    return {
        "median": statistics.median(ordered),
        "interval": [ordered[k - 1], ordered[n - k]],
        "coverage": coverage,
    }


def _binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def verdict(interval: Sequence[float], floor: Sequence[float]) -> str:
    """ "faster" / "slower" where `interval` (of a baseline / variant ratio) excludes 1 and lies
    outside the noise floor's interval (`noise_floor`) on the same side, else "level"."""
    lo, hi = interval
    floor_lo, floor_hi = floor
    if lo > 1 and lo > floor_hi:
        return "faster"
    if hi < 1 and hi < floor_lo:
        return "slower"
    return "level"


def round_ratios(times_s: dict[str, list[float]], reference: str, name: str) -> list[float]:
    """Per round: `reference`'s time over `name`'s. The baseline's time in a round is the
    geometric mean of its two timings (A and A') where `times_s` holds both."""
    return [a / b for a, b in zip(_round_times(times_s, reference), times_s[name], strict=True)]


def _round_times(times_s: dict[str, list[float]], name: str) -> list[float]:
    if name == next(iter(times_s)) and AA in times_s:  # the baseline: its series comes first
        return [math.sqrt(a * b) for a, b in zip(times_s[name], times_s[AA], strict=True)]
    return times_s[name]


def ratio(times_s: dict[str, list[float]], reference: str, name: str, floor: dict) -> dict:
    """`reference` time / `name` time: median, interval, coverage and the verdict against the
    noise floor `floor` (`noise_floor(summarize(...))`); "level" where either interval covers
    less than `CONFIDENCE` (too few rounds)."""
    out = median_interval(round_ratios(times_s, reference, name))
    enough = min(out["coverage"], floor["coverage"]) >= CONFIDENCE
    return out | {"verdict": verdict(out["interval"], floor["interval"]) if enough else "level"}


def summarize(times_s: dict[str, list[float]]) -> dict[str, dict]:
    """The summary of a comparison's raw times (the first series is the baseline's, `AA` its
    second timing, `PLACED` the placement control's where timed): the A/A ratio, the placement
    control's ratio, then every variant's ratio to the baseline, judged against `noise_floor`."""
    baseline = next(iter(times_s))
    pairs = zip(times_s[baseline], times_s[AA], strict=True)
    out = {AA_RATIO: median_interval([a / b for a, b in pairs])}
    if PLACED in times_s:
        out[PLACED_RATIO] = median_interval(round_ratios(times_s, baseline, PLACED))
    floor = noise_floor(out)
    for name in times_s:
        if name not in (baseline, AA, PLACED):
            out[name] = ratio(times_s, baseline, name, floor)
    return out


def noise_floor(summary: dict[str, dict]) -> dict:
    """The interval a verdict must clear: the A/A control's, widened where the summary has a
    placement control to its interval and that interval's reciprocal (which of two sets of
    buffers is the baseline's is arbitrary); its coverage the lower of the two."""
    aa = summary[AA_RATIO]
    bounds = list(aa["interval"])
    if placed := summary.get(PLACED_RATIO):
        bounds += [*placed["interval"], *(1 / bound for bound in placed["interval"])]
    coverage = min(aa["coverage"], placed["coverage"]) if placed else aa["coverage"]
    return {"median": aa["median"], "interval": [min(bounds), max(bounds)], "coverage": coverage}


def _stable(times_s: dict[str, list[float]], precision: float) -> bool:
    """Every ratio's interval (the A/A's too) within `precision` of its median."""
    for summary in summarize(times_s).values():
        lo, hi = summary["interval"]
        if max(hi / summary["median"] - 1, 1 - lo / summary["median"]) > precision:
            return False
    return True


def compare(
    samplers: dict[str, Sampler],
    baseline: str,
    *,
    budget_s: float = 60.0,
    min_repeats: int = MIN_REPEATS,
    max_repeats: int = 40,
    precision: float = 0.01,
    warmup: int = 1,
    deadline: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    placement: Sampler | None = None,
) -> dict:
    """Times `samplers` in interleaved rounds with an A/A control (see the module doc).

    placement: the baseline's computation on buffers (and a program) of its own, timed in every
    round after A' as `PLACED`: the placement control, for variants that run on other buffers.

    Returns {"baseline", "repeats", "stopped" ("stable", "budget" or "max_repeats"),
    "elapsed_s", "times_s" (per name, one sample per round: the baseline first, then `AA`,
    then the variants, then `PLACED` where timed), "summary" (`summarize`)}. `warmup` untimed
    rounds come first (compilation, caches); the budget counts from the first timed round;
    `deadline` (a `time.time()`) ends the rounds too, once `min_repeats` ran.
    """
    if baseline not in samplers:
        raise ValueError(f"{baseline=} is not one of the samplers {sorted(samplers)}")
    for control in (AA, PLACED):
        if control in samplers:
            raise ValueError(f"{control!r} names a control; rename that sampler")
    if not 1 <= min_repeats <= max_repeats:
        raise ValueError(f"need 1 <= {min_repeats=} <= {max_repeats=}")
    variants = [name for name in samplers if name != baseline]
    samplers = samplers | ({PLACED: placement} if placement else {})
    forward = [(baseline, baseline), *((v, v) for v in variants), (AA, baseline)]
    forward += [(PLACED, PLACED)] if placement else []
    for _ in range(warmup):
        for _, name in forward:
            samplers[name]()
    times_s: dict[str, list[float]] = {baseline: [], AA: [], **{v: [] for v in variants}}
    times_s |= {PLACED: []} if placement else {}
    start = clock()
    stopped = "max_repeats"
    for repeat in range(max_repeats):
        for key, name in forward if repeat % 2 == 0 else forward[::-1]:
            times_s[key].append(float(samplers[name]()))
        if repeat + 1 < min_repeats:
            continue
        if _stable(times_s, precision):
            stopped = "stable"
            break
        if clock() - start >= budget_s or (deadline is not None and time.time() >= deadline):
            stopped = "budget"
            break
    return {
        "baseline": baseline,
        "repeats": len(times_s[baseline]),
        "stopped": stopped,
        "elapsed_s": clock() - start,
        "times_s": times_s,
        "summary": summarize(times_s),
    }


# Samplers ---------------------------------------------------------------------------------


def wall(call: Callable[[], object], per: int = 1) -> Sampler:
    """Wall time of one `call()` (ended by `jax.block_until_ready` on what it returns) over
    `per` (e.g. the ops one call loops over). `call` takes no argument, so that a training
    step can carry its state from one call to the next."""

    def sample() -> float:
        begin = time.perf_counter()
        jax.block_until_ready(call())
        return (time.perf_counter() - begin) / per

    return sample


def batched(fn, inputs: Sequence[tuple], *, min_sample_s: float = 2e-3, per: int = 1) -> Sampler:
    """Host-dispatched batches of `fn` calls, rotating over `inputs` (tuples of arguments),
    synchronized once a batch: one sample = one batch's seconds per call, over `per`. The batch
    holds enough calls to last ~`min_sample_s` (at least one per input set, at most 200),
    counted from one call timed when the sampler is made (after two warm calls)."""
    for args in inputs[:2]:
        jax.block_until_ready(fn(*args))
    begin = time.perf_counter()
    jax.block_until_ready(fn(*inputs[0]))
    one = max(time.perf_counter() - begin, 1e-7)
    calls = int(min(200, max(len(inputs), min_sample_s / one)))

    def sample() -> float:
        begin = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(*inputs[i % len(inputs)])
        jax.block_until_ready(out)
        return (time.perf_counter() - begin) / calls / per

    return sample


def in_program(fn, inputs: Sequence[tuple], calls: int, **batch) -> Sampler:
    """Device time of one `fn` call inside one jitted program of `calls` dependent calls.

    inputs: 1-tuples, taken in turn. The program is straight-line (no device loop, whose
    per-iteration bookkeeping would be timed too); each call's input passes through an
    optimization barrier together with the previous output, so the calls run one after
    another, and every output is returned, so none is removed as dead code: the time an op has
    inside a training step (launch included, JAX's per-call dispatch excluded). Samples are
    `batched` calls of the program, divided by `calls`.
    """
    args = [a for (a,) in inputs]
    return batched(jax.jit(chained(fn, calls)), [tuple(args)], per=calls, **batch)


def chained(fn, calls: int):
    """The straight-line program of `in_program`, not jitted (a caller may map it over devices
    first): `program(*xs)` -> the outputs of `calls` calls of `fn`, the i-th on `xs[i % len]`
    passed through an optimization barrier with the previous output."""

    def program(*xs):
        outs = [fn(xs[0])]
        for i in range(1, calls):
            x, _ = lax.optimization_barrier((xs[i % len(xs)], outs[-1]))
            outs.append(fn(x))
        return outs

    return program
