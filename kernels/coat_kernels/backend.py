"""The one place that decides whether a kernel call runs Triton or its torch reference.

``backend="auto"`` (the default of every public dispatcher) runs Triton for CUDA tensors and the
torch reference otherwise. ``"triton"`` forces Triton: on a CPU tensor that needs the Triton
interpreter (``TRITON_INTERPRET=1`` set before the kernels are imported), which is how the CPU
tests run the real kernels. ``"reference"`` forces the torch reference on any device.

Two environment variables are read once, when this module is imported (debugging switches, listed
in docs/user-guide.md): ``COAT_KERNELS_BACKEND`` (auto, triton, reference) replaces the default
"auto" of every call, and Triton's own ``TRITON_INTERPRET`` says whether a CPU tensor can run Triton
(Triton reads it when it compiles the kernels, which are imported after this module).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "reference")

_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# None: not set, "auto" calls pick by device (the hot path below tests this constant, not the environment)
_OVERRIDE = os.environ.get("COAT_KERNELS_BACKEND")
if _OVERRIDE is not None and _OVERRIDE not in BACKENDS:
    raise ValueError(f"COAT_KERNELS_BACKEND={_OVERRIDE!r}: use one of {', '.join(BACKENDS)}, or unset it")


def interpreter_enabled() -> bool:
    """Whether Triton kernels run under Triton's interpreter (``TRITON_INTERPRET`` at import)."""
    return _INTERPRETER


_FP8_DEVICES: set[int] = set()  # CUDA devices already checked for FP8 support (once per process)


def use_triton(x: torch.Tensor, backend: str = "auto") -> bool:
    """True when the call on ``x`` should launch the Triton kernel. On the hot path (CUDA, "auto",
    a device already checked) it costs two attribute reads and a set lookup."""
    if backend == "auto":
        if x.is_cuda and x.device.index in _FP8_DEVICES and _OVERRIDE is None:
            return True
        backend = _OVERRIDE or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "reference":
        return False
    if x.is_cuda:
        if x.device.index not in _FP8_DEVICES:
            major, minor = torch.cuda.get_device_capability(x.device)
            if (major, minor) < (8, 9):
                raise RuntimeError(
                    f"FP8 kernels need a GPU with compute capability >= 8.9 (Ada or Hopper); "
                    f"{torch.cuda.get_device_name(x.device)} is sm_{major}{minor}. Run on an H100/H200, "
                    f"or pass backend='reference' to use the (slow) torch reference"
                )
            _FP8_DEVICES.add(x.device.index)
        return True
    if backend == "auto":
        return False
    if not interpreter_enabled():
        raise RuntimeError(
            "backend='triton' on a CPU tensor needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing coat_kernels, or use backend='reference'"
        )
    return True
