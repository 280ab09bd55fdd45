"""benchmarks/accuracy.py: BF16 vs COAT (and the ablations) over seeds, on the tiny preset."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "accuracy.py")
STEPS = 6


def accuracy(out, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, SCRIPT, "--preset", "tiny", "--steps", str(STEPS), "--seeds", "1", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600, env=env)
    return proc


def test_gaps_per_mode_reuse_of_finished_seeds_and_the_ablations(tmp_path):
    first = accuracy(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    reports = sorted(os.listdir(tmp_path / "seed1"))
    assert "tiny.jsonl" in reports
    mtime = os.path.getmtime(tmp_path / "seed1" / "tiny.jsonl")

    # the ablations and the noise floor are added to the finished seed: bf16 and coat are not trained again
    second = accuracy(tmp_path, "--modes", "bf16,coat,coat-act,coat-opt,bf16@dp2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert os.path.getmtime(tmp_path / "seed1" / "tiny.jsonl") == mtime
    assert (tmp_path / "seed1" / "tiny-coat-act+coat-opt.jsonl").exists()
    assert (tmp_path / "seed1" / "tiny-bf16-dp2.jsonl").exists()

    rows = [json.loads(line) for line in (tmp_path / "accuracy.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [1, "mean"]
    for r in rows:
        for mode in ("bf16", "coat", "coat-act", "coat-opt", "bf16@dp2"):
            assert 0 < r[mode] < 10, (mode, r)  # a byte-level LM's loss: below ln 256 = 5.5 after a few steps
        for mode in ("coat", "coat-act", "coat-opt", "bf16@dp2"):
            assert r[f"gap_{mode}"] == pytest.approx((r[mode] - r["bf16"]) / r["bf16"])
        assert r["gap"] == r["gap_coat"]
    # the same data and initial weights in every mode: the first step's loss agrees
    losses = {}
    for name in os.listdir(tmp_path / "seed1"):
        if name.endswith(".jsonl"):
            for line in (tmp_path / "seed1" / name).read_text().splitlines():
                row = json.loads(line)
                if row.get("kind") == "train":
                    losses[row["mode"] + ("@dp2" if row["dp"] == 2 else "")] = row["losses"]
    assert set(losses) == {"bf16", "coat", "coat-act", "coat-opt", "bf16@dp2"}
    assert all(len(v) == STEPS for v in losses.values())
    first_losses = [v[0] for v in losses.values()]
    assert max(first_losses) - min(first_losses) < 0.02
    # coat-opt has BF16's layers: before the first update its loss is BF16's, bit for bit
    assert losses["coat-opt"][0] == losses["bf16"][0]
    # BF16 at DP 2 on the same global batch: the same math, reduced in another order
    assert losses["bf16@dp2"] == pytest.approx(losses["bf16"], abs=5e-3)

    curves = json.loads((tmp_path / "losses.json").read_text())
    assert curves["modes"] == ["bf16", "coat", "coat-act", "coat-opt", "bf16@dp2"]
    assert curves["losses"]["1"]["coat"] == pytest.approx(losses["coat"], abs=1e-4)

    md = (tmp_path / "accuracy.md").read_text()
    assert "| seed | BF16 | COAT | coat-act | coat-opt | bf16@dp2 | gap coat | gap coat-act | gap coat-opt | gap bf16@dp2 |" in md
    assert "--modes bf16,coat,coat-act,coat-opt,bf16@dp2" in md
    assert "coat-act: the COAT layer spec" in md and "the noise floor" in md
    assert "Goal (issue 7): the COAT gap <= 0.25%" in md


def test_modes_must_start_with_the_bf16_reference(tmp_path):
    proc = accuracy(tmp_path, "--modes", "coat,bf16")
    assert proc.returncode != 0 and "start with bf16" in proc.stderr
