#!/usr/bin/env bash
# One device call on a 2 x H200 machine: real-NCCL collectives and TP=2 training step on both
# GPUs, then the TP=4 convergence study on GPU 0 beside the one-GPU benchmarks on GPU 1.
# Needs the prepared data cache carried in .cache/taco_jax (the machine has no network).
# Usage (device tool): bash benchmarks/gpu_x2_session.sh   (writes into $OUT)
set -u
export TACO_JAX_CACHE=$PWD/.cache/taco_jax PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
nvidia-smi -L
python3 -c 'import jax; print(jax.__version__, jax.devices())'

# Phase A: both GPUs.
timeout 150 python3 benchmarks/collectives.py --sizes-mib 0.0625 1 16 64 256 1024 \
  --codecs taco int8_hadamard --slices 1 4 --inner 5 --reps 10 --out "$OUT" \
  > /tmp/collectives.log 2>&1
timeout 110 python3 benchmarks/train_step.py --only shard_map --out "$OUT/tp2" \
  > /tmp/train_step_tp2.log 2>&1

# Phase B: one study per GPU.
(CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/convergence.py --tp 4 \
  --codecs none taco fp8 taco_no_ds int8 int8_hadamard taco_e8m0 --baseline-seeds 0 1 \
  --set run.steps=600 --set run.eval_every=50 --set compression.impl=xla \
  --set run.checkpoint_every=600 --out "$OUT" --runs-dir /tmp/runs > /tmp/conv_tp4.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 200 python3 benchmarks/train_step.py --out "$OUT"
 CUDA_VISIBLE_DEVICES=1 timeout 90 python3 benchmarks/pipeline.py --sizes-mib 1 16 64 256 \
  --tp 2 4 8 --reps 10 --out "$OUT") > /tmp/gpu1.log 2>&1 &
wait
# At most 8 files come back: the results plus one log.
tail -n +1 /tmp/collectives.log /tmp/train_step_tp2.log /tmp/conv_tp4.log /tmp/gpu1.log \
  > "$OUT/session.log"
tail -n 20 /tmp/collectives.log /tmp/train_step_tp2.log /tmp/conv_tp4.log /tmp/gpu1.log
