"""Per-tensor FP8 quantization with a just-in-time scale, optionally writing the transposed copy.

This is the granularity of every GEMM input. ``torch._scaled_mm`` wants A row-major and B
column-major, so of a linear layer's three GEMMs

    fprop  Y  = X  @ W^T     (A = X,   B = W^T: W row-major is W^T column-major)
    dgrad  dX = dY @ W       (A = dY,  B = W:   needs W^T row-major, the transposed copy of W)
    wgrad  dW = dY^T @ X     (A = dY^T row-major, B = X column-major: transposed copies of dY and X)

the activation X and the output gradient dY are each needed both as they are and transposed. The
transposed copy is written by the same pass that quantizes, from the same registers, for BF16 and
FP16 input; FP32 input (and tiles other kernels build by reshaping) get it from a 1-byte pass
over the codes, because Triton 3.6 miscompiles the in-register transpose there (see
``transpose_in_pass``).

The scale comes from the tensor's current amax by group scaling: a first pass writes one amax per
tile and its last program reduces them to one value (``amax.finish_amax``; or the producer of x does
the same in its own pass and hands the amax over as ``amax``); the quantizing pass derives the scale
from it in-kernel.

Shapes: ``x`` is (N,), (M, N) or (B, S, N), read as R = x.numel() // N rows of N; ``q`` has x's
shape; ``q_t`` is the (N, R) row-major transpose of that (R, N) matrix; ``scale`` is a 0-d FP32
tensor, and ``x ~= q * scale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import workspace
from .amax import amax_outputs, finish_amax
from .backend import use_triton
from .formats import as_rows, fp8_format
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


@lean
@triton.jit
def _tile_amax_kernel(
    x_ptr, tiles_ptr, amax_ptr, counter_ptr, n_rows, n_cols, stride_x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    tile_amax = tl.max(tl.max(abs_or_inf(x.to(tl.float32)), axis=1), axis=0)
    tl.store(tiles_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tile_amax)
    finish_amax(tiles_ptr, amax_ptr, counter_ptr)


@triton.jit
def store_per_tensor_tile(
    y,
    amax_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    rows,
    cols,
    n_rows,
    n_cols,
    FMAX: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    STORE_Q: tl.constexpr,
    CHUNK_ROWS: tl.constexpr,
):
    """Quantize the FP32 tile y (rows x cols of an n_rows x n_cols tensor) with the scale of the
    reduced amax at amax_ptr; store its codes (STORE_Q), its transposed codes (TRANSPOSE) and,
    from the first program, the scale. Shared by every kernel that writes a per-tensor FP8 output.
    CHUNK_ROWS (0: none): the transposed codes of each block of that many rows on their own,
    chunk-major ((n_rows / CHUNK_ROWS, n_cols, CHUNK_ROWS)), in place of the (n_cols, n_rows) one."""
    scale = scale_from_amax(tl.load(amax_ptr), FMAX)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_ptr, scale)
    q = quantize_with_inverse(y, tl.div_rn(1.0, scale), FMAX).to(qt_ptr.dtype.element_ty)
    rows64 = rows.to(tl.int64)
    if STORE_Q:
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        tl.store(q_ptr + rows64[:, None] * n_cols + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        mask_t = (cols[:, None] < n_cols) & (rows[None, :] < n_rows)
        if CHUNK_ROWS > 0:
            chunk = rows64 // CHUNK_ROWS
            qt_offs = (
                chunk[None, :] * n_cols * CHUNK_ROWS
                + cols.to(tl.int64)[:, None] * CHUNK_ROWS
                + (rows64 - chunk * CHUNK_ROWS)[None, :]
            )
        else:
            qt_offs = cols.to(tl.int64)[:, None] * n_rows + rows64[None, :]
        tl.store(qt_ptr + qt_offs, tl.trans(q), mask=mask_t)


@lean
@triton.jit
def _quantize_per_tensor_kernel(
    x_ptr,
    amax_ptr,
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
    STORE_Q: tl.constexpr,
    CHUNK_ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    store_per_tensor_tile(
        x.to(tl.float32),
        amax_ptr,
        q_ptr,
        qt_ptr,
        scale_ptr,
        rows,
        cols,
        n_rows,
        n_cols,
        FMAX,
        TRANSPOSE,
        STORE_Q,
        CHUNK_ROWS,
    )


@lean
@triton.jit
def _dequantize_per_tensor_kernel(q_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0.0)
    x = q.to(tl.float32) * tl.load(scale_ptr)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


_AMAX_BLOCKS = (64, 256, 8)  # (BLOCK_M, BLOCK_N, num_warps) of the tile-amax pass


def _quantize_blocks(n_cols: int, transpose: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the quantizing pass."""
    if (
        transpose
    ):  # 64x128 tiles, 4 warps: the fastest of git show 94757c2:benchmarks/quantize.py --sweep (docs/results.md)
        return 64, min(128, max(16, next_power_of_2(n_cols))), 4
    block_n = min(256, max(16, next_power_of_2(n_cols)))
    return max(1, 8192 // block_n), block_n, 8


# A packed output's scale row: the codes, then the 0-d FP32 scale in a row of 16 bytes (so that n ranks'
# packed outputs side by side still start every chunk and every scale 16-byte aligned: cuBLASLt takes a
# scale pointer only there)
SCALE_ROW_BYTES = 16


def per_tensor_outputs(
    shape,
    n_rows: int,
    n_cols: int,
    f,
    transpose: bool,
    device,
    packed: bool = False,
    scratch: str | None = None,
    scale_out: torch.Tensor | None = None,
):
    """Allocate (q, q_t, scale) for a per-tensor FP8 output; q_t is q itself when not transposing
    (a placeholder pointer the kernel never writes). The kernel writes the scale; for an empty
    tensor, which launches none, it is 1 (no fill launch otherwise).

    ``packed``: q and scale in one buffer, the codes then the scale in a ``SCALE_ROW_BYTES`` row,
    as a sequence-parallel all-gather sends them (``packed_message``; no copy into a send buffer),
    where the codes fill whole 16-byte rows; otherwise (or for an empty tensor) apart.

    ``scratch``: the outputs in the reused buffers of that name (``workspace``), for a caller that
    reads them before it returns; the scale there too, or in ``scale_out`` (a 0-d FP32 buffer, for
    a caller that keeps the scale)."""
    n = n_rows * n_cols
    if packed and n and n % SCALE_ROW_BYTES == 0:
        message = workspace.empty(n + SCALE_ROW_BYTES, torch.uint8, device, workspace.sub(scratch, "msg"))
        q = message[:n].view(f.dtype).view(shape)
        scale = message[n : n + 4].view(torch.float32).view(())
        q_t = workspace.empty((n_cols, n_rows), f.dtype, device, workspace.sub(scratch, "t")) if transpose else q
        return q, q_t, scale
    q = workspace.empty(shape, f.dtype, device, workspace.sub(scratch, "q"))
    q_t = workspace.empty((n_cols, n_rows), f.dtype, device, workspace.sub(scratch, "t")) if transpose else q
    if scale_out is not None:
        scale = scale_out
    else:
        scale = workspace.empty((), torch.float32, device, workspace.sub(scratch, "scale"))
    if not n:
        scale.fill_(1.0)
    return q, q_t, scale


def packed_message(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """The (q.numel() + ``SCALE_ROW_BYTES``,) uint8 view of the one buffer that holds the codes
    ``q`` and then their ``scale``, where a producer wrote them packed (``per_tensor_outputs``);
    None where they are apart."""
    n = q.numel()
    storage = q.untyped_storage()
    offset = q.storage_offset() * q.element_size()
    if (
        scale.untyped_storage().data_ptr() != storage.data_ptr()
        or storage.nbytes() < offset + n + SCALE_ROW_BYTES
        or scale.storage_offset() * 4 != offset + n
        or offset % SCALE_ROW_BYTES
        or not q.is_contiguous()
    ):
        return None
    return q.view(torch.uint8).view(-1).as_strided((n + SCALE_ROW_BYTES,), (1,), offset)


def _packed_copy(q: torch.Tensor, scale: torch.Tensor, f) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) in packed outputs where their size allows (``per_tensor_outputs``): for the
    reference paths, which compute the values apart."""
    n = q.numel()
    if not n or n % SCALE_ROW_BYTES:
        return q, scale
    n_cols = q.shape[-1]
    pq, _, ps = per_tensor_outputs(q.shape, n // n_cols, n_cols, f, False, q.device, packed=True)
    pq.view(torch.uint8).copy_(q.view(torch.uint8))
    ps.copy_(scale)
    return pq, ps


def transpose_in_pass(transpose: bool, dtype: torch.dtype) -> bool:
    """Whether the quantizing pass itself writes the transposed copy.

    Triton 3.6 on Hopper miscompiles ``tl.trans`` of an FP8 tile in some register layouts: a tile
    loaded as FP32 (wrong codes in q or q_t), and tiles built
    through 3-D reshapes, as the SwiGLU kernel's. Tiles loaded as BF16/FP16 are right (the GPU
    tests check every shape class). The others get their transposed copy from the FP8 codes in a
    second, 1-byte pass (``finish_transpose``).
    """
    return transpose and dtype != torch.float32


# (BLOCK_M, BLOCK_N, num_warps) of the byte transpose (``quantize.py --sweep`` (retired: ``git show 94757c2:benchmarks/quantize.py``) times others;
# benchmarks/results/kernel-bandwidth-1gpu)
_TRANSPOSE_BLOCKS = (64, 128, 4)  # faster than 64 x 64 (docs/results.md, "quantization kernels")


@lean
@triton.jit
def _transpose_codes_kernel(
    q_ptr,
    qt_ptr,
    n_rows,
    n_cols,
    chunk_rows,
    q_chunk_stride,
    qt_chunk_stride,
    qt_row_len,
    CHUNKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    if CHUNKED:  # row r of chunk c at c * q_chunk_stride + r * n_cols; its column at c * qt_chunk_stride + r
        chunk = rows64 // chunk_rows
        in_chunk = rows64 - chunk * chunk_rows
        q_offs = chunk[:, None] * q_chunk_stride + in_chunk[:, None] * n_cols + cols[None, :]
        qt_offs = chunk[None, :] * qt_chunk_stride + cols.to(tl.int64)[:, None] * qt_row_len + in_chunk[None, :]
    else:
        q_offs = rows64[:, None] * n_cols + cols[None, :]
        qt_offs = cols.to(tl.int64)[:, None] * n_rows + rows64[None, :]
    q = tl.load(q_ptr + q_offs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
    mask_t = (cols[:, None] < n_cols) & (rows[None, :] < n_rows)
    tl.store(qt_ptr + qt_offs, tl.trans(q), mask=mask_t)


def transpose_codes(q: torch.Tensor, *, backend: str = "auto", scratch: str | None = None) -> torch.Tensor:
    """The (N, R) row-major transpose of FP8 codes q (R rows of N; any leading shape), in one
    1-byte pass: wgrad operands of inputs that were all-gathered or produced without a copy, and
    the dgrad's W^T where the weight cache keeps W's codes only. Tiled, so that both the reads and
    the writes are coalesced (a strided torch copy reads one byte per 32-byte sector)."""
    n_cols = q.shape[-1]
    n_rows = q.numel() // max(n_cols, 1)
    q_t = workspace.empty((n_cols, n_rows), q.dtype, q.device, scratch)
    if not use_triton(q, backend):
        q_t.view(torch.uint8).copy_(q.view(torch.uint8).reshape(n_rows, n_cols).t())
        return q_t
    finish_transpose(q.contiguous(), q_t, True, in_pass=False)
    return q_t


def transpose_chunk_codes(
    chunks: torch.Tensor, *, chunk_major: bool = False, backend: str = "auto", scratch: str | None = None
) -> torch.Tensor:
    """The transposed codes of n chunks of R_c rows of N FP8 codes each, in one 1-byte pass.

    Args:
        chunks: (n, R_c, N) FP8 codes, each chunk's rows contiguous, the chunks at any stride (the
            codes of an all-gather's messages, say, with a scale row after each chunk).
        chunk_major: the layout of the result (below).
    Returns:
        (N, n R_c) row-major, the transpose of the chunks stacked (a wgrad operand over the whole
        sequence); with ``chunk_major``, (n, N, R_c): each chunk's transpose contiguous (the
        operand of one GEMM per chunk).
    """
    n, r_c, n_cols = chunks.shape
    if (n_cols > 1 and chunks.stride(2) != 1) or (r_c > 1 and chunks.stride(1) != n_cols):
        raise ValueError(
            f"each chunk's rows must be contiguous, got strides {chunks.stride()} for {tuple(chunks.shape)}"
        )
    shape = (n, n_cols, r_c) if chunk_major else (n_cols, n * r_c)
    q_t = workspace.empty(shape, chunks.dtype, chunks.device, scratch)
    if not use_triton(chunks, backend):
        t = chunks.view(torch.uint8).transpose(1, 2)  # (n, N, R_c)
        q_t.view(torch.uint8).copy_(t if chunk_major else t.transpose(0, 1).reshape(n_cols, n * r_c))
        return q_t
    if q_t.numel() == 0:
        return q_t
    block_m, block_n, warps = _TRANSPOSE_BLOCKS
    n_rows = n * r_c
    _transpose_codes_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
        chunks.view(torch.uint8),
        q_t.view(torch.uint8),
        n_rows,
        n_cols,
        r_c,
        chunks.stride(0),
        n_cols * r_c if chunk_major else r_c,
        r_c if chunk_major else n_rows,
        CHUNKED=True,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return q_t


def finish_transpose(q: torch.Tensor, q_t: torch.Tensor, transpose: bool, in_pass: bool) -> None:
    """Write q_t (N, R) from the codes q (R rows of N) when the quantizing pass did not."""
    if not transpose or in_pass or q.numel() == 0:
        return
    n_cols, n_rows = q_t.shape
    codes, codes_t = q.view(torch.uint8), q_t.view(torch.uint8)
    block_m, block_n, warps = _TRANSPOSE_BLOCKS
    grid = (cdiv(n_rows, block_m), cdiv(n_cols, block_n))
    _transpose_codes_kernel[grid](
        codes, codes_t, n_rows, n_cols, 0, 0, 0, 0, CHUNKED=False, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps
    )


def tensor_amax(x: torch.Tensor, *, backend: str = "auto", scratch: str | None = None) -> torch.Tensor:
    """max |x| as a 0-d FP32 tensor (+inf if x holds inf or NaN), by group scaling.

    One pass: every program writes the amax of its tile of x, and the last one reduces them (no
    second launch: ``amax.finish_amax``). Use it where one amax serves several quantizing calls
    (the chunks of a tensor quantized one at a time with one scale): hand it to
    ``quantize_per_tensor(..., amax=...)``.
    """
    rows = as_rows(x)
    if rows.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if not use_triton(x, backend):
        return abs_or_inf_reference(rows.float()).amax()
    block_m, block_n, warps = _AMAX_BLOCKS
    grid = (cdiv(rows.shape[0], block_m), cdiv(rows.shape[1], block_n))
    tiles, amax, count = amax_outputs(grid[0] * grid[1], x.device, scratch=scratch)
    _tile_amax_kernel[grid](
        rows,
        tiles,
        amax,
        count,
        rows.shape[0],
        rows.shape[1],
        rows.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return amax


def _reduce_amax(amax: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if amax.dim() == 0 and amax.dtype == torch.float32 and amax.device == x.device:
        return amax  # the common case, checked first (host time per call)
    if amax.dtype != torch.float32 or amax.device != x.device or amax.numel() == 0:
        raise ValueError(
            f"amax must be a non-empty float32 tensor on {x.device} (from tensor_amax or the producer "
            f"of x), got {amax.dtype} of shape {tuple(amax.shape)} on {amax.device}"
        )
    return amax.reshape(()) if amax.numel() == 1 else amax.amax()


def quantize_per_tensor_reference(
    x: torch.Tensor, fmt: str, *, transpose: bool = False, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    f = fp8_format(fmt)
    rows = as_rows(x).float()
    amax = tensor_amax(x, backend="reference") if amax is None else _reduce_amax(amax, x)
    scale = scale_from_amax_reference(amax, f.max)
    rows_q = quantize_with_inverse_reference(rows, 1.0 / scale, f.max).to(f.dtype)
    q = rows_q.view(x.shape)
    if not transpose:
        return q, scale
    return q, scale, rows_q.t().contiguous()


def dequantize_per_tensor_reference(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def quantize_per_tensor(
    x: torch.Tensor,
    fmt: str = "e4m3",
    *,
    transpose: bool = False,
    amax: torch.Tensor | None = None,
    check_finite: bool = True,
    packed: bool = False,
    chunks: int = 1,
    backend: str = "auto",
    scratch: str | None = None,
    scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Quantize ``x`` to FP8 with one just-in-time scale for the whole tensor.

    Args:
        x: BF16/FP16/FP32, 1-D to 3-D (any last dim), last dim contiguous.
        fmt: "e4m3" (activations, weights) or "e5m2" (gradients).
        transpose: also return ``q_t``, the (N, R) row-major FP8 transpose (from the same pass for
            BF16/FP16 input).
        amax: FP32 amax of x already known (0-d, or one per tile/row/group from x's producer,
            reduced here). Without it a group-scaling pass computes it.
        check_finite: raise ``NonFiniteInputError`` if x holds inf or NaN (one device sync).
            With False, the returned scale is +inf for such input, and the codes are zero.
        packed: write q and scale into one buffer, the message a sequence-parallel all-gather
            sends (``packed_message``; where the codes fill whole 16-byte rows). The same values.
        chunks: with ``transpose``, the R rows as that many equal blocks (a sequence-parallel
            linear's chunks), each transposed on its own: q_t chunk-major, (chunks, N, R / chunks),
            from the same pass (as ``quantize_per_tensor_transposed``, the codes written too).
        scratch, scale_out: the outputs in reused buffers, the scale in ``scale_out`` where given
            (``per_tensor_outputs``); the Triton path only, the same values.
    Returns:
        ``(q, scale)`` or ``(q, scale, q_t)``: FP8 codes of x's shape, a 0-d FP32 scale, and the
        per-tensor FP8 transpose.
    """
    if chunks > 1:
        n_rows = x.numel() // max(x.shape[-1], 1)
        if not transpose or packed or n_rows % chunks:
            raise ValueError(
                f"chunks={chunks} needs transpose=True, packed=False and rows that split into equal chunks "
                f"({n_rows} rows)"
            )
    q, scale, q_t = _quantize(
        x,
        fmt,
        transpose,
        amax,
        backend,
        codes=True,
        packed=packed,
        chunks=chunks,
        scratch=scratch,
        scale_out=scale_out,
    )
    if check_finite:
        raise_if_nonfinite(scale, "quantize_per_tensor")
    return (q, scale, q_t) if transpose else (q, scale)


def quantize_per_tensor_transposed(
    x: torch.Tensor,
    fmt: str = "e4m3",
    *,
    amax: torch.Tensor | None = None,
    chunks: int = 1,
    check_finite: bool = True,
    backend: str = "auto",
    scratch: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_t, scale)``: the (N, R) row-major per-tensor FP8 transpose of ``x`` and its scale,
    bit-identical to ``quantize_per_tensor(x, fmt, transpose=True, amax=amax)``'s, without writing
    the codes of x itself (for BF16/FP16 input, whose pass writes the transpose from registers; an
    FP32 x takes the codes' byte pass, as there). What a backward needs of a weight whose codes
    are not kept: W^T for the dgrad. ``chunks`` = n: the R rows as n equal blocks (a sequence
    parallel linear's chunks), each transposed on its own: q_t chunk-major, (n, N, R / n)."""
    if chunks == 1:
        _, scale, q_t = _quantize(x, fmt, True, amax, backend, codes=False, scratch=scratch)
    else:
        n_rows = x.numel() // x.shape[-1]
        if n_rows % chunks:
            raise ValueError(f"{n_rows} rows do not split into {chunks} equal chunks")
        q, scale, q_t = _quantize(x, fmt, True, amax, backend, codes=False, chunks=chunks, scratch=scratch)
    if check_finite:
        raise_if_nonfinite(scale, "quantize_per_tensor_transposed")
    return q_t, scale


def _quantize(
    x,
    fmt: str,
    transpose: bool,
    amax,
    backend: str,
    codes: bool,
    packed: bool = False,
    chunks: int = 1,
    scratch: str | None = None,
    scale_out: torch.Tensor | None = None,
):
    """(q, scale, q_t) of the per-tensor quantization: q_t None without ``transpose``; q None
    where ``codes`` is False and the pass writes q_t from its registers (the codes then unwritten);
    q and scale in one buffer where ``packed`` (``per_tensor_outputs``); q_t chunk-major,
    (chunks, N, R / chunks), where ``chunks`` > 1 (``quantize_per_tensor_transposed``)."""
    if not use_triton(x, backend):
        out = quantize_per_tensor_reference(x, fmt, transpose=transpose, amax=amax)
        q, scale = _packed_copy(out[0], out[1], fp8_format(fmt)) if packed else out[:2]
        q_t = out[2] if transpose else None
        if q_t is not None and chunks > 1:
            q_t = q_t.view(torch.uint8).view(q_t.shape[0], chunks, -1).transpose(0, 1).contiguous().view(q_t.dtype)
        return q, scale, q_t
    rows = as_rows(x)
    plan = _plans.get((x.shape, x.dtype, fmt, transpose, codes, chunks))
    if plan is None:
        plan = _make_plan(x, fmt, transpose, codes, chunks)
    f, n_rows, n_cols, in_pass, store_q, grid, launch = plan
    if amax is None:
        amax = tensor_amax(x, backend=backend, scratch=workspace.sub(scratch, "amax"))
    else:
        amax = _reduce_amax(amax, x)
    if store_q:  # (a chunk-major q_t from a byte pass is allocated there)
        q, q_t, scale = per_tensor_outputs(
            x.shape,
            n_rows,
            n_cols,
            f,
            transpose and (in_pass or chunks == 1),
            x.device,
            packed,
            scratch,
            scale_out,
        )
        if q_t is not None and chunks > 1:
            q_t = q_t.view(chunks, n_cols, n_rows // chunks)  # the pass writes it chunk-major
    else:  # q_t alone; it also stands in for the codes' pointer, which the kernel never writes
        q_t, _, scale = per_tensor_outputs((n_cols, n_rows), n_cols, n_rows, f, False, x.device, scratch=scratch)
        q = q_t
        if chunks > 1:
            q_t = q_t.view(chunks, n_cols, n_rows // chunks)  # the same buffer, laid out chunk-major
    if grid is not None:  # None: an empty tensor, no launch (the scale is 1)
        _quantize_per_tensor_kernel[grid](rows, amax, q, q_t, scale, n_rows, n_cols, rows.stride(0), **launch)
        if chunks > 1 and transpose and not in_pass:  # the codes' byte pass, chunk by chunk
            q_t = transpose_chunk_codes(
                q.view(chunks, n_rows // chunks, n_cols), chunk_major=True, scratch=workspace.sub(scratch, "ct")
            )
        else:
            finish_transpose(q, q_t, transpose, in_pass)
    return (q if store_q else None), scale, (q_t if transpose else None)


# Folded chunks: the per-tensor quantization of a sequence-parallel column-parallel linear's dY, chunk by chunk.
#
# dY (R, N) is n chunks of R_c = R / n rows; chunk c meets chunk c of the other wgrad operand X, whose
# per-tensor scale s_c its producer chose. Quantizing chunk c with the amax amax * max_j(s_j) / s_c makes
# the product of the two scales the same number for every chunk pair, so that dW = dY^T X is one GEMM
# over the whole sequence. One pass writes every chunk's codes (R, N), the transposed codes (N, R)
# (the chunks' transposes side by side: the wgrad operand) and the n scales.

SCALE_STRIDE = tl.constexpr(SCALE_ROW_BYTES // 4)  # the n scales' stride in FP32 words: each 16-byte aligned


@lean
@triton.jit
def _quantize_folded_chunks_kernel(
    x_ptr,
    amax_ptr,
    s_ptr,
    q_ptr,
    qt_ptr,
    scales_ptr,
    n_rows,
    n_cols,
    stride_x,
    chunk_rows,
    n_chunks,
    stride_s,
    FMAX: tl.constexpr,
    FOLD: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.load(amax_ptr)
    chunk = rows // chunk_rows
    if FOLD:  # amax * max_j(s_j) / s_c, each operation IEEE-rounded as torch's reference does it
        chunks = tl.arange(0, BLOCK_C)
        s_max = tl.max(tl.load(s_ptr + chunks * stride_s, mask=chunks < n_chunks, other=0.0), axis=0)
        s_c = tl.load(s_ptr + chunk * stride_s, mask=row_ok, other=1.0)
        chunk_amax = amax * tl.div_rn(s_max, s_c)
    else:
        chunk_amax = tl.zeros((BLOCK_M,), dtype=tl.float32) + amax
    scale = scale_from_amax(chunk_amax, FMAX)
    if tl.program_id(1) == 0:  # every row writes its chunk's scale: the same value, as often as it has rows
        tl.store(scales_ptr + chunk * SCALE_STRIDE, scale, mask=row_ok)
    q = quantize_with_inverse(x, tl.div_rn(1.0, scale)[:, None], FMAX).to(q_ptr.dtype.element_ty)
    rows64 = rows.to(tl.int64)
    tl.store(q_ptr + rows64[:, None] * n_cols + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        mask_t = (cols[:, None] < n_cols) & row_ok[None, :]
        tl.store(qt_ptr + cols.to(tl.int64)[:, None] * n_rows + rows64[None, :], tl.trans(q), mask=mask_t)


def folded_chunk_amaxes(amax: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """The amax to quantize chunk c of dY with: amax * max_j(s_j) / s_c, for the (n,) FP32 scales
    ``x_scales`` of the other operand's chunks (``quantize_folded_chunks``). A chunk whose s_c is
    below the largest uses less of the format's range (its values end up max_j(s_j) / s_c times
    smaller, no larger than the format's maximum): in a floating-point format that costs precision
    only below its smallest normal number, 2^29 below its largest (E5M2), and nothing is clipped."""
    return amax.reshape(()) * (x_scales.max() / x_scales)


def quantize_folded_chunks_reference(
    x: torch.Tensor, fmt: str, *, chunks: int, amax: torch.Tensor, x_scales: torch.Tensor | None, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    rows = as_rows(x)
    r_c = rows.shape[0] // chunks
    amaxes = folded_chunk_amaxes(amax, x_scales.float()) if x_scales is not None else amax.reshape(1).expand(chunks)
    parts = [
        quantize_per_tensor_reference(rows[c * r_c : (c + 1) * r_c], fmt, transpose=transpose, amax=amaxes[c])
        for c in range(chunks)
    ]
    q = torch.cat([p[0].view(torch.uint8) for p in parts]).view(parts[0][0].dtype)
    scales = torch.ones((chunks, SCALE_ROW_BYTES // 4), dtype=torch.float32, device=x.device)
    scales[:, 0] = torch.stack([p[1] for p in parts])
    q_t = torch.cat([p[2].view(torch.uint8) for p in parts], dim=1).view(q.dtype) if transpose else None
    return q, scales[:, 0], q_t


def quantize_folded_chunks(
    x: torch.Tensor,
    fmt: str,
    *,
    chunks: int,
    amax: torch.Tensor,
    x_scales: torch.Tensor | None = None,
    transpose: bool = False,
    backend: str = "auto",
    scratch: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize the ``chunks`` equal blocks of rows of ``x`` per tensor each, in one pass (see above).

    Args:
        x: (R, N) (or (..., N), read as R rows), BF16/FP16/FP32, R a multiple of ``chunks``.
        fmt: the FP8 format ("e5m2" for a gradient).
        amax: x's 0-d FP32 amax (``tensor_amax``, or handed over by x's producer).
        x_scales: (chunks,) FP32 (any stride): the per-tensor scales of the other operand's chunks,
            against which chunk c is folded (its amax is ``folded_chunk_amaxes(amax, x_scales)[c]``);
            None: every chunk is quantized with ``amax`` itself (one scale).
        transpose: also write the (N, R) transposed codes (every chunk's transpose side by side).
    Returns:
        ``(q, scales, q_t)``: the (R, N) codes (chunk c: rows [c R_c, (c + 1) R_c)), the (chunks,)
        FP32 scales (each element 16-byte aligned, as cuBLASLt takes a scale pointer; stride 4),
        and q_t or None. Bit for bit what ``quantize_per_tensor`` of each chunk with its folded amax
        gives (``quantize_folded_chunks_reference``).
    """
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    if n_rows % chunks:
        raise ValueError(f"{n_rows} rows do not split into {chunks} equal chunks")
    if x_scales is not None and (x_scales.shape != (chunks,) or x_scales.dtype != torch.float32):
        raise ValueError(f"x_scales must be {chunks} FP32 scales, got {x_scales.dtype} {tuple(x_scales.shape)}")
    if not use_triton(x, backend):
        return quantize_folded_chunks_reference(
            x, fmt, chunks=chunks, amax=amax, x_scales=x_scales, transpose=transpose
        )
    f = fp8_format(fmt)
    q = workspace.empty((n_rows, n_cols), f.dtype, x.device, workspace.sub(scratch, "q"))
    q_t = workspace.empty((n_cols, n_rows), f.dtype, x.device, workspace.sub(scratch, "t")) if transpose else None
    scales = workspace.empty((chunks, SCALE_ROW_BYTES // 4), torch.float32, x.device, workspace.sub(scratch, "scales"))
    if n_rows * n_cols == 0:
        scales.fill_(1.0)
        return q, scales[:, 0], q_t
    in_pass = transpose_in_pass(transpose, x.dtype)
    block_m, block_n, warps = _quantize_blocks(n_cols, transpose)
    fold = x_scales is not None
    _quantize_folded_chunks_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
        rows,
        _reduce_amax(amax, x),
        x_scales if fold else scales,
        q,
        q_t if in_pass else q,
        scales,
        n_rows,
        n_cols,
        rows.stride(0),
        n_rows // chunks,
        chunks,
        x_scales.stride(0) if fold else 0,
        FMAX=f.max,
        FOLD=fold,
        TRANSPOSE=in_pass,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_C=max(2, next_power_of_2(chunks)),
        num_warps=warps,
    )
    finish_transpose(q, q_t, transpose, in_pass)
    return q, scales[:, 0], q_t


# What a quantizing call works out from its input's shape and dtype and its options, made once per
# (shape, dtype, format, transpose, codes): its host time per call is what eager training waits on.
# (A sweep that patches _quantize_blocks must also give _plans a fresh dict: git show 94757c2:benchmarks/quantize.py.)
_plans: dict[tuple, tuple] = {}
_MAX_PLANS = 1024


def _make_plan(x: torch.Tensor, fmt: str, transpose: bool, codes: bool, chunks: int = 1) -> tuple:
    f = fp8_format(fmt)
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    in_pass = transpose_in_pass(transpose, x.dtype)
    block_m, block_n, warps = _quantize_blocks(n_cols, transpose)
    grid = (cdiv(n_rows, block_m), cdiv(n_cols, block_n)) if n_rows * n_cols else None
    store_q = codes or not in_pass
    launch = dict(
        FMAX=f.max,
        TRANSPOSE=in_pass,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        STORE_Q=store_q,
        CHUNK_ROWS=n_rows // chunks if chunks > 1 else 0,
        num_warps=warps,
    )
    plan = (f, n_rows, n_cols, in_pass, store_q, grid, launch)
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[(x.shape, x.dtype, fmt, transpose, codes, chunks)] = plan
    return plan


def dequantize_per_tensor(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, backend: str = "auto"
) -> torch.Tensor:
    """Inverse of ``quantize_per_tensor``: ``q * scale`` in ``dtype``, q's shape.

    Args:
        q: FP8 codes (e4m3 or e5m2), contiguous, any shape (also a ``q_t``).
        scale: FP32 tensor of one element.
    """
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"q must be float8_e4m3fn or float8_e5m2, got {q.dtype}")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(
            f"scale must be a float32 tensor of one element, got {scale.dtype} of shape {tuple(scale.shape)}"
        )
    if not q.is_contiguous():
        raise ValueError("q must be contiguous; pass q.contiguous()")
    if not use_triton(q, backend):
        return dequantize_per_tensor_reference(q, scale, dtype)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if q.numel():
        block = 4096
        _dequantize_per_tensor_kernel[(cdiv(q.numel(), block),)](q, scale, out, q.numel(), BLOCK=block, num_warps=8)
    return out
