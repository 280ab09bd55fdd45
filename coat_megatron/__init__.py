"""coat_megatron: COAT-style FP8 training for Megatron-Core.

FP8 activations with mixed granularity (1xG groups for what non-linear ops read or save,
per-tensor scales for GEMM inputs) and FP8 AdamW states with dynamic range expansion, as a
Megatron-Core layer spec and optimizer. The Triton kernels live in ``coat_kernels``.
"""

from .config import RECIPES, CoatConfig

__all__ = ["CoatConfig", "RECIPES"]
__version__ = "0.1.0"
