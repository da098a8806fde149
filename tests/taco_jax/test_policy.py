"""The "auto" policy (`taco_jax.policy`): its rule on a known table, the measured table itself,
link detection, explicit options, and what the collectives run when the policy says so.

The GPU path is exercised on the CPU by assuming a GPU target (`taco_jax.target.assume`: under
shard_map the link is then real): the decision only reads the table; what the collectives then
run is read from the lowered program (a plain all-reduce, or uint8 collectives)."""

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from tp_testing import tp_mesh

import taco_jax as tj
from taco_jax import _policy_table, policy, target
from taco_jax.target import Target

MiB = 1 << 20
XLA = "xla"  # the codec ops on the CPU, whatever the target: the policy's choice is the same
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
def speedups(monkeypatch):
    """speedups(tables): the policy reads `tables` ({link: table}) in this test."""
    return lambda tables: monkeypatch.setattr(_policy_table, "SPEEDUPS", tables)


@pytest.fixture
def fake_table(speedups):
    speedups({"nvlink": FAKE, "shm": FAKE, "socket": FAKE})


@pytest.fixture
def gpu():
    """Ops traced in the test take the CPU for a GPU: under shard_map, a real link."""
    with target.assume(backend="gpu"):
        yield


def _on(link: str, **facts) -> Target:
    """A GPU target whose collective's bytes move over `link`."""
    return Target(backend="gpu", real_link=True, link=link, **facts)


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
def test_algorithms_within_the_spread_prefer_one_quantization(speedups, two_shot, algorithm):
    """Two-shot 0.8% ahead (within `TIE`) loses to one-shot, which quantizes once; 8% ahead it
    wins. Between two that quantize once, the faster wins."""
    table = {"all_reduce": {"one_shot": {MiB: 1.2}, "two_shot": {MiB: two_shot}}}
    speedups({"nvlink": table})
    choose = lambda: policy.measured_choice("all_reduce", "nvlink", 2, MiB)  # noqa: E731
    assert choose().algorithm == algorithm
    table["all_reduce"]["fused"] = {MiB: 1.19}
    assert choose().algorithm == algorithm
    table["all_reduce"]["fused"] = {MiB: 1.22}
    assert choose().algorithm == ("fused" if algorithm == "one_shot" else "two_shot")


def test_compression_follows_the_algorithm_that_runs(speedups):
    """Two-shot at 1.06x and one-shot at 1.04x are a tie that one-shot wins; one-shot is below
    MIN_SPEEDUP, so nothing is compressed."""
    table = {"all_reduce": {"one_shot": {MiB: 1.04}, "two_shot": {MiB: 1.06}}}
    speedups({"nvlink": table})
    choice = policy.measured_choice("all_reduce", "nvlink", 2, MiB)
    assert (choice.compress, choice.algorithm) == (False, "one_shot"), choice.reason


def test_forced_compression_runs_the_faster_measured_algorithm(fake_table):
    """min_compress_bytes=0 says whether; "auto" still says how, from the table."""
    cfg = tj.comm_config(link="nvlink", min_compress_bytes=0)
    choice = policy.choose(cfg, "all_reduce", MiB, 2, _on("nvlink"))
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


def _probed(axis_name="tp", link: str = "auto", mode: str = "shard_map") -> Target:
    """`target.probe(axis_name, link)` as a collective over a 2-rank ("dp", "tp") mesh traced
    under `mode` ("shard_map", "vmap") sees it."""
    seen = []

    def fn(v):
        seen.append(target.probe(axis_name, link))
        return v

    if mode == "vmap":
        jax.jit(jax.vmap(jax.vmap(fn, axis_name="tp"), axis_name="dp"))(jnp.zeros((1, 2, 4)))
    else:
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((1, 2), ("dp", "tp"), axis_types=auto, devices=jax.devices()[:2])
        spec = P(("dp", "tp"))
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(jnp.zeros(4))
    return seen[0]


def test_real_link_only_under_shard_map_on_gpu(gpu):
    """vmap emulation never counts as a link (no bytes move), even on a GPU; nor the CPU."""
    assert _probed(mode="shard_map").real_link
    assert not _probed(mode="vmap").real_link
    with target.assume(backend="cpu"):
        assert not _probed(mode="shard_map").real_link


def test_a_cpu_mesh_axis_has_a_link_only_where_a_tuned_table_may_be_read():
    """On the CPU no shipped table applies: the probe finds no link (nothing to find or log)
    unless this machine's tuned table may be read (`policy.reads_link_off_gpu`: one is
    installed, or the collectives are being recorded for pricing); under vmap never."""
    assert _probed(mode="shard_map").link is None
    with policy.recording():
        assert _probed(mode="shard_map").link == "shm"  # two CPU devices of one process
        assert _probed(mode="vmap").link is None
        assert not _probed(mode="shard_map").real_link


def _lowered(fn, nbytes: int, tp: int = 2, hopper: bool = False) -> str:
    """The lowered text of `fn` per rank under shard_map on a bf16 message of `nbytes`/rank;
    for a Hopper GPU, whose Mosaic GPU kernels lower for CUDA only, the traced program's."""
    mesh = tp_mesh(tp)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    spec = jax.ShapeDtypeStruct((tp * nbytes // 2,), jnp.bfloat16)
    if hopper:
        with target.assume(hopper=True):
            return str(jax.jit(mapped).trace(spec).jaxpr)
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
def test_collectives_follow_the_measured_choice(gpu, link, nbytes, with_fused, compressed):
    """Read from the shipped table. On NVLink only the fused kernel measured a gain (from 16
    MiB): where it cannot run (here, a GPU that is not a Hopper one) the table's other rows
    decide, and they say plain; sockets measured one from 16 MiB with every algorithm."""
    assert policy.measured_choice("all_reduce", link, 2, nbytes).compress == with_fused
    expected = policy.measured_choice("all_reduce", link, 2, nbytes, fused=False)
    assert expected.compress == compressed
    text = _lowered(lambda v: tj.compressed_psum(v, "tp", link=link, impl=XLA), nbytes)
    assert _moves_uint8(text) == compressed
    assert ("all_reduce" in text) == (not compressed)


@pytest.mark.parametrize("per_rank,compressed", [(MiB // 2, True), (MiB // 4, False)])
def test_all_gather_reads_its_output_size(gpu, per_rank, compressed):
    """Sockets: the pair measured 1.14x from 1 MiB; an all-gather of 0.5 MiB per rank at N = 2
    makes 1 MiB (compressed), of 0.25 MiB makes 0.5 MiB (below the table: plain)."""
    gather = lambda v: tj.compressed_all_gather(v, "tp", link="socket", tiled=True, impl=XLA)  # noqa: E731
    text = _lowered(gather, per_rank)
    assert _moves_uint8(text) == compressed


def test_explicit_options_win(gpu):
    forced = _lowered(
        lambda v: tj.compressed_psum(v, "tp", link="nvlink", min_compress_bytes=0, impl=XLA), MiB
    )
    assert _moves_uint8(forced)
    # An explicit algorithm says how, not whether: NVLink's table still says plain.
    how = _lowered(
        lambda v: tj.compressed_psum(v, "tp", link="nvlink", algorithm="one_shot", impl=XLA),
        64 * MiB,
    )
    assert not _moves_uint8(how)
    cfg = tj.comm_config(link="socket", algorithm="two_shot")
    choice = policy.choose(cfg, "all_reduce", 64 * MiB, 2, _on("socket"))
    assert (choice.compress, choice.algorithm) == (True, "two_shot")


def test_no_real_link_compresses_everything():
    cfg = tj.comm_config()
    choice = policy.choose(cfg, "all_reduce", 1, 2, Target())  # on the CPU: no real link
    assert (choice.compress, choice.algorithm) == (True, "two_shot")
    emulated = Target(backend="gpu")  # a TP group emulated with vmap on a GPU
    assert policy.choose(cfg, "all_reduce", 1, 2, emulated).compress
    assert not policy.choose(tj.comm_config("none"), "all_reduce", 1 << 30, 2, Target()).compress


def test_summary_names_every_op_and_size():
    text = policy.summary("socket")
    assert text.count("\n") == len(policy.TABLE_OPS) - 1
    assert "all_reduce on socket, N = 2 (shipped): 1 MiB plain" in text


def test_summary_says_fused_only_where_its_kernel_runs():
    """On NVLink the fused rows measured the gains: a machine whose fused exchange runs
    (`Target.fused_exchange_possible`) says so; another reads the other rows (plain)."""
    assert "64 MiB fused" in policy.summary("nvlink", fused=True)
    text = policy.summary("nvlink")
    assert "fused" not in text and "64 MiB compressed" not in text


def test_fused_only_where_its_kernel_runs():
    """NVLink's table picks "fused" (from 16 MiB) where its kernel runs; where it does not, the
    policy reads the other rows (plain there), and an explicit "fused" runs one-shot."""
    cfg = tj.comm_config(link="nvlink")
    nvlink = _on("nvlink")
    choice = policy.choose(cfg, "all_reduce", 64 * MiB, 2, nvlink, fused_available=True)
    assert (choice.compress, choice.algorithm) == (True, "fused")
    assert not policy.choose(cfg, "all_reduce", 64 * MiB, 2, nvlink).compress
    forced = tj.comm_config(link="nvlink", algorithm="fused", min_compress_bytes=0)
    assert policy.choose(forced, "all_reduce", 64 * MiB, 2, nvlink).algorithm == "one_shot"


def test_peer_stores_only_on_one_nvlink_axis(gpu):
    """A Hopper GPU's collective may store into its peers over NVLink, along one mesh axis;
    not over shared memory, nor along a tuple of axes, nor under vmap (no link)."""
    with target.assume(hopper=True):
        assert _probed("tp", "nvlink").fused_exchange_possible
        assert not _probed("tp", "shm").peer_stores
        assert not _probed(("dp", "tp"), "nvlink").peer_stores
        assert not _probed("tp", "nvlink", mode="vmap").peer_stores
    assert _probed("tp", "nvlink").peer_stores  # not a Hopper GPU: stores, but no fused kernel
    assert not _probed("tp", "nvlink").fused_exchange_possible


def test_explicit_nccl_algorithms_never_read_the_fused_row(gpu):
    """algorithm="one_shot" on NVLink, where the fused kernel could run (a Hopper GPU): NCCL's
    one-shot row decides (no gain measured: plain), not the fused row's 64 MiB gain."""
    fused = _lowered(lambda v: tj.compressed_psum(v, "tp", link="nvlink"), 64 * MiB, hopper=True)
    assert "taco_encode_all_gather" in fused  # "auto": the fused kernel, where it runs
    text = _lowered(
        lambda v: tj.compressed_psum(v, "tp", link="nvlink", algorithm="one_shot"), 64 * MiB
    )
    assert not _moves_uint8(text) and "all_reduce" in text


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_the_pair_reads_the_fused_row_only_where_it_runs(op):
    """NVLink, 16 MiB: the fused pair measured a gain, NCCL's pair none."""
    assert policy.measured_choice(op, "nvlink", 2, 16 * MiB, fused=True).compress
    assert not policy.measured_choice(op, "nvlink", 2, 16 * MiB, fused=False).compress
