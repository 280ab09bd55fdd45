"""Optimizer step time and bandwidth on the GPU: CoatAdamW against torch and TransformerEngine, in one run.

    python benchmarks/optimizer.py [--params 536870912] [--sweep] [--out DIR]

Two layouts of the same number of FP32 parameters (default 512M): one tensor, and Llama-2-7B layer
shapes (many tensors: the multi-tensor launch). Per configuration: median step time (CUDA events,
triton.testing.do_bench, L2 flushed between runs), ms per billion parameters, the bytes each step
must move per parameter (each input read once, each output written once) and the bandwidth that
makes, as a fraction of a device-to-device copy measured in the same run; and the optimizer-state
bytes per parameter.

Rows:
- CoatAdamW + BF16 model weights: the fused FP8 step writing the FP32 master weights and the BF16
  copy Megatron's forward reads (18.4 B/param moved: p 4+4, g 4, m and v codes 2+2, metadata
  4 x 12/128, BF16 weights 2).
- torch fused AdamW (FP32 states; 28 B/param) + Megatron's separate main-to-model copy (FP32 -> BF16,
  6 B/param): the stock path COAT replaces (Megatron calls that copy after every step).
- TransformerEngine FusedAdam with FP32, BF16 and FP8 states (what Megatron's
  --use-precision-aware-optimizer runs), where TE imports; the step alone.
Goals (docs/design.md#the-fused-step): COAT step incl. the BF16 write <= 0.6 x (torch fused AdamW + copy);
>= 85% of copy bandwidth; <= 2.2 bytes of state per parameter.

Writes optimizer.md (table) and optimizer.jsonl (one JSON object per row, with the ratios) to --out.
``--sweep`` also times other (groups per program, warps) tilings of the fused step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from unittest import mock

import torch
import triton

from coat_kernels import fp8_adamw as fp8_adamw_module
from coat_megatron import CoatConfig
from coat_megatron.optimizer import CoatAdamW

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LLAMA_LAYER = [(4096 * 3, 4096), (4096, 4096), (11008 * 2, 4096), (4096, 11008), (4096,), (4096,)]


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")


def layouts(numel: int) -> dict[str, list[tuple[int, ...]]]:
    shapes = []
    while sum(torch.Size(s).numel() for s in shapes) < numel:
        shapes += LLAMA_LAYER
    return {f"1 tensor of {numel / 1e6:.0f}M": [(numel,)], f"{len(shapes)} tensors, Llama-2-7B layer shapes": shapes}


def make(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = (
            torch.randn(p.shape, device="cuda", generator=g)
            * 1e-3
            * (1 + torch.rand(p.shape, device="cuda", generator=g))
        )
    models = [torch.empty(p.shape, dtype=torch.bfloat16, device="cuda") for p in params]
    return params, models


def main_to_model_copy(params, models):
    for p, w in zip(params, models):  # Megatron's _copy_main_params_to_model_params: one copy_ per shard
        w.copy_(p.detach())


def free():
    gc.collect()
    torch.cuda.empty_cache()


def coat_rows(shapes, numel, label, args):
    rows = []
    configs = [
        ("CoatAdamW + BF16 model weights (fused)", CoatConfig(), True, None, 18.375),
        ("CoatAdamW, no model weights", CoatConfig(), False, None, 16.375),
        ("CoatAdamW + BF16 model weights, exact_math=True", CoatConfig(), True, True, 18.375),
        (
            "CoatAdamW + BF16, expansion off (per-group absmax)",
            CoatConfig(m_expansion=False, v_expansion=False),
            True,
            None,
            18.125,
        ),
    ]
    for name, config, write_model, exact, moved in configs:
        params, models = make(shapes)
        opt = CoatAdamW(params, **HYPER, config=config, exact_math=exact)
        if write_model:
            opt.model_params = dict(zip(params, models))
        ms = bench_ms(opt.step)
        if write_model:
            torch.cuda.synchronize()
            assert all(torch.equal(w, p.detach().to(torch.bfloat16)) for p, w in zip(params, models)), (
                "BF16 copy differs"
            )
        rows.append(dict(layout=label, name=name, ms=ms, moved=moved, state=opt.state_bytes() / numel))
        del opt, params, models
        free()
    return rows


def torch_rows(shapes, numel, label):
    params, models = make(shapes)
    opt = torch.optim.AdamW(params, **HYPER, fused=True)
    step_ms = bench_ms(opt.step)
    copy_ms = bench_ms(lambda: main_to_model_copy(params, models))

    def step_and_copy():
        opt.step()
        main_to_model_copy(params, models)

    both_ms = bench_ms(step_and_copy)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step") / numel
    del opt, params, models
    free()
    return [
        dict(layout=label, name="torch fused AdamW (FP32 states)", ms=step_ms, moved=28.0, state=state),
        dict(layout=label, name="Megatron main-to-model copy (FP32 -> BF16)", ms=copy_ms, moved=6.0, state=0.0),
        dict(layout=label, name="torch fused AdamW + main-to-model copy", ms=both_ms, moved=34.0, state=state),
    ]


def te_rows(shapes, numel, label):
    try:
        import transformer_engine.pytorch  # noqa: F401
        from transformer_engine.pytorch.optimizers import FusedAdam
    except Exception as e:  # a TE build that does not match torch/CUDA fails in many ways
        return [
            dict(
                layout=label, name="TransformerEngine FusedAdam", skipped=f"TE does not import: {type(e).__name__}: {e}"
            )
        ]
    rows = []
    for name, dtype, moved in (
        ("FP32", torch.float32, 28.0),
        ("BF16", torch.bfloat16, 20.0),
        ("FP8", torch.uint8, 16.0),
    ):
        try:
            params, _ = make(shapes)
            opt = FusedAdam(params, **HYPER, adam_w_mode=True, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
            ms = bench_ms(opt.step)
            state = 0.0
            for s in opt.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    t = s.get(key)
                    if isinstance(t, torch.Tensor):
                        state += t.numel() * (1 if dtype == torch.uint8 else t.element_size())
            rows.append(
                dict(layout=label, name=f"TE FusedAdam, {name} states", ms=ms, moved=moved, state=state / numel)
            )
            del opt, params
        except Exception as e:  # noqa: BLE001 - one TE configuration failing must not stop the run
            rows.append(dict(layout=label, name=f"TE FusedAdam, {name} states", skipped=f"{type(e).__name__}: {e}"))
        free()
    return rows


def sweep_rows(shapes, label):
    rows = []
    for groups, warps in [(4, 4), (8, 4), (8, 8), (16, 4), (16, 8), (32, 8), (32, 16)]:
        with mock.patch.object(fp8_adamw_module, "step_blocks", lambda group_size, c=(groups, warps): c):
            params, models = make(shapes)
            opt = CoatAdamW(params, **HYPER)
            opt.model_params = dict(zip(params, models))
            rows.append(
                dict(
                    layout=label,
                    name=f"sweep: {groups} groups/program, {warps} warps",
                    ms=bench_ms(opt.step),
                    moved=18.375,
                    state=None,
                )
            )
            del opt, params, models
            free()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=512 * 2**20, help="FP32 parameters per layout (default 512M)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/optimizer.py measures GPU step time: run it on a CUDA machine")

    gpu = torch.cuda.get_device_name()
    src = torch.empty(args.params, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * src.nbytes / copy_ms / 1e6
    del src, dst
    free()

    rows = []
    for label, shapes in layouts(args.params).items():
        numel = sum(torch.Size(s).numel() for s in shapes)
        block = coat_rows(shapes, numel, label, args) + torch_rows(shapes, numel, label) + te_rows(shapes, numel, label)
        if args.sweep:
            block += sweep_rows(shapes, label)
        baseline = next(r["ms"] for r in block if r["name"] == "torch fused AdamW + main-to-model copy")
        for r in block:
            r["numel"] = numel
            if "ms" in r:
                r["ms_per_billion"] = r["ms"] * 1e9 / numel
                r["GB/s"] = r["moved"] * numel / r["ms"] / 1e6
                r["of_copy"] = r["GB/s"] / copy_gbs
                r["vs_torch_plus_copy"] = r["ms"] / baseline
        rows += block

    goals = []
    for label in layouts(args.params):
        coat = next(r for r in rows if r["layout"] == label and r["name"] == "CoatAdamW + BF16 model weights (fused)")
        goals += [
            (
                label,
                "COAT step incl. BF16 write <= 0.6 x (torch fused AdamW + copy)",
                coat["vs_torch_plus_copy"],
                coat["vs_torch_plus_copy"] <= 0.6,
            ),
            (label, "COAT step >= 85% of copy bandwidth", coat["of_copy"], coat["of_copy"] >= 0.85),
            (label, "COAT state <= 2.2 bytes/param", coat["state"], coat["state"] <= 2.2),
        ]

    lines = [
        f"# Optimizer step: CoatAdamW vs torch fused AdamW and TransformerEngine FusedAdam, {gpu}",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}; {args.params / 2**20:.0f}M FP32 parameters per layout; "
        f"AdamW lr {HYPER['lr']}, betas {HYPER['betas']}, wd {HYPER['weight_decay']}.",
        f"Device-to-device copy: {copy_ms:.3f} ms for {args.params * 4 / 2**30:.1f} GiB, {copy_gbs:.0f} GB/s (read + write).",
        "Bytes moved: each input read once, each output written once, per parameter (the module docstring lists them).",
        "",
        "| layout | step | ms | ms / 1e9 params | B/param moved | GB/s | of copy | state B/param | vs torch + copy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['layout']} | {r['name']} | skipped: {r['skipped']} | | | | | | |")
            continue
        state = "" if r["state"] is None else f"{r['state']:.4g}"
        lines.append(
            f"| {r['layout']} | {r['name']} | {r['ms']:.3f} | {r['ms_per_billion']:.2f} | {r['moved']:.4g} | {r['GB/s']:.0f} | "
            f"{r['of_copy']:.2f} | {state} | {r['vs_torch_plus_copy']:.3f} |"
        )
    lines += ["", "## Goals", "", "| layout | goal | measured | met |", "|---|---|---|---|"]
    lines += [f"| {label} | {goal} | {value:.3f} | {'yes' if ok else 'NO'} |" for label, goal, value, ok in goals]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "optimizer.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "optimizer.jsonl"), "w") as f:
        f.write(
            json.dumps(
                {
                    "gpu": gpu,
                    "name": "copy",
                    "ms": copy_ms,
                    "GB/s": copy_gbs,
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                }
            )
            + "\n"
        )
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for label, goal, value, ok in goals:
            f.write(json.dumps({"layout": label, "goal": goal, "measured": value, "met": ok}) + "\n")


if __name__ == "__main__":
    main()
