"""SwiGLU from a 1xG FP8 input to a per-tensor FP8 output, and its backward.

The input h is fc1's output, (..., 2F) in Megatron's [gate | up] order, held as 1xG FP8 codes
with FP32 scales (F a multiple of G, so no group straddles the two halves). The output

    a = silu(gate) * up = gate * sigmoid(gate) * up

feeds fc2, so it is quantized per tensor: an amax pass computes a per tile (its last program reduces
the tiles: ``amax.finish_amax``), then the quantizing pass computes a again (from the same codes,
so bit-identically) and writes its codes. The
backward recomputes sigmoid from the saved codes (nothing else is saved):

    d_up   = da * silu(gate)
    d_gate = da * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))

and writes dh (..., 2F) in [d_gate | d_up] order with the amax of the values as written (per tile,
reduced by the pass's last program), the "group scaling" amax that fc1's backward needs to quantize
dh to E5M2 in one pass.

Because the output is a deterministic function of the saved input, fc2 does not need to keep
its FP8 input for wgrad: ``swiglu_to_fp8(..., amax=a_amax, store_q=False, transpose=True)``
writes exactly the transposed codes the forward would have written.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .amax import amax_outputs, finish_amax
from .backend import use_triton
from .formats import as_rows, check_group_size, fp8_format
from .launch import cdiv, lean
from .per_group import dequantize_per_group_reference, quantize_per_group_reference
from .per_tensor import finish_transpose, per_tensor_outputs, quantize_per_tensor_reference
from .scaling import abs_or_inf, abs_or_inf_reference, quantize_with_inverse, scale_from_amax

# (BLOCK_M, BLOCK_N (columns of each half), num_warps) of each kernel: the input's quantization, the
# forward (its amax pass and its quantizing pass) and the backward. The best of 8 tiles each at
# Llama-2-7B's and gpt-1b's shapes (git show 94757c2:benchmarks/ops.py's tile sweep; docs/results.md)
_BLOCKS = {"input": (8, 256, 4), "forward": (4, 1024, 4), "backward": (8, 256, 4)}


class SwigluFp8(NamedTuple):
    """``q`` (..., F) per-tensor FP8 (None when not stored), its 0-d FP32 ``scale``, the
    transposed codes ``q_t`` (F, R) or None, and the 0-d FP32 ``amax`` the scale came from."""

    q: torch.Tensor | None
    scale: torch.Tensor
    q_t: torch.Tensor | None
    amax: torch.Tensor


@triton.jit
def _tile(rows, group_start, n_rows, n_groups, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """A (rows x GROUPS x GROUP) tile of one half of h, as 3-D indices: no reshape of a loaded
    tile is needed to apply one scale per group (reshapes cost layout conversions on the GPU)."""
    groups = group_start + tl.arange(0, GROUPS)
    cols = groups[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask2 = (rows[:, None] < n_rows) & (groups[None, :] < n_groups)
    return groups, cols, mask2


@triton.jit
def _load_half(q_ptr, s_ptr, rows64, groups, cols, mask2, row_len, GROUP: tl.constexpr):
    q = tl.load(q_ptr + rows64[:, None, None] * row_len + cols, mask=mask2[:, :, None], other=0.0)
    s = tl.load(s_ptr + rows64[:, None] * (row_len // GROUP) + groups[None, :], mask=mask2, other=1.0)
    return q.to(tl.float32) * s[:, :, None]


@triton.jit
def _quantize_half(x, q_ptr, s_ptr, rows64, groups, cols, mask2, row_len, FMAX: tl.constexpr, GROUP: tl.constexpr):
    """1xG-quantize the FP32 tile x, store codes and scales, return the dequantized values."""
    scale = scale_from_amax(tl.max(abs_or_inf(x), axis=2), FMAX)
    q = quantize_with_inverse(x, tl.div_rn(1.0, scale)[:, :, None], FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows64[:, None, None] * row_len + cols, q, mask=mask2[:, :, None])
    tl.store(s_ptr + rows64[:, None] * (row_len // GROUP) + groups[None, :], scale, mask=mask2)
    return q.to(tl.float32) * scale[:, :, None]


@triton.jit
def _tile_max(x):
    return tl.max(tl.max(tl.max(abs_or_inf(x), axis=2), axis=1), axis=0)


@lean
@triton.jit
def _quantize_swiglu_input_kernel(
    h_ptr,
    hq_ptr,
    hs_ptr,
    tiles_ptr,
    amax_ptr,
    counter_ptr,
    n_rows,
    n_ffn,
    stride_h,
    FMAX: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUPS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups, cols, mask2 = _tile(rows, tl.program_id(1) * GROUPS, n_rows, n_ffn // GROUP, GROUPS, GROUP)
    rows64 = rows.to(tl.int64)
    src = h_ptr + rows64[:, None, None] * stride_h + cols
    gate = tl.load(src, mask=mask2[:, :, None], other=0.0).to(tl.float32)
    up = tl.load(src + n_ffn, mask=mask2[:, :, None], other=0.0).to(tl.float32)
    gate = _quantize_half(gate, hq_ptr, hs_ptr, rows64, groups, cols, mask2, 2 * n_ffn, FMAX, GROUP)
    up = _quantize_half(
        up, hq_ptr + n_ffn, hs_ptr + n_ffn // GROUP, rows64, groups, cols, mask2, 2 * n_ffn, FMAX, GROUP
    )
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(tiles_ptr + tile, _tile_max(gate * tl.sigmoid(gate) * up))
    finish_amax(tiles_ptr, amax_ptr, counter_ptr)


@lean
@triton.jit
def _swiglu_forward_kernel(
    hq_ptr,
    hs_ptr,
    tiles_ptr,
    amax_ptr,
    counter_ptr,
    q_ptr,
    scale_ptr,
    n_rows,
    n_ffn,
    FMAX: tl.constexpr,
    GROUP: tl.constexpr,
    AMAX_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUPS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups, cols, mask2 = _tile(rows, tl.program_id(1) * GROUPS, n_rows, n_ffn // GROUP, GROUPS, GROUP)
    rows64 = rows.to(tl.int64)
    gate = _load_half(hq_ptr, hs_ptr, rows64, groups, cols, mask2, 2 * n_ffn, GROUP)
    up = _load_half(hq_ptr + n_ffn, hs_ptr + n_ffn // GROUP, rows64, groups, cols, mask2, 2 * n_ffn, GROUP)
    a = gate * tl.sigmoid(gate) * up
    if AMAX_PASS:
        tl.store(tiles_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), _tile_max(a))
        finish_amax(tiles_ptr, amax_ptr, counter_ptr)
    else:
        scale = scale_from_amax(tl.load(amax_ptr), FMAX)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_ptr, scale)
        q = quantize_with_inverse(a, tl.div_rn(1.0, scale), FMAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows64[:, None, None] * n_ffn + cols, q, mask=mask2[:, :, None])


@lean
@triton.jit
def _swiglu_backward_kernel(
    da_ptr,
    hq_ptr,
    hs_ptr,
    dh_ptr,
    tiles_ptr,
    amax_ptr,
    counter_ptr,
    n_rows,
    n_ffn,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUPS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups, cols, mask2 = _tile(rows, tl.program_id(1) * GROUPS, n_rows, n_ffn // GROUP, GROUPS, GROUP)
    rows64 = rows.to(tl.int64)
    gate = _load_half(hq_ptr, hs_ptr, rows64, groups, cols, mask2, 2 * n_ffn, GROUP)
    up = _load_half(hq_ptr + n_ffn, hs_ptr + n_ffn // GROUP, rows64, groups, cols, mask2, 2 * n_ffn, GROUP)
    mask = mask2[:, :, None]
    da = tl.load(da_ptr + rows64[:, None, None] * n_ffn + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_up = (da * (gate * sig)).to(dh_ptr.dtype.element_ty)
    d_gate = (da * up * sig * (1.0 + gate * (1.0 - sig))).to(dh_ptr.dtype.element_ty)
    dh = dh_ptr + rows64[:, None, None] * (2 * n_ffn) + cols
    tl.store(dh, d_gate, mask=mask)
    tl.store(dh + n_ffn, d_up, mask=mask)
    tile = tl.maximum(_tile_max(d_gate.to(tl.float32)), _tile_max(d_up.to(tl.float32)))
    tl.store(tiles_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tile)
    finish_amax(tiles_ptr, amax_ptr, counter_ptr)


def _launch(n_rows: int, n_ffn: int, group_size: int, kernel: str) -> tuple[tuple[int, int], dict]:
    block_m, block_n, warps = _BLOCKS[kernel]
    block_n = max(block_n, group_size)
    grid = (cdiv(n_rows, block_m), cdiv(n_ffn, block_n))
    return grid, {"GROUP": group_size, "BLOCK_M": block_m, "GROUPS": block_n // group_size, "num_warps": warps}


def _check(h_q: torch.Tensor, h_scales: torch.Tensor, group_size: int) -> int:
    check_group_size(group_size)
    if h_q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not h_q.is_contiguous():
        raise ValueError(f"h_q must be contiguous FP8 codes, got {h_q.dtype}")
    two_f = h_q.shape[-1]
    if two_f % (2 * group_size):
        raise ValueError(
            f"SwiGLU input width {two_f} must be 2 x a multiple of the FP8 group size {group_size} (the FFN "
            f"size per tensor-parallel rank must be a multiple of {group_size}); use --coat-group-size with a "
            f"divisor of {two_f // 2}"
        )
    expected = (*h_q.shape[:-1], two_f // group_size)
    if tuple(h_scales.shape) != expected or h_scales.dtype != torch.float32 or not h_scales.is_contiguous():
        raise ValueError(
            f"h_scales must be contiguous float32 of shape {expected}, got {h_scales.dtype} {tuple(h_scales.shape)}"
        )
    return two_f // 2


def swiglu_to_fp8_reference(
    h_q: torch.Tensor,
    h_scales: torch.Tensor,
    group_size: int,
    fmt: str = "e4m3",
    *,
    transpose: bool = False,
    amax: torch.Tensor | None = None,
    store_q: bool = True,
) -> SwigluFp8:
    n_ffn = _check(h_q, h_scales, group_size)
    a = swiglu_from_input(dequantize_per_group_reference(h_q, h_scales, group_size, torch.float32))
    if amax is None:
        amax = abs_or_inf_reference(a).amax() if a.numel() else torch.zeros((), dtype=torch.float32)
    out = quantize_per_tensor_reference(a, fmt, transpose=transpose, amax=amax)
    q = out[0].view(*h_q.shape[:-1], n_ffn) if store_q else None
    return SwigluFp8(q, out[1], out[2] if transpose else None, amax.reshape(()))


def swiglu_to_fp8(
    h_q: torch.Tensor,
    h_scales: torch.Tensor,
    group_size: int = 16,
    fmt: str = "e4m3",
    *,
    transpose: bool = False,
    amax: torch.Tensor | None = None,
    store_q: bool = True,
    backend: str = "auto",
    scratch: str | None = None,
) -> SwigluFp8:
    """SwiGLU of a 1xG FP8 [gate | up] input, quantized per tensor for the next GEMM.

    Args:
        h_q, h_scales: (..., 2F) FP8 codes and (..., 2F // G) FP32 scales; F a multiple of G.
        fmt: format of the output (E4M3 for fc2's input).
        transpose: also write q_t (F, R) for fc2's wgrad.
        amax: the output's amax when already known (a recompute in backward); skips the amax pass.
        store_q: write q (False: only q_t, for the recompute of fc2's wgrad operand).
        scratch: q, q_t and the scale in the reused buffers of that name (``workspace``), for a
            caller that reads them before it returns (the recompute in fc2's backward).
    """
    n_ffn = _check(h_q, h_scales, group_size)
    if not use_triton(h_q, backend):
        return swiglu_to_fp8_reference(h_q, h_scales, group_size, fmt, transpose=transpose, amax=amax, store_q=store_q)
    f = fp8_format(fmt)
    n_rows = h_q.numel() // h_q.shape[-1]
    # the transposed copy comes from a pass over the codes (see per_tensor.transpose_in_pass):
    # q is then written even when not returned
    q, q_t, scale = per_tensor_outputs(
        (*h_q.shape[:-1], n_ffn), n_rows, n_ffn, f, transpose, h_q.device, scratch=scratch
    )
    grid, launch = _launch(n_rows, n_ffn, group_size, "forward")
    if amax is None:
        if n_rows:  # the amax pass: every program writes its tile's, the last one their max
            tiles, amax, count = amax_outputs(grid[0] * grid[1], h_q.device)
            _swiglu_forward_kernel[grid](
                h_q, h_scales, tiles, amax, count, q, scale, n_rows, n_ffn, FMAX=f.max, AMAX_PASS=True, **launch
            )
        else:
            amax = torch.zeros((), dtype=torch.float32, device=h_q.device)
    elif amax.numel() > 1:
        amax = amax.amax()
    if n_rows:  # the quantizing pass reads the amax only (its tiles and counter arguments go unused)
        _swiglu_forward_kernel[grid](
            h_q, h_scales, amax, amax, amax, q, scale, n_rows, n_ffn, FMAX=f.max, AMAX_PASS=False, **launch
        )
        finish_transpose(q, q_t, transpose, in_pass=False)
    return SwigluFp8(q if store_q else None, scale, q_t if transpose else None, amax.reshape(()))


def quantize_swiglu_input_reference(h: torch.Tensor, group_size: int, fmt: str = "e4m3") -> tuple[torch.Tensor, ...]:
    h_q, h_scales = quantize_per_group_reference(h, group_size, fmt)
    _check(h_q, h_scales, group_size)
    a = swiglu_from_input(dequantize_per_group_reference(h_q, h_scales, group_size, torch.float32))
    amax = abs_or_inf_reference(a).amax() if a.numel() else torch.zeros((), dtype=torch.float32)
    return h_q, h_scales, amax


def quantize_swiglu_input(
    h: torch.Tensor, group_size: int = 16, fmt: str = "e4m3", *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1xG-quantize a SwiGLU input h = [gate | up] (fc1's output) and, in the same pass, compute
    the amax of the SwiGLU output from the quantized values (group scaling on the producer side):
    ``swiglu_to_fp8(h_q, h_scales, amax=amax)`` then needs a single pass.

    Returns ``(h_q, h_scales, amax)``: codes (..., 2F), FP32 scales (..., 2F // G) and the 0-d FP32
    amax (reduced by the pass's last program), equal to those of ``quantize_per_group`` +
    ``swiglu_to_fp8``.
    """
    if h.shape[-1] % (2 * group_size):
        raise ValueError(f"SwiGLU input width {h.shape[-1]} must be 2 x a multiple of the FP8 group size {group_size}")
    if not use_triton(h, backend):
        return quantize_swiglu_input_reference(h, group_size, fmt)
    f = fp8_format(fmt)
    rows = as_rows(h, "h")
    n_rows, n_ffn = rows.shape[0], rows.shape[1] // 2
    h_q = torch.empty(h.shape, dtype=f.dtype, device=h.device)
    h_scales = torch.empty(*h.shape[:-1], h.shape[-1] // group_size, dtype=torch.float32, device=h.device)
    grid, launch = _launch(n_rows, n_ffn, group_size, "input")
    if not n_rows:
        return h_q, h_scales, torch.zeros((), dtype=torch.float32, device=h.device)
    tiles, amax, count = amax_outputs(grid[0] * grid[1], h.device)  # every program's tile, and their max
    _quantize_swiglu_input_kernel[grid](
        rows, h_q, h_scales, tiles, amax, count, n_rows, n_ffn, rows.stride(0), FMAX=f.max, **launch
    )
    return h_q, h_scales, amax


def swiglu_backward_reference(
    da: torch.Tensor, h_q: torch.Tensor, h_scales: torch.Tensor, group_size: int, dh_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(h_q, h_scales, group_size)
    dh = swiglu_backward_from_input(
        da, dequantize_per_group_reference(h_q, h_scales, group_size, torch.float32), dh_dtype
    )
    amax = abs_or_inf_reference(dh.float()).amax() if dh.numel() else torch.zeros((), dtype=torch.float32)
    return dh, amax


def swiglu_from_input(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of an exact h = [gate | up] (..., 2F) (BF16 or FP32, not a 1xG copy): FP32
    (R, F), R the rows of h, in torch arithmetic on any device. The forward of
    ``CoatConfig.swiglu_input_store="bf16"`` (an accuracy ablation: no kernel of its own), and of the
    references after dequantizing."""
    gate, up = h.reshape(-1, h.shape[-1]).float().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def swiglu_backward_from_input(da: torch.Tensor, h: torch.Tensor, dh_dtype: torch.dtype) -> torch.Tensor:
    """dh (h's shape, ``dh_dtype``, [d_gate | d_up]) from da (..., F) and the exact h = [gate | up]
    (..., 2F), in FP32 torch arithmetic: the backward of ``swiglu_from_input``."""
    gate, up = h.reshape(-1, h.shape[-1]).float().chunk(2, dim=-1)
    da = da.reshape(gate.shape).float()
    sig = torch.sigmoid(gate)
    dh = torch.cat([da * up * sig * (1.0 + gate * (1.0 - sig)), da * (gate * sig)], dim=-1).to(dh_dtype)
    return dh.view(h.shape)


def swiglu_backward(
    da: torch.Tensor,
    h_q: torch.Tensor,
    h_scales: torch.Tensor,
    group_size: int = 16,
    *,
    dh_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of ``swiglu_to_fp8`` from its saved 1xG FP8 input.

    Args:
        da: gradient of the SwiGLU output, (..., F), contiguous.
    Returns:
        ``(dh, amax)``: dh (..., 2F) in ``dh_dtype`` ([d_gate | d_up]) and amax, the 0-d FP32 max
        of |dh| as written, reduced by the pass's last program (hand it to
        ``quantize_per_tensor(dh, ..., amax=amax)``).
    """
    n_ffn = _check(h_q, h_scales, group_size)
    if da.shape[-1] != n_ffn or da.numel() * 2 != h_q.numel() or not da.is_contiguous():
        raise ValueError(f"da must be contiguous with {n_ffn} columns per row of h, got shape {tuple(da.shape)}")
    if not use_triton(da, backend):
        return swiglu_backward_reference(da, h_q, h_scales, group_size, dh_dtype)
    n_rows = h_q.numel() // h_q.shape[-1]
    dh = torch.empty(h_q.shape, dtype=dh_dtype, device=da.device)
    grid, launch = _launch(n_rows, n_ffn, group_size, "backward")
    if not n_rows:
        return dh, torch.zeros((), dtype=torch.float32, device=da.device)
    tiles, amax, count = amax_outputs(grid[0] * grid[1], da.device)  # every program's tile, and their max
    _swiglu_backward_kernel[grid](da, h_q, h_scales, dh, tiles, amax, count, n_rows, n_ffn, **launch)
    return dh, amax
