"""``CUDA_DEVICE_MAX_CONNECTIONS=1`` where Megatron requires it, set before CUDA starts.

megatron-core 0.19's ``validate_args`` refuses tensor or context parallelism
(``--tensor-model-parallel-size`` or ``--context-parallel-size`` above 1) on GPUs before Blackwell
(compute capability below 10) unless ``CUDA_DEVICE_MAX_CONNECTIONS`` is ``1``: with one hardware
work queue the GPU starts kernels in the order the host issued them, so a tensor-parallel
collective issued before a GEMM starts before it. Two exceptions: with ``--use-megatron-fsdp`` or
``--use-torch-fsdp2`` Megatron wants more than one queue (it refuses ``1``) and with
``--overlap-moe-expert-parallel-comm`` it only warns. The driver reads the variable when CUDA
starts in the process, so a script that sets it after touching CUDA changes nothing:
``coat-megatron-run`` calls ``set_device_max_connections`` with the command line before it
imports anything that may start CUDA.

The compute capability comes from NVML (``libnvidia-ml``), which answers without starting CUDA;
where NVML is missing (no GPU, a CPU run) the rules before Blackwell apply, as Megatron's own check
on a CPU run does (``coat_patches.training_cpu``).
"""

from __future__ import annotations

import argparse
import ctypes
import os

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
BLACKWELL = 10  # the first compute capability (major) for which Megatron drops the requirement


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)  # not argparse's usage and exit: Megatron's parser reports it


def _megatron_flags(argv: list[str]) -> argparse.Namespace:
    """The few Megatron arguments that decide the requirement, read as Megatron's parser reads them
    (no abbreviations, the rest of the command line ignored)."""
    parser = _QuietParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--use-megatron-fsdp", action="store_true")
    parser.add_argument("--use-torch-fsdp2", action="store_true")
    parser.add_argument("--overlap-moe-expert-parallel-comm", action="store_true")
    try:
        return parser.parse_known_args(argv)[0]
    except ValueError:  # a malformed value: Megatron's parser will say what is wrong with it
        return parser.parse_known_args([])[0]


def megatron_requires_one_connection(argv: list[str], compute_capability_major: int | None) -> bool:
    """Whether megatron-core 0.19's ``validate_args`` will refuse these arguments unless
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (``compute_capability_major`` None: unknown, taken as before
    Blackwell)."""
    flags = _megatron_flags(argv)
    model_parallel = flags.tensor_model_parallel_size > 1 or flags.context_parallel_size > 1
    before_blackwell = compute_capability_major is None or compute_capability_major < BLACKWELL
    megatron_warns_instead = flags.use_megatron_fsdp or flags.use_torch_fsdp2 or flags.overlap_moe_expert_parallel_comm
    return model_parallel and before_blackwell and not megatron_warns_instead


def set_device_max_connections(argv: list[str], cpu: bool = False) -> str | None:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in this process's environment where Megatron requires
    it for the pretrain script's arguments ``argv`` on this machine's GPUs, or with ``cpu`` (a run
    on the CPU, where Megatron's check applies the rules before Blackwell) on none (see the module
    docstring); a value the user set stays unless Megatron would refuse it. Returns one line to
    print where a value the user set was replaced, else None."""
    major = None if cpu else gpu_compute_capability_major()
    if not megatron_requires_one_connection(argv, major):
        return None
    user_value = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = "1"
    if user_value is None or user_value == "1":
        return None
    return (
        f"{VARIABLE}={user_value} replaced by 1: Megatron requires 1 for tensor or context parallelism "
        f"on GPUs before Blackwell"
    )


def gpu_compute_capability_major() -> int | None:
    """The compute capability (major) of the first GPU NVML lists, or None without NVML or GPU.
    NVML starts no CUDA context and reads no ``CUDA_*`` variable."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        device = ctypes.c_void_p()
        major, minor = ctypes.c_int(), ctypes.c_int()
        if nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(device)) != 0:
            return None
        if nvml.nvmlDeviceGetCudaComputeCapability(device, ctypes.byref(major), ctypes.byref(minor)) != 0:
            return None
        return major.value
    finally:
        nvml.nvmlShutdown()
