"""What a producing op and its consuming op agree on about the tensor between them.

``OutputForm``: the form in which a linear writes its output, the one its consumer wants (the
consumer declares it, as ``CoatMLP`` does for fc1 feeding SwiGLU).

``AmaxHandoff``: the amaxes the two ops hand each other across that tensor, so that the op that
quantizes per tensor skips the pass that would find its amax (group scaling: the op that writes
the values finds their amax in the same pass). One object serves both directions:

    forward   producer -> consumer   ``consumer_amax``: the amax of what the consumer will compute
                                     from the tensor (fc1 finds SwiGLU's output amax in the pass that
                                     quantizes its own output; SwiGLU quantizes for fc2 with it)
    backward  consumer -> producer   the amax of the gradient that the consumer's backward returns
                                     (SwiGLU's backward writes dh and its amax; fc1's backward
                                     quantizes dh, E5M2 per tensor, with it)

The producer makes it for one output tensor; it travels forward inside that tensor
(``Fp8Tensor.handoff``), and each of the two ops keeps it for its backward. For the backward that is
the gradient's consumer (fc1) handing its producer (SwiGLU) where to leave what it needs, in the
spirit of TransformerEngine's consumer handing its quantizer to its producer. An amax handed over
is a hint: where none arrives, the op that quantizes finds the same value itself in one more pass.
"""

from __future__ import annotations

import enum
import weakref

import torch


class OutputForm(enum.Enum):
    """The form of a linear's output y (..., N):

    * ``BF16``: a plain tensor in the input's dtype;
    * ``PER_GROUP``: a 1xG ``Fp8Tensor`` (E4M3 codes, FP32 scales (..., N // G), G = the group size);
    * ``SWIGLU_INPUT``: ``PER_GROUP`` whose ``handoff`` also carries the amax of SwiGLU's output,
      found in the same pass (fc1 feeding ``swiglu_fp8``).
    """

    BF16 = "bf16"
    PER_GROUP = "1xG"
    SWIGLU_INPUT = "swiglu"

    @classmethod
    def check(cls, value: object, name: str = "output_form") -> OutputForm:
        """``value`` itself where it is an ``OutputForm``; otherwise an error that names the valid values."""
        if isinstance(value, cls):
            return value
        valid = ", ".join(f"OutputForm.{form.name}" for form in cls)
        raise ValueError(f"{name}={value!r} is not an output form; use one of {valid} (coat_megatron.fp8.OutputForm)")


class AmaxHandoff:
    """The amaxes that a producer of a tensor and its consumer hand each other (see the module docstring).

    ``consumer_amax``: forward, the 0-d FP32 amax of what the consumer computes from the tensor, or None.
    The backward amax is bound to the gradient it was found for: ``take_grad_amax(grad)`` returns it
    only for that very tensor, unmodified since it was deposited. Autograd adds the gradients of
    several consumers in place into one of them, which would make a deposited amax stale.
    """

    __slots__ = ("consumer_amax", "_grad", "_grad_version", "_grad_amax")

    def __init__(self, consumer_amax: torch.Tensor | None = None):
        self.consumer_amax = consumer_amax
        self._grad = None
        self._grad_version = None
        self._grad_amax = None

    def deposit_grad_amax(self, grad: torch.Tensor, amax: torch.Tensor) -> None:
        """Leave the FP32 amax of ``grad`` (0-d, or one per tile of the pass that wrote it) for the
        producer's backward. The hand-off keeps no reference that would hold ``grad`` alive."""
        self._grad = weakref.ref(grad)
        self._grad_version = grad._version
        self._grad_amax = amax

    def take_grad_amax(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The amax deposited for ``grad``, or None where it was deposited for another tensor, ``grad``
        changed since, or none was. Taking it empties the hand-off."""
        deposited = self._grad() if self._grad is not None else None
        amax = self._grad_amax if deposited is grad and grad._version == self._grad_version else None
        self._grad = self._grad_version = self._grad_amax = None
        return amax


# gradients whose amax the op that wrote them found, for whichever op quantizes them next, keyed by id():
# a norm's dx (its input's gradient, residual branch included) is a BF16 tensor that carries no hand-off,
# and reaches the linear whose output it is the gradient of through Megatron's residual add, unchanged
_LOOSE_SLOTS = 8  # a backward has one or two in flight; older ones are dropped
_loose: dict[int, AmaxHandoff] = {}


def deposit_loose_grad_amax(grad: torch.Tensor, amax: torch.Tensor) -> None:
    """Leave ``amax`` (0-d FP32, max |grad|) for the op that next quantizes ``grad`` itself, whatever it is
    (``take_grad_amax`` finds it for that very tensor, unmodified since). Keeps no reference to ``grad``."""
    while len(_loose) >= _LOOSE_SLOTS:
        del _loose[next(iter(_loose))]
    handoff = _loose[id(grad)] = AmaxHandoff()
    handoff.deposit_grad_amax(grad, amax)


def take_grad_amax(handoff: AmaxHandoff | None, grad: torch.Tensor) -> torch.Tensor | None:
    """The amax deposited for ``grad``: by its consumer in the hand-off its producer made
    (``handoff.take_grad_amax(grad)``), or by the op that wrote it (``deposit_loose_grad_amax``); None where
    none was (a BF16 output with no hand-off, whose gradient no op measured)."""
    amax = handoff.take_grad_amax(grad) if handoff is not None else None
    loose = _loose.pop(id(grad), None)
    if amax is None and loose is not None:
        amax = loose.take_grad_amax(grad)  # None where id(grad) was another, now dead, tensor's
    return amax
