"""Memory accounting: what the weights, gradients, optimizer states and activations occupy.

On a GPU the caching allocator is the truth: activation memory is what is allocated after the
forward minus before (minus the output), and peak is ``max_memory_allocated``. A CPU has no
allocator statistics, so there activations are the bytes of the tensors autograd saves for
backward (distinct storages, parameters and inputs excluded; ``SavedTensors``), and the peak is
the sum of the parts. Every result says which (``memory_source``).

What is held between steps is counted from the tensors themselves on either device, in parts
(``coat_megatron.memory.static_parts``).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

from coat_megatron.memory import _inner_tensors, _plain, _storage_key, static_parts, tensor_bytes

__all__ = ["MIB", "SavedTensors", "static_parts", "tensor_bytes"]

MIB = 2**20


class SavedTensors:
    """Counts the bytes autograd saves for backward inside the ``with`` block: distinct storages,
    those of ``exclude`` (parameters, inputs) left out.

        with SavedTensors(exclude=params) as saved:
            out = model(x)
        saved.bytes
    """

    def __init__(self, exclude=()):
        self._exclude = {_storage_key(t) for t in exclude if _plain(t)}
        self._seen: dict[tuple[int, int], int] = {}
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        inner = [t] if _plain(t) else _inner_tensors(t)
        if not inner:  # a wrapper we cannot see into: its logical size
            self._seen[(id(t), 0)] = tensor_bytes(t)
        for p in inner:
            key = _storage_key(p)
            if key not in self._exclude:
                self._seen[key] = key[1]
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
