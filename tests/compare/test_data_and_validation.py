"""coat-compare's data on a CPU: validation loss rows (the same held-out windows for every mode),
validation that leaves the training untouched, the corpus recorded by SHA-256, the packages corpus
at a small budget, and the refusals that name their fix."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from coat_compare import cli, probe, run
from coat_compare.corpus import load_corpus, training_windows
from coat_compare.presets import get_preset
from coat_compare.report import read_jsonl


def coat_compare(out, *args, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "coat_compare",
            "--preset",
            "tiny",
            "--steps",
            "6",
            "--out",
            str(out),
            "--no-plots",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["mode"]: r for r in read_jsonl(out / "tiny.jsonl") if r["kind"] == "train"}


@pytest.fixture(scope="session")  # xdist may run other modules between its group's tests
def validated(tmp_path_factory):
    return coat_compare(tmp_path_factory.mktemp("validated"), "--modes", "bf16,coat", "--eval-every", "3")


def test_every_mode_is_validated_on_the_same_held_out_windows(validated):
    bf16, coat = validated["bf16"], validated["coat"]
    for r in (bf16, coat):
        assert r["status"] == "ok" and r["data_seed"] == r["seed"] == 1234
        assert [step for step, _ in r["valid_losses"]] == [3, 6]  # every 3 steps and after the last
        assert r["valid_loss"] == r["valid_losses"][-1][1] and all(math.isfinite(v) for _, v in r["valid_losses"])
        assert r["valid_losses"][1][1] < r["valid_losses"][0][1] < 5.6  # it learns, from ln 256 = 5.55
        assert r["corpus"] == "docstrings" and r["eval_windows"] == 64
    for field in ("valid_windows_sha256", "corpus_train_sha256", "corpus_valid_sha256"):
        assert bf16[field] == coat[field]
    docstrings = load_corpus("docstrings")
    assert bf16["corpus_train_sha256"] == docstrings.manifest["train"]["sha256"]
    # same weights, same batches, same windows: COAT's validation loss tracks BF16's closely
    assert coat["valid_loss"] == pytest.approx(bf16["valid_loss"], rel=0.01)


def test_validation_leaves_the_training_untouched_and_the_report_shows_it(validated, tmp_path):
    plain = coat_compare(tmp_path, "--modes", "coat", "--eval-every", "0")["coat"]
    assert plain["losses"] == validated["coat"]["losses"]  # forward-only passes change nothing the steps read
    assert plain["valid_losses"] == [] and plain["valid_loss"] is None and plain["valid_windows_sha256"] is None
    md = (tmp_path / "tiny.md").read_text()
    assert "| loss first -> last | valid loss |" in md and "Data: the docstrings corpus (" in md


def test_the_packages_corpus_and_another_data_order(tmp_path):
    cache = tmp_path / "corpus"
    rows = coat_compare(
        tmp_path,
        "--modes",
        "bf16",
        "--corpus",
        "packages",
        "--corpus-bytes",
        "3000000",
        "--data-seed",
        "99",
        "--eval-every",
        "6",
        "--eval-windows",
        "16",
        env={"COAT_CORPUS_DIR": str(cache)},
    )
    row = rows["bf16"]
    built = load_corpus("packages", 3_000_000, cache_dir=str(cache))
    assert row["status"] == "ok" and row["seed"] == 1234 and row["data_seed"] == 99
    assert row["corpus"] == "packages" and row["corpus_train_sha256"] == built.manifest["train"]["sha256"]
    assert row["corpus_train_bytes"] + row["corpus_valid_bytes"] >= 3_000_000
    # a few MB hold few validation files (2% of the files): 16 windows here, 256 of 100 MiB in the accuracy runs
    assert [step for step, _ in row["valid_losses"]] == [6] and row["valid_loss"] < 5.6 and row["eval_windows"] == 16
    assert len(os.listdir(cache)) == 1  # built once, then read


def test_a_run_longer_than_its_corpus_is_refused_with_the_fix():
    preset = get_preset("tiny")
    data = training_windows(preset, 1)  # the tiny run fits the docstrings many times over
    with pytest.raises(
        ValueError, match=rf"use --steps {len(data)} or fewer, or a bigger corpus \(--corpus packages, --corpus-bytes\)"
    ):
        training_windows(preset.with_overrides(steps=len(data) + 1), 1)


def test_a_preset_with_a_data_pool_trains_the_same_windows_for_every_data_seed():
    preset = get_preset("tiny").with_overrides(data_pool=8 * 40, steps=40)  # one pass over the pool
    a, b = training_windows(preset, 1), training_windows(preset, 2)
    assert len(a) == len(b) == 40 and a.pool == 8 * 40
    assert not torch.equal(a.order, b.order) and torch.equal(a.order.sort().values, b.order.sort().values)
    assert not torch.equal(training_windows(get_preset("tiny"), 2).order[:320].sort().values, a.order.sort().values)
    with pytest.raises(ValueError, match=r"use --steps 40 or fewer, or a preset whose data_pool \(here 320 windows\)"):
        training_windows(preset.with_overrides(steps=41), 1)


def test_graphed_runs_validate_only_when_asked():
    # (a graphed run is a speed run: the preset's default validation is left out, an asked-for one runs)
    cli.check_args(cli.parse_args(["--preset", "tiny", "--cuda-graphs", "none,local", "--eval-every", "5"]))
    preset = get_preset("tiny")
    assert run.preset_for(preset, "none").eval_every == 20 and run.preset_for(preset, "local").eval_every == 0
    assert run.preset_for(preset, "local", eval_asked=True).eval_every == 20


def _validation_loss_both_ways(mode_name: str) -> tuple[float, float, bool]:
    """The validation loss of a freshly built tiny GPT under no_grad (eager runs) and under
    inference mode (graphed runs), and whether training afterwards still works."""
    from coat_compare import parallel
    from coat_compare.build import build_gpt
    from coat_compare.corpus import validation_set
    from coat_compare.modes import MODES
    from coat_compare.train import train_step, validation_loss

    parallel.seed_everything(1234)
    preset = get_preset("tiny")
    model, optimizer = build_gpt(preset, MODES[mode_name], 1234, 1)
    batches, _ = validation_set(preset, load_corpus(preset.corpus, preset.corpus_max_bytes))
    first = [{k: v[: preset.micro_batch] for k, v in b.items()} for b in batches]
    eager = validation_loss(model, first, preset, "none")
    graphed = validation_loss(model, first, preset, "local")  # in inference mode: no graph is involved
    loss, ok = train_step(model, optimizer, first[:1], preset, None)  # the weight caches still serve training
    return eager, graphed, ok and math.isfinite(loss)


@pytest.mark.parametrize("mode", ["bf16", "coat", "coat-codes"])
def test_validation_beside_graphs_runs_in_inference_mode_with_the_same_loss(mode):
    from distributed import run_distributed

    eager, graphed, trains = run_distributed(_validation_loss_both_ways, 1, args=(mode,), tensor_parallel=1)[0]
    assert eager == graphed and math.isfinite(eager) and trains


def test_data_args_are_passed_on_to_fresh_processes():
    args = cli.parse_args(["--data-seed", "7", "--corpus", "packages", "--eval-every", "5"])
    assert probe.data_args(args) == [
        "--data-seed",
        "7",
        "--corpus",
        "packages",
        "--eval-every",
        "5",
    ]  # passed on to fresh processes
    json.dumps(probe.data_args(args))


def _collections_while_training(interval: int) -> tuple[int, bool, str]:
    import gc

    from coat_compare import parallel
    from coat_compare.modes import MODES
    from coat_compare.train import train

    parallel.seed_everything(1234)
    parallel.GC_INTERVAL = interval
    calls = []
    real = gc.collect
    gc.collect = lambda *a: calls.append(1) or real(*a)
    try:
        row = train(get_preset("tiny").with_overrides(steps=10, eval_every=0), MODES["coat"], 1234)
    finally:
        gc.collect = real
    return len(calls), gc.isenabled(), row["gc"]


def test_training_collects_garbage_every_interval_and_nowhere_else():
    from distributed import run_distributed

    count, enabled_after, mode = run_distributed(_collections_while_training, 1, args=(3,), tensor_parallel=1)[0]
    assert count == 1 + 3  # once before the first step, then before steps 3, 6 and 9 (of 0..9)
    assert enabled_after and mode == "manual"
