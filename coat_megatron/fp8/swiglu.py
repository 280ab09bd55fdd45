"""swiglu_fp8: fc1's 1xG FP8 output in, fc2's per-tensor FP8 input out.

Saves only its FP8 1xG input (and the output amax, a scalar); the backward recomputes SiLU from
it, and leaves dh's amax, found as it writes dh, in the input's ``AmaxHandoff`` for fc1's backward.
The output's transposed copy, which fc2's wgrad needs, is not kept either: it is recomputed in
backward from the same saved input, bit-identical to what the forward would have written. So the
SwiGLU input (1 byte + scales per element) is all the FFN's intermediate activations cost, instead
of BF16's 2 bytes for the input plus 2 for the output.

``input_store="bf16"`` (``CoatConfig.swiglu_input_store``, an accuracy ablation) takes a plain BF16
h, computes from it exactly and saves it (2 bytes per element); the output is still per-tensor FP8.
"""

from __future__ import annotations

import torch

from coat_kernels import quantize_per_tensor, tensor_amax, workspace
from coat_kernels.per_tensor import transpose_chunk_codes
from coat_kernels.swiglu import (
    quantize_swiglu_input,
    swiglu_backward,
    swiglu_backward_from_input,
    swiglu_from_input,
    swiglu_to_fp8,
)

from ..config import INPUT_STORES
from .tensor import Fp8Tensor


class _SwigluFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, group_size, out_fmt, saved_fmt, scratch):
        handoff = h.handoff if isinstance(h, Fp8Tensor) else None
        if isinstance(h, Fp8Tensor) and h.group_size is not None:
            if h.group_size != group_size:
                raise ValueError(f"SwiGLU input has 1x{h.group_size} groups, expected 1x{group_size}")
            h_q, h_scales, amax = h.data_fp8, h.scale, handoff.consumer_amax if handoff else None
        else:
            plain = h.dequantize() if isinstance(h, Fp8Tensor) else h
            h_q, h_scales, amax = quantize_swiglu_input(plain, group_size, saved_fmt)
        r = swiglu_to_fp8(h_q, h_scales, group_size, out_fmt, amax=amax)
        ctx.save_for_backward(h_q, h_scales)
        ctx.meta = (group_size, h.dtype)
        ctx.handoff = handoff  # where dh's amax goes, for the backward of h's producer
        out_amax = r.amax  # the closure must not hold r: r.q is the output, which fc2 does not keep

        def transposed(rows=slice(None), chunks=1):  # the rows of h (as (R, 2F)) whose output to transpose
            q, scales = h_q.view(-1, h_q.shape[-1])[rows], h_scales.view(-1, h_scales.shape[-1])[rows]
            if chunks == 1:
                return swiglu_to_fp8(q, scales, group_size, out_fmt, transpose=True, amax=out_amax, store_q=False).q_t
            # the codes are read once, by the byte pass that hands out the chunks' transposes
            codes = swiglu_to_fp8(
                q, scales, group_size, out_fmt, amax=out_amax, scratch=workspace.name(scratch, "swiglu.q")
            ).q
            return transpose_chunk_codes(
                codes.view(chunks, -1, codes.shape[-1]), chunk_major=True, scratch=workspace.name(scratch, "x_t")
            )

        return Fp8Tensor(r.q, r.scale, transposed_fn=transposed, dtype=h.dtype)

    @staticmethod
    def backward(ctx, da):
        h_q, h_scales = ctx.saved_tensors
        group_size, dtype = ctx.meta
        dh, dh_amax = swiglu_backward(da.contiguous(), h_q, h_scales, group_size, dh_dtype=dtype)
        if ctx.handoff is not None:
            ctx.handoff.deposit_grad_amax(dh, dh_amax)
        return dh, None, None, None, None


class _SwigluFromInput(torch.autograd.Function):
    """SwiGLU from the exact h, which it saves (``input_store="bf16"``)."""

    @staticmethod
    def forward(ctx, h, out_fmt):
        a = swiglu_from_input(h)  # FP32 (R, F)
        out_amax = tensor_amax(a)
        q, scale = quantize_per_tensor(a, out_fmt, amax=out_amax, check_finite=False)
        ctx.save_for_backward(h)
        h_exact = h.detach()

        def transposed(rows=slice(None), chunks=1):  # recomputed from h with the forward's amax: the same codes
            a_rows = swiglu_from_input(h_exact.reshape(-1, h_exact.shape[-1])[rows])
            if chunks == 1:
                return quantize_per_tensor(a_rows, out_fmt, transpose=True, amax=out_amax, check_finite=False)[2]
            codes = quantize_per_tensor(a_rows, out_fmt, amax=out_amax, check_finite=False)[0]
            return transpose_chunk_codes(codes.view(chunks, -1, codes.shape[-1]), chunk_major=True)

        return Fp8Tensor(q.view(*h.shape[:-1], a.shape[-1]), scale, transposed_fn=transposed, dtype=h.dtype)

    @staticmethod
    def backward(ctx, da):
        (h,) = ctx.saved_tensors
        return swiglu_backward_from_input(da, h, h.dtype), None


def swiglu_fp8(
    h: torch.Tensor,
    *,
    group_size: int = 16,
    out_fmt: str = "e4m3",
    saved_fmt: str = "e4m3",
    input_store: str = "fp8",
    scratch: bool = False,
) -> Fp8Tensor:
    """silu(gate) * up of h = [gate | up] (..., 2F), Megatron's order, as a per-tensor FP8 ``Fp8Tensor``.

    h is normally fc1's 1xG ``Fp8Tensor`` output; a plain tensor is quantized to 1xG first. F must be
    a multiple of ``group_size``. ``input_store="bf16"`` (``CoatConfig.swiglu_input_store``) takes a
    plain h (BF16), computes the output from it exactly and saves it for an exact backward.
    ``scratch``: the recomputed output's codes that a sequence-parallel fc2 transposes in its backward
    come from a reused buffer (``CoatConfig.scratch_buffers``, ``coat_kernels.workspace``).
    """
    if input_store not in INPUT_STORES:
        raise ValueError(f"input_store={input_store!r}: use one of {', '.join(INPUT_STORES)}")
    if input_store == "bf16":
        if isinstance(h, Fp8Tensor):
            raise ValueError(
                "input_store='bf16' computes SwiGLU from the exact input, and this h is FP8: give fc1 "
                "OutputForm.BF16 (CoatMLP does with CoatConfig(swiglu_input_store='bf16'))"
            )
        return _SwigluFromInput.apply(h, out_fmt)
    return _SwigluFp8.apply(h, group_size, out_fmt, saved_fmt, scratch)
