"""rmsnorm_to_fp8 / layernorm_to_fp8: the BF16 residual stream in, a per-tensor FP8 GEMM input out.

Forward (exact, from the BF16 input): the normalised output, quantized per tensor with its
transposed copy for the next linear's wgrad. Saved for backward: the 1xG FP8 copy of the input
with its scales, and mean/rstd (FP32, one per row): about 1.25 bytes per input element instead
of BF16's 2 (plus the output the next GEMM would save in BF16). Backward: BF16 input gradient,
weight (and bias) gradients. ``input_store="bf16"`` saves the input itself instead of its 1xG
copy (``CoatConfig.norm_input_store``, an accuracy ablation): the backward is then the exact one.
"""

from __future__ import annotations

import torch

from coat_kernels import dequantize_per_group, workspace
from coat_kernels.norm import (
    add_residual_grad,
    norm_backward,
    norm_backward_from_input,
    norm_quantize,
    norm_to_fp8,
    write_or_add,
)
from coat_kernels.per_tensor import transpose_chunk_codes

from ..config import INPUT_STORES
from .handoff import deposit_loose_grad_amax
from .linear import added_to_main_grad, main_grad_is_fresh
from .tensor import Fp8Tensor


def _multiplier(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    """What the kernels multiply by: the parameter itself (they convert it as they load it; no
    copy, no launch), or for a zero-centred gamma its FP32 w + 1."""
    w = weight.detach()
    return (w.float() + 1.0).contiguous() if zero_centered_gamma else w.contiguous()


class _NormToFp8(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        eps,
        kind,
        group_size,
        zero_centered_gamma,
        out_fmt,
        saved_fmt,
        transpose,
        input_store,
        packed,
        into_main_grad,
        scratch,
        residual=False,
    ):
        # transpose: None (no transposed copy), "store" (written now), "recompute" (in backward,
        # from the saved input); input_store: "fp8" (the 1xG copy is saved) or "bf16" (x itself)
        if input_store not in INPUT_STORES:
            raise ValueError(f"input_store={input_store!r}: use one of {', '.join(INPUT_STORES)}")
        w = _multiplier(weight, zero_centered_gamma)
        b = bias.detach().contiguous() if bias is not None else None
        r = norm_to_fp8(
            x,
            w,
            b,
            eps=eps,
            kind=kind,
            group_size=group_size,
            out_fmt=out_fmt,
            saved_fmt=saved_fmt,
            transpose=transpose == "store",
            packed=packed,
            # the amax is read by the second pass only, unless the backward recomputes the output with it
            scratch_amax=workspace.name(scratch and transpose != "recompute", "norm.amax"),
        )
        exact = input_store == "bf16"
        # exact: x in the slots of the codes, no scales (the kernel wrote the 1xG copy anyway; it is dropped)
        ctx.save_for_backward(x if exact else r.x_q, None if exact else r.x_scales, r.mean, r.rstd, weight)
        ctx.meta = (group_size, zero_centered_gamma, bias is not None, x.dtype, into_main_grad, scratch)
        ctx.bias = bias  # the parameter (its main_grad), not an activation
        transposed_fn = None
        if transpose == "recompute":
            x_q, x_scales, mean, rstd, amax, dtype = r.x_q, r.x_scales, r.mean, r.rstd, r.amax, x.dtype
            x_exact = x.detach() if exact else None

            def transposed_fn(rows=slice(None), chunks=1):
                h = x_q.shape[-1]
                if x_exact is not None:
                    x_saved = x_exact.reshape(-1, h)[rows]
                else:
                    x_saved = dequantize_per_group(
                        x_q.view(-1, h)[rows], x_scales.view(-1, h // group_size)[rows], group_size, dtype
                    )
                mean_rows = mean[rows] if mean is not None else None
                out = norm_quantize(x_saved, w, b, mean_rows, rstd[rows], amax, out_fmt=out_fmt, transpose=chunks == 1)
                if chunks == 1:
                    return out[2]
                return transpose_chunk_codes(out[0].view(chunks, -1, h), chunk_major=True)

        out = Fp8Tensor(r.q, r.scale, transposed=r.q_t, transposed_fn=transposed_fn, dtype=x.dtype)
        if not residual:
            return out
        # x again, as the layer's residual: its gradient comes back here, to be added in the backward's pass
        ctx.set_materialize_grads(False)
        return out, x.view_as(x)

    @staticmethod
    def backward(ctx, grad, grad_residual=None):
        x_saved, x_scales, mean, rstd, weight = ctx.saved_tensors
        group_size, zero_centered_gamma, has_bias, dtype, into_main_grad, scratch = ctx.meta
        if grad is None:  # (grads are not materialized with a residual) the output was not used
            grad = torch.zeros(x_saved.shape, dtype=dtype, device=x_saved.device)
        residual = grad_residual.contiguous() if grad_residual is not None else None
        multiplier = _multiplier(weight, zero_centered_gamma)
        params = [weight, ctx.bias] if has_bias else [weight]
        # where dW (dB) goes: the parameter's main_grad (Megatron's gradient-accumulation protocol, as
        # COAT's linears do: written at a step's first micro-batch, added after), else a new vector in
        # the parameter's dtype; the kernels write it there, rounding once, with no sum, cast or add
        mains = [p.main_grad if into_main_grad and hasattr(p, "main_grad") else None for p in params]
        accumulate = [m is not None and not main_grad_is_fresh(p) for p, m in zip(params, mains)]
        if mains[0] is not None and has_bias and (mains[1] is None or accumulate[0] != accumulate[1]):
            mains, accumulate = [None] * len(params), [False] * len(params)  # the two alike, or neither
        outs = [
            m if m is not None else torch.empty(p.shape, dtype=p.dtype, device=p.device) for p, m in zip(params, mains)
        ]
        if x_scales is None:  # input_store="bf16": x itself
            dx, dw, db = norm_backward_from_input(
                grad, x_saved, multiplier, mean, rstd, has_bias=has_bias, dx_dtype=dtype
            )
            dx = add_residual_grad(dx, residual)
            dw = write_or_add(outs[0], dw, accumulate[0])
            db = write_or_add(outs[1], db, accumulate[1]) if has_bias else None
        else:
            dx, dw, db, *amax = norm_backward(
                grad.contiguous(),
                x_saved,
                x_scales,
                multiplier,
                mean,
                rstd,
                group_size=group_size,
                has_bias=has_bias,
                dx_dtype=dtype,
                dw_out=outs[0],
                db_out=outs[1] if has_bias else None,
                accumulate=accumulate[0],
                residual_grad=residual,
                dx_amax=residual is not None,
                scratch=workspace.name(scratch, "norm.partials"),
            )
            if amax:  # for the linear whose output's gradient dx is too (through the residual add)
                deposit_loose_grad_amax(dx, amax[0])
        grads = [added_to_main_grad(p) if m is not None else g for p, m, g in zip(params, mains, (dw, db))]
        return dx, grads[0], grads[1] if has_bias else None, *([None] * 13)


def rmsnorm_to_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    *,
    group_size: int = 16,
    zero_centered_gamma: bool = False,
    out_fmt: str = "e4m3",
    saved_fmt: str = "e4m3",
    transpose: str | None = "store",
    input_store: str = "fp8",
    packed: bool = False,
    into_main_grad: bool = False,
    scratch: bool = False,
    residual: bool = False,
) -> Fp8Tensor | tuple[Fp8Tensor, torch.Tensor]:
    """RMSNorm of x (..., H) into a per-tensor FP8 ``Fp8Tensor`` for the next linear.

    H must be a multiple of ``group_size`` (the 1xG FP8 copy of x saved for backward).
    ``transpose``: "store" writes the transposed copy (the next linear's wgrad operand) now;
    "recompute" makes it in backward from the saved input (nothing more is kept); None makes
    none (a consumer that all-gathers its input makes its own).
    ``input_store``: "fp8" saves the 1xG copy of x (``saved_fmt``) for backward; "bf16" saves x
    itself, and the backward is the exact one (``CoatConfig.norm_input_store``).
    ``packed``: the output's codes and scale in one buffer, the message that a sequence-parallel
    consumer all-gathers as it is (``coat_kernels.per_tensor.packed_message``).
    ``into_main_grad``: where the weight (and bias) has DDP's ``main_grad``, the backward writes its
    gradient there, or adds it after a step's first micro-batch, and autograd gets a placeholder
    (``CoatConfig.fuse_wgrad_accumulation``, as COAT's linears do); elsewhere the gradient, in the
    parameter's dtype.
    ``scratch``: the buffers read within one pass or one backward (the amax tiles, dW's partial sums)
    reused from call to call (``CoatConfig.scratch_buffers``, ``coat_kernels.workspace``).
    ``residual``: return ``(output, x)``, x as the layer's residual (Megatron's (output, residual) norm
    output), whose gradient the backward adds to dx in its own pass, finding the sum's amax for the
    linear that quantizes it next (``CoatConfig.fuse_residual_backward``); the same bits as autograd's sum.
    """
    return _NormToFp8.apply(
        x,
        weight,
        None,
        eps,
        "rmsnorm",
        group_size,
        zero_centered_gamma,
        out_fmt,
        saved_fmt,
        transpose,
        input_store,
        packed,
        into_main_grad,
        scratch,
        residual,
    )


def layernorm_to_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    group_size: int = 16,
    zero_centered_gamma: bool = False,
    out_fmt: str = "e4m3",
    saved_fmt: str = "e4m3",
    transpose: str | None = "store",
    input_store: str = "fp8",
    packed: bool = False,
    into_main_grad: bool = False,
    scratch: bool = False,
    residual: bool = False,
) -> Fp8Tensor | tuple[Fp8Tensor, torch.Tensor]:
    """LayerNorm of x (..., H) into a per-tensor FP8 ``Fp8Tensor``; as ``rmsnorm_to_fp8``."""
    return _NormToFp8.apply(
        x,
        weight,
        bias,
        eps,
        "layernorm",
        group_size,
        zero_centered_gamma,
        out_fmt,
        saved_fmt,
        transpose,
        input_store,
        packed,
        into_main_grad,
        scratch,
        residual,
    )
