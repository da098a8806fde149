"""How a collective communicates: `CommConfig` (every collective option and its default), the
codec a collective runs, and the forward and backward configurations of a call site.

The public ops (`taco_jax.collectives`) and `taco_jax.TPComm` take a codec (a name, a `Codec`
or a `CommConfig`) plus keyword overrides of these fields (`comm_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from taco_jax import codecs, policy, tahquant
from taco_jax.codecs import Codec
from taco_jax.target import IMPLS

MAX_SLICES = 16
# How an all-reduce moves its codes (docs/method.md, "Collectives"). "one_shot": every rank
# encodes its whole message once, all-gathers the codes and sums all N decoded copies (one
# collective, one quantization; each rank sends (N - 1) x the wire). "two_shot": reduce-scatter
# of codes, re-encode of the sum, all-gather (two quantizations; each rank sends 2 (N - 1) / N x
# the wire). "auto": `taco_jax.policy` chooses.
# "fused": one-shot, with the exchange done by the encode kernel itself, which stores the codes
# straight into every peer's memory (`pallas_kernels.exchange_mosaic`; Hopper GPUs on NVLink
# under shard_map, codec `taco`, bf16); the same arithmetic as "one_shot", which runs wherever
# the fused kernel cannot (`policy.choose`). Its encode is the Mosaic GPU kernel, one-shot's
# the Triton one where JAX has Pallas' Triton lowering: their codes may differ at rounding ties
# (the same bytes where both run Mosaic GPU).
ALGORITHMS = ("auto", "one_shot", "two_shot", "fused")


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """How one direction of a collective communicates. Static and hashable.

    The defaults of every collective option live here; the public ops and `taco_jax.TPComm`
    take a codec (name, `Codec` or `CommConfig`) plus keyword overrides of these fields.

    codec: the codec, a `Codec` or a `TahQuant` (`collective_codec`;
      `codec.is_identity` means the plain lax collective).
    impl: "auto" | "xla" | "pallas" | "pallas_interpret"; which codec kernels run.
    algorithm: "auto" | "one_shot" | "two_shot" | "fused"; how an all-reduce moves its codes
      (`ALGORITHMS`; "auto": `taco_jax.policy`). Reduce-scatter and all-gather have one each,
      whose exchange runs in the fused kernel where it can under "auto" and "fused", and
      through NCCL under the other two.
    slices: split the message into this many independent pieces (1..16) so that the encode of
      piece i+1 can overlap the transfer of piece i; where the kernels run, at least as many as
      keep each kernel buffer under 2^31 bytes (their offsets are 32-bit). Slices do not change
      a result.
    min_compress_bytes: messages smaller than this use the plain lax collective (0: compress
      every message); None: `taco_jax.policy` decides from measurements on GPU links (and
      compresses every message where no bytes move: the CPU, `vmap` emulation).
    link: "auto" | "nvlink" | "shm" | "socket"; the link the policy assumes ("auto": from the
      machine, the TP group's hosts and NVML, `taco_jax.policy.explain_link`).
    telemetry: measure: also run the exact collective in fp32 and report each call site's error
      to `taco_jax.telemetry` (a program built without it is unchanged).
    site_codecs: codecs of named call sites that differ from `codec` (`taco_jax.telemetry`'s
      site names, e.g. {"layer_03/mlp_out/fwd": "none"}, as an error budget's fallbacks set
      them); given as a mapping, kept as sorted (site, codec) pairs.
    """

    codec: Codec | tahquant.TahQuant = dataclasses.field(default_factory=codecs.get_codec)
    _: dataclasses.KW_ONLY  # options by name only: adding one never shifts another
    impl: str = "auto"
    algorithm: str = "auto"
    slices: int = 1
    min_compress_bytes: int | None = None
    link: str = "auto"
    telemetry: bool = False
    site_codecs: tuple[tuple[str, Codec | tahquant.TahQuant], ...] = ()

    def __post_init__(self):
        if isinstance(self.site_codecs, Mapping):  # frozen: set once, here
            pairs = tuple(
                sorted((site, collective_codec(codec)) for site, codec in self.site_codecs.items())
            )
            object.__setattr__(self, "site_codecs", pairs)
        if self.impl not in IMPLS:
            raise ValueError(f"unknown impl={self.impl!r}; choose one of {IMPLS}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm={self.algorithm!r}; choose one of {ALGORITHMS}")
        if not 1 <= self.slices <= MAX_SLICES:
            raise ValueError(f"slices={self.slices} must be in [1, {MAX_SLICES}]")
        if self.min_compress_bytes is not None and self.min_compress_bytes < 0:
            raise ValueError(f"min_compress_bytes={self.min_compress_bytes} must be >= 0 or None")
        if self.link not in policy.LINKS:
            raise ValueError(f"unknown link={self.link!r}; choose one of {policy.LINKS}")


CodecLike = str | Codec | tahquant.TahQuant | CommConfig
# Keyword overrides the collectives accept: the CommConfig fields, and the codec's group size.
OPTION_NAMES = ("group_size",) + tuple(
    f.name for f in dataclasses.fields(CommConfig) if f.name != "codec"
)


def comm_config(codec: CodecLike = codecs.DEFAULT_CODEC, **overrides) -> CommConfig:
    """A `CommConfig` from a codec name, a `Codec` or a `CommConfig`, with keyword overrides of
    its fields (`impl`, `algorithm`, `slices`, `min_compress_bytes`, `link`, `telemetry`,
    `site_codecs`) and of `group_size`.

    comm_config("taco", slices=4) == CommConfig(get_codec("taco"), slices=4).
    """
    unknown = sorted(set(overrides) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown collective option(s) {unknown}; valid: {list(OPTION_NAMES)}")
    group_size = overrides.pop("group_size", None)
    if isinstance(codec, CommConfig):
        cfg = dataclasses.replace(codec, codec=collective_codec(codec.codec, group_size))
    else:
        cfg = CommConfig(collective_codec(codec, group_size))
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


# TAH-Quant codecs the collectives take (the TACO paper's "TAH-Quant on TP" baseline): the
# stochastic ones draw their noise from `tahquant.message_key` (the collectives take no key).
TAHQUANT_CODEC_NAMES = tahquant.STAGE_CODEC_NAMES + tahquant.NEAREST_CODEC_NAMES


def collective_codec(
    codec: str | Codec | tahquant.TahQuant, group_size: int | None = None
) -> Codec | tahquant.TahQuant:
    """The codec a collective runs: a TP codec (`codecs.get_codec`: a name of `CODEC_NAMES` or
    a `Codec`, group_size overriding its G), or a TAH-Quant codec (a name of
    `TAHQUANT_CODEC_NAMES` or a `TahQuant`; its G is part of it, so group_size may only repeat
    it). A stochastic TAH-Quant codec draws its noise from each encoded message's own bits
    (`tahquant.message_key`)."""
    if isinstance(codec, str) and codec not in codecs.CODEC_NAMES + TAHQUANT_CODEC_NAMES:
        raise ValueError(
            f"unknown codec {codec!r}; choose one of {codecs.CODEC_NAMES + TAHQUANT_CODEC_NAMES}"
        )
    if not isinstance(codec, tahquant.TahQuant) and codec not in TAHQUANT_CODEC_NAMES:
        return codecs.get_codec(codec, group_size)
    stage = tahquant.get_stage_codec(codec)
    if group_size not in (None, stage.group_size):
        raise ValueError(
            f"{group_size=} differs from codec {stage.name!r}'s own group_size={stage.group_size}"
        )
    return stage


def fwd_bwd_configs(
    codec: CodecLike, bwd_codec: CodecLike | None, **overrides
) -> tuple[CommConfig, CommConfig]:
    """The forward and backward `CommConfig`s; the backward defaults to the forward one."""
    cfg = comm_config(codec, **overrides)
    return cfg, cfg if bwd_codec is None else comm_config(bwd_codec, **overrides)
