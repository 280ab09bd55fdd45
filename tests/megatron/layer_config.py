"""The TransformerConfig of the one-layer Llama-like tests (launch counts, sequence parallelism, graphed
layers): SwiGLU, RMSNorm, no biases or dropout, BF16, and every fusion off, so that the local spec
and a CPU can run it; each test passes what differs (sizes, parallel sizes, where weights start)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_config(hidden: int, ffn: int, heads: int, **overrides):
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
    )
    return TransformerConfig(**(fields | overrides))
