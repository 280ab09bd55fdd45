"""Per-tensor-scaled FP8 GEMM: cuBLASLt on the GPU (a cached plan, or ``torch._scaled_mm``), FP32 on the CPU.

    out = (a * a_scale) @ (b * b_scale) (+ bias)

``a`` is (M, K) row-major and ``b`` is (K, N) column-major (``b.t()`` contiguous): the layouts
cuBLASLt's FP8 GEMM takes, and the ones the quantizers write (an operand and its transposed
copy). K and N must be multiples of 16 on the GPU; a K that is not (the token count of a wgrad
GEMM) is zero-padded here, which leaves the product unchanged.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .backend import use_triton
from .cublaslt import _cublaslt, alignment, check_scale_alignment

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_LT_OUT = (torch.bfloat16, torch.float32)

# Which library runs a GPU GEMM without bias: "auto" (cuBLASLt with a cached plan, through
# coat_kernels.cublaslt, where the shapes and buffers allow; torch._scaled_mm otherwise) or "torch"
# (always torch._scaled_mm, which asks cuBLASLt's heuristic on every call). Both are cuBLASLt's FP8
# GEMM with FP32 accumulation; the cached plan saves host time per call.
GEMM = os.environ.get("COAT_FP8_GEMM", "auto")
if GEMM not in ("auto", "torch"):
    raise ValueError(f"COAT_FP8_GEMM={GEMM!r}: use auto (the default) or torch")


def fp8_gemm_reference(a, a_scale, b, b_scale, *, out_dtype=torch.bfloat16, bias=None):
    out = (a.float() * a_scale.float()) @ (b.float() * b_scale.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def check_operands(a: torch.Tensor, b: torch.Tensor, caller: str) -> None:
    """FP8 ``a`` (M, K) and ``b`` (K, N), not both E5M2 (cuBLASLt has no such GEMM)."""
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        raise TypeError(f"{caller} takes FP8 operands, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise TypeError("E5M2 x E5M2 GEMMs are not supported by cuBLASLt; quantize one operand to E4M3")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{caller} shapes do not match: a {tuple(a.shape)}, b {tuple(b.shape)}")


def check_gpu_layout(a: torch.Tensor, b: torch.Tensor, caller: str) -> None:
    """What cuBLASLt's FP8 GEMM takes: ``a`` row-major, ``b`` column-major, an output width N that
    is a multiple of 16 (K is padded by ``_pad_k``)."""
    if not (a.is_contiguous() and b.t().is_contiguous()):
        raise ValueError(f"{caller} needs a row-major and b column-major (b.t() contiguous)")
    if b.shape[1] % 16:
        raise ValueError(f"the output width {b.shape[1]} of an FP8 GEMM must be a multiple of 16; pad the layer")


def _cached_plan_fits(a, a_scale, b, b_scale, out_dtype, out) -> bool:
    """Whether the cached-plan cuBLASLt call takes this GEMM: an output height that is a multiple of
    16 (cuBLASLt's FP8 rule for the leading dimension of its transposed view), a BF16 or FP32
    output, one-element FP32 scales on the GPU, and 16-byte aligned buffers."""
    return (
        a.shape[0] % 16 == 0
        and out_dtype in _LT_OUT
        and a_scale.dtype == torch.float32
        and b_scale.dtype == torch.float32
        and a_scale.numel() == 1
        and b_scale.numel() == 1
        and a_scale.is_cuda
        and b_scale.is_cuda
        and alignment(a.data_ptr(), b.data_ptr(), 0 if out is None else out.data_ptr()) >= 16
    )


def _pad_k(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pad = -a.shape[1] % 16
    if not pad:
        return a, b
    a = F.pad(a.view(torch.uint8), (0, pad)).view(a.dtype)
    b = F.pad(b.t().view(torch.uint8), (0, pad)).view(b.dtype).t()
    return a, b


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale) + bias with FP32 accumulation.

    Args:
        a: (M, K) FP8, row-major. b: (K, N) FP8, column-major. E5M2 x E5M2 is not allowed.
        a_scale, b_scale: FP32 tensors of one element (per-tensor scales).
        bias: optional (N,) vector, added in the epilogue.
        use_fast_accum: Hopper's faster, less precise accumulation (TE uses it for fprop only).
        out: a contiguous (M, N) tensor of ``out_dtype`` to write the product into (overwritten).
    Returns:
        (M, N) in ``out_dtype`` (``out`` when given).
    """
    check_operands(a, b, "fp8_gemm")
    if out is not None and (out.shape != (a.shape[0], b.shape[1]) or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous {out_dtype} tensor of shape {(a.shape[0], b.shape[1])}, got {out.dtype} {tuple(out.shape)}"
        )
    if not a.is_cuda or not use_triton(a, backend):
        result = fp8_gemm_reference(a, a_scale, b, b_scale, out_dtype=out_dtype, bias=bias)
        return result if out is None else out.copy_(result)
    check_gpu_layout(a, b, "fp8_gemm")
    a, b = _pad_k(a, b)
    if bias is None and GEMM == "auto" and _cached_plan_fits(a, a_scale, b, b_scale, out_dtype, out):
        lt = _cublaslt()
        if lt is not None:
            if out is None:
                out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
            lt.matmul(a, a_scale, b, b_scale, out, 0.0, use_fast_accum)
            return out
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    kwargs = {} if out is None else {"out": out}
    try:
        return _scaled_mm(a, b, a_scale, b_scale, bias, out_dtype, use_fast_accum, kwargs)
    except RuntimeError:  # a scale cuBLASLt cannot read fails opaquely: name it (checked only when a call failed)
        check_scale_alignment(a_scale, b_scale, "fp8_gemm")
        raise


def _scaled_mm(a, b, a_scale, b_scale, bias, out_dtype, use_fast_accum, kwargs) -> torch.Tensor:
    return torch._scaled_mm(
        a,
        b,
        scale_a=a_scale if a_scale.dim() == 0 else a_scale.reshape(()),
        scale_b=b_scale if b_scale.dim() == 0 else b_scale.reshape(()),
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
        **kwargs,
    )
