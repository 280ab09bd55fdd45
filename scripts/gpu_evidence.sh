#!/usr/bin/env bash
# Every GPU measurement of this repository in one session, on the device machine, after the
# staged megatron-core/TE install:  bash scripts/gpu_evidence.sh  (results under $OUT)
set -uo pipefail
out=${OUT:-benchmarks/results/latest}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/pytest-gpu.log" | tail -3
grep -E "^(FAILED|E  )" "$out/pytest-gpu.log" | head -10
for bench in quantize ops layer optimizer; do
  [ -f "benchmarks/$bench.py" ] || continue
  echo "== benchmarks/$bench.py"
  python3 "benchmarks/$bench.py" --out "$out" 2>&1 | grep -v -i warn | tail -30
done
