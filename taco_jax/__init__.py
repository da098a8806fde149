"""taco-jax: FP8 compression of tensor-parallel communication (TACO) for JAX.

Public API:
  compressed_psum, compressed_psum_scatter, compressed_all_gather  (collectives.py)
  compressed_ppermute: pipeline stage-to-stage sends                 (ppermute.py)
  CommConfig, comm_config: the collective options and their defaults (comm_config.py)
  TPComm, copy_to_tp, reduce_from_tp, gather_from_sp, scatter_to_sp (tp.py: Megatron f / g)
  gspmd: column_parallel_dense, row_parallel_dense for GSPMD (pjit-style) models
  Codec, Payload, get_codec, CODEC_NAMES, roundtrip                 (codecs.py)
  tahquant: TAH-Quant, the stage codecs (get_stage_codec, STAGE_CODEC_NAMES)
  sdp4bit: SDP4Bit's data-parallel compressors (tlq_hs_psum_scatter, qwd_all_gather)
  policy: what the "auto" options choose (whether and how to compress), from measurements
  telemetry: each compressed collective's error by call site (layer_07/mlp_out/fwd)
  timing: ratios of timings with intervals and an A/A control (the benchmarks' harness)
  tune: the collectives timed on this machine for "auto" (`python -m taco_jax.tune`; imported
    on its own, `from taco_jax import tune`)
  reference_ops: the codec ops that ran the jnp reference where fused kernels were asked for

The library needs JAX and NumPy only; the fused GPU kernels (`pallas_kernels`) are imported on
first use, and nothing here imports the models or the training application.
"""

from taco_jax import gspmd, policy, sdp4bit, tahquant, telemetry
from taco_jax._backends import reference_ops
from taco_jax.codecs import CODEC_NAMES, Codec, Payload, get_codec, roundtrip
from taco_jax.collectives import (
    CommConfig,
    comm_config,
    compressed_all_gather,
    compressed_psum,
    compressed_psum_scatter,
    wire_bytes_per_rank,
)
from taco_jax.ppermute import compressed_ppermute
from taco_jax.tp import (
    TPComm,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    scatter_to_sp,
)

__all__ = [
    "CODEC_NAMES",
    "Codec",
    "CommConfig",
    "Payload",
    "TPComm",
    "comm_config",
    "compressed_all_gather",
    "compressed_ppermute",
    "compressed_psum",
    "compressed_psum_scatter",
    "copy_to_tp",
    "gather_from_sp",
    "get_codec",
    "gspmd",
    "policy",
    "reduce_from_tp",
    "reference_ops",
    "roundtrip",
    "scatter_to_sp",
    "sdp4bit",
    "tahquant",
    "telemetry",
    "wire_bytes_per_rank",
]
