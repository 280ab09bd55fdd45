"""1xG per-group FP8 quantization along the last dimension, and its inverse.

This is the granularity of every tensor that feeds or is saved by a non-linear op (norm inputs,
SwiGLU inputs): each run of G consecutive elements of a row gets its own FP32 scale.

Shapes: ``x`` is (N,), (M, N) or (B, S, N) with N a multiple of G; ``q`` has x's shape (FP8
codes); ``scales`` has shape x.shape[:-1] + (N // G,), FP32. Group j of a row covers elements
[j*G, (j+1)*G) of that row and dequantizes as ``q * scales[..., j]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .formats import as_rows, check_group_size, fp8_format
from .launch import cdiv, lean, next_power_of_2
from .scaling import (
    abs_or_inf,
    abs_or_inf_reference,
    quantize_with_inverse,
    quantize_with_inverse_reference,
    raise_if_nonfinite,
    scale_from_amax,
    scale_from_amax_reference,
)


@triton.jit
def quantize_groups(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, FMAX: tl.constexpr):
    """Quantize the FP32 tile x (BLOCK_M x BLOCK_N, masked elements 0) in 1 x GROUP groups.

    Returns the clamped FP32 values to cast to FP8 (BLOCK_M x BLOCK_N) and the group scales
    (BLOCK_M x BLOCK_N // GROUP). Shared by every kernel that writes a 1xG FP8 tensor."""
    x = tl.reshape(x, (BLOCK_M, BLOCK_N // GROUP, GROUP))
    scale = scale_from_amax(tl.max(abs_or_inf(x), axis=2), FMAX)
    y = quantize_with_inverse(x, tl.div_rn(1.0, scale)[:, :, None], FMAX)
    return tl.reshape(y, (BLOCK_M, BLOCK_N)), scale


@triton.jit
def store_groups(q_ptr, s_ptr, y, scale, rows, col_start, n_rows, n_cols, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Store the output of ``quantize_groups`` for the tile of ``rows`` x [col_start, col_start +
    BLOCK_N) of an n_rows x n_cols tensor (col_start a multiple of GROUP)."""
    GROUPS: tl.constexpr = BLOCK_N // GROUP
    cols = col_start + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    row_ok = rows[:, None] < n_rows
    tl.store(
        q_ptr + rows64[:, None] * n_cols + cols[None, :],
        y.to(q_ptr.dtype.element_ty),
        mask=row_ok & (cols[None, :] < n_cols),
    )
    groups = col_start // GROUP + tl.arange(0, GROUPS)
    n_groups = n_cols // GROUP
    tl.store(s_ptr + rows64[:, None] * n_groups + groups[None, :], scale, mask=row_ok & (groups[None, :] < n_groups))


@triton.jit
def load_groups(
    q_ptr,
    s_ptr,
    rows,
    col_start,
    n_rows,
    col_limit,
    row_len,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Dequantize to FP32 the tile ``rows`` x [col_start, col_start + BLOCK_N) of a 1xG FP8 tensor
    whose rows hold ``row_len`` codes (``row_len // GROUP`` scales); columns from ``col_limit`` on
    read as 0. col_start is a multiple of GROUP."""
    GROUPS: tl.constexpr = BLOCK_N // GROUP
    cols = col_start + tl.arange(0, BLOCK_N)
    groups = col_start // GROUP + tl.arange(0, GROUPS)
    rows64 = rows.to(tl.int64)
    row_ok = rows[:, None] < n_rows
    q = tl.load(q_ptr + rows64[:, None] * row_len + cols[None, :], mask=row_ok & (cols[None, :] < col_limit), other=0.0)
    s = tl.load(
        s_ptr + rows64[:, None] * (row_len // GROUP) + groups[None, :],
        mask=row_ok & (groups[None, :] < col_limit // GROUP),
        other=1.0,
    )
    # (one load per group, broadcast over its elements: a per-element load of the scales,
    # cols // GROUP, was several times slower, docs/results.md)
    x = tl.reshape(q.to(tl.float32), (BLOCK_M, GROUPS, GROUP)) * s[:, :, None]
    return tl.reshape(x, (BLOCK_M, BLOCK_N))


@lean
@triton.jit
def _quantize_per_group_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    n_rows,
    n_cols,
    stride_x,
    FMAX: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    y, scale = quantize_groups(x.to(tl.float32), BLOCK_M, BLOCK_N, GROUP, FMAX)
    store_groups(q_ptr, s_ptr, y, scale, rows, tl.program_id(1) * BLOCK_N, n_rows, n_cols, BLOCK_N, GROUP)


@lean
@triton.jit
def _dequantize_per_group_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    n_rows,
    n_cols,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_start = tl.program_id(1) * BLOCK_N
    x = load_groups(q_ptr, s_ptr, rows, col_start, n_rows, n_cols, n_cols, BLOCK_M, BLOCK_N, GROUP)
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)


def _blocks(n_cols: int, group_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles of about 8192 elements, a row segment of up to 256."""
    block_n = max(group_size, min(256, next_power_of_2(n_cols)))
    block_m = max(1, 8192 // block_n)
    return block_m, block_n, 8 if block_m * block_n >= 8192 else 4


def _check(x: torch.Tensor, group_size: int) -> None:
    check_group_size(group_size)
    if x.shape[-1] % group_size:
        raise ValueError(
            f"last dimension {x.shape[-1]} is not a multiple of the FP8 group size {group_size}; "
            f"use a group size that divides it (16, 32, 64 or 128) or pad the tensor"
        )


def quantize_per_group_reference(x: torch.Tensor, group_size: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    f = fp8_format(fmt)
    _check(x, group_size)
    rows = as_rows(x).float()
    groups = rows.view(rows.shape[0], -1, group_size)
    if groups.numel():
        amax = abs_or_inf_reference(groups).amax(dim=-1)
    else:
        amax = groups.new_zeros(groups.shape[:2])
    scale = scale_from_amax_reference(amax, f.max)
    y = quantize_with_inverse_reference(groups, (1.0 / scale)[..., None], f.max)
    q = y.to(f.dtype).view(x.shape)
    return q, scale.view(*x.shape[:-1], x.shape[-1] // group_size)


def dequantize_per_group_reference(
    q: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    groups = q.float().view(-1, q.shape[-1] // group_size, group_size)
    x = groups * scales.reshape(groups.shape[0], -1, 1)
    return x.to(dtype).view(q.shape)


def quantize_per_group(
    x: torch.Tensor, group_size: int = 16, fmt: str = "e4m3", *, check_finite: bool = True, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to FP8 with one scale per 1 x ``group_size`` group of its last dimension.

    Args:
        x: BF16/FP16/FP32, 1-D to 3-D, last dim a multiple of ``group_size`` and contiguous.
        group_size: G, one of 16, 32, 64, 128.
        fmt: "e4m3" or "e5m2".
        check_finite: raise ``NonFiniteInputError`` if x holds inf or NaN (one device sync).
            With False, such groups come back with an infinite scale and zero codes instead.
    Returns:
        ``q``: FP8 codes, x's shape, 1xG granularity. ``scales``: FP32, x.shape[:-1] + (N // G,).
    """
    f = fp8_format(fmt)
    _check(x, group_size)
    if use_triton(x, backend):
        rows = as_rows(x)
        q = torch.empty(x.shape, dtype=f.dtype, device=x.device)
        scales = torch.empty(*x.shape[:-1], x.shape[-1] // group_size, dtype=torch.float32, device=x.device)
        if rows.numel():
            block_m, block_n, warps = _blocks(rows.shape[1], group_size)
            grid = (cdiv(rows.shape[0], block_m), cdiv(rows.shape[1], block_n))
            _quantize_per_group_kernel[grid](
                rows,
                q,
                scales,
                rows.shape[0],
                rows.shape[1],
                rows.stride(0),
                FMAX=f.max,
                GROUP=group_size,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                num_warps=warps,
            )
    else:
        q, scales = quantize_per_group_reference(x, group_size, fmt)
    if check_finite:
        raise_if_nonfinite(scales, "quantize_per_group")
    return q, scales


def dequantize_per_group(
    q: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Inverse of ``quantize_per_group``: ``q * scales`` per group, returned in ``dtype``.

    Args:
        q: FP8 codes (e4m3 or e5m2), contiguous, 1-D to 3-D.
        scales: FP32, q.shape[:-1] + (N // group_size,).
    """
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"q must be float8_e4m3fn or float8_e5m2, got {q.dtype}")
    _check(q, group_size)
    expected = (*q.shape[:-1], q.shape[-1] // group_size)
    if tuple(scales.shape) != expected or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 of shape {expected}, got {scales.dtype} {tuple(scales.shape)}")
    if not (q.is_contiguous() and scales.is_contiguous()):
        raise ValueError("q and scales must be contiguous; pass q.contiguous() and scales.contiguous()")
    if not use_triton(q, backend):
        return dequantize_per_group_reference(q, scales, group_size, dtype)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    n_cols = q.shape[-1]
    n_rows = q.numel() // max(n_cols, 1)
    if q.numel():
        block_m, block_n, warps = _blocks(n_cols, group_size)
        grid = (cdiv(n_rows, block_m), cdiv(n_cols, block_n))
        _dequantize_per_group_kernel[grid](
            q,
            scales,
            out,
            n_rows,
            n_cols,
            GROUP=group_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
        )
    return out
