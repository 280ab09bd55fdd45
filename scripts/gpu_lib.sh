# Shared by the GPU scripts (source it after setting $out, the results folder, and $dest, where
# the packed results go): the set-up every GPU run starts with, and `run`, one capped command.

gpu_setup() {  # folders, unbuffered Python, the project installed, the GPU's name in $out/gpu.txt
  mkdir -p "$out" "$dest"
  export PYTHONUNBUFFERED=1
  [ "${COAT_GPU_INSTALLED:-0}" = 1 ] || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
}

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
