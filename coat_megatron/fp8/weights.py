"""FP8 copies of weights, made once per optimizer step and reused by every micro-batch.

A linear's fprop wants W (out, in) row-major and its dgrad wants W^T (in, out) row-major; one
per-tensor quantizing pass writes both. With ``keep_transpose=False`` the cache keeps W's codes
only (1 byte per parameter instead of 2) and the dgrad transposes them when it runs
(``coat_kernels.transpose_codes``, one tiled byte pass): one scale serves both layouts, so the
codes are the same bytes. With ``keep_codes=False`` it keeps W's amax only (a few bytes per
weight): the fprop quantizes W with it and the dgrad quantizes W^T with it, from the weight
itself, in every micro-batch; the same amax makes the same scale and codes, so the results are
bit-identical to the kept copies' at 1 byte per parameter less, for one more pass over the weight
in each forward and backward.

The copies live in fixed buffers, updated in place (``coat_kernels.refresh``), so that a CUDA
graph that reads them stays valid across optimizer steps. They are remade when the weight
changes, which is detected without any help from the training loop:

* every ``torch.optim.Optimizer.step()`` (Megatron's optimizers step a torch optimizer inside)
  bumps a weight generation, both on the host and, in place, in one int64 scalar per device.
  Eagerly, the host compares generations and launches the refresh only when its copy is stale;
  inside a CUDA graph capture (Megatron's ``cuda_graph_impl`` "local" or "full_iteration") the
  refresh is recorded and the *device* compares its own scalars at every replay, so a replayed
  micro-batch refreshes the copy exactly when an optimizer step came before it, whatever way the
  new values reached the model weights (Megatron writes them through its parameter buffers, or
  all-gathers them later under the distributed optimizer: the refresh reads the weight when the
  layer runs, after Megatron's pre-forward hooks);
* eagerly, an in-place change of the weight itself (its ``_version``) or a new storage also
  invalidates; under graphs, change weights outside an optimizer step only through
  ``load_state_dict`` (the COAT modules invalidate then) or call ``invalidate_weight_caches()``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from coat_kernels.formats import fp8_format
from coat_kernels.refresh import refresh_per_tensor_amax, refresh_per_tensor_copy

_generation = 0
_device_generations: dict[torch.device, torch.Tensor] = {}


def _bump_generation(*_args, **_kwargs) -> None:
    global _generation
    _generation += 1
    for counter in _device_generations.values():
        counter.add_(1)


register_optimizer_step_post_hook(_bump_generation)


def invalidate_weight_caches() -> None:
    """Mark every FP8 weight copy stale (for weights changed outside an optimizer step)."""
    _bump_generation()


def device_generation(device: torch.device) -> torch.Tensor:
    """The int64 scalar on ``device`` that every weight change bumps (in place; fixed address)."""
    counter = _device_generations.get(device)
    if counter is None:
        counter = _device_generations[device] = torch.zeros((), dtype=torch.int64, device=device)
    return counter


class _Buffers(NamedTuple):
    q: torch.Tensor | None
    q_t: torch.Tensor | None
    scale: torch.Tensor | None
    amax: torch.Tensor  # work scalar of the refresh (0 between refreshes)
    kept_amax: torch.Tensor | None  # keep_codes=False: the weight's amax
    generation: torch.Tensor
    shape: torch.Size
    device: torch.device


class Fp8WeightCache:
    """The FP8 (codes, transposed codes, scale) of one weight, refreshed when the weight changes.

    ``get`` returns the same tensors every time (their contents change in place).
    ``keep_transpose=False``: the transposed codes are not kept (``get`` returns None for them;
    take them from ``coat_kernels.transpose_codes`` when needed). ``keep_codes=False``: no codes
    are kept; ``amax`` returns the weight's amax instead, from which
    ``quantize_per_tensor(weight, fmt, amax=...)`` makes the codes ``get`` would have returned."""

    def __init__(self, fmt: str = "e4m3", keep_transpose: bool = True, keep_codes: bool = True):
        if keep_transpose and not keep_codes:
            raise ValueError(
                "keep_transpose=True keeps W^T's codes beside W's, and keep_codes=False keeps no codes: "
                "use keep_codes=False with keep_transpose=False (CoatConfig: cache_weight_transpose=False)"
            )
        self.fmt = fmt
        self.keep_transpose = keep_transpose
        self.keep_codes = keep_codes
        self._key = None
        self._buffers: _Buffers | None = None

    @torch.inference_mode(False)  # first made in an inference-mode forward, they still serve training
    def _allocate(self, weight: torch.Tensor) -> _Buffers:
        dtype, dev = fp8_format(self.fmt).dtype, weight.device
        n_cols = weight.shape[-1] if weight.dim() else 1
        codes = self.keep_codes
        return _Buffers(
            q=torch.empty(weight.shape, dtype=dtype, device=dev) if codes else None,
            q_t=torch.empty((n_cols, weight.numel() // max(n_cols, 1)), dtype=dtype, device=dev)
            if self.keep_transpose
            else None,
            # without codes too: the scale each forward's quantizing pass writes (``amax_and_scale``)
            scale=torch.ones((), dtype=torch.float32, device=dev),
            amax=torch.zeros((), dtype=torch.float32, device=dev),
            kept_amax=None if codes else torch.zeros((), dtype=torch.float32, device=dev),
            generation=torch.full((), -1, dtype=torch.int64, device=dev),
            shape=weight.shape,
            device=dev,
        )

    def _refreshed(self, weight: torch.Tensor) -> _Buffers:
        w = weight.detach()
        b = self._buffers
        if b is None or b.shape != w.shape or b.device != w.device:
            b = self._buffers = self._allocate(w)
            self._key = None
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            # recorded, not run: each replay refreshes the copy iff the device's generation moved
            self._refresh(w, b, force=False)
        else:
            key = (_generation, w.data_ptr(), weight._version)
            if key != self._key:
                self._refresh(w, b, force=True)
                self._key = key
        return b

    def _refresh(self, w: torch.Tensor, b: _Buffers, force: bool) -> None:
        current = device_generation(w.device)
        if self.keep_codes:
            refresh_per_tensor_copy(
                w, b.q, b.scale, b.amax, q_t=b.q_t, generation=b.generation, current=current, force=force
            )
        else:
            refresh_per_tensor_amax(w, b.kept_amax, b.amax, generation=b.generation, current=current, force=force)

    def get(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(w_q (out, in), w_q_t (in, out) or None, scale): per-tensor FP8 of ``weight``."""
        if not self.keep_codes:
            raise RuntimeError("this cache keeps no codes (keep_codes=False): quantize with its amax(weight)")
        b = self._refreshed(weight)
        return b.q, b.q_t, b.scale

    def amax_and_scale(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``amax(weight)``, the 0-d FP32 buffer a forward that quantizes W from it writes W's scale into,
        which its backward reads: the same value in every micro-batch of a step) (``keep_codes=False``)."""
        if self.keep_codes:
            raise RuntimeError("this cache keeps the codes (keep_codes=True): take them from get(weight)")
        b = self._refreshed(weight)
        return b.kept_amax, b.scale

    def amax(self, weight: torch.Tensor) -> torch.Tensor:
        """max |weight| as a 0-d FP32 tensor, remade when the weight changes (``keep_codes=False``)."""
        if self.keep_codes:
            raise RuntimeError("this cache keeps the codes (keep_codes=True): take them from get(weight)")
        return self._refreshed(weight).kept_amax

    @property
    def nbytes(self) -> int:
        """Bytes held for this weight: its FP8 copies, scale and bookkeeping scalars."""
        if self._buffers is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._buffers if isinstance(t, torch.Tensor))

    def clear(self) -> None:
        self._key = self._buffers = None


def weight_cache_for(config) -> Fp8WeightCache:
    """The weight cache a ``CoatConfig`` asks for (``cache_weight``, ``cache_weight_transpose``)."""
    return Fp8WeightCache(
        config.weight_format, keep_transpose=config.cache_weight_transpose, keep_codes=config.cache_weight
    )
