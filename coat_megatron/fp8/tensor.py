"""Fp8Tensor: the FP8 activation that COAT modules hand each other inside a transformer layer.

It looks like a BF16 tensor of the logical shape to autograd and to Megatron (shape, dtype,
device), and holds instead

* ``data``: the FP8 codes, logical shape;
* ``scale``: a 0-d FP32 scale (per-tensor granularity) or FP32 scales of shape
  ``shape[:-1] + (N // G,)`` (1xG granularity, ``group_size`` = G);
* for per-tensor GEMM inputs, the transposed codes ``(N, R)`` that the wgrad GEMM of the consuming
  linear needs, either written by the producer (``transposed``) or recomputable bit-exactly from
  what the producer saved anyway (``transposed_fn(rows, chunks=1)``, e.g. the SwiGLU output from
  its saved input: the ``(N, len(rows))`` transpose of the rows ``rows`` (a slice) of the ``(R, N)``
  matrix, all of them by default; with ``chunks`` = n, each of n equal blocks of those rows
  transposed on its own, ``(n, N, len(rows) / n)``: what a sequence-parallel linear's per-chunk
  wgrad GEMMs take);
* optionally ``handoff``: the ``AmaxHandoff`` between this tensor's producer and its consumer, the
  amaxes that each finds in its own pass for the other (fc1 finds SwiGLU's output amax; SwiGLU's
  backward finds dh's amax for fc1's), so that the one quantizing per tensor skips an amax pass.

Gradients that flow back to an Fp8Tensor are plain BF16 tensors. An op not in the table below
dequantizes its Fp8Tensor arguments, runs in high precision, and warns once per op: the result is
correct, but the memory saving of FP8 is lost at that point.

Handled ops (``HANDLED_OPS``): detach, alias (autograd bookkeeping); view / _unsafe_view that keep
the last dimension (a per-tensor transposed copy stays valid); clone; empty_like, zeros_like,
ones_like, full_like (they read no values: plain tensors); _to_copy (an explicit request for a
high-precision copy: dequantized without a warning).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch.utils._pytree import tree_map

from coat_kernels import dequantize_per_group, dequantize_per_tensor

from .handoff import AmaxHandoff

aten = torch.ops.aten


class Fp8Tensor(torch.Tensor):
    data_fp8: torch.Tensor
    scale: torch.Tensor
    group_size: int | None
    transposed: torch.Tensor | None
    transposed_fn: Callable[[], torch.Tensor] | None
    handoff: AmaxHandoff | None

    @staticmethod
    def __new__(
        cls,
        data,
        scale,
        *,
        group_size=None,
        transposed=None,
        transposed_fn=None,
        handoff=None,
        dtype=torch.bfloat16,
    ):
        if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"Fp8Tensor data must be FP8 codes, got {data.dtype}")
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )
        self.data_fp8 = data
        self.scale = scale
        self.group_size = group_size
        self.transposed = transposed
        self.transposed_fn = transposed_fn
        self.handoff = handoff
        return self

    @property
    def granularity(self) -> str:
        return "tensor" if self.group_size is None else f"1x{self.group_size}"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.group_size is None:
            return dequantize_per_tensor(self.data_fp8, self.scale, dtype)
        return dequantize_per_group(self.data_fp8, self.scale, self.group_size, dtype)

    def transposed_codes(self, rows: slice = slice(None)) -> torch.Tensor:
        """The (N, R') row-major transpose of the FP8 codes of ``rows`` of the (R, N) matrix (per-tensor
        granularity; R' = R by default), recomputed, or stored (a part of it copied out)."""
        if self.transposed is not None:
            return self.transposed if rows == slice(None) else self.transposed[:, rows].contiguous()
        if self.transposed_fn is not None:
            return self.transposed_fn(rows)
        raise ValueError("this Fp8Tensor carries no transposed copy")

    def _rewrap(self, data, scale=None):
        return Fp8Tensor(
            data,
            self.scale if scale is None else scale,
            group_size=self.group_size,
            transposed=self.transposed,
            transposed_fn=self.transposed_fn,
            handoff=self.handoff,
            dtype=self.dtype,
        )

    def __repr__(self):
        return (
            f"Fp8Tensor(shape={tuple(self.shape)}, {self.data_fp8.dtype}, granularity={self.granularity}, "
            f"transposed={'stored' if self.transposed is not None else 'recomputed' if self.transposed_fn else 'none'})"
        )

    def __tensor_flatten__(self):
        names = ["data_fp8", "scale"] + (["transposed"] if self.transposed is not None else [])
        return names, {"group_size": self.group_size, "dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8Tensor(
            inner["data_fp8"],
            inner["scale"],
            group_size=meta["group_size"],
            transposed=inner.get("transposed"),
            dtype=meta["dtype"],
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = HANDLED_OPS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        _warn_once(func)
        return func(*tree_map(_dequantize_arg, args), **tree_map(_dequantize_arg, kwargs))


def _dequantize_arg(x):
    return x.dequantize() if isinstance(x, Fp8Tensor) else x


_WARNED: set[str] = set()


def _warn_once(func) -> None:
    name = str(func)
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"{name} is not handled by Fp8Tensor: its FP8 input is dequantized to run it (correct, but that "
            f"activation's FP8 memory saving is lost here)",
            stacklevel=3,
        )


def _alias(x, *args, **kwargs):
    return x._rewrap(x.data_fp8)


def _view(x, size, *args, **kwargs):
    size = list(size)
    if -1 in size:
        known = 1
        for s in size:
            known *= s if s != -1 else 1
        size[size.index(-1)] = x.numel() // max(known, 1)
    if not size or size[-1] != x.shape[-1]:
        return NotImplemented  # regrouping the last dim would invalidate the scales / transposed copy
    data = x.data_fp8.view(size)
    scale = x.scale if x.group_size is None else x.scale.view(*size[:-1], x.scale.shape[-1])
    return x._rewrap(data, scale)


def _clone(x, *args, **kwargs):
    transposed = x.transposed.clone() if x.transposed is not None else None
    out = Fp8Tensor(x.data_fp8.clone(), x.scale.clone(), group_size=x.group_size, transposed=transposed, dtype=x.dtype)
    out.transposed_fn = x.transposed_fn if transposed is None else None
    return out


def _like(func):
    def plain(x, *args, **kwargs):
        if kwargs.get("device") is None:
            kwargs["device"] = x.device
        return func(torch.empty(x.shape, dtype=x.dtype, device="meta"), *args, **kwargs)

    return plain


def _to_copy(x, *args, **kwargs):
    dtype = kwargs.pop("dtype", None) or x.dtype
    return aten._to_copy.default(x.dequantize(torch.float32), *args, dtype=dtype, **kwargs)


HANDLED_OPS = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.clone.default: _clone,
    aten.empty_like.default: _like(aten.empty_like.default),
    aten.zeros_like.default: _like(aten.zeros_like.default),
    aten.ones_like.default: _like(aten.ones_like.default),
    aten.full_like.default: _like(aten.full_like.default),
    aten._to_copy.default: _to_copy,
}
