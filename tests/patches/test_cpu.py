"""coat_patches.cpu: each redirect in place inside the context, everything restored after it."""

import megatron.core.package_info
import megatron.core.tensor_parallel.random as mcore_random
import pytest
import torch
from distributed import run_distributed

import coat_patches.cpu
from coat_patches.cpu import megatron_on_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="redirects apply only without CUDA")

PATCHED = [
    (torch.cuda, "current_device"),
    (torch.cuda, "get_rng_state"),
    (torch.cuda.random, "get_rng_state"),
    (torch.cuda, "manual_seed"),
    (mcore_random, "_set_cuda_rng_state"),
    (torch.cuda, "current_stream"),
    (torch.cuda, "synchronize"),
]


def originals():
    return [getattr(owner, name) for owner, name in PATCHED]


def test_redirects_inside_and_restores_after():
    before = originals()
    with megatron_on_cpu():
        assert all(now is not was for now, was in zip(originals(), before))
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device="cuda:0").device.type == "cpu"
        assert torch.ones(2).to(device="cuda").device.type == "cpu"
        assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.nn.Parameter(torch.zeros(2)).type() == "torch.cuda.FloatTensor"
        torch.cuda.current_stream().wait_stream(None)
        torch.cuda.synchronize()
    assert all(now is was for now, was in zip(originals(), before))
    assert torch.zeros(2).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")


def test_nested_entries_are_no_ops():
    before = originals()
    with megatron_on_cpu():
        inside = originals()
        with megatron_on_cpu():
            assert originals() == inside
            assert torch.zeros(1).type() == "torch.cuda.FloatTensor"  # not torch.cuda.cuda.
        assert originals() == inside  # leaving the inner context keeps the outer one's patches
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert originals() == before


def test_refuses_other_megatron_versions(monkeypatch):
    monkeypatch.setattr(megatron.core.package_info, "MINOR", 20)
    before = originals()
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.19\.x, but megatron-core 0\.20\.\d+ is installed"):
        with megatron_on_cpu():
            pass
    assert originals() == before


def test_does_nothing_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = originals()
    with megatron_on_cpu():
        assert originals() == before
        assert torch.zeros(1).type() == "torch.FloatTensor"


def _rng_streams(seed: int) -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)
    tracker = get_cuda_rng_tracker()
    draws = dict(default=[torch.rand(3)], model_parallel=[])
    for _ in range(2):
        with tracker.fork():
            draws["model_parallel"].append(torch.rand(3))
        draws["default"].append(torch.rand(3))
    return {k: torch.cat(v) for k, v in draws.items()}


def test_rng_tracker_runs_on_the_cpu_generator():
    """Megatron's seeding gives the default stream the seed and each TP rank its own stream
    (seed + 2718 + rank); forking switches to the rank's stream and back, each resuming where it
    left off. Wrong redirects fail silently (torch queues CUDA seeding without a GPU), so this
    compares the numbers."""
    seed = 123
    ranks = run_distributed(_rng_streams, 2, args=(seed,), tensor_parallel=2)
    for tp_rank, draws in enumerate(ranks):
        default = torch.rand(9, generator=torch.Generator().manual_seed(seed))
        model_parallel = torch.rand(6, generator=torch.Generator().manual_seed(seed + 2718 + tp_rank))
        assert torch.equal(draws["default"], default)
        assert torch.equal(draws["model_parallel"], model_parallel)
    assert not torch.equal(ranks[0]["model_parallel"], ranks[1]["model_parallel"])
