"""coat_kernels: Triton kernels for COAT-style FP8 training, each with its pure-torch reference.

Every public function here picks Triton for CUDA tensors and the torch reference otherwise
(``backend=`` forces one; see ``coat_kernels.backend``). Nothing in this package imports Megatron.
"""

from .backend import use_triton
from .expanded import ExpandedFp8, dequantize_expanded, quantize_expanded
from .formats import FP8_FORMATS, GROUP_SIZES, Fp8Format, fp8_format
from .fp8_adamw import fp8_adamw_step
from .master import join_master, split_master
from .per_group import dequantize_per_group, quantize_per_group
from .per_tensor import (
    dequantize_per_tensor,
    quantize_per_tensor,
    quantize_per_tensor_transposed,
    tensor_amax,
    transpose_codes,
)
from .scaling import NonFiniteInputError

__all__ = [
    "ExpandedFp8",
    "FP8_FORMATS",
    "GROUP_SIZES",
    "Fp8Format",
    "NonFiniteInputError",
    "dequantize_expanded",
    "dequantize_per_group",
    "dequantize_per_tensor",
    "fp8_adamw_step",
    "fp8_format",
    "join_master",
    "quantize_expanded",
    "quantize_per_group",
    "quantize_per_tensor",
    "split_master",
    "tensor_amax",
    "transpose_codes",
    "quantize_per_tensor_transposed",
    "use_triton",
]
