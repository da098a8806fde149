"""Typed run configuration for the bundled training script.

A run is `TrainConfig(model, parallel, compression, optimizer, data, run)`, frozen dataclasses
whose fields are the keys a config file (TOML) or `--set section.key=value` may set: their type
hints check the values, and each field's check sits beside it (`field(default, gt=0)`, or
`__post_init__` where it involves other fields). The model section names a preset (default
`DEFAULT_PRESET`) plus any `ModelConfig` field, or a Hugging Face checkpoint, `init_from = DIR`,
read when the run starts (`TrainConfig.model` is None until `resolve_model`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import taco_jax
from taco_jax import codecs
from taco_models import hf
from taco_models.config import ModelConfig
from taco_models.parallel import ParallelConfig, check_config
from taco_models.pipeline import StageCodecs
from taco_train import zero

DEFAULT_PRESET = "gpt_small_cpu"


class ConfigError(ValueError):
    """A configuration or usage error: `python -m taco_train` prints it as one line, exit 2."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# A field's bounds, named as pydantic's `Field` names them; each test fails NaN. One bound is
# said "must be > 0", two "must be in [0, 1)".
_TESTS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}
_SAID = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_ENDS = {"ge": "[", "gt": "(", "le": "]", "lt": ")"}


def field(default: Any, *, one_of: Sequence[str] | None = None, **bounds: float) -> Any:
    """A section's field and its check, beside it: the values allowed (`one_of`) or bounds,
    the lower first (`gt=0`; `ge=0, lt=1`: in [0, 1)). None ("unset") passes every check."""
    return dataclasses.field(default=default, metadata={"one_of": one_of, "bounds": bounds})


def _problem(value: Any, one_of: Sequence[str] | None, bounds: dict[str, float]) -> str | None:
    """What is wrong with `value` under a field's check ("must be > 0"); None where nothing."""
    if one_of is not None:
        return None if value in one_of else f"is not one of {tuple(one_of)}"
    if all(_TESTS[name](value, bound) for name, bound in bounds.items()):
        return None
    (low_name, low), *upper = bounds.items()
    if upper:  # an interval
        ((high_name, high),) = upper
        return f"must be in {_ENDS[low_name]}{low}, {high}{_ENDS[high_name]}"
    return f"must be {_SAID[low_name]} {low}"


class Section:
    """A section defined here: each field is checked against its type hint, then its `field`
    check; a subclass's `__post_init__` adds the checks across its fields."""

    def __post_init__(self):
        section = next(name for name, cls in _SECTION_CLASSES.items() if cls is type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            key, value = f"{section}.{f.name}", getattr(self, f.name)
            _coerce(key, value, _keys(section)[f.name])
            if value is not None and f.metadata and (problem := _problem(value, **f.metadata)):
                raise ConfigError(f"{key}={value!r} {problem}")


_COMM = taco_jax.CommConfig  # the collectives' option defaults, in one place
_TP_CODECS = taco_jax.CODEC_NAMES + taco_jax.collectives.TAHQUANT_CODEC_NAMES
Fallbacks = Mapping[str, str] | None  # {call site: codec} the error budget chose
# The collective options `CompressionConfig` passes on to `taco_jax.CommConfig`.
COLLECTIVE_OPTIONS = ("group_size", "impl", "algorithm", "slices", "min_compress_bytes", "link")


@dataclasses.dataclass(frozen=True)
class CompressionConfig(Section):
    """How a run's collectives are compressed: TP's (`taco_jax.TPComm.create`), the pipeline's
    and the sharded optimizer's. Each key: docs/training.md, "Configuration reference"."""

    # TP's activations / their gradients (bwd None: as fwd); TAH-Quant's grids as a baseline.
    fwd: str = field(codecs.DEFAULT_CODEC, one_of=_TP_CODECS)
    bwd: str | None = field(None, one_of=_TP_CODECS)
    # `taco_jax.CommConfig`'s options, checked there (`make_comm`); None: the library decides.
    group_size: int | None = None
    impl: str = _COMM.impl
    algorithm: str = _COMM.algorithm
    slices: int = _COMM.slices
    min_compress_bytes: int | None = _COMM.min_compress_bytes
    link: str = _COMM.link
    # The error budget's call sites and their fallbacks (`taco_train.comm_error`).
    error_budget: float | None = field(None, gt=0)
    error_budget_consecutive: int = field(2, ge=1)
    fallback_codec: str = field("none", one_of=taco_jax.CODEC_NAMES)
    # The pipeline's sends (pp_bwd None: pp's backward) and its sum over stages (pp_grads).
    pp: str = field("none", one_of=taco_jax.ppermute.CODEC_NAMES)
    pp_bwd: str | None = field(None, one_of=taco_jax.ppermute.CODEC_NAMES)
    pp_grads: str = field("none", one_of=taco_jax.CODEC_NAMES)
    pp_link: str = field("auto", one_of=taco_jax.policy.LINKS)
    # SDP4Bit's codecs of the sharded optimizer's gradient reduce-scatter / parameter all-gather.
    dp_grad: str = field("none", one_of=zero.GRAD_CODECS)
    dp_param: str = field("none", one_of=zero.PARAM_CODECS)
    tune: str = field("auto", one_of=("auto", "off", "force"))  # when TP is timed (tuning.py)

    def __post_init__(self):
        super().__post_init__()
        self.make_comm()

    def make_comm(self, *, measure: bool = False, fallbacks: Fallbacks = None) -> taco_jax.TPComm:
        """The TP collectives; measure: report each call site's error (`taco_jax.telemetry`);
        fallbacks: {call site: codec} the error budget chose (`CommConfig.site_codecs`)."""
        options = {k: getattr(self, k) for k in COLLECTIVE_OPTIONS}
        sites = dict(fallbacks or {})
        return taco_jax.TPComm.create(
            "tp", fwd=self.fwd, bwd=self.bwd, telemetry=measure, site_codecs=sites, **options
        )

    def stage_codecs(self, *, measure: bool = False, fallbacks: Fallbacks = None) -> StageCodecs:
        """The pipeline's codecs (`measure`, `fallbacks` as `make_comm`'s)."""
        fallbacks = fallbacks or {}
        shared = self.pp_grads
        if shared != "none":  # a compressed_psum with the TP collectives' options, its own link
            options = {k: getattr(self, k) for k in COLLECTIVE_OPTIONS if k != "link"}
            shared = taco_jax.comm_config(
                shared, link=self.pp_link, telemetry=measure, site_codecs=dict(fallbacks), **options
            )
        forward = fallbacks.get("pp_send/fwd", self.pp)
        backward = fallbacks.get("pp_send/bwd", fallbacks.get("pp_send_grads/fwd", self.pp_bwd))
        return StageCodecs(forward, backward, telemetry=measure, shared_grads=shared)

    def zero_config(
        self,
        grad_clip: float,
        dp_axis: str | tuple[str, ...],
        bucket_elements: int,
        *,
        measure: bool = False,
        fallbacks: Fallbacks = None,
    ) -> zero.ZeroConfig:
        """The sharded optimizer's configuration (`measure`, `fallbacks` as `make_comm`'s)."""
        grad = "none" if "dp_grads" in (fallbacks or {}) else self.dp_grad
        param = "none" if "dp_params" in (fallbacks or {}) else self.dp_param
        return zero.ZeroConfig(dp_axis, grad, param, grad_clip, self.impl, measure, bucket_elements)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section):
    """AdamW, linear warmup then cosine decay to `lr * min_lr_ratio`, global-norm clipping;
    `sharded`: ZeRO-1 over dp (`taco_train.zero`), `bucket_elements` padded elements a bucket."""

    lr: float = field(3e-4, gt=0)
    min_lr_ratio: float = field(0.1, ge=0, le=1)
    warmup_steps: int = field(100, ge=0)
    weight_decay: float = field(0.1, ge=0)
    b1: float = field(0.9, ge=0, lt=1)
    b2: float = field(0.95, ge=0, lt=1)
    eps: float = field(1e-8, gt=0)
    grad_clip: float = field(1.0, gt=0)
    sharded: bool = False
    bucket_elements: int = field(zero.BUCKET_ELEMENTS, ge=1)


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """The corpus (`taco_train.data.corpus_documents`), its tokenizer, the validation split
    (`taco_train.data.split_corpus`), the global batch; cache_dir None: `$TACO_JAX_CACHE` or
    `~/.cache/taco_jax`."""

    corpus: str = "shakespeare"
    tokenizer: Literal["bpe", "byte", "hf"] = "bpe"
    val_fraction: float = field(0.05, gt=0, lt=1)
    batch_size: int = field(32, ge=1)
    seed: int = 0
    cache_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig(Section):
    """Length of the run, how often to log / evaluate / checkpoint, and where outputs go."""

    steps: int = field(1000, ge=1)
    log_every: int = field(10, ge=1)
    eval_every: int = field(100, ge=1)
    eval_batches: int = field(8, ge=1)
    checkpoint_every: int = field(500, ge=1)
    keep_checkpoints: int = field(2, ge=1)
    out_dir: str = "runs/default"  # metrics.jsonl, loss.png, config.json, checkpoints/
    resume: bool = True  # from the latest checkpoint in out_dir, if there is one
    stop_at: int | None = None  # end after this step, as if interrupted; checked below
    seed: int = 0
    peak_tflops: float | None = field(None, gt=0)  # for MFU; None: known GPUs' own
    distributed: Literal["auto", "on", "off"] = "auto"  # auto: if JAX_COORDINATOR_ADDRESS is set
    progress: bool = True
    tensorboard: bool = True
    profile_steps: int = field(0, ge=0)  # traced with jax.profiler from profile_start
    profile_start: int = field(5, ge=1)
    async_checkpoint: bool = True
    comm_error_every: int = field(0, ge=0)  # 0: never; `taco_train.comm_error`
    sample_tokens: int = field(0, ge=0)  # printed from the final checkpoint at the end
    reset_fallbacks: bool = False  # `taco_train.comm_error.resumed_fallbacks`

    def __post_init__(self):
        super().__post_init__()
        _check(
            self.stop_at is None or 1 <= self.stop_at <= self.steps,
            f"run.stop_at={self.stop_at} must be in [1, run.steps={self.steps}]",
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A run. init_from: model.init_from, a Hugging Face checkpoint (`taco_models.hf`), whose
    geometry `model` is None until read (`resolve_model`), seq_len the length set beside it."""

    model: ModelConfig | None
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    compression: CompressionConfig = dataclasses.field(default_factory=CompressionConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    init_from: str | None = None
    seq_len: int | None = None

    def __post_init__(self):
        m, p, d, c, o = self.model, self.parallel, self.data, self.compression, self.optimizer
        _check(
            d.tokenizer != "hf" or self.init_from is not None,
            "data.tokenizer='hf' reads the tokenizer.json of model.init_from, which is not set",
        )
        _check(m is not None or self.init_from is not None, "model: no preset and no init_from")
        if m is None:  # the checks below need the checkpoint's geometry: when the run starts
            return
        source = "" if self.init_from is None else f" (of model.init_from={self.init_from!r})"
        batch, per_step = d.batch_size, p.dp * p.microbatches
        _check(
            batch % per_step == 0,
            f"data.batch_size={batch} is not a multiple of parallel.dp x microbatches={per_step}",
        )
        _check(
            batch % (per_step * p.overlap_chunks) == 0,
            f"parallel.overlap_chunks={p.overlap_chunks} does not divide the batch each device "
            f"runs at once (data.batch_size={batch} / (dp x microbatches={per_step}))",
        )
        _check(
            d.tokenizer != "byte" or m.vocab_size >= 256,
            f"model.vocab_size={m.vocab_size}{source} < 256 cannot hold the byte tokenizer",
        )
        _check(
            d.tokenizer != "bpe" or 257 <= m.vocab_size <= 65535,
            f"model.vocab_size={m.vocab_size}{source} must be in [257, 65535] for the bpe "
            "tokenizer (256 byte symbols + end-of-text; token ids are stored as uint16)"
            + ("; data.tokenizer='hf' uses the checkpoint's own" if source else ""),
        )
        _check(
            c.error_budget is None or self.run.comm_error_every > 0,
            f"compression.error_budget={c.error_budget} needs measuring steps: set "
            "run.comm_error_every (e.g. 100)",
        )
        pipeline = (p.pp > 1, "pipeline traffic: needs parallel.pp > 1")
        sharded = (o.sharded, "the sharded optimizer's traffic: needs optimizer.sharded=true")
        needs = {"pp": pipeline, "pp_grads": pipeline, "dp_grad": sharded, "dp_param": sharded}
        for name, (ok, what) in needs.items():
            value = getattr(c, name)
            _check(ok or value == "none", f"compression.{name}={value!r} compresses {what}")
        try:  # before any data is prepared: the model must split parallel.tp ways
            check_config(m, p)
        except ValueError as error:
            raise ConfigError(str(error)) from error

    def to_dict(self) -> dict[str, Any]:
        """The sections as nested dicts; `init_from` (and `seq_len`) in the model's."""
        tree = dataclasses.asdict(self)
        init_from, seq_len = tree.pop("init_from"), tree.pop("seq_len")
        if init_from is not None:  # resolved, the geometry's seq_len is the one set
            tree["model"] = {"init_from": init_from, **(tree["model"] or {"seq_len": seq_len})}
        return tree


SECTIONS = ("model", "parallel", "compression", "optimizer", "data", "run")
_CLASSES = (ModelConfig, ParallelConfig, CompressionConfig, OptimizerConfig, DataConfig, RunConfig)
_SECTION_CLASSES = dict(zip(SECTIONS, _CLASSES, strict=True))


def parse_value(text: str) -> Any:
    """A `--set` value: a TOML literal (`3e-4`, `true`, `"x"`, `[1, 2]`) or else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(tree: dict[str, dict[str, Any]], override: str) -> str:
    """Applies one `section.key=value` to the nested dict `tree` in place; returns the key."""
    key, sep, value = override.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise ConfigError(f"override {override!r} is not of the form section.key=value")
    try:
        _keys(section, name)
    except ConfigError as error:
        raise ConfigError(f"override {override!r}: {error}") from None
    tree.setdefault(section, {})[name] = parse_value(value.strip())
    return f"{section}.{name}"


@functools.cache
def _keys(section: str, name: str | None = None) -> dict[str, Any]:
    """{key: type} of a section: its dataclass's fields, and the model's preset and init_from.
    ConfigError naming the closest valid one where `section`, or `name` in it, is none."""
    if section not in SECTIONS:  # "did you mean" the closest, where one is close
        close = difflib.get_close_matches(section, SECTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown section {section!r}{hint}; valid sections: {SECTIONS}")
    hints = typing.get_type_hints(cls := _SECTION_CLASSES[section])
    keys = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    keys |= {"preset": str, "init_from": str} if section == "model" else {}
    if name is not None and name not in keys:
        close = difflib.get_close_matches(name, list(keys), n=1)
        hint = f" (did you mean {section}.{close[0]}?)" if close else ""
        raise ConfigError(f"unknown key {section}.{name}{hint}; valid keys: {sorted(keys)}")
    return keys


def _typed(tree: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`tree` ({section: {key: value}}), its names and its values' types checked."""
    for section, values in tree.items():
        _keys(section)
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a table, got {values!r}")
    return {  # in the order of SECTIONS: the order of the checks
        section: {k: _coerce(f"{section}.{k}", v, _keys(section, k)[k]) for k, v in values.items()}
        for section, values in sorted(tree.items(), key=lambda item: SECTIONS.index(item[0]))
    }


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` if it is of the type `hint`, an int widened where a float is asked; a type other
    than int, float, str, bool, None or a Literal (`model.rope_scaling`) judges its values."""
    for t in typing.get_args(hint) if typing.get_origin(hint) in _UNIONS else (hint,):
        if typing.get_origin(t) is Literal:
            if value in typing.get_args(t):
                return value
        elif t not in (int, float, str, bool, type(None)):
            return value
        elif type(value) is t or (t is float and type(value) is int):
            return float(value) if t is float else value
    raise ConfigError(f"{key}={value!r} does not match the field type {type_name(hint)}")


_UNIONS = (typing.Union, types.UnionType)


def type_name(hint: Any) -> str:
    """A field type as a user writes it: "float", "int | None", "'bpe' | 'byte' | 'hf'"."""
    if typing.get_origin(hint) in _UNIONS:
        return " | ".join(type_name(t) for t in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return " | ".join(repr(v) for v in typing.get_args(hint))
    return "None" if hint is type(None) else hint.__name__


def _built(section: str, values: dict[str, Any], make: Callable | None = None) -> Any:
    """Section `section` built by `make` (else its class); its models' errors name it."""
    try:
        return (make or _SECTION_CLASSES[section])(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{section}: {error}") from error


def build_config(tree: Mapping[str, Any]) -> TrainConfig:
    """Builds a `TrainConfig` from a nested {section: {key: value}} dict of overrides (a run
    from a checkpoint not read yet, where model.init_from names one that is absent)."""
    tree = _typed(tree)
    model = tree.pop("model", {})
    if "init_from" not in model:
        preset = functools.partial(ModelConfig.preset, model.pop("preset", DEFAULT_PRESET))
        model = _built("model", model, preset)  # first: the order of the checks
        return TrainConfig(model, **{s: _built(s, values) for s, values in tree.items()})
    init_from, seq_len = model["init_from"], model.get("seq_len")
    _check(init_from != "", "model.init_from='' must be the path of a directory")
    if "preset" in model:
        raise ConfigError(
            f"model.init_from={init_from!r} and model.preset={model['preset']!r} both name the "
            "model; the checkpoint's config.json gives its geometry: set only one"
        )
    if others := sorted(set(model) - {"init_from", "seq_len"}):
        raise ConfigError(
            f"model.{others[0]} cannot be set with model.init_from={init_from!r} (the "
            "checkpoint's config.json gives the geometry; only model.seq_len, the training "
            "length, may be set)"
        )
    _check(seq_len is None or seq_len >= 1, f"model.seq_len={seq_len} must be >= 1")
    sections = {s: _built(s, values) for s, values in tree.items()}
    return resolve_model(TrainConfig(None, init_from=init_from, seq_len=seq_len, **sections))


def resolve_model(cfg: TrainConfig, *, required: bool = False) -> TrainConfig:
    """`cfg` with the geometry of its `init_from` checkpoint's config.json (and `seq_len`), all
    checks run; unchanged while that file is absent, unless `required` (a run about to start)."""
    if cfg.model is not None or not (required or (Path(cfg.init_from) / hf.CONFIG_FILE).is_file()):
        return cfg
    try:
        model = hf.load_config(cfg.init_from)
        if cfg.seq_len is not None and cfg.seq_len != model.seq_len:
            _check(
                model.arch != "gpt",
                f"model.seq_len={cfg.seq_len} differs from the n_positions={model.seq_len} of "
                f"model.init_from={cfg.init_from!r} (GPT-2's learned positions fix it): set "
                f"model.seq_len={model.seq_len} or leave it unset",
            )
            model = dataclasses.replace(model, seq_len=cfg.seq_len)
    except hf.CheckpointError as error:
        raise ConfigError(f"model.init_from={cfg.init_from!r}: {error}") from None
    return dataclasses.replace(cfg, model=model)


def from_saved(tree: dict[str, dict[str, Any]]) -> TrainConfig:
    """The `TrainConfig` of a run directory's config.json (`TrainConfig.to_dict`)."""
    tree = _typed(tree)
    model = tree.pop("model")
    init_from = model.pop("init_from", None)
    if init_from is not None and "vocab_size" not in model:  # never resolved
        raise ConfigError("the saved config names model.init_from but no model geometry")
    model = _built("model", model)
    seq_len = None if init_from is None else model.seq_len
    sections = {s: _built(s, values) for s, values in tree.items()}
    return TrainConfig(model, init_from=init_from, seq_len=seq_len, **sections)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Reads a TOML file (or none), applies `section.key=value` overrides (model.preset or
    model.init_from replaces the file's [model]), builds; an error in the file's values names it."""
    where, tree = f"config file {str(path)!r}", {}
    try:
        if path is not None:
            tree = tomllib.loads(Path(path).read_bytes().decode())  # as tomllib.load reads
            _typed(tree)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ConfigError) as error:
        raise ConfigError(f"{where}: {error}") from None
    named = [o for o in overrides if apply_override({}, o) in ("model.preset", "model.init_from")]
    if named and tree.pop("model", None) is not None:  # the file's own model (docs/training.md)
        where += f" (its [model] replaced: --set {named[-1]} names the model)"
    set_by = {apply_override(tree, override): override for override in overrides}  # the last
    from_file = {f"{s}.{k}" for s, values in tree.items() for k in values} - set(set_by)
    try:
        return build_config(tree)
    except ConfigError as error:
        raise _blamed(error, where, from_file, set_by) from None


def _blamed(error: ConfigError, where: str, from_file: set[str], set_by: dict[str, str]):
    """`error` saying where its values came from: an error about a value of the file (its first
    key) starts with the file, after the --set values it names where a --set made it."""
    first = re.match(r"(\w+\.\w+)=", str(error))
    if first is None or first.group(1) not in from_file:
        return error
    named = {f"{s}.{k}" for s, k in re.findall(r"\b(\w+)\.(\w+)\b", str(error)) if s in SECTIONS}
    if conflicting := [set_by[key] for key in sorted(named) if key in set_by]:
        sets = " ".join(f"--set {override}" for override in conflicting)
        return ConfigError(f"{sets} conflicts with {where}: {error}")
    return ConfigError(f"{where}: {error}")
