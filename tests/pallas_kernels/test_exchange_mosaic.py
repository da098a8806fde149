"""The fused encode + all-gather (`pallas_kernels.exchange_mosaic`) and the "fused" all-reduce.

Mosaic GPU's CPU interpreter has no semaphores, so the kernel itself runs only on >= 2 Hopper
GPUs; there it must equal, byte for byte, the encode + NCCL all-gather it replaces, and the
"fused" all-reduce must equal "one_shot" bit for bit where both encode with the Mosaic GPU
kernel (same codes, same sum order): no tolerance is needed. On the CPU, on an assumed Hopper
GPU joined by NVLink (`taco_jax.target.assume`): the launch rule, the fallback to one-shot, and
that the kernel lowers for CUDA inside shard_map (which catches Mosaic GPU API drift without a
GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from tiers import tiered

import taco_jax as tj
from pallas_kernels import encode_mosaic, exchange_mosaic, registry
from pallas_kernels.encode_mosaic import MosaicConfig as MosaicLaunch
from taco_jax import _backends, codecs, collectives, target

TILE = 64 * 128  # elements of one 64-group tile of G = 128
MESSAGE_TILES = 1536  # 24 MiB of bf16 a rank
# One-shot's own encode is Triton's where JAX has the lowering, whose codes may differ from the
# fused kernel's Mosaic GPU ones at rounding ties: compared bit for bit, both run Mosaic GPU.
MOSAIC_CODEC_OPS = dict(triton_missing="compared with the Mosaic GPU codec ops")

two_hopper_gpus = pytest.mark.skipif(
    not target.probe().hopper or jax.device_count() < 2, reason="needs >= 2 Hopper GPUs"
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


@pytest.mark.parametrize("rows,tiles", [(1, 2), (1, 1024), (1, 1030), (2, 256), (128, 2), (129, 2)])
def test_launch_keeps_every_program_resident(rows, tiles):
    """Programs wait for their peers' counterparts, so all must be resident at once: a plan
    divides the row's tiles and launches at most `max_programs()`; none where even one
    program a row is too many."""
    plan = exchange_mosaic.launch(rows, tiles)
    if rows > exchange_mosaic.max_programs():
        assert plan is None
        return
    assert tiles % plan.tiles_per_program == 0
    assert rows * tiles // plan.tiles_per_program <= exchange_mosaic.max_programs()
    assert 1 <= plan.steps_in_flight <= plan.tiles_per_program


def test_unsupported_names_too_many_rows():
    x = jnp.zeros((200, 2 * TILE), jnp.bfloat16)
    reason = exchange_mosaic.unsupported(codecs.get_codec("taco"), x)
    assert "200 rows" in reason


def test_a_plan_must_keep_every_program_resident():
    """A caller's plan with more programs than can be resident would deadlock in the handshake:
    refused, naming the count, before anything is traced on the axis."""
    x = jnp.zeros((1, 256 * TILE), jnp.bfloat16)  # 256 tiles: 256 one-tile programs
    with pytest.raises(ValueError, match="launches 256 programs"):
        exchange_mosaic.encode_all_gather(
            codecs.get_codec("taco"), x, "tp", 2, plan=MosaicLaunch(1, 1)
        )


@pytest.fixture
def hopper():
    """The ops traced in the test take the CPU for a Hopper GPU (`taco_jax.target.assume`); with
    link="nvlink" the fused exchange's conditions then hold (a real link, peer stores)."""
    with target.assume(backend="gpu", hopper=True):
        yield


def _stand_in_exchange(calls):
    """`_backends.exchange` built from the jnp encode and lax collectives (the bytes the
    kernels must produce), recording each call: the fused path's padding, slicing, trimming and
    dispatch, run on the CPU."""

    def exchange(kind, impl, codec, target, *, rows=1, n=None, dtype=None):
        if dtype != jnp.bfloat16:
            return None

        def run(codec, x, axis_name, n_ranks, replicated=False):
            calls.append((kind, x.shape))
            assert x.shape[-1] % exchange_mosaic.ROW_MULTIPLE == 0  # padded for the kernel
            wire = codecs.encode_wire(codec, x)
            if kind == "encode_all_to_all":
                return collectives.exchange_rows(wire, axis_name)
            to = "invarying" if replicated else "varying"
            return lax.all_gather(wire, axis_name, axis=0, to=to)

        return registry.Kernel("stand_in", run, exchange_mosaic.ROW_MULTIPLE)

    return exchange


# The fast tier: every op at 2 ranks, the all-reduce also at 4 ranks in 3 slices.
@pytest.mark.parametrize(
    "op,ranks,slices",
    tiered(
        [(op, *rs) for op in ("psum", "psum_scatter", "all_gather") for rs in ((2, 1), (4, 3))],
        [("psum", 2, 1), ("psum_scatter", 2, 1), ("all_gather", 2, 1), ("psum", 4, 3)],
    ),
)
def test_the_fused_path_equals_one_shot_around_its_exchange(hopper, monkeypatch, ranks, slices, op):
    """With a stand-in for the kernels: "fused" pads rows to whole kernel tiles (odd sizes here),
    slices, exchanges through `_backends.exchange` and trims back, bit for bit as one-shot
    through NCCL (the same codes: padding adds whole zero groups after the message)."""
    calls = []
    monkeypatch.setattr(_backends, "exchange", _stand_in_exchange(calls))
    mesh = _mesh(ranks)
    x = _sharded(mesh, (ranks * ranks * 3001,), seed=ranks)
    ops = {
        "psum": lambda v, **o: tj.compressed_psum(v, "tp", **o),
        "psum_scatter": lambda v, **o: tj.compressed_psum_scatter(v, "tp", **o),
        "all_gather": lambda v, **o: tj.compressed_all_gather(v, "tp", tiled=True, **o),
    }

    def run(algorithm):
        options = dict(
            algorithm=algorithm, impl="xla", slices=slices, min_compress_bytes=0, link="nvlink"
        )
        return _on_mesh(lambda v: ops[op](v, **options)[None], mesh, x)

    fused = run("fused")
    assert len(calls) == slices  # every slice went through the stand-in
    np.testing.assert_array_equal(fused, run("one_shot"))
    assert len(calls) == slices  # one-shot did not


@pytest.mark.parametrize("check_vma", [True, False])
def test_fused_collectives_are_typed_as_lax_ones(hopper, check_vma):
    """The fused kernels inside the collectives, traced with their gradients: under check_vma the
    all-reduce's output is replicated (as lax.psum's), the reduce-scatter's and all-gather's vary
    (as lax's do), so custom_vjp's type checks and out_specs=P() for the psum hold."""
    mesh = _mesh(2)
    options = dict(impl="pallas", algorithm="fused", min_compress_bytes=0, link="nvlink")

    def step(v):
        total = tj.compressed_psum(v, "tp", **options)
        part = tj.compressed_psum_scatter(v, "tp", **options)
        gathered = tj.compressed_all_gather(part, "tp", tiled=True, **options)
        return total, gathered

    def out_and_grads(v):
        (total, gathered), vjp = jax.vjp(step, v)
        return total, gathered, vjp((total, gathered))[0]

    specs = (jax.P(), TP_SPEC, TP_SPEC) if check_vma else (TP_SPEC,) * 3
    fn = jax.jit(
        jax.shard_map(
            out_and_grads, mesh=mesh, in_specs=TP_SPEC, out_specs=specs, check_vma=check_vma
        )
    )
    x = jax.ShapeDtypeStruct(
        (2 * 4 * TILE,), jnp.bfloat16, sharding=jax.NamedSharding(mesh, TP_SPEC)
    )
    jaxpr = str(fn.trace(x).jaxpr)
    assert jaxpr.count("taco_encode_all_gather") >= 2 and "taco_encode_all_to_all" in jaxpr


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("kind", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("dp", [1, 2])
def test_kernels_lower_for_cuda_inside_shard_map(check_vma, kind, dp):
    """The kernels' Mosaic GPU modules build (peer refs, semaphores, TMA stores to a peer whose
    device id is recomputed on the host), on a ("tp",) and a ("dp", "tp") mesh, typed as lax's
    collectives are under check_vma (the gather replicated along tp: out_specs without tp)."""
    mesh = jax.make_mesh(
        (dp, 2),
        ("dp", "tp"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[: 2 * dp],
    )
    codec = codecs.get_codec("taco")
    exchange = getattr(exchange_mosaic, f"encode_{kind}")
    in_specs = jax.P(("dp", "tp"))
    out_specs = jax.P("dp") if kind == "all_gather" else in_specs
    fn = jax.jit(
        jax.shard_map(
            lambda v: exchange(codec, v, "tp", 2),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=check_vma,
        )
    )
    rows = 2 if kind == "all_to_all" else 1  # all-to-all: one row per rank
    x = jax.ShapeDtypeStruct(
        (2 * dp * rows, 4 * TILE), jnp.bfloat16, sharding=jax.NamedSharding(mesh, in_specs)
    )
    text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ------------------------------------------------------------------------------------------
# On two Hopper GPUs.


@pytest.mark.gpu
@two_hopper_gpus
@pytest.mark.parametrize(
    "kind,rows,tiles,plan",
    [
        ("all_gather", 1, 2, None),
        ("all_gather", 1, 1030, None),
        ("all_gather", 2, 512, None),
        # three store slots: 8 tiles per program rotate through them (slot = tile mod 3)
        ("all_gather", 1, 1024, MosaicLaunch(8, 3, store_slots=3)),
        ("all_to_all", None, 2, None),
        ("all_to_all", None, 1030, None),
    ],
    ids=lambda v: f"slots{v.store_slots}" if isinstance(v, MosaicLaunch) else None,
)
def test_fused_exchange_equals_encode_then_the_lax_collective(kind, rows, tiles, plan):
    """Byte for byte: `encode_all_gather` as the Mosaic encode then `lax.all_gather` (every rank
    alike), `encode_all_to_all` (one row per rank) as the encode then `lax.all_to_all`."""
    n = jax.device_count()
    mesh = _mesh(n)
    codec = codecs.get_codec("taco")
    rows = rows or n
    launch = {"plan": plan} if plan else {}

    def fused(v):
        return getattr(exchange_mosaic, f"encode_{kind}")(codec, v, "tp", n, **launch)

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
    fused exchanges and through NCCL's: the same codes (every codec op on Mosaic GPU:
    `MOSAIC_CODEC_OPS`) and the same decodes, so bit for bit."""
    n = jax.device_count()
    mesh = _mesh(n)
    x = _sharded(mesh, (n * n * MESSAGE_TILES * TILE,), seed=7)

    def run(algorithm):
        def pair(v):
            options = dict(algorithm=algorithm, min_compress_bytes=0)
            part = tj.compressed_psum_scatter(v, "tp", **options)
            return tj.compressed_all_gather(part, "tp", axis=0, tiled=True, **options)

        with target.assume(**MOSAIC_CODEC_OPS):
            return _out_and_grad_on_mesh(pair, mesh, x)

    for fused, nccl in zip(run("fused"), run("one_shot"), strict=True):
        np.testing.assert_array_equal(fused, nccl)


@pytest.mark.gpu
@two_hopper_gpus
@pytest.mark.parametrize("check_vma", [True, False])
def test_fused_psum_equals_one_shot_with_gradients(check_vma):
    """Forward and backward (a psum of the cotangent under check_vma=False), bit for bit, over
    dependent calls (the semaphores must come back to zero between calls); one-shot's own encode
    the Mosaic one too (`MOSAIC_CODEC_OPS`)."""
    n = jax.device_count()
    mesh = _mesh(n)
    x = _sharded(mesh, (n, MESSAGE_TILES * TILE), seed=3)

    def run(algorithm):
        def forward(v):
            for _ in range(3):
                v = tj.compressed_psum(v, "tp", algorithm=algorithm, min_compress_bytes=0) / n
                if check_vma:  # the next call's input is again a partial sum, typed varying
                    v = lax.pcast(v, "tp", to="varying")
            return v

        with target.assume(**MOSAIC_CODEC_OPS):
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


@pytest.mark.gpu
@two_hopper_gpus
@pytest.mark.parametrize("op", ["psum", "all_gather"])
def test_messages_whose_buffers_pass_32_bit_offsets(op):
    """2 GiB of bf16 per rank: the fused all-reduce's gathered wire and the all-gather's output
    pass 2^31 bytes, past the kernels' 32-bit offsets (before the collectives sliced such
    messages, both returned non-finite values here). Every value finite, and within one
    quantization's bound: |error| <= U sum of the ranks' norms, U = 2^-4 (E4M3)."""
    n = jax.device_count()
    mesh = _mesh(n)
    x = _sharded(mesh, (n << 30,), seed=11)  # 2^30 bf16 per rank

    def errors(v):
        if op == "psum":
            got = tj.compressed_psum(v, "tp", algorithm="fused", min_compress_bytes=0)
            exact = lax.psum(v.astype(jnp.float32), "tp")
            scale = lax.psum(jnp.linalg.norm(v.astype(jnp.float32)), "tp")
        else:
            got = tj.compressed_all_gather(v, "tp", tiled=True, min_compress_bytes=0)
            exact = lax.all_gather(v, "tp", tiled=True).astype(jnp.float32)
            scale = jnp.linalg.norm(exact)
        bad = jnp.sum(~jnp.isfinite(got))
        return jnp.stack([bad.astype(jnp.float32), jnp.linalg.norm(got - exact) / scale])[None]

    result = np.asarray(_on_mesh(errors, mesh, x))
    assert np.all(result[:, 0] == 0), result
    assert np.all(result[:, 1] <= 2.0**-4), result
