"""benchmarks/tp_overlap.py on two CPU processes (gloo), as on two GPUs under torchrun: both COAT
rows are built with their own ``tp_comm_overlap`` and move the same bytes; the table names them."""

import os
import subprocess
import sys

from coat_compare.report import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "tp_overlap.py")


def test_overlap_on_and_off_rows_at_tp2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", SCRIPT,
         "--preset", "tiny-layer", "--micro-batches", "2", "--modes", "bf16", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["row"]: r for r in read_jsonl(tmp_path / "tp_overlap.jsonl")}
    assert list(rows) == ["bf16", "coat, overlap on", "coat, overlap off"]
    on, off, bf16 = rows["coat, overlap on"], rows["coat, overlap off"], rows["bf16"]
    assert all(r["status"] == "ok" and r["tp"] == 2 and r["ms"] > 0 for r in rows.values())
    # the same gathers either way (the ring is counted as the all-gather it makes up), half of BF16's
    assert on["all_gather_bytes"] == off["all_gather_bytes"] and on["sp_all_gather_fp8_bytes"] > 0
    assert 2 * on["sp_all_gather_fp8_bytes"] == bf16["sp_all_gather_bytes"]
    text = (tmp_path / "tp_overlap.md").read_text()
    assert "| 2 | coat, overlap on |" in text and "| 2 | coat, overlap off |" in text and "1.00x" in text


def test_it_refuses_one_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "tiny-layer", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "1"},
    )
    assert proc.returncode == 2 and "launch with torchrun --nproc-per-node 2" in proc.stderr
