#!/usr/bin/env bash
# The speed issue's GPU runs (one GPU; written for an H100 with torch 2.11, TransformerEngine 2.20.2
# and megatron-core 0.19.2 installed by ../shared/gpu/stage). Everything goes to $RES (default
# /tmp/speed-results) and is packed into $OUT/speed.tgz (the device returns few files).
#
#   bash scripts/gpu_speed.sh tests host      # the parts named, in order; each part stays under 10 minutes
#
# Parts:
#   tests    every gpu-marked test (pytest -m gpu), log in pytest-gpu.log (~3 min)
#   quick    the same less the one that trains coat-compare six times under graphs (~1.5 min)
#   host     benchmarks/host_overhead.py: host time per op and per layer, cProfile (~1 min)
#   profile  benchmarks/step_profile.py, gpt-1b: bf16, te-fp8-current, coat, each eager and with PROFILE_GRAPHS
#            (default local) graphs (~4 min)
#   train1   coat-compare gpt-1b, micro-batch 4, STEPS steps (default 20): bf16 and coat, each eager / local / full (~5 min)
#   train2   the same for te-fp8-current and te-fp8-delayed (~5 min)
#   layer    coat-compare llama2-7b-layer: bf16, te-fp8-current, te-fp8-store, coat (~2 min)
#   kernels  benchmarks/layer_profile.py: GPU time per kernel class of that layer, coat vs TE FP8 current vs BF16 (~1 min)
#   pretrain scripts/gpu_pretrain.sh (1B through megatron.training, BF16 vs --coat-fp8) with GRAPHS_PRETRAIN
#            (default local) Megatron CUDA graphs, ITERS (default 30) iterations (~4 min)
#   speed7b  coat-compare llama2-7b on one H200 at each micro-batch in MB7 (default "1 2"): bf16,
#            te-fp8-current, coat, each eager and with Megatron's per-layer graphs (MODES7, GRAPHS7
#            override), 8 steps on the docstrings corpus (speed only: the corpus builds in seconds);
#            each micro-batch in its own folder, llama2-7b-mb<N>/ (~5 min each)
#   summary  coat-compare --summarize over every report written so far
set -uo pipefail
dest=${OUT:-out}
out=${RES:-/tmp/speed-results}
steps=${STEPS:-20}
graphs=${GRAPHS:-none,local,full}
source "$(dirname "$0")/gpu_lib.sh"
gpu_setup

compare() {  # compare CAP NAME coat-compare-args...
  local cap=$1 name=$2
  shift 2
  run "$cap" "$name" python3 -m coat_compare --out "$out" --name "$name" "$@"
  grep -E "^\| (bf16|te-fp8|coat)" "$out/$name.md" 2>/dev/null | cut -c1-160
}

for part in ${*:-tests host}; do
  case $part in
    tests)
      run 420 pytest-gpu python3 -m pytest -m gpu -q -p no:cacheprovider
      tail -4 "$out/pytest-gpu.log" ;;
    quick)
      run 300 pytest-gpu python3 -m pytest -m gpu -q -p no:cacheprovider -k "not trains_alike_with_megatrons_cuda_graphs"
      tail -4 "$out/pytest-gpu.log"
      run 120 lean-path python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/megatron/test_lean_path.py
      grep -E "launches|passed|failed" "$out/lean-path.log" | cut -c1-300 ;;
    speed7b)
      for mb in ${MB7:-1 2}; do
        RES_MB="$out/llama2-7b-mb$mb"
        mkdir -p "$RES_MB"
        # expandable segments: memory runs near the GPU's limit at 7B, fewer fragments (every mode alike)
        run "${CAP7:-480}" "llama2-7b-mb$mb" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m coat_compare \
          --out "$RES_MB" --name "llama2-7b-mb$mb" --preset llama2-7b --micro-batch "$mb" --steps "${STEPS7:-8}" \
          --modes "${MODES7:-bf16,te-fp8-current,coat}" --cuda-graphs "${GRAPHS7:-none,local}" --corpus "${CORPUS7:-docstrings}" --no-plots
        grep -E "^\| (bf16|te-fp8|coat)" "$RES_MB/llama2-7b-mb$mb.md" 2>/dev/null | cut -c1-200
      done ;;
    host)
      run 240 host python3 benchmarks/host_overhead.py --out "$out"
      grep -E "^\| (coat|bf16|te-fp8)" "$out/host_overhead.md" ;;
    profile)
      run 560 step-profile python3 benchmarks/step_profile.py --preset gpt-1b --modes bf16,te-fp8-current,coat --steps 3 \
        --cuda-graphs "${PROFILE_GRAPHS:-none,local}" --out "$out"
      grep -E "^\| (bf16|te-fp8|coat)" "$out/step_profile.md" ;;
    train1)
      compare 570 gpt-1b-bf16-coat --preset gpt-1b --micro-batch 4 --steps "$steps" --modes bf16,coat --cuda-graphs "$graphs" --no-plots ;;
    train2)
      compare 570 gpt-1b-te --preset gpt-1b --micro-batch 4 --steps "$steps" --modes te-fp8-current,te-fp8-delayed --cuda-graphs "$graphs" --no-plots ;;
    layer)
      compare 300 llama2-7b-layer --preset llama2-7b-layer --modes bf16,te-fp8-current,te-fp8-store,coat --no-plots ;;
    kernels)
      run 300 layer-profile python3 benchmarks/layer_profile.py --preset llama2-7b-layer --modes coat,te-fp8-current,bf16 --out "$out"
      sed -n '/^| class/,/total/p' "$out/layer_profile.md" ;;
    pretrain)
      g=${GRAPHS_PRETRAIN:-local}
      run 570 "pretrain-$g" env OUT="$out/pretrain-$g" GRAPHS="$g" ITERS="${ITERS:-30}" PYTHON=python3 bash scripts/gpu_pretrain.sh
      cat "$out/pretrain-$g/comparison.md" 2>/dev/null ;;
    summary)
      python3 -m coat_compare --summarize --out "$out" >/dev/null 2>&1
      grep -E "^\| tokens/s at equal|^\| per-layer fwd" "$out/summary.md" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
tar czf "$dest/speed.tgz" -C "$out" .
echo "total $SECONDS s"
