#!/usr/bin/env bash
# The GPU tier (`pytest -m gpu`) on this machine's GPUs, in WORKERS processes (default 8) that
# share them: compiling the kernels is most of the tier's time, and the workers compile on the
# CPU's cores at once. Then one summary: pytest's counts, and how often the kernels printed
# Pallas' Triton deprecation warning, by test file.
#   bash scripts/gpu_tests.sh                     # the whole tier
#   bash scripts/gpu_tests.sh tests/pallas_kernels -k mosaic   # arguments go to pytest
# LOG names the full log (default gpu-tests.log).
set -uo pipefail
cd "$(dirname "$0")/.."
workers=${WORKERS:-8}
log=${LOG:-gpu-tests.log}
python=${PYTHON:-python3}

# Each worker takes GPU memory as it needs it, not 75% of the card up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
"$python" -m pytest -m gpu -q -n "$workers" --dist loadfile -rfEs \
  -W "always::DeprecationWarning:jax._src.pallas.triton.pallas_call_registration" \
  "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}

echo "== Pallas' Triton deprecation warnings, by test file (pytest's warnings summary)"
# The summary lists a warning's tests ("tests/f.py::test_a") or, under xdist, its files with a
# count ("tests/f.py: 150 warnings"), then the warning: the count of each file is summed.
awk '/warnings summary/ {on = 1; next} /^-- Docs|short test summary/ {on = 0}
     on && /^tests\// {
       f = $1; sub(/:$/, "", f); split(f, p, "::")
       file[++np] = p[1]; count[np] = ($2 ~ /^[0-9]+$/) ? $2 : 1; next
     }
     on && /Warning:/ {
       if ($0 ~ /Pallas Triton backend is deprecated/)
         for (i = 1; i <= np; i++) {n[file[i]] += count[i]; total += count[i]}
       np = 0
     }
     END {for (f in n) printf "  %-64s %d\n", f, n[f]; printf "  total: %d\n", total}' "$log"
exit "$status"
