"""Megatron-Core on a CPU: redirect the places where megatron-core 0.19 hard-codes CUDA.

The tests (gloo, many processes) and the CPU main job run real Megatron-Core on machines without
a GPU. With ``use_cpu_initialization=True``, ``gradient_accumulation_fusion=False``, all fusions
off and dropout 0, Megatron computes on CPU tensors; what still fails is a short list of CUDA
hard-codes. ``megatron_on_cpu()`` redirects exactly those, and nothing else:

==========================================  ==================================================
Megatron does                               on the CPU it gets
==========================================  ==================================================
``torch.cuda.current_device()`` as the      ``torch.device("cpu")``
device of buffers (RoPE, attention masks,
SP all-gather, pipeline p2p, optimizer)
``device="cuda"`` in factory calls          a ``TorchFunctionMode`` that makes the device the
(grad scaler, schedules' token counts,      CPU in any torch call's ``device=`` keyword
grad-norm helpers, causal masks)            (positional devices and ``.cuda()`` are left alone:
                                            Megatron's CPU paths do not use them)
the CUDA RNG tracker (attention always      ``torch.cuda.get_rng_state`` / ``manual_seed`` and
forks it, even at dropout 0)                Megatron's ``_set_cuda_rng_state`` act on the
                                            CPU default generator
``param.type() == "torch.cuda.*Tensor"``    no-argument ``Tensor.type()`` answers with the CUDA
(DistributedOptimizer, the fp16/bf16        type name (``torch.cuda.FloatTensor``), which is
optimizer, clip_grad_by_total_norm_fp32)    how Megatron dispatches on the dtype
``torch.cuda.current_stream()`` in          a stream whose waits do nothing
``start_grad_sync`` (0.19)
``torch.cuda.synchronize()`` (pipeline      nothing to wait for: CPU ops are synchronous
p2p, the dist-checkpoint writer)
the gradient norm for clipping (Megatron's  an FP32-accumulating norm, as the CUDA kernels; Megatron's
CPU stand-in for the multi-tensor L2 norm)  stand-in returns BF16 gradients' norms in BF16
==========================================  ==================================================

The CPU default generator plays the CUDA generator, so that dropout on CPU tensors draws from the
tracker's streams (per TP rank inside ``fork()``). With dropout > 0, Megatron's ``fork()`` then
logs "CPU RNG state changed within GPU RNG context" on every fork: expected here, not a fault.

Use it around everything that builds or runs Megatron objects::

    with megatron_on_cpu():
        initialize_model_parallel(...)
        model_parallel_cuda_manual_seed(seed)
        ...

Each redirect was found by running GPTModel (TP/SP/PP), DDP + DistributedOptimizer and dist
checkpointing on gloo with megatron-core 0.19.2; other versions move these call sites, so entering
the context checks the version and refuses others. With CUDA present it changes nothing.
The ``TorchFunctionMode`` is per thread: enter the context in the thread that runs Megatron.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from .version import SUPPORTED_MEGATRON, megatron_core_version, require_megatron_core  # noqa: F401 (re-exported)

_CPU = torch.device("cpu")


def check_megatron_version() -> None:
    """Raise if the installed megatron-core is not one whose CUDA hard-codes this module knows."""
    require_megatron_core(__name__)


def _names_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Runs every torch call with a CUDA ``device=`` argument on the CPU instead, and answers a
    no-argument ``Tensor.type()`` with the CUDA type name (Megatron compares those strings to tell
    FP32 from BF16/FP16 parameters and rejects anything else)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # a nested mode may have answered already
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _CpuStream:
    """What ``torch.cuda.current_stream()`` returns on the CPU: every op has already finished."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_get_rng_state(device="cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _fp32_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Megatron's CPU stand-in for the fused multi-tensor L2 norm, accumulating in FP32 as the CUDA
    kernels (apex's amp_C, TE's) do; Megatron's own stand-in returns each BF16 tensor's norm in
    BF16 (3 significant digits), which made gradient clipping of BF16 gradients coarser on a CPU
    than on a GPU."""
    norms = [t.float().norm() for tensors in tensor_lists for t in tensors]
    total = torch.stack(norms).norm() if norms else torch.zeros(())
    return total.reshape(1), None


def _redirects() -> list[tuple[object, str, object]]:
    """(owner, attribute, CPU replacement) for every attribute patched."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.tensor_parallel.random as mcore_random

    return [
        # The gradient norm of BF16 gradients (split master weights, --grad-reduce-in-bf16) in FP32.
        (clip_grads, "l2_norm_impl", _fp32_l2_norm),
        # Megatron allocates its buffers with device=torch.cuda.current_device().
        (torch.cuda, "current_device", lambda: _CPU),
        # The CUDA RNG tracker: model_parallel_cuda_manual_seed seeds it, and attention forks it on
        # every forward even at dropout 0. Without CUDA, torch.cuda.manual_seed is queued and never
        # runs, get_rng_state raises, and _set_cuda_rng_state (torch's lazy call) silently does
        # nothing. The CPU default generator takes the CUDA generator's role, so that dropout (which
        # draws from it on CPU tensors) gets the tracker's per-TP-rank streams. Megatron reaches
        # get_rng_state through both torch.cuda and torch.cuda.random.
        (torch.cuda, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda.random, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda, "manual_seed", torch.manual_seed),
        (mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state),
        # 0.19's start_grad_sync waits on the current stream for CUDA-graph events.
        (torch.cuda, "current_stream", lambda device=None: _CpuStream()),
        # Pipeline p2p (batched isend/irecv) and the dist-checkpoint writer synchronize the device.
        (torch.cuda, "synchronize", lambda device=None: None),
    ]


_lock = threading.Lock()
_depth = 0
_saved: list[tuple[object, str, object]] = []


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Run megatron-core 0.19 on the CPU inside this context (see the module docstring).

    Does nothing when CUDA is available. Nested or repeated entries are no-ops; leaving the
    outermost one restores every patched attribute. The device mode is entered on each entry (it
    lives on the calling thread's mode stack).
    """
    global _depth
    if torch.cuda.is_available():
        yield
        return
    with _lock:
        if _depth == 0:
            check_megatron_version()
            redirects = _redirects()
            _saved[:] = [(owner, name, getattr(owner, name)) for owner, name, _ in redirects]
            for owner, name, replacement in redirects:
                setattr(owner, name, replacement)
        _depth += 1
    try:
        with CudaToCpuMode():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for owner, name, original in reversed(_saved):
                    setattr(owner, name, original)
                _saved.clear()
