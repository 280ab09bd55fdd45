#!/usr/bin/env bash
# The default recipe's GPU evidence on one GPU (COAT's memory mode: split masters, W^T per
# backward, BF16 gradient buffers), in parts that each fit one 10-minute device command:
#
#   bash scripts/gpu_default.sh quick     # GPU tests of the compare harness and the COAT layers and
#                                         # optimizer (~2 min); gpt-1b micro-batch 4: bf16, coat,
#                                         # coat-cached, eager and with per-layer graphs (~4 min)
#   bash scripts/gpu_default.sh llama7b   # Llama-2-7B, micro-batch 2, global batch 16 (8 micro-batches
#                                         # per step): coat, and bf16, te-fp8-current, te-fp8-pa (one
#                                         # 80 GB H100: only coat is expected to fit) (~6 min)
#   bash scripts/gpu_default.sh accuracy  # gpt-125m, 4 seeds, global batch 16 = 4 micro-batches of 4:
#                                         # bf16, coat, te-fp8-delayed (benchmarks/accuracy.py; call
#                                         # again until it prints "all runs done")
#
# Results go to $OUT/<part>/ (logs, reports) and $OUT/<part>.tgz.
set -uo pipefail
part=${1:?usage: gpu_default.sh quick|llama7b|accuracy}
out=${OUT:-out}/$part
dest=${OUT:-out}
source "$(dirname "$0")/gpu_lib.sh"
gpu_setup

case $part in
  quick)
    run 240 pytest-gpu python3 -m pytest -q -m gpu -x tests/megatron/test_lean_path.py tests/megatron/test_cuda_graphs.py \
      tests/megatron/test_coat_optimizer.py tests/compare
    tail -3 "$out/pytest-gpu.log"
    run 330 gpt-1b coat-compare --preset gpt-1b --micro-batch 4 --steps 10 --modes bf16,coat,coat-cached \
      --cuda-graphs none,local --out "$out" --name gpt-1b --no-plots
    grep -E "^\| (bf16|coat)|^\| (end-to-end|default)" "$out/gpt-1b.md" | cut -c1-240 ;;
  llama7b)
    run 560 llama2-7b coat-compare --preset llama2-7b --micro-batch 2 --global-batch 16 --steps 5 \
      --modes coat,bf16,te-fp8-current,te-fp8-pa --out "$out" --name llama2-7b-gb16 --no-plots
    grep -E "^\| (bf16|te-fp8|coat)|^\| (llama|end-to-end)" "$out/llama2-7b-gb16.md" | cut -c1-260 ;;
  accuracy)
    OUT=$out RES=${RES:-/tmp/coat-default-accuracy} PRESET=gpt-125m STEPS=${STEPS:-1200} SEEDS=${SEEDS:-1,2,3,4} \
      MODES=${MODES:-bf16,coat,te-fp8-delayed} JOBS=${JOBS:-6} TIME_LIMIT=${TIME_LIMIT:-500} \
      EXTRA="--micro-batch 4 --global-batch 16" bash "$(dirname "$0")/gpu_accuracy.sh" ;;
  *) echo "unknown part $part: quick, llama7b or accuracy" >&2; exit 2 ;;
esac
tar czf "/tmp/$part.tgz" -C "$out" . && mv "/tmp/$part.tgz" "$dest/$part.tgz"
