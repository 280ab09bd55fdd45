#!/usr/bin/env bash
# Several parts of a GPU script at once on a machine with several GPUs (kinds nvidia-h100-x2, -x4,
# nvidia-h200-x2, -x4), one argument per GPU:
#
#   bash scripts/gpu_parts.sh "acc1b coat" "acc1b bf16"                  # scripts/gpu_default.sh's parts
#   bash scripts/gpu_parts.sh "GPU_TESTS=1 acc1b coat" "spike7b"         # NAME=VALUE first: that part's environment
#   bash scripts/gpu_parts.sh "batches + spike13b" "acc1b coat 3" ...    # " + ": parts one after another on one GPU
#   SCRIPT=scripts/gpu_accuracy.sh bash scripts/gpu_parts.sh "..." "..." # another script's
#
# Argument i runs with CUDA_VISIBLE_DEVICES=i and writes to $OUT/gpu<i>/ (left as one <part>.tgz per
# part, with its printout in $OUT/gpu<i>.txt). An argument still running after $LIMIT seconds
# (default 540) is stopped, so that the packing below runs inside the device's 10-minute command
# limit and what its parts wrote still comes back. Each process has its own GPU, but they share the
# host: use it for accuracy runs and memory figures, and compare timings only between rows of one
# part (its rows ran one after another on one GPU), never across parts. The parts do not talk to each
# other (no NCCL between them).
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: gpu_parts.sh \"PART [ARGS]\" \"PART [ARGS]\" ... (one per GPU, two or more)" >&2; exit 2; }
script=${SCRIPT:-$(dirname "$0")/gpu_default.sh}
base=${OUT:-out}
n=$(nvidia-smi -L | wc -l)
[ "$n" -ge $# ] || { echo "gpu_parts.sh got $# parts but this machine has $n GPUs: give at most $n, or run them one by one" >&2; exit 2; }
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
export COAT_GPU_INSTALLED=1  # installed once here: concurrent installs of one project can race
mkdir -p "$base"
specs=("$@")
run_one() {  # GPU SPEC: the spec's " + "-separated parts one after another on that GPU
  local gpu=$1 spec=$2 one words envs
  while [ -n "$spec" ]; do
    one=${spec%% + *}
    if [ "$one" = "$spec" ]; then spec=""; else spec=${spec#* + }; fi
    read -ra words <<<"$one"
    envs=()  # leading NAME=VALUE words set that part's environment only
    while [ ${#words[@]} -gt 0 ] && [[ ${words[0]} == *=* ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
    env CUDA_VISIBLE_DEVICES="$gpu" OUT="$base/gpu$gpu" "${envs[@]}" bash "$script" "${words[@]}"
  done
}
i=0
for spec in "${specs[@]}"; do
  (
    export -f run_one
    export base script
    timeout -k 5 "${LIMIT:-540}" bash -c 'run_one "$0" "$1"' "$i" "$spec"
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
for ((i = 0; i < ${#specs[@]}; i++)); do echo "=== GPU $i: ${specs[$i]}"; cat "$base/gpu$i.txt"; done
