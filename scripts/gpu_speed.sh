#!/usr/bin/env bash
# The speed issue's GPU runs (one GPU; written for an H100 with torch 2.11, TransformerEngine 2.20.2
# and megatron-core 0.19.2 installed by ../shared/gpu/stage). Results packed into $OUT/speed.tgz.
#
#   bash scripts/gpu_speed.sh host        # host time per op / per layer, and the step profile (~3 min)
#
# Parts:
#   host   benchmarks/host_overhead.py, then benchmarks/step_profile.py for gpt-1b (bf16, te-fp8-current, coat)
set -uo pipefail
dest=${OUT:-out}
out=${RES:-/tmp/speed-results}   # everything here; $dest gets speed.tgz (the device returns few files)
mkdir -p "$out" "$dest"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

run() {  # run CAP_SECONDS NAME command...: the log goes to $out/NAME.log
  local cap=$1 name=$2 start=$SECONDS
  shift 2
  echo "== $* (at most ${cap} s)"
  timeout "$cap" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "   stopped after ${cap} s: see $out/$name.log"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && { echo "   failed ($rc):"; tail -15 "$out/$name.log"; }
  echo "   $((SECONDS - start)) s"
}

for part in ${*:-host}; do
  case $part in
    host)
      run 240 host python3 benchmarks/host_overhead.py --out "$out"
      run 300 step-profile python3 benchmarks/step_profile.py --preset gpt-1b --modes bf16,te-fp8-current,coat --steps 3 --out "$out" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
tar czf "$dest/speed.tgz" -C "$out" .
echo "total $SECONDS s"
