"""The example and GPU scripts, run as a user runs them (on the CPU here)."""

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

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
