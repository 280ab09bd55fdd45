"""swiglu_fp8: fc1's 1xG FP8 output in, fc2's per-tensor FP8 input out.

Saves only its FP8 1xG input (and the output amax, a scalar); the backward recomputes SiLU from
it. The output's transposed copy, which fc2's wgrad needs, is not kept either: it is recomputed
in backward from the same saved input, bit-identical to what the forward would have written.
So the SwiGLU input (1 byte + scales per element) is all the FFN's intermediate activations
cost, instead of BF16's 2 bytes for the input plus 2 for the output.

The backward hands h's gradient to fc1 either as BF16 (with its amax) or, when fc1 is a COAT
linear (``grad_fmt``), already as the per-tensor FP8 codes and transposed codes that fc1's backward
would quantize it to: the same bytes, without the BF16 gradient being written and read again.
"""

from __future__ import annotations

import torch

from coat_kernels.swiglu import quantize_swiglu_input, swiglu_backward, swiglu_backward_to_fp8, swiglu_to_fp8

from .tensor import Fp8Tensor, attach_amax


class _SwigluFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, group_size, out_fmt, saved_fmt, grad_fmt):
        if isinstance(h, Fp8Tensor) and h.group_size is not None:
            if h.group_size != group_size:
                raise ValueError(f"SwiGLU input has 1x{h.group_size} groups, expected 1x{group_size}")
            h_q, h_scales, amax = h.data_fp8, h.scale, h.consumer_amax
        else:
            plain = h.dequantize() if isinstance(h, Fp8Tensor) else h
            h_q, h_scales, amax = quantize_swiglu_input(plain, group_size, saved_fmt)
        r = swiglu_to_fp8(h_q, h_scales, group_size, out_fmt, amax=amax)
        ctx.save_for_backward(h_q, h_scales)
        ctx.meta = (group_size, h.dtype, grad_fmt)
        out_amax = r.amax  # the closure must not hold r: r.q is the output, which fc2 does not keep

        def transposed():
            return swiglu_to_fp8(h_q, h_scales, group_size, out_fmt, transpose=True, amax=out_amax, store_q=False).q_t

        return Fp8Tensor(r.q, r.scale, transposed_fn=transposed, dtype=h.dtype)

    @staticmethod
    def backward(ctx, da):
        h_q, h_scales = ctx.saved_tensors
        group_size, dtype, grad_fmt = ctx.meta
        if grad_fmt is not None:
            r = swiglu_backward_to_fp8(da.contiguous(), h_q, h_scales, group_size, grad_fmt, dh_dtype=dtype)
            return Fp8Tensor(r.q, r.scale, transposed=r.q_t, dtype=dtype), None, None, None, None
        dh, dh_amax = swiglu_backward(da.contiguous(), h_q, h_scales, group_size, dh_dtype=dtype)
        return attach_amax(dh, dh_amax), None, None, None, None


def swiglu_fp8(
    h: torch.Tensor,
    *,
    group_size: int = 16,
    out_fmt: str = "e4m3",
    saved_fmt: str = "e4m3",
    grad_fmt: str | None = None,
) -> Fp8Tensor:
    """silu(gate) * up of h = [gate | up] (..., 2F), Megatron's order, as a per-tensor FP8 ``Fp8Tensor``.

    h is normally fc1's 1xG ``Fp8Tensor`` output; a plain tensor is quantized to 1xG first. F must be
    a multiple of ``group_size``. ``grad_fmt`` ("e5m2" or "e4m3"): h's gradient goes back as a
    per-tensor FP8 ``Fp8Tensor`` of that format with its transposed codes, which only a COAT linear
    (``fp8_linear`` with that backward format) consumes without dequantizing: use it where h is
    such a linear's output. None: a BF16 gradient, for any producer.
    """
    return _SwigluFp8.apply(h, group_size, out_fmt, saved_fmt, grad_fmt)
