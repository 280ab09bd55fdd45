#!/usr/bin/env bash
# coat-compare on one GPU (written for an H200 with torch 2.11, TransformerEngine 2.20.2 and
# megatron-core 0.19.2 installed): BF16 vs TE FP8 vs COAT, reports under $OUT (default ./out).
#
#   bash scripts/gpu_compare.sh                 # about 4-5 minutes; each command is capped (below)
#   STEPS=200 bash scripts/gpu_compare.sh train # the 200 end-to-end steps alone (~6-8 minutes:
#                                               # with the other parts it would pass the device's
#                                               # 10 minutes per command)
#   bash scripts/gpu_compare.sh layer fit       # only the parts named (layer, train, fit; default all)
#   FULL=1 bash scripts/gpu_compare.sh          # also every mode's largest micro-batch for gpt-1b
#                                               # (the tokens/s goal; 4-7 minutes per mode)
#
# 1. per layer: llama2-7b-layer and llama3-8b-layer, every mode (~1 min each)
# 2. end to end: gpt-1b, every mode at micro-batch 4, $STEPS steps (default 30; ~2 min)
# 3. fit: does llama2-7b train at micro-batch 1 with BF16, with COAT (one fresh process per try; ~1 min)
# then prints summary.md: every table and the goals (met or not, and by how much).
set -uo pipefail
out=${OUT:-out}
steps=${STEPS:-30}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

run() {  # run CAP_SECONDS NAME coat-compare-args...: the log goes to $out/NAME.log
  local cap=$1 name=$2 start=$SECONDS
  shift 2
  echo "== coat-compare $* (at most ${cap} s)"
  timeout "$cap" python3 -m coat_compare --out "$out" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "   stopped after ${cap} s: see $out/$name.log"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && { echo "   failed ($rc):"; tail -5 "$out/$name.log"; }
  echo "   $((SECONDS - start)) s"
}

parts=${*:-layer train fit}
for part in $parts; do
  case $part in
    layer)
      run 150 layer-llama2 --preset llama2-7b-layer --modes all
      run 150 layer-llama3 --preset llama3-8b-layer --modes all ;;
    train)
      run $((120 + 2 * steps)) train-gpt1b --preset gpt-1b --steps "$steps" --micro-batch 4 ;;
    fit)
      run 200 fit-llama2-7b --preset llama2-7b --modes bf16,coat --search --search-max-micro-batch 1 --search-steps 5 ;;
    *) echo "unknown part $part: choose from layer train fit"; exit 2 ;;
  esac
done
if [ "${FULL:-0}" = 1 ]; then  # one command per mode: each stays under 10 minutes
  for mode in bf16 te-fp8-delayed te-fp8-current te-fp8-block te-fp8-store te-fp8-pa coat; do
    run 420 "search-gpt1b-$mode" --preset gpt-1b --modes "$mode" --search --search-time-limit 240 --search-steps 6 --name "gpt-1b-search-$mode"
  done
fi

python3 -m coat_compare --summarize --out "$out" 2>/dev/null
# the device machine hands back only a few files from $OUT: pack everything into one
tar czf /tmp/compare.tgz -C "$out" . && mv /tmp/compare.tgz "$out/compare.tgz"
echo "total $SECONDS s; reports, logs and plots in $out/ (and all of them in $out/compare.tgz)"
