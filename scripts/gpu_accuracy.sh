#!/usr/bin/env bash
# BF16 vs COAT validation loss on one GPU (benchmarks/accuracy.py): the gpt-125m preset (113M
# parameters, byte tokens) for 2000 steps on 100 MiB of Python sources (each training byte at most
# once; validation on held-out files every 100 steps), 3 seeds, modes bf16, coat and the noise floor
# bf16@data2 (BF16, same initial weights, another data order): 9 runs.
#
#   bash scripts/gpu_accuracy.sh      # JOBS runs at a time (default 4, each its own process), as many
#                                     # rounds as fit in TIME_LIMIT seconds (default 480); call
#                                     # again until it prints "all runs done" and the report
#   MODES=bf16,coat,bf16@data2,coat-act,coat-opt bash scripts/gpu_accuracy.sh   # adds the ablations
#   MODES=bf16,coat,bf16@data2,bf16@dp2 ... on nvidia-h200-x2: adds the reduction-order noise floor
#   PREVIOUS=path/accuracy.tgz ...    # on a fresh machine: unpack the runs of earlier calls first
#   PRESET=tiny STEPS=6 SEEDS=1,2 ... # the same loop on the tiny preset (a check of the script)
#   EXTRA="--micro-batch 4 --global-batch 16" ...   # more accuracy.py options
#
# Estimate (not yet measured): a gpt-125m step at seq 1024 x 16 takes about 50-80 ms eagerly on an
# H100, so a run is ~2-3 min (2000 steps, ~25 s start-up, 20 validations of 16 forward passes);
# the corpus is built once per machine (~10 s). A run starts only while the time used plus the last
# run's time stays under TIME_LIMIT, so each call ends within about 8 minutes. The runs accumulate
# in $RES (default /tmp/coat-accuracy, kept while the machine stays warm); after each run they are
# packed into $OUT/accuracy.tgz, with accuracy.md / accuracy.png once all are done.
set -uo pipefail
out=${OUT:-out}
res=${RES:-/tmp/coat-accuracy}
seeds=${SEEDS:-1,2,3}
preset=${PRESET:-gpt-125m}
steps=${STEPS:-2000}
modes=${MODES:-bf16,coat,bf16@data2}
limit=${TIME_LIMIT:-480}
jobs=${JOBS:-4}  # runs at once on the one GPU (each ~8 GB; an eager gpt-125m run leaves the GPU idle between launches)
mkdir -p "$out" "$res"
export PYTHONUNBUFFERED=1
[ "${COAT_GPU_INSTALLED:-0}" = 1 ] || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$res/gpu.txt"
if [ -n "${PREVIOUS:-}" ] && [ -f "$PREVIOUS" ]; then
  tar xzf "$PREVIOUS" -C "$res" && echo "unpacked the runs of $PREVIOUS"
fi

last=0
while :; do
  if [ $((SECONDS + last)) -gt "$limit" ]; then
    echo "stopping after ${SECONDS} s: another run (~${last} s) would pass ${limit} s; call again for the rest"
    break
  fi
  start=$SECONDS
  # shellcheck disable=SC2086  # EXTRA: more accuracy.py options, word-split on purpose
  python3 benchmarks/accuracy.py --preset "$preset" --steps "$steps" --seeds "$seeds" --modes "$modes" ${EXTRA:-} --max-runs "$jobs" --jobs "$jobs" --out "$res" \
    2>&1 | tee -a "$res/accuracy.log"
  rc=${PIPESTATUS[0]}
  last=$((SECONDS - start))
  tar czf /tmp/accuracy.tgz -C "$res" . && mv /tmp/accuracy.tgz "$out/accuracy.tgz"
  if [ "$rc" -eq 0 ]; then
    cp "$res/accuracy.md" "$res/accuracy.png" "$out/" 2>/dev/null
    echo "all runs done: $out/accuracy.md"
    break
  fi
  if [ "$rc" -ne 75 ]; then
    echo "accuracy.py failed ($rc): see accuracy.log and the seed*/ reports in $out/accuracy.tgz"
    exit "$rc"
  fi
done
