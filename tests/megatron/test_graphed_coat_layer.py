"""COAT layers under CUDA graphs (GPU only): a graphed layer's outputs and gradients equal the
eager layer's bit for bit, before and after an optimizer step changes its weights (the FP8 weight
copies, or with no codes kept the weights' amax, are refreshed inside the replay); an eager
fwd+bwd never synchronises with the host. (Training with Megatron's per-layer and whole-step graphs:
tests/compare/test_cuda_graph_training.py.)

The layer uses Megatron's local (unfused) attention here, whose kernels are deterministic, so
that eager and replayed runs can be compared bit for bit.
"""

import pytest
import torch
import torch.distributed as dist
from layer_config import layer_config

pytestmark = pytest.mark.gpu

SEQ, BATCH, HIDDEN, FFN, HEADS = 128, 2, 256, 704, 4


@pytest.fixture
def megatron_on_one_gpu(tmp_path):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    dist.init_process_group(
        "cuda:nccl,cpu:gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def coat_layer(coat_config=None):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module

    from coat_megatron.spec import get_gpt_layer_coat_spec

    config = layer_config(HIDDEN, FFN, HEADS)
    spec = get_gpt_layer_coat_spec(coat_config, core_attention=DotProductAttention)
    layer = build_module(spec, config=config, layer_number=1).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(
                torch.randn(p.shape, device="cuda", generator=g) * (0.02 if p.dim() > 1 else 0.1)
                + (1.0 if p.dim() == 1 else 0.0)
            )
    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0).cuda()(SEQ)
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    return layer, rope, x, dy


def eager_step(layer, rope, x, dy):
    for p in layer.parameters():
        p.grad = None
    xi = x.clone().requires_grad_()
    out, _ = layer(xi, attention_mask=None, rotary_pos_emb=rope)
    out.backward(dy)
    return out.detach().clone(), xi.grad.clone(), [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("weight_codes", ["none", "W", "W+WT"], ids=["default-no-codes", "codes", "cached-transpose"])
def test_graphed_coat_layer_is_bit_identical_to_eager_across_a_weight_update(megatron_on_one_gpu, weight_codes):
    from coat_megatron.config import CoatConfig

    config = CoatConfig(cache_weight=weight_codes != "none", cache_weight_transpose=weight_codes == "W+WT")
    layer, rope, x, dy = coat_layer(config)
    static_x = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles, cuBLAS handles) outside the capture
        for _ in range(2):
            eager_step(layer, rope, x, dy)
    torch.cuda.current_stream().wait_stream(side)
    for p in layer.parameters():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, _ = layer(static_x, attention_mask=None, rotary_pos_emb=rope)
        static_out.backward(dy)
    params = list(layer.parameters())
    graphed_grads = [p.grad for p in params]  # the graph's static gradient buffers

    def replay():
        graph.replay()
        torch.cuda.synchronize()
        return static_out.detach().clone(), static_x.grad.clone(), [g.clone() for g in graphed_grads]

    from coat_megatron.fp8.weights import device_generation

    qkv = layer.self_attention.linear_qkv
    for step in range(2):
        if step:  # the SGD step below moved the weight generation: the replay must see it
            assert qkv.weight_cache._buffers.generation.item() != device_generation(qkv.weight.device).item()
        graphed = replay()
        assert qkv.weight_cache._buffers.generation.item() == device_generation(qkv.weight.device).item()
        eager = eager_step(layer, rope, x, dy)
        assert torch.equal(graphed[0], eager[0]), f"step {step}: outputs differ"
        assert torch.equal(graphed[1], eager[1]), f"step {step}: input gradients differ"
        for (name, _), a, b in zip(layer.named_parameters(), graphed[2], eager[2]):
            assert torch.equal(a, b), f"step {step}: gradient of {name} differs"
        # an optimizer step changes every weight; the replay must quantize the new ones
        for p, g in zip(params, eager[2]):
            p.grad = g
        torch.optim.SGD(params, lr=0.5).step()
        for p, g in zip(params, graphed_grads):
            p.grad = g


def test_an_eager_coat_layer_step_never_synchronises(megatron_on_one_gpu):
    layer, rope, x, dy = coat_layer()
    eager_step(layer, rope, x, dy)  # first call: compiles, allocates the weight copies
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for p in layer.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        out, _ = layer(xi, attention_mask=None, rotary_pos_emb=rope)
        out.backward(dy)
        torch.optim.SGD(list(layer.parameters()), lr=0.1).step()  # bumps the weight generation
        out, _ = layer(xi, attention_mask=None, rotary_pos_emb=rope)  # refreshes the FP8 copies
        out.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_norms_fused_residual_gradient_changes_no_bit_on_a_gpu(megatron_on_one_gpu):
    """``CoatConfig.fuse_residual_backward``: two stacked layers whose norms add the residual stream's
    gradient in their backward (and hand its amax to linear_proj and the first layer's linear_fc2) give the
    outputs, input gradient and weight gradients of autograd's sum, bit for bit, on cuBLASLt and Triton."""
    from coat_megatron.config import CoatConfig

    got = []
    for fuse in (True, False):
        built = [coat_layer(CoatConfig(fuse_residual_backward=fuse)) for _ in range(2)]
        layers, (_, rope, x, dy) = [b[0] for b in built], built[0]
        assert layers[0].input_layernorm.returns_residual == fuse
        xi = x.clone().requires_grad_()
        h = xi
        for layer in layers:
            h, _ = layer(h, attention_mask=None, rotary_pos_emb=rope)
        h.backward(dy)
        got.append([h.detach(), xi.grad] + [p.grad for layer in layers for p in layer.parameters()])
    for i, (a, b) in enumerate(zip(*got)):
        assert a.abs().sum() > 0 and torch.equal(a, b), f"tensor {i} differs"
