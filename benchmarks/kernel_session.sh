#!/usr/bin/env bash
# One device call on one H200: the GPU kernel tests, the kernel benchmark (checks + timings at
# the default launches), and a launch-configuration sweep (benchmarks/kernel_sweep.py).
# Usage (device tool): SWEEP=4 bash benchmarks/kernel_session.sh   (writes into $OUT)
# Phases can be left out to fit one call: TESTS=0, CHECK=0 (kernels.py --skip-check), BENCH=0.
# BASELINE=1 adds the kernels exported by benchmarks/baseline_package.sh to the sweep (carry
# build/baseline). PROFILE=1 adds an Nsight Compute look at encode (occupancy, registers, stalls).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
nvidia-smi -L
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels -m gpu 2>&1 \
    | tail -n 15 | tee "$OUT/tests.log"
fi
if [ -n "${SWEEP:-}" ]; then
  timeout "${SWEEP_S:-300}" python3 benchmarks/kernel_sweep.py --sweep "$SWEEP" --out "$OUT" \
    ${BASELINE:+--baseline} 2>&1 | tee "$OUT/sweep.log" | grep -v "^SWEEP\|^DIAG\|^CEILINGS\|^CONFIRM"
fi
if [ "${BENCH:-1}" = 1 ]; then
  # Bandwidth from 64 MiB (smaller sizes are dispatch-bound); small sizes timed in-program.
  skip=$([ "${CHECK:-1}" = 1 ] || echo --skip-check)
  timeout "${BENCH_S:-330}" python3 benchmarks/kernels.py $skip --sizes-mib 64,256,1024 \
    --in-program-kib "${IN_PROGRAM_KIB:-64,256,1024,4096}" --out "$OUT" 2>&1 \
    | tee "$OUT/kernels.log" | grep -v "^CHECK\|^BENCH\|^IN_PROGRAM"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  cat > /tmp/profile_target.py <<'PY'
import jax, jax.numpy as jnp
import pallas_kernels as pk
from taco_jax import codecs
x = jax.random.normal(jax.random.key(0), (8, 1 << 24), jnp.bfloat16)
jax.block_until_ready(pk.encode(codecs.get_codec("taco", 128), x))
PY
  timeout 150 ncu --clock-control none -k "regex:taco_encode" -c 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 /tmp/profile_target.py > "$OUT/ncu.log" 2>&1
  grep -E "taco_|Duration|DRAM Through|Registers|Occupancy  |Warp Cycles" "$OUT/ncu.log"
fi
