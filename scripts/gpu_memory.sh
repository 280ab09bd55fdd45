#!/usr/bin/env bash
# The memory mode's GPU runs (one GPU with torch 2.11, TransformerEngine 2.20.2 and
# megatron-core 0.19.2 installed by ../shared/gpu/stage). Everything goes to $RES (default
# /tmp/memory-results) and is packed into $OUT/memory.tgz.
#
#   bash scripts/gpu_memory.sh tests gpt1b llama7b      # the parts named, in order
#
# Parts:
#   tests     the gpu-marked tests of the split master weights, the fused step, the wgrad into a BF16
#             main_grad, the distributed optimizer on one GPU, and Megatron's CUDA graphs (~3 min)
#   graphs    coat-compare tiny, bf16 and coat, eager and with Megatron's local and whole-step CUDA graphs
#             (what tests/megatron/test_cuda_graphs.py checks; a run that dies leaves its log beside the report)
#   gpt1b     coat-compare gpt-1b, micro-batch 4, STEPS steps (default 20), GRAPHS (default none,local:
#             eager for the memory goals, local graphs for speed): bf16, te-fp8-pa, coat, coat-lean,
#             coat-mem, each in a fresh process (~6 min)
#   llama7b   coat-compare llama2-7b, micro-batch MB7 (default 2), 10 steps, eager: bf16, te-fp8-current,
#             coat, coat-mem (one 80 GB H100: only coat-mem is expected to fit) (~6 min)
#   llama13b  coat-compare llama2-13b, micro-batch 1, 8 steps, eager: coat-mem, and bf16 and coat for
#             the record (one H200) (~5 min)
#   speed7b   coat-compare llama2-7b at micro-batch 1 and 2 with bf16, te-fp8-current, coat (one H200:
#             the speed issue's Llama-2-7B goal) (~8 min)
#   summary   coat-compare --summarize over every report written so far
set -uo pipefail
dest=${OUT:-out}
out=${RES:-/tmp/memory-results}
steps=${STEPS:-20}
graphs=${GRAPHS:-none,local}
source "$(dirname "$0")/gpu_lib.sh"
gpu_setup
big=(env "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}")  # the 7B/13B runs: less fragmentation near the limit

compare() {  # compare CAP NAME coat-compare-args...  (PRE: a command prefix, e.g. the allocator setting)
  local cap=$1 name=$2
  shift 2
  run "$cap" "$name" ${PRE:-} python3 -m coat_compare --out "$out" --name "$name" "$@"
  grep -E "^\| (bf16|te-fp8|coat)|^\| (llama|end-to-end|coat-mem)" "$out/$name.md" 2>/dev/null | cut -c1-220
}

for part in ${*:-tests gpt1b}; do
  case $part in
    tests)
      run 400 pytest-gpu-memory python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_master.py tests/kernels/test_fp8_adamw.py \
        tests/fp8/test_ops.py tests/megatron/test_coat_optimizer.py tests/megatron/test_cuda_graphs.py
      tail -4 "$out/pytest-gpu-memory.log" ;;
    graphs)
      compare 400 tiny-graphs --preset tiny --modes bf16,coat --steps 12 --cuda-graphs none,local,full --no-plots
      for f in "$out"/tiny-graphs-*-failed.log; do [ -f "$f" ] && { echo "== $f"; grep -v "^frame #" "$f" | tail -40; }; done ;;
    gpt1b)
      compare 570 gpt-1b-memory --preset gpt-1b --micro-batch 4 --steps "$steps" --modes bf16,te-fp8-pa,coat,coat-lean,coat-mem \
        --cuda-graphs "$graphs" --no-plots ;;
    llama7b)
      PRE="${big[*]}" compare 590 "llama2-7b-mb${MB7:-2}" --preset llama2-7b --micro-batch "${MB7:-2}" --steps 10 --modes bf16,te-fp8-current,coat,coat-mem --no-plots ;;
    llama13b)
      PRE="${big[*]}" compare 590 llama2-13b --preset llama2-13b --micro-batch 1 --steps 8 --modes coat-mem,coat,bf16 --no-plots ;;
    speed7b)
      for mb in 1 2; do
        PRE="${big[*]}" compare 290 "llama2-7b-speed-mb$mb" --preset llama2-7b --micro-batch "$mb" --steps 10 --modes bf16,te-fp8-current,coat --no-plots
      done ;;
    summary)
      python3 -m coat_compare --summarize --out "$out" >/dev/null 2>&1
      grep -E "coat-mem|llama2" "$out/summary.md" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
tar czf "$dest/memory.tgz" -C "$out" .
echo "total $SECONDS s"
