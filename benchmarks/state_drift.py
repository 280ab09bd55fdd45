"""Drift of FP8 Adam states written every step, against FP32 Adam on the same gradients (CPU).

    python benchmarks/state_drift.py [--steps 400] [--out benchmarks/results/optimizer-state-drift-cpu]

``optimizer_accuracy.py`` quantizes FP32 states once (one-shot error). A real FP8 optimizer writes
its states back to FP8 after every step, and each write rounds: where a step's change to m or v is
below half a code's spacing, round-to-nearest returns the old code, so the state stops following
its gradients (v with beta2 = 0.95 moves 5% of (g^2 - v) per step; an E4M3 code's spacing is 12.5%
before the expansion, 12.5% / k after it). Such errors do not average out: they accumulate.

This trains the docstring GPT of ``optimizer_accuracy.py`` with torch AdamW (FP32 states: the
reference trajectory), and beside it, teacher-forced on the same gradients, keeps each candidate's
states as the optimizer would: m <- Q(beta1 m + (1 - beta1) g), v <- Q(beta2 v + (1 - beta2) g^2),
the update of each step computed from the new FP32 values before they are stored (as
``coat_kernels.fp8_adamw`` does). The parameters follow the reference, so the candidates differ only
in their states. Every ``--every`` steps it records, over all parameters:

- the relative L2 error of the update u = m_hat / (sqrt(v_hat) + eps) against the reference's;
- ||u|| / ||u_ref||: below 1 the candidate steps shorter (v held too high, or m too low);
- the median of v / v_ref: the bias of the second moment;
- the one-shot error of COAT's format on the reference states of that step, the floor a format
  without accumulation would give.

Candidates: BF16 states; per-tensor E4M3 (Megatron's precision-aware FP8 states, round to
nearest); COAT's default (1x128 groups, dynamic range expansion, round to nearest); the same with
stochastic rounding of the stored codes (m and v, or v only): rounding up with probability equal
to the distance to the lower code over the spacing, which is unbiased, so the writes' errors no
longer accumulate in one direction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optimizer_accuracy import (  # noqa: E402
    GPT,
    add_model_args,
    bf16,
    corpus_splits,
    per_tensor,
    train,
    update_direction,
)

from coat_kernels.expanded import (  # noqa: E402
    dequantize_expanded_groups_reference,
    quantize_expanded_groups_reference,
)
from coat_kernels.formats import fp8_format  # noqa: E402

BETAS = (0.9, 0.95)
EPS = 1e-8
GROUP = 128
MANTISSA = {"e4m3": (3, -6), "e5m2": (2, -14)}  # mantissa bits, least normal exponent


def stochastic_round(y: torch.Tensor, fmt: str, g: torch.Generator) -> torch.Tensor:
    """``y`` (already scaled into the format's range) to one of its two neighbouring FP8 values,
    the upper with probability (y - lower) / spacing: unbiased, E[result] = y."""
    bits, min_exp = MANTISSA[fmt]
    a = y.abs()
    exp = torch.floor(torch.log2(torch.where(a > 0, a, 1.0))).clamp_min(min_exp)
    spacing = torch.exp2(exp - bits)
    r = torch.floor(a / spacing + torch.rand(a.shape, generator=g)) * spacing
    return torch.copysign(r.clamp_max(fp8_format(fmt).max), y)


def expanded(fmt: str = "e4m3", stochastic: bool = False):
    """COAT's state format (1x128 groups, dynamic range expansion), rounding to nearest or
    stochastically; returns the dequantized FP32 state."""

    def apply(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        f = fp8_format(fmt)
        n = x.numel()
        groups = -(-n // GROUP)
        flat = torch.nn.functional.pad(x.reshape(-1).float(), (0, groups * GROUP - n)).view(groups, GROUP)
        y, scale, k, center = quantize_expanded_groups_reference(flat, f.max, True, 1 / 16, 16.0)
        codes = (stochastic_round(y, fmt, g) if stochastic else y).to(f.dtype).float()
        return dequantize_expanded_groups_reference(codes, scale, k, center, True).reshape(-1)[:n].view(x.shape)

    return apply


def deterministic(fmt):
    """One of optimizer_accuracy.py's state formats (rounding to nearest), with this file's signature."""
    return lambda x, g: fmt(x.contiguous())


CANDIDATES = {  # name: (m's format, v's format)
    "BF16 / BF16": (deterministic(bf16), deterministic(bf16)),
    "per-tensor E4M3 / E4M3, nearest (Megatron precision-aware FP8)": (
        deterministic(per_tensor),
        deterministic(per_tensor),
    ),
    "COAT default: 1x128 E4M3 + expansion, nearest": (expanded(), expanded()),
    "COAT, v E5M2 + expansion, nearest": (expanded(), expanded("e5m2")),
    "COAT, stochastic rounding of v": (expanded(), expanded(stochastic=True)),
    "COAT, stochastic rounding of m and v": (expanded(stochastic=True), expanded(stochastic=True)),
}


class Tracker:
    """Each candidate's states, written every step from the reference run's gradients."""

    def __init__(self, every: int, seed: int):
        self.every = every
        self.g = torch.Generator().manual_seed(seed)
        self.states: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.rows: list[dict] = []

    def __call__(self, step: int, model, optimizer) -> None:
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad.float() for p in params]
        record = step % self.every == 0
        if record:
            ref_m = [optimizer.state[p]["exp_avg"] for p in params]
            ref_v = [optimizer.state[p]["exp_avg_sq"] for p in params]
            u_ref = torch.cat([update_direction(m, v, step, BETAS, EPS).reshape(-1) for m, v in zip(ref_m, ref_v)])
            v_ref = torch.cat([v.reshape(-1) for v in ref_v])
            one_shot_m, one_shot_v = CANDIDATES["COAT default: 1x128 E4M3 + expansion, nearest"]
            u_once = torch.cat(
                [
                    update_direction(one_shot_m(m, self.g), one_shot_v(v, self.g), step, BETAS, EPS).reshape(-1)
                    for m, v in zip(ref_m, ref_v)
                ]
            )
            once = ((u_once - u_ref).norm() / u_ref.norm()).item()
        for name, (fm, fv) in CANDIDATES.items():
            old = self.states.get(name) or [(torch.zeros_like(g), torch.zeros_like(g)) for g in grads]
            new = [
                (BETAS[0] * m + (1 - BETAS[0]) * g, BETAS[1] * v + (1 - BETAS[1]) * g * g)
                for (m, v), g in zip(old, grads)
            ]
            if record:
                u = torch.cat([update_direction(m, v, step, BETAS, EPS).reshape(-1) for m, v in new])
                v_all = torch.cat([v.reshape(-1) for _, v in new])
                live = v_ref > 0
                self.rows.append(
                    {
                        "step": step,
                        "candidate": name,
                        "rel_l2_error_u": ((u - u_ref).norm() / u_ref.norm()).item(),
                        "norm_ratio_u": (u.norm() / u_ref.norm()).item(),
                        "median_v_ratio": (v_all[live] / v_ref[live]).median().item(),
                        "one_shot_coat": once,
                    }
                )
            self.states[name] = [(fm(m, self.g), fv(v.clamp_min(0), self.g)) for m, v in new]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/optimizer-state-drift-cpu"))
    args = p.parse_args()

    _, train_data, val_data = corpus_splits()
    torch.manual_seed(args.seed)
    model = GPT(dim=args.dim, layers=args.layers, seq=args.seq)
    n_params = sum(q.numel() for q in model.parameters())
    tracker = Tracker(args.every, args.seed)
    t0 = time.time()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=EPS, weight_decay=0.1)
    losses, val, _ = train(model, optimizer, train_data, val_data, args.steps, args, seed=args.seed, after_step=tracker)
    print(f"{n_params} parameters, {args.steps} steps in {time.time() - t0:.0f} s; loss {losses[0]:.3f} -> {val:.3f}")

    steps = sorted({r["step"] for r in tracker.rows})
    by = {(r["candidate"], r["step"]): r for r in tracker.rows}
    shown = ("steps", "every", "batch", "seq", "dim", "layers", "lr", "seed")
    command = "python benchmarks/state_drift.py" + "".join(
        f" --{k} {getattr(args, k)}" for k in shown if getattr(args, k) != p.get_default(k)
    )
    lines = [
        "# FP8 Adam states written every step: drift against FP32 Adam on the same gradients",
        "",
        f"Command: `{command}` (CPU; torch {torch.__version__}).",
        f"Model: the character-level GPT of optimizer_accuracy.py, {args.layers} layers, width {args.dim}, {n_params} "
        f"parameters, {args.steps} steps of batch {args.batch} x {args.seq}, torch AdamW (lr {args.lr}, betas {BETAS}, "
        f"eps {EPS}, wd 0.1); validation loss {val:.3f}. Each candidate keeps its own m and v from the same gradients "
        "(teacher-forced: the parameters follow FP32 AdamW), written to its format after every step.",
        "",
        "u = m_hat / (sqrt(v_hat) + eps), each step's update direction before the learning rate.",
        "",
        "## Relative L2 error of u against FP32 states",
        "",
        "| candidate | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|" + "---|" * len(steps),
    ]
    for name in CANDIDATES:
        lines.append(f"| {name} | " + " | ".join(f"{by[name, s]['rel_l2_error_u']:.4f}" for s in steps) + " |")
    first = next(iter(CANDIDATES))
    lines.append(
        "| one-shot: COAT's format applied once to the FP32 states of that step | "
        + " | ".join(f"{by[first, s]['one_shot_coat']:.4f}" for s in steps)
        + " |"
    )
    for title, key in (
        ("||u|| / ||u_ref||: below 1, the candidate's steps are shorter", "norm_ratio_u"),
        ("Median of v / v_ref: the second moment's bias", "median_v_ratio"),
    ):
        lines += ["", f"## {title}", "", "| candidate | " + " | ".join(f"step {s}" for s in steps) + " |"]
        lines.append("|---|" + "---|" * len(steps))
        for name in CANDIDATES:
            lines.append(f"| {name} | " + " | ".join(f"{by[name, s][key]:.4f}" for s in steps) + " |")
    out_text = "\n".join(lines) + "\n"
    print(out_text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "state_drift.md"), "w") as f:
        f.write(out_text)
    with open(os.path.join(args.out, "state_drift.jsonl"), "w") as f:
        for row in tracker.rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
