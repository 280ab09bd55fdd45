"""Model FLOPs per token, and the GPU peaks that model FLOP utilisation (MFU) is measured against.

Two counts, each named where it is reported:

- Megatron's causal count, the one behind ``model_tflops_per_gpu`` and MFU: the number Megatron's
  training loop prints as "throughput per GPU (TFLOP/s/GPU)", from
  ``megatron.training.training.num_floating_point_operations``, called here with the arguments
  Megatron would have for the model coat-compare trains (``megatron_args``), so that the count
  stays the installed megatron-core's. Per token and layer: 3 (forward, wgrad, dgrad) x 2 (a
  multiply-add) x the matmuls' weights, h x (q + 2 kv) + q x h for QKV and the output projection
  and 3 x h x ffn for SwiGLU, plus causal attention, 6 x q x s (QK^T and AV each take s/2 keys on
  average: the causal mask's half); and once, the output layer's 6 x h x vocab. q = heads x head
  dim (= h), kv = query groups x head dim. No norms, no input embedding (a lookup).
- The full-attention count (``model_tflops_per_gpu_full_attn``), coat-compare's count before
  2026-11-28: 6 x N + 12 x layers x hidden x seq per token, N the parameters but the input
  embedding (norms included); attention as if every query saw all s keys (no causal halving).

Both count what the model needs, not what an implementation does (no recomputation). MFU: model
TFLOP/s per GPU (Megatron's count) over the GPU's dense peak.
"""

from __future__ import annotations

import argparse
import functools

from .presets import Preset

FORMULA = (
    "Megatron's causal count (megatron.training.training.num_floating_point_operations): per token "
    "6 x (h x (q + 2 kv) + q x h + 3 x h x ffn + q x seq) per layer + 6 x h x vocab"
)
FORMULA_FULL_ATTN = "6 x N + 12 x layers x hidden x seq per token, N = parameters but the input embedding"

# dense (no sparsity) tensor-core peaks in TFLOP/s, from the vendor's data sheets (SXM parts)
PEAK_TFLOPS = {
    "H100": {"bf16": 989.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0},
}


def layer_parameters(preset: Preset) -> int:
    """The parameters of one transformer layer (every tensor-parallel shard), as counted in N."""
    h = preset.hidden
    head_dim = h // preset.heads
    kv = (preset.kv_heads or preset.heads) * head_dim
    attention = h * (h + 2 * kv) + h * h  # QKV and the output projection
    mlp = 3 * h * preset.ffn  # SwiGLU: gate and up (fc1), down (fc2)
    norms = 2 * h
    return attention + mlp + norms


def matmul_parameters(preset: Preset) -> int:
    """N: the parameters of the whole model (every tensor-parallel shard) that take part in matmuls."""
    h = preset.hidden
    return preset.layers * layer_parameters(preset) + h + preset.vocab * h  # final norm, output layer


def flops_per_token_full_attn(preset: Preset) -> float:
    """The full-attention count of the whole model, per token: 6 x N + 12 x layers x hidden x seq."""
    return 6.0 * matmul_parameters(preset) + 12.0 * preset.layers * preset.hidden * preset.seq


def layer_flops_per_token_full_attn(preset: Preset) -> float:
    """One transformer layer's share of the full-attention count: 6 x its parameters + 12 x hidden x seq."""
    return 6.0 * layer_parameters(preset) + 12.0 * preset.hidden * preset.seq


def megatron_args(preset: Preset, num_layers: int | None = None) -> argparse.Namespace:
    """The arguments ``num_floating_point_operations`` reads, as Megatron's parser and
    ``validate_args`` would set them for the model coat-compare builds (``build.transformer_config``
    and ``build.stage_models``): a Llama-style GPT with SwiGLU, no biases, RoPE, untied output
    layer, grouped-query attention where ``kv_heads`` is set, no MoE, MTP, MLA, hybrid layers or
    linear attention. ``padded_vocab_size`` is ``preset.vocab``: the output layer coat-compare builds
    is that wide (Megatron's padding to a multiple of 128 x TP leaves every preset's vocabulary as
    it is at TP 1 and 2). ``num_layers`` overrides the preset's (0: the output layer alone)."""
    gqa = preset.kv_heads is not None and preset.kv_heads != preset.heads
    return argparse.Namespace(
        num_layers=preset.layers if num_layers is None else num_layers,
        hidden_size=preset.hidden,
        ffn_hidden_size=preset.ffn,
        num_attention_heads=preset.heads,
        kv_channels=preset.hidden // preset.heads,
        group_query_attention=gqa,
        num_query_groups=preset.kv_heads if gqa else preset.heads,
        seq_length=preset.seq,
        padded_vocab_size=preset.vocab,
        swiglu=True,
        attention_output_gate=False,
        multi_latent_attention=False,
        experimental_attention_variant=None,
        hybrid_layer_pattern=None,
        num_experts=None,
        moe_layer_freq=1,
        moe_router_topk=2,
        moe_ffn_hidden_size=None,
        moe_shared_expert_intermediate_size=None,
        moe_latent_size=None,
        mtp_num_layers=None,
    )


def _megatron_count():
    try:
        from megatron.training.training import num_floating_point_operations
    except ImportError as e:
        raise RuntimeError(
            "coat_compare.flops needs megatron.training.training.num_floating_point_operations (shipped with "
            f"megatron-core) for Megatron's FLOP count, and it does not import: {e}"
        ) from e
    return num_floating_point_operations


@functools.lru_cache(maxsize=None)
def megatron_flops(preset: Preset, num_layers: int | None = None) -> float:
    """Megatron's count for one sequence of ``preset.seq`` tokens (a global batch of 1), fwd+bwd."""
    count = _megatron_count()
    try:
        return float(count(megatron_args(preset, num_layers), 1))
    except AttributeError as e:
        missing = getattr(e, "name", None) or str(e)
        raise RuntimeError(
            f"megatron.training.training.num_floating_point_operations reads args.{missing}, which "
            "coat_compare.flops.megatron_args does not set (a newer megatron-core?): add it there, with the value "
            f"Megatron's parser gives it for a dense Llama-style GPT ({e})"
        ) from e


def flops_per_token(preset: Preset) -> float:
    """Megatron's causal count of the whole model, per token."""
    return megatron_flops(preset) / preset.seq


def layer_flops_per_token(preset: Preset) -> float:
    """One transformer layer's share of Megatron's count, per token: the count with one layer less
    subtracted (every layer counts the same)."""
    layers = max(preset.layers, 1)
    return (megatron_flops(preset, layers) - megatron_flops(preset, layers - 1)) / preset.seq


def peaks(device_name: str) -> dict[str, float] | None:
    """The dense BF16 and FP8 peaks of the GPU named, or None where this table has none."""
    for key, value in PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None


NO_FIELDS = {"model_tflops_per_gpu": None, "model_tflops_per_gpu_full_attn": None, "mfu_bf16": None, "mfu_fp8": None}


def _fields(tokens_per_s_per_gpu: float, device_name: str, per_token, per_token_full_attn) -> dict:
    if device_name == "CPU":
        return dict(NO_FIELDS)
    tflops = tokens_per_s_per_gpu * per_token() / 1e12
    peak = peaks(device_name)
    return {
        "model_tflops_per_gpu": tflops,
        "model_tflops_per_gpu_full_attn": tokens_per_s_per_gpu * per_token_full_attn() / 1e12,
        "mfu_bf16": tflops / peak["bf16"] if peak else None,
        "mfu_fp8": tflops / peak["fp8"] if peak else None,
    }


def utilisation(preset: Preset, tokens_per_s_per_gpu: float, device_name: str) -> dict:
    """The row fields: model TFLOP/s per GPU by Megatron's causal count (``model_tflops_per_gpu``)
    and by the full-attention count (``model_tflops_per_gpu_full_attn``), and MFU of Megatron's
    count against the BF16 and FP8 peaks (None where the GPU's peaks are unknown). All None on a
    CPU, where they say nothing of a GPU."""
    return _fields(
        tokens_per_s_per_gpu,
        device_name,
        lambda: flops_per_token(preset),
        lambda: flops_per_token_full_attn(preset),
    )


def layer_utilisation(preset: Preset, ms: float, tp: int, device_name: str) -> dict:
    """The layer-row fields: one layer's fwd+bwd of seq x micro-batch tokens in ``ms``, split over
    ``tp`` GPUs, as ``utilisation`` gives them with one layer's share of each count."""
    tokens_per_s_per_gpu = preset.seq * preset.micro_batch / (ms / 1e3) / tp
    return _fields(
        tokens_per_s_per_gpu,
        device_name,
        lambda: layer_flops_per_token(preset),
        lambda: layer_flops_per_token_full_attn(preset),
    )
