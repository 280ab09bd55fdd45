"""Why Megatron's precision-aware optimizer with FP8 moments (coat-compare's ``te-fp8-pa``) diverges:
a CPU emulation of what TransformerEngine's FusedAdam stores, on a GPT with gpt-1b's vocabulary.

    python benchmarks/pa_optimizer_emulation.py                  # vocabulary 32000, lr 3e-3: diverges
    python benchmarks/pa_optimizer_emulation.py --vocab 256 --formats fp32,te-fp8 --name vocab256
    python benchmarks/pa_optimizer_emulation.py --lr 3e-4 --formats fp32,te-fp8,coat --name lr3e-4

What is emulated. ``--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8``
(OptimizerConfig ``exp_avg_dtype = exp_avg_sq_dtype = torch.uint8``) makes TE FusedAdam keep each
moment of each optimizer parameter (with the distributed optimizer: each FP32 main-param shard; with
one data-parallel rank: each whole parameter) as one E4M3 tensor with ONE scale. Every step it
dequantizes both moments to FP32, runs its FP32 AdamW kernel, and requantizes each with
scale_inv = amax / 448 of the new moment (``FusedAdam._apply_scale``); ``te_per_tensor_e4m3`` is
that rule. E4M3 spans 2^-9 (smallest subnormal) to 448, about 2^17.8, and one scale per tensor
spends that range on the tensor's largest element.

Why it breaks. v is the square of the gradient, so it spans twice m's octaves. An element whose
gradient is below about 2^-9.4 = 1/670 of its tensor's largest has v < amax_v * 2^-10 / 448 and
loses v to zero, while its m, 670x further from underflow, survives. Its next update is
m_hat / (sqrt((1 - beta2) g^2 / bc2) + eps): about 4.5x the exact one for a steady gradient,
larger for a shrinking one, and m_hat / eps for a zero gradient (a token absent from the batch).
Exact Adam's |m_hat / sqrt(v_hat)| never exceeds ``adam_update_bound`` (at most 1.17 for betas
0.9/0.95), so larger updates are quantization artefacts.

gpt-1b in coat-compare makes the spread extreme: a 32000-entry vocabulary with byte tokens, of which
107 occur in the corpus. The output-layer rows of the other 31893 get gradients p_j * h, about 1e-3
of the used rows' from the first step and shrinking as training pushes their logits down: their v
is lost from step 1 on and their updates run up to 1e4x exact Adam's largest. The over-sized steps
first push unseen-token logits down faster than FP32 Adam (the loss falls faster), then overshoot:
at the first spike (loss far above ln(32000)) every position predicts a never-seen token.

What runs. A small Llama-style GPT (RMSNorm, RoPE, SwiGLU, untied embeddings, init as coat-compare's
``init_weights_by_name``) on coat-compare's byte corpus, from the same start on the same batches,
with coat-compare's optimizer settings (AdamW after a 10-step linear warm-up, then a constant
learning rate, betas 0.9/0.95, eps 1e-8, weight decay 0.1, global-norm clipping 1.0) and the
learning rate of its tiny preset, 3e-3 (at gpt-1b's 3e-4 this small model shows the same
artefacts but learns too slowly in 40 steps for them to spike the loss). Moments stored as:

- fp32: Megatron's default (TE FusedAdam with FP32 states),
- te-fp8: E4M3 m and v, one scale per tensor (the precision-aware optimizer's fp8 / fp8),
- te-fp8-m/bf16-v: E4M3 per-tensor m, BF16 v (``--exp-avg-dtype fp8 --exp-avg-sq-dtype bf16``),
- te-bf16-m/fp8-v: BF16 m, E4M3 per-tensor v (``--exp-avg-dtype bf16 --exp-avg-sq-dtype fp8``),
- coat: COAT's state format (``coat_kernels.quantize_expanded``: E4M3, groups of 128 with dynamic
  range expansion, CoatConfig's defaults), as CoatAdamW stores it.

Per step and format it records the loss, the share of positions whose prediction (argmax) is a
never-seen token (shown at the first loss spike), the fraction of elements whose v is lost (had a
nonzero gradient, stored 0), the fraction with m stored nonzero and v stored zero ("m alive, v
dead"), the fraction of updates over 1.5x exact Adam's bound and the largest |update|, overall and
for the output layer. Writes NAME.md and
NAME.jsonl to --out (default $OUT or benchmarks/results/te-fp8-pa-divergence-1gpu/emulation-cpu).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from coat_compare.corpus import ByteBatches, stdlib_docstrings
from coat_kernels import dequantize_expanded, quantize_expanded
from coat_megatron import CoatConfig

E4M3_MAX = 448.0  # FusedAdam.dtype_to_range_map[torch.uint8]
# An update counts as blown up above this multiple of exact Adam's largest: rounding m and v to E4M3
# normals (3 mantissa bits: m within 2^-4, sqrt(v) within 2^-5) moves it by under 10%; a lost v, or
# an m rounded among the few subnormal codes, gets there.
OVER_BOUND = 1.5


# ------------------------------------------------------------------------------ state formats


def te_per_tensor_e4m3(x: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """x (FP32, any shape) stored as TE FusedAdam stores an FP8 moment, read back as FP32.

    FusedAdam._apply_scale: scale_inv = amax / 448 (one FP32 value for the whole tensor), the
    quantizer's scale = 1 / scale_inv, codes = E4M3(x * scale) rounded to nearest; reading back
    multiplies the codes by scale_inv. (An all-zero tensor would get scale_inv 0 there; it cannot
    occur after a step of these models, and is kept at 0 here.)
    """
    amax = x.abs().max()
    if amax == 0:
        return torch.zeros_like(x)
    scale_inv = amax / E4M3_MAX
    scale = 1.0 / scale_inv
    return (x * scale).to(torch.float8_e4m3fn).float() * (1.0 / scale)


def bf16(x: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """FusedAdam's BF16 state: a plain cast, no scale."""
    return x.bfloat16().float()


def coat_expanded(x: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """COAT's state format with CoatConfig's defaults (E4M3, groups of 128, expansion, k in [1/16, 16])."""
    c = CoatConfig()
    state = quantize_expanded(
        x.contiguous(),
        c.optimizer_group_size,
        c.m_format if signed else c.v_format,
        signed=signed,
        expansion=True,
        k_min=c.k_min,
        k_max=c.k_max,
        backend="reference",
    )
    return dequantize_expanded(state, torch.float32, backend="reference").view(x.shape)


def fp32(x: torch.Tensor, signed: bool = True) -> torch.Tensor:
    return x


FORMATS = {  # name: (how m is stored, how v is stored)
    "fp32": (fp32, fp32),
    "te-fp8": (te_per_tensor_e4m3, te_per_tensor_e4m3),
    "te-fp8-m/bf16-v": (te_per_tensor_e4m3, bf16),
    "te-bf16-m/fp8-v": (bf16, te_per_tensor_e4m3),
    "coat": (coat_expanded, coat_expanded),
}


def adam_update_bound(step: int, beta1: float, beta2: float) -> float:
    """The largest |m_hat / sqrt(v_hat)| exact Adam can produce at ``step`` (1-based), any gradients.

    m_t = (1 - b1) sum_i b1^(t-i) g_i and v_t = (1 - b2) sum_i b2^(t-i) g_i^2, so by Cauchy-Schwarz
    |m_t| <= (1 - b1) sqrt(sum_j (b1^2 / b2)^j) sqrt(v_t / (1 - b2)); with the bias corrections
    bc1 = 1 - b1^t, bc2 = 1 - b2^t this bounds the update direction. Needs b1^2 < b2.
    """
    ratio = beta1 * beta1 / beta2
    series = (1 - ratio**step) / (1 - ratio)
    return (1 - beta1) / (1 - beta1**step) * math.sqrt(series * (1 - beta2**step) / (1 - beta2))


class EmulatedAdamW:
    """AdamW as TE FusedAdam's FP32 kernel computes it (adam_w_mode=1: decoupled weight decay,
    bias correction, eps outside the square root) with m and v stored between steps in ``fmt``.

    FP32 parameters; ``step`` applies Megatron's global-norm gradient clipping first and returns the
    step's statistics (see the module docstring)."""

    def __init__(
        self,
        named_params,
        fmt: str,
        lr: float,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        clip_grad: float = 1.0,
        watch: str = "output.weight",
    ):
        self.params = dict(named_params)
        self.store_m, self.store_v = FORMATS[fmt]
        self.lr, self.betas, self.eps, self.wd, self.clip = lr, betas, eps, weight_decay, clip_grad
        self.m = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.v = {n: torch.zeros_like(p) for n, p in self.params.items()}
        # elements that have had a nonzero gradient: exact Adam's v is > 0 there from then on
        self.seen = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in self.params.items()}
        self.t = 0
        self.watch = watch

    @torch.no_grad()
    def step(self) -> dict:
        self.t += 1
        b1, b2 = self.betas
        grads = {n: p.grad.float() for n, p in self.params.items()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        clip = min(1.0, self.clip / (norm.item() + 1e-6))
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        bound = adam_update_bound(self.t, b1, b2)
        totals = dict(
            n=0,
            v_lost=0,
            m_alive_v_dead=0,
            over_bound=0,
            max_update=0.0,
            watch_over_bound=0,
            watch_n=0,
            watch_max_update=0.0,
        )
        for name, p in self.params.items():
            g = grads[name] * clip
            seen = self.seen[name].logical_or_(g != 0)
            m = self.m[name].mul_(b1).add_(g, alpha=1 - b1)
            v = self.v[name].mul_(b2).addcmul_(g, g, value=1 - b2)
            u = (m / bc1) / ((v / bc2).sqrt() + self.eps)
            p.sub_(self.lr * (u + self.wd * p))
            stored_m, stored_v = self.store_m(m, signed=True), self.store_v(v, signed=False)
            over = int((u.abs() > OVER_BOUND * bound).sum())
            totals["n"] += u.numel()
            totals["v_lost"] += int((seen & (stored_v == 0)).sum())
            totals["m_alive_v_dead"] += int(((stored_m != 0) & (stored_v == 0)).sum())
            totals["over_bound"] += over
            totals["max_update"] = max(totals["max_update"], u.abs().max().item())
            if name == self.watch:
                totals.update(watch_over_bound=over, watch_n=u.numel(), watch_max_update=u.abs().max().item())
            self.m[name], self.v[name] = stored_m.clone(), stored_v.clone()
        n, wn = totals.pop("n"), max(1, totals.pop("watch_n"))
        return {
            "grad_norm": norm.item(),
            "update_bound": bound,
            "v_lost": totals["v_lost"] / n,
            "m_alive_v_dead": totals["m_alive_v_dead"] / n,
            "over_bound": totals["over_bound"] / n,
            "max_update": totals["max_update"],
            "output_over_bound": totals["watch_over_bound"] / wn,
            "output_max_update": totals["watch_max_update"],
        }


# ------------------------------------------------------------------------------ the model


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (batch, heads, seq, head_dim) queries or keys (base 10000)."""
    seq, dim = x.shape[-2], x.shape[-1]
    freqs = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.input_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.linear_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.linear_proj = nn.Linear(dim, dim, bias=False)
        self.pre_mlp_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.linear_fc1 = nn.Linear(dim, 2 * ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (
            self.linear_qkv(self.input_layernorm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        attn = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + self.linear_proj(attn.transpose(1, 2).reshape(b, s, d))
        gate, up = self.linear_fc1(self.pre_mlp_layernorm(x)).chunk(2, dim=-1)
        return x + self.linear_fc2(F.silu(gate) * up)


class LlamaGPT(nn.Module):
    """A Llama-style GPT with Megatron's parameter names where they matter (``output.weight``)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int, seed: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.final_layernorm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # coat-compare's init_weights_by_name: N(0, 0.02), output projections / sqrt(2 L)
            for name, p in self.named_parameters():
                if p.dim() > 1:
                    std = (
                        0.02 / math.sqrt(2 * layers)
                        if name.endswith(("linear_proj.weight", "linear_fc2.weight"))
                        else 0.02
                    )
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.final_layernorm(x))


# ------------------------------------------------------------------------------ the runs


def train(init: nn.Module, fmt: str, data: ByteBatches, unseen: torch.Tensor, args) -> list[dict]:
    """Train a copy of ``init`` with moments stored in ``fmt``; one row of statistics per step.
    ``unseen``: (vocab,) bool, the tokens that never occur in the corpus."""
    model = copy.deepcopy(init)
    opt = EmulatedAdamW(model.named_parameters(), fmt, lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    warmup = args.warmup
    rows = []
    for step in range(args.steps):
        batch = data.batch(generator)
        opt.lr = args.lr * min(1.0, (step + 1) / warmup)  # coat-compare's set_learning_rate
        logits = model(batch["tokens"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        model.zero_grad(set_to_none=True)
        loss.backward()
        stats = opt.step()
        predicts_unseen = unseen[logits.detach().argmax(-1)].float().mean().item()
        rows.append(
            {
                "format": fmt,
                "step": step + 1,
                "loss": loss.item(),
                "lr": opt.lr,
                "predicts_unseen": predicts_unseen,
                **stats,
            }
        )
        if not math.isfinite(loss.item()):
            break
    return rows


def report(rows: list[dict], args, n_params: int, n_unseen: int, seconds: float) -> str:
    by_fmt = {}
    for r in rows:
        by_fmt.setdefault(r["format"], []).append(r)
    steps = sorted({r["step"] for r in rows})
    shown = [s for s in steps if s <= 3 or s % 5 == 0 or s == steps[-1]]
    lines = [
        "# Megatron's precision-aware optimizer with FP8 moments, emulated on the CPU",
        "",
        f"Command: `python benchmarks/pa_optimizer_emulation.py {command_line(args)}` (torch {torch.__version__}, {seconds:.0f} s).",
        f"Model: Llama-style GPT, {args.layers} layers, hidden {args.dim}, vocabulary {args.vocab} ({n_unseen} entries never occur in "
        f"the corpus), {n_params / 1e6:.2f} M parameters; byte tokens of the standard-library docstrings (coat-compare's corpus), "
        f"batch {args.batch} x {args.seq}; AdamW lr {args.lr:g} after a {args.warmup}-step linear warm-up, then constant, "
        "betas 0.9/0.95, eps 1e-8, weight decay 0.1, clip 1.0; the same start and batches for every format.",
        "",
        "## Loss per step",
        "",
        "| step | " + " | ".join(by_fmt) + " |",
        "|---|" + "---|" * len(by_fmt),
    ]
    for s in shown:
        lines.append(
            f"| {s} | "
            + " | ".join(next((f"{r['loss']:.3f}" for r in rs if r["step"] == s), "-") for rs in by_fmt.values())
            + " |"
        )
    lines.append("| largest | " + " | ".join(f"{max(r['loss'] for r in rs):.3f}" for rs in by_fmt.values()) + " |")
    # the first spike: the first step after the warm-up whose loss is above the untrained model's
    spikes = [
        next((r for r in rs if r["step"] > args.warmup and r["loss"] > rs[0]["loss"]), None) for rs in by_fmt.values()
    ]
    lines.append(
        "| first spike above step 1's loss | " + " | ".join(str(r["step"]) if r else "none" for r in spikes) + " |"
    )
    lines.append(
        "| there: positions predicting a never-seen token | "
        + " | ".join(f"{r['predicts_unseen']:.1%}" if r else "-" for r in spikes)
        + " |"
    )
    lines += [
        "",
        "## What the stored moments do to the update (mean over steps 2..end; largest over all steps)",
        "",
        "v lost: elements that have had a nonzero gradient (exact Adam's v > 0) whose v is stored as 0. "
        "m alive, v dead: stored m != 0 and stored v == 0; the next update of such an element is "
        "m_hat / (sqrt((1 - beta2) g^2 / bc2) + eps), m_hat / eps if its gradient is 0. "
        "Over bound: updates |m_hat / (sqrt(v_hat) + eps)| more than 1.5x the largest exact Adam can produce "
        "(`adam_update_bound`, <= 1.17 for betas 0.9/0.95; rounding to E4M3 normals moves an update by under 10%, "
        "an m rounded among the few subnormal codes of a per-tensor scale by up to about 2x). "
        "Largest update: |m_hat / (sqrt(v_hat) + eps)|, to be multiplied by the learning rate.",
        "",
        "| format | v lost | m alive, v dead | updates over bound | output layer: over bound | largest update | output layer: largest update |",
        "|---|---|---|---|---|---|---|",
    ]
    for fmt, rs in by_fmt.items():
        later = [r for r in rs if r["step"] >= 2] or rs
        mean = lambda k: sum(r[k] for r in later) / len(later)  # noqa: E731
        lines.append(
            f"| {fmt} | {mean('v_lost'):.2%} | {mean('m_alive_v_dead'):.2%} | {mean('over_bound'):.2%} | {mean('output_over_bound'):.2%} | "
            f"{max(r['max_update'] for r in rs):.3g} | {max(r['output_max_update'] for r in rs):.3g} |"
        )
    return "\n".join(lines) + "\n"


def command_line(args) -> str:
    return (
        f"--steps {args.steps} --vocab {args.vocab} --lr {args.lr:g} --dim {args.dim} --layers {args.layers} "
        f"--seq {args.seq} --batch {args.batch} --formats {args.formats}"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--vocab",
        type=int,
        default=32000,
        help="gpt-1b's 32000 (byte tokens: 107 of them occur in the corpus); 256 for fewer unused rows",
    )
    p.add_argument(
        "--lr", type=float, default=3e-3, help="peak learning rate: 3e-3 as coat-compare's tiny preset (gpt-1b: 3e-4)"
    )
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (coat-compare: at least 10)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/te-fp8-pa-divergence-1gpu/emulation-cpu"))
    p.add_argument("--name", default="pa_optimizer_emulation", help="report files {out}/NAME.md and NAME.jsonl")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    corpus = stdlib_docstrings()
    data = ByteBatches(corpus, args.seq, args.batch, vocab_size=args.vocab)
    unseen = torch.ones(args.vocab, dtype=torch.bool)
    unseen[sorted(set(min(b, args.vocab - 1) for b in corpus))] = False
    init = LlamaGPT(args.vocab, args.dim, args.layers, args.heads, ffn=int(2.75 * args.dim), seed=args.seed)
    n_params = sum(q.numel() for q in init.parameters())
    start, rows = time.time(), []
    for fmt in args.formats.split(","):
        t0 = time.time()
        fmt_rows = train(init, fmt, data, unseen, args)
        rows += fmt_rows
        print(
            f"{fmt}: loss {fmt_rows[0]['loss']:.3f} -> {fmt_rows[-1]['loss']:.3f} at step {fmt_rows[-1]['step']} "
            f"(largest {max(r['loss'] for r in fmt_rows):.3f}), updates over bound "
            f"{sum(r['over_bound'] for r in fmt_rows) / len(fmt_rows):.2%}, largest update {max(r['max_update'] for r in fmt_rows):.3g} "
            f"({time.time() - t0:.0f} s)",
            flush=True,
        )
    text = report(rows, args, n_params, int(unseen.sum()), time.time() - start)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, f"{args.name}.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
