"""tests/kernels/host_path_layer.py, run as a user runs it (a subprocess: it stubs Triton's launch and the GEMMs
for the whole process): COAT's ops of one layer issue no more Triton launches than they did when the
host path was measured on GPUs (2026-11-26: 29 per layer fwd+bwd at the harness's shapes), plus one per norm
since a norm's weight-gradient sum is a kernel (3d0175a: ``sum_partials``, in place of torch's sum and cast,
two launches that this count does not see: one launch fewer per norm in all), and after warm-up every one of
them takes the lean launch path (coat_kernels.launch) instead of Triton's."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_one_layer_launches_31_kernels_all_through_the_lean_path():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "COAT_LEAN_LAUNCH")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "kernels", "host_path_layer.py"),
            "--calls",
            "3",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"(\d+) us per call .*?, (\d+) Triton launches, (\d+) through the lean path", done.stdout)
    assert found, done.stdout[-2000:]
    us, launches, lean = map(int, found.groups())
    assert us > 0 and launches <= 29 + 2 and lean == launches  # 2 norms, one sum_partials each
