"""benchmarks/spike_batches.py, run as a user runs it: each step's batch statistics beside the losses
of runs that trained on those batches, on the tiny preset."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "spike_batches.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_the_losses_of_runs_on_these_batches_sit_beside_their_bytes(tmp_path):
    run = [sys.executable, "-m", "coat_compare", "--preset", "tiny", "--steps", "6", "--micro-batch", "2"]
    run += ["--global-batch", "4", "--modes", "bf16,coat", "--no-plots", "--out", str(tmp_path), "--name", "r"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = str(tmp_path / "r.jsonl")
    base = [sys.executable, SCRIPT, "--preset", "tiny", "--global-batch", "4", "--steps", "6", "--from-step", "2"]
    proc = subprocess.run(
        [*base, "--rows", report, "--out", str(tmp_path / "s")], capture_output=True, text=True, timeout=600, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "s" / "spike_batches.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    trained = {json.loads(x)["mode"]: json.loads(x) for x in open(report) if '"kind": "train"' in x}
    assert [r["step"] for r in steps] == list(range(1, 7))
    for mode in ("bf16", "coat"):
        assert [r["losses"][mode] for r in steps] == trained[mode]["losses"]
    assert all(0 <= r["non_ascii"] <= 1 and 0 < r["surprisal"] < math.log(256) for r in steps)
    correlations = [r for r in rows if r["kind"] == "correlation"]
    assert [(c["run"], c["steps"]) for c in correlations] == [("bf16", 5), ("coat", 5)]
    md = (tmp_path / "s" / "spike_batches.md").read_text()
    assert f"--rows {report}`" in md and "| step | non-ASCII | surprisal | rare | bf16 | coat |" in md

    # rows of runs on other batches are refused, naming what differs and the fix
    other = subprocess.run(
        [*base, "--seed", "7", "--rows", report, "--out", str(tmp_path / "t")], capture_output=True, text=True, env=ENV
    )
    assert other.returncode != 0 and "trained on other batches" in other.stderr
    assert "run this where the runs ran, with their --seed, --data-seed and --global-batch" in other.stderr
