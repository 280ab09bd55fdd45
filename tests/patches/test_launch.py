"""coat-megatron-run and coat-megatron-demo as a user runs them: subprocesses, Megatron's own
training loop (megatron.training.pretrain) on the CPU with gloo."""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import run_distributed

from coat_patches import launch as launch_module

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


def test_pretrain_example_trains_under_interleaved_pipeline_parallelism(tmp_path):
    """PP 2 with 2 virtual stages per rank (Megatron's interleaved 1F1B schedule): pretrain() calls
    the dataset provider once per model chunk with its vp_stage; 4 layers, one per virtual stage."""
    report_path = tmp_path / "report.json"
    argv = [*TINY, "--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    argv += ["--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "1"]
    done = launch(EXAMPLE, *argv, "--coat-fp8", "--coat-report", str(report_path), nproc=2, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Number of virtual stages per pipeline stage: 2" in done.stdout
    assert re.search(r"virtual_pipeline_model_parallel_size \.+ 2\n", done.stdout)
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 2 and report["optimizer"] == "CoatDistributedOptimizer"
    losses = [it["loss"] for it in report["iterations"]]
    logged = [(int(i), float(loss)) for i, loss in LOGGED.findall(done.stdout)]
    assert [i for i, _ in logged] == [1, 2, 3, 4, 5, 6] and losses[0] == pytest.approx(logged[0][1], rel=1e-5)
    assert abs(losses[0] - math.log(256)) < 0.1 and losses[-1] < losses[0] - 0.1
    # each rank holds two model chunks: both chunks' BF16 weights are weights, and the split masters'
    # low words (DP 1: every parameter, 2 bytes) the only master weights (the second chunk's weights
    # were once counted as master weights too: 9.47 bytes per parameter where 8.19 are held)
    per_param = report["bytes_per_parameter"]
    assert per_param["master_weights"] == pytest.approx(2.0, abs=0.15), per_param
    assert per_param["weights"] == pytest.approx(2.0, abs=0.01), per_param


def test_overlapped_gradient_reduction_and_parameter_gather_train_the_same(tmp_path):
    """--overlap-grad-reduce and --overlap-param-gather only schedule DP 2's reduce-scatter and
    all-gather (bucket by bucket, 8 buckets here, during the backward of the second of 2 micro-batches
    and the next forward): COAT's optimizer must give the same losses, bit for bit on the CPU, as
    without them (one bucket, reduced after the backward)."""
    argv = [*TINY, "--global-batch-size", "8", "--ddp-bucket-size", "8192", "--coat-fp8"]
    losses = {}
    for name, overlap in {"plain": [], "overlap": ["--overlap-grad-reduce", "--overlap-param-gather"]}.items():
        report_path = tmp_path / f"{name}.json"
        done = launch(EXAMPLE, *argv, *overlap, "--coat-report", str(report_path), nproc=2, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert re.search(rf"overlap_param_gather \.+ {bool(overlap)}\n", done.stdout)
        buckets = re.search(r"Number of buckets for gradient all-reduce / reduce-scatter: (\d+)", done.stdout)
        assert int(buckets.group(1)) == (8 if overlap else 1)  # Megatron buckets only what it overlaps
        losses[name] = [it["loss"] for it in json.loads(report_path.read_text())["iterations"]]
    assert len(losses["plain"]) == 6 and losses["plain"][-1] < losses["plain"][0] - 0.1
    assert losses["overlap"] == losses["plain"]


FAILING_RANK = """
import sys
sys.path.insert(0, {examples!r})
import pretrain_gpt as example
import torch
from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

steps = 0


def forward_step(data_iterator, model):
    global steps
    steps += 1
    if torch.distributed.get_rank() == 1 and steps == 3:
        raise RuntimeError("rank 1 fails in its third forward step")
    return example.forward_step(data_iterator, model)


if __name__ == "__main__":
    args = parse_and_validate_args(
        extra_args_provider=example.add_data_arguments, args_defaults={{"tokenizer_type": "NullTokenizer"}}
    )
    pretrain(
        pretrain_cfg_container_from_args(args, gpt_config_from_args(args)),
        example.train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
"""


def test_a_rank_that_fails_mid_run_ends_the_job(tmp_path):
    """examples/pretrain_gpt.py on DP 2 whose rank 1 raises in its third step (one micro-batch per
    step: iteration 3), while rank 0 waits for it in a collective: the job exits non-zero within
    seconds of the failure, not at Megatron's collective timeout (10 minutes)."""
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK.format(examples=str(ROOT / "examples")))
    start = time.monotonic()
    done = launch(str(script), *TINY, "--coat-fp8", nproc=2, timeout=240)
    assert done.returncode != 0
    assert "RuntimeError: rank 1 fails in its third forward step" in done.stderr
    assert [int(i) for i, _ in LOGGED.findall(done.stdout)] == [1, 2]  # iteration 3 never finished
    assert time.monotonic() - start < 200


def _close_with_a_missing_rank(timeout_s: float) -> float | None:
    """Rank 0 closes the process groups while rank 1 stays away for longer than ``timeout_s``;
    returns how long rank 0 waited (rank 1: None)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(timeout_s + 4)
        return None
    start = time.monotonic()
    with pytest.raises(launch_module.PeersLostError, match=r"did not reach the end of the script within 2 s"):
        launch_module._close_process_groups(timeout_s)
    return time.monotonic() - start


def _close_with_every_rank(timeout_s: float) -> tuple[int, bool]:
    """Megatron's process groups (TP 2 on two ranks: a dozen groups beside the default one) closed
    by the launcher; the number of groups there were, and whether torch.distributed is still up."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    groups = len(distributed_c10d._world.pg_names)
    launch_module._close_process_groups(timeout_s)
    return groups, dist.is_initialized()


def test_closing_the_process_groups_waits_a_bounded_time_for_the_other_ranks():
    waited, _ = run_distributed(_close_with_a_missing_rank, 2, args=(2.0,), timeout=60)
    assert 2.0 <= waited < 4.0
    closed = run_distributed(_close_with_every_rank, 2, args=(2.0,), tensor_parallel=2, timeout=60)
    assert [up for _, up in closed] == [False, False]
    assert all(groups > 2 for groups, _ in closed)


def test_the_graphs_are_released_before_any_process_group_is_destroyed(monkeypatch, capsys):
    """NCCL's destroy waits for every CUDA graph that captured one of its kernels: the graphs go
    first, then the barrier, then each group in torch's order (by name, reversed), the default last; rank 0
    says how many graphs were released and how long the closing took."""
    import torch.distributed as dist

    steps = []
    barrier = launch_module._store_barrier
    destroy = dist.destroy_process_group
    monkeypatch.setattr(launch_module, "release_cuda_graphs", lambda: steps.append("release") or 3)
    monkeypatch.setattr(launch_module, "_store_barrier", lambda t: (steps.append("barrier"), barrier(t)))
    monkeypatch.setattr(
        dist,
        "destroy_process_group",
        lambda group=None: (steps.append(launch_module._describe_group(group or dist.group.WORLD)), destroy(group)),
    )
    monkeypatch.setenv("RANK", "0")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.new_group([0], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
        dist.new_group([0], group_desc="DATA_PARALLEL_GROUP")
        launch_module._close_process_groups(5.0)
    finally:
        if dist.is_initialized():
            destroy()
    assert steps == [
        "release",
        "barrier",
        "DATA_PARALLEL_GROUP (gloo, 1 rank)",
        "TENSOR_MODEL_PARALLEL_GROUP (gloo, 1 rank)",
        "the default group (gloo, 1 rank)",
    ]
    assert re.search(
        r"coat-megatron-run: 3 CUDA graphs released in [\d.]+ s, then the process groups closed in [\d.]+ s",
        capsys.readouterr().out,
    )


STUCK_TEARDOWN = """
import sys, time
import torch.distributed as dist
from coat_patches import launch

dist.init_process_group("gloo", rank=0, world_size=1)
tp = dist.new_group([0], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
launch.TEARDOWN_S = 1.0
launch.release_cuda_graphs = lambda: 64
destroy = dist.destroy_process_group
def stuck(group=None):  # a communicator that never lets go (a live CUDA graph captured its kernels)
    if group is tp:
        time.sleep(60)
    destroy(group)
dist.destroy_process_group = stuck
launch._close_process_groups(5.0)
print("not reached")
"""


def test_a_teardown_that_hangs_after_every_rank_finished_leaves_with_status_0():
    """Every rank finished the script (the barrier passed), but destroying a process group does
    not return (seen on GPUs after TP 2 runs with CUDA graphs): the process leaves after
    ``TEARDOWN_S`` with a line that names the group and says the graphs were released before,
    and status 0, not at a scheduler's time limit."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(launch_module._free_port()),
        "CUDA_VISIBLE_DEVICES": "",
    }
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUCK_TEARDOWN], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "not reached" not in done.stdout
    assert (
        "closing the process groups took more than 1 s; leaving without them (stuck in destroying "
        "TENSOR_MODEL_PARALLEL_GROUP (gloo, 1 rank); 64 CUDA graphs released before)"
    ) in done.stderr
    assert time.monotonic() - start < 60


def test_the_demo_stopped_with_sigterm_takes_its_training_down(tmp_path):
    """A demo stopped with SIGTERM (a job scheduler, `kill`) forwards it to the training run it
    started, and ends with it: no training is left running."""
    import signal

    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-m", "coat_patches.demo", "--cpu", "--iters", "200", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    try:
        deadline, training = time.monotonic() + 120, []
        while not training and time.monotonic() < deadline and proc.poll() is None:
            training = psutil.Process(proc.pid).children(recursive=True)
            time.sleep(0.2)
        assert training, "the demo started no training run"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(training, timeout=30)
        assert not alive, f"training left running: {alive}"
    finally:
        proc.kill()
        proc.wait()


def test_stacks_after_writes_every_thread_of_a_rank_still_running(tmp_path, monkeypatch):
    """COAT_STACKS_AFTER: a rank whose script runs past the time writes where it is (once) to its
    own file; the run goes on."""
    monkeypatch.setenv("COAT_STACKS_AFTER", "0.3")
    monkeypatch.setenv("COAT_STACKS_DIR", str(tmp_path / "stacks"))
    monkeypatch.setenv("RANK", "3")
    stacks = launch_module._stacks_after()

    def a_replay_that_hangs():
        time.sleep(1.5)
        return "went on"

    assert a_replay_that_hangs() == "went on"
    launch_module._cancel_stacks(stacks)
    text = (tmp_path / "stacks" / "coat-stacks-rank3.txt").read_text()
    assert text.startswith("Timeout (") and "a_replay_that_hangs" in text and text.count("Timeout (") == 1


def test_stacks_after_leaves_nothing_when_the_script_ends_in_time(tmp_path, monkeypatch):
    monkeypatch.setenv("COAT_STACKS_AFTER", "60")
    monkeypatch.setenv("COAT_STACKS_DIR", str(tmp_path / "stacks"))
    stacks = launch_module._stacks_after()
    assert (tmp_path / "stacks" / "coat-stacks-rank0.txt").exists()
    launch_module._cancel_stacks(stacks)
    time.sleep(0.1)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its folder
    monkeypatch.delenv("COAT_STACKS_AFTER")
    assert launch_module._stacks_after() is None  # unset: nothing armed


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_stacks_after_names_the_fix(monkeypatch, capsys, value):
    monkeypatch.setenv("COAT_STACKS_AFTER", value)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        launch_module._stacks_after()
    assert stop.value.code == 2
    assert "give the seconds after which each rank writes its stacks, e.g. 90" in capsys.readouterr().err


def test_a_load_folder_that_does_not_exist_is_a_warning_and_the_run_trains(tmp_path):
    """Megatron trains from scratch when --load names no folder; the launcher says so in one line."""
    missing = tmp_path / "nowhere"
    done = launch(EXAMPLE, *TINY, "--load", str(missing))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"coat-megatron-run: warning: --load {missing} does not exist: training starts from scratch" in done.stdout
    assert [int(i) for i, _ in LOGGED.findall(done.stdout)] == [1, 2, 3, 4, 5, 6]
