"""The wgrad's accumulation into a BF16 gradient buffer: in the GEMM (cuBLASLt, beta = 1) against
an FP32 temporary and an add (what ``torch._scaled_mm`` alone allows), per linear of a model.

    python benchmarks/wgrad_accumulate.py [--preset gpt-1b] [--tokens 8192] [--out DIR]

For each linear's wgrad, dW (out x in) += dY^T (out x tokens, E5M2) @ X (tokens x in, E4M3): the
median time of ``fp8_gemm_accumulate`` by each backend and of the plain GEMM that writes a BF16
result (the first micro-batch's), and the sum per layer and per model micro-batch. Needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

from coat_compare.presets import get_preset
from coat_compare.report import write_markdown_and_rows
from coat_kernels import quantize_per_tensor
from coat_kernels.gemm import fp8_gemm
from coat_kernels.gemm_accumulate import fp8_gemm_accumulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from weight_passes import linear_shapes  # noqa: E402  (one layer's (name, out, in), as the weights are kept)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-1b")
    p.add_argument("--tokens", type=int, help="tokens per micro-batch (default: the preset's seq x micro-batch)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("wgrad_accumulate.py times GPU kernels: run it on a machine with a CUDA GPU")
    preset = get_preset(args.preset)
    tokens = args.tokens or preset.seq * preset.micro_batch
    rows = []
    for name, n_out, n_in in linear_shapes(preset):
        g = torch.Generator(device="cuda").manual_seed(0)
        dy_t, dy_s = quantize_per_tensor(torch.randn(n_out, tokens, device="cuda", generator=g), "e5m2")
        x_t, x_s = quantize_per_tensor(torch.randn(n_in, tokens, device="cuda", generator=g), "e4m3")
        b = x_t.t()  # (tokens, in) column-major
        main_grad = torch.zeros(n_out, n_in, device="cuda", dtype=torch.bfloat16)
        row = {"linear": name, "out": n_out, "in": n_in, "tokens": tokens}
        for backend in ("cublaslt", "add"):
            row[f"{backend}_ms"] = triton.testing.do_bench(
                lambda backend=backend: fp8_gemm_accumulate(dy_t, dy_s, b, x_s, main_grad, backend=backend),
                warmup=10,
                rep=100,
                return_mode="median",
            )
        row["write_ms"] = triton.testing.do_bench(
            lambda: fp8_gemm(dy_t, dy_s, b, x_s, out_dtype=torch.bfloat16, out=main_grad),
            warmup=10,
            rep=100,
            return_mode="median",
        )
        rows.append(row)
    layer = {k: sum(r[k] for r in rows) for k in ("cublaslt_ms", "add_ms", "write_ms")}
    lines = [
        f"# wgrad accumulation into a BF16 buffer, {preset.name}, {tokens} tokens per micro-batch ({torch.cuda.get_device_name()})",
        "",
        f"`python benchmarks/wgrad_accumulate.py --preset {preset.name} --tokens {tokens}`",
        "",
        "| linear | out x in | in the GEMM (cuBLASLt) ms | FP32 temporary + add ms | plain GEMM, BF16 written ms | add / GEMM |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['linear']} | {r['out']} x {r['in']} | {r['cublaslt_ms']:.3f} | {r['add_ms']:.3f} | {r['write_ms']:.3f} | "
            f"{r['add_ms'] / r['cublaslt_ms']:.2f} |"
        )
    lines += [
        f"| **layer** | | {layer['cublaslt_ms']:.3f} | {layer['add_ms']:.3f} | {layer['write_ms']:.3f} | "
        f"{layer['add_ms'] / layer['cublaslt_ms']:.2f} |",
        "",
        f"Per micro-batch of the model ({preset.layers} layers): {preset.layers * layer['cublaslt_ms']:.1f} ms in the GEMM "
        f"against {preset.layers * layer['add_ms']:.1f} ms by the temporary and an add.",
    ]
    device = torch.cuda.get_device_name()
    rows = [{**r, "preset": preset.name, "device": device} for r in rows]
    write_markdown_and_rows(args.out, "wgrad_accumulate", "\n".join(lines) + "\n", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
