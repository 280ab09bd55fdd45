"""Every CUDA graph is reset before the process groups go (coat_patches.cuda_graphs): Megatron's
per-layer runners lose both graphs and their captured flags, and any other live graph is reset too.
On a CPU with stand-ins for the runner and the graph; without CUDA the release is a no-op."""

import weakref

import torch

from coat_patches import cuda_graphs


class Graph:
    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


class Runner:
    def __init__(self, fwd, bwd):
        self.fwd_graph, self.bwd_graph = fwd, bwd
        self.cudagraph_created = self.fwd_graph_recorded = self.bwd_graph_recorded = True


def test_runners_lose_their_graphs_and_every_other_graph_is_reset():
    captured = Runner(Graph(), Graph())
    half = Runner(Graph(), None)  # a capture that ended after the forward graph
    loose = Graph()  # TransformerEngine's, a whole-step graph: reached by no runner
    fwd, bwd, half_fwd = captured.fwd_graph, captured.bwd_graph, half.fwd_graph
    # a runner's graph is also a live object of its own: reset once, through the runner
    objects = [captured, fwd, "not a graph", half, half_fwd, loose, bwd]
    assert cuda_graphs.reset_graphs(objects, Runner, Graph) == 4
    assert (fwd.resets, bwd.resets, half_fwd.resets, loose.resets) == (1, 1, 1, 1)
    for runner in (captured, half):
        assert runner.fwd_graph is None and runner.bwd_graph is None
        assert not (runner.cudagraph_created or runner.fwd_graph_recorded or runner.bwd_graph_recorded)


def test_a_dead_weak_proxy_among_the_live_objects_is_passed_over():
    # gc.get_objects() lists weakref proxies; isinstance() on one whose referent is gone raises
    # ReferenceError (it stopped the launcher after a graphed TP 2 run on an H200)
    gone = Graph()
    proxy = weakref.proxy(gone)
    del gone
    runner = Runner(Graph(), Graph())
    objects = [proxy, runner, weakref.proxy(runner)]
    assert cuda_graphs.reset_graphs(objects, Runner, Graph) == 2
    assert runner.fwd_graph is None and runner.bwd_graph is None


def test_nothing_to_release_without_cuda():
    if torch.cuda.is_available():
        return
    assert cuda_graphs.release_cuda_graphs() == 0
