"""The timing harness (`taco_jax.timing`) on synthetic timings with known answers: the
order-statistic interval, the verdict rule, and the interleaved rounds with their A/A control."""

import math

import numpy as np
import pytest

from taco_jax import timing


def test_interval_is_the_order_statistics_of_the_binomial():
    """20 values: P(Binomial(20, 1/2) <= 5) = 0.0207 (<= 2.5%) and P(<= 6) = 0.0577, so the 95%
    interval is the 6th smallest to the 6th largest, covering 1 - 2 x 0.0207 = 95.9%."""
    out = timing.median_interval([float(v) for v in range(20, 0, -1)])
    assert out["interval"] == [6.0, 15.0]
    assert out["median"] == 10.5
    assert math.isclose(out["coverage"], 1 - 2 * sum(math.comb(20, i) for i in range(6)) / 2**20)
    # 6 values: [min, max] covers 1 - 2 / 64 >= 95%; 5 values cover 1 - 2 / 32 < 95% only.
    assert timing.median_interval([3.0, 1, 2, 6, 5, 4])["interval"] == [1.0, 6.0]
    assert timing.median_interval([1.0, 2, 3, 4, 5])["coverage"] == 1 - 2 / 32


def test_interval_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="no values"):
        timing.median_interval([])


@pytest.mark.parametrize(
    "interval,aa,verdict",
    [
        ((1.03, 1.07), (0.99, 1.01), "faster"),
        ((1.03, 1.07), (0.98, 1.04), "level"),  # above 1, not above the A/A interval
        ((1.01, 1.07), (0.95, 1.005), "faster"),
        ((0.99, 1.07), (0.90, 0.95), "level"),  # includes 1
        ((0.90, 0.95), (0.99, 1.01), "slower"),
        ((0.90, 0.97), (0.96, 1.01), "level"),  # below 1, not below the A/A interval
    ],
)
def test_verdict_rule(interval, aa, verdict):
    assert timing.verdict(interval, aa) == verdict


class FakeClock:
    """Time that advances by each sample's seconds: a budget counted in simulated time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def synthetic(speedup: float, noise: float, seed: int, clock: FakeClock | None = None):
    """A baseline of 1 s and a variant of 1 / speedup s, each sample scaled by exp(N(0, noise))
    (log-normal, as timing noise is multiplicative)."""
    rng = np.random.default_rng(seed)

    def sampler(seconds):
        def sample():
            t = seconds * math.exp(rng.normal(0.0, noise))
            if clock is not None:
                clock.now += t
            return t

        return sample

    return {"base": sampler(1.0), "variant": sampler(1.0 / speedup)}


def verdict_of(speedup, noise, seed, rounds=20):
    out = timing.compare(
        synthetic(speedup, noise, seed), "base", min_repeats=rounds, max_repeats=rounds, warmup=0
    )
    return out["summary"]["variant"]["verdict"], out


def test_five_percent_faster_at_low_noise_is_faster():
    """1% noise a sample: a paired ratio's noise is ~1.4%, its median's interval over 20 rounds
    about +-0.7%, far from 1.05; in every one of 20 seeds."""
    for seed in range(20):
        verdict, out = verdict_of(1.05, 0.01, seed)
        assert verdict == "faster", out["summary"]
        assert out["summary"]["variant"]["median"] == pytest.approx(1.05, rel=0.02)


def test_five_percent_faster_at_high_noise_is_level():
    """20% noise a sample: the interval of the median over 20 rounds spans about +-10%, which
    a 5% difference cannot clear; level in every one of 20 seeds."""
    for seed in range(20):
        verdict, out = verdict_of(1.05, 0.20, seed)
        assert verdict == "level", out["summary"]


def test_a_true_a_a_is_level():
    """The variant is the baseline: a verdict needs its 95% interval to miss 1 (<= 5% of runs)
    and to clear the A/A interval too, so at most 5% of 200 seeds, 10 expected, may say
    otherwise; 20 is 3.2 standard deviations above that."""
    wrong = sum(verdict_of(1.0, 0.05, seed)[0] != "level" for seed in range(200))
    assert wrong <= 20


def test_rounds_interleave_with_the_baseline_twice():
    """Each round times the baseline first and last (A'), reversed every other round."""
    calls = []
    samplers = {name: (lambda n=name: calls.append(n) or 1.0) for name in ("a", "b", "c")}
    out = timing.compare(samplers, "a", min_repeats=2, max_repeats=2, warmup=0)
    assert calls == ["a", "b", "c", "a", "a", "c", "b", "a"]
    assert list(out["times_s"]) == ["a", timing.AA, "b", "c"]
    assert out["repeats"] == 2  # constant times: stable at the minimum


def test_rounds_stop_when_stable_or_out_of_budget():
    """Noise of 0.1%: every interval is within 1% of its median at the minimum of 6 rounds.
    Noise of 30% with a budget of 20 simulated seconds (~3 s a round): the budget ends it."""
    stable = timing.compare(synthetic(1.05, 0.001, 0), "base", warmup=0)
    assert (stable["stopped"], stable["repeats"]) == ("stable", timing.MIN_REPEATS)
    clock = FakeClock()
    spent = timing.compare(
        synthetic(1.05, 0.3, 0, clock), "base", warmup=0, budget_s=20.0, clock=clock
    )
    assert spent["stopped"] == "budget"
    assert timing.MIN_REPEATS <= spent["repeats"] < 40


def test_summary_recomputes_from_the_raw_times():
    out = timing.compare(synthetic(1.2, 0.05, 3), "base", min_repeats=8, max_repeats=8)
    assert timing.summarize(out["times_s"]) == out["summary"]


def test_compare_names_a_wrong_baseline():
    with pytest.raises(ValueError, match="baseline='nope'"):
        timing.compare({"a": lambda: 1.0}, "nope")


def with_placement(speedup: float, placed: float, seed: int, rounds: int = 20) -> dict:
    """`synthetic` at 1% noise, with a placement control: the baseline's computation taking
    1 / `placed` s (on buffers of its own)."""
    samplers = synthetic(speedup, 0.01, seed)
    placement = synthetic(placed, 0.01, seed + 1000)["variant"]
    return timing.compare(
        samplers, "base", placement=placement, min_repeats=rounds, max_repeats=rounds, warmup=0
    )


def test_the_placement_control_is_timed_every_round_after_the_a_a():
    calls = []
    samplers = {name: (lambda n=name: calls.append(n) or 1.0) for name in ("a", "b")}
    out = timing.compare(
        samplers, "a", placement=lambda: calls.append("p") or 1.0, min_repeats=2, warmup=0
    )
    assert calls[:8] == ["a", "b", "a", "p", "p", "a", "b", "a"]
    assert list(out["times_s"]) == ["a", timing.AA, "b", timing.PLACED]
    assert set(out["summary"]) == {timing.AA_RATIO, timing.PLACED_RATIO, "b"}


@pytest.mark.parametrize("speedup", [1.10, 1 / 1.10])
def test_a_difference_the_placement_control_shows_is_level(speedup):
    """1% noise a sample: 20 rounds give each ratio an interval of about +-0.7%, so a variant
    10% faster or slower is "faster" or "slower" against the A/A control alone. When the same
    computation on buffers of its own runs 15% slower (a ratio of 0.85, its reciprocal 1.18),
    the floor spans [~0.84, ~1.19], which 1.10 and 0.91 do not clear; in every one of 20 seeds."""
    alone = "faster" if speedup > 1 else "slower"
    for seed in range(20):
        assert verdict_of(speedup, 0.01, seed)[0] == alone
        out = with_placement(speedup, 0.85, seed)
        floor = timing.noise_floor(out["summary"])
        assert floor["interval"][0] < 0.86 and floor["interval"][1] > 1 / 0.86, floor
        assert out["summary"]["variant"]["verdict"] == "level", out["summary"]


def test_a_placement_control_like_its_a_a_leaves_verdicts_alone():
    """A placement control that reads like the A/A (same buffers' speed, 1% noise) widens the
    floor by the control's own interval only: a 5% difference stays "faster"."""
    for seed in range(20):
        out = with_placement(1.05, 1.0, seed)
        assert out["summary"]["variant"]["verdict"] == "faster", out["summary"]


def test_the_floor_without_a_placement_control_is_the_a_a():
    out = timing.compare(synthetic(1.2, 0.05, 3), "base", min_repeats=8, max_repeats=8)
    assert timing.noise_floor(out["summary"]) == out["summary"][timing.AA_RATIO]


def test_a_summary_with_a_placement_control_recomputes_from_the_raw_times():
    out = with_placement(1.2, 0.9, 3, rounds=8)
    assert timing.summarize(out["times_s"]) == out["summary"]


@pytest.mark.parametrize("name", [timing.AA, timing.PLACED])
def test_a_sampler_may_not_take_a_control_s_name(name):
    with pytest.raises(ValueError, match="names a control"):
        timing.compare({"a": lambda: 1.0, name: lambda: 1.0}, "a")
