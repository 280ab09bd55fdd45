"""Make the Triton interpreter's float casts exact, so CPU tests can compare FP8 codes as bytes,
and let Triton 3.6's interpreter run with numpy >= 2.4.

The interpreter (triton 3.6-3.9) converts floats with its own bit manipulation, which is wrong for
about 2% of fp32 -> fp8 values (a rounding carry into the exponent halves the value, ties round
away from zero, subnormals are truncated) and truncates fp32 -> bf16 instead of rounding
(upstream triton issue 8322). torch's CPU casts round to nearest even like the GPU does, so the
fix converts through torch: view the raw buffer as the source torch dtype, cast, view back.

Triton 3.6's interpreter turns a scalar tensor into a Python int (a loop bound read at run time,
as ``range(0, n_programs, ...)`` in ``coat_kernels.amax``) with ``int()`` of its one-element array,
which numpy 2.4 and later refuse ("only 0-dimensional arrays can be converted to Python scalars");
Triton 3.7.1 and later squeeze the array first, and so does this module for every version.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl

_TORCH_DTYPES = {
    tl.float32: torch.float32,
    tl.float16: torch.float16,
    tl.bfloat16: torch.bfloat16,
    tl.float8e4nv: torch.float8_e4m3fn,
    tl.float8e5: torch.float8_e5m2,
    tl.float64: torch.float64,
}
_BITS = {
    8: (np.uint8, torch.uint8),
    16: (np.uint16, torch.uint16),
    32: (np.uint32, torch.uint32),
    64: (np.uint64, torch.uint64),
}


def _convert_float_with_torch(input, input_dtype, output_dtype, rounding_mode):
    src = _TORCH_DTYPES[input_dtype]
    dst = _TORCH_DTYPES[output_dtype]
    np_in, t_in = _BITS[input_dtype.primitive_bitwidth]
    np_out, t_out = _BITS[output_dtype.primitive_bitwidth]
    raw = np.ascontiguousarray(input).view(np_in)
    out = torch.from_numpy(raw.copy()).view(t_in).view(src).to(dst).view(t_out)
    return out.numpy().view(np_out).reshape(np.shape(input))


def _scalar_as_int(tensor) -> int:
    return int(tensor.handle.data.squeeze())


def install() -> None:
    from triton.runtime import interpreter

    interpreter._convert_float = _convert_float_with_torch
    patch_tensor = interpreter._patch_lang_tensor  # applied at every interpreted launch, then undone

    def patch_tensor_with_scalar_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_as_int)

    interpreter._patch_lang_tensor = patch_tensor_with_scalar_index
