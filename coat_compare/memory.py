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

from coat_megatron.memory import (
    fp8_copy_bytes,
    gradient_bytes,
    optimizer_parts,
    static_parts,
    tensor_bytes,
    weights_bytes,
)
from coat_megatron.memory import inner_tensors as _inner_tensors
from coat_megatron.memory import is_plain_tensor as _plain
from coat_megatron.memory import storage_key as _storage_key

__all__ = [
    "MIB",
    "SavedTensors",
    "fp8_copy_bytes",
    "gradient_bytes",
    "optimizer_parts",
    "static_parts",
    "tensor_bytes",
    "weights_bytes",
]

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


def expected_bytes_per_param(mode) -> dict[str, float]:
    """What ``mode`` holds between steps per parameter, by part, from its recipe alone (before
    anything is built): BF16 weights; COAT's FP8 weight copies (W where kept, and W^T where cached; an upper
    bound: embeddings have none); gradient buffers; master weights; Adam's moments. TE's own FP8
    weight copies are not counted."""
    coat = mode.coat_config()
    uses_coat_layers = mode.spec == "coat"
    fp8_copies = (coat.cache_weight + coat.cache_weight_transpose) * 1.0 if uses_coat_layers else 0.0
    if mode.coat_optimizer:
        masters, states = (2.0 if coat.master_weights == "split" else 4.0), 2.0 + 6 * 4 / coat.optimizer_group_size
    else:
        masters, states = 4.0, (2.0 if mode.precision_aware else 8.0)
    return {"weights": 2.0, "fp8_copies": fp8_copies, "grads": 4.0 if mode.grad_fp32 else 2.0,
            "master_weights": masters, "states": states}  # fmt: skip


def why_it_does_not_fit(mode, params: int, gpu_bytes: int, *, tp: int = 1, pp: int = 1, dp: int = 1) -> str:
    """One sentence for an out-of-memory row: what each GPU holds between steps after the layout's
    sharding (``params`` of the whole model; weights and gradient buffers split over TP x PP, master
    weights and optimizer states over TP x PP x DP by the distributed optimizer), its largest part,
    and what COAT's default would hold instead."""
    from .modes import MODES

    def per_gpu(parts: dict[str, float]) -> dict[str, float]:
        sharded = ("master_weights", "states")
        return {k: v / (tp * pp * (dp if k in sharded else 1)) for k, v in parts.items()}

    parts = per_gpu(expected_bytes_per_param(mode))
    total = sum(parts.values())
    largest = max(parts, key=parts.get)
    held = total * params
    names = {"fp8_copies": "FP8 weight copies", "master_weights": "master weights", "states": "optimizer states"}
    lean_total = sum(per_gpu(expected_bytes_per_param(MODES["coat"])).values())  # COAT's default: its memory mode
    advice = f"; coat holds {lean_total:.1f} B/param" if lean_total < total else ""
    layout = "" if tp * pp * dp == 1 else f" at TP {tp} x PP {pp} x DP {dp}"
    return (
        f"{mode.name} holds about {held / 2**30:.0f} GiB per GPU between steps{layout} ({total:.1f} B/param x "
        f"{params / 1e9:.2f} B params) of this GPU's {gpu_bytes / 2**30:.0f} GiB, the most in "
        f"{names.get(largest, largest)} ({parts[largest]:.1f} B/param), before activations{advice}"
    )
