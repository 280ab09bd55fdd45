"""Launches and allocations of one transformer layer's fwd+bwd at TP 2 with sequence parallel, on a CPU.

``count_layer(kind, recipe)`` runs in each rank of a gloo group (``distributed.run_distributed``
with ``tensor_parallel=2``): it builds one Megatron ``TransformerLayer`` -- COAT's spec with the
``recipe`` (``CoatConfig.recipe``), or ``"bf16"``: Megatron's local spec (BF16 linears) -- runs two
micro-batches to warm up (the FP8 weight copies or amaxes are made in the first), then counts one
micro-batch's forward and backward with ``launch_counter.LaunchCounter``: what it would launch and
allocate on a GPU, as one layer of a stack of COAT layers (dy's amax left by the next layer's input
norm, as ``CoatConfig.fuse_residual_backward`` does there). COAT's kernels run as Triton (the interpreter), not as their torch references,
so the count follows the GPU path.

Core attention (Megatron's unfused local one here; flash attention on a GPU) is the same in every
mode and is not COAT's: its own fwd+bwd on the same inputs is counted alone and reported
beside the layer's, and ``excluding_attention`` is the layer less it.

Shapes are small and every GEMM dimension is a multiple of 16 (as on a GPU, where a K that is not
would be padded). The COAT linears' and norms' weights carry a ``main_grad`` (BF16, COAT's default gradient
buffers) as Megatron's DDP gives them, reset at every micro-batch as at the first of a step; the
BF16 linears return their weight gradients to autograd (no apex on a CPU).
"""

from __future__ import annotations

import contextlib

import torch
from launch_counter import LaunchCounter
from layer_config import layer_config

SIZES = (32, 2, 64, 128, 4)  # seq, micro-batch, hidden, FFN, heads
WARM_UP = 2


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm in Megatron's norm slot under sequence parallelism (Megatron's own torch norm
    refuses it; apex's, which the local spec would take, is not on a CPU)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def _spec(kind: str, recipe: str | None, device: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from coat_megatron.config import CoatConfig
    from coat_megatron.spec import get_gpt_layer_coat_spec

    if kind == "coat":
        # on a CPU linear_proj runs as beside flash attention on a GPU, which keeps its output: its
        # wgrad operand is requantized from that BF16 input in backward; on a GPU, the spec's default
        cpu = device == "cpu"
        name, _, extra = recipe.partition("+")  # "memory+scratch": the recipe with CoatConfig.scratch_buffers
        return get_gpt_layer_coat_spec(
            CoatConfig.recipe(name, scratch_buffers=extra == "scratch"),
            core_attention=DotProductAttention if cpu else None,
            proj_input_saved_by_attention=True if cpu else None,
        )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return spec


def build_layer(kind: str, recipe: str | None = None, device: str = "cpu", sizes: tuple = SIZES):
    """(layer, rope, x, dy) on this rank: x its (seq / tp, micro_batch, hidden) BF16 chunk;
    ``sizes`` = (seq, micro_batch, hidden, ffn, heads)."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    seq, micro_batch, hidden, ffn, heads = sizes
    tp = parallel_state.get_tensor_model_parallel_world_size()
    model_parallel_cuda_manual_seed(1234)
    config = layer_config(
        hidden,
        ffn,
        heads,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=device == "cpu",
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
    )
    layer = build_module(_spec(kind, recipe, device), config=config, layer_number=1).to(device)
    g = torch.Generator(device=device).manual_seed(100 + parallel_state.get_tensor_model_parallel_rank())
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device) * (0.05 if p.dim() > 1 else 0.1) + (p.dim() == 1))
    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0).to(device)(seq)
    x = torch.randn(seq // tp, micro_batch, hidden, generator=g, device=device).to(torch.bfloat16)
    dy = torch.randn(x.shape, generator=g, device=device).to(torch.bfloat16)
    return layer, rope, x, dy


def _with_main_grads(layer) -> list[torch.nn.Parameter]:
    """Give COAT's linear and norm weights DDP's ``main_grad`` (BF16) and its flag; they are returned."""
    from coat_megatron.layers.linear import CoatColumnParallelLinear, CoatRowParallelLinear
    from coat_megatron.layers.norm import CoatNorm

    coats = (CoatColumnParallelLinear, CoatRowParallelLinear, CoatNorm)
    weights = [m.weight for m in layer.modules() if isinstance(m, coats)]
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.bfloat16, device=w.device)
    return weights


def regions(layer) -> dict[str, torch.nn.Module]:
    """The layer's modules whose launches are told apart (``LaunchCounter(regions=...)``);
    "attention" holds what SelfAttention runs outside its two linears (the split of the qkv
    output, RoPE) and "core_attention" the attention itself: neither is COAT's."""
    return {
        "input_norm": layer.input_layernorm,
        "attention": layer.self_attention,
        "linear_qkv": layer.self_attention.linear_qkv,
        "core_attention": layer.self_attention.core_attention,
        "linear_proj": layer.self_attention.linear_proj,
        "pre_mlp_norm": layer.pre_mlp_layernorm,
        "mlp": layer.mlp,  # what the MLP runs between its linears: the activation
        "linear_fc1": layer.mlp.linear_fc1,
        "linear_fc2": layer.mlp.linear_fc2,
    }


NOT_COATS = ("attention", "core_attention")


class MicroBatch:
    """One micro-batch's fwd+bwd of ``build_layer``'s layer, called as ``step(context)`` with the
    ``context`` (a counter, a profiler) around exactly the forward and the backward."""

    def __init__(self, kind: str, recipe: str | None = None, device: str = "cpu", sizes: tuple = SIZES):
        self.layer, self.rope, self.x, self.dy = build_layer(kind, recipe, device, sizes)
        self.weights = _with_main_grads(self.layer)
        # as in a stack of COAT layers: the next layer's input norm, which wrote dy (the residual stream's
        # gradient), leaves its amax for this layer's linear_fc2 (CoatConfig.fuse_residual_backward)
        in_stack = getattr(self.layer.input_layernorm, "returns_residual", False)
        self.dy_amax = self.dy.float().abs().amax() if in_stack else None

    def __call__(self, context=None) -> None:
        from coat_megatron.fp8.handoff import deposit_loose_grad_amax

        for w in self.weights:
            w.grad_added_to_main_grad = False  # DDP's zero_grad_buffer: the first micro-batch of a step
        x = self.x.clone().requires_grad_()
        if self.dy_amax is not None:
            deposit_loose_grad_amax(self.dy, self.dy_amax)
        with context if context is not None else contextlib.nullcontext():
            out, _ = self.layer(x, attention_mask=None, rotary_pos_emb=self.rope)
            out.backward(self.dy)
        for p in [x, *self.layer.parameters()]:
            p.grad = None


def count_layer(kind: str, recipe: str | None = None) -> dict:
    """Run in a rank at TP 2 (see the module docstring): the ``LaunchCounter.summary()`` of one
    micro-batch's fwd+bwd, with ``excluding_attention``: {"launches", "allocations"} less the
    regions ``NOT_COATS`` (attention's own work, the same in every mode)."""
    import coat_kernels.backend as backend

    backend._OVERRIDE = "triton"  # the GPU path: Triton kernels (interpreted), not the torch references
    step = MicroBatch(kind, recipe)
    for _ in range(WARM_UP):
        step()
    counter = LaunchCounter(regions=regions(step.layer))
    step(counter)
    return with_excluded_attention(counter.summary())


def with_excluded_attention(got: dict) -> dict:
    """``got`` (a ``LaunchCounter.summary()``) with ``excluding_attention`` added."""
    got["excluding_attention"] = {
        kind: got[kind] - sum(got["regions"].get(r, {}).get(kind, 0) for r in NOT_COATS)
        for kind in ("launches", "allocations")
    }
    return got
