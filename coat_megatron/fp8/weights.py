"""FP8 copies of weights, made once per optimizer step and reused by every micro-batch.

A linear's fprop wants W (out, in) row-major and its dgrad wants W^T (in, out) row-major; one
per-tensor quantizing pass writes both. With ``keep_transpose=False`` the cache keeps W's codes
only (1 byte per parameter instead of 2) and the dgrad transposes them when it runs
(``transpose_codes``): one scale serves both layouts, so the codes are the same bytes. The copies are valid until the weight changes, which is
detected without any help from the training loop:

* every ``torch.optim.Optimizer.step()`` (Megatron's optimizers step a torch optimizer inside)
  bumps a global weight generation, through torch's global optimizer step hook, so copies made
  before the step are stale afterwards, whatever way the new values reach the model weights
  (Megatron writes them through its parameter buffers, which autograd's version counter of the
  parameter does not see);
* an in-place change of the weight itself (its ``_version``) or a new storage also invalidates.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from coat_kernels import quantize_per_tensor

_generation = 0


def _bump_generation(*_args, **_kwargs) -> None:
    global _generation
    _generation += 1


register_optimizer_step_post_hook(_bump_generation)


def invalidate_weight_caches() -> None:
    """Mark every FP8 weight copy stale (for weights changed outside an optimizer step)."""
    _bump_generation()


def transpose_codes(q: torch.Tensor) -> torch.Tensor:
    """The per-tensor FP8 codes of W^T (row-major) from those of W: a byte transpose."""
    return q.view(torch.uint8).t().contiguous().view(q.dtype)


class Fp8WeightCache:
    """The FP8 (codes, transposed codes, scale) of one weight, refreshed when the weight changes.

    ``keep_transpose=False``: the transposed codes are not kept (``get`` returns None for them;
    take them from ``transpose_codes`` when needed)."""

    def __init__(self, fmt: str = "e4m3", keep_transpose: bool = True):
        self.fmt = fmt
        self.keep_transpose = keep_transpose
        self._key = None
        self._value = None

    def get(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(w_q (out, in), w_q_t (in, out) or None, scale): per-tensor FP8 of ``weight``."""
        key = (_generation, weight.data_ptr(), weight._version, weight.shape, weight.device)
        if key != self._key:
            with torch.no_grad():
                if self.keep_transpose:
                    q, scale, q_t = quantize_per_tensor(weight.detach(), self.fmt, transpose=True, check_finite=False)
                else:
                    (q, scale), q_t = quantize_per_tensor(weight.detach(), self.fmt, check_finite=False), None
            self._key, self._value = key, (q, q_t, scale)
        return self._value

    @property
    def nbytes(self) -> int:
        """Bytes of the FP8 copies held now."""
        if self._value is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._value if t is not None)

    def clear(self) -> None:
        self._key = self._value = None
