"""What each weight-cache configuration costs per micro-batch on a preset's linear weights (GPU).

    python benchmarks/weight_passes.py [--preset llama2-7b] [--step-ms 174] [--out DIR]

Every COAT linear needs W's FP8 codes in its forward GEMM and W^T's in its dgrad GEMM, once per
micro-batch. What each configuration runs for that:

=============  ==================================================  ===========================
recipe         per micro-batch                                     per optimizer step
=============  ==================================================  ===========================
coat (default) W quantized from the BF16 weight with its kept amax  the amax (one read of W)
               (forward); W^T likewise (backward, one pass)
coat-codes     W^T transposed from W's kept codes (backward)       amax + W's codes
coat-cached    nothing                                             amax + W's and W^T's codes
=============  ==================================================  ===========================

Each pass is timed on every linear weight of one layer (QKV, output projection, fc1, fc2; CUDA
event medians from triton.testing.do_bench, which flushes L2) and summed over the layers. With
``--step-ms`` (the measured step time of one micro-batch) the table also gives each
configuration's share of it: what the default gives up for its bytes, before anything overlaps.
"""

from __future__ import annotations

import argparse
import os

import torch

from coat_compare.presets import Preset, get_preset
from coat_compare.report import write_markdown_and_rows


def linear_shapes(preset: Preset) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one layer's linear weights, stored (out, in) row-major
    as Megatron keeps them (TP 1): QKV (with GQA's narrower K and V), the output projection, fc1
    (gate and up together) and fc2."""
    h = preset.hidden
    kv = (preset.kv_heads or preset.heads) * (h // preset.heads)
    return [
        ("linear_qkv", h + 2 * kv, h),
        ("linear_proj", h, h),
        ("linear_fc1", 2 * preset.ffn, h),
        ("linear_fc2", h, preset.ffn),
    ]


def passes(w: torch.Tensor) -> dict:
    """The passes of the three configurations on one weight, as callables."""
    from coat_kernels import quantize_per_tensor, quantize_per_tensor_transposed, tensor_amax, transpose_codes

    amax = tensor_amax(w)
    q, _ = quantize_per_tensor(w, "e4m3", amax=amax, check_finite=False)
    return {
        "amax": lambda: tensor_amax(w),
        "W codes": lambda: quantize_per_tensor(w, "e4m3", amax=amax, check_finite=False),
        "W^T codes": lambda: quantize_per_tensor_transposed(w, "e4m3", amax=amax, check_finite=False),
        "W and W^T codes": lambda: quantize_per_tensor(w, "e4m3", transpose=True, amax=amax, check_finite=False),
        "transpose W's codes": lambda: transpose_codes(q),
    }


# which passes each configuration runs per micro-batch and per optimizer step
RECIPES = {
    "coat (default)": (("W codes", "W^T codes"), ("amax",)),
    "coat-codes": (("transpose W's codes",), ("amax", "W codes")),
    "coat-cached": ((), ("amax", "W and W^T codes")),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--step-ms", type=float, help="a measured step time of one micro-batch, ms")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/weight_passes.py times GPU kernels: run it on a CUDA machine")
    import triton

    preset = get_preset(args.preset)
    gpu = torch.cuda.get_device_name()
    per_shape = []
    for name, n_out, n_in in linear_shapes(preset):
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * 0.02
        times = {
            k: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for k, fn in passes(w).items()
        }
        per_shape.append({"weight": name, "shape": [n_out, n_in], "ms": times})
    layers = preset.layers
    totals = {}
    for recipe, (micro, step) in RECIPES.items():
        totals[recipe] = {
            "per_micro_batch_ms": layers * sum(s["ms"][k] for s in per_shape for k in micro),
            "per_step_ms": layers * sum(s["ms"][k] for s in per_shape for k in step),
        }
    lines = [
        f"# Weight passes per micro-batch: {preset.name} ({layers} layers), {gpu}",
        "",
        f"`python benchmarks/weight_passes.py --preset {preset.name}"
        + (f" --step-ms {args.step_ms:g}`" if args.step_ms else "`"),
        "",
        "| weight | shape (out, in) | " + " | ".join(f"{k} ms" for k in per_shape[0]["ms"]) + " |",
        "|---|---|" + "---|" * len(per_shape[0]["ms"]),
    ]
    for s in per_shape:
        lines.append(
            f"| {s['weight']} | {s['shape'][0]} x {s['shape'][1]} | "
            + " | ".join(f"{v:.4f}" for v in s["ms"].values())
            + " |"
        )
    lines += [
        "",
        "| recipe | per micro-batch ms | per optimizer step ms |"
        + (" share of a micro-batch step |" if args.step_ms else ""),
        "|---|---|---|" + ("---|" if args.step_ms else ""),
    ]
    for recipe, t in totals.items():
        share = f" {100 * t['per_micro_batch_ms'] / args.step_ms:.1f}% |" if args.step_ms else ""
        lines.append(f"| {recipe} | {t['per_micro_batch_ms']:.2f} | {t['per_step_ms']:.2f} |{share}")
    text = "\n".join(lines) + "\n"
    rows = [{"kind": "weight", "preset": preset.name, "device": gpu, **s} for s in per_shape]
    rows += [{"kind": "recipe", "preset": preset.name, "device": gpu, "recipe": r, **t} for r, t in totals.items()]
    write_markdown_and_rows(args.out, f"weight_passes-{preset.name}", text, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
