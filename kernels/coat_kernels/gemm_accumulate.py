"""FP8 GEMM that accumulates into its output in the GEMM's epilogue: ``out += (a * a_scale) @ (b * b_scale)``.

Why: a wgrad summed over micro-batches into a gradient buffer (Megatron's gradient-accumulation
fusion). ``torch._scaled_mm`` has no accumulate input, so without this the product goes to an FP32
temporary of the weight's size that a second kernel adds into the buffer: per linear parameter and
micro-batch, 4 bytes written, then 4 + 2 read and 2 written again. cuBLASLt computes
``D = alpha * op(A) op(B) + beta * C`` with ``beta = 1`` and ``C = D = out``: the buffer is read and
written once, in FP32 inside the GEMM, and rounded once to its dtype, as the temporary-and-add does.

Backends:

- cuBLASLt through ctypes (``coat_kernels.cublaslt``: the library torch itself loads, one handle and
  a 32 MiB workspace per device, a matmul plan per (shape, dtypes) cached);
- the FP32 temporary and an add (``accumulate_by_add``), also the CPU's reference and the fallback
  where the library cannot be loaded.

(Torch newer than the GPU image's 2.11 is adding a scaled addmm; this does not rely on it.)

Layouts as ``gemm.fp8_gemm``: ``a`` (M, K) row-major, ``b`` (K, N) column-major, ``out`` (M, N)
row-major, contiguous. cuBLASLt is column-major, so the call computes out^T = b^T a^T: its A is
``b`` (K x N, transposed), its B is ``a`` (K x M), its C and D are ``out`` viewed as N x M: the
"TN" form Hopper's FP8 GEMM requires.
"""

from __future__ import annotations

import torch

from .cublaslt import (  # noqa: F401  (the binding's names, also reached through this module by tests)
    _CUBLAS_COMPUTE_32F,
    _CUDA_R_32F,
    _DESC_A_SCALE_POINTER,
    _DESC_FAST_ACCUM,
    _DESC_TRANSA,
    _OP_T,
    _PREF_MAX_WORKSPACE_BYTES,
    _WORKSPACE_BYTES,
    CublasLtError,
    _cublaslt,
    _library_path,
    alignment,
)
from .gemm import _pad_k, check_gpu_layout, check_operands, fp8_gemm, fp8_gemm_reference

ACCUMULATE_BACKENDS = ("auto", "cublaslt", "add")


def accumulate_by_add(a, a_scale, b, b_scale, out, *, use_fast_accum: bool = False) -> torch.Tensor:
    """The reference (and the fallback): the product in FP32, added into ``out`` (rounded once)."""
    if out.is_cuda:
        product = fp8_gemm(a, a_scale, b, b_scale, out_dtype=torch.float32, use_fast_accum=use_fast_accum)
    else:
        product = fp8_gemm_reference(a, a_scale, b, b_scale, out_dtype=torch.float32)
    return out.add_(product)


def backend_for(out: torch.Tensor) -> str:
    """Which way ``fp8_gemm_accumulate`` goes for ``out``: "cublaslt" on a GPU where torch ships
    cuBLASLt and ``out``'s height is a multiple of 16 (cuBLASLt's FP8 leading-dimension rule), else
    "add"."""
    return "cublaslt" if out.is_cuda and out.shape[0] % 16 == 0 and _cublaslt() is not None else "add"


def fp8_gemm_accumulate(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    use_fast_accum: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """``out += (a * a_scale) @ (b * b_scale)``, the product accumulated in FP32 and added to ``out``
    (BF16 or FP32, (M, N) contiguous) in one rounding. Returns ``out``.

    ``backend``: "auto" (``backend_for``), "cublaslt" or "add" (the FP32 temporary and an add).
    Scales are 0-d (or one-element) FP32 tensors, as the quantizers return them.
    """
    if backend not in ACCUMULATE_BACKENDS:
        raise ValueError(f"backend {backend!r}: use 'auto', 'cublaslt' or 'add'")
    check_operands(a, b, "fp8_gemm_accumulate")
    if out.shape != (a.shape[0], b.shape[1]) or out.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"out must be a BF16 or FP32 tensor of shape {(a.shape[0], b.shape[1])}, got {out.dtype} {tuple(out.shape)}"
        )
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (row-major)")
    chosen = backend_for(out) if backend == "auto" else backend
    if chosen == "cublaslt" and backend == "auto" and alignment(a.data_ptr(), b.data_ptr(), out.data_ptr()) < 16:
        chosen = "add"  # buffers cuBLASLt's FP8 GEMM cannot take (an explicit "cublaslt" raises)
    if chosen == "add" or not out.is_cuda:
        return accumulate_by_add(a, a_scale, b, b_scale, out, use_fast_accum=use_fast_accum)
    check_gpu_layout(a, b, "fp8_gemm_accumulate")
    if a.shape[0] % 16:  # out's rows are cuBLASLt's columns of D here: its leading dimension
        raise ValueError(f"the output height {a.shape[0]} of an accumulating FP8 GEMM must be a multiple of 16")
    a, b = _pad_k(a, b)
    sa = a_scale if a_scale.dim() == 0 else a_scale.reshape(())
    sb = b_scale if b_scale.dim() == 0 else b_scale.reshape(())
    lt = _cublaslt()
    if lt is None:
        from . import cublaslt

        raise CublasLtError(f"cuBLASLt is not available here ({cublaslt._LT_ERROR}); use backend='add'")
    lt.accumulate(a, sa, b, sb, out, use_fast_accum)
    return out
