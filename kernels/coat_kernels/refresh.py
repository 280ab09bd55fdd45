"""A per-tensor FP8 copy kept in fixed buffers and refreshed in place, on the device's own decision.

A weight's FP8 copy (codes W, transposed codes W^T, 0-d scale) is read by every micro-batch's
GEMMs and changes only when the weight does. Under CUDA graphs no Python runs between replays, so
"is the copy stale?" cannot be a host-side check: this refresh is written so that a captured graph
can replay it on every micro-batch and pay for the work only when the weight changed.

* The buffers never move (``q``, ``q_t``, ``scale`` are updated in place), so a graph that reads
  them stays valid across optimizer steps.
* Two int64 device scalars decide: ``generation`` (the weight generation the copy was made from)
  and ``current`` (bumped by whoever changes the weight: an optimizer step). When they are equal
  the three kernels below mask out every load and store (a few microseconds of launches); when
  they differ the copy is remade from the weight and ``generation`` takes ``current``'s value.
  ``force=True`` remakes it regardless (the host knows it is stale): the same compiled kernels,
  so an eager refresh compiles what a graph capture will record.

Three launches, no host synchronisation and no allocation:

    amax pass     per tile, max |x| (NaN -> inf), atomically max-ed into ``amax`` (0 on entry)
    quantize pass x * (1 / scale) with scale = amax / fmt_max (the rule of ``scaling``), codes
                  and, for 16-bit input, the transposed codes from the same registers; the scale
    finish        ``generation`` <- ``current``; ``amax`` <- 0 for the next refresh

The codes and scale are bit-identical to ``quantize_per_tensor(x, fmt, transpose=...)``.

``refresh_per_tensor_amax`` keeps the amax only (for a cache that holds no codes: the codes are
made where they are used, ``quantize_per_tensor(x, fmt, amax=kept)``, bit-identical to the kept
ones): the same gated amax pass into a work scalar, then ``kept`` <- work where stale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .formats import as_rows, fp8_format
from .launch import cdiv, lean
from .per_tensor import (
    _AMAX_BLOCKS,
    _quantize_blocks,
    finish_transpose,
    quantize_per_tensor_reference,
    tensor_amax,
    transpose_in_pass,
)
from .scaling import abs_or_inf, quantize_with_inverse, scale_from_amax


@triton.jit
def _is_stale(gen_ptr, cur_ptr, force):
    return (tl.load(gen_ptr) != tl.load(cur_ptr)) | (force != 0)


# ``force`` is a run-time argument (not specialised): the forced refresh the host launches eagerly
# and the gated one a CUDA graph records are one compiled kernel, so nothing compiles (or loads a
# module) during a capture
@lean
@triton.jit(do_not_specialize=["force"])
def _refresh_amax_kernel(
    x_ptr,
    amax_ptr,
    gen_ptr,
    cur_ptr,
    force,
    n_rows,
    n_cols,
    stride_x,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    stale = _is_stale(gen_ptr, cur_ptr, force)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols) & stale
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(abs_or_inf(x.to(tl.float32)), axis=1), axis=0), mask=stale)


@lean
@triton.jit(do_not_specialize=["force"])
def _refresh_quantize_kernel(
    x_ptr,
    amax_ptr,
    gen_ptr,
    cur_ptr,
    force,
    q_ptr,
    qt_ptr,
    scale_ptr,
    n_rows,
    n_cols,
    stride_x,
    FMAX: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    stale = _is_stale(gen_ptr, cur_ptr, force)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols) & stale
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = scale_from_amax(tl.load(amax_ptr), FMAX)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_ptr, scale, mask=stale)
    q = quantize_with_inverse(x, tl.div_rn(1.0, scale), FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows64[:, None] * n_cols + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        mask_t = (cols[:, None] < n_cols) & (rows[None, :] < n_rows) & stale
        tl.store(qt_ptr + cols.to(tl.int64)[:, None] * n_rows + rows64[None, :], tl.trans(q), mask=mask_t)


@lean
@triton.jit
def _refresh_finish_kernel(amax_ptr, gen_ptr, cur_ptr, HAS_GENERATION: tl.constexpr):
    tl.store(amax_ptr, 0.0)
    if HAS_GENERATION:
        tl.store(gen_ptr, tl.load(cur_ptr))


@lean
@triton.jit(do_not_specialize=["force"])
def _refresh_keep_amax_kernel(amax_ptr, kept_ptr, gen_ptr, cur_ptr, force):
    stale = _is_stale(gen_ptr, cur_ptr, force)
    tl.store(kept_ptr, tl.load(amax_ptr), mask=stale)
    tl.store(amax_ptr, 0.0)
    tl.store(gen_ptr, tl.load(cur_ptr))


def _format_name(q: torch.Tensor) -> str:
    return "e4m3" if q.dtype == torch.float8_e4m3fn else "e5m2"


def _check(x, q, scale, amax, q_t, generation, current) -> None:
    if q.shape != x.shape or q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not q.is_contiguous():
        raise ValueError(
            f"q must be contiguous FP8 codes of x's shape {tuple(x.shape)}, got {q.dtype} {tuple(q.shape)}"
        )
    n_cols = x.shape[-1] if x.dim() else 1
    if q_t is not None and (
        q_t.shape != (n_cols, x.numel() // max(n_cols, 1)) or q_t.dtype != q.dtype or not q_t.is_contiguous()
    ):
        raise ValueError(
            f"q_t must be contiguous {q.dtype} of shape {(n_cols, x.numel() // max(n_cols, 1))}, got {q_t.dtype} {tuple(q_t.shape)}"
        )
    if (generation is None) != (current is None):
        raise ValueError("give both generation and current (int64 device scalars), or neither")
    _check_scalars(x, scale=scale, amax=amax, generation=generation, current=current)


def _check_scalars(x: torch.Tensor, **scalars: torch.Tensor | None) -> None:
    """Each given scalar is one element on x's device: FP32, or int64 for the generations."""
    for name, t in scalars.items():
        dtype = torch.int64 if name in ("generation", "current") else torch.float32
        if t is not None and (t.numel() != 1 or t.dtype != dtype or t.device != x.device):
            raise ValueError(f"{name} must be a {dtype} tensor of one element on {x.device}")


def _gated_amax(rows: torch.Tensor, amax, gen, cur, forced: int) -> None:
    """The amax pass of a refresh: max |rows| atomically into ``amax`` (0 on entry), where stale."""
    if rows.numel() == 0:
        return
    n_rows, n_cols = rows.shape
    block_m, block_n, warps = _AMAX_BLOCKS
    grid = (cdiv(n_rows, block_m), cdiv(n_cols, block_n))
    _refresh_amax_kernel[grid](
        rows, amax, gen, cur, forced, n_rows, n_cols, rows.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps
    )


def refresh_per_tensor_copy_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    *,
    q_t: torch.Tensor | None = None,
    generation: torch.Tensor | None = None,
    current: torch.Tensor | None = None,
    force: bool = False,
) -> None:
    """Torch reference of ``refresh_per_tensor_copy``: the same decision, taken with ``torch.where``
    on the device (no host synchronisation, so it too could be captured)."""
    out = quantize_per_tensor_reference(x, _format_name(q), transpose=q_t is not None)
    stale = torch.ones((), dtype=torch.bool, device=x.device)
    if generation is not None and not force:
        stale = (generation != current).reshape(())
    pairs = [(q, out[0]), (scale.view(()), out[1])] + ([(q_t, out[2])] if q_t is not None else [])
    for dst, new in pairs:
        old = dst.view(torch.uint8) if dst.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dst
        new = new.view(torch.uint8) if new.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else new
        old.copy_(torch.where(stale, new.reshape(old.shape), old))
    amax.zero_()
    if generation is not None:
        generation.copy_(current)


def refresh_per_tensor_copy(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    *,
    q_t: torch.Tensor | None = None,
    generation: torch.Tensor | None = None,
    current: torch.Tensor | None = None,
    force: bool = False,
    backend: str = "auto",
) -> None:
    """Remake the per-tensor FP8 copy of ``x`` in its buffers, in place, if it is stale.

    Args:
        x: BF16/FP16/FP32 (a weight: (out, in)), last dim contiguous.
        q: FP8 codes of x's shape (its dtype is the format); q_t: the (N, R) transposed codes or None.
        scale: 0-d FP32, the dequantization scale (x ~= q * scale), written here.
        amax: 0-d FP32 work buffer, 0 on entry (left 0 on return).
        generation, current: int64 device scalars; the copy is remade only where they differ
            (decided on the device), then ``generation`` <- ``current``. Without them (or with
            ``force``) the copy is always remade.
    Nothing is allocated and nothing synchronises: safe to capture in a CUDA graph.
    """
    _check(x, q, scale, amax, q_t, generation, current)
    if not use_triton(x, backend):
        refresh_per_tensor_copy_reference(
            x, q, scale, amax, q_t=q_t, generation=generation, current=current, force=force
        )
        return
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    forced = int(generation is None or force)
    placeholder = torch.empty((), dtype=torch.int64, device=x.device) if generation is None else None
    gen = generation if generation is not None else placeholder  # read, but ``forced`` decides
    cur = current if current is not None else placeholder
    if rows.numel():
        _gated_amax(rows, amax, gen, cur, forced)
        in_pass = transpose_in_pass(q_t is not None, x.dtype)
        block_m, block_n, warps = _quantize_blocks(n_cols, q_t is not None)
        grid = (cdiv(n_rows, block_m), cdiv(n_cols, block_n))
        _refresh_quantize_kernel[grid](
            rows,
            amax,
            gen,
            cur,
            forced,
            q,
            q_t if q_t is not None else q,
            scale,
            n_rows,
            n_cols,
            rows.stride(0),
            FMAX=fp8_format(_format_name(q)).max,
            TRANSPOSE=in_pass,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
        )
        if q_t is not None:
            # FP32 input: the transposed codes from the codes (a byte pass; a stale-but-current
            # copy is transposed again, to the same bytes)
            finish_transpose(q, q_t, True, in_pass)
    else:
        scale.fill_(1.0)
    _refresh_finish_kernel[(1,)](amax, gen, cur, HAS_GENERATION=generation is not None)


def refresh_per_tensor_amax_reference(
    x: torch.Tensor,
    kept: torch.Tensor,
    work: torch.Tensor,
    *,
    generation: torch.Tensor,
    current: torch.Tensor,
    force: bool = False,
) -> None:
    """Torch reference of ``refresh_per_tensor_amax`` (decided with ``torch.where`` on the device)."""
    new = tensor_amax(x, backend="reference")
    stale = torch.ones((), dtype=torch.bool, device=x.device) if force else (generation != current).reshape(())
    kept.copy_(torch.where(stale, new.reshape(kept.shape), kept))
    work.zero_()
    generation.copy_(current)


def refresh_per_tensor_amax(
    x: torch.Tensor,
    kept: torch.Tensor,
    work: torch.Tensor,
    *,
    generation: torch.Tensor,
    current: torch.Tensor,
    force: bool = False,
    backend: str = "auto",
) -> None:
    """Remake ``kept`` = max |x| (+inf for inf or NaN), in place, if ``generation`` != ``current``
    (decided on the device) or ``force``; then ``generation`` <- ``current``.

    Args:
        x: BF16/FP16/FP32 (a weight), last dim contiguous.
        kept: 0-d FP32, the amax that ``quantize_per_tensor(x, fmt, amax=kept)`` turns into the
            scale and codes (bit-identical to ``refresh_per_tensor_copy``'s).
        work: 0-d FP32 work buffer, 0 on entry (left 0).
        generation, current: int64 device scalars, as in ``refresh_per_tensor_copy``.
    Nothing is allocated and nothing synchronises: safe to capture in a CUDA graph.
    """
    _check_scalars(x, kept=kept, work=work, generation=generation, current=current)
    if not use_triton(x, backend):
        refresh_per_tensor_amax_reference(x, kept, work, generation=generation, current=current, force=force)
        return
    _gated_amax(as_rows(x), work, generation, current, int(force))
    _refresh_keep_amax_kernel[(1,)](work, kept, generation, current, int(force))
