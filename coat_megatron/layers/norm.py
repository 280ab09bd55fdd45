"""CoatNorm: Megatron's input_layernorm / pre_mlp_layernorm slot, producing FP8 for the next linear.

It takes the BF16 residual stream and returns a per-tensor FP8 ``Fp8Tensor`` (RMSNorm or
LayerNorm, by ``config.normalization``), which the COAT linear that follows consumes without a
BF16 copy. Parameters and their names are Megatron's (``weight``, and ``bias`` for LayerNorm),
so checkpoints move between this and the local spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from ..config import CoatConfig
from ..fp8 import layernorm_to_fp8, rmsnorm_to_fp8


class CoatNorm(MegatronModule):
    """``output="fp8"`` (input_layernorm, pre_mlp_layernorm) returns FP8 for the next COAT linear
    (with ``CoatConfig.fuse_residual_backward``, as ``(output, residual)``: its input is the layer's
    residual, whose gradient its backward adds in its own pass);
    ``output="bf16"`` (the block's final norm, before the output layer) returns BF16, and unlike
    Megatron's torch fallback norm it works under sequence parallelism."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        coat_config: CoatConfig | None = None,
        output: str = "fp8",
        **kwargs,
    ):
        super().__init__(config=config)
        if output not in ("fp8", "bf16"):
            raise ValueError(f"output={output!r}: use 'fp8' or 'bf16'")
        self.output = output
        self.coat = (coat_config or CoatConfig()).for_layers(config)
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"COAT norms support RMSNorm and LayerNorm, not {config.normalization!r}")
        if hidden_size % self.coat.group_size:
            raise ValueError(
                f"hidden size {hidden_size} is not a multiple of the FP8 group size {self.coat.group_size}; "
                f"use --coat-group-size with a divisor of {hidden_size} or pad the model"
            )
        self.eps = eps
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        self.bias = (
            None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device))
        )
        self.sequence_parallel = config.sequence_parallel
        # (output, residual): Megatron's layer takes the residual from the norm; not where it recomputes the
        # norm (its checkpoint of the norm keeps one output, and would free the residual with it)
        recomputed = config.recompute_granularity == "selective" and "layernorm" in (config.recompute_modules or [])
        self.returns_residual = output == "fp8" and self.coat.fuse_residual_backward and not recomputed
        for p in self.parameters():
            # Megatron all-reduces the grads of these over the tensor-parallel group under SP
            p.sequence_parallel = self.sequence_parallel

    def forward(self, x: torch.Tensor):
        if self.output == "bf16":
            w = self.weight + 1 if self.zero_centered_gamma else self.weight
            if self.rms:
                return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), self.eps)
            return F.layer_norm(x, (x.shape[-1],), w.to(x.dtype), self.bias.to(x.dtype), self.eps)
        kw = dict(
            group_size=self.coat.group_size,
            zero_centered_gamma=self.zero_centered_gamma,
            out_fmt=self.coat.forward_format,
            saved_fmt=self.coat.forward_format,
            # under SP the consumer gathers the codes (each rank's chunk with its own scale: no amax
            # is shared over the group) and makes its own transposed copies
            transpose=None if self.sequence_parallel else "recompute" if self.coat.recompute_norm_output else "store",
            input_store=self.coat.norm_input_store,
            # ... as one message, codes and scale, that it sends as it is
            packed=self.sequence_parallel,
            # dW into DDP's main_grad in the backward's own kernels, as COAT's linears do
            into_main_grad=self.coat.fuse_wgrad_accumulation
            or bool(getattr(self.config, "gradient_accumulation_fusion", False)),
            scratch=self.coat.scratch_buffers,
            residual=self.returns_residual,
        )
        if self.rms:
            return rmsnorm_to_fp8(x, self.weight, self.eps, **kw)
        return layernorm_to_fp8(x, self.weight, self.bias, self.eps, **kw)
