"""coat-compare on two and four processes (gloo, CPU), as on GPUs: the job, started plainly, runs
each mode under a ``torchrun --nproc-per-node N`` of its own.

TP = 2 with sequence parallel: the all-gather bytes per step, exactly. Take U = the bytes of one
rank's BF16 slice of the hidden states, (seq / TP) x micro-batch x hidden x 2. Per step each rank
sends, over the TP group, in a GPT of L layers:

==================================================  ============  ============
all-gather                                          BF16          COAT
==================================================  ============  ============
inputs of linear_qkv and linear_fc1 (forward)       2L x U        2L x U/2 (FP8)
the same, gathered again for the weight gradient    2L x U        2L x U/2 (FP8)
output gradients of linear_proj and linear_fc2      2L x U        2L x U/2 (FP8)
output layer input (forward, and again for wgrad)   2 x U         2 x U
embedding output gradient (scatter's backward)      1 x U         1 x U
==================================================  ============  ============

so BF16 = (6L + 3) U and COAT = (3L + 3) U, of which 3L U are FP8: every gather inside the
transformer layers moves exactly half of BF16's bytes, plus one FP32 scale per rank with each of
the forward gathers and output-gradient gathers, in a 16-byte row behind the codes of the same
uint8 message, so counted with the FP8 bytes (cuBLASLt takes a scale only at a 16-byte aligned
address): S = 4 x 16 bytes per layer and micro-batch (each rank's chunk keeps its own scale, and
the gathers again for the weight gradient reuse the forward's). One layer (the per-layer preset)
is the first three rows with L = 1 (its input is already a slice): BF16 6U, COAT 3U + 64 bytes.

DP = 2 with the distributed optimizer at the same global batch as DP = 1: each rank holds half
of the optimizer bytes, and the losses are DP = 1's up to reduction order (see DP_LOSS_TOL).
The checkpoint-resume checks: a DP = 2 checkpoint resumes at DP = 2 bit for bit and at DP = 1
within the same tolerance (one run over several commands); a TP 2 x DP 2 one at DP 4 and on one
process (the resume sub-command, with its report).
"""

import math
import os
import subprocess
import sys

import pytest

from coat_compare import report
from coat_compare.job import main as coat_compare
from coat_compare.job import summarize
from coat_compare.report import read_jsonl

SEQ, MICRO_BATCH, HIDDEN, LAYERS = 64, 8, 64, 2  # the tiny presets
U = (SEQ // 2) * MICRO_BATCH * HIDDEN * 2  # one rank's BF16 slice at TP 2: 32768 bytes
# the FP32 scales one rank sends per layer and micro-batch, each in a 16-byte row: with the codes of the
# forward gathers of linear_qkv and linear_fc1, their gathers again for wgrad and the dY gathers of
# linear_proj and linear_fc2
S = 6 * 16
# A different DP size changes the order of reductions (and for COAT, which micro-batch sets each
# per-tensor FP8 scale: a rank's own at DP 2, the whole batch's at DP 1), never the math: the first
# loss agrees to 1e-4 and later ones drift apart over the 8 steps here (measured 2026-11-29: BF16 9.6e-5,
# COAT 2.3e-4; 1.4e-3 over 6 steps with earlier code), against a loss that falls by ~0.1 per step.
# 5e-3 stays well below that fall while leaving room for the drift.
DP_LOSS_TOL = 5e-3


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def run(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m coat_compare ARGS --no-plots`` as a user runs it (the job starts its own torchrun
    for each run of several processes); it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", "coat_compare", *args, "--no-plots"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def rows(path, kind="train") -> dict:
    return {r["mode"]: r for r in read_jsonl(path) if r["kind"] == kind}


def test_tp2_sequence_parallel_gathers_linear_inputs_in_fp8_at_half_the_bytes(tmp_path):
    proc = run("--preset", "tiny", "--modes", "bf16,coat", "--steps", "4", "--tp", "2", "--out", str(tmp_path))
    assert proc.stdout.count("# coat-compare: tiny") == 1  # rank 0 alone reports
    by = rows(tmp_path / "tiny.jsonl")
    bf16, coat = by["bf16"], by["coat"]
    assert bf16["status"] == coat["status"] == "ok"
    assert (bf16["tp"], bf16["dp"]) == (2, 1)
    L = LAYERS
    assert bf16["all_gather_bytes"] == {"tp_wide": (6 * L + 3) * U}  # 491520 bytes per step
    # the scales packed behind their codes: 16 bytes each, in the FP8 message
    assert coat["all_gather_bytes"] == {"tp_fp8": 3 * L * U + L * S, "tp_wide": 3 * U}  # 196608 + 192, 98304
    assert (
        coat["sp_all_gather_bytes"] == (3 * L + 3) * U + L * S and coat["sp_all_gather_fp8_bytes"] == 3 * L * U + L * S
    )
    # the gathers COAT does in FP8 cost BF16 twice their codes' bytes (the scales aside)
    codes = coat["sp_all_gather_fp8_bytes"] - L * S
    assert bf16["sp_all_gather_bytes"] - (coat["sp_all_gather_bytes"] - L * S) == codes
    for r in (bf16, coat):
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
        assert len(r["peak_MiB_per_rank"]) == len(r["optimizer_MiB_per_rank"]) == 2
        assert r["peak_MiB"] == max(r["peak_MiB_per_rank"])
        assert all(math.isfinite(x) for x in r["losses"]) and len(r["losses"]) == 4
    assert abs(bf16["losses"][0] - coat["losses"][0]) < 0.01  # same weights, same batch
    md = (tmp_path / "tiny.md").read_text()
    assert "## End to end: tiny at TP 2 x PP 1 x DP 1" in md and "SP all-gather MiB/step (FP8)" in md
    assert "| 0.28 (0.19) | 0.60 |" in md  # COAT: 295104 bytes, 196800 FP8; 0.60 of BF16's


def test_tp2_one_layer_gathers(tmp_path):
    run("--preset", "tiny-layer", "--modes", "bf16,coat", "--tp", "2", "--out", str(tmp_path))
    by = rows(tmp_path / "tiny-layer.jsonl", "layer")
    assert by["bf16"]["all_gather_bytes"] == {"tp_wide": 6 * U}
    assert by["coat"]["all_gather_bytes"] == {"tp_fp8": 3 * U + S}
    assert by["coat"]["activation_MiB"] < by["bf16"]["activation_MiB"]
    assert "SP all-gather MiB (FP8)" in (tmp_path / "tiny-layer.md").read_text()
    for r in by.values():  # a CPU's TFLOP/s say nothing of a GPU's: none, printed "-"
        assert r["model_tflops_per_gpu"] is None and r["mfu_bf16"] is None
    heads = f"| {report.TFLOPS_HEAD} | {report.MFU_HEAD} | activation MiB |"  # Megatron's count (full attention's)
    assert heads in (tmp_path / "tiny-layer.md").read_text()


DP_STEPS = 8
# validation every 2 steps on 16 windows: the losses the run over two commands must give again
EVAL = ["--eval-every", "2", "--eval-windows", "16"]


@pytest.fixture(scope="session")
def dp_runs(tmp_path_factory):
    """The tiny preset at DP 2 (micro-batch 4) and at DP 1 (micro-batch 8), the same global batch,
    BF16 and COAT: one pair of jobs shared by the DP 2 test, the TP 2 x DP 2 test (one process's
    optimizer bytes) and the run over two commands (the DP 2 COAT run is the uninterrupted one).
    (Megatron's overlap flags training the same losses: tests/patches/test_launch.py, through
    Megatron's own loop, bit for bit with 8 buckets against 1.)
    Session-scoped: xdist runs the group's tests on one worker, but other modules' tests may come
    between them there, and a module-scoped fixture would then run its two jobs again."""
    out = tmp_path_factory.mktemp("dp")
    common = ["--preset", "tiny", "--modes", "bf16,coat", "--steps", str(DP_STEPS), *EVAL, "--out", str(out)]
    run(*common, "--dp", "2", "--micro-batch", "4", "--name", "dp2")
    run(*common, "--micro-batch", "8", "--name", "dp1")
    return out


@pytest.mark.xdist_group("dp_runs")
def test_dp2_halves_optimizer_bytes_per_rank_and_matches_dp1_at_the_same_global_batch(dp_runs, tmp_path, capsys):
    for name in ("dp2", "dp1"):  # summarize reads every report in its folder: these two alone
        for suffix in (".jsonl", ".md"):
            (tmp_path / f"{name}{suffix}").write_text((dp_runs / f"{name}{suffix}").read_text())
    two, one = rows(tmp_path / "dp2.jsonl"), rows(tmp_path / "dp1.jsonl")
    for mode in ("bf16", "coat"):
        a, b = two[mode], one[mode]
        assert a["status"] == b["status"] == "ok"
        # each rank holds its half of the main params and states (buckets padded to DP x 128 elements)
        for per_rank in a["optimizer_MiB_per_rank"]:
            assert per_rank / b["optimizer_MiB"] == pytest.approx(0.5, abs=0.005), (
                mode,
                a["optimizer_MiB_per_rank"],
                b["optimizer_MiB"],
            )
        assert a["optimizer_bytes_per_param"] == pytest.approx(b["optimizer_bytes_per_param"], rel=0.01)
        assert a["losses"] == pytest.approx(b["losses"], abs=DP_LOSS_TOL), mode
        assert a["sp_all_gather_bytes"] == 0 and a["dp_all_gather_bytes"] > 0  # the parameter gather
        assert b["all_gather_bytes"] == {}
    assert two["bf16"]["losses"][0] == one["bf16"]["losses"][0]  # before any update, BF16 agrees exactly
    assert summarize(str(tmp_path)) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "## The same global batch at DP n and at DP 1" in summary
    diff = max(abs(x - y) for x, y in zip(two["coat"]["losses"], one["coat"]["losses"]))
    assert f"| tiny | coat | 1 | 8 x 64 | 2 x 4 | {diff:.1e} (step " in summary


@pytest.mark.xdist_group("dp_runs")
def test_tp2_by_dp2_accumulates_micro_batches_on_four_processes(dp_runs, tmp_path):
    """Four ranks, TP 2 x DP 2, global batch 8 at micro-batch 2: each rank accumulates 2
    micro-batches per step (Megatron's schedule), then the distributed optimizer reduces and steps
    its quarter. Against one process at the same global batch (dp_runs' DP 1 run, one micro-batch
    of 8: the optimizer bytes do not depend on the micro-batch; one process accumulating 4
    micro-batches is test_job's test_global_batch_accumulates_micro_batches_like_one_large_one):
    each rank holds a quarter of the optimizer bytes. TP 2 draws other initial weights than TP 1
    (Megatron's per-partition init), so the losses are compared between the modes of the 4-rank
    run, which share them."""
    args = ["--preset", "tiny", "--modes", "bf16,coat", "--steps", "6", "--micro-batch", "2", "--global-batch", "8"]
    run(*args, "--tp", "2", "--dp", "2", "--out", str(tmp_path), "--name", "tp2dp2")
    four, one = rows(tmp_path / "tp2dp2.jsonl"), rows(dp_runs / "dp1.jsonl")
    u = (SEQ // 2) * 2 * HIDDEN * 2  # one rank's BF16 slice of a micro-batch of 2
    for mode in ("bf16", "coat"):
        a, b = four[mode], one[mode]
        assert a["status"] == b["status"] == "ok"
        assert (a["tp"], a["dp"], a["global_batch"], a["micro_batches"], b["global_batch"]) == (2, 2, 8, 2, 8)
        assert len(a["optimizer_MiB_per_rank"]) == len(a["peak_MiB_per_rank"]) == 4
        for per_rank in a["optimizer_MiB_per_rank"]:  # half the parameters (TP), half of their shard (DP)
            assert per_rank / b["optimizer_MiB"] == pytest.approx(0.25, abs=0.01), (mode, per_rank, b["optimizer_MiB"])
        assert a["dp_all_gather_bytes"] > 0 and a["tokens_per_s_per_gpu"] == pytest.approx(a["tokens_per_s"] / 4)
        assert all(math.isfinite(x) for x in a["losses"]) and a["losses"][-1] < a["losses"][0] - 0.2
    # the sequence-parallel gathers of both micro-batches, COAT's inside the layers in FP8
    assert four["bf16"]["sp_all_gather_bytes"] == 2 * (6 * LAYERS + 3) * u
    assert four["coat"]["sp_all_gather_bytes"] == 2 * (3 * LAYERS + 3) * u + 2 * LAYERS * S
    assert four["coat"]["sp_all_gather_fp8_bytes"] == 2 * 3 * LAYERS * u + 2 * LAYERS * S
    # the default recipe tracks BF16 from the same TP 2 weights (measured: within 1e-3 per step)
    assert four["coat"]["losses"] == pytest.approx(four["bf16"]["losses"], abs=DP_LOSS_TOL)
    assert four["coat"]["optimizer_bytes_per_param"] < 0.4 * four["bf16"]["optimizer_bytes_per_param"]


@pytest.mark.xdist_group("dp_runs")
def test_one_run_over_two_commands_stops_at_its_save_and_resumes_where_it_stopped(dp_runs, tmp_path):
    """--stop-after-save ends a DP 2 run at its checkpoint; a second command --load's it and trains
    the rest of --steps on the same schedule and batches: together, the uninterrupted run's losses
    and validation losses bit for bit (the same layout: dp_runs' DP 2 COAT run, the same arguments).
    A third --load's it at DP 1 (micro-batch 8: the same global batch), through the checkpoint's
    dp_reshardable format: the uninterrupted run's losses within DP_LOSS_TOL (another reduction
    order), and its checkpoint files untouched."""
    tiny = ["--preset", "tiny", "--modes", "coat", "--steps", str(DP_STEPS), *EVAL]
    common = [*tiny, "--dp", "2", "--micro-batch", "4"]
    ckpt = str(tmp_path / "ckpt")
    run(*common, "--save", ckpt, "--save-step", "4", "--stop-after-save", "--out", str(tmp_path), "--name", "first")
    run(*common, "--load", ckpt, "--out", str(tmp_path), "--name", "second")
    run(*tiny, "--micro-batch", "8", "--load", ckpt, "--out", str(tmp_path), "--name", "second-dp1")  # DP 1
    whole = rows(dp_runs / "dp2.jsonl")["coat"]
    first, second, dp1 = (rows(tmp_path / f"{n}.jsonl")["coat"] for n in ("first", "second", "second-dp1"))
    assert whole["status"] == first["status"] == second["status"] == "ok"
    assert (first["first_step"], first["last_step"], second["first_step"], second["last_step"]) == (0, 4, 4, 8)
    assert len(whole["losses"]) == 8 and first["losses"] + second["losses"] == whole["losses"]
    assert [s for s, _ in first["valid_losses"]] == [2, 4] and [s for s, _ in second["valid_losses"]] == [6, 8]
    assert first["valid_losses"] + second["valid_losses"] == whole["valid_losses"]
    assert second["valid_loss"] == whole["valid_loss"]
    assert dp1["status"] == "ok" and (dp1["dp"], dp1["first_step"], dp1["last_step"]) == (1, 4, 8)
    assert dp1["losses"] == pytest.approx(whole["losses"][4:], abs=DP_LOSS_TOL)


def test_checkpoint_at_tp2_by_dp2_resumes_at_dp4_and_at_one_process(tmp_path):
    """A TP change reshards through Megatron's fully_reshardable format (FP32 Adam states: COAT's
    are dequantized on save and requantized on load, so the resumed losses move within that
    rounding and the reduction order's)."""
    run(
        "resume", "--preset", "tiny", "--modes", "coat", "--steps", "6", "--save-step", "3", "--tp", "2", "--dp", "2",
        "--micro-batch", "2", "--global-batch", "8", "--resume-at", "dp4,1",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path), timeout=900,
    )  # fmt: skip
    (r,) = rows(tmp_path / "tiny-resume.jsonl", "resume").values()
    assert r["status"] == "ok", r
    assert r["resumed"] == ["resumed_dp4", "resumed_1", "resumed_tp2xdp2"]
    assert r["checkpoint_format"] == "fully_reshardable" and r["saved_at"] == "tp2xdp2"
    after = r["losses_uninterrupted"][3:]
    for name in r["resumed"]:
        assert r[f"losses_{name}"] == pytest.approx(after, abs=DP_LOSS_TOL), name
    assert not any((tmp_path / "ckpt").iterdir())  # the checkpoint is gone with its temporary directory
    md = (tmp_path / "tiny-resume.md").read_text()
    assert "## Checkpoint resume: tiny at TP 2 x PP 1 x DP 2" in md
    assert "| resumed at dp4 | difference | resumed at 1 | difference | resumed at tp2xdp2 | difference |" in md


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "tiny-layer", "--dp", "2"], "has no data-parallel communication"),
        (["--preset", "tiny", "--tp", "3"], "use --tp 1, 2, 4"),
        (["--preset", "tiny", "--tp", "2", "--seq", "63"], "use --seq 62"),
        (["resume", "--preset", "tiny"], "give --dp 2 (or more)"),
        (["--preset", "tiny-layer", "--modes", "coat", "--load", "x"], "checkpoints need an end-to-end preset"),
    ],
)
def test_layouts_the_job_cannot_run_name_the_fix(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        coat_compare([*args, "--no-plots"])
    assert message in str(e.value) + capsys.readouterr().err


def test_pp2_trains_the_one_process_losses_and_reports_memory_per_stage(tmp_path):
    """PP 2 (the 1F1B schedule, 4 micro-batches per step) against one process at the same global
    batch: the stages hand each other the BF16 hidden states a layer hands the next in one process,
    so the losses agree (measured: bit for bit on gloo)."""
    args = ["--preset", "tiny", "--modes", "coat", "--steps", "4", "--micro-batch", "2", "--global-batch", "8"]
    run(*args, "--pp", "2", "--out", str(tmp_path), "--name", "pp2")
    run(*args, "--out", str(tmp_path), "--name", "one")
    two, one = rows(tmp_path / "pp2.jsonl"), rows(tmp_path / "one.jsonl")
    for mode in ("coat",):
        a, b = two[mode], one[mode]
        assert a["status"] == b["status"] == "ok"
        assert (a["pp"], a["tp"], a["dp"], a["micro_batches"]) == (2, 1, 1, 4)
        assert len(a["peak_MiB_per_stage"]) == 2 and a["peak_MiB"] == max(a["peak_MiB_per_stage"])
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6), mode
    md = (tmp_path / "pp2.md").read_text()
    assert "## End to end: tiny at TP 1 x PP 2 x DP 1" in md and "peak MiB per pipeline stage" in md


def test_the_layout_check_judges_each_layout_against_one_process(tmp_path):
    """layouts: every mode in every layout from the same weights and batches, judged by the rule
    written before the runs (coat_compare.layouts)."""
    run(
        "layouts", "1,dp2", "--preset", "tiny", "--modes", "bf16,coat", "--steps", "4", "--micro-batch", "2",
        "--global-batch", "8", "--out", str(tmp_path), timeout=900,
    )  # fmt: skip
    got = [r for r in read_jsonl(tmp_path / "tiny-layouts.jsonl") if r["kind"] == "layout"]
    assert [(r["mode"], r["layout"]) for r in got] == [(m, name) for m in ("bf16", "coat") for name in ("1", "dp2")]
    for r in got:
        assert r["status"] == "ok" and len(r["losses"]) == 4, r
        if r["layout"] != "1":
            assert r["agrees"] and r["first_step_relative"] <= 2e-3, r
            assert (r["bf16_drift"] is None) == (r["mode"] == "bf16")
    md = (tmp_path / "tiny-layouts.md").read_text()
    assert "## Parallel layouts against the first: tiny" in md and "| coat | dp2 |" in md
