"""benchmarks/weight_passes.py: the weight shapes it times, the passes each recipe runs, and its
refusal without a GPU (the timing itself is a GPU run)."""

import os

import pytest
import torch
from load_file import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "weight_passes.py")


def load_script():
    return load_file("benchmarks/weight_passes.py", "weight_passes_script")


def test_one_layers_linear_weights_are_the_layers_matmul_parameters():
    from coat_compare.flops import layer_parameters
    from coat_compare.presets import get_preset

    script = load_script()
    for name in ("llama2-7b", "llama3-8b-layer", "gpt-1b"):  # llama3: GQA, K and V narrower than Q
        preset = get_preset(name)
        shapes = script.linear_shapes(preset)
        assert [s[0] for s in shapes] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
        assert sum(o * i for _, o, i in shapes) == layer_parameters(preset) - 2 * preset.hidden  # but the norms
    assert script.linear_shapes(get_preset("llama3-8b-layer"))[0][1:] == (4096 + 2 * 1024, 4096)


def test_each_recipes_passes_run_and_make_what_the_recipe_needs():
    """On a CPU (torch references): the default's two passes give the codes and the transposed
    codes that coat-cached's one pass gives, and coat-codes' transpose gives the same W^T."""
    script = load_script()
    w = torch.randn(48, 80, dtype=torch.bfloat16)
    run = {k: fn() for k, fn in script.passes(w).items()}
    q, scale = run["W codes"]
    q_t, scale_t = run["W^T codes"]
    q_both, scale_both, q_t_both = run["W and W^T codes"]
    assert torch.equal(q.view(torch.uint8), q_both.view(torch.uint8)) and torch.equal(scale, scale_both)
    assert torch.equal(q_t.view(torch.uint8), q_t_both.view(torch.uint8)) and torch.equal(scale_t, scale_both)
    assert torch.equal(run["transpose W's codes"].view(torch.uint8), q_t.view(torch.uint8))
    assert run["amax"].item() == w.float().abs().max().item()
    for micro, step in script.RECIPES.values():
        assert set(micro) | set(step) <= set(run)


def test_it_refuses_to_time_without_a_gpu(monkeypatch):
    script = load_script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="times GPU kernels: run it on a CUDA machine"):
        script.main(["--preset", "tiny"])
