"""benchmarks/outlier_stress.py, run as a user runs it, on the tiny preset (CPU: bf16 and coat train, TE modes are skipped rows)."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "outlier_stress.py")
STEPS, GROWTH = 4, 4.0


def stress(out, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    # a learning rate of ~0: the weights change by the injection alone, so its effect can be measured
    cmd = [
        sys.executable,
        SCRIPT,
        "--preset",
        "tiny",
        "--steps",
        str(STEPS),
        "--growth",
        str(GROWTH),
        "--lr",
        "1e-7",
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "outlier_stress.jsonl").read_text().splitlines()]
    return rows, (out / "outlier_stress.md").read_text()


def by_mode(rows):
    steps, summaries = {}, {}
    for r in rows:
        if r["kind"] == "step":
            steps.setdefault(r["mode"], []).append(r)
        else:
            summaries[r["mode"]] = r
    return steps, summaries


def ratios(rows, key):
    return [b[key] / a[key] for a, b in zip(rows, rows[1:])]


def test_swiglu_injection_grows_the_channels_by_the_factor_in_every_mode(tmp_path):
    rows, md = stress(tmp_path, "--modes", "bf16,te-fp8-current,coat", "--channels", "3")
    steps, summaries = by_mode(rows)
    assert list(summaries) == ["bf16", "te-fp8-current", "coat"]
    te = summaries["te-fp8-current"]
    assert te["status"] == "skipped" and "TransformerEngine" in te["reason"]
    assert set(steps) == {"bf16", "coat"}

    for mode in ("bf16", "coat"):
        run = steps[mode]
        assert [r["step"] for r in run] == list(range(STEPS))
        for r in run:
            assert r["finite"] and math.isfinite(r["loss"]) and r["optimizer_stepped"]
            assert r["factor"] == pytest.approx(GROWTH ** r["step"])
        # the weight rows the forward read: x GROWTH per step (BF16 rounding), the other rows as they were;
        # so the optimizer's master weights were scaled too (it would write the old rows back otherwise)
        assert ratios(run, "weight_injected_amax") == pytest.approx([GROWTH] * (STEPS - 1), rel=2.0**-7)
        assert ratios(run, "weight_other_amax") == pytest.approx([1.0] * (STEPS - 1), rel=2.0**-7)
        # fc1's output in those channels: x GROWTH per step up to the batch-to-batch spread of a maximum
        # over tokens (each step reads another batch); the other channels do not grow
        assert all(GROWTH / 1.5 < q < GROWTH * 1.5 for q in ratios(run, "out_injected_amax")), ratios(
            run, "out_injected_amax"
        )
        first, last = run[0], run[-1]
        assert 0.5 < last["out_other_amax"] / first["out_other_amax"] < 2
        # SwiGLU's output there grows faster than either factor: silu(gate) * up, both halves grown
        growth_out = last["out_injected_amax"] / first["out_injected_amax"]
        assert last["swiglu_injected_amax"] / first["swiglu_injected_amax"] > growth_out * GROWTH

        s = summaries[mode]
        assert s["status"] == "ok" and s["steps_run"] == STEPS and s["target"] == "swiglu" and s["inject_layers"] == [1]
        assert (
            s["first_nonfinite_step"] is None and s["first_blowup_step"] is None and s["skipped_optimizer_steps"] == 0
        )
        assert s["initial_loss"] == run[0]["loss"] and s["out_injected_amax_last"] == last["out_injected_amax"]
        assert s["final_loss"] == pytest.approx(sum(r["loss"] for r in run) / STEPS)
        assert s["out_past_e5m2_step"] is None and s["seconds"] > 0
    # the same initial weights and first batch in both modes
    assert abs(steps["bf16"][0]["loss"] - steps["coat"][0]["loss"]) < 0.02
    # COAT's fc1 output is 1x16 FP8: the measured maximum is its dequantized value, within E4M3's step
    assert steps["coat"][0]["out_injected_amax"] == pytest.approx(steps["bf16"][0]["out_injected_amax"], rel=2.0**-3)

    assert (
        "| mode | status | steps | loss first -> last 10 |" in md
        and "| injected weight rows max abs first -> last | seconds |" in md
    )
    assert "| bf16 | ok | 4 |" in md and "| coat | ok | 4 |" in md
    assert "| te-fp8-current | skipped: te-fp8-current" in md
    assert "## Per step" in md and "| step | growth | bf16 loss | bf16 act | bf16 SwiGLU | coat loss |" in md
    assert (tmp_path / "outlier_stress-coat.log").exists()


def test_residual_target_in_every_layer(tmp_path):
    rows, md = stress(tmp_path, "--modes", "coat", "--target", "residual", "--inject-layers", "all", "--channels", "2")
    steps, summaries = by_mode(rows)
    run = steps["coat"]
    assert summaries["coat"]["inject_layers"] == [0, 1] and "swiglu_injected_amax" not in run[0]
    assert ratios(run, "weight_injected_amax") == pytest.approx([GROWTH] * (STEPS - 1), rel=2.0**-7)
    # fc2's output in the injected residual channels (its input also changes: layer 0's channels grew)
    assert run[-1]["out_injected_amax"] / run[0]["out_injected_amax"] > GROWTH ** (STEPS - 1) / 2
    assert "linear_fc2's rows (residual channels) in layer(s) 0, 1" in md and "SwiGLU" not in md.split("## Per step")[1]


def test_bad_arguments_name_the_fix(tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "tiny-layer", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "choose an end-to-end one" in proc.stderr
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "tiny", "--growth", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--growth and --blowup must be positive" in proc.stderr
