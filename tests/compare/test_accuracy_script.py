"""benchmarks/accuracy.py, run as a user runs it: BF16 vs COAT validation loss over seeds with the
noise floors and the ablations, on the tiny preset; its verdict rules on the rows of made-up runs;
and its refusal of malformed mode keys."""

import json
import math
import os
import shutil
import statistics
import subprocess
import sys

import pytest

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


LONGER = ["--steps", "14"]  # tiny warms up for 10 steps: 4 more for a learning-rate schedule to act on


@pytest.fixture(scope="session")  # xdist may run other modules between its group's tests
def bf16_and_coat(tmp_path_factory):
    """bf16 and coat, 14 steps, the constant schedule: the one run both tests below start from
    (each copies it into its own --out, where accuracy.py finds it done)."""
    out = tmp_path_factory.mktemp("accuracy")
    proc = accuracy(out, "--modes", "bf16,coat", *LONGER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.xdist_group("bf16_and_coat")
def test_a_repeated_run_is_its_own_column_and_on_a_cpu_repeats_the_first_bit_for_bit(bf16_and_coat, tmp_path):
    """bf16@run2: the same seed, batches and code again (coat-compare --repeat 2, a label in its
    row): on a GPU a noise floor of nondeterministic reductions; on a CPU nothing differs. bf16 and
    coat come done from the shared run; bf16@run2 trains here."""
    shutil.copytree(bf16_and_coat, tmp_path, dirs_exist_ok=True)
    done = tmp_path / "seed1" / "tiny-bf16+coat.jsonl"
    mtime = os.path.getmtime(done)
    proc = accuracy(tmp_path, "--modes", "bf16,coat,bf16@run2", *LONGER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.getmtime(done) == mtime  # not run again
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
        report,
        "--modes",
        "bf16,coat,bf16@run2",
        *LONGER,
        "--rows",
        str(tmp_path),
        "--rows",
        str(tmp_path / "earlier"),
    )
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert not (report / "seed1").exists()  # nothing ran
    assert [json.loads(line) for line in (report / "accuracy.jsonl").read_text().splitlines()] == summary
    assert f"--rows {tmp_path} --rows {tmp_path / 'earlier'}`" in (report / "accuracy.md").read_text()


@pytest.mark.xdist_group("bf16_and_coat")
def test_runs_of_another_learning_rate_schedule_are_neither_used_nor_counted_as_done(bf16_and_coat, tmp_path):
    """--lr-decay reaches every run, and the rows in --out of the other schedule do not stand in for
    its runs: a cosine report trains its own, beside the constant ones (the shared run's, 14 steps:
    tiny warms up for 10)."""
    longer = LONGER
    shutil.copytree(bf16_and_coat, tmp_path, dirs_exist_ok=True)
    constant = accuracy(tmp_path, "--modes", "bf16,coat", *longer)  # the constant runs: done
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


def made_up_runs(directory, preset, steps, adam_eps, valid_by_seed):
    """Rows as coat-compare writes them for finished runs, with the given final validation loss per
    seed and mode key (``MODE`` or ``MODE@data2``), in ``directory``/seedN/: what accuracy.py reads."""
    for seed, valid in valid_by_seed.items():
        (directory / f"seed{seed}").mkdir(parents=True)
        with open(directory / f"seed{seed}" / "made-up.jsonl", "w") as f:
            for key, loss in valid.items():
                mode, _, order = key.partition("@data")
                row = {
                    "kind": "train",
                    "status": "ok",
                    "mode": mode,
                    "seed": seed,
                    "data_seed": seed + 1000 * (int(order or 1) - 1),
                    "dp": 1,
                    "adam_eps": adam_eps,
                    "losses": [3.0] * (steps - 1) + [loss],
                    "valid_loss": loss,
                    "valid_losses": [[steps, loss]],
                    "device": "made-up GPU",
                    "corpus": "made-up",
                    "corpus_files": 1,
                    "corpus_train_bytes": 10**6,
                    "corpus_train_sha256": "a" * 64,
                    "corpus_valid_bytes": 10**4,
                    "corpus_valid_sha256": "b" * 64,
                    "valid_windows_sha256": "c" * 64,
                    "eval_windows": 8,
                    "eval_every": steps,
                    "seq": 64,
                    "steps": steps,
                    "micro_batch": 4,
                    "global_batch": 16,
                }
                f.write(json.dumps(row) + "\n")


def gaps_to_losses(gaps: dict[str, list[float]]) -> dict[int, dict[str, float]]:
    """BF16 ends at 1.0 in every seed; each other key at 1 + its gap."""
    seeds = range(1, len(next(iter(gaps.values()))) + 1)
    return {s: {"bf16": 1.0, **{k: 1.0 + g[s - 1] for k, g in gaps.items()}} for s in seeds}


def verdicts(out) -> dict[str, dict]:
    rows = [json.loads(line) for line in (out / "accuracy.jsonl").read_text().splitlines()]
    return {r.get("mode", r["kind"]): r for r in rows if r["kind"] in ("verdict", "paired_verdict")}


def test_the_verdict_rules_on_made_up_gaps(tmp_path):
    """gpt-125m's rule (mean gap <= 0.25% and mean + 2 standard errors <= 0.5%) on four seeds: a mode
    close to BF16 meets it, a scattered one misses the second bound only, a steady one above 0.25%
    the first; the noise-floor reading takes bf16@data2's per-seed gaps, whatever their sign."""
    gaps = {
        "coat": [0.001, 0.002, 0.0015, 0.0025],  # mean 0.175%, se 0.048%
        "coat-act": [-0.004, 0.006, -0.003, 0.007],  # mean 0.15%, se 0.29%: mean + 2 se 0.73%
        "te-fp8-delayed": [0.003, 0.0031, 0.0029, 0.003],  # mean 0.30%
        "bf16@data2": [0.002, -0.004, 0.005, -0.001],  # rms 0.339%
    }
    made_up_runs(tmp_path / "runs", "gpt-125m", 4, 1e-8, gaps_to_losses(gaps))
    proc = accuracy(
        tmp_path / "report", "--preset", "gpt-125m", "--steps", "4", "--seeds", "1,2,3,4", "--max-runs", "0",
        "--modes", "bf16,coat,coat-act,te-fp8-delayed,bf16@data2", "--rows", str(tmp_path / "runs"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    v = verdicts(tmp_path / "report")
    assert set(v) == {"verdict", "coat", "coat-act", "te-fp8-delayed"}  # the noise floor is not judged

    assert v["coat"]["met"] is True and v["coat"]["gap_mean"] == pytest.approx(0.00175)
    assert v["coat"]["upper"] == pytest.approx(0.00175 + 2 * statistics.stdev(gaps["coat"]) / 2)
    assert v["coat-act"]["met"] is False and v["coat-act"]["note"].startswith("mean + 2 se +0.73")
    assert v["te-fp8-delayed"]["met"] is False and v["te-fp8-delayed"]["note"].startswith(
        "mean gap +0.300% above 0.25%"
    )

    noise = v["verdict"]
    rms = math.sqrt(sum(g * g for g in gaps["bf16@data2"]) / 4)
    assert noise["noise_floor"] == "bf16@data2" and noise["noise_rms"] == pytest.approx(rms)
    assert noise["allowed_gap"] == pytest.approx(2 * rms / 2) and noise["met"] is True  # |0.175%| <= 0.339%
    md = (tmp_path / "report" / "accuracy.md").read_text()
    assert "- coat vs BF16 over 4 seed(s), rule mean gap <= 0.25% and mean + 2 se <= 0.50%: +0.175%" in md
    assert "| 2 | 1.0000 | 1.0020 | 1.0060 | 1.0031 | 0.9960 | +0.20% | +0.60% | +0.31% | -0.40% |" in md

    # the sign of a BF16-vs-BF16 gap is arbitrary: the floor flipped reads the same
    flipped = {**gaps, "bf16@data2": [-g for g in gaps["bf16@data2"]]}
    made_up_runs(tmp_path / "flipped", "gpt-125m", 4, 1e-8, gaps_to_losses(flipped))
    proc = accuracy(
        tmp_path / "report2", "--preset", "gpt-125m", "--steps", "4", "--seeds", "1,2,3,4", "--max-runs", "0",
        "--modes", "bf16,coat,bf16@data2", "--rows", str(tmp_path / "flipped"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert verdicts(tmp_path / "report2")["verdict"]["allowed_gap"] == pytest.approx(noise["allowed_gap"])


def test_one_long_run_is_judged_on_its_gap_alone(tmp_path):
    """llama2-7b's rule: one seed, final gap <= 0.5% (no standard error needed)."""
    made_up_runs(tmp_path / "runs", "llama2-7b", 3, 1e-5, gaps_to_losses({"coat": [0.004], "te-fp8-current": [0.006]}))
    proc = accuracy(
        tmp_path / "report", "--preset", "llama2-7b", "--steps", "3", "--seeds", "1", "--max-runs", "0",
        "--modes", "bf16,coat,te-fp8-current", "--rows", str(tmp_path / "runs"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    v = verdicts(tmp_path / "report")
    assert v["coat"]["met"] is True and v["coat"]["upper_bound"] is None
    assert v["te-fp8-current"]["met"] is False and "above 0.50%" in v["te-fp8-current"]["note"]
    assert v["verdict"]["met"] is None  # no noise floor among the modes


@pytest.mark.parametrize(
    "modes,message",
    [
        ("coat,bf16", "start with bf16"),
        ("bf16,coat,bf16@data0", "is not MODE, MODE@dpN, MODE@dataN or MODE@runN"),
        ("bf16,coat,bf16@run0", "is not MODE, MODE@dpN, MODE@dataN or MODE@runN"),
        ("bf16,coat,bf16@twice", "is not MODE, MODE@dpN, MODE@dataN or MODE@runN"),
    ],
)
def test_malformed_modes_are_refused_before_any_run(tmp_path, modes, message):
    proc = accuracy(tmp_path, "--modes", modes)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # nothing ran or was written
