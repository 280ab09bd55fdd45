"""COAT's linears under sequence parallelism: FP8 GEMMs that run chunk by chunk as the sequence travels.

Under sequence parallelism (SP) each of the n tensor-parallel ranks holds one chunk of the
sequence, R_c = R / n of the R token rows (``chunk_exchange`` names the chunks and the order in
which a rank meets them). A column-parallel linear (linear_qkv, linear_fc1) needs every chunk of
its input, a row-parallel one (linear_proj, linear_fc2) sums its output over the ranks and keeps
its own chunk. COAT moves the gathered tensors as FP8 codes (half of BF16's bytes) and splits each
exchange into the n chunks, so that a GEMM runs on the chunk in hand while the next one travels
(a ring of point-to-point transfers; ``CoatConfig.tp_comm_overlap`` off: one blocking collective
per exchange, the same arithmetic).

Every chunk keeps the per-tensor scale its producer quantized it with (the norm, SwiGLU, or this
rank's dY): no amax is all-reduced over the group, and each chunk's GEMM takes that chunk's scale.
Row block j of a product comes from chunk j alone, so the result equals dequantizing each rank's
chunk with its own scale and multiplying in FP32, chunk by chunk (the tests' torch reference).

Column-parallel, X = [X_0; ...; X_{n-1}] (R, h) gathered, W (out/n, h):

    fprop  Y_j = X_j W^T          for each chunk j as it arrives (X_j E4M3, scale s_j)
    dgrad  dX_c = dY_c W          for c = r - 1, r - 2, ..., r: the partial of chunk c, added to what
                                  arrived from rank r - 1 and sent on to rank r + 1 (reduce-scatter, BF16)
    wgrad  dW = dY^T X            one GEMM over the whole sequence: dY's chunk j is quantized against
                                  X_j's scale s_j (``coat_kernels.per_tensor.quantize_folded_chunks``:
                                  all chunks in one pass), so that every chunk pair has the same
                                  product of scales

Row-parallel, X (R, in/n) this rank's full-sequence slice of the input, W (h, in/n):

    fprop  Y_c = X_c W^T          for c = r - 1, ..., r: the partial of chunk c, reduce-scattered as above
                                  (X has one scale: without the ring, one GEMM writes every chunk's)
    dgrad  dX_j = dY_j W          for each chunk j of the gathered dY as it arrives (E5M2, scale s_j:
                                  each rank quantizes its own dY with its own amax)
    wgrad  dW = sum_j dY_j^T X_j  one GEMM per chunk, each with its pair of scales (the dY chunks'
                                  scales are their producers' ranks'), summed in FP32 / into main_grad

What the column-parallel wgrad reads, the gathered input, is not kept from the forward: the
backward gathers the FP8 codes again (their scales are kept: n numbers), in a ring overlapped with
the dgrad GEMMs and the dX reduce-scatter, as Megatron's own SP does in BF16. So the activation a
column-parallel linear saves is this rank's chunk, 1 byte per element, as without SP; keeping the
gathered chunks instead would save n times that per linear (n - 1 more chunks of the sequence at
hidden size, for linear_qkv and linear_fc1 of every layer) to spare a transfer that runs hidden
behind the dgrad GEMMs.

Transposed operands of the wgrad GEMMs: the column-parallel dY^T from the pass that quantizes dY's
chunks (placed side by side) and X^T by one byte transpose of the gathered codes, read where they
were gathered; the row-parallel ones per chunk (the GEMM's token dimension is the chunk's), each
made for every chunk in one pass: the gathered dY_j^T by a byte transpose of the gathered codes
(with the ring, chunk by chunk as they arrive), and X_j^T by its producer's recompute of the whole
sequence (``transposed_fn(chunks=n)``) or by requantizing the kept input with the forward's scale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coat_kernels import quantize_per_tensor, quantize_per_tensor_transposed, tensor_amax, transpose_codes, workspace
from coat_kernels.gemm import fp8_gemm
from coat_kernels.per_tensor import packed_message, quantize_folded_chunks, transpose_chunk_codes

from ..config import CoatConfig
from ..fp8.handoff import AmaxHandoff, OutputForm, take_grad_amax
from ..fp8.linear import WeightGradient, quantize_output, weight_for_dgrad, weight_for_fprop
from ..fp8.tensor import Fp8Tensor
from ..fp8.weights import Fp8WeightCache
from .chunk_exchange import all_gather_chunks, reduce_scatter_chunks


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, Fp8Tensor) else t


def _gemm_into(out, a, a_scale, b_rows, b_scale, config: CoatConfig, *, bias=None, fprop: bool = False) -> None:
    """out = (a * a_scale) @ (b_rows * b_scale)^T (+ bias): ``a`` (M, K) and ``b_rows`` (N, K) row-major FP8
    (W for fprop, W^T for dgrad), ``out`` a contiguous (M, N) block of the result. Hopper's fast
    accumulation in fprop only, as ``fp8_linear``."""
    fast = fprop and config.fprop_fast_accumulation
    fp8_gemm(a, a_scale, b_rows.t(), b_scale, out_dtype=out.dtype, bias=bias, use_fast_accum=fast, out=out)


def _cat_codes(codes: list[torch.Tensor], dim: int) -> torch.Tensor:
    """FP8 codes side by side (as bytes: no FP8 kernel needed), or the one tensor given."""
    if len(codes) == 1:
        return codes[0]
    return torch.cat([c.view(torch.uint8) for c in codes], dim=dim).view(codes[0].dtype)


def _reduced_amax(
    handoff: AmaxHandoff | None, t: torch.Tensor, rows: torch.Tensor, scratch: str | None = None
) -> torch.Tensor:
    """The 0-d amax of a gradient ``t`` (``rows``: it as contiguous rows): the one its producer left
    in ``handoff`` (reduced if it is per tile), or computed."""
    amax = take_grad_amax(handoff, t)
    if amax is None:
        return tensor_amax(rows, scratch=scratch)
    return amax.reshape(()) if amax.numel() == 1 else amax.amax()


class _ColumnParallelSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache, config, output_form, main_grad, group):
        if isinstance(x, Fp8Tensor) and x.group_size is None:
            codes, scale = x.data_fp8, x.scale
        else:  # BF16 (or a 1xG tensor, which is no GEMM input): quantized with this rank's amax
            x = _plain(x)
            codes, scale = quantize_per_tensor(x, config.forward_format, check_finite=False, packed=True)
        local = _rows(codes)
        overlap = config.tp_comm_overlap
        # without the ring, codes and scale packed in one message (as COAT's producers write them) are
        # sent again in backward, scale and all: nothing else to keep; otherwise the n scales are kept
        resend = not overlap and packed_message(local, scale) is not None
        on = config.scratch_buffers
        gather = all_gather_chunks(  # under way from here
            local, scale, group, overlap=overlap, keep_scales=not resend, scratch=workspace.name(on, "gathered")
        )
        w_q, w_scale, ctx.w = weight_for_fprop(weight, cache, config)
        n, r_c = len(gather), local.shape[0]
        # a GEMM output that quantize_output turns into FP8 is read once, there; a BF16 one is the output
        y_name = workspace.name(on and output_form is not OutputForm.BF16, "y")
        y = workspace.empty((n * r_c, weight.shape[0]), x.dtype, local.device, y_name)
        for _ in range(n):
            j, chunk, scale_j = gather.take()
            _gemm_into(y[j * r_c : (j + 1) * r_c], chunk, scale_j, w_q, w_scale, config, bias=bias, fprop=True)
        ctx.save_for_backward(local, weight, scale if resend else gather.scale_vector())
        ctx.meta = (config, group, bias is not None, x.shape, x.dtype, main_grad, n, resend)
        out, ctx.handoff = quantize_output(y.view(n * x.shape[0], *x.shape[1:-1], weight.shape[0]), output_form, config)
        return out

    @staticmethod
    def backward(ctx, dy):
        local, weight, saved_scale = ctx.saved_tensors
        config, group, has_bias, x_shape, x_dtype, main_grad, n, resend = ctx.meta
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        r_c = local.shape[0]
        overlap, on = config.tp_comm_overlap, config.scratch_buffers
        # the input's codes again, for wgrad: under way while dY is quantized and the dgrad runs
        gather = x_scales = None
        if need_dw and resend:  # this rank's message again: every chunk's scale comes with its codes
            gather = all_gather_chunks(local, saved_scale, group, overlap=False, scratch=workspace.name(on, "gathered"))
            x_scales = gather.scale_vector()
        elif need_dw:
            x_scales = saved_scale
            gather = all_gather_chunks(
                local,
                None,
                group,
                overlap=overlap,
                scales=list(x_scales.unbind()),
                scratch=workspace.name(on, "gathered"),
            )
        dy = _plain(dy)
        dy_rows = _rows(dy.contiguous())
        amax = _reduced_amax(ctx.handoff, dy, dy_rows, workspace.name(on, "dy.amax"))
        # dY is this rank's whole (R, out/n), quantized chunk by chunk in one pass (with the chunks'
        # transposed codes side by side, the wgrad operand), chunk c against X's chunk c: then every
        # chunk pair has one product of scales, and the wgrad is one GEMM over the sequence
        dy_q, dy_scales, dy_t = quantize_folded_chunks(
            dy_rows,
            config.backward_format,
            chunks=n,
            amax=amax,
            x_scales=x_scales,
            transpose=need_dw,
            scratch=workspace.name(on, "dy"),
        )
        scatter = reduce_scatter_chunks(
            (r_c, x_shape[-1]), x_dtype, local.device, group, overlap=overlap, scratch=workspace.name(on, "partials")
        )
        scatter = scatter if need_dx else None
        w_t, w_scale = weight_for_dgrad(ctx.w, weight, config) if need_dx else (None, None)
        x_chunks = [None] * n
        for _ in range(n):
            taken = gather.take() if gather else None  # posts the transfer of the next chunk
            if scatter:
                c, part = scatter.partial()
                _gemm_into(part, dy_q[c * r_c : (c + 1) * r_c], dy_scales[c], w_t, w_scale, config)
                scatter.reduce(part)
            if taken:
                j, x_chunks[j], _ = taken
        dx = scatter.result().view(x_shape) if need_dx else None
        dw = None
        if need_dw:
            if overlap:
                x_t = transpose_codes(_cat_codes(x_chunks, 0))
            else:  # (h, R) from the gathered chunks where they lie (between the scale rows) in one pass
                x_t = transpose_chunk_codes(gather.chunk_codes(), scratch=workspace.name(on, "x_t"))
            wgrad = WeightGradient(weight, main_grad, accumulate=config.wgrad_accumulate)
            # scale_c * s_c is the same number for every chunk c (to FP32 rounding): chunk 0's pair
            wgrad.add(dy_t, dy_scales[0], x_t.t(), x_scales[0])
            dw = wgrad.result()
        db = dy_rows.float().sum(dim=0).to(weight.dtype) if has_bias and need_db else None
        return dx, dw, db, None, None, None, None, None


def _chunks_transposed(ctx, x_orig, x_amax, saved_t, chunked_t: bool, n: int, r_c: int):
    """The (in/n, R_c) transposed codes of each chunk of a row-parallel linear's X (indexed by chunk),
    made in one go for the whole sequence: kept chunk-major by the forward; requantized from the
    kept BF16 input with the forward's amax (the same codes) and transposed chunk by chunk (one
    pass); rearranged from the producer's transposed copy; or recomputed by the producer."""
    if chunked_t:
        return saved_t
    if x_orig is not None:  # one pass writes every chunk's transposed codes (a BF16 input's from registers)
        config = ctx.meta[0]
        scratch = workspace.name(config.scratch_buffers, "x_t")
        return quantize_per_tensor_transposed(
            _rows(x_orig), config.forward_format, amax=x_amax, chunks=n, check_finite=False, scratch=scratch
        )[0]
    if saved_t is not None:  # (in/n, R) -> (n, in/n, R_c): one copy
        x_t = saved_t
        return x_t.view(torch.uint8).view(x_t.shape[0], n, r_c).transpose(0, 1).contiguous().view(x_t.dtype)
    return ctx.x_t_fn(chunks=n)


class _RowParallelSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cache, config, save_original_input, main_grad, group):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        fmt, on = config.forward_format, config.scratch_buffers
        r_c = x.numel() // x.shape[-1] // n
        x_t = x_orig = x_amax = x_t_fn = codes = None
        if isinstance(x, Fp8Tensor) and x.group_size is None:
            codes, x_scale = _rows(x.data_fp8), x.scale
            x_t, x_t_fn = x.transposed, x.transposed_fn
            chunks = [codes[c * r_c : (c + 1) * r_c] for c in range(n)]
        else:
            x = _plain(x)
            x_amax = tensor_amax(x)
            if save_original_input:  # x is kept anyway: the wgrad operand is requantized from it in backward
                # (the codes are read by this forward's GEMM only; the scale is kept for the backward)
                kept_scale = torch.empty((), dtype=torch.float32, device=x.device)
                codes, x_scale = quantize_per_tensor(
                    _rows(x),
                    fmt,
                    amax=x_amax,
                    check_finite=False,
                    scratch=workspace.name(on, "x"),
                    scale_out=kept_scale,
                )
                chunks = [codes[c * r_c : (c + 1) * r_c] for c in range(n)]
                x_orig = x
            else:  # one scale; the codes and every chunk's transposed codes (chunk-major) from one pass
                codes, x_scale, x_t = quantize_per_tensor(
                    _rows(x), fmt, transpose=True, amax=x_amax, chunks=n, check_finite=False
                )
                chunks = [codes[c * r_c : (c + 1) * r_c] for c in range(n)]
        w_q, w_scale, ctx.w = weight_for_fprop(weight, cache, config)
        scatter = reduce_scatter_chunks(
            (r_c, weight.shape[0]),
            x.dtype,
            x_scale.device,
            group,
            overlap=config.tp_comm_overlap,
            scratch=workspace.name(on, "partials"),
        )
        whole = scatter.all_partials() if codes is not None else None
        if whole is not None:  # every chunk's partial in one GEMM: X has one scale (each row the same product)
            _gemm_into(whole, codes, x_scale, w_q, w_scale, config, fprop=True)
        else:
            for _ in range(n):
                c, part = scatter.partial()
                _gemm_into(part, chunks[c], x_scale, w_q, w_scale, config, fprop=True)
                scatter.reduce(part)
        y = scatter.result().view(x.shape[0] // n, *x.shape[1:-1], weight.shape[0])
        chunked_t = x_t is not None and x_t.dim() == 3  # (n, in/n, R_c), chunk-major: made above
        ctx.save_for_backward(x_orig, x_amax, x_scale, weight, x_t)
        ctx.x_t_fn = x_t_fn
        ctx.meta = (config, group, n, rank, r_c, x.shape, x.dtype, main_grad, chunked_t)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_orig, x_amax, x_scale, weight, saved_t = ctx.saved_tensors
        config, group, n, rank, r_c, x_shape, x_dtype, main_grad, chunked_t = ctx.meta
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dy = _plain(dy)
        overlap, on = config.tp_comm_overlap, config.scratch_buffers
        # dY's amax where the next layer's norm found it in its backward (CoatConfig.fuse_residual_backward)
        dy_amax = take_grad_amax(None, dy)
        # the wgrad's dY_j^T: with the ring, each chunk's as it arrives (this rank's from its quantizing
        # pass); without, every chunk's in one pass where they were gathered
        dy_q, dy_scale, *own_t = quantize_per_tensor(
            _rows(dy.contiguous()),
            config.backward_format,
            transpose=need_dw and overlap,
            amax=dy_amax,
            check_finite=False,
            packed=True,
            scratch=workspace.name(on and not overlap, "dy"),
        )
        gather = all_gather_chunks(dy_q, dy_scale, group, overlap=overlap, scratch=workspace.name(on, "gathered"))
        dy_t = (
            transpose_chunk_codes(gather.chunk_codes(), chunk_major=True, scratch=workspace.name(on, "dy_t"))
            if need_dw and not overlap
            else None
        )
        dx = torch.empty((n * r_c, x_shape[-1]), dtype=x_dtype, device=dy_q.device) if need_dx else None
        w_t, w_scale = weight_for_dgrad(ctx.w, weight, config) if need_dx else (None, None)
        wgrad = WeightGradient(weight, main_grad, chunks=n, accumulate=config.wgrad_accumulate) if need_dw else None

        x_t = _chunks_transposed(ctx, x_orig, x_amax, saved_t, chunked_t, n, r_c) if need_dw else None
        for _ in range(n):
            j, chunk, chunk_scale = gather.take()
            if need_dx:
                _gemm_into(dx[j * r_c : (j + 1) * r_c], chunk, chunk_scale, w_t, w_scale, config)
            if need_dw:
                chunk_t = dy_t[j] if dy_t is not None else own_t[0] if j == rank else transpose_codes(chunk)
                wgrad.add(chunk_t, chunk_scale, x_t[j].t(), x_scale)
        dx = dx.view(x_shape) if need_dx else None
        dw = wgrad.result() if need_dw else None
        return dx, dw, None, None, None, None, None


def column_parallel_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    group,
    config: CoatConfig,
    weight_cache: Fp8WeightCache,
    output_form: OutputForm = OutputForm.BF16,
    accumulate_into_main_grad: bool = False,
) -> torch.Tensor:
    """The sequence-parallel column-parallel linear: every rank's chunk of x, gathered, times W^T.

    Args:
        x: [s/n, b, h], this rank's chunk of the sequence: a per-tensor FP8 ``Fp8Tensor`` (the COAT
            norm's output, with this rank's own scale) or BF16 (quantized here with its own amax).
        weight: (out/n, h), this rank's rows; bias: (out/n,) or None.
        group: the tensor-parallel group (n ranks).
        config, weight_cache, output_form, accumulate_into_main_grad: as ``fp8_linear``.
    Returns:
        [s, b, out/n]: BF16, or 1xG FP8, as ``output_form`` says. Its gradient reaches x reduce-scattered
        (BF16, [s/n, b, h]).
    """
    output_form = OutputForm.check(output_form)
    return _ColumnParallelSP.apply(x, weight, bias, weight_cache, config, output_form, accumulate_into_main_grad, group)


def row_parallel_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    group,
    config: CoatConfig,
    weight_cache: Fp8WeightCache,
    save_original_input: bool = False,
    accumulate_into_main_grad: bool = False,
) -> torch.Tensor:
    """The sequence-parallel row-parallel linear: x @ W^T summed over the ranks, this rank's chunk kept.

    Args:
        x: [s, b, in/n]: a per-tensor FP8 ``Fp8Tensor`` (SwiGLU's output) or BF16 (the attention's
            output; quantized here with one scale).
        weight: (h, in/n), this rank's columns (no bias: the caller adds it after the sum).
        group: the tensor-parallel group (n ranks).
        config, weight_cache, save_original_input, accumulate_into_main_grad: as ``fp8_linear``.
    Returns:
        [s/n, b, h] BF16, this rank's chunk of the sum. Its gradient is gathered as E5M2 codes, each
        rank's chunk with its own scale.
    """
    return _RowParallelSP.apply(x, weight, weight_cache, config, save_original_input, accumulate_into_main_grad, group)
