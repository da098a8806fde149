"""The "auto" policy (`taco_jax.policy`): its rule on a known table, the measured table itself,
link detection, explicit options, and what the collectives run when the policy says so.

The GPU path is exercised on the CPU by declaring the link real (`on_real_link` patched): the
decision only reads the table; what the collectives then run is read from the lowered program
(a plain all-reduce, or uint8 collectives)."""

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from tp_testing import tp_mesh

import taco_jax as tj
from taco_jax import _policy_table, collectives, policy

MiB = 1 << 20
BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
# A table with known answers: compress from 16 MiB; two-shot wins at 16 MiB, one-shot above;
# at 256 MiB only one-shot pays (what N > 2, which runs two-shot, must not be told).
FAKE = {
    "all_reduce": {
        "one_shot": {MiB: 0.5, 16 * MiB: 1.2, 64 * MiB: 1.9, 256 * MiB: 1.5},
        "two_shot": {MiB: 0.4, 16 * MiB: 1.3, 64 * MiB: 1.5, 256 * MiB: 1.0},
    },
    "reduce_scatter_all_gather": {"-": {MiB: 1.04, 16 * MiB: 1.06, 64 * MiB: 1.5}},
}


@pytest.fixture
def fake_table(monkeypatch):
    monkeypatch.setattr(_policy_table, "SPEEDUPS", {"nvlink": FAKE, "shm": FAKE, "socket": FAKE})


@pytest.mark.parametrize(
    "op,n_ranks,nbytes,compress,algorithm",
    [
        ("all_reduce", 2, MiB // 2, False, "one_shot"),  # below every measured size: no evidence
        ("all_reduce", 2, MiB, False, "one_shot"),  # measured slower (one-shot the less slow)
        ("all_reduce", 2, 8 * MiB, False, "one_shot"),  # between a no and a yes: no
        ("all_reduce", 2, 16 * MiB, True, "two_shot"),
        ("all_reduce", 2, 32 * MiB, True, "two_shot"),  # between two yeses: yes
        ("all_reduce", 2, 64 * MiB, True, "one_shot"),
        ("all_reduce", 2, 1 << 40, True, "one_shot"),  # above: the largest measured size
        ("all_reduce", 4, 64 * MiB, True, "two_shot"),  # N > 2: two-shot's own row decides
        ("all_reduce", 4, 128 * MiB, False, "two_shot"),  # ... a yes and a no: no
        ("all_reduce", 4, 256 * MiB, False, "two_shot"),
        ("reduce_scatter", 2, MiB, False, "-"),  # 1.04x is within noise (MIN_SPEEDUP)
        ("all_gather", 2, 16 * MiB, True, "-"),
    ],
)
def test_rule_on_a_known_table(fake_table, op, n_ranks, nbytes, compress, algorithm):
    choice = policy.measured_choice(op, "nvlink", n_ranks, nbytes)
    assert (choice.compress, choice.algorithm) == (compress, algorithm), choice.reason


@pytest.mark.parametrize("two_shot,algorithm", [(1.21, "one_shot"), (1.3, "two_shot")])
def test_algorithms_within_the_spread_prefer_one_quantization(monkeypatch, two_shot, algorithm):
    """Two-shot 0.8% ahead (within `TIE`) loses to one-shot, which quantizes once; 8% ahead it
    wins. Between two that quantize once, the faster wins."""
    table = {"all_reduce": {"one_shot": {MiB: 1.2}, "two_shot": {MiB: two_shot}}}
    monkeypatch.setattr(_policy_table, "SPEEDUPS", {"nvlink": table})
    choose = lambda: policy.measured_choice("all_reduce", "nvlink", 2, MiB)  # noqa: E731
    assert choose().algorithm == algorithm
    table["all_reduce"]["fused"] = {MiB: 1.19}
    assert choose().algorithm == algorithm
    table["all_reduce"]["fused"] = {MiB: 1.22}
    assert choose().algorithm == ("fused" if algorithm == "one_shot" else "two_shot")


def test_compression_follows_the_algorithm_that_runs(monkeypatch):
    """Two-shot at 1.06x and one-shot at 1.04x are a tie that one-shot wins; one-shot is below
    MIN_SPEEDUP, so nothing is compressed."""
    table = {"all_reduce": {"one_shot": {MiB: 1.04}, "two_shot": {MiB: 1.06}}}
    monkeypatch.setattr(_policy_table, "SPEEDUPS", {"nvlink": table})
    choice = policy.measured_choice("all_reduce", "nvlink", 2, MiB)
    assert (choice.compress, choice.algorithm) == (False, "one_shot"), choice.reason


def test_forced_compression_runs_the_faster_measured_algorithm(fake_table, monkeypatch):
    """min_compress_bytes=0 says whether; "auto" still says how, from the table."""
    monkeypatch.setattr(policy, "on_real_link", lambda axis_name: True)
    cfg = tj.comm_config(link="nvlink", min_compress_bytes=0)
    choice = policy.choose(cfg, "all_reduce", MiB, "tp", 2)
    assert (choice.compress, choice.algorithm) == (True, "one_shot")


def test_shipped_table_is_the_records():
    """`_policy_table` equals what benchmarks/policy_table.py makes of the records it names."""
    spec = importlib.util.spec_from_file_location("policy_table", BENCHMARKS / "policy_table.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    for link, source in _policy_table.SOURCES.items():
        record = json.loads((BENCHMARKS / "results" / source["record"]).read_text())
        assert generator.speedups(record, _policy_table.CODEC) == _policy_table.SPEEDUPS[link]
        assert record["command"] == source["command"]


def test_measured_table_sizes_follow_the_rule():
    """At every measured size of the shipped table (N = 2), whose both neighbours are itself:
    compress exactly where the chosen algorithm's speedup reached MIN_SPEEDUP; the chosen one is
    the fastest or one measured within `TIE` of it that quantizes no more often."""
    for link, ops in _policy_table.SPEEDUPS.items():
        assert link in policy.LINKS and set(ops) == set(policy.TABLE_OPS.values())
        for op, table_op in policy.TABLE_OPS.items():
            rows = ops[table_op]
            for size in rows[next(iter(rows))]:
                best = max(rows, key=lambda a: rows[a][size])  # noqa: B023
                choice = policy.measured_choice(op, link, 2, size)
                chosen = choice.algorithm if op == "all_reduce" else best
                assert choice.compress == (rows[chosen][size] >= policy.MIN_SPEEDUP)
                if op != "all_reduce":
                    assert choice.algorithm == "-"
                    continue
                assert rows[chosen][size] * (1 + policy.TIE) >= rows[best][size]
                assert policy.QUANTIZATIONS[chosen] <= policy.QUANTIZATIONS[best]


def test_bad_link_names_the_value():
    with pytest.raises(ValueError, match="link='pcie'"):
        tj.comm_config(link="pcie")
    with pytest.raises(ValueError, match="min_compress_bytes=-1"):
        tj.comm_config(min_compress_bytes=-1)


def test_real_link_only_under_shard_map_on_gpu(monkeypatch):
    """vmap emulation never counts as a link (no bytes move), even on a GPU."""
    seen = {}
    monkeypatch.setattr(policy.jax, "default_backend", lambda: "gpu")

    def probe(tag):
        def fn(v):
            seen[tag] = policy.on_real_link("tp")
            return v

        return fn

    mesh = tp_mesh(2)
    jax.jit(jax.shard_map(probe("shard_map"), mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(
        jnp.zeros(4)
    )
    jax.jit(jax.vmap(probe("vmap"), axis_name="tp"))(jnp.zeros((2, 4)))
    assert seen == {"shard_map": True, "vmap": False}


def _lowered(fn, nbytes: int, tp: int = 2) -> str:
    """The lowered text of `fn` per rank under shard_map on a bf16 message of `nbytes`/rank."""
    mesh = tp_mesh(tp)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    spec = jax.ShapeDtypeStruct((tp * nbytes // 2,), jnp.bfloat16)
    return jax.jit(mapped).lower(spec).as_text()


def _moves_uint8(text: str) -> bool:
    return "xui8" in text and ("all_gather" in text or "all_to_all" in text)


@pytest.mark.parametrize(
    "link,nbytes,with_fused,compressed",
    [
        ("nvlink", 64 * MiB, True, False),
        ("nvlink", MiB, False, False),
        ("socket", MiB, False, False),
        ("socket", 64 * MiB, True, True),
    ],
)
def test_collectives_follow_the_measured_choice(monkeypatch, link, nbytes, with_fused, compressed):
    """Read from the shipped table. On NVLink only the fused kernel measured a gain (from 16
    MiB): where it cannot run (here, a CPU posing as a GPU link) the table's other rows decide,
    and they say plain; sockets measured one from 16 MiB with every algorithm."""
    monkeypatch.setattr(policy, "on_real_link", lambda axis_name: True)
    assert policy.measured_choice("all_reduce", link, 2, nbytes).compress == with_fused
    expected = policy.measured_choice("all_reduce", link, 2, nbytes, fused=False)
    assert expected.compress == compressed
    text = _lowered(lambda v: tj.compressed_psum(v, "tp", link=link), nbytes)
    assert _moves_uint8(text) == compressed
    assert ("all_reduce" in text) == (not compressed)


@pytest.mark.parametrize("per_rank,compressed", [(MiB // 2, True), (MiB // 4, False)])
def test_all_gather_reads_its_output_size(monkeypatch, per_rank, compressed):
    """Sockets: the pair measured 1.14x from 1 MiB; an all-gather of 0.5 MiB per rank at N = 2
    makes 1 MiB (compressed), of 0.25 MiB makes 0.5 MiB (below the table: plain)."""
    monkeypatch.setattr(policy, "on_real_link", lambda axis_name: True)
    gather = lambda v: tj.compressed_all_gather(v, "tp", link="socket", tiled=True)  # noqa: E731
    text = _lowered(gather, per_rank)
    assert _moves_uint8(text) == compressed


def test_explicit_options_win(monkeypatch):
    monkeypatch.setattr(policy, "on_real_link", lambda axis_name: True)
    forced = _lowered(
        lambda v: tj.compressed_psum(v, "tp", link="nvlink", min_compress_bytes=0), MiB
    )
    assert _moves_uint8(forced)
    # An explicit algorithm says how, not whether: NVLink's table still says plain.
    how = _lowered(
        lambda v: tj.compressed_psum(v, "tp", link="nvlink", algorithm="one_shot"), 64 * MiB
    )
    assert not _moves_uint8(how)
    cfg = tj.comm_config(link="socket", algorithm="two_shot")
    choice = policy.choose(cfg, "all_reduce", 64 * MiB, "tp", 2)
    assert (choice.compress, choice.algorithm) == (True, "two_shot")


def test_no_real_link_compresses_everything():
    cfg = tj.comm_config()
    choice = policy.choose(cfg, "all_reduce", 1, "tp", 2)  # on the CPU: no real link
    assert (choice.compress, choice.algorithm) == (True, "two_shot")
    assert not policy.choose(tj.comm_config("none"), "all_reduce", 1 << 30, "tp", 2).compress


def test_summary_names_every_op_and_size():
    text = policy.summary("socket")
    assert text.count("\n") == len(policy.TABLE_OPS) - 1
    assert "all_reduce on socket, N = 2 (shipped): 1 MiB plain" in text


def test_fused_only_where_its_kernel_runs(monkeypatch):
    """NVLink's table picks "fused" (from 16 MiB) where its kernel runs; where it does not, the
    policy reads the other rows (plain there), and an explicit "fused" runs one-shot."""
    monkeypatch.setattr(policy, "on_real_link", lambda axis_name: True)
    cfg = tj.comm_config(link="nvlink")
    choice = policy.choose(cfg, "all_reduce", 64 * MiB, "tp", 2, fused_available=True)
    assert (choice.compress, choice.algorithm) == (True, "fused")
    assert not policy.choose(cfg, "all_reduce", 64 * MiB, "tp", 2).compress
    forced = tj.comm_config(link="nvlink", algorithm="fused", min_compress_bytes=0)
    assert policy.choose(forced, "all_reduce", 64 * MiB, "tp", 2).algorithm == "one_shot"
    assert not policy.peer_writes(tj.comm_config(link="shm"), "tp")
    assert not policy.peer_writes(cfg, ("dp", "tp"))


def test_explicit_nccl_algorithms_never_read_the_fused_row(monkeypatch):
    """algorithm="one_shot" on NVLink, where the fused kernel could run: NCCL's one-shot row
    decides (no gain measured: plain), not the fused row's 64 MiB gain."""
    monkeypatch.setattr(policy, "on_real_link", lambda axis_name: True)
    monkeypatch.setattr(collectives, "_fused_runs", lambda *args: True)
    text = _lowered(
        lambda v: tj.compressed_psum(v, "tp", link="nvlink", algorithm="one_shot"), 64 * MiB
    )
    assert not _moves_uint8(text) and "all_reduce" in text


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_the_pair_reads_the_fused_row_only_where_it_runs(op):
    """NVLink, 16 MiB: the fused pair measured a gain, NCCL's pair none."""
    assert policy.measured_choice(op, "nvlink", 2, 16 * MiB, fused=True).compress
    assert not policy.measured_choice(op, "nvlink", 2, 16 * MiB, fused=False).compress
