"""The Llama-2-7B MLP block (RMSNorm -> fc1 4096->2x11008 -> SwiGLU -> fc2 11008->4096) in one run:
fwd+bwd time and activation memory of the COAT FP8 ops against the same block in BF16 and against
TransformerEngine's LayerNormMLP (BF16, FP8 delayed and current scaling) when TE is installed; then
each COAT kernel's bandwidth against a device-to-device copy.

    python benchmarks/ops.py [--tokens 8192] [--out DIR]

Time: CUDA-event median of fwd+bwd (triton.testing.do_bench, L2 flushed), after warm-up (so FP8
weight copies and TE's workspaces exist). Activation memory: memory allocated after the forward
minus before, minus the output (what is kept for backward). "saved" counts the storages the block
hands to autograd's saved_tensors_hooks (torch/COAT modes; TE keeps its own).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
from torch.autograd.graph import saved_tensors_hooks

from coat_kernels import norm as norm_module
from coat_kernels import quantize_per_group, quantize_per_tensor
from coat_kernels import swiglu as swiglu_module
from coat_kernels.norm import norm_backward, norm_to_fp8
from coat_kernels.swiglu import quantize_swiglu_input, swiglu_backward, swiglu_to_fp8
from coat_megatron.config import CoatConfig
from coat_megatron.fp8 import Fp8WeightCache, OutputForm, fp8_linear, rmsnorm_to_fp8, swiglu_fp8
from coat_megatron.optional import transformer_engine_available

MIB = 2**20


def bench_ms(fn, grads) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, grad_to_none=grads, return_mode="median")


class Bf16Block(torch.nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))
        self.fc1 = torch.nn.Parameter(torch.randn(2 * ffn, hidden, dtype=torch.bfloat16) / hidden**0.5)
        self.fc2 = torch.nn.Parameter(torch.randn(hidden, ffn, dtype=torch.bfloat16) / ffn**0.5)

    def forward(self, x):
        gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), self.norm, 1e-5), self.fc1).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2)


class CoatBlock(Bf16Block):
    def __init__(self, hidden, ffn, config):
        super().__init__(hidden, ffn)
        self.config = config
        self.c1, self.c2 = Fp8WeightCache(), Fp8WeightCache()

    def forward(self, x):
        transpose = "recompute" if self.config.recompute_norm_output else "store"
        n = rmsnorm_to_fp8(x, self.norm, 1e-5, group_size=self.config.group_size, transpose=transpose)
        h = fp8_linear(n, self.fc1, config=self.config, weight_cache=self.c1, output_form=OutputForm.SWIGLU_INPUT)
        return fp8_linear(
            swiglu_fp8(h, group_size=self.config.group_size), self.fc2, config=self.config, weight_cache=self.c2
        )


def measure(name, block, x, dy, context=None):
    params = list(block.parameters())
    ctx = context or (lambda: torch.enable_grad())

    def step():
        with ctx():
            y = block(x)
        y.backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x.grad = None
    before = torch.cuda.memory_allocated()
    with saved_tensors_hooks(pack, lambda t: t), ctx():
        y = block(x)
    torch.cuda.synchronize()
    activation = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
    storages = {}
    for t in saved:
        try:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            storages = None
            break
    skip = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
    saved_bytes = None if storages is None else sum(v for k, v in storages.items() if k not in skip)
    y.backward(dy)
    del y, saved
    ms = bench_ms(step, [x] + params)
    return {
        "mode": name,
        "ms": ms,
        "activation_MiB": activation / MIB,
        "saved_MiB": None if saved_bytes is None else saved_bytes / MIB,
    }


def te_modes(hidden, ffn):
    if not transformer_engine_available():
        return [], "TransformerEngine not installed: TE rows skipped"
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    autocast = getattr(te, "autocast", None)

    def fp8(r):
        if autocast is not None:
            return lambda: autocast(enabled=True, recipe=r)
        return lambda: te.fp8_autocast(enabled=True, fp8_recipe=r)

    def make():
        return te.LayerNormMLP(
            hidden,
            ffn,
            normalization="RMSNorm",
            activation="swiglu",
            bias=False,
            params_dtype=torch.bfloat16,
            device="cuda",
        )

    return [
        ("TE LayerNormMLP BF16", make, None),
        ("TE LayerNormMLP FP8 delayed", make, fp8(recipe.DelayedScaling())),
        ("TE LayerNormMLP FP8 current", make, fp8(recipe.Float8CurrentScaling())),
    ], None


def kernel_rows(tokens, hidden, ffn, copy_gbs, sweep):
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(hidden, device="cuda")
    h = torch.randn(tokens, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    h_q, h_s = quantize_per_group(h, 16, "e4m3", check_finite=False)
    r = norm_to_fp8(x, w, eps=1e-5)
    da = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
    dh, tiles = swiglu_backward(da, h_q, h_s)
    n_x, n_h, n_a = tokens * hidden, tokens * 2 * ffn, tokens * ffn
    cases = [
        (
            "norm_to_fp8 (stats + quantize passes, x read twice)",
            lambda: norm_to_fp8(x, w, eps=1e-5),
            n_x * (2 + 1 + 0.25 + 1 + 1),
        ),
        (
            "norm_backward",
            lambda: norm_backward(x, r.x_q, r.x_scales, w, None, r.rstd, group_size=16),
            n_x * (2 + 1.25 + 2),
        ),
        ("quantize_per_group G=16 (plain)", lambda: quantize_per_group(h, 16, "e4m3", check_finite=False), n_h * 3.25),
        ("quantize_swiglu_input (fc1 output 1x16 + SwiGLU amax)", lambda: quantize_swiglu_input(h, 16), n_h * 3.25),
        ("swiglu_to_fp8, amax from fc1's pass", lambda: swiglu_to_fp8(h_q, h_s, 16, amax=tiles), n_h * 1.25 + n_a),
        ("swiglu_to_fp8 with its own amax pass", lambda: swiglu_to_fp8(h_q, h_s, 16), n_h * 1.25 + n_a),
        (
            "swiglu transposed recompute (backward)",
            lambda: swiglu_to_fp8(h_q, h_s, 16, transpose=True, amax=tiles.amax(), store_q=False),
            n_h * 1.25 + n_a,
        ),
        ("swiglu_backward", lambda: swiglu_backward(da, h_q, h_s), n_a * 2 + n_h * 1.25 + n_h * 2),
        (
            "quantize_per_tensor E5M2 + transpose (dh, amax from SwiGLU)",
            lambda: quantize_per_tensor(dh, "e5m2", transpose=True, amax=tiles, check_finite=False),
            n_h * 4,
        ),
    ]
    rows = []
    for name, fn, nbytes in cases:
        ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
        rows.append({"kernel": name, "ms": ms, "of_copy": nbytes / ms / 1e6 / copy_gbs})
    if sweep:
        rows += sweep_rows(cases, copy_gbs, hidden)
    return rows


# The tile shapes the sweep tries: SwiGLU's (BLOCK_M, BLOCK_N, num_warps), the norm stats pass's
# (rows per program, num_warps), the norm backward's (programs per multiprocessor, num_warps)
SWIGLU_TILES = [
    (8, 256, 4),
    (16, 256, 4),
    (32, 256, 8),
    (16, 512, 8),
    (32, 128, 4),
    (64, 128, 8),
    (8, 512, 4),
    (4, 1024, 4),
]
STATS_TILES = [(1, 8), (1, 4), (2, 8), (4, 8), (4, 16), (8, 16), (2, 4)]
BACKWARD_TILES = [(4, None), (8, None), (2, None), (8, 4), (16, 4), (4, 16)]


def sweep_rows(cases, copy_gbs, hidden) -> list[dict]:
    """Each kernel's cases again at every tile of its sweep list, one kernel's tiles changed at a time."""
    by_name = {name: (fn, nbytes) for name, fn, nbytes in cases}
    plans = [
        ("input", ["quantize_swiglu_input (fc1 output 1x16 + SwiGLU amax)"]),
        ("forward", ["swiglu_to_fp8, amax from fc1's pass", "swiglu transposed recompute (backward)"]),
        ("backward", ["swiglu_backward"]),
    ]
    rows = []

    def timed(name, label):
        fn, nbytes = by_name[name]
        ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
        rows.append({"kernel": f"{name} {label}", "ms": ms, "of_copy": nbytes / ms / 1e6 / copy_gbs, "sweep": True})

    for kernel, names in plans:
        default = swiglu_module._BLOCKS[kernel]
        for cfg in SWIGLU_TILES:
            swiglu_module._BLOCKS[kernel] = cfg
            for name in names:
                timed(name, f"[{kernel} {cfg}]")
        swiglu_module._BLOCKS[kernel] = default
    block_n = triton.next_power_of_2(hidden)
    for cfg in STATS_TILES:
        norm_module._STATS_BLOCKS[block_n] = cfg
        timed("norm_to_fp8 (stats + quantize passes, x read twice)", f"[stats {cfg}]")
    norm_module._STATS_BLOCKS.pop(block_n, None)
    default = norm_module._BACKWARD_BLOCKS
    for cfg in BACKWARD_TILES:
        norm_module._BACKWARD_BLOCKS = cfg
        timed("norm_backward", f"[backward {cfg}]")
    norm_module._BACKWARD_BLOCKS = default
    return rows


def profile(block, x, dy) -> str:
    for _ in range(3):
        block(x).backward(dy)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            block(x).backward(dy)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--profile", action="store_true", help="also print the COAT block's kernels by CUDA time")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time the SwiGLU and norm kernels at other tile shapes (SWIGLU_TILES, ...)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/ops.py measures the GPU: run it on a CUDA machine")
    torch.manual_seed(0)
    t, hdim, ffn = args.tokens, args.hidden, args.ffn
    gpu = torch.cuda.get_device_name()
    x = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16)

    results = [measure("BF16 (torch ops)", Bf16Block(hdim, ffn).cuda(), x, dy)]
    te_rows, te_note = te_modes(hdim, ffn)
    for name, make, ctx in te_rows:
        results.append(measure(name, make(), x, dy, ctx))
    results.append(measure("COAT", CoatBlock(hdim, ffn, CoatConfig()).cuda(), x, dy))
    results.append(
        measure(
            "COAT, promoted fprop accumulation",
            CoatBlock(hdim, ffn, CoatConfig(fprop_fast_accumulation=False)).cuda(),
            x,
            dy,
        )
    )
    results.append(
        measure(
            "COAT, norm output recomputed for wgrad",
            CoatBlock(hdim, ffn, CoatConfig(recompute_norm_output=True)).cuda(),
            x,
            dy,
        )
    )

    src = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6
    kernels = kernel_rows(t, hdim, ffn, copy_gbs, args.sweep)

    bf16 = results[0]
    te_cur = next((r for r in results if r["mode"] == "TE LayerNormMLP FP8 current"), None)
    lines = [
        f"# Llama-2-7B MLP block ({t} tokens, {hdim} -> 2x{ffn} SwiGLU -> {hdim}), fwd+bwd: {gpu}",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}. {te_note or ''}",
        "",
        "| mode | fwd+bwd ms | vs TE FP8 current | activation MiB | vs BF16 | saved-tensor MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        vs_te = f"{r['ms'] / te_cur['ms']:.2f}" if te_cur else "-"
        saved = f"{r['saved_MiB']:.0f}" if r["saved_MiB"] is not None else "-"
        lines.append(
            f"| {r['mode']} | {r['ms']:.2f} | {vs_te} | {r['activation_MiB']:.0f} | {r['activation_MiB'] / bf16['activation_MiB']:.2f} | {saved} |"
        )
    lines += [
        "",
        f"COAT kernels at this shape (device copy {copy_gbs:.0f} GB/s; bytes = inputs read once + outputs written once):",
        "",
        "| kernel | ms | of copy |",
        "|---|---|---|",
    ]
    lines += [f"| {k['kernel']} | {k['ms']:.3f} | {k['of_copy']:.2f} |" for k in kernels]
    if args.profile:
        lines += [
            "",
            "COAT block fwd+bwd, kernels by CUDA time (torch.profiler, 5 iterations):",
            "",
            "```",
            profile(CoatBlock(hdim, ffn, CoatConfig()).cuda(), x, dy),
            "```",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ops.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "ops.jsonl"), "w") as f:
        for r in results + kernels:
            f.write(json.dumps({"gpu": gpu, **r}) + "\n")


if __name__ == "__main__":
    main()
