"""Named scratch buffers, reused from call to call instead of allocated each time.

Eager COAT issues about 80 allocations per layer and micro-batch at TP 2 + SP, most of them outputs
that never leave the function that makes them: the gathered codes, the reduce-scatter's partial sums,
W's and W^T's codes in the memory recipe, the backward's transposed operands, amax tiles. Each goes
through the caching allocator on the host. Here each such call site names a buffer; ``empty(shape,
dtype, device, name)`` returns a view of the ``(device, name)`` buffer, grown when a request is
larger than it, so that after the first micro-batch none of them allocates (Megatron's
``GlobalMemoryBuffer`` does the same for its own sequence-parallel all-gathers).

The rule that keeps it correct: a name is asked for again only after the tensor it last gave is
dead, which holds for buffers written and read within one function on one stream (every use here:
the collectives are blocking, so the compute stream waits for them before anything writes the buffer
again). A tensor that a layer keeps for its backward, or hands to another module, never comes from
here. Each call site has its own name, so buffers in use at the same time never share memory.

While a CUDA graph is being captured every request allocates as ``torch.empty`` does (a graph's
tensors come from its private pool, and replays allocate nothing anyway), so graphed layers are
unaffected. ``CoatConfig(scratch_buffers=False)`` (``--coat-scratch-buffers off``) makes every call
site allocate as before: the same values, bit for bit.

The buffers stay allocated: their sum is what one layer's largest transients take at once at most,
e.g. a few hundred MB for a Llama-2-7B layer at TP 2 and 8192 tokens; ``nbytes()`` reports it and
``release()`` frees them (the next requests allocate them again).
"""

from __future__ import annotations

import functools
import math

import torch

_buffers: dict[tuple[torch.device, str], torch.Tensor] = {}
# (name, shape, dtype, device) -> the view handed out last time: a request seen before costs one dict
# lookup (about 1.5 us on an H200 host, against 3-5 us for torch.empty from the caching allocator and 8 us
# for making the view anew), emptied for a name whose buffer grows
_views: dict[tuple, torch.Tensor] = {}
_MAX_VIEWS = 4096  # distinct requests remembered (a run has a few dozen); past it they are forgotten
_ALIGN = 16  # bytes: cuBLASLt takes FP8 operands and scale pointers at 16-byte aligned addresses only


def name(on: bool, call_site: str) -> str | None:
    """``call_site`` where scratch buffers are on (``CoatConfig.scratch_buffers``), else None (allocate)."""
    return call_site if on else None


def sub(scratch: str | None, part: str) -> str | None:
    """The name of one of several outputs of a call site (``"ag"`` -> ``"ag.q"``), None where it allocates."""
    return None if scratch is None else f"{scratch}.{part}"


@functools.cache
def _cuda() -> bool:
    return torch.cuda.is_available()


def _capturing() -> bool:
    return _cuda() and torch.cuda.is_current_stream_capturing()


def empty(shape, dtype: torch.dtype, device, scratch: str | None = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, or, with a ``scratch`` name, a view of that
    reused buffer (outside CUDA graph capture). Its contents are whatever was last written there."""
    if scratch is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if _capturing():  # a graph's tensors come from its private pool
        return torch.empty(shape, dtype=dtype, device=device)
    key = (scratch, shape if not isinstance(shape, list) else tuple(shape), dtype, device)
    view = _views.get(key)
    if view is None:
        view = _view(scratch, shape, dtype, torch.device(device))
        if len(_views) >= _MAX_VIEWS:
            _views.clear()
        _views[key] = view
    return view


def _view(scratch: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one buffer
        device = torch.device("cuda", torch.cuda.current_device())
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    key = (device, scratch)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < nbytes:
        # grown to the request, rounded up; the views of the old buffer are forgotten so that it is freed
        for k in [k for k in _views if k[0] == scratch]:
            del _views[k]
        _buffers.pop(key, None)
        buf = _buffers[key] = torch.empty(max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN), dtype=torch.uint8, device=device)
    return buf[:nbytes].view(dtype).view(shape)


def nbytes(device=None) -> int:
    """Bytes the scratch buffers hold (on ``device``, or on every device)."""
    return sum(b.numel() for (d, _), b in _buffers.items() if device is None or d == torch.device(device))


def release() -> None:
    """Free every scratch buffer (e.g. before a memory-hungry phase); later requests allocate them again."""
    _views.clear()
    _buffers.clear()
