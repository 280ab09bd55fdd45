"""FP8 copies of weights, made once per optimizer step and reused by every micro-batch.

A linear's fprop wants W (out, in) row-major and its dgrad wants W^T (in, out) row-major; one
per-tensor quantizing pass writes both. The copies are valid until the weight changes, which is
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


class Fp8WeightCache:
    """The FP8 (codes, transposed codes, scale) of one weight, refreshed when the weight changes."""

    def __init__(self, fmt: str = "e4m3"):
        self.fmt = fmt
        self._key = None
        self._value = None

    def get(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_q (out, in), w_q_t (in, out), scale): per-tensor FP8 of ``weight``."""
        key = (_generation, weight.data_ptr(), weight._version, weight.shape, weight.device)
        if key != self._key:
            with torch.no_grad():
                q, scale, q_t = quantize_per_tensor(weight.detach(), self.fmt, transpose=True, check_finite=False)
            self._key, self._value = key, (q, q_t, scale)
        return self._value

    def clear(self) -> None:
        self._key = self._value = None
