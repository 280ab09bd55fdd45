#!/usr/bin/env bash
# Outlier stress on one GPU (benchmarks/outlier_stress.py): gpt-125m for STEPS (default 400) steps
# in BF16, TE FP8 current scaling and COAT, same weights and batches, while a few FFN channels'
# gate and up weights in the middle layer grow x GROWTH (default 1.03) per optimizer step, past
# E4M3's and E5M2's ranges. Each mode is its own process, capped at 180 s (one command stays under
# 10 minutes). Everything goes to $RES (default /tmp/stress-results), packed into $OUT/stress.tgz.
#
#   bash scripts/gpu_stress.sh                    # TARGET=swiglu (gate and up rows of the same channels)
#   TARGET=residual bash scripts/gpu_stress.sh    # linear_fc2's rows: residual-stream channels
#   TARGET=gate GROWTH=1.05 STEPS=300 MODES=bf16,coat bash scripts/gpu_stress.sh
set -uo pipefail
dest=${OUT:-out}
out=${RES:-/tmp/stress-results}
target=${TARGET:-swiglu}
source "$(dirname "$0")/gpu_lib.sh"
gpu_setup

run 570 "outlier-stress-$target" python3 benchmarks/outlier_stress.py --preset gpt-125m --steps "${STEPS:-400}" \
  --growth "${GROWTH:-1.03}" --target "$target" --modes "${MODES:-bf16,te-fp8-current,coat}" --mode-timeout 180 \
  --out "$out/$target"
sed -n '/^| mode/,/^$/p' "$out/$target/outlier_stress.md" 2>/dev/null
tar czf "$dest/stress.tgz" -C "$out" .
echo "total $SECONDS s"
