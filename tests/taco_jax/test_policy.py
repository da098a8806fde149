"""The "auto" policy (`taco_jax.policy`): its rule on a known table, the measured table itself,
link detection, explicit options, and what the collectives run when the policy says so.

The GPU path is exercised on the CPU by declaring the link real (`on_real_link` patched): the
decision only reads the table; what the collectives then run is read from the lowered program
(a plain all-reduce, or uint8 collectives)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from tp_testing import tp_mesh

import taco_jax as tj
from taco_jax import _policy_table, policy

MiB = 1 << 20
# A table with known answers: compress from 16 MiB; one-shot wins at 64 MiB, two-shot at 16.
FAKE = {
    "all_reduce": {
        "one_shot": {MiB: 0.5, 16 * MiB: 1.2, 64 * MiB: 1.9},
        "two_shot": {MiB: 0.4, 16 * MiB: 1.3, 64 * MiB: 1.5},
    },
    "reduce_scatter_all_gather": {"-": {MiB: 1.04, 16 * MiB: 1.06, 64 * MiB: 1.5}},
}


@pytest.fixture
def fake_table(monkeypatch):
    monkeypatch.setattr(_policy_table, "SPEEDUPS", {"nvlink": FAKE, "shm": FAKE, "socket": FAKE})


@pytest.mark.parametrize(
    "op,nbytes,compress,algorithm",
    [
        ("all_reduce", MiB // 2, False, "-"),  # below every measured size: no evidence
        ("all_reduce", MiB, False, "-"),  # measured slower
        ("all_reduce", 8 * MiB, False, "-"),  # between sizes: the smaller one's answer
        ("all_reduce", 16 * MiB, True, "two_shot"),
        ("all_reduce", 64 * MiB, True, "one_shot"),
        ("all_reduce", 1 << 40, True, "one_shot"),  # above: the largest measured size
        ("reduce_scatter", MiB, False, "-"),  # 1.04x is within noise (MIN_SPEEDUP)
        ("all_gather", 16 * MiB, True, "-"),
    ],
)
def test_rule_on_a_known_table(fake_table, op, nbytes, compress, algorithm):
    choice = policy.measured_choice(op, "nvlink", 2, nbytes)
    assert (choice.compress, choice.algorithm) == (compress, algorithm), choice.reason


def test_more_than_two_ranks_take_two_shot(fake_table):
    """One-shot sends (N - 1) x the wire, two-shot 2 (N - 1) / N x: from N = 3 two-shot."""
    assert policy.measured_choice("all_reduce", "shm", 4, 64 * MiB).algorithm == "two_shot"
    assert policy.measured_choice("all_reduce", "shm", 2, 64 * MiB).algorithm == "one_shot"


def test_measured_table_follows_the_rule():
    """Every link and op of the shipped table, at every measured size: compress exactly where
    the best measured speedup reached MIN_SPEEDUP, with that algorithm (N = 2)."""
    for link, ops in _policy_table.SPEEDUPS.items():
        assert link in policy.LINKS and set(ops) == set(policy.TABLE_OPS.values())
        for op, table_op in policy.TABLE_OPS.items():
            rows = ops[table_op]
            for size in rows[next(iter(rows))]:
                best = max(rows, key=lambda a: rows[a][size])  # noqa: B023
                choice = policy.measured_choice(op, link, 2, size)
                assert choice.compress == (rows[best][size] >= policy.MIN_SPEEDUP)
                if choice.compress and op == "all_reduce":
                    assert choice.algorithm == best
    assert set(_policy_table.SOURCES) == set(_policy_table.SPEEDUPS)
    assert all("collectives.py" in s["command"] for s in _policy_table.SOURCES.values())


@pytest.mark.parametrize(
    "env,link",
    [
        ({}, "nvlink"),
        ({"NCCL_P2P_DISABLE": "1"}, "shm"),
        ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, "socket"),
    ],
)
def test_link_from_nccl_switches(monkeypatch, env, link):
    for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert policy.detect_link() == link
    assert policy.resolve_link("auto") == link
    assert policy.resolve_link("shm") == "shm"


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
    "link,nbytes,compressed",
    [("nvlink", 64 * MiB, False), ("socket", MiB, False), ("socket", 64 * MiB, True)],
)
def test_collectives_follow_the_measured_choice(monkeypatch, link, nbytes, compressed):
    """Read from the shipped table: NVLink measured no gain, sockets one from 16 MiB."""
    monkeypatch.setattr(policy, "on_real_link", lambda axis_name: True)
    expected = policy.measured_choice("all_reduce", link, 2, nbytes)
    assert expected.compress == compressed
    text = _lowered(lambda v: tj.compressed_psum(v, "tp", link=link), nbytes)
    assert _moves_uint8(text) == compressed
    assert ("all_reduce" in text) == (not compressed)


def test_explicit_options_win(monkeypatch):
    monkeypatch.setattr(policy, "on_real_link", lambda axis_name: True)
    forced = _lowered(lambda v: tj.compressed_psum(v, "tp", link="nvlink", min_compress_bytes=0),
                      MiB)  # fmt: skip
    assert _moves_uint8(forced)
    # An explicit algorithm says how, not whether: NVLink's table still says plain.
    how = _lowered(lambda v: tj.compressed_psum(v, "tp", link="nvlink", algorithm="one_shot"),
                   64 * MiB)  # fmt: skip
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
    assert "all_reduce on socket, N = 2: 1 MiB plain" in text
