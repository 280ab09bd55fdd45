"""coat-megatron-run and coat-megatron-demo as a user runs them: subprocesses, Megatron's own
training loop (megatron.training.pretrain) on the CPU with gloo."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "pretrain_gpt.py")
TINY = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 6 --lr 1e-3 --lr-warmup-iters 1 "
    "--bf16 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 --use-distributed-optimizer "
    "--log-interval 1 --eval-iters 0 --eval-interval 1000 --num-workers 0 --vocab-size 256 "
    f"--byte-corpus stdlib_docstrings --byte-corpus-bytes {1 << 18}"
).split()
LOGGED = re.compile(r"iteration\s+(\d+)/\s+6 .*lm loss: ([\d.E+-]+)")
NUMBER = r"([\d.e+-]+)"
TELEMETRY = re.compile(
    rf"\[coat\] iteration (\d+) \| m k mean/min/max {NUMBER}/{NUMBER}/{NUMBER} \| v k {NUMBER}/{NUMBER}/{NUMBER} "
    rf"\| underflow m {NUMBER} v {NUMBER}"
)


def launch(*argv: str, nproc: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    """``coat-megatron-run --cpu ...`` (under torchrun for ``nproc`` > 1)."""
    runner = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    return subprocess.run(
        [*runner, "-m", "coat_patches.launch", "--cpu", *argv], capture_output=True, text=True, timeout=timeout
    )


def test_pretrain_example_trains_with_coat_on_two_processes(tmp_path):
    report_path = tmp_path / "report.json"
    done = launch(EXAMPLE, *TINY, "--coat-fp8", "--coat-report", str(report_path), nproc=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logged = [(int(i), float(loss)) for i, loss in LOGGED.findall(done.stdout)]
    assert [i for i, _ in logged] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(loss) for _, loss in logged)
    report = json.loads(report_path.read_text())
    assert report["mode"] == "coat" and report["world_size"] == 2 and report["optimizer"] == "CoatDistributedOptimizer"
    losses = [it["loss"] for it in report["iterations"]]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    # Megatron's first log line is iteration 1's loss; later lines average since the previous one
    assert losses[0] == pytest.approx(logged[0][1], rel=1e-5)
    assert losses[-1] < losses[0] - 0.1  # bytes of text: the loss falls from ln(256) at once
    assert report["saved_for_backward_bytes_per_micro_batch"] > 0 and report["optimizer_state_bytes"] > 0
    # --coat-fp8 alone is COAT's memory mode: BF16 gradient buffers (2 bytes per parameter, plus
    # the buffers' alignment padding on this tiny model), split masters (int16 low words on this
    # rank's half of the parameters: 1 byte per parameter of the model)
    per_param = report["bytes_per_parameter"]
    assert per_param["grads"] == pytest.approx(2.0, abs=0.25), per_param
    assert per_param["master_weights"] == pytest.approx(1.0, abs=0.15), per_param
    assert per_param["total"] == pytest.approx(sum(v for k, v in per_param.items() if k != "total"))
    # COAT's state telemetry at every log interval (1 here), printed once (by the last rank)
    stats = TELEMETRY.findall(done.stdout)
    assert [int(s[0]) for s in stats] == [1, 2, 3, 4, 5, 6]
    for _, *values in stats:
        m_mean, m_min, m_max, v_mean, v_min, v_max, m_under, v_under = map(float, values)
        assert 1 / 16 <= m_min <= m_mean <= m_max <= 16 and 1 / 16 <= v_min <= v_mean <= v_max <= 16
        assert 0 <= m_under <= 1 and 0 <= v_under <= 1


def test_incompatible_flags_stop_with_the_fix():
    done = launch(EXAMPLE, *TINY, "--coat-fp8", "--fp8-format", "hybrid", timeout=120)
    assert done.returncode == 2
    assert "coat-megatron-run: error: --coat-fp8 cannot run with these arguments" in done.stderr
    assert "drop --fp8-format" in done.stderr
    assert not LOGGED.search(done.stdout)  # stopped before training


def test_demo_prints_the_comparison(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "coat_patches.demo", "--cpu", "--iters", "6", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\[COAT\] iteration\s+6/6\s+lm loss", done.stdout)
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in (
            "final loss",
            "tokens/s",
            "saved for backward / micro-batch",
            "optimizer states",
        ):
            rows[cells[0]] = [float(re.sub(r"[^\d.]", "", c)) for c in cells[1:]]
    assert set(rows) == {"final loss", "tokens/s", "saved for backward / micro-batch", "optimizer states"}
    bf16_loss, coat_loss, _ = rows["final loss"]
    assert 0 < bf16_loss < math.log(256) and 0 < coat_loss < math.log(256)
    assert abs(coat_loss - bf16_loss) < 0.1
    assert rows["tokens/s"][0] > 0 and rows["tokens/s"][1] > 0
    bf16_saved, coat_saved, saved_ratio = rows["saved for backward / micro-batch"]
    assert coat_saved < bf16_saved and saved_ratio < 0.7
    bf16_states, coat_states, states_ratio = rows["optimizer states"]
    # FP32 m and v: 8 bytes per parameter; COAT: about 2.19
    assert coat_states < bf16_states and 0.2 < states_ratio < 0.35
    assert (tmp_path / "comparison.md").read_text().startswith("| | BF16 | COAT | COAT / BF16 |")
