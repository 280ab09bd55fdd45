"""coat_megatron_patches(): every patch in place inside, everything restored after."""

import subprocess

import megatron.core.datasets.utils as dataset_utils
import megatron.training.arguments as arguments
import megatron.training.initialize as initialize
import megatron.training.training as training
import pytest
import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.pipeline_parallel import schedules

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


def test_a_pipeline_output_that_is_a_view_is_kept_and_any_other_is_freed():
    """Megatron 0.19 asserts that a stage output it frees is no view, which a per-layer CUDA graph's
    output is (every PP run with graphs stopped at its first micro-batch on GPUs): the patch leaves a
    view alone, inside lists too, and frees the rest as Megatron does."""
    base = torch.arange(12.0).reshape(3, 4)
    view, plain, listed = base[1:], torch.ones(5), [base[:1], torch.ones(6)]
    with pytest.raises(AssertionError, match="counter-productive to free a view"):
        schedules.deallocate_output_tensor(view, True)
    with coat_megatron_patches():
        schedules.deallocate_output_tensor(view, True)
        schedules.deallocate_output_tensor(plain, True)
        schedules.deallocate_output_tensor(listed, True)
        schedules.deallocate_output_tensor(torch.ones(3), False)  # Megatron's switch still decides
    assert view.shape == (2, 4) and torch.equal(view, torch.arange(4.0, 12.0).reshape(2, 4))
    assert plain.numel() == 1 and listed[1].numel() == 1 and listed[0].shape == (1, 4)
