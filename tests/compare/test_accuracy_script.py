"""benchmarks/accuracy.py: BF16 vs COAT validation loss over seeds with the noise floors and the
ablations, on the tiny preset; and its verdict rule on made-up gaps."""

import json
import math
import os
import subprocess
import sys

import pytest
from load_file import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "accuracy.py")
STEPS = 6
MODES = "bf16,coat,coat-act,coat-opt,bf16@data2,bf16@dp2"


def accuracy(out, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--preset",
            "tiny",
            "--steps",
            str(STEPS),
            "--seeds",
            "1",
            "--eval-every",
            "3",
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def load_script():
    return load_file("benchmarks/accuracy.py", "accuracy_script")


def test_validation_gaps_noise_floors_ablations_and_runs_split_over_calls(tmp_path):
    # a call runs at most --max-runs (seed, mode) runs and says that more are left
    first = accuracy(tmp_path, "--modes", MODES, "--max-runs", "4")  # one job: same DP size and data order
    assert first.returncode == 75, first.stderr[-3000:]
    assert "2 run(s) left (seed 1 bf16@data2, seed 1 bf16@dp2): run the same command again" in first.stdout
    assert not (tmp_path / "accuracy.md").exists()
    done = tmp_path / "seed1" / "tiny-bf16+coat+coat-act+coat-opt.jsonl"
    mtime = os.path.getmtime(done)

    # the next call runs the rest, two processes at once; the finished modes are not trained again
    second = accuracy(tmp_path, "--modes", MODES, "--jobs", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert os.path.getmtime(done) == mtime
    for name in ("tiny-bf16-data2", "tiny-bf16-dp2"):
        assert (tmp_path / "seed1" / f"{name}.jsonl").exists(), name

    rows = {}
    for name in os.listdir(tmp_path / "seed1"):
        if name.endswith(".jsonl"):
            for line in (tmp_path / "seed1" / name).read_text().splitlines():
                row = json.loads(line)
                if row.get("kind") == "train":
                    rows[
                        row["mode"] + ("@dp2" if row["dp"] == 2 else "") + ("@data2" if row["data_seed"] != 1 else "")
                    ] = row
    assert set(rows) == set(MODES.split(","))
    assert rows["bf16@data2"]["data_seed"] == 1001 and rows["bf16@data2"]["seed"] == 1
    assert len({r["valid_windows_sha256"] for r in rows.values()}) == 1  # one set of validation windows for every mode
    assert all([s for s, _ in r["valid_losses"]] == [3, 6] for r in rows.values())
    losses = {k: r["losses"] for k, r in rows.items()}
    # the same initial weights everywhere and, but for bf16@data2, the same first batch
    assert (
        max(v[0] for k, v in losses.items() if k != "bf16@data2")
        - min(v[0] for k, v in losses.items() if k != "bf16@data2")
        < 0.02
    )
    assert losses["coat-opt"][0] == losses["bf16"][0]  # BF16's layers: before the first update, BF16's loss bit for bit
    assert losses["bf16@dp2"] == pytest.approx(losses["bf16"], abs=5e-3)  # the same math, another reduction order
    assert losses["bf16@data2"][0] != losses["bf16"][0]  # another batch at step 1

    summary = [json.loads(line) for line in (tmp_path / "accuracy.jsonl").read_text().splitlines()]
    # the noise-floor reading, then the paired rule for every mode but the noise floor (bf16@data2)
    assert [r["kind"] for r in summary] == ["seed", "mean", "verdict"] + ["paired_verdict"] * 4
    assert [r["mode"] for r in summary[3:]] == ["coat", "coat-act", "coat-opt", "bf16@dp2"]
    assert all(r["met"] is None and r["upper_bound"] == 0.005 for r in summary[3:])  # one seed: no standard error
    seed = summary[0]
    for key in MODES.split(","):
        assert seed["valid"][key] == rows[key]["valid_loss"]
        assert seed["train_tail"][key] == pytest.approx(rows[key]["losses"][-1])  # the last 10% of 6 steps: one step
    for key in MODES.split(",")[1:]:
        assert seed["gap_valid"][key] == pytest.approx(
            (seed["valid"][key] - seed["valid"]["bf16"]) / seed["valid"]["bf16"]
        )
    verdict = summary[2]
    assert verdict["noise_floor"] == "bf16@data2" and verdict["met"] is None  # one seed: no standard error
    assert verdict["gap_coat"] == pytest.approx(seed["gap_valid"]["coat"])
    assert summary[0]["corpus_valid_sha256"] == rows["bf16"]["corpus_valid_sha256"]

    curves = json.loads((tmp_path / "losses.json").read_text())
    assert curves["modes"] == MODES.split(",")
    assert curves["valid_losses"]["1"]["coat"] == [
        [s, pytest.approx(v, abs=1e-4)] for s, v in rows["coat"]["valid_losses"]
    ]

    md = (tmp_path / "accuracy.md").read_text()
    header = "| seed | BF16 | COAT | coat-act | coat-opt | bf16@data2 | bf16@dp2 | gap COAT | gap coat-act | gap coat-opt | gap bf16@data2 | gap bf16@dp2 |"
    assert md.count(header) == 2  # validation loss (primary), then training loss
    assert md.index("Validation loss after the last step (the primary figure)") < md.index(
        "Training loss, mean over the last 10%"
    )
    assert f"SHA-256 `{rows['bf16']['corpus_train_sha256']}`" in md and "each byte at most once" in md
    assert (
        "coat-act: the COAT layer spec" in md
        and "bf16@data2: BF16 with the same initial weights and another order" in md
    )
    assert "Noise-floor reading: COAT's mean validation-loss gap to BF16 <= 0.25% and within two standard errors" in md
    assert "- coat vs BF16 over 1 seed(s), rule mean gap <= 0.25% and mean + 2 se <= 0.50%:" in md
    assert (
        "|gap_coat| <= 2 noise_rms / sqrt(seeds)" in md and ": not judged (standard errors need 2 seeds or more)." in md
    )


def test_a_repeated_run_is_its_own_column_and_on_a_cpu_repeats_the_first_bit_for_bit(tmp_path):
    """bf16@run2: the same seed, batches and code again (coat-compare --repeat 2, a label in its
    row): on a GPU a noise floor of nondeterministic reductions; on a CPU nothing differs."""
    proc = accuracy(tmp_path, "--modes", "bf16,coat,bf16@run2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for name in ("tiny-bf16+coat", "tiny-bf16-run2"):
        for line in (tmp_path / "seed1" / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") == "train":
                rows[row["mode"] + (f"@run{row['repeat']}" if "repeat" in row else "")] = row
    assert set(rows) == {"bf16", "coat", "bf16@run2"}
    assert rows["bf16@run2"]["repeat"] == 2 and rows["bf16@run2"]["data_seed"] == rows["bf16"]["data_seed"] == 1
    assert rows["bf16@run2"]["losses"] == rows["bf16"]["losses"]
    assert rows["bf16@run2"]["valid_loss"] == rows["bf16"]["valid_loss"]
    summary = [json.loads(line) for line in (tmp_path / "accuracy.jsonl").read_text().splitlines()]
    assert summary[0]["gap_valid"]["bf16@run2"] == 0.0
    assert summary[2]["kind"] == "verdict" and summary[2]["noise_floor"] == "bf16@run2"
    assert "bf16@run2: BF16 run again with the same seed, batches and code" in (tmp_path / "accuracy.md").read_text()

    # --rows: runs another session left elsewhere join a report without copies, and nothing trains again
    earlier = tmp_path / "earlier" / "seed1"
    earlier.mkdir(parents=True)
    os.replace(tmp_path / "seed1" / "tiny-bf16-run2.jsonl", earlier / "tiny-bf16-run2.jsonl")
    report = tmp_path / "report"
    joined = accuracy(
        report, "--modes", "bf16,coat,bf16@run2", "--rows", str(tmp_path), "--rows", str(tmp_path / "earlier")
    )
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert not (report / "seed1").exists()  # nothing ran
    assert [json.loads(line) for line in (report / "accuracy.jsonl").read_text().splitlines()] == summary
    assert f"--rows {tmp_path} --rows {tmp_path / 'earlier'}`" in (report / "accuracy.md").read_text()


def test_runs_of_another_learning_rate_schedule_are_neither_used_nor_counted_as_done(tmp_path):
    """--lr-decay reaches every run, and the rows in --out of the other schedule do not stand in for
    its runs: a cosine report trains its own, beside the constant ones (14 steps: tiny warms up for 10)."""
    longer = ["--steps", "14"]
    constant = accuracy(tmp_path, "--modes", "bf16,coat", *longer)
    assert constant.returncode == 0, constant.stderr[-3000:]
    first = json.loads((tmp_path / "accuracy.jsonl").read_text().splitlines()[0])
    cosine = accuracy(tmp_path, "--modes", "bf16,coat", *longer, "--lr-decay", "cosine", "--max-runs", "0")
    assert cosine.returncode == 75 and "2 run(s) left (seed 1 bf16, seed 1 coat)" in cosine.stdout
    # likewise another Adam epsilon (the Llama presets' default changed; rows recorded without one had 1e-8)
    other_eps = accuracy(tmp_path, "--modes", "bf16,coat", *longer, "--adam-eps", "1e-5", "--max-runs", "0")
    assert other_eps.returncode == 75 and "2 run(s) left (seed 1 bf16, seed 1 coat)" in other_eps.stdout
    same_eps = accuracy(tmp_path, "--modes", "bf16,coat", *longer, "--adam-eps", "1e-8", "--max-runs", "0")
    assert same_eps.returncode == 0 and "--adam-eps 1e-08`" in (tmp_path / "accuracy.md").read_text()
    cosine = accuracy(tmp_path, "--modes", "bf16,coat", *longer, "--lr-decay", "cosine")
    assert cosine.returncode == 0, cosine.stderr[-3000:]
    for name, decay in (("tiny-bf16+coat", "constant"), ("tiny-bf16+coat-cosine", "cosine")):
        lines = (tmp_path / "seed1" / f"{name}.jsonl").read_text().splitlines()  # both kept, side by side
        assert {json.loads(line).get("lr_decay") for line in lines if '"train"' in line} == {decay}
    second = json.loads((tmp_path / "accuracy.jsonl").read_text().splitlines()[0])
    assert second["valid"]["bf16"] != first["valid"]["bf16"]
    text = (tmp_path / "accuracy.md").read_text()
    assert "--lr-decay cosine`" in text and "then a cosine down to 10% of it at the last step" in text


def test_mode_keys_name_the_dp_size_data_order_and_run():
    script = load_script()
    assert script.parse_key("bf16@run2") == ("bf16", 1, 1, 2)
    assert script.parse_key("coat@dp2@data3@run2") == ("coat", 2, 3, 2)
    assert script.mode_key("coat", 2, 3, 2) == "coat@dp2@data3@run2" and script.mode_key("bf16") == "bf16"
    for bad in ("bf16@run0", "bf16@run", "bf16@twice"):
        with pytest.raises(SystemExit, match="MODE@runN"):
            script.parse_key(bad)


def test_the_modes_start_with_the_bf16_reference(capsys):
    script = load_script()
    with pytest.raises(SystemExit):
        script.parse_args(["--modes", "coat,bf16"])
    assert "start with bf16" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="is not MODE, MODE@dpN, MODE@dataN or MODE@runN"):
        script.parse_args(["--modes", "bf16,coat,bf16@data0"])
    assert script.parse_args(["--modes", "bf16,coat,bf16@data2"])[1] == ["bf16", "coat", "bf16@data2"]


def test_the_verdict_rule():
    script = load_script()
    assert script.parse_key("bf16@data2") == ("bf16", 1, 2, 1)
    assert script.parse_key("coat-act@dp2") == ("coat-act", 2, 1, 1)
    assert script.mode_key("bf16", 1, 2) == "bf16@data2" and script.data_seed(3, 2) == 1003

    noise = [0.002, -0.004, 0.005]  # per-seed BF16-vs-BF16 gaps: rms 0.39%, so a 3-seed mean's se is 0.22%
    rms = math.sqrt((0.002**2 + 0.004**2 + 0.005**2) / 3)

    close = [0.0015, 0.0025, 0.002]  # mean +0.20%: under 0.25% and within 2 x 0.22% of zero
    v = script.verdict(close, noise, "bf16@data2")
    assert v["met"] is True and v["gap_coat"] == pytest.approx(0.002) and v["gap_noise"] == pytest.approx(0.001)
    assert v["noise_rms"] == pytest.approx(rms) and v["allowed_gap"] == pytest.approx(2 * rms / math.sqrt(3))

    # the sign of a BF16-vs-BF16 gap is arbitrary: flipping it changes nothing
    flipped = script.verdict(close, [-g for g in noise], "bf16@data2")
    assert flipped["met"] is True and flipped["allowed_gap"] == pytest.approx(v["allowed_gap"])

    above = [0.0025, 0.0035, 0.003]  # mean +0.30%: above the goal though within the noise
    v = script.verdict(above, noise)
    assert v["met"] is False and v["note"] == "mean gap above 0.25%" and abs(v["gap_coat"]) <= v["allowed_gap"]

    quiet_noise = [0.0001, -0.0001, 0.0]  # rms 0.008%: COAT's +0.20% is far outside two standard errors of it
    tight = [0.0019, 0.0021, 0.002]
    v = script.verdict(tight, quiet_noise)
    assert v["met"] is False and v["note"] == "further from zero than two standard errors of the noise floor"
    better = script.verdict([-0.003, -0.002, -0.004], quiet_noise)  # far better than BF16 is also far from the noise
    assert better["met"] is False

    assert script.verdict(close, None)["met"] is None and "add bf16@data2" in script.verdict(close, None)["note"]
    assert script.verdict([0.001], [0.0])["met"] is None  # one seed: no standard error
    line = script.verdict_line(script.verdict(close, noise, "bf16@data2"))
    assert (
        "COAT +0.200% (its own se " in line and "noise floor bf16@data2: per-seed gaps rms 0.387%, mean +0.100%" in line
    )
    assert line.endswith("**met**.") and "The signed reading" in line


def test_paired_verdict_bounds_the_mean_gap_and_its_upper_two_standard_errors():
    acc = load_script()
    met = acc.paired_verdict("coat", [0.001, 0.002, 0.0015, 0.0025], "gpt-125m")
    assert met["met"] and met["gap_mean"] == pytest.approx(0.00175) and met["upper"] < 0.005
    scattered = acc.paired_verdict("coat", [-0.004, 0.006, -0.003, 0.007], "gpt-125m")  # mean 0.15%, wide scatter
    assert scattered["met"] is False and "mean + 2 se" in scattered["note"] and "mean gap" not in scattered["note"]
    high = acc.paired_verdict("te-fp8-delayed", [0.003, 0.0031, 0.0029, 0.003], "gpt-125m")
    assert high["met"] is False and high["note"].startswith("mean gap +0.300% above 0.25%")
    assert acc.paired_verdict("coat", [0.001], "gpt-125m")["met"] is None  # one seed: no standard error
    assert acc.paired_verdict("coat", [0.004], "llama2-7b")["met"]  # one long run, judged on its gap: <= 0.5%
    assert acc.paired_verdict("coat", [0.003], "gpt-1b")["met"] is False  # <= 0.25%
    assert "**NOT met**" in acc.paired_verdict_line(high)
