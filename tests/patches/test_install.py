"""coat_megatron_patches(): every patch in place inside, everything restored after."""

import subprocess

import megatron.core.datasets.utils as dataset_utils
import megatron.training.arguments as arguments
import megatron.training.initialize as initialize
import megatron.training.training as training
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.pipeline_parallel import schedules

from coat_patches.cpu import megatron_on_cpu
from coat_patches.install import coat_megatron_patches

PATCHED = [
    (arguments, "add_megatron_arguments"),
    (arguments, "validate_args"),
    (arguments, "get_device_arch_version"),
    (GPTModel, "__init__"),
    (training, "get_megatron_optimizer"),
    (training, "train_step"),
    (training, "initialize_megatron"),
    (training, "set_jit_fusion_options"),
    (initialize, "_initialize_distributed"),
    (initialize, "_set_random_seed"),
    (dataset_utils, "compile_helpers"),
    (schedules, "deallocate_output_tensor"),
    (RotaryEmbedding, "forward"),
    (torch.Tensor, "cuda"),
    (torch.nn.Module, "cuda"),
    (torch.cuda, "Stream"),
    (torch.cuda, "stream"),
]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply only without CUDA")


def test_everything_is_patched_inside_and_restored_after():
    before = [getattr(owner, name) for owner, name in PATCHED]
    layout = DistributedOptimizer.__dict__["compute_full_param_layout"]
    with coat_megatron_patches():
        assert all(getattr(owner, name) is not was for (owner, name), was in zip(PATCHED, before))
        assert DistributedOptimizer.__dict__["compute_full_param_layout"] is not layout
        assert torch.zeros(2).cuda().device.type == "cpu"
    assert [getattr(owner, name) for owner, name in PATCHED] == before
    assert DistributedOptimizer.__dict__["compute_full_param_layout"] is layout  # a staticmethod again


def test_prebuilt_dataset_helpers_are_not_rebuilt(monkeypatch):
    def no_make(*args, **kwargs):
        raise AssertionError(f"ran {args}")

    monkeypatch.setattr(subprocess, "run", no_make)
    with coat_megatron_patches():
        dataset_utils.compile_helpers()  # the wheel has no Makefile: Megatron's own would run make and exit
    with pytest.raises(AssertionError, match="make"):
        dataset_utils.compile_helpers()


def test_a_pipeline_output_that_is_a_view_is_pseudo_freed_and_its_backward_runs():
    """Megatron 0.19 asserts that a stage output it frees is no view, which a per-layer CUDA graph's
    output is (every PP run with graphs stopped at its first micro-batch on GPUs): the patch
    pseudo-frees a view as any other output (one element left, what the backward's custom_backward
    asserts), inside lists too, leaves the tensor it views untouched, and the backward from it
    gives the gradients it would have given."""

    class Double(torch.autograd.Function):  # stands for a graph's replay node
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    x = torch.randn(3, 4, requires_grad=True)
    base = Double.apply(x)
    view, plain, listed, kept = base[1:], torch.ones(5), [base[:1], torch.ones(6)], torch.ones(3)
    with pytest.raises(AssertionError, match="counter-productive to free a view"):
        schedules.deallocate_output_tensor(view, True)
    with coat_megatron_patches():
        for out in (view, plain, listed):
            schedules.deallocate_output_tensor(out, True)
        schedules.deallocate_output_tensor(kept, False)  # Megatron's switch still decides
        schedules.custom_backward(view, torch.ones(2, 4))
    assert view.numel() == plain.numel() == listed[0].numel() == listed[1].numel() == 1 and kept.numel() == 3
    assert base.shape == (3, 4) and torch.equal(base, x.detach() * 2)
    assert torch.equal(x.grad, torch.tensor([[0.0] * 4, [2.0] * 4, [2.0] * 4]))


def test_under_pipeline_parallelism_each_rope_call_gets_its_own_copy(monkeypatch):
    """Megatron caches the RoPE table (lru_cache), so every micro-batch's layers share one tensor;
    under PP with per-layer graphs that one input outlives a micro-batch's graphs (the suspected
    cause of graph creation's ``fwd_buffer_reuse_ref_count`` assertion). Under PP the patch hands
    each call a copy of the same values; without PP the cached tensor itself, as Megatron does."""
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    stages = {"n": 1}
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: stages["n"])
    with megatron_on_cpu(), coat_megatron_patches():
        assert rope(32) is rope(32)  # one stage: Megatron's cache, untouched
        stages["n"] = 2
        first, second = rope(32), rope(32)
        assert first is not second and first.data_ptr() != second.data_ptr()
        assert torch.equal(first, second) and torch.equal(first, rope.get_emb(32))
        rope.forward.cache_clear()  # what Megatron's YaRN subclass calls still works
    with megatron_on_cpu():
        assert rope(32) is rope(32)
