"""`compression.tune` (`taco_train.tuning`): the step's collectives counted from its traced
program agree with the plain step's own collectives; a run that tunes (forced, on the CPU
under vmap) prints per op and size what runs, the predicted and then the measured step, writes
both into metrics.jsonl, and a second start finds its sizes in the policy file; "off" measures
nothing. The multi-process tuning is in test_distributed.py."""

import collections

import jax
import numpy as np
import pytest
from train_testing import TINY, tiny_args

from taco_jax import policy, tune
from taco_train import metrics, trainer
from taco_train.config import ConfigError, load_config
from taco_train.main import main

LAX_COLLECTIVES = {
    "psum": "all_reduce",
    "reduce_scatter": "reduce_scatter",
    "all_gather": "all_gather",
}


def _lax_collectives(jaxpr, n_ranks, times=1, into=None) -> collections.Counter:
    """(op, bytes per rank as `policy.choose` counts them: an all-gather's output) -> runs, of
    the lax collectives along "tp" in a traced program, through scan lengths (what the
    identity codec runs)."""
    into = collections.Counter() if into is None else into
    for eqn in jaxpr.eqns:
        op = LAX_COLLECTIVES.get(eqn.primitive.name)
        axes = eqn.params.get("axes", eqn.params.get("axis_name"))
        if op is not None and "tp" in str(axes):
            aval = eqn.invars[0].aval
            nbytes = int(np.prod(aval.shape)) * aval.dtype.itemsize
            into[(op, nbytes * (n_ranks if op == "all_gather" else 1))] += times
        for sub, factor in tune._sub_jaxprs(eqn):
            _lax_collectives(sub, n_ranks, times * factor, into)
    return into


SEQUENCE_PARALLEL = ("parallel.sequence_parallel=true",)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param((), id="default"),
        pytest.param(SEQUENCE_PARALLEL, id="sequence_parallel"),
        pytest.param(("parallel.remat=true",), id="remat", marks=pytest.mark.slow),
        pytest.param(("parallel.pp=2", "parallel.microbatches=2"), id="pp", marks=pytest.mark.slow),
    ],
)
def test_step_collectives_are_the_steps_own(extra):
    """With the identity codec every TP collective of the step is a lax one: the count from
    the traced program's scopes (`tune.step_collectives`) equals the lax collectives in it,
    op, size and runs (layers under scan, forward and backward, pipeline ticks). The models'
    remat keeps the collectives' outputs: the count is that of the step without it. With
    sequence parallelism the model sums some gradients with lax psums of its own (no policy
    decides those), one of them the size of the loss's: there the all-reduces are a part."""
    cfg = load_config(TINY, ["parallel.mode='shard_map'", "compression.fwd='none'", *extra])
    steps = trainer.build_steps(cfg)
    state = jax.eval_shape(steps.init, jax.random.key(0))
    shape = (cfg.data.batch_size, cfg.model.seq_len + 1)
    batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=steps.batch_sharding)
    with policy.recording() as calls:
        traced = steps.train_step.trace(state, batch)
    counted = collections.Counter()
    for call, n in tune.step_collectives(traced.jaxpr, calls):
        counted[(call.op, call.nbytes)] += n
    lax_ops = _lax_collectives(traced.jaxpr.jaxpr, cfg.parallel.tp)
    if extra != SEQUENCE_PARALLEL:
        assert counted == lax_ops
        return
    pair = {k: n for k, n in lax_ops.items() if k[0] != "all_reduce"}
    assert pair and pair == {k: n for k, n in counted.items() if k[0] != "all_reduce"}
    assert all(lax_ops[k] >= n for k, n in counted.items())


def test_tune_mode_is_checked():
    with pytest.raises(ConfigError, match="compression.tune='always'"):
        load_config(TINY, ["compression.tune='always'"])


@pytest.mark.slow
def test_a_forced_tuning_predicts_then_measures_the_step(tmp_path, cache, capsys, monkeypatch):
    """configs/tiny.toml (TP = 2 under vmap on the CPU) with compression.tune=force: the
    step's sizes are timed, each printed with what runs and its ratio; the prediction is
    printed, and after warm-up the measured step beside it, both in metrics.jsonl. A second
    start with "auto" finds the sizes in the file and times nothing; "off" predicts nothing."""
    monkeypatch.setenv("TACO_JAX_POLICY_FILE", str(tmp_path / "policy.json"))  # this test's own
    run = tmp_path / "run"
    main(tiny_args(run, cache, "compression.tune='force'", "run.steps=4", "run.eval_every=4"))
    out, err = capsys.readouterr()
    assert "compression.tune=force: timing 2 TP collective size(s)" in err
    assert "all_reduce 32 KiB x 10 (taco@128, N = 2 on vmap): two_shot" in err
    predicted = next(line for line in err.splitlines() if line.startswith("TP collectives "))
    records = [r for r in metrics.read_jsonl(run / "metrics.jsonl") if r["kind"] == "tune"]
    assert len(records) == 1 and records[0]["step"] == 2
    (record,) = records
    assert f"{record['collectives_plain_s'] * 1e3:.2f} ms" in predicted
    assert record["predicted_saving_s"] == pytest.approx(
        record["collectives_plain_s"] - record["collectives_chosen_s"]
    )
    assert f"step {record['step_s'] * 1e3:.1f} ms measured at step 2" in out
    again = tmp_path / "again"
    main(tiny_args(again, cache, "run.steps=2", "run.eval_every=2"))
    err = capsys.readouterr().err
    assert "timing" not in err and "all_reduce 32 KiB x 10" in err
    off = tmp_path / "off"
    main(tiny_args(off, cache, "compression.tune='off'", "run.steps=2", "run.eval_every=2"))
    err = capsys.readouterr().err
    assert "all_reduce 32 KiB" not in err
    assert not [r for r in metrics.read_jsonl(off / "metrics.jsonl") if r["kind"] == "tune"]
