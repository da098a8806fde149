"""Tuning "auto" on this machine (`taco_jax.tune`, `taco_jax._tuned`, `policy.tuned_cell`): the
decision rule on synthetic measurements with known answers, the policy file (written, read
back, and a damaged, foreign or stale one ignored in one line), the collectives following a
tuned table under shard_map, the prediction's arithmetic, the summary's sources, and (slow) a
measurement under vmap on the CPU, where a variant with a wrong result is never chosen."""

import json
import logging
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from tp_testing import tp_mesh

import taco_jax as tj
from taco_jax import _tuned, algorithms, collectives, policy, target, timing, tune
from taco_jax.target import Target

KiB, MiB = 1 << 10, 1 << 20
AA = [0.98, 1.02]
TACO = _tuned.codec_key(tj.get_codec("taco"))


def variant(median, lo, hi, aa=AA, seconds=None, verdict=None):
    """A variant measured at `median` [lo, hi] x the plain collective (1 ms), its verdict by
    `timing.verdict` against the A/A interval unless given."""
    return {
        "seconds": seconds if seconds is not None else 1e-3 / median,
        "median": median,
        "interval": [lo, hi],
        "verdict": verdict or timing.verdict([lo, hi], aa),
        "rel_err": 0.03,
    }


def comparison(aa=AA, plain_s=1e-3, **variants):
    return {"plain_s": plain_s, "aa": aa, "repeats": 12, "variants": variants}


def choice_of(op, variants: dict, fused_runs: bool = False):
    return policy.tuned_cell(op, comparison(**variants), fused_runs, "here")


@pytest.fixture(autouse=True)
def no_table_installed():
    """Each test starts with the file's table (no table a trainer of this process installed)."""
    _tuned.uninstall()
    yield
    _tuned.uninstall()


@pytest.fixture
def installed():
    """Installs a table for this test only (a process's table, as the trainer installs it)."""

    def install(entries):
        table = _tuned.Table("tuned.json", "today", entries)
        _tuned.install(table)
        return table

    yield install
    _tuned.uninstall()


def test_level_means_plain():
    """1.01x [0.99, 1.03]: inside the A/A control's interval, and covering 1: level, plain; the
    algorithm is the fastest measured (what a forced compression runs)."""
    choice = choice_of(
        "all_reduce", dict(one_shot=variant(1.01, 0.99, 1.03), two_shot=variant(0.9, 0.88, 0.92))
    )
    assert (choice.compress, choice.algorithm) == (False, "one_shot"), choice.reason
    assert "level" in choice.reason


def test_above_one_but_within_the_noise_floor_is_level():
    """1.08x [1.04, 1.12] with an A/A control of [0.90, 1.15]: the run cannot tell it from
    noise (the shipped table's 1.05x threshold would have compressed)."""
    aa = [0.90, 1.15]
    stats = variant(1.08, 1.04, 1.12, aa=aa)
    assert stats["verdict"] == "level"
    choice = policy.tuned_cell("all_reduce", comparison(aa=aa, one_shot=stats), False, "here")
    assert not choice.compress


def test_faster_beyond_the_control_compresses_with_the_fastest():
    choice = choice_of(
        "all_reduce", dict(one_shot=variant(1.3, 1.25, 1.35), two_shot=variant(1.5, 1.45, 1.55))
    )
    assert (choice.compress, choice.algorithm) == (True, "two_shot"), choice.reason


def test_overlapping_intervals_prefer_one_quantization():
    """Two-shot's median is ahead but the intervals overlap: the run does not tell them apart,
    and one-shot quantizes once."""
    choice = choice_of(
        "all_reduce", dict(one_shot=variant(1.3, 1.2, 1.4), two_shot=variant(1.35, 1.28, 1.42))
    )
    assert (choice.compress, choice.algorithm) == (True, "one_shot"), choice.reason


def test_a_wrong_result_or_a_kernel_that_cannot_run_is_never_chosen():
    fused = variant(2.0, 1.9, 2.1, verdict="wrong")
    variants = {"fused": fused, "one_shot": variant(1.2, 1.15, 1.25)}
    assert choice_of("all_reduce", variants, True).algorithm == "one_shot"
    variants["fused"] = variant(2.0, 1.9, 2.1)
    assert choice_of("all_reduce", variants, True).algorithm == "fused"
    assert choice_of("all_reduce", variants).algorithm == "one_shot"


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_the_pair_reads_the_exchange_that_runs(op):
    """The reduce-scatter / all-gather exchange through the fused kernel wherever it runs
    (`collectives._exchange_fused`), so only its row decides there; elsewhere NCCL's ("-")."""
    variants = {"-": variant(1.0, 0.97, 1.03), "fused": variant(1.4, 1.35, 1.45)}
    assert choice_of(op, variants, True).compress
    assert not choice_of(op, variants).compress
    assert choice_of(op, variants, True).algorithm == "-"


def _entry(op="all_reduce", codec=TACO, **by_size):
    return {op: {size: {codec: c} for size, c in by_size.items()}}


def test_between_measured_sizes_both_must_pay_and_n4_is_measured(installed):
    """N = 4 decides from its own measurements (one-shot faster at 4 MiB), not from a model;
    a size between a plain one and a compressed one stays plain; above the largest measured
    size as the largest; below the smallest, plain."""
    plain = comparison(one_shot=variant(0.8, 0.78, 0.82), two_shot=variant(0.7, 0.68, 0.72))
    pays = comparison(one_shot=variant(1.4, 1.35, 1.45), two_shot=variant(1.1, 1.05, 1.15))
    installed({(4, "nvlink"): {"all_reduce": {MiB: {TACO: plain}, 4 * MiB: {TACO: pays}}}})
    decide = lambda nbytes: policy.tuned_choice("all_reduce", "nvlink", 4, nbytes, TACO)  # noqa: E731
    assert not decide(MiB // 2).compress
    assert not decide(2 * MiB).compress
    assert (decide(4 * MiB).compress, decide(4 * MiB).algorithm) == (True, "one_shot")
    assert decide(64 * MiB).compress
    assert policy.tuned_choice("all_reduce", "nvlink", 8, 4 * MiB, TACO) is None  # not measured
    assert policy.tuned_choice("all_reduce", "nvlink", 4, 4 * MiB, "int6_hadamard@128") is None


def test_times_of_the_kernels_are_not_read_for_the_jnp_reference(installed):
    """A table timed with the kernels ("auto", "pallas": one key) decides for them only: a run
    of the jnp reference (impl="xla") finds no cell of its own and compresses as untuned."""
    assert _tuned.codec_key(collectives.collective_codec("taco"), "pallas") == TACO
    assert _tuned.codec_key(collectives.collective_codec("taco"), "xla") == f"{TACO}/xla"
    level = comparison(one_shot=variant(1.0, 0.97, 1.03), two_shot=variant(0.9, 0.87, 0.93))
    installed({(2, "shm"): {"all_reduce": {MiB: {TACO: level}}}})
    for impl, compress in (("auto", False), ("pallas", False), ("xla", True)):
        cfg = tj.comm_config("taco", link="shm", impl=impl)
        assert policy.decide(cfg, "all_reduce", MiB, 2, Target(link="shm")).compress is compress


def _lowered(fn, nbytes: int, tp: int = 2) -> str:
    mesh = tp_mesh(tp)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    spec = jax.ShapeDtypeStruct((tp * nbytes // 2,), jnp.bfloat16)
    return jax.jit(mapped).lower(spec).as_text()


def _moves_uint8(text: str) -> bool:
    return "xui8" in text and ("all_gather" in text or "all_to_all" in text)


def test_collectives_follow_a_tuned_table_on_a_mesh_never_under_vmap(installed):
    """CPU devices of one process (link "shm"), with a table measured for them: plain where it
    measured level, compressed (one-shot) where faster. Under vmap nothing moves: the table is
    not read, every message compressed."""
    level = comparison(one_shot=variant(1.0, 0.97, 1.03), two_shot=variant(0.9, 0.87, 0.93))
    pays = comparison(one_shot=variant(1.4, 1.35, 1.45), two_shot=variant(1.2, 1.15, 1.25))
    installed({(2, "shm"): {"all_reduce": {64 * KiB: {TACO: level}, 256 * KiB: {TACO: pays}}}})
    psum = lambda v: tj.compressed_psum(v, "tp", codec="taco")  # noqa: E731
    assert not _moves_uint8(_lowered(psum, 64 * KiB))
    assert _moves_uint8(_lowered(psum, 256 * KiB))
    with policy.recording() as calls:
        _lowered(psum, 256 * KiB)
    (call,) = [c for cs in calls.values() for c in cs]
    assert (call.link, call.choice.algorithm, call.choice.compress) == ("shm", "one_shot", True)
    with policy.recording() as calls:
        jax.jit(jax.vmap(psum, axis_name="tp")).lower(jnp.zeros((2, 32 * KiB), jnp.bfloat16))
    (call,) = [c for cs in calls.values() for c in cs]
    assert (call.link, call.choice.algorithm, call.choice.compress) == (None, "two_shot", True)


def test_auto_fuses_a_group_above_two_only_where_its_table_measured_fused(installed):
    """N = 4 on NVLink, traced for a Hopper GPU (whose fused kernel runs): the shipped table
    measured N = 2 only, so "auto" never fuses there; a tuned table whose N = 4 row measured
    fused faster than the rest makes it run the fused exchange."""
    spec = jax.ShapeDtypeStruct((4 * 8 * MiB,), jnp.bfloat16)  # 16 MiB per rank

    def traced() -> str:  # a fresh function each time: jit caches traces by function
        psum = lambda v: tj.compressed_psum(v, "tp", link="nvlink")  # noqa: E731
        mapped = jax.shard_map(psum, mesh=tp_mesh(4), in_specs=P("tp"), out_specs=P("tp"))
        with target.assume(backend="gpu", hopper=True):
            return str(jax.jit(mapped).trace(spec).jaxpr)

    assert "taco_encode_all_gather" not in traced()
    fast_fused = comparison(
        one_shot=variant(1.1, 1.05, 1.15),
        two_shot=variant(1.2, 1.15, 1.25),
        fused=variant(1.6, 1.55, 1.65),
    )
    installed({(4, "nvlink"): {"all_reduce": {16 * MiB: {TACO: fast_fused}}}})
    assert "taco_encode_all_gather" in traced()


def _call(op, nbytes, codec="taco", compress_algorithm=None, n_ranks=2):
    cfg = tj.comm_config(codec, link="shm")
    choice = policy.Choice(compress_algorithm is not None, compress_algorithm or "-", "")
    return policy.Call(cfg, op, nbytes, "tp", n_ranks, False, Target(link="shm"), choice)


def test_the_prediction_is_counts_times_measured_times(installed):
    """Each collective's count x the measured seconds of the plain op and of what the policy
    chooses now (here from the installed table: one-shot at 256 KiB, plain at 64 KiB); the
    identity codec's calls cost the plain time of their size; an unmeasured size, or a codec
    the table did not measure, is named and left out."""
    level = comparison(plain_s=2e-4, one_shot=variant(1.0, 0.97, 1.03, seconds=2e-4))
    pays = comparison(plain_s=1e-3, one_shot=variant(1.25, 1.2, 1.3, seconds=8e-4))
    gather = comparison(plain_s=5e-4, **{"-": variant(1.0, 0.97, 1.03, seconds=5e-4)})
    table = installed(
        {
            (2, "shm"): {
                "all_reduce": {64 * KiB: {TACO: level}, 256 * KiB: {TACO: pays}},
                "all_gather": {64 * KiB: {TACO: gather}},
            }
        }
    )
    counted = [
        (_call("all_reduce", 256 * KiB), 12),
        (_call("all_reduce", 64 * KiB), 3),
        (_call("all_gather", 64 * KiB, codec="none"), 2),
        (_call("reduce_scatter", 64 * KiB), 5),  # not measured
        (_call("all_reduce", 256 * KiB, codec="int6_hadamard"), 7),  # another codec: not measured
    ]
    prediction = tune.predict(counted, table, "shm")
    assert prediction.plain_s == pytest.approx(12 * 1e-3 + 3 * 2e-4 + 2 * 5e-4)
    assert prediction.chosen_s == pytest.approx(12 * 8e-4 + 3 * 2e-4 + 2 * 5e-4)
    assert prediction.unmeasured == ("reduce_scatter 64 KiB x 5", "all_reduce 256 KiB x 7")
    lines = "\n".join(prediction.lines)
    assert (
        "all_reduce 256 KiB x 12 (taco@128, N = 2 on shm): one_shot 1.25x [1.20, 1.30] faster"
        in lines
    )
    assert (
        "all_reduce 64 KiB x 3 (taco@128, N = 2 on shm): plain (one_shot 1.00x [0.97, 1.03] level)"
        in lines
    )
    assert "-2.40 ms" in prediction.line() and "-24.0% of a 10.0 ms step" in prediction.line(1e-2)


def _written(tmp_path, monkeypatch):
    monkeypatch.setenv("TACO_JAX_POLICY_FILE", str(tmp_path / "policy.json"))
    entries = {
        (2, "shm"): {"all_reduce": {MiB: {TACO: comparison(one_shot=variant(1.2, 1.1, 1.3))}}}
    }
    return _tuned.write(_tuned.default_path(), entries, "test"), entries


def test_the_policy_file_reads_back_and_merges(tmp_path, monkeypatch):
    path, entries = _written(tmp_path, monkeypatch)
    assert _tuned.read(path).entries == entries
    more = {(2, "shm"): {"all_gather": {MiB: {TACO: comparison()}}}, (4, "shm"): {}}
    _tuned.write(path, more, "test")
    table = _tuned.read(path)
    assert set(table.entries) == {(2, "shm"), (4, "shm")}
    assert set(table.entries[(2, "shm")]) == {"all_reduce", "all_gather"}
    assert _tuned.current().entries == table.entries  # the file the environment names
    assert "python -m taco_jax.tune --tp 2" not in policy.source(2, "shm", TACO, real_link=False)
    assert "tuned table" in policy.source(2, "shm", TACO, real_link=False)
    assert "no tuned table for N = 8" in policy.source(8, "shm", TACO, real_link=False)


def test_the_file_is_named_by_the_machine_in_the_cache_directory(tmp_path, monkeypatch):
    """Without `TACO_JAX_POLICY_FILE`, the project's cache directory holds one file per machine:
    one that differs in anything the fingerprint holds looks for another name."""
    monkeypatch.setenv("TACO_JAX_POLICY_FILE", "")
    monkeypatch.setenv("TACO_JAX_CACHE", str(tmp_path))
    path = _tuned.default_path()
    assert path.parent == tmp_path and re.fullmatch(r"policy-[0-9a-f]{16}\.json", path.name)
    here = _tuned.fingerprint()
    other = _tuned.default_path({**here, "devices": here["devices"] + 1})
    assert other.parent == tmp_path and other != path


@pytest.mark.parametrize(
    "spoil,why",
    [
        (lambda data: "{not json", "damaged"),
        (lambda data: {**data, "entries": [{"n_ranks": 2}]}, "damaged"),
        (lambda data: {**data, "fingerprint": {**data["fingerprint"], "devices": 4096}}, "foreign"),
        (lambda data: {**data, "taco_jax": "0.0.1"}, "stale"),
    ],
)
def test_a_damaged_foreign_or_stale_file_is_ignored_in_one_line(
    tmp_path, monkeypatch, caplog, spoil, why
):
    path, _ = _written(tmp_path, monkeypatch)
    spoiled = spoil(json.loads(path.read_text()))
    path.write_text(spoiled if isinstance(spoiled, str) else json.dumps(spoiled))
    with caplog.at_level(logging.WARNING, logger="taco_jax.policy"):
        assert _tuned.current() is None
        assert _tuned.current() is None  # read again: not said again
        cfg = tj.comm_config("taco", link="shm")
        assert policy.decide(cfg, "all_reduce", MiB, 2, Target(link="shm")).compress
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"{path}: {why}" in lines[0], lines


def test_the_summary_names_its_source_and_fused_only_where_it_runs(installed):
    """The tuned table's sizes where it measured the group, the shipped table's elsewhere; a
    tuned "fused" faster than all is not named where its kernel does not run (`fused_kernel_runs`
    of the group's target: a Hopper GPU storing into its peers, the kernels compiled)."""
    fast_fused = comparison(
        one_shot=variant(1.0, 0.97, 1.03),
        two_shot=variant(0.9, 0.87, 0.93),
        fused=variant(1.5, 1.45, 1.55),
    )
    installed({(2, "nvlink"): {"all_reduce": {16 * MiB: {TACO: fast_fused}}}})
    hopper = Target(backend="gpu", hopper=True, real_link=True, link="nvlink", peer_stores=True)
    assert algorithms.fused_kernel_runs(hopper)
    assert not algorithms.fused_kernel_runs(hopper, impl="xla")
    assert not algorithms.fused_kernel_runs(Target(backend="gpu", real_link=True, link="nvlink"))
    assert not algorithms.fused_kernel_runs(Target())  # the CPU
    text = policy.summary("nvlink", 2)
    assert "all_reduce on nvlink, N = 2 (tuned): 16 MiB plain" in text
    assert "fused" not in text
    assert "all_reduce on nvlink, N = 2 (tuned): 16 MiB fused" in policy.summary(
        "nvlink", 2, fused=True
    )
    assert "reduce_scatter on nvlink, N = 2 (shipped)" in text
    shipped = policy.summary("nvlink", 2, fused=False)
    assert "fused" not in shipped.split("\n", 1)[1]  # the pair's shipped fused rows unread too


@pytest.mark.slow
def test_measure_under_vmap_times_and_checks_every_variant():
    """On the CPU under vmap (the codec's cost): every variant timed against the plain op with
    an A/A control and checked against its result (`tune.measure`); a variant whose result is
    wrong (here, two-shot's program made to return zeros) is marked "wrong" and never chosen,
    however fast."""
    group = tune.Group(2, _tuned.EMULATED)
    ops = tune.measure(group, {"all_reduce": [64 * KiB]}, ["taco"], budget_s=2, say=print)
    result = ops["all_reduce"][64 * KiB][TACO]
    assert set(result["variants"]) == {"one_shot", "two_shot"}
    assert result["repeats"] >= timing.MIN_REPEATS and len(result["aa"]) == 2
    for stats in result["variants"].values():
        # tune's own rule: a result within WRONG_FACTOR x the codec's round trip is not wrong
        assert stats["verdict"] != "wrong"
        assert stats["rel_err"] <= tune.WRONG_FACTOR * result["roundtrip_err"]
        lo, hi = stats["interval"]
        assert lo <= stats["median"] <= hi

    codec, calls = collectives.collective_codec("taco"), tune.MIN_CALLS
    programs = tune._programs(group, "all_reduce", [codec], "auto", calls)
    two_shot = tune._op("all_reduce", group.axis, codec, "two_shot")
    programs[(TACO, "two_shot")] = tune._program(
        lambda v: jnp.zeros_like(two_shot(v)), group, calls
    )
    x = tune._message(group, tune._elements("all_reduce", 64 * KiB, 2), seed=0)
    result = tune._checked_times(programs, x, [codec], calls, 2, tune._Clock())[TACO]
    one_shot, two_shot = result["variants"]["one_shot"], result["variants"]["two_shot"]
    assert one_shot["verdict"] != "wrong"
    assert one_shot["rel_err"] <= tune.WRONG_FACTOR * result["roundtrip_err"]
    assert two_shot["verdict"] == "wrong" and two_shot["rel_err"] == pytest.approx(1.0)
    assert policy.tuned_cell("all_reduce", result, False, "here").algorithm == "one_shot"
