"""Compression error by call site (`taco_jax.telemetry`): what each site reports equals the
codec's error on the same tensors, sites are named per layer under jit, scan, remat, vmap and
shard_map, and `site_codecs` moves single layers off their codec (what an error budget does)."""

import functools

import hlo_testing
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from tiers import tiered
from tp_testing import MODES, run_tp

import taco_jax as tj
from taco_jax import codecs, telemetry

TP = 4
# The reported error against the one computed here from the same tensors: the decoded values
# are the same fp32 numbers; the exact sum differs from this float64 one by <= N 2^-24 of
# sum_r |x_r| per value (N = 4: 2.4e-7, <= 2x the sum's own size for Gaussian ranks), which
# moves an error of ~1% of the norm by <= 2.4e-7 x 2 / 0.01 = 5e-5 of itself; the fp32 sums
# of squares add ~log2(n) 2^-24 = 1e-6. So 1e-4.
RTOL = 1e-4


def _ranks(shape, seed=0, tp=TP):
    return jax.random.normal(jax.random.key(seed), (tp, *shape), jnp.float32)


def _roundtrip(codec, x) -> np.ndarray:
    return np.asarray(codecs.roundtrip(codec, jnp.asarray(x, jnp.float32)))


def _relative(out, exact) -> float:
    out, exact = np.asarray(out, np.float64), np.asarray(exact, np.float64)
    return float(np.linalg.norm(out - exact) / np.linalg.norm(exact))


def _two_shot_sum(codec, x: np.ndarray) -> np.ndarray:
    """What two-shot TACO computes from ranks' flat messages x [N, n]: rank j sums everyone's
    decoded chunk j in fp32, re-encodes it, and every rank decodes every chunk."""
    chunks = x.reshape(x.shape[0], x.shape[0], -1)  # [rank, chunk, n / N]
    summed = [
        np.sum([_roundtrip(codec, c) for c in chunks[:, j]], axis=0, dtype=np.float32)
        for j in range(x.shape[0])
    ]
    return np.concatenate([_roundtrip(codec, s) for s in summed])


def _one_shot_sum(codec, x: np.ndarray) -> np.ndarray:
    return np.sum([_roundtrip(codec, r) for r in x], axis=0, dtype=np.float32)


# op, the collective under test (per rank), and this module's reckoning of its output (all
# ranks' outputs, concatenated) and of the exact result, from the ranks' inputs [N, n].
CASES = {
    "two_shot": (
        lambda v, codec: tj.compressed_psum(v, "tp", codec=codec, algorithm="two_shot"),
        lambda codec, x: np.tile(_two_shot_sum(codec, x), TP),
        lambda x: np.tile(x.astype(np.float64).sum(0), TP),
    ),
    "one_shot": (
        lambda v, codec: tj.compressed_psum(v, "tp", codec=codec, algorithm="one_shot"),
        lambda codec, x: np.tile(_one_shot_sum(codec, x), TP),
        lambda x: np.tile(x.astype(np.float64).sum(0), TP),
    ),
    "reduce_scatter": (
        lambda v, codec: tj.compressed_psum_scatter(v, "tp", codec=codec),
        lambda codec, x: np.concatenate(
            [
                np.sum([_roundtrip(codec, c) for c in chunks], 0, dtype=np.float32)
                for chunks in x.reshape(TP, TP, -1).transpose(1, 0, 2)
            ]
        ),
        lambda x: x.astype(np.float64).sum(0),
    ),
    "all_gather": (
        lambda v, codec: tj.compressed_all_gather(v, "tp", codec=codec, tiled=True),
        lambda codec, x: np.tile(np.concatenate([_roundtrip(codec, r) for r in x]), TP),
        lambda x: np.tile(x.reshape(-1), TP),
    ),
}
OPS = {"two_shot": "all_reduce", "one_shot": "all_reduce"}


@pytest.mark.parametrize("codec", tiered(["taco", "int8"], fast=["taco"]))
@pytest.mark.parametrize("case", list(CASES))
def test_reported_error_is_the_codec_error_of_the_same_tensors(case, codec):
    """Each site's error equals the relative error that `codecs` round trips of the same
    inputs give, summed as the collective sums them; its bytes are a ring's, once per rank."""
    collective, reckoned, exact = CASES[case]
    x = _ranks((TP * 4 * 128,), seed=11)
    telemetry.drain()
    run_tp(lambda v: collective(v, tj.comm_config(codec, telemetry=True)), x, tp=TP, mode="vmap")
    reported = telemetry.drain()
    name = OPS.get(case, case)
    assert list(reported) == [f"{name}/fwd"]
    site = reported[f"{name}/fwd"]
    xs = np.asarray(x)
    np.testing.assert_allclose(site.error, _relative(reckoned(codec, xs), exact(xs)), rtol=RTOL)
    assert site.nonfinite == site.exact_nonfinite == 0
    per_rank = (
        xs[0].nbytes
        * {"all_reduce": 2 * (TP - 1) / TP, "reduce_scatter": (TP - 1) / TP, "all_gather": TP - 1}[
            name
        ]
    )
    assert site.nbytes == site.compressed_bytes == pytest.approx(TP * per_rank)


def _layers_loss(comm, x, ws):
    """Three scanned, rematerialized layers of f and g (Megatron's MLP pair), per rank."""

    def layer(h, xs):
        w, i = xs
        h = tj.copy_to_tp(h, comm, name="mlp_in", layer=i)
        return h + tj.reduce_from_tp(jnp.tanh(h @ w), comm, name="mlp_out", layer=i), None

    saved = jax.checkpoint_policies.save_only_these_names("tp_reduce", telemetry.CHECKPOINT_NAME)
    out, _ = lax.scan(jax.checkpoint(layer, policy=saved), x, (ws, jnp.arange(3)))
    return jnp.sum(jnp.square(out))


@pytest.mark.parametrize("mode", tiered(MODES, fast=["vmap"]))
def test_sites_are_named_by_layer_under_jit_scan_remat_vmap_and_shard_map(mode):
    """A traced layer index names each site; every site reports once per rank and call (the
    forward from the backward pass: remat runs the forward twice), within the two-shot bound."""
    x = jnp.broadcast_to(_ranks((16, 128), seed=3, tp=1)[0], (TP, 16, 128))
    ws = 0.1 * _ranks((3, 128, 128), seed=4)
    comm = tj.TPComm.create(telemetry=True)
    telemetry.drain()
    run_tp(
        lambda a: jax.grad(functools.partial(_layers_loss, comm), argnums=1)(*a),
        (x, ws),
        tp=TP,
        mode=mode,
    )
    reported = telemetry.drain()
    assert list(reported) == [
        f"layer_{i:02d}/{op}" for i in range(3) for op in ("mlp_in/bwd", "mlp_out/fwd")
    ]
    message = 16 * 128 * 4  # fp32 bytes of one rank's message
    for site in reported.values():
        assert site.calls == TP  # one report per rank: none dropped, none repeated by remat
        assert site.nbytes == site.compressed_bytes == TP * 2 * (TP - 1) / TP * message
        # two-shot E4M3 (test_collectives.py): u (1 + u) sum_r ||x_r|| + u ||sum||, u = 2^-4,
        # at most (2 u + u^2) N of the sum's norm for ranks of equal norm; ~0.036 measured.
        assert 0.01 < site.error < 0.06, site


def test_site_codecs_move_one_layer_off_its_codec_under_scan():
    """`site_codecs` names a layer of a scanned site: that layer runs its codec (here none: the
    lax collective itself, reporting only its bytes), the others keep theirs. The programs with
    and without the move are two programs, which need not round alike: the moved layer equals
    lax.psum within the reassociation of its N-term sum, the others stay within the two-shot
    bound of the exact sum (and off it: still compressed), as they were before the move."""
    xs = _ranks((3, 64, 256), seed=5)

    def layers(comm, xs):
        body = lambda _, a: (None, tj.reduce_from_tp(a[0], comm, name="out", layer=a[1]))  # noqa: E731
        return lax.scan(body, None, (xs, jnp.arange(3)))[1]

    plain = tj.TPComm.create(telemetry=True)
    moved = tj.TPComm.create(telemetry=True, site_codecs={"layer_01/out/fwd": "none"})
    telemetry.drain()
    before = run_tp(functools.partial(layers, plain), xs, tp=TP, mode="vmap")
    telemetry.drain()
    after = run_tp(functools.partial(layers, moved), xs, tp=TP, mode="vmap")
    reported = telemetry.drain()
    exact = run_tp(lambda v: lax.psum(v, "tp"), xs, tp=TP, mode="vmap")
    # Two orders of an N-term fp32 sum differ by <= 2 (N - 1) 2^-24 sum_r |x_r| per value.
    magnitude = np.sum(np.abs(np.asarray(xs)), axis=0)
    level = 2 * (TP - 1) * 2.0**-24 * magnitude[1]
    assert bool(np.all(np.abs(np.asarray(after[:, 1]) - np.asarray(exact[:, 1])) <= level))
    u = 2.0**-4  # two-shot E4M3 (test_collectives.py): u (1 + u) sum_r ||x_r|| + u ||sum||
    for i in (0, 2):
        layer = np.asarray(xs[:, i], np.float64)
        bound = u * (1 + u) * sum(map(np.linalg.norm, layer)) + u * np.linalg.norm(layer.sum(0))
        for program in (before, after):
            for rank in range(TP):
                error = np.linalg.norm(np.asarray(program[rank, i], np.float64) - layer.sum(0))
                assert 0 < error <= 1.01 * bound, (i, rank, error, bound)
        assert reported[f"layer_{i:02d}/out/fwd"].error > 0
    assert reported["layer_01/out/fwd"].error is None
    assert reported["layer_01/out/fwd"].compressed_bytes == 0


def test_the_layer_fed_outliers_exceeds_the_budget_and_alone_falls_back():
    """Four scanned layers with plain INT8 (per-group absmax); layer 2's partial sums carry 1%
    outlier channels (x100). INT8's error is ~0.009 on Gaussian data and ~0.031 with such
    channels (BENCHMARKS.md, "Codec error", TP = 4): a budget of 0.02 puts layer 2 alone over
    it, and with its fallback it runs uncompressed while the others stay compressed."""
    xs = np.array(_ranks((4, 64, 512), seed=9))
    outliers = np.random.default_rng(0).choice(512, 5, replace=False)
    xs[:, 2, :, outliers] *= 100.0

    def measure(site_codecs):
        comm = tj.TPComm.create(fwd="int8", telemetry=True, site_codecs=site_codecs)

        def layers(xs):
            body = lambda _, a: (None, tj.reduce_from_tp(a[0], comm, name="mlp_out", layer=a[1]))  # noqa: E731
            return lax.scan(body, None, (xs, jnp.arange(4)))[1]

        telemetry.drain()
        run_tp(layers, jnp.asarray(xs), tp=TP, mode="vmap")
        return telemetry.drain()

    errors = measure({})
    assert [e.error < 0.015 for e in errors.values()] == [True, True, False, True], errors
    over = telemetry.over_budget(errors, 0.02)
    assert over == ["layer_02/mlp_out/fwd"]
    again = measure(dict.fromkeys(over, "none"))
    assert again["layer_02/mlp_out/fwd"].error is None
    for site in ("layer_00/mlp_out/fwd", "layer_01/mlp_out/fwd", "layer_03/mlp_out/fwd"):
        assert again[site].error == errors[site].error


def test_codec_made_non_finite_values_exceed_any_budget_and_the_inputs_own_do_not():
    """A Hadamard group with G max|x| beyond fp32's range overflows in the codec (docs/api.md,
    "Non-finite values"), where the exact sum is finite: over any budget. A rank's own Inf
    is not the codec's doing: its error is NaN, and it stays."""
    x = np.array(_ranks((1024,), seed=2))
    overflowing, infinite = x.copy(), x.copy()
    overflowing[0, :128] = 1e37  # 128 x 1e37 > 3.4e38 in the Hadamard's +-1 sums
    infinite[0, 0] = np.inf
    comm = tj.TPComm.create(telemetry=True)
    for name, values in (("overflow", overflowing), ("inf", infinite)):
        run_tp(
            lambda v, n=name: tj.reduce_from_tp(v, comm, name=n),
            jnp.asarray(values),
            tp=TP,
            mode="vmap",
        )
    errors = telemetry.drain()
    assert errors["overflow/fwd"].nonfinite > 0 and errors["overflow/fwd"].exact_nonfinite == 0
    assert errors["inf/fwd"].exact_nonfinite > 0 and np.isnan(errors["inf/fwd"].error)
    assert telemetry.over_budget(errors, 1e9) == ["overflow/fwd"]


def test_names_change_no_program_and_measuring_adds_to_it():
    """Without `telemetry` a site's name changes nothing in the compiled program; with it, the
    exact collective and the host callbacks join it. (A traced `layer` is a scan input of its
    own: `models` pass it only where a program uses it, `TPContext.names_layers`.)"""
    x = _ranks((16, 128), seed=3)
    ws = 0.1 * _ranks((3, 128, 128), seed=4)

    def hlo(comm, **site):
        def loss(x, ws):
            def layer(h, w):
                h = tj.copy_to_tp(h, comm, **{k: f"{v}_in" for k, v in site.items()})
                y = tj.reduce_from_tp(jnp.tanh(h @ w), comm, **site)
                return h + y, None

            saved = jax.checkpoint_policies.save_only_these_names("tp_reduce")
            return jnp.sum(jnp.square(lax.scan(jax.checkpoint(layer, policy=saved), x, ws)[0]))

        grad = jax.vmap(jax.grad(loss, argnums=1), axis_name="tp")
        return jax.jit(grad).lower(x, ws)

    plain = tj.TPComm.create()
    compiled = lambda lowered: hlo_testing.program(lowered.compile().as_text())  # noqa: E731
    assert compiled(hlo(plain)) == compiled(hlo(plain, name="mlp"))
    assert "callback" in hlo(tj.TPComm.create(telemetry=True), name="mlp").as_text()
    assert "callback" not in hlo(plain, name="mlp").as_text()


def test_site_codecs_name_their_codecs():
    with pytest.raises(ValueError, match="unknown codec 'int9'"):
        tj.comm_config("taco", site_codecs={"layer_01/mlp_out/fwd": "int9"})
    cfg = tj.comm_config("taco", site_codecs={"b/fwd": "none", "a/fwd": "int8"})
    assert [site for site, _ in cfg.site_codecs] == ["a/fwd", "b/fwd"]
    assert hash(cfg) == hash(tj.comm_config("taco", site_codecs={"a/fwd": "int8", "b/fwd": "none"}))
