#!/usr/bin/env bash
# Two parts of a GPU script at once on a two-GPU machine (kind nvidia-h100-x2), one part per GPU:
#
#   bash scripts/gpu_two.sh "acc1b coat" "acc1b bf16"                    # scripts/gpu_default.sh's parts
#   bash scripts/gpu_two.sh "GPU_TESTS=1 acc1b coat" "spike7b"           # NAME=VALUE first: that part's environment
#   SCRIPT=scripts/gpu_accuracy.sh bash scripts/gpu_two.sh "..." "..."  # another script's
#
# Part i runs with CUDA_VISIBLE_DEVICES=i and writes to $OUT/gpu<i>/ (left as one <part>.tgz per
# part, with its printout in $OUT/gpu<i>.txt). A part still running after $LIMIT seconds (default
# 540) is stopped, so that the packing below runs inside the device's 10-minute command limit and
# what the part wrote still comes back. Each process has its own GPU,
# but the two share the host: use it for accuracy runs and memory figures, and compare timings only
# between rows of one part (its rows ran one after another on one GPU), never across the two parts.
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: gpu_two.sh \"PART [ARGS]\" \"PART [ARGS]\"" >&2; exit 2; }
script=${SCRIPT:-$(dirname "$0")/gpu_default.sh}
base=${OUT:-out}
n=$(nvidia-smi -L | wc -l)
[ "$n" -ge 2 ] || { echo "gpu_two.sh needs two GPUs, this machine has $n: run the parts one by one" >&2; exit 2; }
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
export COAT_GPU_INSTALLED=1  # installed once here: two concurrent installs of one project can race
mkdir -p "$base"
specs=("$@")
i=0
for spec in "${specs[@]}"; do
  read -ra words <<<"$spec"
  envs=()  # leading NAME=VALUE words set that part's environment only
  while [ ${#words[@]} -gt 0 ] && [[ ${words[0]} == *=* ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
  (
    timeout -k 5 "${LIMIT:-540}" env CUDA_VISIBLE_DEVICES=$i OUT="$base/gpu$i" "${envs[@]}" bash "$script" "${words[@]}"
    rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "stopped after ${LIMIT:-540} s (LIMIT): what it wrote is packed"; fi
  ) >"$base/gpu$i.txt" 2>&1 &
  i=$((i + 1))
done
wait
# What comes back from the device machine is counted in files: leave each part's results as one
# archive (the part packs its folder as <part>.tgz; one that died before is packed here), so that
# the loose files of one part cannot crowd out another's.
shopt -s nullglob
for dir in "$base"/gpu*/*/; do
  dir=${dir%/}
  [ -f "$dir.tgz" ] || tar czf "$dir.tgz" -C "$dir" .
  rm -rf "$dir"
done
for i in 0 1; do echo "=== GPU $i: ${specs[$i]}"; cat "$base/gpu$i.txt"; done
