#!/usr/bin/env bash
# The GPU measurements of this repository, on the device machine after the staged
# megatron-core/TE install:  bash scripts/gpu_evidence.sh [tests] [quantize] [ops] [layer] [optimizer]
# (all of them when none is named); results under $OUT.
set -uo pipefail
out=${OUT:-benchmarks/results/latest}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests quantize ops layer optimizer)
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for step in "${steps[@]}"; do
  if [ "$step" = tests ]; then
    python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/pytest-gpu.log" | tail -2
    grep -E "^(FAILED|E  )" "$out/pytest-gpu.log" | head -10
    continue
  fi
  extra=()
  [ "$step" = optimizer ] && extra=(--sweep)
  echo "== benchmarks/$step.py ${extra[*]}"
  python3 "benchmarks/$step.py" "${extra[@]}" --out "$out" 2>&1 | grep -v -i warn | tail -40
done
