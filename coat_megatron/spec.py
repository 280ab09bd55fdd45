"""get_gpt_layer_coat_spec: Megatron-Core's GPT layer spec with COAT modules in its slots.

Beside Megatron's ``get_gpt_layer_local_spec`` and ``get_gpt_layer_with_transformer_engine_spec``:

    input_layernorm    CoatNorm (BF16 residual -> per-tensor FP8)
    linear_qkv         CoatColumnParallelLinear (FP8 GEMMs; FP8 all-gather under SP)
    core_attention     Megatron's, BF16 (TE's when TransformerEngine is installed, else local)
    linear_proj        CoatRowParallelLinear (quantizes the attention output just in time)
    pre_mlp_layernorm  CoatNorm
    mlp                CoatMLP: fc1 -> 1x16 FP8 -> SwiGLU -> per-tensor FP8 -> fc2
    residual adds      Megatron's bias-dropout-add, BF16

Parameter names and shapes are the local spec's, and the dist-checkpoint key map is the same,
so a checkpoint moves between the COAT, local and TE specs.
"""

from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .config import CoatConfig
from .layers import CoatColumnParallelLinear, CoatMLP, CoatNorm, CoatRowParallelLinear
from .optional import transformer_engine_available


def _core_attention(core_attention):
    if core_attention is not None:
        return core_attention
    if transformer_engine_available():
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    return DotProductAttention


def _saves_its_output(core_attention) -> bool:
    """TE's attention (flash / fused) keeps its output for its backward; Megatron's unfused local
    attention does not (it keeps the probabilities and V)."""
    return getattr(core_attention, "__name__", "") == "TEDotProductAttention"


def get_gpt_layer_coat_spec(
    coat_config: CoatConfig | None = None,
    *,
    core_attention=None,
    proj_input_saved_by_attention: bool | None = None,
    num_experts: int | None = None,
    qk_layernorm: bool = False,
) -> ModuleSpec:
    """A ``TransformerLayer`` spec with COAT's FP8 modules (RMSNorm or LayerNorm, by the config).

    Args:
        coat_config: the recipe (formats, group size); defaults to ``CoatConfig()``.
        core_attention: the attention core; default TE's ``TEDotProductAttention`` when TE is
            installed, else Megatron's ``DotProductAttention``. It stays BF16.
        proj_input_saved_by_attention: the core attention keeps its output for its backward
            (flash attention does), so linear_proj saves nothing new; else linear_proj saves its
            FP8 transposed input. Default: True for TE's attention (it saves its output), False
            otherwise.
    """
    if num_experts:
        raise ValueError("COAT's layer spec covers dense layers; mixture-of-experts layers are not supported yet")
    if qk_layernorm:
        raise ValueError("qk_layernorm is not supported by the COAT layer spec")
    cfg = coat_config or CoatConfig()
    attention = _core_attention(core_attention)
    if proj_input_saved_by_attention is None:
        proj_input_saved_by_attention = _saves_its_output(attention)
    norm = partial(CoatNorm, coat_config=cfg)
    column = partial(CoatColumnParallelLinear, coat_config=cfg)
    row = partial(CoatRowParallelLinear, coat_config=cfg)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=column,
                    core_attention=attention,
                    linear_proj=partial(
                        CoatRowParallelLinear, coat_config=cfg, input_saved_by_producer=proj_input_saved_by_attention
                    ),
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=partial(CoatMLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def get_gpt_block_coat_spec(
    config, coat_config: CoatConfig | None = None, *, vp_stage: int | None = None, **layer_kwargs
) -> TransformerBlockSubmodules:
    """The block of this pipeline stage (and virtual stage ``vp_stage``): COAT layers and a BF16
    final norm (``CoatNorm(output="bf16")``, which, unlike Megatron's torch fallback norm, works
    under sequence parallelism)."""
    layer = get_gpt_layer_coat_spec(coat_config, **layer_kwargs)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=partial(CoatNorm, coat_config=coat_config or CoatConfig(), output="bf16"),
    )
