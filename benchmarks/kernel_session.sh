#!/usr/bin/env bash
# One device call on one H200: [the GPU kernel tests], a launch-configuration sweep, and an
# Nsight Compute look at encode (occupancy, registers, stall reasons, DRAM throughput).
# Usage (device tool): SWEEP=2 TESTS=0 bash benchmarks/kernel_session.sh   (writes into $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
SWEEP=${SWEEP:-2}
nvidia-smi -L
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels -m gpu 2>&1 \
    | tail -n 30 | tee "$OUT/tests.log"
fi
timeout 360 python3 benchmarks/kernel_sweep.py --sweep "$SWEEP" --out "$OUT" 2>&1 \
  | tee "$OUT/sweep.log" | grep -v "^SWEEP\|^DIAG\|^CEILINGS\|^CONFIRM"
cat > /tmp/profile_target.py <<'PY'
import jax, jax.numpy as jnp
import pallas_kernels as pk
from taco_jax import codecs
codec = codecs.get_codec("taco", 128)
x = jax.random.normal(jax.random.key(0), (8, 1 << 24), jnp.bfloat16)
for cfg in (pk.BlockConfig(64, num_warps=4),
            pk.BlockConfig(64, num_warps=4, tiles_per_program=4, num_stages=1, prefetch=True)):
    jax.block_until_ready(pk.encode(codec, x, config=cfg))
PY
timeout 150 ncu --clock-control none -k "regex:taco_encode" -c 2 --section SpeedOfLight \
  --section WarpStateStats --section Occupancy --section LaunchStats \
  python3 /tmp/profile_target.py > "$OUT/ncu.log" 2>&1
grep -E "taco_|Duration|DRAM Through|Registers|Achieved Occ|Theoretical Occ|Stall|stall|cycles being" \
  "$OUT/ncu.log" | head -n 60
