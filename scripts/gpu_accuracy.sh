#!/usr/bin/env bash
# BF16 vs COAT accuracy on one GPU: the gpt-125m preset (113M parameters, byte tokens of the
# docstring corpus) for 2000 steps, 3 seeds (benchmarks/accuracy.py). One seed per invocation keeps
# each device command under 10 minutes; the reports accumulate in $RES (default /tmp/coat-accuracy,
# kept while the machine stays warm), and each call packs them into $OUT/accuracy.tgz.
#
#   SEEDS=1 bash scripts/gpu_accuracy.sh; SEEDS=2 ...; SEEDS=3 ...; SEEDS=1,2,3 bash scripts/gpu_accuracy.sh
#   (the last call reuses the finished seeds and writes accuracy.md / accuracy.png)
#   MODES=bf16,coat,bf16@dp2 ... on nvidia-h200-x2: adds the noise floor (BF16 at DP 2, the same
#   global batch: only the reduction order differs); MODES=bf16,coat,coat-act,coat-opt: the ablations
set -euo pipefail
out=${OUT:-out}
res=${RES:-/tmp/coat-accuracy}
seeds=${SEEDS:-1,2,3}
steps=${STEPS:-2000}
modes=${MODES:-bf16,coat}
mkdir -p "$out" "$res"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 benchmarks/accuracy.py --preset gpt-125m --steps "$steps" --seeds "$seeds" --modes "$modes" --out "$res"
tar czf /tmp/accuracy.tgz -C "$res" . && mv /tmp/accuracy.tgz "$out/accuracy.tgz"
