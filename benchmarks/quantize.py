"""Bandwidth of the quantization kernels against a device-to-device copy, in one run.

    python benchmarks/quantize.py [--rows 8192 --cols 14336] [--sweep] [--out DIR]

Bytes counted per kernel: each input read once plus each output written once (BF16 x: 2 B per
element, FP8 codes 1 B, FP32 scales 4 B per group). The copy moves 2 x the bytes of x (read +
write). Times are CUDA-event medians from triton.testing.do_bench, which flushes L2 between runs.
Kernels run with check_finite=False, as the training ops call them (no host sync).
``--sweep`` also times other tile shapes of the two main kernels, to choose their defaults.
"""

from __future__ import annotations

import argparse
import json
import os
from unittest import mock

import torch
import triton

from coat_kernels import (
    dequantize_per_group,
    dequantize_per_tensor,
    quantize_per_group,
    quantize_per_tensor,
    tensor_amax,
    transpose_codes,
)
from coat_kernels import per_group as qg_module
from coat_kernels import per_tensor as qt_module


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=14336)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/quantize.py measures GPU bandwidth: run it on a CUDA machine")

    gpu = torch.cuda.get_device_name()
    m, n = args.rows, args.cols
    numel = m * n
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    copy_ms = bench_ms(lambda: dst.copy_(x))
    copy_gbs = 2 * x.nbytes / copy_ms / 1e6

    q16, s16 = quantize_per_group(x, 16, "e4m3", check_finite=False)
    qt, st = quantize_per_tensor(x, "e4m3", check_finite=False)
    amax = tensor_amax(x)
    rows = []

    def case(name, fn, bytes_moved, note=""):
        ms = bench_ms(fn)
        gbs = bytes_moved / ms / 1e6
        rows.append(
            {"kernel": name, "ms": ms, "GB/s": gbs, "of_copy": gbs / copy_gbs, "bytes": bytes_moved, "note": note}
        )

    for g in (16, 32, 64, 128):
        case(
            f"quantize_per_group G={g} e4m3",
            lambda g=g: quantize_per_group(x, g, "e4m3", check_finite=False),
            numel * (2 + 1) + numel // g * 4,
        )
    case(
        "dequantize_per_group G=16 -> bf16",
        lambda: dequantize_per_group(q16, s16, 16, torch.bfloat16),
        numel * (1 + 2) + numel // 16 * 4,
    )
    case("tensor_amax (group-scaling pass)", lambda: tensor_amax(x), numel * 2)
    case(
        "quantize_per_tensor e4m3, amax from producer",
        lambda: quantize_per_tensor(x, "e4m3", amax=amax, check_finite=False),
        numel * (2 + 1),
    )
    case(
        "quantize_per_tensor e4m3 + transpose, amax from producer",
        lambda: quantize_per_tensor(x, "e4m3", transpose=True, amax=amax, check_finite=False),
        numel * (2 + 1 + 1),
    )
    case(
        "quantize_per_tensor e4m3 (with its own amax pass)",
        lambda: quantize_per_tensor(x, "e4m3", check_finite=False),
        numel * (2 + 1),
        "x is read twice: the bound is 3/5 of copy",
    )
    case(
        "quantize_per_tensor e4m3 + transpose (with its own amax pass)",
        lambda: quantize_per_tensor(x, "e4m3", transpose=True, check_finite=False),
        numel * (2 + 1 + 1),
        "x is read twice: the bound is 4/6 of copy",
    )
    case("dequantize_per_tensor -> bf16", lambda: dequantize_per_tensor(qt, st, torch.bfloat16), numel * (1 + 2))
    case("transpose_codes (tiled byte transpose)", lambda: transpose_codes(qt), numel * 2)
    case(
        "torch q.view(uint8).t().contiguous()",
        lambda: qt.view(torch.uint8).t().contiguous(),
        numel * 2,
        "what the default's dgrad used for W^T before transpose_codes",
    )

    sweep = []
    if args.sweep:
        for cfg in [(32, 256, 8), (16, 256, 4), (64, 256, 8), (64, 128, 8), (16, 128, 4), (128, 128, 8), (8, 256, 2)]:
            with mock.patch.object(qg_module, "_blocks", lambda *_a, cfg=cfg: cfg):
                ms = bench_ms(lambda: quantize_per_group(x, 16, "e4m3", check_finite=False))
            sweep.append(
                {
                    "kernel": "quantize_per_group G=16",
                    "blocks": cfg,
                    "ms": ms,
                    "of_copy": numel * 3.25 / ms / 1e6 / copy_gbs,
                }
            )
        for cfg in [
            (128, 128, 8),
            (128, 128, 4),
            (64, 64, 4),
            (64, 128, 4),
            (128, 64, 4),
            (256, 64, 8),
            (64, 256, 8),
            (256, 128, 8),
        ]:
            # the quantizer keeps its tiles per shape (_plans): an empty table makes it ask for them again
            with (
                mock.patch.object(qt_module, "_quantize_blocks", lambda *_a, cfg=cfg: cfg),
                mock.patch.object(qt_module, "_plans", {}),
            ):
                ms = bench_ms(lambda: quantize_per_tensor(x, "e4m3", transpose=True, amax=amax, check_finite=False))
            sweep.append(
                {
                    "kernel": "quantize_per_tensor + transpose (producer amax)",
                    "blocks": cfg,
                    "ms": ms,
                    "of_copy": numel * 4 / ms / 1e6 / copy_gbs,
                }
            )
        for cfg in [(64, 256, 8), (32, 256, 4), (128, 256, 8), (64, 512, 8)]:
            with mock.patch.object(qt_module, "_AMAX_BLOCKS", cfg):
                ms = bench_ms(lambda: tensor_amax(x))
            sweep.append({"kernel": "tensor_amax", "blocks": cfg, "ms": ms, "of_copy": numel * 2 / ms / 1e6 / copy_gbs})

        for cfg in [
            (64, 64, 4),
            (128, 128, 8),
            (128, 128, 4),
            (64, 128, 4),
            (128, 64, 4),
            (256, 128, 8),
            (128, 256, 8),
        ]:
            with mock.patch.object(qt_module, "_TRANSPOSE_BLOCKS", cfg):
                ms = bench_ms(lambda: transpose_codes(qt))
            sweep.append(
                {"kernel": "transpose_codes", "blocks": cfg, "ms": ms, "of_copy": numel * 2 / ms / 1e6 / copy_gbs}
            )

    lines = [
        f"# Quantization kernels vs device copy: {gpu}",
        "",
        f"x: {m}x{n} BF16; torch {torch.__version__}, triton {triton.__version__}.",
        f"Device-to-device copy of x: {copy_ms:.3f} ms, {copy_gbs:.0f} GB/s (read + write).",
        "",
        "| kernel | ms | GB/s | of copy | note |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['kernel']} | {r['ms']:.3f} | {r['GB/s']:.0f} | {r['of_copy']:.2f} | {r['note']} |" for r in rows]
    if sweep:
        lines += [
            "",
            "Tile sweep (BLOCK_M, BLOCK_N, num_warps):",
            "",
            "| kernel | blocks | ms | of copy |",
            "|---|---|---|---|",
        ]
        lines += [f"| {r['kernel']} | {r['blocks']} | {r['ms']:.3f} | {r['of_copy']:.2f} |" for r in sweep]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quantize.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "quantize.jsonl"), "w") as f:
        for r in [{"gpu": gpu, "kernel": "copy", "ms": copy_ms, "GB/s": copy_gbs}] + rows + sweep:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
