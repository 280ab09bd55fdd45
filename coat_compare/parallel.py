"""Where a comparison runs: the device, torch.distributed and Megatron's model-parallel state.

One process per GPU. A run of several processes is started by the job under ``torchrun``
(``probe``); the process group comes from its environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT)
and ``--tp`` x ``--pp`` x ``--dp`` equals the world size. A run of one process started plainly
is a world of one (an in-process store). NCCL on a GPU, gloo on a CPU.

On a CPU, Megatron-Core still names CUDA in a few places; ``coat_patches.cpu.megatron_on_cpu()``
redirects those for the life of the job; on a GPU, ``coat_patches.cuda_graphs`` releases a finished
mode's CUDA graphs. (The comparison job is an application of the plugin and its patches.)
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os

import torch


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


# this process's rank and the world size, kept after the process group is gone (the report is
# written after the job has left it)
_WORLD = {"rank": 0, "size": 1}


def is_main_rank() -> bool:
    """Rank 0 (or a plain process): the one that prints progress and writes the report."""
    return _WORLD["rank"] == 0


def rank() -> int:
    return _WORLD["rank"]


def world_size() -> int:
    return _WORLD["size"]


def per_rank(value) -> list:
    """``value`` of every rank, indexed by rank (a collective: call it on every rank)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [value]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value, group=_WORLD.get("objects"))
    return out


def initialize(tp: int, dp: int, stack: contextlib.ExitStack, pp: int = 1, vpp: int = 1) -> None:
    """Join (or make) the process group and set Megatron's TP x PP x DP state (``vpp`` virtual
    pipeline stages per rank where > 1); CPU redirects are entered on ``stack`` and undone when it
    closes."""
    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        from coat_patches.cpu import megatron_on_cpu

        stack.enter_context(megatron_on_cpu())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp * pp * dp != world:
        raise ValueError(
            f"--tp {tp} x --pp {pp} x --dp {dp} = {tp * pp * dp} processes, but this run has {world}: "
            "run coat-compare with plain python, which starts the processes of each run itself"
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        if "RANK" in os.environ:
            torch.distributed.init_process_group(backend)
        else:
            # a world of one needs no rendezvous: an in-process store, not a TCP port that another run
            # started at the same moment may take between its pick and its bind (EADDRINUSE: seen with
            # 16 runs packed on one host)
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    _WORLD.update(rank=torch.distributed.get_rank(), size=torch.distributed.get_world_size())
    if backend == "nccl" and _WORLD["size"] > 1:
        # small Python objects (each rank's memory figures) over gloo: no device copy, no
        # synchronisation with the GPU, no NCCL communicator made for them after CUDA graphs
        _WORLD["objects"] = torch.distributed.new_group(backend="gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        )
    stack.callback(_shutdown)


def _shutdown() -> None:
    from megatron.core import parallel_state

    _WORLD.pop("objects", None)
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def seed_everything(seed: int) -> None:
    """torch's generators and Megatron's CUDA RNG tracker (attention forks it even at dropout 0).

    On a GPU the tracker is a graph-safe one in every run (CUDA graphs need it; the dropout-free
    presets draw no random numbers, so eager runs are unchanged), made anew for each mode:
    TransformerEngine's where TE is installed (its attention accepts no other inside a graph; what
    megatron.training picks for CUDA graphs), else Megatron's graph-safe tracker."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from coat_megatron.optional import transformer_engine_available

    torch.manual_seed(seed)
    cuda = torch.cuda.is_available()
    model_parallel_cuda_manual_seed(
        seed, te_rng_tracker=cuda and transformer_engine_available(), use_cudagraphable_rng=cuda, force_reset_rng=True
    )


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def barrier() -> None:
    """All ranks here before any goes on (timings that start together)."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def release_cuda_graphs() -> None:
    """Forget the CUDA graphs of a finished mode (Megatron keeps their state process-wide), so
    that the next mode captures its own."""
    if not torch.cuda.is_available():
        return
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader
    from megatron.core.transformer import cuda_graphs

    from coat_megatron.optional import transformer_engine_available
    from coat_patches.cuda_graphs import release_cuda_graphs as release_every_graph

    # every graph reset, not only those Megatron's delete_cuda_graphs() still lists (it forgets the
    # per-layer training graphs): a graph left alive pins its NCCL communicator at tear-down
    release_every_graph()
    # a capture that failed half-way leaves these process-wide flags set (and TE's attention then
    # refuses to run eagerly)
    cuda_graphs._set_capture_end()
    cuda_graphs._set_warmup_end()
    if transformer_engine_available():
        from transformer_engine.pytorch.graph import set_capture_end

        set_capture_end()
    FullCudaGraphWrapper.result = {"training": None, "validation": None}
    FullCudaGraphWrapper.curr_iteration = {"training": 0, "validation": 0}
    StaticBufferLoader.static_buffers = {"training": [], "validation": []}


def free_memory() -> None:
    """Return what a finished (or failed) mode held, so the next one starts clean."""
    import gc

    release_cuda_graphs()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:  # TE keeps FP8 scaling state (amax histories) in a process-wide manager
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except Exception:
        return
    FP8GlobalStateManager.reset()


GC_INTERVAL = 50  # steps between garbage collections while training (Megatron's --manual-gc-interval)


@contextlib.contextmanager
def step_watchdog(seconds: float | None):
    """Run the block under a deadline: past ``seconds`` (None: no deadline) every thread's Python
    stack goes to stderr after a line ``Timeout (H:MM:SS)!`` (``faulthandler``, which needs no GIL)
    and the process exits (status 1), which makes torchrun end the run's other ranks. A
    collective that one rank never joins would otherwise hang the whole job; the stacks say where
    each rank was."""
    if not seconds:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def manual_gc(enabled: bool):
    """Python's automatic collection off for the block (after one collection), back on after it."""
    was_enabled = gc.isenabled()
    if enabled:
        gc.collect()
        gc.disable()
    try:
        yield
    finally:
        if enabled and was_enabled:
            gc.enable()
