"""COAT's sequence-parallel path on GPUs (NCCL), run by ``test_sequence_parallel.py`` under
``torchrun --nproc-per-node 2`` (also by hand: ``torchrun --nproc-per-node 2 tests/megatron/sequence_parallel_gpu.py``).

Checks, at TP 2 with sequence parallel, each printed as it passes:

1. the column- and row-parallel linears (Triton quantizers, cuBLASLt GEMMs) against the torch
   reference on the same GPU: each rank's chunk dequantized with its own scale, FP32 matmuls chunk
   by chunk;
2. a COAT TransformerLayer with ``tp_comm_overlap`` on (the ring of NCCL point-to-point
   transfers) and off (collectives) gives the same output and gradients bit for bit;
3. its eager fwd+bwd never synchronises with the host;
4. its fwd+bwd captured in a CUDA graph (with the ring inside) replays bit-identical to eager.

The layer uses Megatron's local (unfused) attention, whose kernels are deterministic. Without
CUDA (gloo, with the torch references and Megatron's CPU redirects) checks 1 and 2 run, so that
the script itself can be tried on any machine.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from layer_config import layer_config

SEQ, BATCH, HIDDEN, FFN, HEADS = 256, 2, 256, 768, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _q(x, fmt):
    from coat_kernels.per_tensor import dequantize_per_tensor_reference, quantize_per_tensor_reference

    q, scale = quantize_per_tensor_reference(x, fmt)
    return dequantize_per_tensor_reference(q, scale, torch.float32)


def _q_folded(dy_rows, x_chunks, rows):
    """A column-parallel dY as its backward quantizes it: chunk j against X's chunk j
    (``coat_kernels.per_tensor.folded_chunk_amaxes``), dequantized to FP32."""
    from coat_kernels.per_tensor import (
        dequantize_per_tensor_reference,
        folded_chunk_amaxes,
        quantize_per_tensor_reference,
    )

    scales = [quantize_per_tensor_reference(c, "e4m3")[1] for c in x_chunks]
    amaxes = folded_chunk_amaxes(dy_rows.float().abs().max(), torch.stack(scales))
    out = []
    for j, amax in enumerate(amaxes):
        q, g = quantize_per_tensor_reference(dy_rows[j * rows : (j + 1) * rows], "e5m2", amax=amax)
        out.append(dequantize_per_tensor_reference(q, g, torch.float32))
    return torch.cat(out)


def _close(got, want, what, rel=2**-7):
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    assert scale > 0, what
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * scale, msg=lambda m: f"{what}: {m}")


def check_linears(group, rank: int, n: int) -> None:
    from coat_megatron.config import CoatConfig
    from coat_megatron.fp8.weights import weight_cache_for
    from coat_megatron.layers.sequence_parallel import column_parallel_fp8_linear, row_parallel_fp8_linear

    config = CoatConfig(fprop_fast_accumulation=False)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    x_full = torch.randn(SEQ, BATCH, HIDDEN, device=DEVICE, generator=g)
    x_full[: SEQ // n] *= 8.0  # rank 0's chunk a larger amax: the scales must stay per chunk
    x_full = x_full.to(torch.bfloat16)
    w_full = torch.randn(FFN, HIDDEN, device=DEVICE, generator=g) * 0.05
    dy_full = torch.randn(SEQ, BATCH, FFN, device=DEVICE, generator=g).to(torch.bfloat16)
    out_c, rows = FFN // n, SEQ // n * BATCH

    # column-parallel: this rank's chunk in, every chunk's rows out
    x = x_full.chunk(n)[rank].clone().requires_grad_()
    w = w_full[rank * out_c : (rank + 1) * out_c].clone().requires_grad_()
    y = column_parallel_fp8_linear(x, w, None, group=group, config=config, weight_cache=weight_cache_for(config))
    dy = dy_full[..., rank * out_c : (rank + 1) * out_c].contiguous()
    y.backward(dy)
    ref_x = [_q(c, "e4m3").reshape(-1, HIDDEN) for c in x_full.chunk(n)]
    ref_w = _q(w.detach(), "e4m3")
    _close(y, torch.cat([c @ ref_w.t() for c in ref_x]).view(y.shape), "column Y")
    x_chunks = list(x_full.chunk(n))
    ref_dy = _q_folded(dy.reshape(-1, out_c), x_chunks, rows)
    _close(w.grad, sum(ref_dy[j * rows : (j + 1) * rows].t() @ ref_x[j] for j in range(n)), "column dW")
    partials = [
        _q_folded(dy_full[..., k * out_c : (k + 1) * out_c].reshape(-1, out_c), x_chunks, rows)[
            rank * rows : (rank + 1) * rows
        ]
        @ _q(w_full[k * out_c : (k + 1) * out_c], "e4m3")
        for k in range(n)
    ]
    _close(x.grad, sum(partials).view(x.shape), "column dX")

    # row-parallel: this rank's columns of the whole sequence in, its chunk of the sum out
    a_full = torch.randn(SEQ, BATCH, FFN, device=DEVICE, generator=g).to(torch.bfloat16)
    a = a_full[..., rank * out_c : (rank + 1) * out_c].clone().requires_grad_()
    w2_full = torch.randn(HIDDEN, FFN, device=DEVICE, generator=g) * 0.05
    w2 = w2_full[:, rank * out_c : (rank + 1) * out_c].clone().requires_grad_()
    y2 = row_parallel_fp8_linear(a, w2, group=group, config=config, weight_cache=weight_cache_for(config))
    dy2 = x_full.chunk(n)[rank].contiguous()  # each rank's chunk of dY, its own amax
    y2.backward(dy2)
    ref_a = [_q(a_full[..., k * out_c : (k + 1) * out_c], "e4m3").reshape(-1, out_c) for k in range(n)]
    ref_w2 = [_q(w2_full[:, k * out_c : (k + 1) * out_c], "e4m3") for k in range(n)]
    want = sum(ref_a[k][rank * rows : (rank + 1) * rows] @ ref_w2[k].t() for k in range(n))
    _close(y2, want.view(y2.shape), "row Y")
    ref_dy2 = torch.cat([_q(c, "e5m2").reshape(-1, HIDDEN) for c in x_full.chunk(n)])
    _close(a.grad, (ref_dy2 @ ref_w2[rank]).view(a.shape), "row dX")
    _close(w2.grad, ref_dy2.t() @ ref_a[rank], "row dW")
    print(f"rank {rank}: column- and row-parallel linears equal the per-chunk reference", flush=True)


def coat_layer(overlap: bool):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module

    from coat_megatron.config import CoatConfig
    from coat_megatron.spec import get_gpt_layer_coat_spec

    config = layer_config(
        HIDDEN,
        FFN,
        HEADS,
        use_cpu_initialization=DEVICE == "cpu",
        tensor_model_parallel_size=dist.get_world_size(),
        sequence_parallel=True,
    )
    spec = get_gpt_layer_coat_spec(CoatConfig(tp_comm_overlap=overlap), core_attention=DotProductAttention)
    layer = build_module(spec, config=config, layer_number=1).to(DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(
                torch.randn(p.shape, device=DEVICE, generator=g) * (0.02 if p.dim() > 1 else 0.1)
                + (1.0 if p.dim() == 1 else 0.0)
            )
    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0).to(DEVICE)(SEQ)
    g = torch.Generator(device=DEVICE).manual_seed(200 + dist.get_rank())
    x = torch.randn(SEQ // dist.get_world_size(), BATCH, HIDDEN, device=DEVICE, generator=g).to(torch.bfloat16)
    dy = torch.randn(x.shape, device=DEVICE, generator=g).to(torch.bfloat16)
    return layer, rope, x, dy


def eager_step(layer, rope, x, dy):
    for p in layer.parameters():
        p.grad = None
    xi = x.clone().requires_grad_()
    out, _ = layer(xi, attention_mask=None, rotary_pos_emb=rope)
    out.backward(dy)
    return out.detach().clone(), xi.grad.clone(), [p.grad.clone() for p in layer.parameters()]


def same(a, b, what: str) -> None:
    assert torch.equal(a[0], b[0]), f"{what}: outputs differ"
    assert torch.equal(a[1], b[1]), f"{what}: input gradients differ"
    for i, (ga, gb) in enumerate(zip(a[2], b[2])):
        assert torch.equal(ga, gb), f"{what}: gradient of parameter {i} differs"


def check_layer(rank: int) -> None:
    layer, rope, x, dy = coat_layer(overlap=True)
    ring = eager_step(layer, rope, x, dy)
    collectives = eager_step(*coat_layer(overlap=False))
    same(ring, collectives, "overlap on against off")
    print(f"rank {rank}: the layer with the overlap on and off is bit-identical", flush=True)
    if DEVICE == "cpu":
        return

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager_step(layer, rope, x, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"rank {rank}: an eager fwd+bwd never synchronises with the host", flush=True)

    static_x = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager_step(layer, rope, x, dy)
    torch.cuda.current_stream().wait_stream(side)
    for p in layer.parameters():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    # thread-local, as Megatron captures: NCCL's watchdog thread queries events during the capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_out, _ = layer(static_x, attention_mask=None, rotary_pos_emb=rope)
        static_out.backward(dy)
    grads = [p.grad for p in layer.parameters()]
    for step in range(2):
        graph.replay()
        torch.cuda.synchronize()
        graphed = (static_out.detach().clone(), static_x.grad.clone(), [g.clone() for g in grads])
        same(graphed, eager_step(layer, rope, x, dy), f"graph replay {step} against eager")
        for p, g in zip(layer.parameters(), grads):
            p.grad = g
    print(f"rank {rank}: the CUDA-graphed fwd+bwd replays bit-identical to eager", flush=True)


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with contextlib.ExitStack() as stack:
        if DEVICE == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl")
        else:
            from coat_patches.cpu import megatron_on_cpu

            stack.enter_context(megatron_on_cpu())
            dist.init_process_group("gloo")
        stack.callback(dist.destroy_process_group)
        parallel_state.initialize_model_parallel(dist.get_world_size(), 1)
        stack.callback(parallel_state.destroy_model_parallel)
        model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=DEVICE == "cuda", force_reset_rng=True)
        group = parallel_state.get_tensor_model_parallel_group()
        check_linears(group, dist.get_rank(group), dist.get_world_size(group))
        check_layer(dist.get_rank())


if __name__ == "__main__":
    main()
