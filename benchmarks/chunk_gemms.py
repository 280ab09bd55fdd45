"""What sequence parallelism's per-chunk scales cost COAT's GEMMs at TP 2: one FP8 GEMM per sequence
chunk against one GEMM over the whole gathered sequence.

    python benchmarks/chunk_gemms.py [--out DIR]

At TP n each rank quantizes its own sequence chunk with its own per-tensor scale (no amax
all-reduce), so the column-parallel forward (gathered X times W^T) and the row-parallel data
gradient (gathered dY times W) run n GEMMs of M = seq / n rows, one per chunk scale
(``coat_megatron.layers.sequence_parallel``). The alternatives: one GEMM with one scale (what an
amax all-reduce over TP would allow) and one GEMM with a row-wise A scale (``torch._scaled_mm``
with (M, 1) and (1, N) scales). Shapes: Llama-2-7B at TP 2, seq 2048, micro-batch 1: the QKV and
FC1 forwards (E4M3 x E4M3), the projection and FC2 data gradients (E5M2 x E4M3). Times are CUDA
event means over 50 calls after 5 warm-up calls, in microseconds. Writes chunk_gemms.md to --out.
"""

from __future__ import annotations

import argparse
import os

import torch

# name: (M, K, N): M the gathered sequence, K the reduction, N the output width on one TP rank
SHAPES = {
    "QKV forward": (2048, 4096, 6144),
    "FC1 forward": (2048, 4096, 11008),
    "projection dgrad": (2048, 4096, 2048),
    "FC2 dgrad": (2048, 4096, 5504),
}


def mean_us(fn, calls: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1000


def measure(name: str, m: int, k: int, n: int, chunks: int = 2) -> dict:
    a_format = torch.float8_e5m2 if "dgrad" in name else torch.float8_e4m3fn
    a = torch.randn(m, k, device="cuda").to(a_format)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt takes it
    one = torch.ones((), device="cuda")
    parts = a.chunk(chunks)
    row = {"gemm": name, "m": m, "k": k, "n": n, "a_format": str(a_format).split(".")[-1]}
    row["one_us"] = mean_us(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    row["chunks_us"] = mean_us(lambda: [torch._scaled_mm(p, b, one, one, out_dtype=torch.bfloat16) for p in parts])
    rows_scale, cols_scale = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    try:
        row["rowwise_us"] = mean_us(lambda: torch._scaled_mm(a, b, rows_scale, cols_scale, out_dtype=torch.bfloat16))
    except RuntimeError as e:  # a torch or GPU without row-wise FP8 scaling
        row["rowwise_us"], row["rowwise_refused"] = None, str(e).splitlines()[0][:160]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="directory for chunk_gemms.md")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit(
            "chunk_gemms.py needs a CUDA GPU with FP8 GEMMs (compute capability >= 8.9): run it on the GPU machine"
        )
    rows = [measure(name, *shape) for name, shape in SHAPES.items()]
    lines = [
        f"# One GEMM against one per sequence chunk (TP 2), {torch.cuda.get_device_name()}, torch {torch.__version__}",
        "",
        "| GEMM (M, K, N), A's format | one GEMM, one scale (us) | two chunk GEMMs (us) | one GEMM, row-wise A scale (us) | chunks / one | row-wise / one |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rowwise = "refused" if r["rowwise_us"] is None else f"{r['rowwise_us']:.1f}"
        rowwise_ratio = "-" if r["rowwise_us"] is None else f"{r['rowwise_us'] / r['one_us']:.3f}"
        lines.append(
            f"| {r['gemm']} ({r['m']}, {r['k']}, {r['n']}), {r['a_format']} | {r['one_us']:.1f} | {r['chunks_us']:.1f} | "
            f"{rowwise} | {r['chunks_us'] / r['one_us']:.3f} | {rowwise_ratio} |"
        )
    extra = sum(r["chunks_us"] - r["one_us"] for r in rows)
    lines += [
        "",
        f"The chunks cost {extra:.1f} us more than single GEMMs per layer and micro-batch (these four GEMMs).",
    ]
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chunk_gemms.md"), "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
