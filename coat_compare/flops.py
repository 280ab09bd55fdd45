"""Model FLOPs per token, and the GPU peaks that model FLOP utilisation (MFU) is measured against.

Per token a training step does 6 x N + 12 x L x h x s floating-point operations (the forward's
2 per parameter and the backward's 4, plus attention's two matmuls over the sequence,
QK^T and AV, at 2 x h x s each per layer, times three for forward and backward), with N the
parameters that take part in matmuls: every parameter but the input embedding, whose forward is
a lookup. L layers, hidden size h, sequence length s. Model FLOPs count what the model needs,
not what the implementation does (no recomputation, no causal-mask savings), so they compare
recipes fairly. MFU: model TFLOP/s per GPU over the GPU's dense peak.
"""

from __future__ import annotations

from .presets import Preset

FORMULA = "6 x N + 12 x layers x hidden x seq per token, N = parameters but the input embedding"

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


def flops_per_token(preset: Preset) -> float:
    return 6.0 * matmul_parameters(preset) + 12.0 * preset.layers * preset.hidden * preset.seq


def layer_flops_per_token(preset: Preset) -> float:
    """One transformer layer's share of the formula: 6 x its parameters + 12 x hidden x seq."""
    return 6.0 * layer_parameters(preset) + 12.0 * preset.hidden * preset.seq


def peaks(device_name: str) -> dict[str, float] | None:
    """The dense BF16 and FP8 peaks of the GPU named, or None where this table has none."""
    for key, value in PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None


def utilisation(preset: Preset, tokens_per_s_per_gpu: float, device_name: str, per_token: float | None = None) -> dict:
    """The row fields: model TFLOP/s per GPU (``per_token`` FLOPs a token, the whole model's by
    default; None on a CPU, where it says nothing of a GPU) and MFU against the BF16 and FP8 peaks
    (None where the GPU's peaks are unknown)."""
    if device_name == "CPU":
        return {"model_tflops_per_gpu": None, "mfu_bf16": None, "mfu_fp8": None}
    tflops = tokens_per_s_per_gpu * (flops_per_token(preset) if per_token is None else per_token) / 1e12
    peak = peaks(device_name)
    return {
        "model_tflops_per_gpu": tflops,
        "mfu_bf16": tflops / peak["bf16"] if peak else None,
        "mfu_fp8": tflops / peak["fp8"] if peak else None,
    }


def layer_utilisation(preset: Preset, ms: float, tp: int, device_name: str) -> dict:
    """The layer-row fields: one layer's fwd+bwd of seq x micro-batch tokens in ``ms``, split over
    ``tp`` GPUs, as ``utilisation`` gives them with one layer's FLOPs a token."""
    tokens_per_s_per_gpu = preset.seq * preset.micro_batch / (ms / 1e3) / tp
    return utilisation(preset, tokens_per_s_per_gpu, device_name, layer_flops_per_token(preset))
