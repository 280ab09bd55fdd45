#!/usr/bin/env bash
# coat-compare on two GPUs of one host (written for 2 H200s with torch 2.11, TransformerEngine 2.20.2
# and megatron-core 0.19.2 installed): tensor parallel with sequence parallel, data parallel with the
# distributed optimizer, a checkpoint resumed at another DP size, and the largest llama2-7b micro-batch.
#
#   bash scripts/gpu_two.sh                  # every part below, about 6-8 minutes
#   bash scripts/gpu_two.sh layer train      # some parts (layer train dp resume fit), e.g. one device call each
#
# Each part's reports accumulate in $RES (default /tmp/coat-two-gpu: it survives between calls on a
# machine that stays warm); every call ends by packing all of $RES into ONE file, $OUT/two-gpu.tgz,
# and printing the combined summary (summary.md). Each command is capped with `timeout`; the exact
# commands are in commands.txt. To commit: tar xzf two-gpu.tgz, copy coat-two-gpu/*.{md,jsonl,png,txt}
# to benchmarks/results/two-gpu-h200/.
#
# layer   llama2-7b-layer at --tp 2: bf16, te-fp8-current, te-fp8-store, coat (time, activation
#         memory per GPU, sequence-parallel all-gather bytes per fwd+bwd)                  ~1 min
# train   gpt-1b at --tp 2, $STEPS steps: bf16, te-fp8-current, coat (step time, tokens/s total and
#         per GPU, memory per GPU, all-gather bytes per step)                              ~1 min
# dp      gpt-1b at --dp 2, $STEPS steps, the same modes (optimizer bytes per rank), and bf16 and
#         coat at DP 1 with the same global batch (micro-batch x 2) for the loss comparison
#         (BF16's DP 1 vs DP 2 difference is the control: reduction order alone)           ~2 min
# resume  gpt-1b coat: checkpoint at DP 2 after 5 steps, resumed at DP 1 and DP 2, 5 more steps
#         against the uninterrupted run                                                    ~2 min
# fit     llama2-7b at --tp 2, bf16, te-fp8-current and coat: the largest micro-batch up to
#         $FIT_CAP, at most $FIT_TIME s of tries per mode, tokens/s per GPU there            ~5 min
set -uo pipefail
export NCCL_NVLS_ENABLE=0        # NVLink multicast off (the device machines' rule)
export PYTHONUNBUFFERED=1
out=${OUT:-out}
res=${RES:-/tmp/coat-two-gpu}
steps=${STEPS:-20}
fit_cap=${FIT_CAP:-8}
fit_time=${FIT_TIME:-60}
mkdir -p "$out" "$res"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(layer train dp resume fit)
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$res/gpu.txt"
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "this script needs 2 GPUs (nvidia-smi -L lists fewer)"; exit 1; }

compare() {  # compare CAP_SECONDS NAME PROCESSES coat-compare-args...: the log goes to $res/NAME.log
  local cap=$1 name=$2 procs=$3 start=$SECONDS
  shift 3
  local launch=(python3)
  [ "$procs" -gt 1 ] && launch=(python3 -m torch.distributed.run --standalone --nproc-per-node "$procs")
  echo "== ${launch[*]} -m coat_compare $* (at most ${cap} s)" | tee -a "$res/commands.txt"
  timeout "$cap" "${launch[@]}" -m coat_compare --out "$res" --name "$name" "$@" >"$res/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "   stopped after ${cap} s: see $name.log"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && { echo "   failed ($rc):"; grep -v -i warn "$res/$name.log" | tail -5; }
  echo "   $((SECONDS - start)) s"
}

for part in "${parts[@]}"; do
  case $part in
    layer)
      compare 180 llama2-7b-layer-tp2 2 --preset llama2-7b-layer --tp 2 --modes bf16,te-fp8-current,te-fp8-store,coat ;;
    train)
      compare 200 gpt-1b-tp2 2 --preset gpt-1b --tp 2 --steps "$steps" --modes bf16,te-fp8-current,coat ;;
    dp)
      compare 200 gpt-1b-dp2 2 --preset gpt-1b --dp 2 --steps "$steps" --micro-batch 4 --modes bf16,te-fp8-current,coat
      compare 200 gpt-1b-dp1-same-batch 1 --preset gpt-1b --steps "$steps" --micro-batch 8 --modes bf16,coat ;;
    resume)
      compare 300 gpt-1b-resume 1 --preset gpt-1b --modes coat --dp 2 --micro-batch 2 --steps 10 --save-step 5 \
        --resume-check --checkpoint-dir /tmp/coat-two-gpu-checkpoints ;;
    fit)
      compare $((3 * fit_time + 300)) llama2-7b-tp2-search 1 --preset llama2-7b --tp 2 --modes bf16,te-fp8-current,coat --search \
        --search-max-micro-batch "$fit_cap" --search-time-limit "$fit_time" --search-steps 5 ;;
    *) echo "unknown part $part: choose from layer train dp resume fit"; exit 2 ;;
  esac
done

python3 -m coat_compare --summarize --out "$res" 2>/dev/null   # prints summary.md
tar czf "$out/two-gpu.tgz" -C "$(dirname "$res")" "$(basename "$res")"
echo "total $SECONDS s; everything in $out/two-gpu.tgz ($(du -h "$out/two-gpu.tgz" | cut -f1))"
