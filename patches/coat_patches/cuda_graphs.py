"""Every CUDA graph released before the process groups go.

NCCL's communicator destroy waits until every CUDA graph that captured one of its kernels is gone
(NCCL >= 2.26 counts them; abort waits the same way), so a process that still holds a graph with a
TP all-gather or reduce-scatter in it never returns from ``destroy_process_group``. Megatron-Core
0.19's ``delete_cuda_graphs()`` does not release the per-layer training graphs of
``--cuda-graph-impl local``: it resets the runners in ``_CudagraphGlobalRecord.cudagraph_record``,
which ``create_cudagraphs()`` empties right after capture, and the runners stay in each layer's
``CudaGraphManager``. Megatron's own ``train()`` cleans up only TransformerEngine's graphs. So the
graphs are found by the garbage collector's list of live objects and reset (``CUDAGraph.reset``
frees a graph at once, whoever still refers to it); the known cases (PyTorch issue 115388,
TransformerEngine pull request 2367) were fixed the same way.
"""

from __future__ import annotations

import gc
from typing import Iterable


def reset_graphs(objects: Iterable[object], runner_type: type, graph_type: type) -> int:
    """Reset and forget the graphs among ``objects``: each ``runner_type`` (Megatron's
    ``_CudaGraphRunner``) loses its forward and backward graph and is marked not captured, and every
    ``graph_type`` (``torch.cuda.CUDAGraph``) left is reset. The number of graphs reset."""
    done: set[int] = set()  # ids of the graphs reset (each once, though a live graph is listed too)
    graphs = []
    for obj in objects:
        # type(), not isinstance(): isinstance reads obj.__class__, which a weakref proxy whose referent is
        # gone answers with ReferenceError (gc.get_objects() lists such proxies; seen on an H200 after training)
        kind = type(obj)
        if issubclass(kind, runner_type):
            for name in ("fwd_graph", "bwd_graph"):
                graph = getattr(obj, name, None)
                if graph is not None and id(graph) not in done:
                    graph.reset()
                    done.add(id(graph))
                setattr(obj, name, None)
            for flag in ("cudagraph_created", "fwd_graph_recorded", "bwd_graph_recorded"):
                setattr(obj, flag, False)
        elif issubclass(kind, graph_type):
            graphs.append(obj)
    for graph in graphs:  # any other: TransformerEngine's, a whole-step graph, one of the optimizer
        if id(graph) not in done:
            graph.reset()
            done.add(id(graph))
    return len(done)


def release_cuda_graphs() -> int:
    """Release every CUDA graph of this process (Megatron's per-layer and whole-step graphs, and any
    other) and wait for the GPU; the number of graphs reset (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    from megatron.core import full_cuda_graph
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.transformer import cuda_graphs

    torch.cuda.synchronize()  # no replay in flight
    reset = reset_graphs(gc.get_objects(), cuda_graphs._CudaGraphRunner, torch.cuda.CUDAGraph)
    FullCudaGraphWrapper.cuda_graph = {"training": None, "validation": None}
    # the process-wide pool of whole-step graphs: a handle kept past its graph's deletion holds that graph's
    # memory, and capturing into it again fails (CUDACachingAllocator use_count assert)
    full_cuda_graph._shared_graph_pool = None
    cuda_graphs.delete_cuda_graphs()  # Megatron's records, its memory pool; collects and empties the cache
    torch.cuda.synchronize()
    return reset
