#!/usr/bin/env bash
# NVIDIA apex built on a GPU machine without internet from a source snapshot: its core extensions
# (--cpp_ext --cuda_ext: fused norms, amp_C, the fused weight-gradient GEMM that Megatron's
# gradient-accumulation fusion calls, the softmax kernels), in place, for Hopper only, then the
# snapshot put on Python's path. APEX_EXTENSIONS=name,name builds only those of setup.py's extensions
# (fused_weight_gradient_mlp_cuda alone, the one Megatron's gradient-accumulation fusion calls, takes
# a minute or two; all of them take over 7 minutes on 16 cores). ninja keeps its objects in SRC/build, so a build stopped by a time
# limit goes on where it stopped when run again on the same machine. Wheels of ninja and packaging
# (apex's setup.py needs both) are taken from SRC/_wheels when they are not installed.
#
#   bash scripts/build_apex.sh SRC        # SRC: `git archive` of github.com/NVIDIA/apex (never committed here)
#   APEX_EXTENSIONS=fused_weight_gradient_mlp_cuda bash scripts/build_apex.sh SRC
set -euo pipefail
src=$(cd "${1:?usage: build_apex.sh SRC (an NVIDIA apex source tree)}" && pwd)
[ -f "$src/setup.py" ] && [ -d "$src/apex/normalization" ] || {
  echo "$src is not an NVIDIA apex source tree (no setup.py or apex/normalization)" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "no nvcc on PATH: apex's CUDA extensions need the CUDA toolkit" >&2; exit 2; }
for tool in ninja packaging; do
  python3 -c "import $tool" 2>/dev/null || python3 -m pip install -q --no-index --no-deps "$src"/_wheels/"$tool"-*.whl
done
cd "$src"
# setup.py run with setuptools.setup wrapped so that only APEX_EXTENSIONS' extensions are built
MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} APEX_CPP_EXT=1 APEX_CUDA_EXT=1 \
  python3 -c '
import os, sys, setuptools
only = [n for n in os.environ.get("APEX_EXTENSIONS", "").split(",") if n]
real_setup = setuptools.setup
def setup(**kw):
    if only:
        names = [e.name for e in kw["ext_modules"]]
        missing = sorted(set(only) - set(names))
        if missing:
            sys.exit(f"APEX_EXTENSIONS names {missing}, which setup.py does not build: choose among {names}")
        kw["ext_modules"] = [e for e in kw["ext_modules"] if e.name in only]
    return real_setup(**kw)
setuptools.setup = setup
sys.argv = ["setup.py", "build_ext", "--inplace"]
exec(compile(open("setup.py").read(), "setup.py", "exec"), {"__name__": "__main__", "__file__": "setup.py"})
' 2>&1 | grep -vE "^\[[0-9]+/[0-9]+\]|warning" | tail -5
echo "$src" >"$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/nvidia-apex-source.pth"
cd /
built=${APEX_EXTENSIONS:-amp_C,fused_layer_norm_cuda,fused_weight_gradient_mlp_cuda}
python3 -c "import apex, ${built}
from apex.normalization import FusedLayerNorm
print('apex ok:', apex.__file__, '(built: ${built})')"
