"""The two FP8 formats and how a tensor is laid out for the kernels.

E4M3 (``torch.float8_e4m3fn``, largest finite 448) carries forward activations, weights and
optimizer states; E5M2 (``torch.float8_e5m2``, largest finite 57344) carries gradients.
Every quantizer clamps to the format's largest finite value before the cast: the GPU, torch on
the CPU and the Triton interpreter disagree on overflow otherwise (the GPU saturates, torch
makes E5M2 overflow inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float


FP8_FORMATS = {
    "e4m3": Fp8Format("e4m3", torch.float8_e4m3fn, 448.0),
    "e5m2": Fp8Format("e5m2", torch.float8_e5m2, 57344.0),
}

# Smallest normal FP32. A per-group or per-tensor scale is never set below it: a subnormal scale
# carries few significant bits, so x / scale would overshoot the format's range.
FP32_MIN_NORMAL = 2.0**-126

GROUP_SIZES = (16, 32, 64, 128)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_format(name: str) -> Fp8Format:
    """The format called ``name`` ("e4m3" or "e5m2"); a clear error for anything else."""
    try:
        return FP8_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unsupported FP8 format {name!r}: use 'e4m3' (activations, weights, optimizer "
            f"states) or 'e5m2' (gradients)"
        ) from None


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"unsupported FP8 group size {group_size!r}: use one of {', '.join(map(str, GROUP_SIZES))}")


def as_rows(x: torch.Tensor, what: str = "x") -> torch.Tensor:
    """View ``x`` (1-D to 3-D) as a 2-D (rows, last dim) tensor whose last dim is contiguous.

    A view, never a copy: an input that cannot be viewed so (a transposed or sliced tensor) is
    rejected, because a silent copy would cost a full extra pass over it.
    """
    if not 1 <= x.dim() <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{what} must be bfloat16, float16 or float32, got {x.dtype}")
    n = x.shape[-1]
    try:
        rows = x.view(-1, n) if x.dim() != 2 else x
    except RuntimeError:
        rows = None
    if rows is None or (n > 1 and rows.stride(1) != 1) or (rows.shape[0] > 1 and rows.stride(0) < n):
        raise ValueError(
            f"{what} of shape {tuple(x.shape)} and strides {x.stride()} cannot be read as rows with a "
            f"contiguous last dimension; pass {what}.contiguous()"
        )
    return rows
