"""Fine-tuning from a Hugging Face checkpoint (model.init_from) and exporting back to one.

The checkpoints are the tiny transformers-made fixtures of tests/models/fixtures/hf/.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_testing import REPO, TINY, tiny_overrides

pytest.importorskip("safetensors")

from taco_models import hf  # noqa: E402
from taco_models.config import RopeScaling  # noqa: E402
from taco_models.parallel import reference_loss_and_grads  # noqa: E402
from taco_train import data, trainer  # noqa: E402
from taco_train.config import ConfigError, load_config, resolve_model  # noqa: E402
from taco_train.export import export  # noqa: E402
from taco_train.export import main as export_main  # noqa: E402
from taco_train.main import main  # noqa: E402

FIXTURES = REPO / "tests" / "models" / "fixtures" / "hf"
QWEN = str(FIXTURES / "qwen2_tied")  # sharded, tied head, with a tokenizer.json
LLAMA3 = str(FIXTURES / "llama3_untied")  # rope_scaling "llama3", untied head, no tokenizer


def _config(tmp_path, cache, *extra, init_from=QWEN):
    """configs/tiny.toml, the model its --set model.init_from (which replaces the file's)."""
    overrides = tiny_overrides(tmp_path / "run", cache, f"model.init_from={init_from!r}", *extra)
    return load_config(TINY, overrides)


# ---------------------------------------------------------------------------------------------
# Configuration.


def test_geometry_comes_from_the_checkpoint(tmp_path, cache):
    cfg = _config(tmp_path, cache, "model.seq_len=16", 'data.tokenizer="hf"')
    assert cfg.model == dataclasses.replace(hf.load_config(QWEN), seq_len=16)
    assert cfg.to_dict()["model"]["init_from"] == QWEN


def test_init_from_set_on_the_command_line_replaces_the_files_model():
    """--set model.init_from names the model: configs/default.toml's [model] (a preset and its
    geometry, seq_len=128) is dropped for the checkpoint's geometry and length; a --set
    model.seq_len, before or after, still sets the training length."""
    default, byte = REPO / "configs" / "default.toml", "data.tokenizer=byte"
    cfg = load_config(default, [f"model.init_from={QWEN!r}", byte])
    assert cfg.model == hf.load_config(QWEN) and cfg.model.seq_len == 64 and cfg.init_from == QWEN
    cfg = load_config(default, ["model.seq_len=16", f"model.init_from={QWEN!r}", byte])
    assert cfg.model == dataclasses.replace(hf.load_config(QWEN), seq_len=16)


def test_a_preset_beside_init_from_on_the_command_line_names_both():
    with pytest.raises(
        ConfigError,
        match=r"model\.init_from='.*qwen2_tied' and model\.preset='gpt_tiny' both name",
    ):
        load_config(TINY, ["model.preset=gpt_tiny", f"model.init_from={QWEN!r}"])


def test_geometry_beside_init_from_is_refused(tmp_path, cache):
    with pytest.raises(ConfigError, match=r"model\.d_model cannot be set with model\.init_from"):
        _config(tmp_path, cache, "model.d_model=128")


def test_gpt2_sequence_length_is_the_checkpoints(tmp_path, cache):
    with pytest.raises(
        ConfigError,
        match=r"model\.seq_len=16 differs from the n_positions=32 .*"
        r"set model\.seq_len=32 or leave it unset",
    ):
        _config(tmp_path, cache, "model.seq_len=16", init_from=str(FIXTURES / "gpt2"))


def test_a_checkpoint_without_a_tokenizer_says_which_tokenizer_to_set(tmp_path, cache):
    cfg = _config(tmp_path, cache, 'data.tokenizer="hf"', init_from=str(FIXTURES / "gpt2"))
    with pytest.raises(
        ConfigError,
        match=r"data\.tokenizer='hf' reads model\.init_from's "
        r"tokenizer\.json, and .*gpt2/tokenizer\.json is not a file: set "
        r"data\.tokenizer=bpe \(trained on data\.corpus\) or data\.tokenizer=byte",
    ):
        trainer.train_and_evaluate(cfg)


def test_hf_tokenizer_needs_init_from():
    with pytest.raises(ConfigError, match="data.tokenizer='hf' reads the tokenizer.json of"):
        load_config(TINY, ['data.tokenizer="hf"'])


def test_configured_tokenizer_must_fit_the_checkpoint_vocabulary(tmp_path, cache):
    # The GPT-2 fixture's vocabulary (250) cannot hold the byte tokenizer's 256 ids.
    with pytest.raises(
        ConfigError,
        match=r"model\.vocab_size=250 \(of model\.init_from=.*gpt2'"
        r"\) < 256 cannot hold the byte tokenizer",
    ):
        _config(tmp_path, cache, init_from=str(FIXTURES / "gpt2"))


def test_hf_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, cache, capsys):
    ckpt = tmp_path / "gpt2_with_tokenizer"
    shutil.copytree(FIXTURES / "gpt2", ckpt)
    shutil.copy(FIXTURES / "qwen2_tied" / "tokenizer.json", ckpt)  # 256 ids > 250
    cfg = _config(tmp_path, cache, 'data.tokenizer="hf"', init_from=str(ckpt))
    with pytest.raises(
        ConfigError,
        match=r"the tokenizer's 256 ids do not fit the model's "
        r"vocab_size=250",
    ):
        trainer.train_and_evaluate(cfg)


def test_absent_checkpoint_parses_and_fails_when_run(tmp_path, cache):
    absent = str(tmp_path / "not_downloaded")
    cfg = _config(tmp_path, cache, 'data.tokenizer="hf"', init_from=absent)
    assert cfg.model is None and cfg.init_from == absent
    with pytest.raises(ConfigError, match=r"not_downloaded/config\.json: no such file"):
        resolve_model(cfg, required=True)


@pytest.mark.parametrize(
    ("name", "tp", "geometry"),
    # The checkpoints' config.json: (width, layers, arch, tied head).
    [
        ("finetune_qwen25_0p5b", 2, (896, 24, "qwen2", True)),
        ("finetune_smollm2_135m", 3, (576, 30, "llama", True)),
    ],
)
def test_finetune_config_parses_without_the_checkpoint(name, tp, geometry):
    cfg = load_config(REPO / "configs" / f"{name}.toml")
    assert cfg.init_from is not None and cfg.data.tokenizer == "hf"
    assert cfg.compression.fwd == "taco" and cfg.parallel.tp == tp
    if cfg.model is not None:  # the checkpoint is downloaded here
        m = cfg.model
        assert (m.d_model, m.n_layers, m.arch, m.tied_embeddings) == geometry


def test_cli_error_for_a_missing_checkpoint_is_one_line(tmp_path, cache, capsys):
    absent = str(tmp_path / "absent")
    overrides = tiny_overrides(tmp_path / "run", cache, f"model.init_from={absent!r}")
    args = ["--config", TINY]
    for override in overrides:
        args += ["--set", override]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("taco-train: error: model.init_from=")


# ---------------------------------------------------------------------------------------------
# Runs: the first loss is the checkpoint's, the export is the final checkpoint.


def _first_batch(cfg) -> np.ndarray:
    dataset = data.prepare_dataset(
        cfg.data.corpus,
        tokenizer=cfg.data.tokenizer,
        vocab_size=cfg.model.vocab_size,
        val_fraction=cfg.data.val_fraction,
        seed=cfg.data.seed,
        cache_dir=cfg.data.cache_dir,
        tokenizer_file=Path(cfg.init_from) / "tokenizer.json",
    )
    batches = data.Batches(dataset.train, cfg.data.batch_size, cfg.model.seq_len, cfg.data.seed)
    return batches.train(0)


def _final_params(out_dir: Path, step: int) -> dict:
    manager = ocp.CheckpointManager((out_dir / "checkpoints").absolute())
    restored = manager.restore(step, args=ocp.args.StandardRestore())
    manager.close()
    return restored["params"]


LAYOUTS = {
    "vmap_tp2": ["parallel.tp=2", 'parallel.mode="vmap"'],
    "shard_map_tp2_dp2": ["parallel.tp=2", "parallel.dp=2", 'parallel.mode="shard_map"'],
    "pipeline_pp2_tp2": [
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.microbatches=2",
        'parallel.mode="shard_map"',
    ],
    # The sharded optimizer: the export gathers its fp32 master shards (which the fp32
    # replica in the checkpoint's params equals, dp_param being "none").
    "zero_dp2_tp2": [
        "parallel.tp=2",
        "parallel.dp=2",
        'parallel.mode="shard_map"',
        "optimizer.sharded=true",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_finetune_starts_from_the_checkpoint_and_exports_the_result(layout, tmp_path, cache):
    """Step 1's loss is the checkpoint's loss on batch 0 (the weights were loaded, placed
    where each rank expects them), and the export holds the final checkpoint's parameters."""
    jax.clear_caches()
    cfg = _config(
        tmp_path,
        cache,
        "model.seq_len=16",
        'data.tokenizer="hf"',
        'compression.fwd="none"',
        "run.steps=3",
        "run.eval_every=3",
        "run.checkpoint_every=3",
        "run.log_every=1",
        *LAYOUTS[layout],
    )
    last = trainer.train_and_evaluate(cfg)
    records = [json.loads(line) for line in (cfg_out(cfg) / "metrics.jsonl").open()]
    first = next(r for r in records if r.get("kind") == "train" and r["step"] == 1)
    _, params = hf.load(QWEN, seq_len=16)
    tokens = jnp.asarray(_first_batch(cfg))
    loss, _ = reference_loss_and_grads(cfg.model, params, tokens)
    # fp32 both (compute_dtype float32, codec none): the TP run and the unsharded reference
    # differ only by reassociation, ~1e-6 relative; 1e-5 fails on any wrongly loaded weight.
    np.testing.assert_allclose(first["loss"], float(loss), rtol=1e-5)
    assert last["train"]["step"] == 3

    export(cfg_out(cfg), tmp_path / "export")
    cfg2, exported = hf.load(tmp_path / "export")
    assert cfg2 == cfg.model
    final = _final_params(cfg_out(cfg), 3)
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), final, exported)
    # The padding rows of the vocabulary are not exported (and load as zeros).
    assert jax.tree.all(same) or _equal_but_padding(final, exported, cfg.model)
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    assert not jax.tree.all(jax.tree.map(np.array_equal, params, exported))  # it trained


@pytest.mark.slow
def test_finetune_from_llama3_keeps_its_rope_scaling(tmp_path, cache):
    """A Llama 3.1-style checkpoint through the trainer (TP 2 x DP 2) and out: step 1's loss is
    the checkpoint's, and the run's saved config (a dict) restores the rope scaling, so the
    export is the same model."""
    jax.clear_caches()
    cfg = _config(
        tmp_path,
        cache,
        "model.seq_len=16",
        'data.tokenizer="byte"',
        'compression.fwd="none"',
        "run.steps=3",
        "run.eval_every=3",
        "run.checkpoint_every=3",
        "run.log_every=1",
        *LAYOUTS["shard_map_tp2_dp2"],
        init_from=LLAMA3,
    )
    trainer.train_and_evaluate(cfg)
    records = [json.loads(line) for line in (cfg_out(cfg) / "metrics.jsonl").open()]
    first = next(r for r in records if r.get("kind") == "train" and r["step"] == 1)
    _, params = hf.load(LLAMA3, seq_len=16)
    loss, _ = reference_loss_and_grads(cfg.model, params, jnp.asarray(_first_batch(cfg)))
    # As above: fp32 both ways, reassociation only (~1e-6); the rope scaling dropped anywhere
    # would move the loss by far more (it moves the fixture's logits by 17%).
    np.testing.assert_allclose(first["loss"], float(loss), rtol=1e-5)

    export(cfg_out(cfg), tmp_path / "export")
    cfg2, exported = hf.load(tmp_path / "export")
    assert cfg2 == cfg.model and cfg2.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 128)
    final = _final_params(cfg_out(cfg), 3)
    assert jax.tree.all(
        jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), final, exported)
    )


def _equal_but_padding(final, exported, model) -> bool:
    final = jax.tree.map(np.array, final)
    final["wte"][model.vocab_size :] = 0
    return jax.tree.all(jax.tree.map(np.array_equal, final, exported))


def cfg_out(cfg) -> Path:
    return Path(cfg.run.out_dir)


def test_export_cli_errors_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        export_main([str(tmp_path / "no_run"), str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_run/config.json: no such file" in err[0]
