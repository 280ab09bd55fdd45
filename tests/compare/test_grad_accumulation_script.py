"""benchmarks/grad_accumulation.py: BF16 against FP32 gradient buffers over several micro-batches,
run as a user runs it (a subprocess: it joins a process group and sets Megatron's global state)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bf16_summation_error_is_measured_against_the_sampling_noise(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "benchmarks", "grad_accumulation.py")
    done = subprocess.run(
        [sys.executable, script, "--counts", "1,4", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    one, four = [json.loads(line) for line in (tmp_path / "grad_accumulation.jsonl").read_text().splitlines()]
    # one micro-batch: COAT's GEMM writes its FP32 product into the buffer (no BF16 wgrad in between), so
    # the BF16 buffer differs from the FP32 one by one rounding of the gradient to BF16 (2^-9 relative at most)
    assert one["micro_batches"] == 1 and 0 < one["rounding_error"] < 2**-9
    assert (
        one["rounding_error"] < four["rounding_error"] < 0.02
        and four["worst_parameter_error"] >= four["rounding_error"]
    )
    assert four["sampling_noise"] > 10 * four["rounding_error"]
    assert "| 4 | " in (tmp_path / "grad_accumulation.md").read_text()
