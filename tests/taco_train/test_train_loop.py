"""End to end on configs/tiny.toml: the CLI's outputs, and resume == uninterrupted, bit for bit."""

import json
import logging
import re
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_testing import TINY, assert_same_state, checkpoint_steps, tiny_args, untimed

import taco_jax
from taco_train import comm_error, metrics, trainer
from taco_train.checkpointing import damage
from taco_train.config import load_config
from taco_train.main import main


def _cli(out_dir, cache_dir, *extra):
    # JAX's in-memory caches change how a retraced step lowers (a jitted helper traced before
    # becomes a second private function), so a run after another in this process would miss
    # the session's compilation cache (tests/conftest.py); cleared, each run lowers as the
    # first did, and a resume compiles nothing new (the paper-layout test's three runs on a
    # 2-core machine: 123 s -> 109 s, not recorded).
    jax.clear_caches()
    main(tiny_args(out_dir, cache_dir, *extra))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("full")
    _cli(out, cache)
    return out


def _final_params(out_dir, step):
    manager = ocp.CheckpointManager((out_dir / "checkpoints").absolute())
    restored = manager.restore(step, args=ocp.args.StandardRestore())
    manager.close()
    return restored


def test_cli_writes_metrics_plot_and_config(full_run):
    records = metrics.read_jsonl(full_run / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in evals] == [3, 6]
    for r in train:
        assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) and r["lr"] > 0
    assert "tokens_per_s" in train[-1] and "mfu" in train[-1]
    assert (full_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((full_run / "config.json").read_text())
    assert config["run"]["steps"] == 6 and config["model"]["d_model"] == 64


def _board_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from the TensorBoard event files under `directory`."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):  # TFRecord: length u64, crc u32, payload, crc u32
            length = int.from_bytes(data[at : at + 8], "little")
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 16 + length
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_holds_the_metrics(full_run):
    """Every numeric field of metrics.jsonl, as a scalar at its step (fp32 in the event file)."""
    board = _board_scalars(full_run / "tensorboard")
    records = metrics.read_jsonl(full_run / "metrics.jsonl")
    for kind, field in (
        ("train", "loss"),
        ("train", "lr"),
        ("train", "grad_norm"),
        ("eval", "val_loss"),
    ):
        expected = [(r["step"], r[field]) for r in records if r["kind"] == kind]
        got = board[f"{kind}/{field}"]
        assert [step for step, _ in got] == [step for step, _ in expected]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in expected], rtol=2**-23)


@pytest.mark.slow
def test_profile_steps_write_a_trace(cache, tmp_path):
    _cli(tmp_path, cache, "run.profile_steps=2", "run.profile_start=2", "run.steps=4")
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert traces and all(t.stat().st_size > 0 for t in traces)


def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resumes_exactly(
    full_run, cache, tmp_path, capsys, monkeypatch
):
    """SIGTERM delivered while the run writes its first train record (step 2 of 6): the run
    finishes the step, saves a good checkpoint of it, says so in one line and exits with
    128 + 15; the plain rerun ends with the uninterrupted run's metrics and state. (Here, beside
    `full_run`, its step is compiled once; the signalled process: test_checkpoints.py.)"""
    write = metrics.MetricsWriter.write

    def write_then_signal(self, record):
        write(self, record)
        if record["kind"] == "train" and record["step"] == 2:
            signal.raise_signal(signal.SIGTERM)

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(metrics.MetricsWriter, "write", write_then_signal)
        with pytest.raises(SystemExit) as exit_info:
            _cli(run, cache)
    assert exit_info.value.code == 128 + signal.SIGTERM
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "taco-train: SIGTERM: stopped at step 2; run the same command to resume"
    assert checkpoint_steps(run / "checkpoints") == [2]
    assert damage(run / "checkpoints" / "2") is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back
    _cli(run, cache)
    assert "at step 2" in capsys.readouterr().err
    ours = untimed(metrics.read_jsonl(run / "metrics.jsonl"))
    assert ours == untimed(metrics.read_jsonl(full_run / "metrics.jsonl"))
    assert_same_state(run, full_run, 6)


@pytest.mark.slow  # ~10 s; the fast tier resumes after a signal (above)
def test_resume_reproduces_the_uninterrupted_run(full_run, cache, tmp_path):
    _cli(tmp_path, cache, "run.stop_at=3")  # "interrupted" after the step-3 checkpoint
    first = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    assert max(r["step"] for r in first) == 3
    _cli(tmp_path, cache)  # resumes from step 3
    resumed = untimed(metrics.read_jsonl(tmp_path / "metrics.jsonl"))
    assert resumed == untimed(metrics.read_jsonl(full_run / "metrics.jsonl"))
    a, b = _final_params(full_run, 6), _final_params(tmp_path, 6)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_divergence_stops_in_one_line_and_saves_no_nonfinite_state(cache, tmp_path, capsys):
    """optimizer.lr=1e3 diverges within a few steps: the run stops with one line that names the
    steps and what to try, and every checkpoint it left is finite (a rerun never resumes into
    NaN)."""
    with pytest.raises(SystemExit) as exit_info:
        _cli(tmp_path, cache, "optimizer.lr=1e3", "run.steps=12", "run.eval_every=100")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("taco-train: error: ") and "optimizer.lr" in err[-1], err[-1]
    manager = ocp.CheckpointManager((tmp_path / "checkpoints").absolute())
    for step in manager.all_steps():
        state = manager.restore(step, args=ocp.args.StandardRestore())
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))
    manager.close()


@pytest.mark.parametrize("mode,written", [("shard_map", True), ("vmap", False)])
def test_auto_policy_is_printed_and_kept_for_real_tp_on_gpus(tmp_path, capsys, mode, written):
    """TP over real GPUs with the defaults: the policy's choices go to stderr and to
    collectives_policy.txt (the backend is declared a GPU here; nothing runs on it), from the
    shipped table (no tuned one), and on NVLink "fused" only where its kernel runs (a Hopper
    GPU's target), though the shipped NVLink table measured it fastest from 16 MiB."""
    cfg = load_config(
        TINY, ["parallel.tp=2", f"parallel.mode={mode!r}", "compression.link='nvlink'"]
    )
    with taco_jax.target.assume(backend="gpu"):
        trainer._say_policy(cfg, tmp_path, "nvlink")
    kept = tmp_path / "collectives_policy.txt"
    assert kept.exists() == written
    if written:
        assert kept.read_text() == taco_jax.policy.summary("nvlink", 2, fused=False) + "\n"
        assert "all_reduce on nvlink, N = 2 (shipped)" in capsys.readouterr().err
        assert "fused" not in kept.read_text()
        with taco_jax.target.assume(backend="gpu", hopper=True):
            trainer._say_policy(cfg, tmp_path, "nvlink")
        assert "16 MiB fused" in kept.read_text()


def test_auto_links_are_found_from_the_run_mesh_and_built_into_its_steps(monkeypatch):
    """TP under shard_map with link "auto": the TP groups' link from the mesh's devices (two
    CPU devices of this process: shared memory); none under vmap (no link) or when set."""
    tp2 = ["parallel.mode='shard_map'", "parallel.tp=2"]
    links = trainer.resolve_links(load_config(TINY, tp2))
    assert list(links) == ["link"] and links["link"] == taco_jax.policy.Link(
        "shm", "the group's 2 cpu devices share one process's memory"
    )
    assert trainer.resolve_links(load_config(TINY, ["parallel.tp=2"])) == {}
    assert trainer.resolve_links(load_config(TINY, [*tp2, "compression.link=socket"])) == {}
    built = {}
    monkeypatch.setattr(
        trainer, "make_steps", lambda model, parallel, comm, *_: built.update(comm=comm)
    )
    trainer.build_steps(load_config(TINY, tp2), links={"link": taco_jax.policy.Link("socket", "-")})
    assert built["comm"].fwd.link == built["comm"].bwd.link == "socket"


PIPELINED = (
    "parallel.mode='shard_map'",
    "parallel.pp=2",
    "parallel.microbatches=2",
    "compression.pp='tahquant'",
    "run.comm_error_every=2",
)


@pytest.mark.slow
def test_pipelined_run_trains_and_resumes_exactly(cache, tmp_path):
    """pp = 2 x tp = 2 on 4 fake devices, stochastic stage codec: the loss falls, the stage
    traffic's error is logged, and a run interrupted at its step-3 checkpoint resumes into the
    uninterrupted run's metrics and parameters, bit for bit (the codec's noise comes from the
    run's seed and the step, both restored)."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _cli(full, cache, *PIPELINED)
    records = metrics.read_jsonl(full / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"]
    stage_errors = [r["comm_error/pp_send/fwd"] for r in records if r["kind"] == "comm"]
    # Asymmetric INT8 sends of activations: ~0.01 relative (test_ppermute.py); 0.05 bounds it.
    assert stage_errors and all(0 < e < 0.05 for e in stage_errors)
    _assert_resume_is_exact(full, resumed, cache, PIPELINED)


def _assert_resume_is_exact(full, resumed, cache, overrides):
    """A run of `overrides` stopped at its step-3 checkpoint and resumed ends with the metrics
    and the state of the uninterrupted run in `full`, bit for bit."""
    _cli(resumed, cache, *overrides, "run.stop_at=3")
    _cli(resumed, cache, *overrides)
    want = untimed(metrics.read_jsonl(full / "metrics.jsonl"))
    assert untimed(metrics.read_jsonl(resumed / "metrics.jsonl")) == want
    a, b = _final_params(full, 6), _final_params(resumed, 6)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


THREE_D = (
    "parallel.mode='shard_map'",
    "parallel.dp=2",
    "parallel.pp=2",
    "parallel.microbatches=2",
    "compression.pp='tahquant'",
    "compression.pp_grads='taco'",
    "optimizer.sharded=true",
    "compression.dp_grad='tlq_hs'",
    "compression.dp_param='qwd'",
    "run.comm_error_every=2",
)


# The error per op: every call site logged must be non-zero (something was compressed) and below
# its op's bound, and each dimension must be logged (`LOGGED_OPS`).
TWO_SHOT_TACO = 0.13  # two-shot E4M3: u (1 + u) + u per summed norm, u = 2^-4 (test_collectives.py)
ERROR_BOUNDS = {
    **dict.fromkeys(
        ("embed/fwd", "attn_in/bwd", "attn_out/fwd", "mlp_in/bwd", "mlp_out/fwd", "head_in/bwd"),
        TWO_SHOT_TACO,
    ),
    # INT8 stage sends: ~0.01 relative (test_ppermute.py); 0.05 bounds them
    "pp_send/fwd": 0.05,
    "pp_send/bwd": 0.05,
    "pp_send_grads/fwd": 0.05,  # 1F1B's own sends of the gradients
    # the stages' sum of the shared parameters' gradients: one two-shot all-reduce, as TP's
    "pp_grads/fwd": TWO_SHOT_TACO,
    # TLq-HS: a 4-bit absmax level (per group <= sqrt(128) / (2 * 7) = 0.81 of its norm) after an
    # 8-bit one (0.045): < 0.9
    "dp_grads": 0.9,
    # qWD: the replica is the master to within a bf16 rounding (2^-8) plus one step of the
    # 4-bit weight difference, an AdamW update (<= lr x 3.2 per value, Adam's largest normalized
    # step) over 7, against weights of RMS ~0.02: 3e-3 x 3.2 / 7 / 0.02 + 2^-8 < 0.08
    "dp_params": 0.08,
}


# One op of each dimension (under emulation the embedding and the head report nothing:
# `taco_models.pipeline._branch_ctx`).
LOGGED_OPS = {"attn_in/bwd", "mlp_out/fwd", "pp_send/fwd", "pp_grads/fwd", "dp_grads", "dp_params"}


def _assert_trains_logs_and_resumes(tmp_path, cache, overrides):
    """A compressed run: the loss falls, each dimension's compression error is logged within its
    bound (`ERROR_BOUNDS`) at every call site, and a run resumed from its step-3 checkpoint
    ends bit for bit where the uninterrupted one does. Returns the run directories (full,
    resumed)."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _cli(full, cache, *overrides)
    records = metrics.read_jsonl(full / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    logged = comm_error.site_errors([r for r in records if r["kind"] == "comm"][-1])
    for site, error in logged.items():
        assert 0 < error < ERROR_BOUNDS[comm_error.op_of(site)], (site, error)
    assert {comm_error.op_of(site) for site in logged} >= LOGGED_OPS, sorted(logged)
    _assert_resume_is_exact(full, resumed, cache, overrides)
    return full, resumed


@pytest.mark.slow
def test_3d_compressed_run_trains_and_resumes_exactly(cache, tmp_path, capsys):
    """dp = 2 x pp = 2 x tp = 2 on 8 fake devices, every dimension compressed: TACO on the TP
    traffic, TAH-Quant on the stage sends, TACO on the stages' sum of the shared parameters'
    gradients, ZeRO-1 with both SDP4Bit compressors over dp (each
    rank keeps the dp shards of its stage and TP slice). The loss falls, each dimension's
    compression error is logged, and a run interrupted at its step-3 checkpoint resumes into the
    uninterrupted run's metrics and state, bit for bit (every compressor's noise comes from the
    run's seed and the step)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    _, resumed = _assert_trains_logs_and_resumes(tmp_path, cache, (*THREE_D, "parallel.tp=2"))
    with pytest.raises(SystemExit):  # the state holds one master shard per dp rank and slice
        _cli(resumed, cache, *THREE_D, "parallel.tp=1")
    assert "(dp, pp, tp) slices (2, 2, 2) -> (2, 2, 1)" in capsys.readouterr().err


@pytest.mark.slow
def test_the_paper_layout_emulated_on_one_device_trains_and_resumes_exactly(
    cache, tmp_path, check_replicas
):
    """The paper's TP 4 x PP 2 x DP 2 (16 ranks) with every dimension compressed, emulated on one
    device (`parallel.mode=emulate`, models/spmd.py): the loss falls, each dimension's error is
    logged within its bound, every rank's copy of what it replicates (qWD's weight replicas
    across dp among them) is the same bits, and a resumed run ends bit for bit where the
    uninterrupted one does."""
    check_replicas(True)
    overrides = (*THREE_D, "parallel.mode='emulate'", "parallel.tp=4")
    _assert_trains_logs_and_resumes(tmp_path, cache, overrides)


@pytest.mark.slow
def test_one_f_one_b_3d_run_trains_and_resumes_exactly(cache, tmp_path):
    """The 3D compressed run of test_3d_compressed_run_trains_and_resumes_exactly with the 1F1B
    schedule (its stage sends and backward sends are explicit, each with its own key): the loss
    falls, every dimension's compression error is logged within its bound, and a resumed run
    ends bit for bit where the uninterrupted one does."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    overrides = (*THREE_D, "parallel.tp=2", "parallel.schedule='1f1b'")
    _assert_trains_logs_and_resumes(tmp_path, cache, overrides)


def test_the_start_up_summary_names_every_op_that_runs_the_reference(capsys):
    """Not only a warning: where a kernel cannot take a call (here a row of 3 groups on a
    Hopper GPU whose JAX has no Triton lowering, a target as tests/pallas_kernels/
    test_registry.py builds them) the run's start-up says which op runs the jnp reference and
    why, in one line; nothing where every op has its kernel."""
    import jax.numpy as jnp

    import pallas_kernels
    from pallas_kernels import registry

    registry.forget_reference()
    trainer._say_reference_ops()
    assert capsys.readouterr().err == ""
    hopper = taco_jax.target.Target(backend="gpu", hopper=True, triton_missing="no Triton")
    with pytest.warns(RuntimeWarning, match="runs the jnp reference"):
        pallas_kernels.encode(
            taco_jax.get_codec("taco"), jnp.ones((2, 384), jnp.bfloat16), target=hopper
        )
    trainer._say_reference_ops()
    assert capsys.readouterr().err == (
        "on the jnp reference, far slower than the fused kernels: encode of taco (rows [2, "
        "n=384], bfloat16): the Mosaic GPU kernels cannot take rows of n=384 (need whole tiles "
        "of 8192 and a wire of whole 8-row boxes of 128 bytes: n a multiple of 16384)\n"
    )
    registry.forget_reference()


@pytest.mark.slow
def test_both_steps_compile_before_step_1(cache, tmp_path, monkeypatch, capsys):
    """With measuring steps, the train step and the measuring step are compiled before the
    loop starts (the measuring one's compile, or an out-of-memory from its exact fp32
    collectives, no longer waits for step run.comm_error_every, maybe hours in), and the loop
    compiles neither again; the start-up says how much more memory the measuring step needs."""
    compiled = []

    class Compiles(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Compiling jit(train_step)"):
                compiled.append("train_step")

    steps = trainer._steps

    def loop(*args, **kwargs):
        compiled.append("loop starts")
        return steps(*args, **kwargs)

    handler = Compiles()
    logging.getLogger("jax").addHandler(handler)
    monkeypatch.setattr(trainer, "_steps", loop)
    try:
        with jax.log_compiles():
            _cli(tmp_path / "run", cache, "run.comm_error_every=2", "run.steps=4")
    finally:
        logging.getLogger("jax").removeHandler(handler)
    assert compiled == ["train_step", "train_step", "loop starts"]
    err = capsys.readouterr().err
    assert re.search(
        r"the measuring step \(run.comm_error_every=2\) needs [\d.,]+ (bytes|KiB|MiB) more device "
        r"memory than the train step \([\d.,]+ MiB per device\): its exact fp32 collectives",
        err,
    ), err
