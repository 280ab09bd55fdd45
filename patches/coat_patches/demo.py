"""The main job: a tiny GPT trained in BF16 and with ``--coat-fp8`` through Megatron's own training
loop, on the built-in corpus, and a comparison table.

    coat-megatron-demo [--iters 200] [--out coat-demo]      (or python -m coat_patches.demo)

Both runs are ``coat-megatron-run examples/pretrain_gpt.py`` (``megatron.training.pretrain``) with
the same model, data (the Python standard library's docstrings as bytes), seed and schedule; only
``--coat-fp8`` differs. Each writes a ``--coat-report`` (``coat_patches.report``), from which the
table is made (``coat_patches.report.summarize`` says how each number is taken; the demo runs one
micro-batch per step, so "per micro-batch" is "per step").

Without a GPU everything runs on the CPU: COAT then runs the torch references of its FP8 kernels,
which are slower than BF16 matmuls, so the CPU's tokens/s says nothing about FP8 speed. With a
GPU the same command uses it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from .report import comparison_table, summarize

# A Llama-shaped byte-level model: 4 layers, hidden 128, SwiGLU FFN 352, RMSNorm, RoPE, untied.
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "128",
    "--ffn-hidden-size",
    "352",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--bf16",
    "--vocab-size",
    "256",
    "--byte-corpus",
    "stdlib_docstrings",
    "--byte-corpus-bytes",
    str(1 << 20),
]
TRAINING = [
    "--micro-batch-size",
    "8",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-decay-style",
    "cosine",
    "--weight-decay",
    "0.1",
    "--adam-beta2",
    "0.95",
    "--clip-grad",
    "1.0",
    "--use-distributed-optimizer",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000000",
    "--num-workers",
    "0",
    "--seed",
    "1234",
    # Both runs eager: on a GPU --coat-fp8 alone would turn on per-layer CUDA graphs for COAT only
    "--cuda-graph-impl",
    "none",
]
MODES = {"BF16": [], "COAT": ["--coat-fp8"]}
# Megatron's learning-rate schedule needs fewer warm-up iterations than iterations, and warm-up
# takes at least one (warmup_iters): two is the shortest run that trains.
MIN_ITERS = 2
ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) .*elapsed time per iteration \(ms\): ([\d.]+).*lm loss: ([\d.E+-]+)"
)


def example_script() -> Path:
    script = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"
    if not script.is_file():
        raise FileNotFoundError(
            f"the demo runs examples/pretrain_gpt.py from the coat-megatron source tree, which is not at {script}: "
            f"install coat-megatron from a checkout (pip install -e .)"
        )
    return script


def warmup_iters(iters: int) -> int:
    return max(1, iters // 20)


def run(mode: str, flags: list[str], iters: int, out: Path, cpu: bool = False) -> dict:
    """One training run through the launcher; prints its progress; returns its report."""
    report = out / f"{mode.lower()}.json"
    report.unlink(missing_ok=True)
    log_interval = max(1, iters // 10)
    command = [
        sys.executable,
        "-m",
        "coat_patches.launch",
        *(["--cpu"] if cpu else []),
        str(example_script()),
        *MODEL,
        *TRAINING,
        "--train-iters",
        str(iters),
        "--lr-warmup-iters",
        str(warmup_iters(iters)),
        "--log-interval",
        str(log_interval),
        "--coat-report",
        str(report),
        *flags,
    ]
    log = out / f"{mode.lower()}.log"
    tail: deque[str] = deque(maxlen=60)
    start = time.perf_counter()
    with (
        open(log, "w") as f,
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p,
        forwarding_signals(p),
    ):
        for line in p.stdout:
            f.write(line)
            tail.append(line)
            m = ITERATION_LINE.search(line)
            if m:
                it, total, ms, loss = m.groups()
                print(
                    f"  [{mode}] iteration {int(it):>4}/{total}  lm loss {float(loss):.3f}  {float(ms):7.1f} ms/it",
                    flush=True,
                )
    if p.returncode != 0 or not report.is_file():
        sys.stderr.write("".join(tail))
        raise SystemExit(
            f"the {mode} run failed (exit code {p.returncode}); its log: {log}\ncommand: {' '.join(command)}"
        )
    doc = json.loads(report.read_text())
    doc["wall_seconds"] = time.perf_counter() - start
    return doc


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def forwarding_signals(child: subprocess.Popen):
    """While the block runs, SIGTERM and SIGINT sent to the demo go to its training ``child`` too;
    the demo then ends with the child (status 128 + the signal's number), as the shell would. Without
    this a demo stopped with SIGTERM left its training running."""

    def forward(signum, frame):
        child.send_signal(signum)
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, with an error as one line (and exit code 2) instead of the usage and the error."""

    def error(self, message: str) -> None:
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def iterations(text: str) -> int:
    try:
        iters = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: pass e.g. --iters 200") from None
    if iters < MIN_ITERS:
        raise argparse.ArgumentTypeError(
            f"{iters} is too few to train: Megatron's learning-rate schedule needs more iterations than warm-up ones, "
            f"and warm-up takes at least one; use --iters {MIN_ITERS} or more"
        )
    return iters


def prepare_out(out: Path) -> str | None:
    """Create ``out`` if missing; what is wrong with it as the demo's output directory, or None."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file: pass a directory (it is created if missing), e.g. --out coat-demo"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        return (
            f"--out {out} is not a writable directory ({e.strerror or e}): "
            f"pass one you can write to, e.g. --out coat-demo"
        )
    return None


def main(argv: list[str] | None = None) -> None:
    parser = OneLineErrorParser(prog="coat-megatron-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--iters",
        type=iterations,
        default=200,
        help=f"training iterations per run, at least {MIN_ITERS} (default 200: about 3.5 minutes on 2 CPU cores)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("coat-demo"),
        help="where the logs and reports go, created if missing (default ./coat-demo)",
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is available")
    args = parser.parse_args(argv)
    try:
        example_script()
    except FileNotFoundError as e:
        parser.error(str(e))
    if problem := prepare_out(args.out):
        parser.error(problem)
    start = time.perf_counter()
    reports = {}
    for mode, flags in MODES.items():
        print(f"{mode}: examples/pretrain_gpt.py through coat-megatron-run, {args.iters} iterations", flush=True)
        reports[mode] = run(mode, flags, args.iters, args.out, args.cpu)
    table = comparison_table(*(summarize(reports[m]) for m in MODES))
    doc = reports["BF16"]
    print()
    print(
        f"{doc['num_layers']}-layer GPT (hidden {doc['hidden_size']}, FFN {doc['ffn_hidden_size']}), "
        f"{args.iters} iterations of {doc['global_batch_size']} x {doc['seq_length']} bytes of Python docstrings, "
        f"on {doc['device']}:"
    )
    print(table)
    (args.out / "comparison.md").write_text(table + "\n")
    if doc["device"] == "cpu":
        print("(on a CPU, COAT runs the torch references of its FP8 kernels: its tokens/s is not FP8 speed)")
    print(f"logs and reports: {args.out}{os.sep}  ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
