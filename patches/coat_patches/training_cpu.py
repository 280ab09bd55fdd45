"""``megatron.training`` (``pretrain()`` and its training loop) on a machine without a GPU.

``coat_patches.cpu.megatron_on_cpu()`` makes megatron-core's modules, schedules and optimizers run
on CPU tensors. The training loop in ``megatron.training`` assumes CUDA in a few more places,
each redirected here (found by running ``examples/pretrain_gpt.py`` and Megatron-LM's own
``pretrain_gpt.py`` under ``coat-megatron-run`` on a CPU with megatron-core 0.19.2):

=================================================  ============================================
``megatron.training`` does                         on the CPU
=================================================  ============================================
arguments: CUDA-only defaults (fused kernels,      ``validate_args`` first sets the CPU's
``--transformer-impl transformer_engine``,         settings (``CPU_ARGUMENTS``: no fusions, CPU
NCCL, weights initialised on the GPU)              initialisation, local layers, gloo)
``get_device_arch_version()`` reads the GPU's      0 (no GPU: the pre-Blackwell rules, so TP/CP
compute capability while validating arguments      ask for ``CUDA_DEVICE_MAX_CONNECTIONS=1``,
                                                   which is set: it means nothing on a CPU)
``initialize_megatron`` asserts CUDA unless        ``pretrain()`` gets ``allow_no_cuda=True``
``allow_no_cuda``
``_initialize_distributed`` calls                  the process group is made first, on gloo
``torch.cuda.set_device`` and inits the            (``--distributed-backend`` nccl needs a GPU);
process group with ``--distributed-backend``,      Megatron's own code then runs with one
and skips the model-parallel groups when           visible device, so it builds the groups
``torch.cuda.device_count()`` is 0
``_set_random_seed`` seeds the CUDA RNG tracker    the same, with one visible device (the tracker
only when a device is visible                      is what attention forks on every forward)
``set_jit_fusion_options`` warms up fused          skipped: the CPU run does not use them, and
kernels (``torch.compile``) on "cuda" tensors      compiling them for the CPU took 17 s of a
                                                   5 s tiny run
``Tensor.cuda()``, ``Module.cuda()`` (batches,     return the CPU tensor / module unchanged
model placement)
``torch.cuda.Stream``/``stream`` (DDP set-up)      a stream whose waits do nothing; no-op context
=================================================  ============================================

Left alone: ``torch.cuda.memory_allocated`` and friends answer 0 without CUDA (Megatron's memory
report prints zeros) and ``empty_cache`` does nothing. The CPU default generator plays the CUDA
generator, and the FP8 kernels run their torch references, so a CPU run trains the same model
with the same numerics as on a GPU, slowly.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os

import torch

from .cpu import _CpuStream, megatron_on_cpu
from .replacements import Replacements
from .version import require_megatron_core

# What a CPU run needs whatever the command line says (Megatron's fused kernels and TE are CUDA-only).
CPU_ARGUMENTS = {
    "use_cpu_initialization": True,
    "gradient_accumulation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "cross_entropy_loss_fusion": False,
    "no_persist_layer_norm": True,
    "transformer_impl": "local",
    "distributed_backend": "gloo",
}


def set_cpu_arguments(args) -> None:
    """Set ``CPU_ARGUMENTS`` on a parsed namespace, saying on rank 0 which ones changed."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    changed = {k: v for k, v in CPU_ARGUMENTS.items() if getattr(args, k, None) != v}
    for k, v in changed.items():
        setattr(args, k, v)
    if changed and args.rank == 0:
        print(
            "coat-megatron-run: no GPU: running on the CPU with " + ", ".join(f"{k}={v}" for k, v in changed.items()),
            flush=True,
        )


def _cpu_tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _cpu_module_cuda(self, device=None):
    return self


@contextlib.contextmanager
def _one_visible_device():
    """``torch.cuda.device_count()`` answers 1 inside (Megatron's gate for model-parallel groups
    and the RNG tracker); ``set_device`` is never reached because the process group exists."""
    count = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = count


def _init_gloo_process_group(args) -> None:
    if torch.distributed.is_initialized():
        return
    # a world of one needs no rendezvous: an in-process store, not a TCP port that another process
    # may take between the launcher picking it and this bind (EADDRINUSE under parallel jobs)
    store = torch.distributed.HashStore() if args.world_size == 1 else None
    torch.distributed.init_process_group(
        backend="gloo",
        world_size=args.world_size,
        rank=args.rank,
        store=store,
        timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
    )


def install(replacements: Replacements) -> contextlib.AbstractContextManager:
    """Apply the redirects of the module docstring; returns the context (``megatron_on_cpu()``)
    to run the script in. Call only where CUDA is not available."""
    require_megatron_core(__name__)
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    validate_args = arguments.validate_args
    initialize_megatron = training.initialize_megatron
    initialize_distributed = initialize._initialize_distributed
    set_random_seed = initialize._set_random_seed

    @functools.wraps(validate_args)
    def validate_args_on_cpu(args, defaults={}):  # noqa: B006 - Megatron's signature
        set_cpu_arguments(args)
        return validate_args(args, defaults)

    @functools.wraps(initialize_megatron)
    def initialize_megatron_without_cuda(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    @functools.wraps(initialize_distributed)
    def initialize_distributed_on_gloo(*args, **kwargs):
        from megatron.training import get_args

        _init_gloo_process_group(get_args())
        with _one_visible_device():
            return initialize_distributed(*args, **kwargs)

    @functools.wraps(set_random_seed)
    def set_random_seed_with_tracker(*args, **kwargs):
        with _one_visible_device():
            return set_random_seed(*args, **kwargs)

    replacements.replace(arguments, "validate_args", validate_args_on_cpu)
    replacements.replace(arguments, "get_device_arch_version", lambda: 0)
    replacements.replace(training, "initialize_megatron", initialize_megatron_without_cuda)
    replacements.replace(initialize, "_initialize_distributed", initialize_distributed_on_gloo)
    replacements.replace(initialize, "_set_random_seed", set_random_seed_with_tracker)
    replacements.replace(training, "set_jit_fusion_options", lambda *args, **kwargs: None)
    replacements.replace(torch.Tensor, "cuda", _cpu_tensor_cuda)
    replacements.replace(torch.nn.Module, "cuda", _cpu_module_cuda)
    replacements.replace(torch.cuda, "Stream", lambda *args, **kwargs: _CpuStream())
    replacements.replace(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    return megatron_on_cpu()
