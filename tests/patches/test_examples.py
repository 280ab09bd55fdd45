"""The example and GPU scripts, run as a user runs them (on the CPU here)."""

import json
import math
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cpu_env(**extra: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(port), **extra}


def test_layer_spec_example_trains(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "layer_spec.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=_cpu_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([\d.]+)", done.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0] < math.log(256)
    state = re.search(r"optimizer state: ([\d.]+) MiB for ([\d.]+)M parameters", done.stdout)
    mib, params = float(state.group(1)), float(state.group(2))
    assert 2.0 < mib * 2**20 / (params * 1e6) < 2.4  # COAT's 2.19 bytes per parameter
    assert "'v_underflow_fraction'" in done.stdout


def test_gpu_pretrain_script_smoke_runs_tiny(tmp_path):
    # GLOBAL_BATCH 4 at micro-batch 2: Megatron's loop accumulates 2 micro-batches per iteration
    env = _cpu_env(SIZE="tiny", ITERS="5", GLOBAL_BATCH="4", OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_pretrain.sh")], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = {mode: json.loads((tmp_path / f"{mode}.json").read_text()) for mode in ("bf16", "coat")}
    assert reports["bf16"]["mode"] == "bf16" and reports["coat"]["mode"] == "coat"
    assert all(len(r["iterations"]) == 5 for r in reports.values())
    log = (tmp_path / "coat.log").read_text()
    assert "iteration        5/       5" in log and re.search(r"global_batch_size \.+ 4\n", log)
    assert re.search(r"micro_batch_size \.+ 2\n", log)
    table = (tmp_path / "comparison.md").read_text()
    assert table.startswith("| | BF16 | COAT | COAT / BF16 |") and "| optimizer states |" in table


@pytest.mark.parametrize(
    "recipe, layout, tp, pp, dp",
    [
        ("llama2_7b.sh", {}, 1, 1, 4),
        ("llama2_7b.sh", {"TP": "2"}, 2, 1, 2),
        ("llama_1b.sh", {"TP": "2", "PP": "2"}, 2, 2, 1),
        ("llama3_8b.sh", {"TP": "2", "PP": "2"}, 2, 2, 1),
        ("llama3_8b.sh", {}, 1, 1, 4),
    ],
    ids=["7b-dp4", "7b-tp2-dp2", "1b-tp2-pp2", "llama3-8b-tp2-pp2", "llama3-8b-dp4"],
)
def test_llama_recipes_give_megatron_the_layout(monkeypatch, recipe, layout, tp, pp, dp):
    """The recipe's command on 4 GPUs (DRY_RUN=1 prints it), read by Megatron's parser and
    validate_args with COAT's patches as a world of 4 processes: the layout it produces."""
    from megatron_argv import parse

    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "DRY_RUN": "1", "GPUS": "4", "PATH": f"{bin_dir}:{os.environ['PATH']}", **layout}
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / recipe)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout)
    assert command[:7] == ["python3", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m"]
    script = command.index(str(ROOT / "examples" / "pretrain_gpt.py"))
    assert command[script - 1] == "coat_patches.launch"
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse(monkeypatch, *command[script + 1 :])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (tp, pp, dp)
    assert args.sequence_parallel is (tp > 1)
    assert args.coat_fp8 and args.use_distributed_optimizer and args.overlap_grad_reduce
    assert args.micro_batch_size == (4 if recipe == "llama_1b.sh" else 1)
    if recipe == "llama3_8b.sh":  # Llama 3's shape: GQA, long sequences, its RoPE base and vocabulary
        assert (args.num_query_groups, args.seq_length, args.ffn_hidden_size) == (8, 8192, 14336)
        assert (args.rotary_base, args.vocab_size, args.global_batch_size) == (500000, 128256, 8)
        assert args.overlap_param_gather


@pytest.mark.parametrize(
    "env, wanted, unwanted",
    [
        # under PP (TP 2 x PP 2 here) the comparison's lines run without the pipeline sync, as --coat-fp8 does
        ({"MODE": "bf16"}, ["--coat-p2p-sync off"], ["--coat-fp8", "--fp8-format", "--cuda-graph-impl"]),
        (
            {"MODE": "bf16", "GRAPHS": "te"},
            ["--cuda-graph-impl transformer_engine", "--coat-p2p-sync off"],
            ["--coat-fp8"],
        ),
        (
            {"MODE": "te-fp8", "GRAPHS": "te"},
            [
                "--fp8-format hybrid --fp8-recipe tensorwise",
                "--cuda-graph-impl transformer_engine",
                "--coat-p2p-sync off",
            ],
            ["--coat-fp8"],
        ),
        ({"MODE": "bf16", "PP": "1"}, [], ["--coat-p2p-sync"]),
        ({"GRAPHS": "te"}, ["--coat-fp8"], ["--cuda-graph-impl", "--coat-p2p-sync"]),  # COAT: its own choices
        ({"COAT": "0"}, [], ["--coat-fp8"]),
    ],
    ids=["bf16", "bf16-graphs", "te-fp8-graphs", "bf16-no-pp", "coat", "coat-0"],
)
def test_the_llama3_recipe_prints_the_comparisons_other_lines(env, wanted, unwanted):
    full = {**os.environ, "DRY_RUN": "1", "GPUS": "4", "TP": "2", "PP": "2", **env}
    done = subprocess.run(["bash", str(ROOT / "examples" / "llama3_8b.sh")], capture_output=True, text=True, env=full)
    assert done.returncode == 0, done.stderr
    for text in wanted:
        assert text in done.stdout, text
    for text in unwanted:
        assert text not in done.stdout, text
    bad = subprocess.run(
        ["bash", str(ROOT / "examples" / "llama3_8b.sh")], capture_output=True, text=True, env={**full, "MODE": "fp4"}
    )
    assert bad.returncode == 2 and "MODE=fp4: use coat, bf16 or te-fp8" in bad.stderr


@pytest.mark.parametrize("iters, warmup", [("12", "1"), ("2000", "200"), ("2001", "2000"), ("5", "1")])
def test_a_short_run_of_a_recipe_warms_up_over_a_tenth_of_it(iters, warmup):
    """Megatron asserts that the warm-up is shorter than the run: ITERS at or under the recipe's WARMUP
    (2000 for Llama-3-8B; the evidence parts run 12) warms up over a tenth of ITERS, and says so."""
    full = {**os.environ, "DRY_RUN": "1", "GPUS": "1", "ITERS": iters}
    done = subprocess.run(["bash", str(ROOT / "examples" / "llama3_8b.sh")], capture_output=True, text=True, env=full)
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout)
    assert command[command.index("--train-iters") + 1] == iters
    assert command[command.index("--lr-warmup-iters") + 1] == warmup
    assert ("warming up over" in done.stderr) is (warmup != "2000")
    too_short = subprocess.run(
        ["bash", str(ROOT / "examples" / "llama3_8b.sh")], capture_output=True, text=True, env={**full, "ITERS": "1"}
    )
    assert too_short.returncode == 2 and "ITERS=1: train at least 2 iterations" in too_short.stderr


def test_gpu_pretrain_layouts_script_runs_tiny_and_summarizes(tmp_path):
    """scripts/gpu_pretrain_layouts.sh with the tiny model on the CPU (one process and DP 2, BF16 and
    eager COAT): each run's log, and a summary row per run with the numbers read back from the log,
    DP 2's losses against one process's."""
    bin_dir = str(Path(sys.executable).parent)
    env = _cpu_env(
        SIZE="tiny", ITERS="4", LAYOUTS="one dp2", MODES="bf16 coat", RES=str(tmp_path / "res"), OUT=str(tmp_path)
    )
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_pretrain_layouts.sh")],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {}
    for line in (tmp_path / "summary.md").read_text().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0], cells[1]] = cells
    assert set(rows) == {(layout, mode) for layout in ("one", "dp2") for mode in ("bf16", "coat")}
    for (layout, mode), cells in rows.items():
        log = (tmp_path / f"{layout}-{mode}.log").read_text()
        times = [float(ms) for ms in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log)]
        assert len(times) == 4 and cells[2:4] == ["1" if layout == "one" else "2", "none"] and cells[-1] == "ok"
        losses = [float(v) for v in re.findall(r"lm loss: ([\d.Ee+-]+)", log)]
        assert cells[9] == f"{losses[0]:.4f} -> {losses[-1]:.4f}"
        # DP 2 computes the same model on the same global batches: its losses agree with one process's
        assert cells[10] == "" if layout == "one" else float(cells[10]) < 0.02
        assert cells[11] == ""  # x TE FP8: no te-fp8 run here
        # global batch 4 x seq 64 tokens per iteration, over the median of iterations 3 and 4
        assert float(cells[4].replace(",", "")) == pytest.approx(256 * 1000 / statistics.median(times[2:]), rel=0.01)
    assert rows["dp2", "bf16"][6] == "1.00" and float(rows["dp2", "coat"][6]) > 0
    # rows.jsonl: one row per run, the figures the table quotes, Megatron's own TFLOP/s beside
    kept = {(r["layout"], r["mode"]): r for r in map(json.loads, (tmp_path / "rows.jsonl").read_text().splitlines())}
    assert set(kept) == set(rows)
    for key, row in kept.items():
        assert f"{row['tokens_s']:,.0f}" == rows[key][4] and row["status"] == "ok" and row["timed_iterations"] == 2
        assert row["megatron_tflops_per_gpu"] is not None and rows[key][13] == f"{row['megatron_tflops_per_gpu']:.1f}"


def test_gpu_pretrain_layouts_script_runs_the_llama3_recipe_itself(tmp_path):
    """SIZE=llama3-8b runs examples/llama3_8b.sh (here DRY_RUN=1: each run's log holds the command it
    would start): the recipe's shape and flags, then the layout's, the mode's and the logging flags."""
    env = _cpu_env(SIZE="llama3-8b", ITERS="12", LAYOUTS="tp2pp2 dp4", MODES="bf16-graphs coat", DRY_RUN="1",
                   RES=str(tmp_path / "res"), OUT=str(tmp_path))  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    script = ["bash", str(ROOT / "scripts" / "gpu_pretrain_layouts.sh")]
    done = subprocess.run(script, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for layout, mode, tail in [
        ("tp2pp2", "coat", "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
         "--coat-fp8 --coat-cuda-graphs off"),
        ("tp2pp2", "bf16-graphs", "--sequence-parallel --cuda-graph-impl transformer_engine"),
        ("dp4", "bf16-graphs", "--eval-interval 1000000 --cuda-graph-impl local"),
    ]:  # fmt: skip
        note, line = (tmp_path / f"{layout}-{mode}.log").read_text().splitlines()
        # 12 iterations are under the recipe's warm-up: it warms up over a tenth (Megatron asserts warm-up < decay)
        assert note == "ITERS=12 is not above the recipe's 2000 warm-up iterations: warming up over 1 (a tenth)"
        command = line.split()
        assert command[:6] == ["python3", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
        text = " ".join(command)
        assert "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336" in text and "--train-iters 12" in text
        assert "--lr-warmup-iters 1 " in text
        assert "--log-interval 1 --log-memory-interval 12 --eval-iters 0" in text and text.endswith(tail)
    kept = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(kept) == 4 and all(r["status"].startswith("stopped: no iteration") for r in kept)


def test_gpu_pretrain_layouts_script_gives_te_fp8_pa_megatrons_fp8_adam_states(tmp_path):
    """te-fp8-pa: TE FP8 (current scaling) with Megatron's precision-aware optimizer keeping FP8 Adam states, stock
    Megatron's leanest memory beside COAT's (here DRY_RUN=1 with a stand-in transformer_engine package, so that
    the script takes TE for installed: the log holds the command the recipe would start)."""
    fake = tmp_path / "fake" / "transformer_engine"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "pytorch.py").write_text("")
    env = _cpu_env(SIZE="llama3-8b", ITERS="12", LAYOUTS="one", MODES="te-fp8-pa te-fp8 te-fp8-pa-graphs", DRY_RUN="1",
                   RES=str(tmp_path / "res"), OUT=str(tmp_path))  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), env.get("PYTHONPATH", "")])
    script = ["bash", str(ROOT / "scripts" / "gpu_pretrain_layouts.sh")]
    done = subprocess.run(script, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pa = (tmp_path / "one-te-fp8-pa.log").read_text().splitlines()[-1].strip()
    plain = (tmp_path / "one-te-fp8.log").read_text().splitlines()[-1].strip()
    fp8 = "--fp8-format hybrid --fp8-recipe tensorwise --cuda-graph-impl none"
    assert pa.endswith(f"{fp8} --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"), pa
    assert plain.endswith(fp8) and "--transformer-impl transformer_engine" in pa
    graphed = (tmp_path / "one-te-fp8-pa-graphs.log").read_text().splitlines()[-1].strip()
    assert "--cuda-graph-impl local --use-precision-aware-optimizer --exp-avg-dtype fp8" in graphed, graphed


def test_gpu_pretrain_layouts_script_names_te_when_a_te_mode_lacks_it(tmp_path):
    """The te-fp8 modes need TransformerEngine: without it the script says so and exits 2 before any run."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("TransformerEngine imports here")
    env = _cpu_env(SIZE="tiny", LAYOUTS="one", MODES="te-fp8", RES=str(tmp_path / "res"), OUT=str(tmp_path))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_pretrain_layouts.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2 and "mode te-fp8 needs TransformerEngine" in done.stderr
    assert not list((tmp_path / "res").glob("*.log"))


def test_gpu_pretrain_layouts_script_runs_a_mode_with_options_beside_it(tmp_path):
    """MODE+nosync+gc: the same mode with --coat-p2p-sync off and Megatron's manual garbage collection,
    its summary row compared with the mode without them; an unknown option stops before any run."""
    env = _cpu_env(SIZE="tiny", ITERS="4", LAYOUTS="one", MODES="bf16 bf16+nosync+gc", RES=str(tmp_path / "res"),
                   OUT=str(tmp_path))  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    script = ["bash", str(ROOT / "scripts" / "gpu_pretrain_layouts.sh")]
    done = subprocess.run(script, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "one-bf16+nosync+gc.log").read_text()
    assert re.search(r"^\s+manual_gc \.+ True$", log, re.M) and re.search(r"^\s+coat_p2p_sync \.+ off$", log, re.M)
    rows = {}
    for line in (tmp_path / "summary.md").read_text().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[1]] = cells
    assert rows["bf16+nosync+gc"][-1] == "ok" and float(rows["bf16+nosync+gc"][12]) > 0 and rows["bf16"][12] == ""
    env["MODES"] = "bf16+fast"
    done = subprocess.run(script, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and "options after + are nosync, sync and gc" in done.stderr
