"""benchmarks/state_drift.py, run as a user runs it on a model small enough for a CPU: the
teacher-forced drift of FP8 states written every step, each candidate at every record step."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "state_drift.py")


def test_the_drift_run_writes_every_candidate_at_every_record_step(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--steps", "6", "--every", "3", "--dim", "32", "--layers", "1", "--batch", "4"]
        + ["--seq", "32", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "state_drift.jsonl").read_text().splitlines()]
    candidates = [r["candidate"] for r in rows if r["step"] == 3]
    assert len(candidates) == len(set(candidates)) >= 5  # BF16, COAT and its variants, per-tensor E4M3
    assert [(r["step"], r["candidate"]) for r in rows] == [(s, c) for s in (3, 6) for c in candidates]
    assert "COAT, stochastic rounding of m and v" in candidates and "BF16 / BF16" in candidates
    by = {(r["candidate"], r["step"]): r for r in rows}
    for step in (3, 6):
        bf16 = by["BF16 / BF16", step]["rel_l2_error_u"]
        coat = by["COAT default: 1x128 E4M3 + expansion, nearest", step]["rel_l2_error_u"]
        assert 0 < bf16 < coat < 0.5  # FP8's rounding is coarser than BF16's, and still small
        assert 0 < by["BF16 / BF16", step]["one_shot_coat"] <= coat * 1.5
    md = (tmp_path / "state_drift.md").read_text()
    assert "`python benchmarks/state_drift.py --steps 6 --every 3 --batch 4 --seq 32 --dim 32 --layers 1`" in md
    assert md.count("| COAT, stochastic rounding of m and v |") == 3  # one line in each of the three tables
