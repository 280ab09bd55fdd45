"""CoatMLP: Megatron's MLP with fc1 -> FP8 SwiGLU -> fc2 kept in FP8 end to end.

fc1 writes its output as 1x16 FP8 (``OutputForm.SWIGLU_INPUT``: finding SwiGLU's output amax in the
same pass), SwiGLU reads that and writes per-tensor FP8 for fc2, and fc2 writes BF16 for Megatron's
bias-dropout-add. Backward, SwiGLU hands fc1 the amax of dh through the ``AmaxHandoff`` that fc1's
output carried.
With ``CoatConfig.swiglu_input_store="bf16"`` (an accuracy ablation) fc1 writes BF16 instead, which
SwiGLU reads exactly and saves.
Construction (and so parameters, TP split of the gated fc1, checkpoints) is Megatron's MLP.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from ..fp8 import OutputForm, swiglu_fp8
from .linear import CoatColumnParallelLinear, CoatRowParallelLinear


class CoatMLP(MLP):
    """Built by Megatron's ``MLP.as_mlp_submodule``; the COAT recipe is that of its COAT linears."""

    def __init__(self, config, submodules, *args, **kwargs):
        if not (config.gated_linear_unit and config.activation_func is F.silu):
            raise ValueError(
                "COAT's FP8 MLP implements SwiGLU (gated_linear_unit=True with activation_func=F.silu, "
                "--swiglu); use Megatron's local spec for other activations"
            )
        if config.activation_func_clamp_value is not None or config.glu_linear_offset != 0.0:
            raise ValueError("COAT's FP8 SwiGLU does not implement activation_func_clamp_value or glu_linear_offset")
        super().__init__(config, submodules, *args, **kwargs)
        if not (
            isinstance(self.linear_fc1, CoatColumnParallelLinear) and isinstance(self.linear_fc2, CoatRowParallelLinear)
        ):
            raise TypeError(
                "CoatMLP needs CoatColumnParallelLinear fc1 and CoatRowParallelLinear fc2 (get_gpt_layer_coat_spec)"
            )
        self.coat = self.linear_fc1.coat
        ffn_local = self.linear_fc2.input_size_per_partition
        if ffn_local % self.coat.group_size:
            raise ValueError(
                f"the FFN width per tensor-parallel rank, {ffn_local}, is not a multiple of the FP8 group size "
                f"{self.coat.group_size}; choose ffn_hidden_size / tensor_model_parallel_size divisible by "
                f"{self.coat.group_size} or set --coat-group-size"
            )
        exact_input = self.coat.swiglu_input_store == "bf16"
        self.linear_fc1.output_form = OutputForm.BF16 if exact_input else OutputForm.SWIGLU_INPUT
        if self.linear_fc1.skip_bias_add and self.linear_fc1.bias is not None:
            self.linear_fc1.skip_bias_add = False  # the bias goes into the GEMM epilogue, before quantizing

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise ValueError("per_token_scale (MoE) is not supported by COAT's MLP")
        h, _ = self.linear_fc1(hidden_states)
        a = swiglu_fp8(
            h,
            group_size=self.coat.group_size,
            out_fmt=self.coat.forward_format,
            saved_fmt=self.coat.forward_format,
            input_store=self.coat.swiglu_input_store,
            scratch=self.coat.scratch_buffers,
        )
        return self.linear_fc2(a)
