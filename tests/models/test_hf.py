"""taco_models.hf: Hugging Face checkpoints in and out, against transformers' own logits.

The fixtures (tests/models/fixtures/hf/, made by scripts/make_hf_fixtures.py with transformers)
are tiny random GPT-2, Qwen2, Llama and Mistral models (tied and untied heads, GQA, Llama 3.1's
rope scaling, one sharded checkpoint) with transformers' fp32 logits of a fixed batch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("safetensors")

from taco_models import hf  # noqa: E402
from taco_models.config import RopeScaling  # noqa: E402
from taco_models.layers import rotary_frequencies  # noqa: E402
from taco_models.parallel import (  # noqa: E402
    ParallelConfig,
    make_logits,
    make_mesh,
    param_specs,
    reference_logits,
)

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = (
    "gpt2",
    "qwen2_untied",
    "qwen2_tied",
    "qwen2_untied_v5",
    "llama3_untied",
    "llama_tied",
    "mistral",
)
# A Python with torch and transformers (not project dependencies), for the test that
# transformers loads what we save; unset, that test is skipped.
HF_PYTHON = os.environ.get("TACO_HF_PYTHON")

# Our fp32 logits against transformers' (torch, fp32): the same arithmetic in different matmul
# and reduction orders (einsum vs torch.matmul, attention as XLA fuses it vs torch's SDPA), so
# each dot product of length n <= 128 differs by reassociation, ~ sqrt(n) eps_fp32 ~ 1e-6
# relative per layer, compounding over 2 layers, a norm and the head to a few 1e-6. 1e-4
# relative to the largest logit leaves a margin of > 10x for that and still fails on any wrong
# mapping (a transposed or misplaced tensor changes logits by O(1) relative).
LOGITS_RTOL = 1e-4


def _relative_max_diff(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def _ours(cfg, params, tokens) -> np.ndarray:
    logits = reference_logits(cfg, params, jnp.asarray(tokens), dtype="float32")
    return np.asarray(logits)[..., : cfg.vocab_size]


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers(name):
    cfg, params = hf.load(FIXTURES / name)
    tokens = np.load(FIXTURES / name / "tokens.npy")
    theirs = np.load(FIXTURES / name / "logits.npy")
    assert _relative_max_diff(_ours(cfg, params, tokens), theirs) <= LOGITS_RTOL


def test_fixture_geometry():
    """What each fixture exercises: padding, GQA, the two heads, sharding, the 4.x config."""
    gpt2 = hf.load_config(FIXTURES / "gpt2")
    assert (gpt2.arch, gpt2.vocab_size, gpt2.padded_vocab, gpt2.tied_embeddings) == (
        "gpt",
        250,
        256,
        True,
    )
    untied, tied = (hf.load_config(FIXTURES / n) for n in ("qwen2_untied", "qwen2_tied"))
    assert (untied.n_heads, untied.n_kv_heads, untied.rope_theta) == (8, 4, 1e6)  # GQA, tp <= 4
    assert not untied.tied_embeddings and tied.tied_embeddings
    assert (FIXTURES / "qwen2_tied" / hf.INDEX_FILE).is_file()
    v4, v5 = (
        json.loads((FIXTURES / n / hf.CONFIG_FILE).read_text())
        for n in ("qwen2_untied", "qwen2_untied_v5")
    )
    assert v4["rope_theta"] == 1e6 and "rope_parameters" not in v4  # transformers 4.x
    assert v5["rope_parameters"]["rope_theta"] == 1e6 and "rope_theta" not in v5  # 5.x
    assert hf.load_config(FIXTURES / "qwen2_untied_v5") == untied
    llama3, llama_tied, mistral = (
        hf.load_config(FIXTURES / n) for n in ("llama3_untied", "llama_tied", "mistral")
    )
    assert (llama3.arch, llama3.n_kv_heads, llama3.tied_embeddings) == ("llama", 4, False)
    assert llama3.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 128)
    assert (llama_tied.arch, llama_tied.n_kv_heads, llama_tied.tied_embeddings) == (
        "llama",
        2,
        True,
    )
    assert llama_tied.rope_scaling is None and mistral.rope_scaling is None
    assert (mistral.arch, mistral.n_kv_heads, mistral.tied_embeddings) == ("mistral", 2, False)
    assert json.loads((FIXTURES / "mistral" / hf.CONFIG_FILE).read_text())["sliding_window"] is None


# config.json of published checkpoints as the Hub serves them (transformers 4.x keys, extras
# included), with the parameter count transformers builds from each (`numel` of every
# parameter; the Hub's "8.03B", "7.25B", "135M").
PUBLISHED = {
    "Llama-3.1-8B": (
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.43.0.dev0",
            "use_cache": True,
            "vocab_size": 128256,
        },
        8_030_261_248,
    ),
    "Mistral-7B-v0.3": (
        {
            "architectures": ["MistralForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mistral",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.42.0.dev0",
            "use_cache": True,
            "vocab_size": 32768,
        },
        7_248_023_552,
    ),
    "SmolLM2-135M": (
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "hidden_act": "silu",
            "hidden_size": 576,
            "initializer_range": 0.041666666666666664,
            "intermediate_size": 1536,
            "is_llama_config": True,
            "max_position_embeddings": 8192,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 9,
            "num_hidden_layers": 30,
            "num_key_value_heads": 3,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_interleaved": False,
            "rope_scaling": None,
            "rope_theta": 100000,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.42.3",
            "use_cache": True,
            "vocab_size": 49152,
        },
        134_515_008,
    ),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_load_with_their_parameter_count(name, tmp_path):
    config, count = PUBLISHED[name]
    (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(config))
    cfg = hf.load_config(tmp_path)
    assert cfg.num_params() == count and cfg.padded_vocab == cfg.vocab_size
    assert (cfg.rope_scaling is not None) == (name == "Llama-3.1-8B")


def test_llama31_rotary_frequencies_equal_transformers():
    """Llama 3.1 8B's rope (head size 128, theta 5e5, "llama3" factor 8, 1, 4, 8192: 6 of its 64
    frequencies interpolated, 29 divided) against transformers' `_compute_llama3_parameters`.
    Both are fp32: a power (ours theta^-x, theirs 1 / theta^x) then a handful of roundings in
    the smoothing, each <= 1 ulp, so they agree to ~8 eps_fp32 relative."""
    theirs = np.load(FIXTURES / "llama31_rope_frequencies.npy")
    ours = np.asarray(rotary_frequencies(128, 5e5, RopeScaling(8.0, 1.0, 4.0, 8192)))
    np.testing.assert_allclose(ours, theirs, rtol=8 * np.finfo(np.float32).eps, atol=0)
    unscaled = np.asarray(rotary_frequencies(128, 5e5))
    assert np.sum(~np.isclose(unscaled, theirs, rtol=1e-3)) == 6 + 29  # the scaling is exercised


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip_is_exact(name, tmp_path):
    cfg, params = hf.load(FIXTURES / name)
    hf.save(cfg, params, tmp_path)
    cfg2, params2 = hf.load(tmp_path)
    assert cfg2 == cfg
    same = jax.tree.map(lambda a, b: a.shape == b.shape and np.array_equal(a, b), params, params2)
    assert jax.tree.all(same)


def _tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="numpy") as f:
            names = f.keys()
            shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in names}
    return shapes


@pytest.mark.parametrize("name", NAMES)
def test_save_writes_the_hugging_face_names_and_shapes(name, tmp_path):
    cfg, params = hf.load(FIXTURES / name)
    hf.save(cfg, params, tmp_path, max_shard_bytes=50_000)
    assert _tensor_shapes(tmp_path) == _tensor_shapes(FIXTURES / name)
    assert (tmp_path / hf.INDEX_FILE).is_file()
    assert hf.load_config(tmp_path) == cfg


def test_padded_vocabulary_rows_are_zero_and_dropped_on_save(tmp_path):
    cfg, params = hf.load(FIXTURES / "gpt2")
    assert params["wte"].shape == (256, 64) and not params["wte"][250:].any()
    params["wte"][250:] = 1.0  # training may move padding rows; they are not the model's
    hf.save(cfg, params, tmp_path)
    assert _tensor_shapes(tmp_path)["transformer.wte.weight"] == (250, 64)


def _edited(tmp_path: Path, name: str, edit) -> Path:
    directory = tmp_path / name
    shutil.copytree(FIXTURES / name, directory)
    config = json.loads((directory / hf.CONFIG_FILE).read_text())
    edit(config)
    (directory / hf.CONFIG_FILE).write_text(json.dumps(config))
    return directory


def test_rope_theta_from_transformers_4_and_5_configs(tmp_path):
    def as_v5(config):  # transformers 5.x writes rope_parameters
        config["rope_parameters"] = {"rope_theta": 12345.0, "rope_type": "default"}
        config.pop("rope_theta", None)

    def as_v4(config):
        config.pop("rope_parameters", None)
        config["rope_theta"] = 54321.0

    assert hf.load_config(_edited(tmp_path, "qwen2_untied", as_v5)).rope_theta == 12345.0
    shutil.rmtree(tmp_path / "qwen2_untied")
    assert hf.load_config(_edited(tmp_path, "qwen2_untied", as_v4)).rope_theta == 54321.0


def test_llama3_rope_from_transformers_4_config(tmp_path):
    """Llama 3.1's config.json as transformers 4.x writes it: `rope_theta` beside a
    `rope_scaling` table; save writes that form, and its original length whatever seq_len is."""

    def as_v4(config):
        scaling = config.pop("rope_parameters")
        config["rope_theta"] = scaling.pop("rope_theta")
        config["rope_scaling"] = scaling

    cfg = hf.load_config(FIXTURES / "llama3_untied")
    assert hf.load_config(_edited(tmp_path, "llama3_untied", as_v4)) == cfg
    written = hf.hf_config(dataclasses.replace(cfg, seq_len=64))
    assert written["rope_theta"] == 1e4 and "rope_parameters" not in written
    assert written["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }


@pytest.mark.parametrize(
    ("name", "table"),
    [("qwen2_untied", "rope_parameters"), ("llama3_untied", "rope_scaling")],
)
def test_other_rope_types_are_refused(tmp_path, name, table):
    def yarn(config):
        config[table] = {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}

    with pytest.raises(hf.CheckpointError) as info:
        hf.load_config(_edited(tmp_path, name, yarn))
    assert str(info.value).endswith(
        f"config.json: {table}.rope_type='yarn' is not supported; supported: default, llama3"
    )


def test_llama3_rope_without_its_factors(tmp_path):
    directory = _edited(tmp_path, "llama3_untied", lambda c: c["rope_parameters"].pop("factor"))
    with pytest.raises(hf.CheckpointError, match=r"config\.json: key rope_parameters\.factor is"):
        hf.load_config(directory)


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("mistral", {"sliding_window": 4096}, "sliding_window=4096 is not supported"),
        ("llama3_untied", {"attention_bias": True}, "attention_bias=true is not supported"),
        ("llama_tied", {"mlp_bias": True}, "mlp_bias=true is not supported"),
        ("llama_tied", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported (silu)"),
        ("llama_tied", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_what_ours_lacks_is_refused(tmp_path, name, edit, message):
    with pytest.raises(hf.CheckpointError, match=f"config\\.json: {re.escape(message)}"):
        hf.load_config(_edited(tmp_path, name, lambda c: c.update(edit)))


def test_mistral_without_the_key_has_transformers_default_window(tmp_path):
    directory = _edited(tmp_path, "mistral", lambda c: c.pop("sliding_window"))
    with pytest.raises(hf.CheckpointError, match="sliding_window=4096 is not supported"):
        hf.load_config(directory)


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the file and the key.


def test_no_config_json(tmp_path):
    with pytest.raises(hf.CheckpointError, match=r"config\.json: no such file") as info:
        hf.load(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_unknown_architecture(tmp_path):
    def gemma(config):
        config.update(architectures=["GemmaForCausalLM"], model_type="gemma")

    with pytest.raises(hf.CheckpointError) as info:
        hf.load(_edited(tmp_path, "gpt2", gemma))
    assert str(info.value).endswith(
        "config.json: architectures=['GemmaForCausalLM'] (model_type='gemma') is not supported; "
        "supported: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    )


def _rewrite_tensors(directory: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    file = directory / hf.SINGLE_FILE
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_tensor_and_wrong_shape_are_all_named(tmp_path):
    directory = tmp_path / "gpt2"
    shutil.copytree(FIXTURES / "gpt2", directory)

    def break_two(tensors):
        del tensors["transformer.h.1.mlp.c_fc.bias"]
        tensors["transformer.h.0.attn.c_attn.weight"] = np.zeros((64, 190), np.float32)

    _rewrite_tensors(directory, break_two)
    with pytest.raises(hf.CheckpointError) as info:
        hf.load(directory)
    shape, missing = str(info.value).splitlines()  # both, in the table's order
    assert f"{directory}: tensor 'transformer.h.1.mlp.c_fc.bias' is missing" in missing
    assert shape.endswith(
        "model.safetensors: tensor 'transformer.h.0.attn.c_attn.weight' has "
        "shape (64, 190), expected (64, 192)"
    )


def test_a_tensor_the_model_has_no_place_for(tmp_path):
    directory = tmp_path / "gpt2"
    shutil.copytree(FIXTURES / "gpt2", directory)
    extra = "transformer.h.2.ln_1.weight"  # a third layer in a two-layer config

    _rewrite_tensors(directory, lambda t: t.update({extra: t["transformer.ln_f.weight"]}))
    with pytest.raises(hf.CheckpointError) as info:
        hf.load(directory)
    assert str(info.value).endswith(
        f"model.safetensors: tensor {extra!r} has no place in the model"
    )


def test_bf16_checkpoint_loads_as_its_fp32_values(tmp_path):
    """Qwen2.5's published checkpoints are bf16: read through ml_dtypes, widened exactly."""
    import ml_dtypes

    directory = tmp_path / "qwen2_untied"
    shutil.copytree(FIXTURES / "qwen2_untied", directory)
    _rewrite_tensors(
        directory, lambda t: t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
    )
    _, params = hf.load(directory)
    _, full = hf.load(FIXTURES / "qwen2_untied")
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), full)
    assert jax.tree.all(jax.tree.map(np.array_equal, params, rounded))
    assert params["wte"].dtype == np.float32


def test_hub_gpt2_names_without_the_transformer_prefix(tmp_path):
    """The original GPT-2 checkpoints on the Hub name `h.0.attn...`, not
    `transformer.h.0.attn...`."""
    directory = tmp_path / "gpt2"
    shutil.copytree(FIXTURES / "gpt2", directory)

    def strip(tensors):
        for name in list(tensors):
            tensors[name.removeprefix("transformer.")] = tensors.pop(name)

    _rewrite_tensors(directory, strip)
    _, params = hf.load(directory)
    assert jax.tree.all(jax.tree.map(np.array_equal, params, hf.load(FIXTURES / "gpt2")[1]))


def test_geometry_that_disagrees_with_the_tensors(tmp_path):
    directory = _edited(tmp_path, "qwen2_untied", lambda c: c.update(intermediate_size=80))
    with pytest.raises(hf.CheckpointError, match=r"mlp\.gate_proj\.weight' has shape"):
        hf.load(directory)


def test_index_naming_an_absent_shard(tmp_path):
    directory = tmp_path / "qwen2_tied"
    shutil.copytree(FIXTURES / "qwen2_tied", directory)
    shard = sorted(directory.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(hf.CheckpointError, match=f"{shard.name}: no such file"):
        hf.load(directory)


# ---------------------------------------------------------------------------------------------
# Sharded loading: each device reads only its slices.


def _record_reads(monkeypatch) -> list[tuple[str, tuple[slice, ...], int]]:
    reads = []
    original = hf._Files.read

    def read(self, name, index):
        block = original(self, name, index)
        reads.append((name, index, block.size))
        return block

    monkeypatch.setattr(hf._Files, "read", read)
    return reads


@pytest.mark.parametrize("name", ["gpt2", "qwen2_tied", "llama3_untied"])
def test_tp4_load_reads_only_each_devices_slices(name, monkeypatch):
    """tp = 4 on a (dp 2, tp 4) mesh of 8 CPU devices: the arrays equal the full load, every
    device's shard of a TP-split parameter is a quarter, and the bytes read are exactly the
    shards' (no device reads another's slice; padding rows are not read)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    parallel = ParallelConfig(dp=2, tp=4)
    mesh = make_mesh(parallel)
    cfg = hf.load_config(FIXTURES / name)
    full = hf.load(FIXTURES / name)[1]
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg))
    reads = _record_reads(monkeypatch)
    _, sharded = hf.load(FIXTURES / name, shardings=shardings)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), sharded, full))
    # jax.make_array_from_callback calls back once for a fully replicated array, else once per
    # device; the dp = 2 devices holding the last vocabulary shard read none of its padding.
    held = sum(
        leaf.size
        if leaf.sharding.is_fully_replicated
        else sum(shard.data.size for shard in leaf.addressable_shards)
        for leaf in jax.tree.leaves(sharded)
    )
    padding = parallel.dp * (cfg.padded_vocab - cfg.vocab_size) * cfg.d_model
    assert sum(size for *_, size in reads) == held - padding
    wqkv = sharded["blocks"]["attn"]["wqkv"]
    assert {s.data.shape for s in wqkv.addressable_shards} == {
        (*wqkv.shape[:2], wqkv.shape[2] // 4, *wqkv.shape[3:])
    }


@pytest.mark.parametrize("name", ["qwen2_untied", "mistral"])
def test_pipeline_stages_read_only_their_layers(name, monkeypatch):
    """pp = 2 x tp = 2 (`full_layout_specs`): stage s reads layer s's tensors only."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    from taco_models.pipeline import full_layout_specs

    parallel = ParallelConfig(dp=2, pp=2, tp=2)
    mesh = make_mesh(parallel)
    cfg = hf.load_config(FIXTURES / name)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), full_layout_specs(cfg))
    full = hf.load(FIXTURES / name)[1]
    reads = _record_reads(monkeypatch)
    _, sharded = hf.load(FIXTURES / name, shardings=shardings)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), sharded, full))
    # o_proj.weight [D, N H] of layer l: the 4 devices of stage l (dp 2 x tp 2) read it, each
    # all D rows and its half of the heads' columns; no device reads the other stage's layer.
    o_reads = [(name, index) for name, index, _ in reads if "o_proj" in name]
    layers = sorted(name.split(".")[2] for name, _ in o_reads)
    assert layers == ["0"] * 4 + ["1"] * 4
    half = cfg.d_model // 2
    assert {(i[0].stop - i[0].start, i[1].stop - i[1].start) for _, i in o_reads} == {
        (cfg.d_model, half)
    }


@pytest.mark.parametrize("name", ["qwen2_untied", "llama3_untied"])
def test_tp4_loaded_model_runs_as_the_full_one(name):
    """The TP-sharded load fed to the shard_map model (codec "none") gives the full model's
    logits: the slices are where the TP ranks expect them."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    import taco_jax

    parallel = ParallelConfig(tp=4, compute_dtype="float32")
    mesh = make_mesh(parallel)
    cfg = hf.load_config(FIXTURES / name)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg))
    _, params = hf.load(FIXTURES / name, shardings=shardings)
    tokens = np.load(FIXTURES / name / "tokens.npy")
    logits = make_logits(cfg, parallel, taco_jax.TPComm.create("tp", fwd="none"), mesh)
    ours = np.asarray(jax.jit(logits)(params, jax.device_put(tokens, NamedSharding(mesh, P()))))
    theirs = np.load(FIXTURES / name / "logits.npy")
    assert _relative_max_diff(ours[..., : cfg.vocab_size], theirs) <= LOGITS_RTOL


# ---------------------------------------------------------------------------------------------
# transformers reads what we write (where a Python with torch and transformers is at hand).


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_transformers_loads_our_save(name, tmp_path):
    if not HF_PYTHON:
        pytest.skip("TACO_HF_PYTHON (a Python with torch and transformers) is not set")
    cfg, params = hf.load(FIXTURES / name)
    hf.save(cfg, params, tmp_path / "ours", max_shard_bytes=50_000)
    script = (
        "import sys, numpy as np, torch, transformers\n"
        "torch.use_deterministic_algorithms(True)\n"
        "t = torch.from_numpy(np.load(sys.argv[3])).long()\n"
        "for path, out in ((sys.argv[1], sys.argv[4]), (sys.argv[2], sys.argv[5])):\n"
        "    m = transformers.AutoModelForCausalLM.from_pretrained(path).eval()\n"
        "    with torch.no_grad(): np.save(out, m(t).logits.float().numpy())\n"
    )
    ours, original = tmp_path / "ours.npy", tmp_path / "original.npy"
    subprocess.run(
        [
            HF_PYTHON,
            "-c",
            script,
            str(tmp_path / "ours"),
            str(FIXTURES / name),
            str(FIXTURES / name / "tokens.npy"),
            str(ours),
            str(original),
        ],
        check=True,
    )
    # transformers on our save against transformers on the original, in one process: the
    # same weights through the same code with torch's deterministic algorithms, which PyTorch
    # documents as reproducible on one machine and release: bit-equal.
    np.testing.assert_array_equal(np.load(ours), np.load(original))
    # The logits stored with the fixture came from another machine, whose torch may take
    # other vector paths (an AVX-512 CPU: 1.2e-6 to 2.2e-6 apart): the same arithmetic in
    # another order, within LOGITS_RTOL's derivation above.
    stored = np.load(FIXTURES / name / "logits.npy")
    assert _relative_max_diff(np.load(ours), stored) <= LOGITS_RTOL
