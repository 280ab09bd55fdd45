"""Where one transformer layer's fwd+bwd spends its GPU time, kernel by kernel, per mode.

    python benchmarks/layer_profile.py [--preset llama2-7b-layer] [--modes coat,te-fp8-current] [--out DIR]

Builds the layer exactly as ``coat-compare`` does, warms it up, then profiles ``--repeats`` fwd+bwd
with ``torch.profiler`` and sums each kernel's GPU time per fwd+bwd. Kernels are put in classes
(GEMM, attention, quantize/cast, norm, SwiGLU, elementwise, other) so that two modes' totals can be
compared class by class: where COAT's layer is slower than TE's, this says which kernels cost it.
Writes layer_profile.md and layer_profile.jsonl to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import defaultdict

import torch

CLASSES = [  # (class, substrings of kernel names), first match wins
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "_scaled_mm")),
    ("attention", ("flash", "fmha", "sdpa", "attn", "softmax", "dot_do_o", "convert_dq")),
    ("norm", ("norm",)),
    ("SwiGLU", ("swiglu", "silu")),
    ("quantize / cast / transpose", ("quantize", "cast", "transpose", "amax", "scale", "refresh")),
    ("rope", ("rope", "rotary", "cos_kernel", "sin_kernel")),
    ("elementwise / copy / reduce", ("elementwise", "copy", "reduce", "fill", "cat", "memset", "memcpy")),
]


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profile_layer(preset, mode, repeats: int, seed: int = 1234) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from coat_compare.layer import LayerStep

    run = LayerStep(preset, mode, seed)

    def step():
        run.step()
        run.clear_grads()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time_total / 1e3 / repeats  # ms per fwd+bwd
    by_class = defaultdict(float)
    for name, ms in per_kernel.items():
        by_class[kernel_class(name)] += ms
    return {
        "mode": mode.name,
        "preset": preset.name,
        "total_ms": sum(per_kernel.values()),
        "by_class_ms": dict(by_class),
        "kernels_ms": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama2-7b-layer")
    p.add_argument("--modes", default="coat,te-fp8-current,bf16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/layer_profile.py profiles GPU kernels: run it on a CUDA machine")
    from coat_compare import parallel
    from coat_compare.modes import parse_modes
    from coat_compare.presets import get_preset

    preset = get_preset(args.preset)
    rows = []
    with contextlib.ExitStack() as stack:
        parallel.initialize(1, 1, stack)
        for mode in parse_modes(args.modes):
            parallel.free_memory()
            parallel.seed_everything(1234)
            rows.append(profile_layer(preset, mode, args.repeats))
            print(f"{mode.name}: {rows[-1]['total_ms']:.2f} ms of kernels per fwd+bwd", flush=True)
    classes = [c for c, _ in CLASSES] + ["other"]
    lines = [
        f"# GPU time per kernel class, one {preset.name} fwd+bwd ({torch.cuda.get_device_name()})",
        "",
        f"`python benchmarks/layer_profile.py --preset {args.preset} --modes {args.modes}`",
        "",
        "Sum of kernel times (ms per fwd+bwd, torch.profiler; kernels only, gaps between them excluded).",
        "",
        "| class | " + " | ".join(r["mode"] for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for c in classes:
        lines.append(f"| {c} | " + " | ".join(f"{r['by_class_ms'].get(c, 0.0):.3f}" for r in rows) + " |")
    lines.append("| **total** | " + " | ".join(f"**{r['total_ms']:.3f}**" for r in rows) + " |")
    for r in rows:
        lines += ["", f"## {r['mode']}: kernels by GPU time (ms per fwd+bwd)", "", "```"]
        lines += [
            f"{ms:8.3f}  {kernel_class(name):28s} {name[:100]}" for name, ms in list(r["kernels_ms"].items())[:30]
        ]
        lines += ["```"]
    text = "\n".join(lines) + "\n"
    from coat_compare.report import write_markdown_and_rows

    write_markdown_and_rows(args.out, "layer_profile", text, rows)


if __name__ == "__main__":
    main()
