"""Megatron-Core modules for the COAT layer spec (they drop into TransformerLayer's slots)."""

from .linear import CoatColumnParallelLinear, CoatRowParallelLinear
from .mlp import CoatMLP
from .norm import CoatNorm

__all__ = ["CoatColumnParallelLinear", "CoatMLP", "CoatNorm", "CoatRowParallelLinear"]
