"""The fused encode + all-gather (`pallas_kernels.exchange_mosaic`) and the "fused" all-reduce.

Mosaic GPU's CPU interpreter has no semaphores, so the kernel itself runs only on >= 2 Hopper
GPUs; there it must equal, byte for byte, the encode + NCCL all-gather it replaces, and the
"fused" all-reduce must equal "one_shot" bit for bit (same codes, same sum order): no tolerance
is needed. On the CPU: the launch rule, the fallback to one-shot, and that the kernel lowers for
CUDA inside shard_map (which catches Mosaic GPU API drift without a GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taco_jax as tj
from pallas_kernels import _pallas, encode_mosaic, exchange_mosaic
from pallas_kernels.config import MOSAIC_MIN_TILES
from taco_jax import codecs, policy

TILE = 64 * 128  # elements of one 64-group tile of G = 128

two_hopper_gpus = pytest.mark.skipif(
    not _pallas.hopper_gpu() or jax.device_count() < 2, reason="needs >= 2 Hopper GPUs"
)


def _mesh(n):
    return jax.make_mesh(
        (n,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )


TP_SPEC = jax.P("tp")


def _on_mesh(fn, mesh, x, *, out_specs=TP_SPEC, check_vma=False):
    """jit(shard_map(fn)) over the "tp" axis of `mesh`, applied to x (sharded along it)."""
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=TP_SPEC, out_specs=out_specs, check_vma=check_vma
    )
    return jax.jit(mapped)(x)


def _out_and_grad_on_mesh(forward, mesh, x, *, check_vma=False):
    """forward(x) and the gradient of 0.5 |forward(x)|^2 (the vjp of the output itself)."""

    def out_and_grad(v):
        out, vjp = jax.vjp(forward, v)
        return out, vjp(out)[0]

    return _on_mesh(out_and_grad, mesh, x, check_vma=check_vma)


def _sharded(mesh, shape, seed):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("tp")))


@pytest.mark.parametrize(
    "rows,tiles,expected",
    [(1, 2, (1, 1)), (1, 1024, (8, 3)), (1, 1030, (10, 3)), (2, 256, (4, 3)), (129, 2, None)],
)
def test_launch_keeps_every_program_resident(rows, tiles, expected):
    plan = exchange_mosaic.launch(rows, tiles)
    if expected is None:
        assert plan is None
        return
    assert (plan.tiles_per_program, plan.steps_in_flight) == expected
    assert rows * tiles // plan.tiles_per_program <= exchange_mosaic.MAX_PROGRAMS


def test_unsupported_names_too_many_rows():
    x = jnp.zeros((200, 2 * TILE), jnp.bfloat16)
    reason = exchange_mosaic.unsupported(codecs.get_codec("taco"), x, need_hopper=False)
    assert "200 rows" in reason


def test_fused_runs_one_shot_off_a_real_link():
    """On the CPU (no peer memory) "fused" is one-shot through the lax all-gather, bit for bit."""
    mesh = _mesh(2)
    x = _sharded(mesh, (2, 3 * TILE + 128), seed=0)

    def run(algorithm):
        fn = lambda v: tj.compressed_psum(v, "tp", algorithm=algorithm, impl="xla")  # noqa: E731
        return _on_mesh(fn, mesh, x, out_specs=jax.P(), check_vma=True)

    assert not policy.peer_writes(tj.comm_config("taco"), "tp")
    np.testing.assert_array_equal(run("fused"), run("one_shot"))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("kind", ["all_gather", "all_to_all"])
def test_kernels_lower_for_cuda_inside_shard_map(monkeypatch, check_vma, kind):
    """The kernels' Mosaic GPU modules build (peer refs, semaphores, TMA stores to a peer),
    typed as lax's collectives are under check_vma (the gather replicated: out_specs=P())."""
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    mesh = _mesh(2)
    codec = codecs.get_codec("taco")
    exchange = getattr(exchange_mosaic, f"encode_{kind}")
    out_specs = jax.P() if kind == "all_gather" else jax.P("tp")
    fn = jax.jit(
        jax.shard_map(
            lambda v: exchange(codec, v, "tp", 2),
            mesh=mesh,
            in_specs=jax.P("tp"),
            out_specs=out_specs,
            check_vma=check_vma,
        )
    )
    x = jax.ShapeDtypeStruct(
        (4 if kind == "all_to_all" else 2, 4 * TILE),  # all-to-all: one row per rank
        jnp.bfloat16,
        sharding=jax.NamedSharding(mesh, jax.P("tp")),
    )
    text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ------------------------------------------------------------------------------------------
# On two Hopper GPUs.


@pytest.mark.gpu
@two_hopper_gpus
@pytest.mark.parametrize(
    "kind,rows,tiles",
    [("all_gather", 1, 2), ("all_gather", 1, 1030), ("all_gather", 2, 512),
     ("all_to_all", None, 2), ("all_to_all", None, 1030)],
)  # fmt: skip
def test_fused_exchange_equals_encode_then_the_lax_collective(kind, rows, tiles):
    """Byte for byte: `encode_all_gather` as the Mosaic encode then `lax.all_gather` (every rank
    alike), `encode_all_to_all` (one row per rank) as the encode then `lax.all_to_all`."""
    n = jax.device_count()
    mesh = _mesh(n)
    codec = codecs.get_codec("taco")
    rows = rows or n
    fused = lambda v: getattr(exchange_mosaic, f"encode_{kind}")(codec, v, "tp", n)  # noqa: E731
    lax_collective = {
        "all_gather": lambda w: lax.all_gather(w, "tp", axis=0),
        "all_to_all": lambda w: lax.all_to_all(w, "tp", 0, 0, tiled=True),
    }[kind]
    reference = lambda v: lax_collective(encode_mosaic.encode(codec, v))  # noqa: E731
    # Two different inputs in a row: a byte the kernel failed to write (or wrote late) would
    # keep the first call's value in a reused buffer and fail the second comparison.
    for seed in (1, 2):
        x = _sharded(mesh, (n * rows, tiles * TILE), seed)
        got = np.asarray(_on_mesh(fused, mesh, x)).reshape(n, -1)
        np.testing.assert_array_equal(got, np.asarray(_on_mesh(reference, mesh, x)).reshape(n, -1))
        if kind == "all_gather":  # every rank holds every rank's codes
            np.testing.assert_array_equal(got, got[:1].repeat(n, axis=0))


@pytest.mark.gpu
@two_hopper_gpus
def test_fused_pair_equals_the_nccl_pair_with_gradients():
    """Reduce-scatter then all-gather (sequence parallelism), forward and backward, through the
    fused exchanges and through NCCL's: the same codes and the same decodes, so bit for bit. The
    all-gather's input is 1/N of the message: at N x 64 MiB per rank every encode is the Mosaic
    one (below 64 MiB NCCL's path encodes with Triton, which may differ at rounding ties)."""
    n = jax.device_count()
    mesh = _mesh(n)
    x = _sharded(mesh, (n * n * MOSAIC_MIN_TILES * TILE,), seed=7)

    def run(algorithm):
        def pair(v):
            options = dict(algorithm=algorithm, min_compress_bytes=0)
            part = tj.compressed_psum_scatter(v, "tp", **options)
            return tj.compressed_all_gather(part, "tp", axis=0, tiled=True, **options)

        return _out_and_grad_on_mesh(pair, mesh, x)

    for fused, nccl in zip(run("fused"), run("one_shot"), strict=True):
        np.testing.assert_array_equal(fused, nccl)


@pytest.mark.gpu
@two_hopper_gpus
@pytest.mark.parametrize("check_vma", [True, False])
def test_fused_psum_equals_one_shot_with_gradients(check_vma):
    """Forward and backward (a psum of the cotangent under check_vma=False), bit for bit, over
    dependent calls (the semaphores must come back to zero between calls). 64 MiB per rank, so
    that one-shot's own encode is the Mosaic one too (Triton's may differ at rounding ties)."""
    n = jax.device_count()
    mesh = _mesh(n)
    x = _sharded(mesh, (n, MOSAIC_MIN_TILES * TILE), seed=3)

    def run(algorithm):
        def forward(v):
            for _ in range(3):
                v = tj.compressed_psum(v, "tp", algorithm=algorithm, min_compress_bytes=0) / n
                if check_vma:  # the next call's input is again a partial sum, typed varying
                    v = lax.pcast(v, "tp", to="varying")
            return v

        return _out_and_grad_on_mesh(forward, mesh, x, check_vma=check_vma)

    out_f, grad_f = run("fused")
    out_o, grad_o = run("one_shot")
    np.testing.assert_array_equal(out_f, out_o)
    np.testing.assert_array_equal(grad_f, grad_o)


@pytest.mark.gpu
@two_hopper_gpus
def test_fused_psum_of_a_padded_message():
    """A message the kernel pads (not whole tiles): within the all-reduce's bound of the exact
    sum (test_check_vma_gpu.py: U = 2^-4 per E4M3 rounding), rank-identical."""
    n = jax.device_count()
    mesh = _mesh(n)
    x = _sharded(mesh, (n, 3 * 1024 * TILE + 300), seed=4)
    run = lambda psum: _on_mesh(psum, mesh, x).astype(jnp.float32).reshape(n, -1)  # noqa: E731
    out = run(lambda v: tj.compressed_psum(v, "tp", algorithm="fused", min_compress_bytes=0))
    exact = run(lambda v: lax.psum(v.astype(jnp.float32), "tp"))
    u = 2.0**-4
    norms = jnp.linalg.norm(x.astype(jnp.float32).reshape(n, -1), axis=1)
    # Each rank's codes: <= u of its input; the sum, rounded once to bf16: + 2^-9 of the sum.
    bound = u * float(jnp.sum(norms)) + 2.0**-9 * float(jnp.linalg.norm(exact[0]))
    assert float(jnp.linalg.norm(out[0] - exact[0])) <= bound
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out[:1]).repeat(n, axis=0))
