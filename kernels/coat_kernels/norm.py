"""RMSNorm / LayerNorm that read the BF16 residual stream and write FP8, and their backward.

Forward, two passes over x (a per-tensor scale needs the whole tensor's amax before any code is
written):

    stats pass     per row: mean (LayerNorm), rstd, the amax of the normalised output y, and the
                   1xG FP8 copy of x (all the backward needs of x), from one read of x, a tile of
                   rows per program; its last program reduces the tiles' amaxes to the tensor's
                   (``amax.finish_amax``)
    quantize pass  y = (x - mean) * rstd * w (+ b), computed again from the exact x, quantized
                   per tensor with the scale of that amax, with its transposed copy
                   (the next GEMM's wgrad operand), from a second read of x

The forward is exact (computed from x, not from its FP8 copy); the backward reads x from the 1xG
FP8 copy with the forward's exact mean and rstd:

    x^ = (x - mean) * rstd,  g = dy * w
    RMSNorm:   dx = rstd * (g - x^ * mean(g * x^))
    LayerNorm: dx = rstd * (g - mean(g) - x^ * mean(g * x^))
    dw = sum over rows of dy * x^,   db = sum over rows of dy

Where the norm also returns x as the layer's residual (``CoatConfig.fuse_residual_backward``), the
backward adds that branch's gradient to dx in the same pass, rounded as autograd's own sum would be
(the same bits, without the sum's launch and its three passes over the activation), and finds the
result's amax there too, for the linear whose output gradient it is (its quantization needs no
amax pass of its own).

The backward's programs each sum their rows' dw (db) into a row of FP32 partials; a second kernel
sums the partials in a fixed order and writes dw in the caller's dtype, or adds it into the
caller's buffer (a weight's ``main_grad``, Megatron's gradient-accumulation protocol), rounding
once: no separate sum, cast or add.

Shapes: x is (..., H) with H a multiple of G, read as R rows; the per-tensor output q has x's
shape and q_t is (H, R); the saved copy x_q has x's shape with scales (..., H // G); mean and
rstd are FP32 of R elements. ``weight`` is the effective multiplier, FP32 or the BF16/FP16
parameter itself (the kernels convert it as they load it; callers fold a
zero-centred gamma's +1 into it).

Kernels run with FP contraction off so that y is the same in both passes and in the torch
reference, bit for bit, given the same mean and rstd.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import workspace
from .amax import amax_outputs, finish_amax
from .backend import use_triton
from .formats import as_rows, check_group_size, fp8_format
from .launch import cdiv, lean, next_power_of_2
from .per_group import dequantize_per_group_reference, quantize_groups, quantize_per_group_reference, store_groups
from .per_tensor import (
    _packed_copy,
    _quantize_blocks,
    finish_transpose,
    per_tensor_outputs,
    quantize_per_tensor_reference,
    store_per_tensor_tile,
    transpose_in_pass,
)
from .scaling import abs_or_inf, abs_or_inf_reference

KINDS = ("rmsnorm", "layernorm")


class NormFp8(NamedTuple):
    """What ``norm_to_fp8`` returns: the per-tensor FP8 output for the next GEMM (q, scale, q_t)
    and what the backward needs (x_q, x_scales: the 1xG FP8 copy of x; mean, rstd)."""

    q: torch.Tensor
    scale: torch.Tensor
    q_t: torch.Tensor | None
    x_q: torch.Tensor
    x_scales: torch.Tensor
    mean: torch.Tensor | None
    rstd: torch.Tensor
    amax: torch.Tensor


@triton.jit
def _normalize(x, mean, rstd, w, b, IS_LAYERNORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    if IS_LAYERNORM:
        x = x - mean
    y = x * rstd * w
    if HAS_BIAS:
        y = y + b
    return y


@lean
@triton.jit
def _norm_stats_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    xq_ptr,
    xs_ptr,
    mean_ptr,
    rstd_ptr,
    tiles_ptr,
    amax_ptr,
    counter_ptr,
    n_rows,
    n_cols,
    stride_x,
    eps,
    FMAX_SAVED: tl.constexpr,
    GROUP: tl.constexpr,
    IS_LAYERNORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    centred = x
    if IS_LAYERNORM:
        mean = tl.div_rn(tl.sum(x, axis=1), n_cols.to(tl.float32))
        centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(centred * centred, axis=1), n_cols.to(tl.float32)) + eps))
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    b = 0.0
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _normalize(x, mean[:, None], rstd[:, None], w, b, IS_LAYERNORM, HAS_BIAS)
    tl.store(tiles_ptr + tl.program_id(0), tl.max(tl.max(tl.where(mask, abs_or_inf(y), 0.0), axis=1), axis=0))
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    if IS_LAYERNORM:
        tl.store(mean_ptr + rows, mean, mask=row_ok)
    xg, scale = quantize_groups(x, BLOCK_M, BLOCK_N, GROUP, FMAX_SAVED)
    store_groups(xq_ptr, xs_ptr, xg, scale, rows, 0, n_rows, n_cols, BLOCK_N, GROUP)
    finish_amax(tiles_ptr, amax_ptr, counter_ptr)


@lean
@triton.jit
def _norm_quantize_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    amax_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    n_rows,
    n_cols,
    stride_x,
    FMAX: tl.constexpr,
    IS_LAYERNORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    x = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
    ).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    mean = 0.0
    if IS_LAYERNORM:
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = 0.0
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _normalize(x, mean, rstd[:, None], w[None, :], b, IS_LAYERNORM, HAS_BIAS)
    store_per_tensor_tile(y, amax_ptr, q_ptr, qt_ptr, scale_ptr, rows, cols, n_rows, n_cols, FMAX, TRANSPOSE, True, 0)


@lean
@triton.jit
def _norm_backward_kernel(
    dy_ptr,
    xq_ptr,
    xs_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_ptr,
    db_ptr,
    dres_ptr,
    tiles_ptr,
    amax_ptr,
    counter_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    GROUP: tl.constexpr,
    IS_LAYERNORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    AMAX: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    groups = tl.arange(0, BLOCK_N // GROUP)
    n_groups = n_cols // GROUP
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dx_amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = (tl.program_id(0) * rows_per_program).to(tl.int64)
    for i in range(0, rows_per_program):
        row64 = first + i
        row = tl.minimum(row64, n_rows - 1)  # past the end: read the last row again, store nothing
        q = tl.load(xq_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(xs_ptr + row * n_groups + groups, mask=groups < n_groups, other=1.0)
        x = tl.reshape(tl.reshape(q, (BLOCK_N // GROUP, GROUP)) * s[:, None], (BLOCK_N,))
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if IS_LAYERNORM:
            x = tl.where(mask, x - tl.load(mean_ptr + row), 0.0)
        xhat = x * rstd
        g = dy * w
        c1 = tl.div_rn(tl.sum(g * xhat, axis=0), n_cols.to(tl.float32))
        if IS_LAYERNORM:
            c2 = tl.div_rn(tl.sum(g, axis=0), n_cols.to(tl.float32))
            dx = (g - xhat * c1 - c2) * rstd
        else:
            dx = (g - xhat * c1) * rstd
        dx = dx.to(dx_ptr.dtype.element_ty)
        if HAS_RESIDUAL:  # autograd's sum of the two branches, as it rounds it: dx rounded, then the add
            r = tl.load(dres_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dx = (dx.to(tl.float32) + r).to(dx_ptr.dtype.element_ty)
        live = row64 < n_rows
        tl.store(dx_ptr + row64 * n_cols + cols, dx, mask=mask & live)
        if AMAX:
            dx_amax = tl.maximum(dx_amax, tl.where(mask & live, abs_or_inf(dx.to(tl.float32)), 0.0))
        dw += tl.where(live, dy * xhat, 0.0)
        if HAS_BIAS:
            db += tl.where(live, dy, 0.0)
    tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * n_cols + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(db_ptr + tl.program_id(0).to(tl.int64) * n_cols + cols, db, mask=mask)
    if AMAX:  # dx's amax, for the op that quantizes dx next (no pass of its own to find it)
        tl.store(tiles_ptr + tl.program_id(0), tl.max(dx_amax, axis=0))
        finish_amax(tiles_ptr, amax_ptr, counter_ptr)


@lean
@triton.jit
def _sum_partials_kernel(
    p_ptr,
    out_ptr,
    n_parts,
    n_cols,
    ACCUMULATE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # out[c] (+)= sum over p of partials[p, c], in FP32, the parts in the same order on every run
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        parts = (start + tl.arange(0, BLOCK_P)).to(tl.int64)
        ok = (parts < n_parts)[:, None] & col_ok[None, :]
        acc += tl.load(p_ptr + parts[:, None] * n_cols + cols[None, :], mask=ok, other=0.0)
    total = tl.sum(acc, axis=0)
    if ACCUMULATE:
        total += tl.load(out_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def write_or_add(out: torch.Tensor, total: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """The reference of the partials' last step: ``out`` (any float dtype) = (out +) total (FP32),
    rounded once to out's dtype; returns ``out``."""
    return out.copy_(out.float() + total if accumulate else total)


def sum_partials(
    partials: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, backend: str = "auto"
) -> torch.Tensor:
    """``out`` (H,) (+)= the column sums of ``partials`` (P, H) FP32, rounded once to out's dtype."""
    if partials.dim() != 2 or partials.dtype != torch.float32 or not partials.is_contiguous():
        raise ValueError(
            f"partials must be a contiguous FP32 (P, H) matrix, got {partials.dtype} {tuple(partials.shape)}"
        )
    if out.shape != partials.shape[1:] or not out.is_contiguous() or not out.is_floating_point():
        raise ValueError(
            f"out must be a contiguous float vector of {partials.shape[1]} elements, got {out.dtype} {tuple(out.shape)}"
        )
    n_parts, n_cols = partials.shape
    if n_cols == 0:
        return out
    if not use_triton(partials, backend) or n_parts == 0:
        return write_or_add(out, partials.sum(dim=0), accumulate)
    block_c = 32 if n_cols >= 2048 else 16  # columns per program: enough programs for the GPU's SMs
    block_p = min(64, max(2, next_power_of_2(n_parts)))
    _sum_partials_kernel[(cdiv(n_cols, block_c),)](
        partials, out, n_parts, n_cols, ACCUMULATE=accumulate, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4
    )
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, group_size: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown norm {kind!r}: use 'rmsnorm' or 'layernorm'")
    if kind == "rmsnorm" and bias is not None:
        raise ValueError("RMSNorm has no bias; pass bias=None")
    check_group_size(group_size)
    n = x.shape[-1]
    if n % group_size:
        raise ValueError(
            f"hidden size {n} is not a multiple of the FP8 group size {group_size}; use --coat-group-size "
            f"with a divisor of {n} (16, 32, 64 or 128) or pad the model"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (
            t.shape != (n,) or t.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not t.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be a contiguous float32/bfloat16/float16 vector of {n} elements, got {t.dtype} {tuple(t.shape)}"
            )


def _stats_reference(rows: torch.Tensor, kind: str, eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    if kind == "layernorm":
        mean = rows.mean(dim=-1)
        centred = rows - mean[:, None]
    else:
        mean, centred = None, rows
    return mean, 1.0 / torch.sqrt((centred * centred).mean(dim=-1) + eps)


def _normalize_reference(rows, mean, rstd, weight, bias):
    if mean is not None:
        rows = rows - mean[:, None]
    y = rows * rstd[:, None] * weight.float()
    return y + bias.float() if bias is not None else y


def norm_to_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float,
    kind: str = "rmsnorm",
    group_size: int = 16,
    out_fmt: str = "e4m3",
    saved_fmt: str = "e4m3",
    transpose: bool = True,
    stats: tuple[torch.Tensor | None, torch.Tensor] | None = None,
) -> NormFp8:
    """Torch reference of ``norm_to_fp8``. ``stats`` (mean, rstd) replaces the computed ones, so a
    test can check a kernel's codes bit for bit given the kernel's own statistics."""
    _check(x, weight, bias, kind, group_size)
    rows = as_rows(x).float()
    mean, rstd = stats if stats is not None else _stats_reference(rows, kind, eps)
    y = _normalize_reference(rows, mean, rstd, weight, bias)
    amax = abs_or_inf_reference(y).amax() if y.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    out = quantize_per_tensor_reference(y, out_fmt, transpose=transpose, amax=amax)
    x_q, x_scales = quantize_per_group_reference(x, group_size, saved_fmt)
    return NormFp8(
        out[0].view(x.shape), out[1], out[2] if transpose else None, x_q, x_scales, mean, rstd, amax.reshape(())
    )


# Rows per program and warps of the stats pass, by the padded row length (None: the default rule).
# Each program ends with one atomic ticket (``finish_amax``): fewer, larger programs take fewer.
_STATS_BLOCKS: dict[int, tuple[int, int]] = {}


def _stats_blocks(n_cols: int, group_size: int) -> tuple[int, int]:
    """(rows per program, num_warps) of the stats pass: one row per program by default. Two or four
    rows per program (fewer amax tickets) were no faster in ``ops.py`` (retired: ``git show 94757c2:benchmarks/ops.py``)'s tile sweep
    (docs/results.md)."""
    block_n = max(group_size, next_power_of_2(n_cols))
    if block_n in _STATS_BLOCKS:
        rows, warps = _STATS_BLOCKS[block_n]
        if rows < 1 or rows & (rows - 1):
            raise ValueError(f"_STATS_BLOCKS[{block_n}] asks {rows} rows per program: give a power of 2")
        return rows, warps
    return 1, min(16, max(4, block_n // 512))


def norm_to_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float,
    kind: str = "rmsnorm",
    group_size: int = 16,
    out_fmt: str = "e4m3",
    saved_fmt: str = "e4m3",
    transpose: bool = True,
    packed: bool = False,
    backend: str = "auto",
    scratch_amax: str | None = None,
) -> NormFp8:
    """Normalise x (RMSNorm or LayerNorm) into per-tensor FP8, keeping a 1xG FP8 copy of x.

    Args:
        x: the BF16 (or FP16/FP32) residual stream, (..., H), H a multiple of ``group_size``.
        weight, bias: vectors of H, FP32 or BF16/FP16 (the effective multiplier and shift, converted to
            FP32 as they are loaded; bias LayerNorm only).
        out_fmt: format of the per-tensor output (E4M3 for a GEMM input).
        saved_fmt: format of the 1xG copy of x saved for backward.
        transpose: also write q_t (H, R), the wgrad operand of the next GEMM.
        packed: write q and scale into one buffer, the message a sequence-parallel all-gather
            sends (``per_tensor.packed_message``; where the codes fill whole 16-byte rows).
        scratch_amax: the amax tiles (and the returned amax) in the reused buffer of that name
            (``workspace``), for a caller that does not keep the amax.
    Returns:
        ``NormFp8(q, scale, q_t, x_q, x_scales, mean, rstd)``; mean is None for RMSNorm.
    """
    _check(x, weight, bias, kind, group_size)
    if not use_triton(x, backend):
        r = norm_to_fp8_reference(
            x,
            weight,
            bias,
            eps=eps,
            kind=kind,
            group_size=group_size,
            out_fmt=out_fmt,
            saved_fmt=saved_fmt,
            transpose=transpose,
        )
        if packed:
            q, scale = _packed_copy(r.q, r.scale, fp8_format(out_fmt))
            r = r._replace(q=q, scale=scale)
        return r
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    f_out, f_saved = fp8_format(out_fmt), fp8_format(saved_fmt)
    dev = x.device
    rstd = torch.empty(n_rows, dtype=torch.float32, device=dev)
    mean = torch.empty(n_rows, dtype=torch.float32, device=dev) if kind == "layernorm" else None
    x_q = torch.empty(x.shape, dtype=f_saved.dtype, device=dev)
    x_scales = torch.empty(*x.shape[:-1], n_cols // group_size, dtype=torch.float32, device=dev)
    q, q_t, scale = per_tensor_outputs(x.shape, n_rows, n_cols, f_out, transpose, dev, packed)
    if n_rows:
        amax = _stats_pass(rows, weight, bias, eps, x_q, x_scales, mean, rstd, f_saved, group_size, scratch_amax)
        _quantize_pass(rows, weight, bias, mean, rstd, amax, q, q_t, scale, f_out, transpose, x.dtype)
    else:
        amax = torch.zeros((), dtype=torch.float32, device=dev)
    return NormFp8(q, scale, q_t if transpose else None, x_q, x_scales, mean, rstd, amax.reshape(()))


def _stats_pass(rows, weight, bias, eps, x_q, x_scales, mean, rstd, f_saved, group_size, scratch=None) -> torch.Tensor:
    """norm_to_fp8's first pass: mean (LayerNorm; None for RMSNorm), rstd and the 1xG copy of x
    written; returns the tensor's amax of y (a 0-d FP32 on the device)."""
    n_rows, n_cols = rows.shape
    stats_rows, stats_warps = _stats_blocks(n_cols, group_size)
    stats_grid = (cdiv(n_rows, stats_rows),)
    tiles, amax, count = amax_outputs(stats_grid[0], rows.device, scratch)  # every program's amax, and their max
    _norm_stats_kernel[stats_grid](
        rows,
        weight,
        bias if bias is not None else weight,
        x_q,
        x_scales,
        mean if mean is not None else rstd,
        rstd,
        tiles,
        amax,
        count,
        n_rows,
        n_cols,
        rows.stride(0),
        eps,
        FMAX_SAVED=f_saved.max,
        GROUP=group_size,
        IS_LAYERNORM=mean is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=stats_rows,
        BLOCK_N=max(group_size, next_power_of_2(n_cols)),
        num_warps=stats_warps,
        enable_fp_fusion=False,
    )
    return amax


def _quantize_pass(rows, weight, bias, mean, rstd, amax, q, q_t, scale, f_out, transpose, dtype) -> None:
    """norm_to_fp8's second pass: y again from the exact x, written per tensor into q (and q_t)."""
    n_rows, n_cols = rows.shape
    block_m, block_n, warps = _quantize_blocks(n_cols, transpose)
    in_pass = transpose_in_pass(transpose, dtype)
    _norm_quantize_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
        rows,
        weight,
        bias if bias is not None else weight,
        mean if mean is not None else rstd,
        rstd,
        amax,
        q,
        q_t,
        scale,
        n_rows,
        n_cols,
        rows.stride(0),
        FMAX=f_out.max,
        IS_LAYERNORM=mean is not None,
        HAS_BIAS=bias is not None,
        TRANSPOSE=in_pass,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    finish_transpose(q, q_t, transpose, in_pass)


def norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    amax: torch.Tensor,
    *,
    out_fmt: str = "e4m3",
    transpose: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, ...]:
    """The quantizing pass of ``norm_to_fp8`` alone, with given statistics and amax: (q, scale[, q_t]).

    Used to recompute a norm's per-tensor FP8 output in backward (from its saved 1xG input copy,
    dequantized) instead of keeping it from the forward."""
    f = fp8_format(out_fmt)
    rows = as_rows(x)
    if not use_triton(x, backend):
        y = _normalize_reference(rows.float(), mean, rstd, weight, bias)
        out = quantize_per_tensor_reference(y, out_fmt, transpose=transpose, amax=amax)
        return (out[0].view(x.shape), *out[1:])
    n_rows, n_cols = rows.shape
    q, q_t, scale = per_tensor_outputs(x.shape, n_rows, n_cols, f, transpose, x.device)
    if n_rows:
        _quantize_pass(rows, weight, bias, mean, rstd, amax, q, q_t, scale, f, transpose, x.dtype)
    return (q, scale, q_t) if transpose else (q, scale)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def norm_backward_reference(
    dy: torch.Tensor,
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    *,
    group_size: int,
    has_bias: bool,
    dx_dtype: torch.dtype,
    residual_grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = dequantize_per_group_reference(x_q, x_scales, group_size, torch.float32)
    dx, dw, db = norm_backward_from_input(dy, x, weight, mean, rstd, has_bias=has_bias, dx_dtype=dx_dtype)
    return add_residual_grad(dx, residual_grad), dw, db


def add_residual_grad(dx: torch.Tensor, residual_grad: torch.Tensor | None) -> torch.Tensor:
    """dx + the residual branch's gradient as autograd sums the two (in dx's dtype: each rounded, then
    added, the sum rounded once); dx itself without one."""
    if residual_grad is None:
        return dx
    return (dx.float() + residual_grad.reshape(dx.shape).float()).to(dx.dtype)


def norm_backward_from_input(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    *,
    has_bias: bool,
    dx_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward of ``norm_to_fp8`` from its exact input x (..., H) (BF16 or FP32, not the 1xG copy),
    in FP32 torch arithmetic on any device; the other arguments and the returns as ``norm_backward``.
    The path of ``CoatConfig.norm_input_store="bf16"``, an accuracy ablation, so it has no kernel of
    its own; ``norm_backward_reference`` is this after dequantizing the 1xG copy."""
    n = dy.shape[-1]
    x = x.reshape(-1, n).float()
    dy2 = dy.reshape(-1, n).float()
    if mean is not None:
        x = x - mean[:, None]
    xhat = x * rstd[:, None]
    g = dy2 * weight.float()
    c1 = (g * xhat).sum(dim=-1, keepdim=True) / n
    dx = g - xhat * c1
    if mean is not None:
        dx = dx - g.sum(dim=-1, keepdim=True) / n
    dx = (dx * rstd[:, None]).to(dx_dtype).view(dy.shape)
    dw = (dy2 * xhat).sum(dim=0)
    return dx, dw, dy2.sum(dim=0) if has_bias else None


def _amax_reference(t: torch.Tensor) -> torch.Tensor:
    """max |t| (NaN as inf) as a 0-d FP32 tensor; 0 for an empty t."""
    return abs_or_inf_reference(t.float()).amax() if t.numel() else torch.zeros((), device=t.device)


# The backward's programs per multiprocessor (each walks its rows in turn) and warps (None: by
# the row length)
_BACKWARD_BLOCKS: tuple[int, int | None] = (4, None)


def _launch_backward(dy, x_q, x_scales, weight, mean, rstd, dx, residual_grad, group_size, has_bias, dx_amax, scratch):
    """The backward kernel's launch: dx written; returns the per-program dW (dB) partials and dx's amax (or None)."""
    n_rows, n_cols = dy.numel() // dy.shape[-1], dy.shape[-1]
    per_sm, warps = _BACKWARD_BLOCKS
    programs = min(n_rows, per_sm * _multiprocessors(dy.device.index) if dy.is_cuda else 8)
    rows_per_program = cdiv(n_rows, programs)
    programs = cdiv(n_rows, rows_per_program)
    dw = workspace.empty((programs, n_cols), torch.float32, dy.device, workspace.sub(scratch, "dw"))
    db = workspace.empty((programs, n_cols), torch.float32, dy.device, workspace.sub(scratch, "db")) if has_bias else dw
    # dx's amax is read by another op's backward, later: its own allocation, never a scratch buffer
    tiles, amax, counter = amax_outputs(programs, dy.device) if dx_amax else (rstd, rstd, rstd)
    block_n = max(group_size, next_power_of_2(n_cols))
    _norm_backward_kernel[(programs,)](
        dy,
        x_q,
        x_scales,
        weight,
        mean if mean is not None else rstd,
        rstd,
        dx,
        dw,
        db,
        residual_grad if residual_grad is not None else dy,
        tiles,
        amax,
        counter,
        n_rows,
        n_cols,
        rows_per_program,
        GROUP=group_size,
        IS_LAYERNORM=mean is not None,
        HAS_BIAS=has_bias,
        HAS_RESIDUAL=residual_grad is not None,
        AMAX=dx_amax,
        BLOCK_N=block_n,
        num_warps=warps or min(16, max(4, block_n // 512)),
    )
    return dw, db, amax if dx_amax else None


def norm_backward(
    dy: torch.Tensor,
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    *,
    group_size: int,
    has_bias: bool = False,
    dx_dtype: torch.dtype = torch.bfloat16,
    dw_out: torch.Tensor | None = None,
    db_out: torch.Tensor | None = None,
    accumulate: bool = False,
    residual_grad: torch.Tensor | None = None,
    dx_amax: bool = False,
    backend: str = "auto",
    scratch: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward of ``norm_to_fp8`` from the saved 1xG FP8 copy of x.

    Args:
        dy: gradient of the normalised output, x's shape (BF16 or FP32), contiguous.
        x_q, x_scales, mean, rstd: what ``norm_to_fp8`` returned for the backward.
        weight: the multiplier the forward used.
        dw_out, db_out: where dw (db) goes, a contiguous float vector of H (the weight's dtype, or its
            ``main_grad``): written, or with ``accumulate`` added to (rounded once); None: a new FP32 one.
        residual_grad: the gradient that reaches x by the residual branch (x's shape, contiguous),
            added to dx in the same pass as autograd would add it (``add_residual_grad``: the same
            bits); the caller's norm returns x as its residual (``CoatConfig.fuse_residual_backward``).
        dx_amax: also return dx's amax (0-d FP32), found in the same pass, for the op that quantizes dx.
        scratch: the per-program partial sums in the reused buffers of that name (``workspace``).
    Returns:
        ``(dx, dw, db)``, and dx's amax with ``dx_amax``: dx in ``dx_dtype`` and x's shape; dw, db:
        ``dw_out``/``db_out`` or FP32 vectors (db None without bias).
    """
    if not dy.is_contiguous():
        raise ValueError("dy must be contiguous; pass dy.contiguous()")
    if residual_grad is not None and (residual_grad.shape != dy.shape or not residual_grad.is_contiguous()):
        raise ValueError(
            f"residual_grad must be contiguous and of dy's shape {tuple(dy.shape)}, got "
            f"{tuple(residual_grad.shape)}; pass residual_grad.contiguous()"
        )
    n_cols = dy.shape[-1]
    if dw_out is None:
        dw_out = torch.empty(n_cols, dtype=torch.float32, device=dy.device)
    if has_bias and db_out is None:
        db_out = torch.empty(n_cols, dtype=torch.float32, device=dy.device)
    n_rows = dy.numel() // max(n_cols, 1)
    if not use_triton(dy, backend):
        dx, dw, db = norm_backward_reference(
            dy,
            x_q,
            x_scales,
            weight,
            mean,
            rstd,
            group_size=group_size,
            has_bias=has_bias,
            dx_dtype=dx_dtype,
            residual_grad=residual_grad,
        )
        out = (dx, write_or_add(dw_out, dw, accumulate), write_or_add(db_out, db, accumulate) if has_bias else None)
        return (*out, _amax_reference(dx)) if dx_amax else out
    dx = torch.empty(dy.shape, dtype=dx_dtype, device=dy.device)
    if n_rows == 0:
        zeros = torch.zeros(n_cols, dtype=torch.float32, device=dy.device)
        db = write_or_add(db_out, zeros, accumulate) if has_bias else None
        out = (dx, write_or_add(dw_out, zeros, accumulate), db)
        return (*out, zeros[:1].reshape(())) if dx_amax else out
    dw, db, amax = _launch_backward(
        dy, x_q, x_scales, weight, mean, rstd, dx, residual_grad, group_size, has_bias, dx_amax, scratch
    )
    sum_partials(dw, dw_out, accumulate=accumulate)
    if has_bias:
        sum_partials(db, db_out, accumulate=accumulate)
    out = (dx, dw_out, db_out if has_bias else None)
    return (*out, amax) if dx_amax else out
