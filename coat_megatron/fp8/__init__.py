"""The FP8 activation flow: the Fp8Tensor type and the fused ops that produce and consume it.

Inside a transformer layer: BF16 residual -> ``rmsnorm_to_fp8`` -> per-tensor FP8 -> ``fp8_linear``
(fc1, 1xG FP8 out) -> ``swiglu_fp8`` -> per-tensor FP8 -> ``fp8_linear`` (fc2, BF16 out) -> the
residual add in BF16. Nothing FP8 crosses a layer boundary.
"""

from .handoff import AmaxHandoff, OutputForm
from .linear import fp8_linear
from .norm import layernorm_to_fp8, rmsnorm_to_fp8
from .swiglu import swiglu_fp8
from .tensor import HANDLED_OPS, Fp8Tensor
from .weights import Fp8WeightCache, invalidate_weight_caches

__all__ = [
    "AmaxHandoff",
    "HANDLED_OPS",
    "Fp8Tensor",
    "Fp8WeightCache",
    "OutputForm",
    "fp8_linear",
    "invalidate_weight_caches",
    "layernorm_to_fp8",
    "rmsnorm_to_fp8",
    "swiglu_fp8",
]
