"""What a training run holds between steps, counted from the tensors themselves, by part.

``static_parts`` gives the bytes of: weights (the model's BF16 parameters), FP8 weight copies
(COAT's per-linear caches), gradients (DDP's buffers: FP32, or BF16 with
``grad_reduce_in_fp32=False``), master weights (FP32 main parameters, TE FusedAdam's master
params or remainders, COAT's split-master low words) and optimizer states (Adam moments in
whatever format: FP32, TE's FP8 tensors with their scales, COAT's codes and per-group metadata).
A tensor that shares storage with the model's parameters (COAT's split masters step the BF16
shards in place) is the weights' and counts once. Divided by the parameter count they are the
bytes per parameter a recipe costs between steps.
"""

from __future__ import annotations

import torch


def is_plain_tensor(t: torch.Tensor) -> bool:
    """True for a ``torch.Tensor`` or ``nn.Parameter`` that holds its own data (no wrapper subclass
    such as TE's Float8Tensor or COAT's Fp8Tensor, whose bytes sit in the tensors inside it)."""
    return type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds, looking inside wrapper subclasses (TE's Float8Tensor, COAT's
    Fp8Tensor) at the tensors they carry; an unknown wrapper counts its logical size."""
    if is_plain_tensor(t):
        return t.numel() * t.element_size()
    inner = inner_tensors(t)
    return sum(p.numel() * p.element_size() for p in inner) if inner else t.numel() * t.element_size()


# where tensor subclasses without __tensor_flatten__ keep their data (TE's FP8 tensors)
_WRAPPED = (
    "_data",
    "_transpose",
    "_scale_inv",
    "_rowwise_data",
    "_columnwise_data",
    "_rowwise_scale_inv",
    "_columnwise_scale_inv",
)


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside a wrapper subclass, recursively (``__tensor_flatten__``'s, or TE's
    data, transpose and scale attributes); [] when it is not one we can see into."""
    flatten = getattr(t, "__tensor_flatten__", None)
    names = flatten()[0] if flatten is not None else _WRAPPED
    out = []
    for name in names:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            out += [inner] if is_plain_tensor(inner) else inner_tensors(inner)
    return out


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage under a plain tensor: equal for views of one storage."""
    return (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(tensor_bytes(p) for p in model.parameters())


def gradient_bytes(model) -> int:
    """DDP's gradient buffers (FP32 with grad_reduce_in_fp32, else the parameters' dtype)."""
    buffers = list(getattr(model, "buffers", [])) + list(getattr(model, "expert_parallel_buffers", []))
    return sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)


# optimizer state keys that hold (part of) a master weight, not a moment
MASTER_KEYS = ("master_param", "master_low")


def optimizer_parts(optimizers: list, model: torch.nn.Module | None = None) -> dict[str, int]:
    """{"master_weights": ..., "states": ...}: bytes the inner optimizers of Megatron's distributed
    optimizers hold. Master weights: their parameters (FP32 main shards) and master-weight state
    (TE's ``master_param``, COAT's ``master_low``); states: everything else per parameter (moments,
    TE's FP8 scales, COAT's codes and metadata). Each storage counts once; storage shared with
    ``model``'s parameters counts nowhere (it is the weights')."""
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
    seen: dict[tuple, tuple[str, int]] = {}

    def add(t, part):
        inner = [t] if is_plain_tensor(t) else inner_tensors(t)
        if not inner:  # a wrapper we cannot see into: its logical size, once
            seen.setdefault((id(t),), (part, tensor_bytes(t)))
        for p in inner:
            if p.untyped_storage().data_ptr() in model_storages:
                continue
            seen.setdefault((*storage_key(p), p.data_ptr(), p.numel()), (part, tensor_bytes(p)))

    for opt in optimizers:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                add(p, "master_weights")
        for state in inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    add(value, "master_weights" if key in MASTER_KEYS else "states")
        for scales in getattr(inner, "_scales", {}).values():  # TE FusedAdam's FP8 state scales
            for value in scales.values() if isinstance(scales, dict) else []:
                if isinstance(value, torch.Tensor):
                    add(value, "states")
    out = {"master_weights": 0, "states": 0}
    for part, nbytes in seen.values():
        out[part] += nbytes
    return out


def optimizer_bytes(optimizers: list, model: torch.nn.Module | None = None) -> int:
    """Master weights + optimizer states (``optimizer_parts``)."""
    return sum(optimizer_parts(optimizers, model).values())


def fp8_copy_bytes(model: torch.nn.Module) -> int:
    """COAT's FP8 weight copies (each linear's ``Fp8WeightCache``: codes, transposed codes where
    kept, scale). TE keeps its FP8 weights inside its modules' workspaces, which are not counted
    here (on a GPU they are in ``other``)."""
    return sum(m.weight_cache.nbytes for m in model.modules() if hasattr(getattr(m, "weight_cache", None), "nbytes"))


def static_parts(chunks, optimizers: list) -> dict[str, int]:
    """Bytes held between steps, by part (see the module docstring), of a model or of a rank's
    list of model chunks (its virtual pipeline stages): the chunks' weights, FP8 copies and
    gradient buffers summed, the optimizers' parts counted once. A storage the optimizer shares
    with any chunk's parameters is the weights' (counting against the first chunk alone made the
    later chunks' BF16 weights master weights)."""
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    parts = {
        "weights": sum(weights_bytes(c) for c in chunks),
        "fp8_copies": sum(fp8_copy_bytes(c) for c in chunks),
        "grads": sum(gradient_bytes(c) for c in chunks),
    }
    return parts | optimizer_parts(optimizers, torch.nn.ModuleList(chunks))
