"""fp8_linear: a linear layer whose three GEMMs run in FP8 with per-tensor scales.

    fprop  Y  = X @ W^T      A = X (E4M3, row-major)      B = W as stored (E4M3; W row-major is W^T column-major)
    dgrad  dX = dY @ W       A = dY (E5M2, row-major)     B = W^T (E4M3, the transposed copy of W)
    wgrad  dW = dY^T @ X     A = dY^T (E5M2, transposed)  B = X^T (E4M3, the transposed copy of X)

X arrives as an ``Fp8Tensor`` from a COAT producer (the norm, SwiGLU) with its transposed copy, or
as a plain BF16 tensor that is quantized here; dY as plain BF16, quantized here (with the amax that
its producer, SwiGLU's backward, left in the output's ``AmaxHandoff``, where it did). Saved for
backward: X^T (1 byte per element) and its scale; or nothing new when the producer can recompute
X^T (SwiGLU) or when the caller says that the BF16 input is saved anyway (``save_original_input``:
X^T is requantized from it in backward with the forward's amax, hence bit-identical). The output
is BF16, or 1xG FP8 for fc1 (what SwiGLU reads and saves), as its ``OutputForm`` says. Weight
copies come from an ``Fp8WeightCache`` (once per step). On a CPU the GEMMs dequantize and multiply
in FP32. The pieces that the sequence-parallel linears (``coat_megatron.layers.sequence_parallel``)
share with this one live here too: the weight's codes for fprop and dgrad, the FP8 output, and the
wgrad summed over chunks (``WeightGradient``).
"""

from __future__ import annotations

import sys

import torch

from coat_kernels import (
    quantize_per_group,
    quantize_per_tensor,
    quantize_per_tensor_transposed,
    tensor_amax,
    transpose_codes,
    workspace,
)
from coat_kernels.gemm import fp8_gemm
from coat_kernels.gemm_accumulate import fp8_gemm_accumulate
from coat_kernels.swiglu import quantize_swiglu_input

from ..config import CoatConfig
from .handoff import AmaxHandoff, OutputForm, take_grad_amax
from .tensor import Fp8Tensor
from .weights import Fp8WeightCache, weight_cache_for


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def weight_for_fprop(weight: torch.Tensor, cache: Fp8WeightCache, config: CoatConfig):
    """(w_q (out, in) E4M3, its 0-d scale, what ``weight_for_dgrad`` needs): W's codes from the
    cache, or (no codes kept) quantized here from the cache's amax: the bytes a kept copy would hold."""
    if cache.keep_codes:
        w_q, w_t, w_scale = cache.get(weight)
        return w_q, w_scale, (w_t, w_q, w_scale, None)
    if config.scratch_buffers:  # the codes, read by this forward's GEMMs only, in a reused buffer; the
        # scale, which the backward reads, in the cache's own (the same value each micro-batch of a step)
        w_amax, scale_out = cache.amax_and_scale(weight)
        w_q, w_scale = quantize_per_tensor(
            weight, config.weight_format, amax=w_amax, check_finite=False, scratch="w", scale_out=scale_out
        )
        return w_q, w_scale, (None, None, w_scale, w_amax)
    w_amax = cache.amax(weight)
    w_q, w_scale = quantize_per_tensor(weight, config.weight_format, amax=w_amax, check_finite=False)
    return w_q, w_scale, (None, None, w_scale, w_amax)


def weight_for_dgrad(saved, weight: torch.Tensor, config: CoatConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(W^T (in, out) row-major E4M3, its scale): kept by the cache, transposed from W's kept codes,
    or quantized transposed from the weight with the forward's amax (the same scale and codes)."""
    w_t, w_q, w_scale, w_amax = saved
    if w_t is None and w_q is not None:
        w_t = transpose_codes(w_q, scratch=workspace.name(config.scratch_buffers, "w_t"))
    elif w_t is None:
        w_t = quantize_per_tensor_transposed(
            weight.detach(),
            config.weight_format,
            amax=w_amax,
            check_finite=False,
            scratch=workspace.name(config.scratch_buffers, "w_t"),
        )[0]
    return w_t, w_scale


def quantize_output(y: torch.Tensor, form: OutputForm, config: CoatConfig) -> tuple[torch.Tensor, AmaxHandoff | None]:
    """A linear's BF16 output y as it leaves the layer, in ``form`` (``OutputForm``), and the
    ``AmaxHandoff`` it carries to its consumer (None for BF16), which the linear keeps for its
    backward: where the consumer leaves dY's amax."""
    if form is OutputForm.SWIGLU_INPUT:
        y_q, y_scales, a_amax = quantize_swiglu_input(y, config.group_size, config.forward_format)
    elif form is OutputForm.PER_GROUP:
        y_q, y_scales = quantize_per_group(y, config.group_size, config.forward_format, check_finite=False)
        a_amax = None
    else:
        return y, None
    handoff = AmaxHandoff(consumer_amax=a_amax)
    return Fp8Tensor(y_q, y_scales, group_size=config.group_size, handoff=handoff, dtype=y.dtype), handoff


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache, config, output_form, save_original_input, main_grad):
        fmt = config.forward_format
        x_t = x_t_fn = x_orig = x_amax = None
        if isinstance(x, Fp8Tensor) and x.group_size is None:
            x_q, x_scale, x_t, x_t_fn = x.data_fp8, x.scale, x.transposed, x.transposed_fn
        else:
            if isinstance(x, Fp8Tensor):  # a 1xG tensor is no GEMM input: dequantize it (rare)
                x = x.dequantize()
            if save_original_input:
                x_amax = tensor_amax(x)
                x_q, x_scale = quantize_per_tensor(x, fmt, amax=x_amax, check_finite=False)
                x_orig = x
            else:
                x_q, x_scale, x_t = quantize_per_tensor(x, fmt, transpose=True, check_finite=False)
        w_q, w_scale, ctx.w = weight_for_fprop(weight, cache, config)
        y = fp8_gemm(
            _rows(x_q),
            x_scale,
            w_q.t(),
            w_scale,
            out_dtype=x.dtype,
            bias=bias,
            use_fast_accum=config.fprop_fast_accumulation,
        ).view(*x.shape[:-1], weight.shape[0])
        ctx.save_for_backward(x_t, x_orig, x_amax, x_scale, weight)
        ctx.x_t_fn = x_t_fn
        ctx.meta = (config, bias is not None, x.shape, x.dtype, main_grad)
        out, ctx.handoff = quantize_output(y, output_form, config)
        return out

    @staticmethod
    def backward(ctx, dy):
        x_t, x_orig, x_amax, x_scale, weight = ctx.saved_tensors
        config, has_bias, x_shape, x_dtype, main_grad = ctx.meta
        dy2 = _rows(dy.contiguous())
        dy_q, dy_scale, dy_t = quantize_per_tensor(
            dy2, config.backward_format, transpose=True, amax=take_grad_amax(ctx.handoff, dy), check_finite=False
        )
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            w_t, w_scale = weight_for_dgrad(ctx.w, weight, config)
            dx = fp8_gemm(dy_q, dy_scale, w_t.t(), w_scale, out_dtype=x_dtype).view(x_shape)
        if ctx.needs_input_grad[1]:
            if x_t is None and x_orig is not None:
                x_t = quantize_per_tensor(
                    x_orig, config.forward_format, transpose=True, amax=x_amax, check_finite=False
                )[2]
            elif x_t is None:
                x_t = ctx.x_t_fn()
            wgrad = WeightGradient(weight, main_grad, accumulate=config.wgrad_accumulate)
            wgrad.add(dy_t, dy_scale, x_t.t(), x_scale)
            dw = wgrad.result()
        if has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(dim=0).to(weight.dtype)
        return dx, dw, db, None, None, None, None, None


def _capturing_a_per_layer_graph() -> bool:
    """Megatron's per-layer CUDA graphs (cuda_graph_impl="local") replay one captured backward for
    every micro-batch: what it does to main_grad must not depend on which micro-batch it is."""
    cuda_graphs = sys.modules.get("megatron.core.transformer.cuda_graphs")
    return cuda_graphs is not None and cuda_graphs.is_graph_capturing()


class WeightGradient:
    """dW = sum over c of (dY_c^T * s_dy,c) @ (X_c * s_x,c): the wgrad GEMM of a linear, one FP8 GEMM
    per chunk of tokens (``chunks`` of them; more than one where the chunks carry their own scales,
    as sequence-parallel ones do), summed in FP32 inside the GEMMs.

    ``into_main_grad``: Megatron's gradient-accumulation-fusion protocol, where the weight has a
    ``main_grad`` (FP32 or BF16): dW goes into it and autograd gets a placeholder, so DDP's hook
    does not add it a second time. While DDP has added nothing to main_grad since it zeroed it
    (``grad_added_to_main_grad`` False: the first micro-batch of a step), the first chunk's GEMM
    writes straight into it, with no FP32 temporary to add (8 bytes per weight element less
    traffic); later chunks, later micro-batches, and a captured per-layer graph, which serves every
    micro-batch, add, the way ``accumulate`` (``CoatConfig.wgrad_accumulate``) says. A BF16 main_grad is rounded once per chunk. Without
    it: one chunk writes dW in the weight's dtype; several are summed in an FP32 temporary.
    """

    def __init__(self, weight: torch.Tensor, into_main_grad: bool, chunks: int = 1, accumulate: str = "auto"):
        self.weight = weight
        self.accumulate = accumulate
        self.main = weight.main_grad if into_main_grad and hasattr(weight, "main_grad") else None
        self.chunks = chunks
        self.sum = None

    def add(self, dy_t: torch.Tensor, dy_scale: torch.Tensor, x_t_cm: torch.Tensor, x_scale: torch.Tensor) -> None:
        """Add dY_c^T X_c: ``dy_t`` (out, R_c) row-major E5M2, ``x_t_cm`` (R_c, in) column-major E4M3."""
        first, main = self.sum is None, self.main
        if main is not None:
            if first and main_grad_is_fresh(self.weight):
                fp8_gemm(dy_t, dy_scale, x_t_cm, x_scale, out_dtype=main.dtype, out=main)
            else:
                fp8_gemm_accumulate(dy_t, dy_scale, x_t_cm, x_scale, main, backend=self.accumulate)
            self.sum = main
        elif first:
            dtype = self.weight.dtype if self.chunks == 1 else torch.float32
            self.sum = fp8_gemm(dy_t, dy_scale, x_t_cm, x_scale, out_dtype=dtype)
        else:
            fp8_gemm_accumulate(dy_t, dy_scale, x_t_cm, x_scale, self.sum, backend=self.accumulate)

    def result(self) -> torch.Tensor | None:
        """What the autograd Function returns for the weight: dW, or main_grad's placeholder."""
        if self.main is None:
            return self.sum.to(self.weight.dtype)
        return added_to_main_grad(self.weight)


def main_grad_is_fresh(weight: torch.Tensor) -> bool:
    """Whether a gradient may be written into ``weight.main_grad`` rather than added: DDP has added
    nothing to it since it zeroed it (``grad_added_to_main_grad`` False, the first micro-batch of a
    step), and no per-layer graph is being captured (its one backward serves every micro-batch)."""
    return getattr(weight, "grad_added_to_main_grad", None) is False and not _capturing_a_per_layer_graph()


def added_to_main_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """What autograd gets for a weight whose gradient went into its ``main_grad``: None without DDP's
    flag; with it, the flag set and a placeholder that DDP's hook drops (zeros where Megatron asks
    for ``zero_out_wgrad``)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
    return _placeholder(weight.main_grad.shape, weight.dtype, weight.device)


# (device, dtype) -> the buffer that every placeholder weight gradient of that dtype is a view of
_placeholders: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A weight gradient that nobody reads (Megatron's DDP sees ``grad_added_to_main_grad`` and drops
    it): a view of one buffer per device and dtype, as large as the largest asked for, instead of an
    allocation per linear and micro-batch (the weight's size, as TE's ``get_dummy_wgrad`` keeps). While
    a CUDA graph is captured, a fresh one: the graph's pool must not hand out memory used outside it."""
    numel = shape.numel()
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(shape, dtype=dtype, device=device)
    buffer = _placeholders.get((device, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = _placeholders[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: CoatConfig | None = None,
    weight_cache: Fp8WeightCache | None = None,
    output_form: OutputForm = OutputForm.BF16,
    save_original_input: bool = False,
    accumulate_into_main_grad: bool = False,
) -> torch.Tensor:
    """y = x @ weight^T + bias with FP8 GEMMs (fprop, dgrad, wgrad).

    Args:
        x: (..., in): an ``Fp8Tensor`` (per-tensor, from a COAT producer) or a plain BF16 tensor.
        weight: (out, in), BF16 or FP32; bias: (out,) or None.
        config: formats (forward_format for X and Y, backward_format for dY, weight_format for W),
            the 1xG group size of an FP8 output, and how a wgrad is added into a ``main_grad``
            that already holds a sum (wgrad_accumulate).
        weight_cache: reuse the weight's FP8 copies across micro-batches (made here if absent,
            keeping the codes and their transposed copy as ``config.cache_weight`` and
            ``config.cache_weight_transpose`` say).
        output_form: ``OutputForm.BF16`` for a BF16 y; ``PER_GROUP`` for a 1xG FP8 ``Fp8Tensor``;
            ``SWIGLU_INPUT`` for fc1 feeding SwiGLU: 1xG FP8 whose ``AmaxHandoff`` also carries
            SwiGLU's output amax, found in the same pass.
        save_original_input: x (plain) is kept alive anyway (e.g. attention saves its output):
            save it instead of an FP8 transposed copy.
        accumulate_into_main_grad: add wgrad (FP32) into ``weight.main_grad`` instead of returning
            it (Megatron's gradient_accumulation_fusion).
    """
    output_form = OutputForm.check(output_form)
    config = config or CoatConfig()
    cache = weight_cache or weight_cache_for(config)
    return _Fp8Linear.apply(x, weight, bias, cache, config, output_form, save_original_input, accumulate_into_main_grad)
