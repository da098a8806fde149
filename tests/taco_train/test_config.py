"""Config files, command-line overrides and validation errors."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from taco_models.config import ModelConfig, RopeScaling
from taco_train.config import (
    CompressionConfig,
    ConfigError,
    DataConfig,
    OptimizerConfig,
    RunConfig,
    TrainConfig,
    apply_override,
    build_config,
    from_saved,
    load_config,
    parse_value,
)

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


def test_configs_dir_is_not_empty():
    assert {p.name for p in CONFIGS} >= {"default.toml", "tiny.toml", "h200_convergence.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    cfg.compression.make_comm()


def test_default_config_is_the_laptop_run():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "default.toml")
    assert cfg.parallel.tp == 4 and cfg.compression.fwd == "taco"
    assert cfg.data.corpus == "shakespeare"  # real text, not synthetic


def test_h200_preset_is_sized_to_the_corpus():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "h200_convergence.toml")
    assert 20e6 <= cfg.model.num_params() <= 40e6
    assert 256 <= cfg.model.seq_len <= 512 and cfg.parallel.tp == 4


def test_paper_3d_preset_compresses_every_dimension():
    """The paper's layout, TP 4 x PP 2 x DP 2, with TACO, TAH-Quant and SDP4Bit."""
    cfg = load_config(Path(__file__).parents[2] / "configs" / "paper_3d.toml")
    p, c = cfg.parallel, cfg.compression
    assert (p.tp, p.pp, p.dp, p.num_devices) == (4, 2, 2, 16)
    assert (c.fwd, c.pp, c.dp_grad, c.dp_param) == ("taco", "tahquant", "tlq_hs", "qwd")
    assert cfg.optimizer.sharded


def test_overrides_change_only_what_they_name():
    base = load_config(None)
    cfg = load_config(None, ["optimizer.lr=3e-4", "parallel.tp=4", "model.d_model=128"])
    assert cfg.optimizer.lr == 3e-4 and cfg.parallel.tp == 4 and cfg.model.d_model == 128
    assert cfg.optimizer.warmup_steps == base.optimizer.warmup_steps
    assert cfg.model.n_layers == base.model.n_layers


def test_override_beats_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[optimizer]\nlr = 1e-3\n[model]\npreset = "gpt_tiny"\n[data]\ntokenizer = "byte"\n'
    )
    assert load_config(path).optimizer.lr == 1e-3
    assert load_config(path, ["optimizer.lr=2e-3"]).optimizer.lr == 2e-3
    assert load_config(path).model.d_model == 64  # gpt_tiny


DEFAULT = Path(__file__).parents[2] / "configs" / "default.toml"  # a preset and its geometry


@pytest.mark.parametrize(
    "overrides",
    [["model.preset='gpt_125m'"], ["model.seq_len=256", "model.preset=gpt_125m"]],
    ids=["preset", "seq_len_before_preset"],
)
def test_a_preset_set_on_the_command_line_is_that_preset(overrides):
    """`--set model.preset` names the model: the file's [model] (gpt_small_cpu narrowed to 192
    wide, 4096 tokens, 128 long) is dropped, the command line's model keys apply on top in any
    order, and the file's other sections stay."""
    cfg = load_config(DEFAULT, overrides)
    seq_len = dict(o.split("=") for o in overrides).get("model.seq_len")
    expected = ModelConfig.preset("gpt_125m", **({"seq_len": int(seq_len)} if seq_len else {}))
    assert cfg.model == expected and cfg.model.d_model == 768 and cfg.model.n_layers == 12
    assert cfg.parallel.tp == load_config(DEFAULT).parallel.tp == 4


def test_model_keys_without_a_preset_apply_over_the_files_model():
    base = load_config(DEFAULT).model
    assert base.d_model == 192 and base.vocab_size == 4096  # the file's, not gpt_small_cpu's 256
    cfg = load_config(DEFAULT, ["model.d_model=256"])
    assert cfg.model == dataclasses.replace(base, d_model=256)


def test_init_from_in_the_file_gives_way_to_a_preset_set_on_the_command_line():
    """The file names a checkpoint (and its training length); --set model.preset names another
    model: the preset's geometry, no checkpoint. The file's data.tokenizer='hf' read that
    checkpoint's tokenizer: without it, an error saying the file's model was replaced."""
    path = Path(__file__).parents[2] / "configs" / "finetune_qwen25_0p5b.toml"
    cfg = load_config(path, ["model.preset=gpt_tiny", "data.tokenizer=byte"])
    assert cfg.init_from is None and cfg.model == ModelConfig.preset("gpt_tiny")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["model.preset=gpt_tiny"])
    assert str(info.value) == (
        f"config file {str(path)!r} (its [model] replaced: --set model.preset=gpt_tiny names the "
        "model): data.tokenizer='hf' reads the tokenizer.json of model.init_from, which is not set"
    )


def test_a_preset_and_init_from_in_one_place_both_name_the_model(tmp_path):
    both = "both name the model; the checkpoint's config.json gives its geometry: set only one"
    with pytest.raises(ConfigError, match=re.escape(both)):
        load_config(None, ["model.preset=gpt_tiny", "model.init_from='ckpt'"])
    path = tmp_path / "mine.toml"
    path.write_text('[model]\npreset = "gpt_tiny"\ninit_from = "ckpt"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"config file {str(path)!r}: ") and both in str(info.value)


def test_int_widens_to_float_and_strings_parse():
    assert load_config(None, ["optimizer.lr=1"]).optimizer.lr == 1.0
    assert isinstance(load_config(None, ["optimizer.lr=1"]).optimizer.lr, float)
    assert parse_value("taco") == "taco" and parse_value('"x"') == "x"
    assert parse_value("true") is True and parse_value("3e-4") == 3e-4
    assert load_config(None, ["compression.bwd=none"]).compression.bwd == "none"


def test_rope_scaling_is_a_toml_table_and_survives_the_saved_config():
    """`model.rope_scaling` (Llama 3.1's) from a TOML inline table; a run directory's
    config.json (`to_dict`, then `from_saved` on resume or export) restores it."""
    table = (
        "{factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, "
        "original_max_position_embeddings = 16}"
    )
    cfg = load_config(
        None, ['model.preset="llama_tiny"', 'data.tokenizer="byte"', f"model.rope_scaling={table}"]
    )
    assert cfg.model.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    assert from_saved(json.loads(json.dumps(cfg.to_dict()))).model == cfg.model
    with pytest.raises(ConfigError, match="rope_scaling='x' must be a RopeScaling or a dict"):
        load_config(
            None, ['model.preset="llama_tiny"', 'data.tokenizer="byte"', 'model.rope_scaling="x"']
        )


def test_tp_takes_tahquant_grids_with_their_own_group_size():
    cfg = load_config(None, ["compression.fwd=tahquant4_nearest"]).compression
    assert cfg.make_comm().fwd.codec.group_size == 32  # its own G, not the TP codecs' 128
    assert load_config(None, []).compression.make_comm().fwd.codec.group_size == 128
    with pytest.raises(ValueError, match="group_size=64 differs"):
        load_config(None, ["compression.fwd=tahquant4_nearest", "compression.group_size=64"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=-1", "optimizer.lr=-1.0"),
        ("optimizer.lrr=1", "unknown key optimizer.lrr"),
        ("optim.lr=1", "unknown section 'optim'"),
        ("optimizer.lr", "section.key=value"),
        ("compression.fwd=fp4", "compression.fwd='fp4'"),
        (
            "data.batch_size=30",
            "data.batch_size=30 is not a multiple of parallel.dp x microbatches=4",
        ),
        ("run.steps=ten", "run.steps='ten'"),
        ("compression.pp=int3", "compression.pp='int3'"),
        ("compression.pp_grads=tahquant", "compression.pp_grads='tahquant'"),
        ("compression.pp_grads=taco", "compression.pp_grads='taco' compresses pipeline traffic"),
        ("compression.pp_link=infiniband", "compression.pp_link='infiniband'"),
        ("parallel.pp=3", "pp x repeats=3"),
        ("run.stop_at=5000", "run.stop_at=5000"),
        ("model.preset='gpt_huge'", "gpt_huge"),
        ("data.tokenizer=chars", "data.tokenizer='chars'"),
        ("compression.dp_grad=fp8", "compression.dp_grad='fp8'"),
        ("compression.dp_param=tlq_hs", "compression.dp_param='tlq_hs'"),
        ("compression.dp_grad=tlq_hs", "needs optimizer.sharded=true"),
        ("optimizer.bucket_elements=0", "optimizer.bucket_elements=0 must be >= 1"),
        ("optimizer.b2=1", "optimizer.b2=1.0 must be in [0, 1)"),
        ("compression.error_budget_consecutive=0", "error_budget_consecutive=0 must be >= 1"),
        ("model.preset=3", "model.preset=3 does not match the field type str"),
        ("model.init_from=3", "model.init_from=3 does not match the field type str"),
    ],
)
def test_validation_errors_name_the_value(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, ["parallel.dp=4", override])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: OptimizerConfig(b1=1.0), "optimizer.b1=1.0 must be in [0, 1)"),
        (lambda: OptimizerConfig(min_lr_ratio=1.5), "optimizer.min_lr_ratio=1.5 must be in [0, 1]"),
        (lambda: DataConfig(val_fraction=0.0), "data.val_fraction=0.0 must be in (0, 1)"),
        (lambda: RunConfig(steps=0), "run.steps=0 must be >= 1"),
        (lambda: RunConfig(stop_at=20, steps=10), "run.stop_at=20 must be in [1, run.steps=10]"),
        (
            lambda: RunConfig(distributed="maybe"),
            "run.distributed='maybe' does not match the field type 'auto' | 'on' | 'off'",
        ),
        (lambda: RunConfig(steps="10"), "run.steps='10' does not match the field type int"),
        (lambda: CompressionConfig(pp_link="wifi"), "compression.pp_link='wifi' is not one of"),
        (
            lambda: CompressionConfig(error_budget=float("nan")),
            "compression.error_budget=nan must be > 0",
        ),
    ],
)
def test_a_section_checks_its_fields_when_built_in_python(make, message):
    """The checks beside the fields run in `__post_init__`, for a section built in Python as
    for one loaded; NaN fails a bound."""
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value).startswith(message)


def test_a_saved_config_is_checked_as_a_file_is():
    """A run directory's config.json goes through the same names, types and checks."""
    saved = json.loads(json.dumps(load_config(None).to_dict()))
    assert from_saved(saved) == load_config(None)
    saved["run"]["steps"] = "ten"
    with pytest.raises(ConfigError, match="run.steps='ten' does not match the field type int"):
        from_saved(saved)
    saved["run"] = {"stepz": 10}
    with pytest.raises(ConfigError, match=r"unknown key run.stepz \(did you mean run.steps\?\)"):
        from_saved(saved)


def test_an_error_budget_needs_measuring_steps():
    with pytest.raises(ValueError, match="compression.error_budget=0.05 needs measuring steps"):
        load_config(None, ["compression.error_budget=0.05"])
    cfg = load_config(None, ["compression.error_budget=0.05", "run.comm_error_every=100"])
    assert cfg.compression.error_budget == 0.05 and cfg.run.comm_error_every == 100
    with pytest.raises(ValueError, match="compression.error_budget=-0.1 must be > 0"):
        load_config(None, ["compression.error_budget=-0.1", "run.comm_error_every=100"])
    with pytest.raises(ValueError, match="run.comm_error_every=-1 must be >= 0"):
        load_config(None, ["run.comm_error_every=-1"])
    with pytest.raises(ValueError, match="compression.fallback_codec='int9' is not one of"):
        load_config(None, ["compression.fallback_codec=int9"])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.vocab_sise=3",
            "unknown key model.vocab_sise (did you mean model.vocab_size?); valid keys: ['arch', ",
        ),
        (
            "optimiser.lr=3",
            "unknown section 'optimiser' (did you mean 'optimizer'?); valid sections: ('model', ",
        ),
        ("model.zzz=3", "unknown key model.zzz; valid keys: "),  # nothing close
        ("run.out_dri=x", "(did you mean run.out_dir?)"),
    ],
)
def test_unknown_names_say_the_closest_valid_one(override, message):
    with pytest.raises(ValueError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(f"override {override!r}: ") and message in str(info.value)


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[optimizer]\nlrr = 1e-3\n", "unknown key optimizer.lrr (did you mean optimizer.lr?)"),
        ("[optimiser]\nlr = 1e-3\n", "unknown section 'optimiser' (did you mean 'optimizer'?)"),
        ("[run]\nsteps = 'ten'\n", "run.steps='ten' does not match the field type int"),
        ("[run]\nstop_at = 1.5\n", "run.stop_at=1.5 does not match the field type int | None"),
        (
            "[data]\ntokenizer = 3\n",
            "data.tokenizer=3 does not match the field type 'bpe' | 'byte' | 'hf'",
        ),
        ("[optimizer]\nlr = -1.0\n", "optimizer.lr=-1.0 must be > 0"),
        ("[optimizer]\nlr = 1e-3\n[run]\nsteps = [\n", "Invalid value"),  # not TOML
    ],
)
def test_errors_in_a_config_file_name_the_file(toml, message, tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(toml)
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert str(info.value).startswith(f"config file {str(path)!r}: ") and message in str(info.value)


def test_a_config_file_not_in_utf8_is_one_error_naming_the_file(tmp_path):
    """TOML is UTF-8: a Latin-1 byte is the file's error, not a traceback."""
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[run]\nout_dir = 'caf\xe9'\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert str(info.value).startswith(f"config file {str(path)!r}: ")
    assert "can't decode byte 0xe9" in str(info.value)


def test_a_bad_value_given_by_an_override_does_not_blame_the_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[optimizer]\nlr = 1e-3\n")
    with pytest.raises(ValueError) as info:
        load_config(path, ["optimizer.lr=-2"])
    assert str(info.value) == "optimizer.lr=-2.0 must be > 0"


def test_a_conflict_made_by_an_override_blames_the_override(tmp_path):
    """The file's budget is fine with its measuring steps; --set run.comm_error_every=0 takes
    them away: the error names the override first, then the file."""
    path = tmp_path / "mine.toml"
    path.write_text("[compression]\nerror_budget = 0.05\n[run]\ncomm_error_every = 100\n")
    load_config(path)
    with pytest.raises(ValueError) as info:
        load_config(path, ["run.comm_error_every=0"])
    assert str(info.value) == (
        f"--set run.comm_error_every=0 conflicts with config file {str(path)!r}: "
        "compression.error_budget=0.05 needs measuring steps: set run.comm_error_every (e.g. 100)"
    )


def test_a_vocabulary_tp_cannot_split_says_the_vocab_size_to_set():
    """4000 pads to 4096 rows, which tp = 3 does not split; 4224 (a multiple of lcm(128, 3))
    pads to itself, which it does."""
    layout = [
        "parallel.tp=3",
        "model.n_heads=6",
        "model.n_kv_heads=6",
        "model.d_model=192",
        "model.d_ff=768",
    ]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "model.vocab_size=4000 is padded to 4096 rows (a multiple of 128), which parallel.tp=3 "
            "does not split: set model.vocab_size to a multiple of 384 (e.g. 4224) or parallel.tp "
            "to a divisor of 4096"
        ),
    ):
        load_config(None, [*layout, "model.vocab_size=4000"])
    assert load_config(None, [*layout, "model.vocab_size=4224"]).model.padded_vocab == 4224


def test_one_f_one_b_schedule_is_accepted_and_takes_no_repeats():
    one_f_one_b = [
        "parallel.mode='shard_map'",
        "parallel.pp=2",
        "parallel.microbatches=4",
        "parallel.schedule=1f1b",
        "run.comm_error_every=2",
    ]
    assert load_config(None, one_f_one_b).parallel.schedule == "1f1b"
    with pytest.raises(ValueError, match="repeats=2 needs schedule='circular'"):
        load_config(None, [*one_f_one_b, "parallel.repeats=2"])


def test_bpe_vocab_must_fit_uint16():
    with pytest.raises(ValueError, match="model.vocab_size=70000"):
        build_config({"model": {"preset": "gpt_tiny", "vocab_size": 70000}})


def test_apply_override_builds_sections():
    tree = {}
    apply_override(tree, "run.steps=5")
    apply_override(tree, "run.out_dir=/tmp/x")
    assert tree == {"run": {"steps": 5, "out_dir": "/tmp/x"}}


def test_sharded_optimizer_takes_every_layout():
    cfg = load_config(
        None,
        [
            "optimizer.sharded=true",
            "parallel.dp=2",
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.microbatches=2",
        ],
    )
    assert cfg.optimizer.sharded and cfg.parallel.pp == 2


def test_pp_grads_runs_with_the_collective_options():
    overrides = [
        "parallel.mode='shard_map'",
        "parallel.pp=2",
        "parallel.microbatches=2",
        "compression.pp_grads=taco",
        "compression.min_compress_bytes=0",
        "compression.link=nvlink",
        "compression.pp_link=socket",
    ]
    shared = load_config(None, overrides).compression.stage_codecs().shared_grads
    assert shared.codec.name == "taco" and shared.min_compress_bytes == 0
    assert shared.link == "socket"  # the stages' link, not TP's
    assert load_config(None, []).compression.stage_codecs().shared_grads == "none"
