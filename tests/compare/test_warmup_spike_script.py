"""benchmarks/warmup_spike.py: one run per warm-up length from the same initial weights, judged
against ln(vocab), run as a user runs it (a subprocess: it joins a process group)."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_each_warm_up_starts_alike_and_is_judged_against_ln_vocab(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "benchmarks", "warmup_spike.py")
    argv = ["--layers", "1", "--hidden", "64", "--seq", "32", "--micro-batch", "4", "--steps", "6", "--warmups", "2,5"]
    done = subprocess.run(
        [sys.executable, script, *argv, "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    short, long = [json.loads(line) for line in (tmp_path / "warmup_spike.jsonl").read_text().splitlines()]
    assert (short["lr_warmup_steps"], long["lr_warmup_steps"]) == (2, 5)
    assert short["losses"][0] == long["losses"][0]  # the same initial weights and first batch
    assert len(short["losses"]) == 6 and short["ln_vocab"] == math.log(256)
    assert short["peak_after_step_1"] == max(short["losses"][1:])
    md = (tmp_path / "warmup_spike.md").read_text()
    assert "seq 32 x micro-batch 4" in md and "--seq 32 --micro-batch 4" in md
