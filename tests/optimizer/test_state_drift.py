"""benchmarks/state_drift.py: stochastic rounding onto the FP8 grids, and the teacher-forced drift
of FP8 states written every step, on a model small enough for a CPU."""

import json
import os
import sys

import pytest
import torch
from load_file import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "state_drift.py")


def load_script():
    return load_file("benchmarks/state_drift.py", "state_drift_script")


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_stochastic_rounding_lands_on_a_neighbouring_code_and_is_unbiased(fmt, dtype):
    script = load_script()
    g = torch.Generator().manual_seed(0)
    fmax = torch.finfo(dtype).max
    # awkward values: subnormal range, around 1, near the format's top, zero, both signs
    y = torch.tensor([0.0, 1e-3, -3.3e-3, 0.3, 1.0, 1.06, -1.1, 7.7, 300.0, -fmax * 0.97, fmax])
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = torch.sort(codes[torch.isfinite(codes)].unique()).values
    samples = torch.stack([script.stochastic_round(y, fmt, g) for _ in range(4000)])
    assert torch.equal(samples.to(dtype).float(), samples)  # every result is an FP8 value
    below = grid[torch.searchsorted(grid, y, right=True) - 1]
    above = grid[torch.searchsorted(grid, y, right=False).clamp_max(grid.numel() - 1)]
    assert ((samples == below) | (samples == above)).all()  # one of the two neighbours of y
    exact = torch.isin(y, grid)
    assert (samples[:, exact] == y[exact]).all()  # a value on the grid stays
    spacing = (above - below).clamp_min(1e-12)
    mean = samples.mean(0)
    assert ((mean - y).abs() <= 4 * spacing / (2 * 4000**0.5) + 1e-12).all()  # E[result] = y


def test_the_drift_run_writes_every_candidate_at_every_record_step(tmp_path):
    import subprocess

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
    script = load_script()
    assert [(r["step"], r["candidate"]) for r in rows] == [(s, c) for s in (3, 6) for c in script.CANDIDATES]
    by = {(r["candidate"], r["step"]): r for r in rows}
    for step in (3, 6):
        bf16 = by["BF16 / BF16", step]["rel_l2_error_u"]
        coat = by["COAT default: 1x128 E4M3 + expansion, nearest", step]["rel_l2_error_u"]
        assert 0 < bf16 < coat < 0.5  # FP8's rounding is coarser than BF16's, and still small
        assert 0 < by["BF16 / BF16", step]["one_shot_coat"] <= coat * 1.5
    md = (tmp_path / "state_drift.md").read_text()
    assert "`python benchmarks/state_drift.py --steps 6 --every 3 --batch 4 --seq 32 --dim 32 --layers 1`" in md
    assert md.count("| COAT, stochastic rounding of m and v |") == 3  # one line in each of the three tables
