"""Hugging Face checkpoints in and out: GPT-2 (`GPT2LMHeadModel`), Qwen2 / Qwen2.5
(`Qwen2ForCausalLM`), Llama 2 / 3 / 3.1+ (`LlamaForCausalLM`, rope_scaling "llama3" included)
and Mistral without a sliding window (`MistralForCausalLM`): directories of `config.json` and
safetensors files.

    cfg, params = taco_models.hf.load("Qwen2.5-0.5B")        # full fp32 parameters, host memory
    taco_models.hf.save(cfg, params, "out")                   # a directory transformers loads

One table per layout (`_rules`: GPT-2's; Qwen2's, Llama's and Mistral's, alike) maps each of
our parameters to the Hugging Face tensors it is made of, with the reshape and transpose between
the layouts (as jax-ml/bonsai's `models/qwen3/params.py` does); loading and saving both read it.
Our layouts: QKV [D, K, R, H] with KV head k's q_per_kv queries, key and value in slots 0..R-1
(`taco_models.model`), blocks stacked on a leading layers axis, the vocabulary padded to
`ModelConfig.padded_vocab` (zero rows on load, dropped on save). GPT-2's Conv1D weights are
stored [in, out], torch.nn.Linear's [out, in].

With `shardings` (a tree of `jax.sharding.Sharding`s like the parameters', e.g.
`NamedSharding(mesh, taco_models.param_specs(cfg))`) every device reads only the slices of the
safetensors files its shard is made of (`safe_open(...).get_slice`), so a checkpoint larger than
one device's memory loads under TP and PP.

Errors name the file and the key in one line (`CheckpointError`): no config.json, an
architecture other than these, a setting ours lacks (a sliding window, a rope type other than
ROPE_TYPES, biases Llama may add), a missing tensor, a shape that does not match, a damaged file
(a config.json that is not JSON, a truncated safetensors file).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from taco_models.config import ModelConfig, RopeScaling

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Hugging Face architecture -> (our arch, its config.json's model_type).
ARCHITECTURES = {
    "GPT2LMHeadModel": ("gpt", "gpt2"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "mistral"),
}
ROPE_TYPES = ("default", "llama3")
# Buffers some checkpoints hold that are not parameters (GPT-2's causal mask, old rotary tables).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


class CheckpointError(ValueError):
    """A Hugging Face directory that cannot be read as the model it claims to hold."""


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def load_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of the Hugging Face directory `path` (reads only its config.json)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{file}: no such file (a Hugging Face model directory holds one)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{file}: not valid JSON ({error})") from None
    archs = hf.get("architectures") or []
    arch = next((ARCHITECTURES[a][0] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{file}: architectures={archs} (model_type={hf.get('model_type')!r}) is not "
            f"supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    try:
        return _gpt2_config(hf, file) if arch == "gpt" else _rotary_config(hf, file, arch)
    except KeyError as error:
        raise CheckpointError(f"{file}: key {error.args[0]!r} is missing") from None


def _require(ok: bool, file: Path, message: str) -> None:
    if not ok:
        raise CheckpointError(f"{file}: {message}")


def _gpt2_config(hf: dict, file: Path) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    # Ours is jax.nn.gelu's tanh approximation, which is GPT-2's "gelu_new".
    _require(
        act in ("gelu_new", "gelu_pytorch_tanh"),
        file,
        f"activation_function={act!r} is not GPT-2's tanh GELU (gelu_new)",
    )
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        _require(not hf.get(key, False), file, f"{key}=true is not supported")
    _require(hf.get("scale_attn_weights", True), file, "scale_attn_weights=false is not supported")
    d = hf["n_embd"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        seq_len=hf["n_positions"],
        d_model=d,
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        n_kv_heads=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * d,
        arch="gpt",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def _rope(hf: dict, file: Path) -> tuple[float, RopeScaling | None]:
    """(rope theta, scaling) as transformers reads them: 4.x's `rope_theta` and `rope_scaling`,
    5.x's `rope_parameters` (where both are set, 5.x takes `rope_scaling`). Rope types other
    than ROPE_TYPES are refused."""
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    table = hf.get(name) or {}
    kind = table.get("rope_type", table.get("type", "default"))
    supported = ", ".join(ROPE_TYPES)
    _require(
        kind in ROPE_TYPES,
        file,
        f"{name}.rope_type={kind!r} is not supported; supported: {supported}",
    )
    theta = table.get("rope_theta", hf.get("rope_theta"))
    _require(theta is not None, file, "neither rope_theta nor rope_parameters.rope_theta is set")
    partial = table.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    _require(partial == 1.0, file, f"partial_rotary_factor={partial} is not supported (1.0)")
    if kind == "default":
        return float(theta), None
    try:
        scaling = RopeScaling(
            factor=float(table["factor"]),
            low_freq_factor=float(table["low_freq_factor"]),
            high_freq_factor=float(table["high_freq_factor"]),
            # transformers 5.x's default; 4.x requires the key
            original_max_position_embeddings=int(
                table.get("original_max_position_embeddings", hf["max_position_embeddings"])
            ),
        )
    except KeyError as error:
        raise CheckpointError(f"{file}: key {name}.{error.args[0]} is missing") from None
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{file}: {error}") from None
    return float(theta), scaling


def _rotary_config(hf: dict, file: Path, arch: str) -> ModelConfig:
    """Qwen2, Llama and Mistral: the same config.json keys; each refuses what ours lacks."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    act = hf.get("hidden_act", "silu")
    _require(act == "silu", file, f"hidden_act={act!r} is not supported (silu)")
    head_dim = hf.get("head_dim") or d // heads
    _require(
        head_dim * heads == d,
        file,
        f"head_dim={head_dim} x num_attention_heads={heads} != hidden_size={d}",
    )
    if arch == "qwen2":
        _require(
            not hf.get("use_sliding_window", False),
            file,
            "use_sliding_window=true is not supported",
        )
    if arch == "mistral":  # transformers' MistralConfig defaults to a window of 4096
        window = hf.get("sliding_window", 4096)
        _require(
            window is None, file, f"sliding_window={window} is not supported (null: full attention)"
        )
    if arch in ("llama", "mistral"):
        for key in ("attention_bias", "mlp_bias"):
            _require(not hf.get(key, False), file, f"{key}=true is not supported")
    theta, scaling = _rope(hf, file)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        seq_len=hf["max_position_embeddings"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=hf["intermediate_size"],
        arch=arch,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )


def hf_config(cfg: ModelConfig, token_ids: dict[str, int | list[int]] | None = None) -> dict:
    """The config.json of `cfg` (transformers 4.x keys, which 5.x reads too). token_ids: e.g.
    {"bos_token_id": 0, "eos_token_id": [0, 2]}, each id inside the vocabulary (without them
    transformers assumes GPT-2's 50256)."""
    token_ids = dict(token_ids or {})
    for key, ids in token_ids.items():
        for i in ids if isinstance(ids, list) else [ids]:
            if not (isinstance(i, int) and 0 <= i < cfg.vocab_size):
                raise ValueError(
                    f"{key}={ids!r} is not inside the vocabulary [0, {cfg.vocab_size})"
                )
    architecture, model_type = next(
        (name, kind) for name, (arch, kind) in ARCHITECTURES.items() if arch == cfg.arch
    )
    common = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tied_embeddings,
        "torch_dtype": "float32",
    }
    common |= token_ids
    if cfg.arch == "gpt":
        return {
            **common,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.d_ff,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
    arch_keys = {
        "qwen2": {"use_sliding_window": False},
        "llama": {"attention_bias": False, "mlp_bias": False},
        "mistral": {"sliding_window": None},
    }[cfg.arch]
    scaling = cfg.rope_scaling
    return {
        **common,
        "max_position_embeddings": cfg.seq_len,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None
        if scaling is None
        else {"rope_type": "llama3", **dataclasses.asdict(scaling)},
        "attention_dropout": 0.0,
        **arch_keys,
    }


# ---------------------------------------------------------------------------------------------
# The tables: our parameter <- Hugging Face tensors.


@dataclasses.dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor as (part of) one of our parameters (one layer's, for blocks).

    factors: per axis of the HF tensor, the sizes it is a row-major reshape into; perm: our
    axes as positions in the flattened factor list (our block = transpose(reshape(hf), perm)).
    hf_shape: the tensor's shape; an axis shorter than its factors' product is the vocabulary,
    which ours pads with zero rows.
    """

    name: str  # "{i}" stands for the layer index
    factors: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    hf_shape: tuple[int, ...]

    @property
    def flat(self) -> tuple[int, ...]:
        return tuple(itertools.chain(*self.factors))

    @property
    def shape(self) -> tuple[int, ...]:  # ours (one layer's)
        return tuple(self.flat[p] for p in self.perm)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Our parameter `path` (one layer's slice when `layered`) as its `pieces` joined along our
    axis `axis`."""

    path: tuple[str, ...]
    pieces: tuple[Piece, ...]
    axis: int = 0
    layered: bool = False


def _piece(name, factors, perm, hf_shape=None) -> Piece:
    factors = tuple(tuple(f) for f in factors)
    return Piece(name, factors, tuple(perm), hf_shape or tuple(math.prod(f) for f in factors))


def _rules(cfg: ModelConfig) -> list[Rule]:
    return _gpt2_rules(cfg) if cfg.arch == "gpt" else _rotary_rules(cfg)


def _vocab_rules(cfg: ModelConfig, embed: str) -> list[Rule]:
    v, vp, d = cfg.vocab_size, cfg.padded_vocab, cfg.d_model
    rules = [Rule(("wte",), (_piece(embed, [[vp], [d]], (0, 1), (v, d)),))]
    if not cfg.tied_embeddings:  # torch.nn.Linear [V, D]; ours [D, V]
        rules.append(Rule(("lm_head",), (_piece("lm_head.weight", [[vp], [d]], (1, 0), (v, d)),)))
    return rules


def _gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    d, n, h, f = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
    p = "transformer.h.{i}."
    vec = lambda name, size: _piece(name, [[size]], (0,))
    layer = lambda path, *pieces: Rule(path, pieces, layered=True)
    return [
        *_vocab_rules(cfg, "transformer.wte.weight"),
        Rule(("wpe",), (_piece("transformer.wpe.weight", [[cfg.seq_len], [d]], (0, 1)),)),
        layer(("blocks", "norm_attn", "scale"), vec(p + "ln_1.weight", d)),
        layer(("blocks", "norm_attn", "bias"), vec(p + "ln_1.bias", d)),
        # Conv1D [D, 3 N H] (q, k, v) -> [D, N, 3, H]: MHA's slots are query, key, value.
        layer(
            ("blocks", "attn", "wqkv"),
            _piece(p + "attn.c_attn.weight", [[d], [3, n, h]], (0, 2, 1, 3)),
        ),
        layer(("blocks", "attn", "bqkv"), _piece(p + "attn.c_attn.bias", [[3, n, h]], (1, 0, 2))),
        layer(("blocks", "attn", "wo"), _piece(p + "attn.c_proj.weight", [[n, h], [d]], (0, 1, 2))),
        layer(("blocks", "attn", "bo"), vec(p + "attn.c_proj.bias", d)),
        layer(("blocks", "norm_mlp", "scale"), vec(p + "ln_2.weight", d)),
        layer(("blocks", "norm_mlp", "bias"), vec(p + "ln_2.bias", d)),
        layer(("blocks", "mlp", "w_up"), _piece(p + "mlp.c_fc.weight", [[d], [f]], (0, 1))),
        layer(("blocks", "mlp", "b_up"), vec(p + "mlp.c_fc.bias", f)),
        layer(("blocks", "mlp", "w_down"), _piece(p + "mlp.c_proj.weight", [[f], [d]], (0, 1))),
        layer(("blocks", "mlp", "b_down"), vec(p + "mlp.c_proj.bias", d)),
        Rule(("norm_out", "scale"), (vec("transformer.ln_f.weight", d),)),
        Rule(("norm_out", "bias"), (vec("transformer.ln_f.bias", d),)),
    ]


def _rotary_rules(cfg: ModelConfig) -> list[Rule]:
    """Qwen2, Llama and Mistral name their tensors alike; Qwen2 adds the QKV bias."""
    d, k, q, h, f = cfg.d_model, cfg.n_kv_heads, cfg.q_per_kv, cfg.head_dim, cfg.d_ff
    p = "model.layers.{i}."
    a = p + "self_attn."
    # torch.nn.Linear [out, in]. Query head n = k q + j (GQA groups), so q_proj's rows
    # [K, Q, H] and k / v_proj's [K, 1, H] join on our slot axis R = Q + 2.
    qkv_w = [_piece(a + "q_proj.weight", [[k, q, h], [d]], (3, 0, 1, 2))] + [
        _piece(a + f"{x}_proj.weight", [[k, 1, h], [d]], (3, 0, 1, 2)) for x in "kv"
    ]
    qkv_b = [_piece(a + "q_proj.bias", [[k, q, h]], (0, 1, 2))] + [
        _piece(a + f"{x}_proj.bias", [[k, 1, h]], (0, 1, 2)) for x in "kv"
    ]
    up = [_piece(p + f"mlp.{x}_proj.weight", [[1, f], [d]], (2, 0, 1)) for x in ("gate", "up")]
    vec = lambda name: _piece(name, [[d]], (0,))
    bias = [Rule(("blocks", "attn", "bqkv"), tuple(qkv_b), axis=1, layered=True)]
    return [
        *_vocab_rules(cfg, "model.embed_tokens.weight"),
        Rule(("blocks", "norm_attn", "scale"), (vec(p + "input_layernorm.weight"),), layered=True),
        Rule(("blocks", "attn", "wqkv"), tuple(qkv_w), axis=2, layered=True),
        *(bias if cfg.qkv_bias else []),
        Rule(
            ("blocks", "attn", "wo"),
            (_piece(a + "o_proj.weight", [[d], [cfg.n_heads, h]], (1, 2, 0)),),
            layered=True,
        ),
        Rule(
            ("blocks", "norm_mlp", "scale"),
            (vec(p + "post_attention_layernorm.weight"),),
            layered=True,
        ),
        Rule(("blocks", "mlp", "w_up"), tuple(up), axis=1, layered=True),
        Rule(
            ("blocks", "mlp", "w_down"),
            (_piece(p + "mlp.down_proj.weight", [[d], [f]], (1, 0)),),
            layered=True,
        ),
        Rule(("norm_out", "scale"), (vec("model.norm.weight"),)),
    ]


def _names(rule: Rule, cfg: ModelConfig) -> list[str]:
    layers = range(cfg.n_layers) if rule.layered else [None]
    return [piece.name.format(i=i) for i in layers for piece in rule.pieces]


# ---------------------------------------------------------------------------------------------
# Reading.


class _Files:
    """The directory's safetensors tensors by name, opened lazily with the numpy API."""

    def __init__(self, path: Path):
        self._open = _open_safetensors
        index = path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index}: not a weight map ({error!r})") from None
            self.where = {name: path / file for name, file in weight_map.items()}
        elif (path / SINGLE_FILE).is_file():
            with self._open(path / SINGLE_FILE) as f:
                self.where = dict.fromkeys(f.keys(), path / SINGLE_FILE)
        else:
            raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} is there")
        self.where = {_canonical(name): file for name, file in self.where.items()}
        self._raw = {}  # canonical -> stored name
        for file in set(self.where.values()):
            if not file.is_file():
                raise CheckpointError(f"{file}: no such file ({INDEX_FILE} names it)")
            with self._open(file) as f:
                stored = f.keys()
            self._raw.update({_canonical(name): name for name in stored})
        self._handles: dict[Path, object] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        file = self.where[name]
        if file not in self._handles:
            self._handles[file] = self._open(file).__enter__()
        return self._handles[file].get_slice(self._raw[name])

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor[index] as fp32, reading only that block from the file."""
        return np.asarray(self._slice(name)[index], dtype=np.float32)


def _open_safetensors(file: Path):
    """`safe_open(file)` (numpy), a damaged file (truncated, not safetensors) a CheckpointError
    naming it in one line."""
    from safetensors import SafetensorError, safe_open  # the train extra's (the core: JAX+NumPy)

    try:
        return safe_open(file, framework="numpy")
    except SafetensorError as error:
        size = file.stat().st_size
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({size:,} bytes: {error}); a download "
            "cut short leaves one like it: fetch it again"
        ) from None


def _canonical(name: str) -> str:
    # The original GPT-2 checkpoints on the Hub omit GPT2LMHeadModel's "transformer." prefix.
    bare = ("wte.", "wpe.", "h.", "ln_f.")
    return "transformer." + name if name.startswith(bare) else name


def _check_tensors(files: _Files, cfg: ModelConfig, path: Path) -> None:
    """Every mismatch at once: missing tensors, wrong shapes, tensors the model has no place
    for; raises one CheckpointError of one line per problem."""
    problems, expected = [], set()
    for rule in _rules(cfg):
        layers = range(cfg.n_layers) if rule.layered else [None]
        for i, piece in itertools.product(layers, rule.pieces):
            name = piece.name.format(i=i)
            expected.add(name)
            if name not in files.where:
                problems.append(f"{path}: tensor {name!r} is missing")
            elif files.shape(name) != piece.hf_shape:
                problems.append(
                    f"{files.where[name]}: tensor {name!r} has shape "
                    f"{files.shape(name)}, expected {piece.hf_shape}"
                )
    extra = [n for n in files.where if n not in expected and not n.endswith(_IGNORED_SUFFIXES)]
    if cfg.tied_embeddings:  # a tied checkpoint may still store the head: the same matrix
        extra = [n for n in extra if n != "lm_head.weight"]
    problems += [f"{files.where[n]}: tensor {n!r} has no place in the model" for n in extra]
    if problems:
        raise CheckpointError("\n".join(problems))


def _runs(factors: tuple[int, ...], ranges: list[range], limit: int) -> list[slice]:
    """The contiguous runs of flat indices, in row-major order, of the block `ranges` of an
    axis reshaped into `factors`, clipped to the stored length `limit`."""
    grids = np.meshgrid(*[np.asarray(r) for r in ranges], indexing="ij")
    flat = np.ravel_multi_index([g.ravel() for g in grids], factors)
    flat = flat[flat < limit]
    if flat.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(flat) != 1) + 1
    return [slice(int(run[0]), int(run[-1]) + 1) for run in np.split(flat, breaks)]


def _read_piece(files: _Files, name: str, piece: Piece, ours: list[range]) -> np.ndarray:
    """Our block `ours` (one range per our axis) of `piece`, reading only what it needs."""
    flat_ranges = [None] * len(piece.flat)
    for axis, p in enumerate(piece.perm):
        flat_ranges[p] = ours[axis]
    runs, start = [], 0
    for hf_axis, factors in enumerate(piece.factors):
        axis_ranges = flat_ranges[start : start + len(factors)]
        runs.append(_runs(factors, axis_ranges, piece.hf_shape[hf_axis]))
        start += len(factors)
    block = _read_runs(files, name, runs)
    wanted = [
        math.prod(len(r) for r in flat_ranges[s : s + len(f)])
        for s, f in zip(_starts(piece.factors), piece.factors, strict=True)
    ]
    pad = [(0, w - n) for w, n in zip(wanted, block.shape, strict=True)]  # the padded vocabulary
    block = np.pad(block, pad) if any(p for _, p in pad) else block
    return block.reshape([len(r) for r in flat_ranges]).transpose(piece.perm)


def _starts(factors) -> list[int]:
    return list(itertools.accumulate([len(f) for f in factors[:-1]], initial=0))


def _read_runs(files: _Files, name: str, runs: list[list[slice]]) -> np.ndarray:
    if any(not r for r in runs):  # entirely padding
        return np.zeros([0] * len(runs), np.float32)

    def gather(axis: int, prefix: tuple[slice, ...]) -> np.ndarray:
        if axis == len(runs):
            return files.read(name, prefix)
        parts = [gather(axis + 1, (*prefix, run)) for run in runs[axis]]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)

    return gather(0, ())


def _read_rule(files: _Files, rule: Rule, shape: tuple[int, ...], index) -> np.ndarray:
    """Our parameter of `shape` at `index` (a tuple of slices, as jax callbacks pass)."""
    ranges = [range(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
    layers = ranges[0] if rule.layered else [None]
    ours = ranges[1:] if rule.layered else ranges
    blocks = []
    for i in layers:
        parts, offset = [], 0
        for piece in rule.pieces:
            size = piece.shape[rule.axis]
            r = ours[rule.axis]
            lo, hi = max(r.start, offset), min(r.stop, offset + size)
            if lo < hi:
                sub = list(ours)
                sub[rule.axis] = range(lo - offset, hi - offset)
                parts.append(_read_piece(files, piece.name.format(i=i), piece, sub))
            offset += size
        blocks.append(np.concatenate(parts, axis=rule.axis))
    return np.stack(blocks) if rule.layered else blocks[0]


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load(
    path: str | Path, shardings: dict | None = None, seq_len: int | None = None
) -> tuple[ModelConfig, dict]:
    """(ModelConfig, fp32 parameters) of the Hugging Face directory `path` (config.json and
    model.safetensors, or shards named by model.safetensors.index.json).

    shardings: None returns numpy arrays (the whole model in host memory); a tree of
    `jax.sharding.Sharding`s shaped like the parameters returns `jax.Array`s built with
    `jax.make_array_from_callback`, each device reading only its own slices from the files.
    seq_len: the training sequence length of a rotary model (all but GPT-2), instead of
    config.json's max_position_embeddings (GPT-2's learned positions fix it).
    """
    from taco_models.parallel import abstract_params

    path = Path(path)
    cfg = load_config(path)
    if seq_len is not None and seq_len != cfg.seq_len:
        if cfg.arch == "gpt":
            raise CheckpointError(
                f"{path / CONFIG_FILE}: seq_len={seq_len} differs from n_positions="
                f"{cfg.seq_len}, which GPT-2's learned positions fix"
            )
        cfg = dataclasses.replace(cfg, seq_len=seq_len)
    files = _Files(path)
    _check_tensors(files, cfg, path)
    shapes = abstract_params(cfg)
    params: dict = {}
    for rule in _rules(cfg):
        shape = _get(shapes, rule.path).shape
        if shardings is None:
            value = _read_rule(files, rule, shape, (slice(None),) * len(shape))
        else:
            read = lambda index, rule=rule, shape=shape: _read_rule(files, rule, shape, index)
            value = jax.make_array_from_callback(shape, _get(shardings, rule.path), read)
        _set(params, rule.path, value)
    return cfg, params


# ---------------------------------------------------------------------------------------------
# Writing.


def _write_piece(ours: np.ndarray, piece: Piece) -> np.ndarray:
    flat = ours.transpose(np.argsort(piece.perm)).reshape(piece.flat)
    full = flat.reshape([math.prod(f) for f in piece.factors])
    return np.ascontiguousarray(full[tuple(slice(0, n) for n in piece.hf_shape)])


def to_hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our parameters -> {Hugging Face tensor name: fp32 numpy array}."""
    tensors = {}
    for rule in _rules(cfg):
        value = np.asarray(jax.device_get(_get(params, rule.path)), dtype=np.float32)
        layers = range(cfg.n_layers) if rule.layered else [None]
        for i in layers:
            ours = value[i] if rule.layered else value
            bounds = np.cumsum([piece.shape[rule.axis] for piece in rule.pieces])[:-1]
            parts = np.split(ours, bounds, axis=rule.axis)
            for piece, part in zip(rule.pieces, parts, strict=True):
                tensors[piece.name.format(i=i)] = _write_piece(part, piece)
    return tensors


def save(
    cfg: ModelConfig,
    params: dict,
    path: str | Path,
    *,
    max_shard_bytes: int | None = None,
    extra_files: Callable[[Path], None] | None = None,
    token_ids: dict[str, int | list[int]] | None = None,
) -> None:
    """Writes `params` as a Hugging Face directory that transformers loads: config.json and
    model.safetensors (fp32), or with `max_shard_bytes` shards and model.safetensors.index.json.
    The vocabulary's padding rows are dropped. extra_files(path) may add e.g. a tokenizer;
    token_ids: config.json's bos_token_id / eos_token_id (`hf_config`)."""
    from safetensors.numpy import save_file

    path = Path(path)
    config = hf_config(cfg, token_ids)  # before anything is written
    path.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_tensors(cfg, params)
    for stale in [*path.glob("model*.safetensors"), path / INDEX_FILE]:  # an earlier save's
        stale.unlink(missing_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if max_shard_bytes is None:
        save_file(tensors, str(path / SINGLE_FILE), metadata=metadata)
    else:
        _save_sharded(tensors, path, max_shard_bytes, metadata)
    if extra_files is not None:
        extra_files(path)


def _save_sharded(tensors: dict, path: Path, max_bytes: int, metadata: dict) -> None:
    from safetensors.numpy import save_file

    shards: list[dict] = [{}]
    for name, value in tensors.items():
        if shards[-1] and sum(v.nbytes for v in shards[-1].values()) + value.nbytes > max_bytes:
            shards.append({})
        shards[-1][name] = value
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
