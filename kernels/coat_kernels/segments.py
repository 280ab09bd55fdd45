"""Segments of a flat buffer quantized to per-tensor FP8 into a byte stream, and back: the kernels
of the distributed optimizer's FP8 parameter gather (``coat_megatron.optimizer.param_gather``).

A segment is a run of ``n`` consecutive elements of a flat BF16 (or FP16/FP32) buffer ``x``,
starting at element ``start``, that belongs to weight ``w`` (an index into per-weight vectors) and
lies in a byte ``stream`` from byte ``offset``: as 1-byte FP8 codes (a weight segment, ``w >= 0``)
or as its own bytes (a raw segment, ``w == -1``: a parameter that is not gathered as FP8). A gather
has a few hundred segments per bucket; a torch loop over them costs the host several launches
each, so these kernels take all the segments of one table in one launch.

``segment_table`` cuts the segments into blocks of ``BLOCK`` elements, one row (start, offset, n, w)
per block and program (int32: a bucket and its stream stay below 2^31 elements and bytes), made
once per layout. The three passes over a table, each one launch:

    segmented_amax   amax[w] = max |x| over w's segments here (NaN -> inf), atomically max-ed
    pack_segments    stream[offset:] = codes of x[start:] * (1 / scale[w]) (the rule of every COAT
                     quantizer: ``scaling``), or x's bytes for a raw segment
    unpack_segments  x[start:] = codes * scale[w] rounded to x's dtype, or the bytes for a raw one

Every weight segment of one table is in one format (``e4m3`` or ``e5m2``: a table per format).
Each has a torch reference (a loop over the segments); the kernels equal it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .expanded import compiled_for_nvidia
from .formats import fp8_format
from .launch import lean
from .scaling import abs_or_inf, fp8_bits, quantize_with_inverse, quantize_with_inverse_reference

BLOCK = 4096  # elements per program
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def segment_table(
    segments: list[tuple[int, int, int, int]], device, element_size: int = 2, block: int = BLOCK
) -> torch.Tensor:
    """The (rows, 4) int32 table of ``segments`` = [(start, offset, n, w), ...] in blocks of ``block``
    elements: one row (start, offset, n, w) per block, offsets in bytes (1 per element of a weight
    segment, ``element_size``, x's, per element of a raw one). A raw segment's offset must be a
    multiple of ``element_size``. Empty segments are dropped."""
    rows = []
    for start, offset, n, w in segments:
        if n <= 0:
            continue
        width = 1 if w >= 0 else element_size
        if w < 0 and offset % element_size:
            raise ValueError(f"raw segment at byte {offset}: its offset must be a multiple of {element_size}")
        if start + n > 2**31 - 1 or offset + width * n > 2**31 - 1:
            raise ValueError(f"segment ({start}, {offset}, {n}) lies beyond 2^31 elements or bytes: split the bucket")
        first = torch.arange(0, n, block, dtype=torch.int64)
        count = torch.clamp(n - first, max=block)
        rows.append(torch.stack([start + first, offset + first * width, count, torch.full_like(first, w)], dim=1))
    if not rows:
        return torch.zeros((0, 4), dtype=torch.int32, device=device)
    return torch.cat(rows).to(torch.int32).to(device)


def _check(x: torch.Tensor, stream: torch.Tensor, table: torch.Tensor) -> None:
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 1-D buffer, got shape {tuple(x.shape)}")
    if stream.dtype != torch.uint8 or stream.dim() != 1 or not stream.is_contiguous():
        raise ValueError("stream must be a contiguous 1-D uint8 tensor")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[1] != 4:
        raise ValueError("table must be segment_table's (rows, 4) int32 tensor")


# ---------------------------------------------------------------------------------- references


def _segments_of(table: torch.Tensor) -> list[tuple[int, int, int, int]]:
    return [tuple(int(v) for v in row) for row in table.cpu()]


def segmented_amax_reference(x: torch.Tensor, table: torch.Tensor, n_weights: int) -> torch.Tensor:
    amax = torch.zeros(n_weights, dtype=torch.float32, device=x.device)
    for start, _, n, w in _segments_of(table):
        if w >= 0:
            part = x[start : start + n].float()
            m = torch.where(torch.isnan(part), torch.inf, part.abs()).max()
            amax[w] = torch.maximum(amax[w], m)
    return amax


def pack_segments_reference(x, table, inverse_scales, fmt: str, stream) -> None:
    f = fp8_format(fmt)
    size = x.element_size()
    for start, offset, n, w in _segments_of(table):
        if w >= 0:
            y = quantize_with_inverse_reference(x[start : start + n].float(), inverse_scales[w], f.max)
            stream[offset : offset + n].copy_(y.to(f.dtype).view(torch.uint8))
        else:
            stream[offset : offset + n * size].copy_(x[start : start + n].view(torch.uint8))


def unpack_segments_reference(stream, table, scales, fmt: str, x) -> None:
    f = fp8_format(fmt)
    size = x.element_size()
    for start, offset, n, w in _segments_of(table):
        if w >= 0:
            codes = stream[offset : offset + n].view(f.dtype).float()
            x[start : start + n].copy_(codes * scales[w])
        else:
            x[start : start + n].view(torch.uint8).copy_(stream[offset : offset + n * size])


# ---------------------------------------------------------------------------------- kernels


@triton.jit
def _block(table_ptr, RAW_UNIT: tl.constexpr, BLOCK: tl.constexpr):
    """This program's table row as indices: elements of x, bytes of the stream (codes), integers of
    RAW_UNIT bytes in the stream (a raw segment), the mask of the row's n elements, and the weight."""
    row = table_ptr + tl.program_id(0) * 4
    start, offset, n, w = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    offs = tl.arange(0, BLOCK)
    at_x = start.to(tl.int64) + offs
    return at_x, offset.to(tl.int64) + offs, (offset // RAW_UNIT).to(tl.int64) + offs, offs < n, w


@lean
@triton.jit
def _amax_kernel(x_ptr, table_ptr, amax_ptr, BLOCK: tl.constexpr):
    at_x, _, _, mask, w = _block(table_ptr, 1, BLOCK)
    x = tl.load(x_ptr + at_x, mask=mask & (w >= 0), other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + tl.maximum(w, 0), tl.max(abs_or_inf(x), axis=0), mask=w >= 0)


@lean
@triton.jit
def _pack_kernel(
    x_ptr, xraw_ptr, table_ptr, inv_ptr, stream_ptr, streamraw_ptr, RAW_UNIT: tl.constexpr,
    FMAX: tl.constexpr, E5M2: tl.constexpr, PTX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    at_x, at_code, at_raw, mask, w = _block(table_ptr, RAW_UNIT, BLOCK)
    if w >= 0:
        x = tl.load(x_ptr + at_x, mask=mask, other=0.0).to(tl.float32)
        y = quantize_with_inverse(x, tl.load(inv_ptr + w), FMAX)
        tl.store(stream_ptr + at_code, fp8_bits(y, E5M2, PTX), mask=mask)
    else:  # x's own bytes, as integers of x's element size (the offset is a multiple of it)
        tl.store(streamraw_ptr + at_raw, tl.load(xraw_ptr + at_x, mask=mask), mask=mask)


@lean
@triton.jit
def _unpack_kernel(
    stream_ptr, streamraw_ptr, table_ptr, scale_ptr, x_ptr, xraw_ptr, RAW_UNIT: tl.constexpr,
    E5M2: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    at_x, at_code, at_raw, mask, w = _block(table_ptr, RAW_UNIT, BLOCK)
    if w >= 0:
        bits = tl.load(stream_ptr + at_code, mask=mask, other=0)
        if E5M2:
            q = bits.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            q = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        tl.store(x_ptr + at_x, (q * tl.load(scale_ptr + w)).to(x_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(xraw_ptr + at_x, tl.load(streamraw_ptr + at_raw, mask=mask), mask=mask)


def _raw_views(x: torch.Tensor, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    size = x.element_size()
    whole = stream.numel() - stream.numel() % size
    return x.view(_INT_OF_SIZE[size]), stream[:whole].view(_INT_OF_SIZE[size]), size


def segmented_amax(
    x: torch.Tensor, table: torch.Tensor, n_weights: int, *, out: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """FP32 ``amax[w]`` = the largest |x| over weight w's segments in ``table`` (0 for a weight with
    none; +inf where one holds inf or NaN). ``out``: an FP32 vector of ``n_weights`` to max into
    (zeroed by the caller); raw rows are skipped."""
    amax = torch.zeros(n_weights, dtype=torch.float32, device=x.device) if out is None else out
    if not use_triton(x, backend):
        amax.copy_(torch.maximum(amax, segmented_amax_reference(x, table, n_weights)))
        return amax
    if table.shape[0]:
        _amax_kernel[(table.shape[0],)](x, table, amax, BLOCK=BLOCK, num_warps=8)
    return amax


def pack_segments(
    x: torch.Tensor,
    table: torch.Tensor,
    inverse_scales: torch.Tensor,
    fmt: str,
    stream: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Write the segments of ``table`` into ``stream``: a weight segment as the FP8 (``fmt``) codes of
    ``x * inverse_scales[w]`` (clamped to the format's range; NaN to 0), a raw one as x's bytes."""
    _check(x, stream, table)
    if not use_triton(x, backend):
        return pack_segments_reference(x, table, inverse_scales, fmt, stream)
    if not table.shape[0]:
        return
    f = fp8_format(fmt)
    xraw, streamraw, size = _raw_views(x, stream)
    _pack_kernel[(table.shape[0],)](
        x, xraw, table, inverse_scales, stream, streamraw, RAW_UNIT=size, FMAX=f.max, E5M2=fmt == "e5m2",
        PTX=compiled_for_nvidia(), BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip


def unpack_segments(
    stream: torch.Tensor,
    table: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    x: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Write the segments of ``table`` from ``stream`` into ``x``: a weight segment as its codes times
    ``scales[w]`` rounded to x's dtype, a raw one as the bytes."""
    _check(x, stream, table)
    if not use_triton(x, backend):
        return unpack_segments_reference(stream, table, scales, fmt, x)
    if not table.shape[0]:
        return
    xraw, streamraw, size = _raw_views(x, stream)
    _unpack_kernel[(table.shape[0],)](
        stream, streamraw, table, scales, x, xraw, RAW_UNIT=size, E5M2=fmt == "e5m2", BLOCK=BLOCK, num_warps=8
    )
