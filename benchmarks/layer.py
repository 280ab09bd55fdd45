"""One Llama-2-7B transformer layer (hidden 4096, FFN 11008, 32 heads, seq 2048, micro-batch 4,
TP=1) in every mode, in one run: fwd+bwd time and activation memory, as ratios.

    python benchmarks/layer.py [--seq 2048 --micro-batch 4] [--out DIR]

Modes: Megatron local spec BF16; TE spec BF16; TE spec FP8 (delayed, current scaling); TE spec
FP8 current with ``activation_func_fp8_input_store``; the COAT spec (TE's attention when TE is
installed), with linear_proj saving an FP8 transposed input or relying on the attention's saved
output. Time: CUDA-event median of fwd+bwd (triton.testing.do_bench). Activation memory:
allocated after the forward minus before, minus the output, after warm-up (FP8 weight copies
and workspaces already exist). A mode that cannot run is a row that says why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket

import torch
import torch.nn.functional as F
import triton

MIB = 2**20


def init_megatron():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def layer_config(args, **overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        bias_activation_fusion=True, apply_rope_fusion=False, **overrides,
    )


def build(mode: str, args):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module

    from coat_megatron.spec import get_gpt_layer_coat_spec

    fp8 = {}
    if mode.startswith("TE FP8"):
        fp8 = dict(fp8="hybrid", fp8_recipe="delayed" if "delayed" in mode else "tensorwise")
        if "store" in mode:
            fp8["activation_func_fp8_input_store"] = True
    config = layer_config(args, **fp8)
    if mode == "local BF16":
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    elif mode.startswith("TE"):
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        from coat_megatron.config import CoatConfig

        coat = CoatConfig(recompute_norm_output="recomputed" in mode)
        spec = get_gpt_layer_coat_spec(coat, proj_input_saved_by_attention=False if "proj saves" in mode else None)
    layer = build_module(spec, config=config, layer_number=1).cuda()
    ctx = contextlib.nullcontext
    if fp8:
        from megatron.core.fp8_utils import get_fp8_context

        ctx = lambda: get_fp8_context(config)  # noqa: E731
    return layer, config, ctx


def measure(mode: str, args) -> dict:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    layer, config, ctx = build(mode, args)
    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0).cuda()(args.seq)
    x = torch.randn(args.seq, args.micro_batch, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = list(layer.parameters())

    def forward():
        with ctx():
            out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
        return out

    def step():
        forward().backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    x.grad = None
    before = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    activation = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    out.backward(dy)
    del out
    ms = triton.testing.do_bench(step, warmup=5, rep=50, grad_to_none=[x] + params, return_mode="median")
    del layer
    torch.cuda.empty_cache()
    return {"mode": mode, "ms": ms, "activation_MiB": activation / MIB}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/layer.py measures the GPU: run it on a CUDA machine")
    init_megatron()
    from coat_megatron.optional import transformer_engine_available

    te = transformer_engine_available()
    modes = ["local BF16", "TE BF16", "TE FP8 delayed", "TE FP8 current", "TE FP8 current + FP8 SwiGLU input store",
             "COAT", "COAT (proj saves its FP8 input)", "COAT (norm outputs recomputed for wgrad)"]
    rows = []
    for mode in modes:
        if mode.startswith("TE") and not te:
            rows.append({"mode": mode, "error": "TransformerEngine not installed"})
            continue
        try:
            rows.append(measure(mode, args))
        except Exception as e:  # a mode that cannot run is reported, not fatal
            rows.append({"mode": mode, "error": f"{type(e).__name__}: {e}"[:300]})
        torch.cuda.empty_cache()
    by = {r["mode"]: r for r in rows if "ms" in r}
    te_bf16, te_cur, te_store = by.get("TE BF16"), by.get("TE FP8 current"), by.get("TE FP8 current + FP8 SwiGLU input store")
    gpu = torch.cuda.get_device_name()
    lines = [
        f"# One Llama-2-7B layer (h {args.hidden}, FFN {args.ffn}, {args.heads} heads, seq {args.seq}, micro-batch {args.micro_batch}, TP=1): {gpu}",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}; fwd+bwd median; activation = allocated after forward - before - output.",
        "",
        "| mode | fwd+bwd ms | vs TE FP8 current | activation MiB | vs TE BF16 | vs TE FP8 + store |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | - | - | - | - | {r['error']} |")
            continue
        f = lambda a, b, k: f"{a[k] / b[k]:.2f}" if b else "-"  # noqa: E731
        lines.append(
            f"| {r['mode']} | {r['ms']:.2f} | {f(r, te_cur, 'ms')} | {r['activation_MiB']:.0f} | "
            f"{f(r, te_bf16, 'activation_MiB')} | {f(r, te_store, 'activation_MiB')} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layer.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "layer.jsonl"), "w") as fh:
        for r in rows:
            fh.write(json.dumps({"gpu": gpu, **r}) + "\n")


if __name__ == "__main__":
    main()
