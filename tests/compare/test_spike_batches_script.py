"""benchmarks/spike_batches.py: each step's batch statistics beside the losses of runs that trained
on those batches, on the tiny preset."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from load_file import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "spike_batches.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def load_script():
    return load_file("benchmarks/spike_batches.py", "spike_batches_script")


def test_batch_statistics_by_hand():
    script = load_script()
    freq = torch.zeros(256, dtype=torch.float64)
    freq[ord("a")], freq[ord("b")], freq[200] = 0.5, 0.5 - 1e-6, 1e-6
    log_p = freq.clamp_min(1e-12).log()
    # the first byte of each window is input only: the labels are a, b, 200, a
    windows = torch.tensor([[ord("x"), ord("a"), ord("b")], [ord("x"), 200, ord("a")]], dtype=torch.uint8)
    stats = script.batch_stats(windows, log_p, freq)
    assert stats["non_ascii"] == 0.25 and stats["rare"] == 0.25
    assert stats["surprisal"] == pytest.approx((2 * math.log(2) - math.log(0.5 - 1e-6) - math.log(1e-6)) / 4)
    assert script.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0) and script.pearson([1, 1, 1], [1, 2, 3]) is None


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
