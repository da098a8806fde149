#!/usr/bin/env bash
# Exports pallas_kernels/ at git revision REV as the package `pallas_kernels_base` under
# build/baseline/, so that a benchmark can time the previous kernels beside the current ones in
# the same device run (kernel_sweep.py --baseline; carry build/baseline to the device).
# Usage: bash benchmarks/baseline_package.sh [REV]   (default HEAD)
set -euo pipefail
rev=${1:-HEAD}
dest=build/baseline/pallas_kernels_base
rm -rf "$dest"
mkdir -p "$dest"
git archive "$rev" pallas_kernels | tar -x --strip-components=1 -C "$dest"
sed -i 's/\bpallas_kernels\b/pallas_kernels_base/g' "$dest"/*.py
git rev-parse "$rev" >"$dest/REVISION"
echo "$dest: pallas_kernels at $(cat "$dest/REVISION")"
