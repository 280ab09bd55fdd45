"""benchmarks/weight_passes.py, run as a user runs it: it names its options, and without a GPU it
refuses to time anything, with the fix (the timing itself is a GPU run: scripts/gpu_evidence.sh
weight-passes)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "weight_passes.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_help_names_the_options():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(option in proc.stdout for option in ("--preset", "--step-ms", "--out"))


def test_it_refuses_to_time_without_a_gpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert proc.returncode != 0 and "times GPU kernels: run it on a CUDA machine" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written
