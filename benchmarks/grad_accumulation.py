"""What summing micro-batch gradients in BF16 buffers costs, against the gradient's own noise.

    python benchmarks/grad_accumulation.py [--preset tiny] [--micro-batch 2] [--counts 1,4,16,64] [--out DIR]

COAT's default keeps Megatron DDP's gradient buffers in BF16: every micro-batch's weight gradient
is added into them and rounded to BF16 (round to nearest even) before the next. For each count N of
micro-batches, this builds the model twice from the same weights (``coat``: BF16 buffers;
``coat-fp32-grads``: FP32 buffers), runs one forward-backward of N micro-batches of the same
windows through Megatron's schedule, and compares the summed gradients:

- rounding error: ||g_bf16 - g_fp32|| / ||g_fp32|| over all parameters, and its worst parameter.
  COAT's linears write each wgrad's FP32 product into the buffer inside the GEMM, so the FP32
  buffer holds it unrounded, and at one micro-batch the error is one rounding to BF16 (the storage's
  own); the sum's roundings come on top with every further micro-batch;
- sampling noise, the yardstick: ||g_A - g_B|| / ||g_fp32|| for the FP32 gradients of the two halves
  of the micro-batches (each rescaled to the whole), i.e. how much the gradient moves when other
  text is drawn. Rounding error far below it is invisible to training.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from dataclasses import replace

import torch

from coat_compare import parallel
from coat_compare.build import build_gpt
from coat_compare.modes import MODES
from coat_compare.presets import get_preset
from coat_compare.train import token_loss_totals, training_windows


def summed_gradients(preset, mode, batches: list[dict], seed: int) -> dict[str, torch.Tensor]:
    """FP32 copies of every parameter's gradient summed over ``batches`` in ``mode``'s buffers."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    parallel.seed_everything(seed)
    (model,), _ = build_gpt(preset, mode, seed)  # one pipeline stage
    model.zero_grad_buffer()
    token_loss_totals(get_forward_backward_func(), [model], batches, preset, forward_only=False)
    return {name: p.main_grad.detach().float().clone() for name, p in model.named_parameters()}


def relative(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).square().sum()) for k in a)
    den = sum(float(b[k].square().sum()) for k in b)
    return (num / den) ** 0.5


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--counts", default="1,4,16,64")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    rows = []
    with contextlib.ExitStack() as stack:
        parallel.initialize(1, 1, stack)
        for n in counts:
            preset = replace(
                get_preset(args.preset), micro_batch=args.micro_batch, global_batch=args.micro_batch * n, steps=1
            )
            data = training_windows(preset, args.seed).batch(0)
            device = parallel.device()
            batches = [
                {k: v[i * args.micro_batch : (i + 1) * args.micro_batch].to(device) for k, v in data.items()}
                for i in range(n)
            ]
            bf16 = summed_gradients(preset, MODES["coat"], batches, args.seed)
            fp32 = summed_gradients(preset, MODES["coat-fp32-grads"], batches, args.seed)
            row = {"micro_batches": n, "rounding_error": relative(bf16, fp32),
                   "worst_parameter_error": max(relative({k: bf16[k]}, {k: fp32[k]}) for k in fp32 if fp32[k].any())}  # fmt: skip
            if n > 1:
                half = n // 2
                a = summed_gradients(preset, MODES["coat-fp32-grads"], batches[:half], args.seed)
                b = summed_gradients(preset, MODES["coat-fp32-grads"], batches[half:], args.seed)
                # Megatron divides each micro-batch's loss by the count: rescale each half to the whole
                a = {k: v * half / n for k, v in a.items()}
                b = {k: v * (n - half) / n for k, v in b.items()}
                row["sampling_noise"] = relative(a, b)
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grad_accumulation.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lines = [
        f"# Summing micro-batch gradients in BF16 against FP32 buffers: {args.preset}, micro-batch {args.micro_batch}, "
        f"on {parallel.device_name()}",
        "",
        f"`python benchmarks/grad_accumulation.py --preset {args.preset} --micro-batch {args.micro_batch} --counts {args.counts}`",
        "",
        "| micro-batches | rounding error (all parameters) | worst parameter | sampling noise (two halves) |",
        "|---|---|---|---|",
        *[
            f"| {r['micro_batches']} | {r['rounding_error']:.2e} | {r['worst_parameter_error']:.2e} | "
            + (f"{r['sampling_noise']:.2e} |" if "sampling_noise" in r else "- |")
            for r in rows
        ],
    ]
    with open(os.path.join(args.out, "grad_accumulation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
