"""The sequence-parallel all-gather of a column-parallel linear's input, in FP8.

Under sequence parallelism each tensor-parallel rank holds a slice of the sequence; a
column-parallel linear gathers the whole sequence before its GEMM. COAT gathers FP8 codes
instead of BF16 (half the bytes). Every rank quantizes with one shared scale: the amax is
all-reduced (MAX) over the group before quantizing (the COAT norm does this between its two
passes; a plain input is quantized here). The gathered codes are not kept for backward: the
wgrad operand (their transpose) is made in backward by gathering the local codes again, as
Megatron does for BF16, so each rank saves only its own slice. The gradient of the gathered
input is reduce-scattered back to the slices, in BF16 (NCCL reduces no FP8).

The row-parallel linears (linear_proj, linear_fc2) reduce-scatter their output in BF16; the
backward of that is an all-gather of the output gradient, which COAT also does in FP8
(``reduce_scatter_with_fp8_grad``): E5M2 codes with a group-shared scale, handed to the linear's
backward, which needs exactly that per-tensor FP8 dY for its dgrad and wgrad GEMMs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import _reduce_scatter_along_first_dim

from coat_kernels import quantize_per_tensor, tensor_amax, transpose_codes

from ..fp8.tensor import Fp8Tensor


def all_reduce_amax(group):
    """A callable that all-reduces (MAX, in place) a 0-d amax over ``group``: one scale per group."""

    def reduce(amax: torch.Tensor) -> None:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)

    return reduce


def _gather_rows(codes: torch.Tensor, group) -> torch.Tensor:
    """All-gather FP8 codes along the first (sequence) dimension. Through a uint8 view: gloo
    rejects float8 dtypes, NCCL takes both."""
    world = dist.get_world_size(group)
    out = torch.empty((world * codes.shape[0], *codes.shape[1:]), dtype=codes.dtype, device=codes.device)
    dist.all_gather_into_tensor(out.view(torch.uint8), codes.contiguous().view(torch.uint8), group=group)
    return out


class _GatherFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, fmt):
        if not (isinstance(x, Fp8Tensor) and x.group_size is None):
            plain = x.dequantize() if isinstance(x, Fp8Tensor) else x
            amax = tensor_amax(plain)
            all_reduce_amax(group)(amax)
            q, scale = quantize_per_tensor(plain, fmt, amax=amax, check_finite=False)
            x = Fp8Tensor(q, scale, dtype=plain.dtype)
        local = x.data_fp8
        ctx.group = group
        return Fp8Tensor(
            _gather_rows(local, group),
            x.scale,
            transposed_fn=lambda: transpose_codes(_gather_rows(local, group)),
            dtype=x.dtype,
        )

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along_first_dim(grad.contiguous(), ctx.group), None, None


class _ReduceScatterFp8Grad(torch.autograd.Function):
    """Forward: Megatron's BF16 reduce-scatter of a row-parallel linear's output to the sequence
    slices. Backward: the matching all-gather of the output gradient, in FP8: each rank
    quantizes its slice of dY (``fmt``, E5M2) with the amax all-reduced (MAX) over the group, the
    codes are gathered, and the linear's backward receives a per-tensor ``Fp8Tensor`` dY whose
    transposed copy (the wgrad operand) is a codes transpose. The scale is the one the linear's
    backward would compute from the gathered BF16 dY (the MAX of the slices' amaxes), so the
    codes are bit-identical to quantizing after a BF16 gather, at half the bytes."""

    @staticmethod
    def forward(ctx, out, group, fmt):
        ctx.group, ctx.fmt = group, fmt
        return _reduce_scatter_along_first_dim(out, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.dequantize() if isinstance(grad, Fp8Tensor) else grad.contiguous()
        amax = tensor_amax(grad)
        all_reduce_amax(ctx.group)(amax)
        q, scale = quantize_per_tensor(grad, ctx.fmt, amax=amax, check_finite=False)
        gathered = _gather_rows(q, ctx.group)
        rows = gathered.view(-1, gathered.shape[-1])
        dy = Fp8Tensor(gathered, scale, transposed_fn=lambda: transpose_codes(rows), dtype=grad.dtype)
        return dy, None, None


def reduce_scatter_with_fp8_grad(out: torch.Tensor, group, fmt: str = "e5m2") -> torch.Tensor:
    """Reduce-scatter a row-parallel output ([s, b, h] BF16) to the sequence slices; its gradient
    is all-gathered in FP8 (``fmt``) and reaches the linear's backward as an ``Fp8Tensor``."""
    return _ReduceScatterFp8Grad.apply(out, group, fmt)


def gather_fp8_from_sequence_parallel(x: torch.Tensor, group, fmt: str = "e4m3") -> Fp8Tensor:
    """All-gather x ([s/tp, b, h], an FP8 ``Fp8Tensor`` with a group-shared scale, or plain BF16)
    into a per-tensor FP8 [s, b, h] whose transposed copy is regathered in backward."""
    return _GatherFp8.apply(x, group, fmt)
