"""Accuracy of FP8 Adam states, on states captured from a real training run (CPU, no GPU needed).

    python benchmarks/optimizer_accuracy.py [--steps 400] [--out benchmarks/results/optimizer-states-accuracy-cpu]

1. Train a small character-level GPT on real English text (docstrings of the Python standard
   library) with torch.optim.AdamW (FP32 states) and capture its Adam states at a few steps.
2. One-shot error: quantize the captured m and v with each state format and measure the error of
   the update direction u = m_hat / (sqrt(v_hat) + eps) (bias-corrected, as the step uses it),
   over all parameters: relative L2 error ||u' - u|| / ||u||, and the MSE ratio to the baseline.
   The baseline is what Megatron's precision-aware optimizer stores with --exp-avg-dtype fp8
   --exp-avg-sq-dtype fp8 (TransformerEngine FusedAdam): E4M3 with one absmax scale per tensor.
3. Trajectories: train the same model from the same start with FP32 AdamW, CoatAdamW (and the
   variants worth comparing) and a per-tensor FP8 AdamW, and compare the losses.

Writes optimizer_accuracy.md (tables) and optimizer_accuracy.jsonl to --out.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import json
import math
import os
import time

import torch
from torch import nn

from coat_kernels import dequantize_expanded, dequantize_per_tensor, quantize_expanded, quantize_per_tensor
from coat_megatron import CoatConfig
from coat_megatron.optimizer import CoatAdamW

STDLIB = (
    "abc argparse ast asyncio bisect calendar collections contextlib csv dataclasses datetime decimal difflib "
    "doctest email enum fractions functools heapq http.client inspect ipaddress json logging pathlib pickle "
    "pprint random re shutil statistics string subprocess tarfile textwrap threading typing unittest zipfile"
).split()


def docstring_corpus() -> str:
    """Docstrings of modules, classes and functions of the standard library: real English prose."""
    seen, parts = set(), []
    for name in STDLIB:
        module = importlib.import_module(name)
        objects = [module] + [v for _, v in sorted(vars(module).items()) if inspect.isclass(v) or inspect.isfunction(v)]
        for obj in objects:
            members = [obj] + (
                [v for _, v in sorted(vars(obj).items()) if inspect.isfunction(v)] if inspect.isclass(obj) else []
            )
            for m in members:
                doc = inspect.getdoc(m)
                if doc and len(doc) > 100 and doc not in seen:
                    seen.add(doc)
                    parts.append(doc)
    return "\n\n".join(parts)


class GPT(nn.Module):
    def __init__(self, vocab=128, dim=128, layers=4, heads=4, seq=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x, mask=self.mask, is_causal=True)))


def batch(data, size, seq, g):
    idx = torch.randint(0, data.numel() - seq - 1, (size,), generator=g)
    return torch.stack([data[i : i + seq] for i in idx]), torch.stack([data[i + 1 : i + seq + 1] for i in idx])


class PerTensorFp8AdamW(torch.optim.AdamW):
    """AdamW whose m and v are E4M3 with one absmax scale per tensor, requantized after every step:
    what TE FusedAdam stores for Megatron's precision-aware optimizer with FP8 states."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    if f"{key}.fp8" in state:
                        q, s = state.pop(f"{key}.fp8")
                        state[key] = dequantize_per_tensor(q, s, torch.float32)
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[f"{key}.fp8"] = quantize_per_tensor(state.pop(key), "e4m3")


def train(model, optimizer, data, val, steps, args, capture_at=(), seed=0, after_step=None):
    """``after_step(step, model, optimizer)``: called after each optimizer step, the gradients still
    in ``p.grad``."""
    g = torch.Generator().manual_seed(seed)
    schedule = lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses, captured = [], {}
    for step in range(1, steps + 1):
        x, y = batch(data, args.batch, args.seq, g)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(step, model, optimizer)
        scheduler.step()
        losses.append(loss.item())
        if step in capture_at:
            captured[step] = {
                "m": [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()],
                "v": [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()],
            }
    with torch.no_grad():
        gv = torch.Generator().manual_seed(1234)
        val_loss = (
            sum(
                nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                for x, y in (batch(val, 64, args.seq, gv) for _ in range(8))
            )
            / 8
        )
    return losses, val_loss, captured


# --------------------------------------------------------------------------------- state formats


def per_tensor(x, signed=True):
    q, s = quantize_per_tensor(x, "e4m3")
    return dequantize_per_tensor(q, s, torch.float32)


def expanded(fmt="e4m3", expansion=True, k_min=1 / 16, k_max=16.0):
    def apply(x, signed=True):
        return dequantize_expanded(
            quantize_expanded(x.contiguous(), 128, fmt, signed, expansion=expansion, k_min=k_min, k_max=k_max)
        ).view(x.shape)

    return apply


def bf16(x, signed=True):
    return x.bfloat16().float()


FORMATS = {  # name: (m format, v format, bytes per parameter of m + v)
    "per-tensor E4M3 / E4M3 (Megatron precision-aware FP8, baseline)": (per_tensor, per_tensor, 2.0),
    "per-group-128 E4M3 / E4M3, no expansion": (expanded(expansion=False), expanded(expansion=False), 2.0625),
    "COAT E4M3+expand / E4M3+expand, k in [1/16, 16] (default)": (expanded(), expanded(), 2.1875),
    "COAT, k in [1, 16] for m only": (expanded(k_min=1.0), expanded(), 2.1875),
    "COAT, k in [1, 16] for m and v": (expanded(k_min=1.0), expanded(k_min=1.0), 2.1875),
    "COAT E4M3+expand / E5M2+expand": (expanded(), expanded("e5m2"), 2.1875),
    "COAT m expanded / v per-group without expansion": (expanded(), expanded(expansion=False), 2.125),
    "BF16 / BF16 (reference, twice the bytes)": (bf16, bf16, 4.0),
}


def update_direction(m, v, step, betas, eps):
    bc1, bc2 = 1 - betas[0] ** step, 1 - betas[1] ** step
    return (m / bc1) / ((v / bc2).sqrt() + eps)


def one_shot_errors(captured, betas, eps):
    rows = []
    for step, states in sorted(captured.items()):
        u = torch.cat([update_direction(m, v, step, betas, eps).reshape(-1) for m, v in zip(states["m"], states["v"])])
        nonzero_v = torch.cat([v.reshape(-1) > 0 for v in states["v"]])
        base_mse = None
        for name, (fm, fv, nbytes) in FORMATS.items():
            mq = [fm(m) for m in states["m"]]
            vq = [fv(v, signed=False) for v in states["v"]]
            uq = torch.cat([update_direction(m, v, step, betas, eps).reshape(-1) for m, v in zip(mq, vq)])
            err = uq - u
            mse = err.pow(2).mean().item()
            base_mse = mse if base_mse is None else base_mse
            v_flat = torch.cat([v.reshape(-1) for v in vq])
            m_flat, m_ref = torch.cat([m.reshape(-1) for m in mq]), torch.cat([m.reshape(-1) for m in states["m"]])
            rel_elem = (err.abs() / u.abs().clamp_min(1e-12))[u != 0]
            rows.append(
                {
                    "step": step,
                    "format": name,
                    "bytes_per_param": nbytes,
                    "rel_l2_error_u": (err.norm() / u.norm()).item(),
                    "mse_u": mse,
                    "mse_vs_baseline": mse / base_mse,
                    "median_rel_error_u": rel_elem.median().item(),
                    "m_rel_l2_error": ((m_flat - m_ref).norm() / m_ref.norm()).item(),
                    "v_underflow_fraction": ((v_flat == 0) & nonzero_v).float().mean().item(),
                }
            )
    return rows


def k_distribution(captured):
    """k of COAT's default on the captured states (DESIGN: about 2 for m, about 10 for v in COAT's runs)."""
    out = {}
    for step, states in sorted(captured.items()):
        for key, signed in (("m", True), ("v", False)):
            k = torch.cat([quantize_expanded(t.contiguous(), 128, "e4m3", signed).k for t in states[key]])
            out[f"{key}@{step}"] = {
                "mean": k.mean().item(),
                "p10": k.quantile(0.1).item(),
                "median": k.median().item(),
                "p90": k.quantile(0.9).item(),
            }
    return out


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The docstring GPT's run: steps, batch, sequence, width, depth, learning rate, seed (shared
    with state_drift.py)."""
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)


def corpus_splits() -> tuple[str, torch.Tensor, torch.Tensor]:
    """(the docstring text, its first 95% as ASCII codes for training, the rest for validation)."""
    text = docstring_corpus()
    data = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)
    split = int(0.95 * data.numel())
    return text, data[:split], data[split:]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--no-trajectories", action="store_true", help="only the one-shot error (about 4x faster)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/optimizer-states-accuracy-cpu"))
    args = p.parse_args()

    text, train_data, val_data = corpus_splits()
    torch.manual_seed(args.seed)
    init = GPT(dim=args.dim, layers=args.layers, seq=args.seq)
    n_params = sum(p.numel() for p in init.parameters())
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    capture_at = sorted({max(1, args.steps // 8), args.steps // 2, args.steps})
    print(f"corpus {len(text)} characters, model {n_params} parameters, {args.steps} steps, captures at {capture_at}")

    t0 = time.time()
    model = copy.deepcopy(init)
    fp32_losses, fp32_val, captured = train(
        model,
        torch.optim.AdamW(model.parameters(), **hyper),
        train_data,
        val_data,
        args.steps,
        args,
        capture_at,
        args.seed,
    )
    print(
        f"FP32 AdamW: loss {fp32_losses[0]:.3f} -> {sum(fp32_losses[-20:]) / 20:.3f}, val {fp32_val:.4f} ({time.time() - t0:.0f} s)"
    )
    errors = one_shot_errors(captured, hyper["betas"], hyper["eps"])
    ks = k_distribution(captured)

    runs = [
        {
            "optimizer": "torch AdamW, FP32 states",
            "final_loss": sum(fp32_losses[-20:]) / 20,
            "val_loss": fp32_val,
            "max_gap": 0.0,
            "mean_gap": 0.0,
        }
    ]
    if not args.no_trajectories:
        candidates = {
            "CoatAdamW, default (k in [1/16, 16])": lambda ps: CoatAdamW(ps, **hyper),
            "CoatAdamW, k in [1, 16]": lambda ps: CoatAdamW(ps, **hyper, config=CoatConfig(k_min=1.0)),
            "CoatAdamW, expansion off (per-group 128 absmax)": lambda ps: CoatAdamW(
                ps, **hyper, config=CoatConfig(m_expansion=False, v_expansion=False)
            ),
            "per-tensor E4M3 AdamW (Megatron precision-aware FP8)": lambda ps: PerTensorFp8AdamW(ps, **hyper),
        }
        for name, make in candidates.items():
            t0 = time.time()
            model = copy.deepcopy(init)
            losses, val, _ = train(
                model, make(model.parameters()), train_data, val_data, args.steps, args, seed=args.seed
            )
            gaps = [a - b for a, b in zip(losses, fp32_losses)]
            runs.append(
                {
                    "optimizer": name,
                    "final_loss": sum(losses[-20:]) / 20,
                    "val_loss": val,
                    "max_gap": max(abs(x) for x in gaps),
                    "mean_gap": sum(gaps[-100:]) / min(100, len(gaps)),
                }
            )
            print(f"{name}: final {runs[-1]['final_loss']:.4f}, val {val:.4f} ({time.time() - t0:.0f} s)")

    last = max(captured)
    at_last = [r for r in errors if r["step"] == last]
    base = at_last[0]["rel_l2_error_u"]
    lines = [
        "# FP8 Adam states: error of the update direction on captured states",
        "",
        f"Command: `python benchmarks/optimizer_accuracy.py --steps {args.steps}` (CPU; torch {torch.__version__}).",
        f"Model: character-level GPT, {args.layers} layers, width {args.dim}, {n_params} parameters, trained {args.steps} steps "
        f"on {len(text)} characters of Python standard-library docstrings with torch AdamW (lr {args.lr}, betas (0.9, 0.95), wd 0.1, "
        f"warmup + cosine), batch {args.batch} x {args.seq}. FP32 loss {fp32_losses[0]:.3f} -> {sum(fp32_losses[-20:]) / 20:.3f}.",
        "",
        "u = m_hat / (sqrt(v_hat) + eps), the bias-corrected update direction; errors over all parameters.",
        "Baseline: one absmax scale per tensor, E4M3 (TransformerEngine FusedAdam's FP8 states).",
        "",
        f"## At step {last}",
        "",
        "| m / v format | bytes/param | rel. L2 error of u | vs baseline | MSE of u vs baseline | median rel. error | v underflow |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in at_last:
        lines.append(
            f"| {r['format']} | {r['bytes_per_param']:.4g} | {r['rel_l2_error_u']:.4f} | {r['rel_l2_error_u'] / base:.3f} | "
            f"{r['mse_vs_baseline']:.3g} | {r['median_rel_error_u']:.4f} | {r['v_underflow_fraction']:.2%} |"
        )
    lines += [
        "",
        "## All captures (relative L2 error of u)",
        "",
        "| m / v format | " + " | ".join(f"step {s}" for s in sorted(captured)) + " |",
        "|---|" + "---|" * len(captured),
    ]
    for name in FORMATS:
        lines.append(
            f"| {name} | " + " | ".join(f"{r['rel_l2_error_u']:.4f}" for r in errors if r["format"] == name) + " |"
        )
    lines += [
        "",
        "## k of COAT's default on these states",
        "",
        "| state@step | mean | p10 | median | p90 |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {key} | {d['mean']:.2f} | {d['p10']:.2f} | {d['median']:.2f} | {d['p90']:.2f} |" for key, d in ks.items()
    ]
    if len(runs) > 1:
        lines += [
            "",
            "## Training with each state format (same start, same batches)",
            "",
            "| optimizer | final train loss (mean of last 20) | val loss | max abs gap to FP32 | mean gap, last 100 steps |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['optimizer']} | {r['final_loss']:.4f} | {r['val_loss']:.4f} | {r['max_gap']:.4f} | {r['mean_gap']:+.4f} |"
            for r in runs
        ]
    text_out = "\n".join(lines) + "\n"
    print(text_out)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "optimizer_accuracy.md"), "w") as f:
        f.write(text_out)
    with open(os.path.join(args.out, "optimizer_accuracy.jsonl"), "w") as f:
        for row in errors + [{"k": ks}] + runs:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
