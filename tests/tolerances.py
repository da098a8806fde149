"""Tolerances shared by the model and training tests (derivations beside each)."""

from __future__ import annotations

import math

from taco_models import ModelConfig

BATCH = 4  # rows of the test batches
U_FP32 = 2.0**-24  # fp32 unit roundoff


def exact_tolerance(cfg: ModelConfig, batch: int = BATCH) -> float:
    """Normwise tolerance for TP-vs-unsharded in fp32 with uncompressed collectives.

    The TP model computes the same function with its reductions reassociated: contractions over
    F, N x H and V are split into tp partial sums, SP sums replicated-parameter gradients over
    B x T in tp pieces, and XLA blocks differently shaped dots differently. Modelling rounding
    errors as independent and zero-mean (Higham & Mary 2019), a length-n reduction carries a
    relative error ~ u sqrt(n); two orders differ by sqrt(2) of that; K reductions in sequence
    (forward and backward, gain ~ 1 at init) add in quadrature: u sqrt(2 n K). The largest
    reduction is n = max(F, V, B T); K ~ 2 x (7 per block + head + loss). A factor of 8 covers
    the maximum over ~1e5 elements (~4.5 sigma) measured against max|reference|.
    """
    n = max(cfg.d_ff, cfg.padded_vocab, batch * cfg.seq_len)
    k = 2 * (7 * cfg.n_layers + 2)
    return 8 * U_FP32 * math.sqrt(2 * n * k)
