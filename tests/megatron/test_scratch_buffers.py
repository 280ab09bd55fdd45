"""Scratch buffers (``CoatConfig.scratch_buffers``, ``coat_kernels.workspace``) change no number, nor does the
norms' fused residual gradient (``CoatConfig.fuse_residual_backward``): two
COAT layers stacked at TP 2 + SP (and on one process, without TP), two micro-batches of forward and backward into DDP's main_grad,
give bit-identical outputs, input gradients and main_grads with the buffers on and off. Two layers,
so that a buffer one layer's forward left for its backward (which would be a bug) is overwritten by
the other's before that backward reads it; two micro-batches, so that each buffer is reused with
the same shapes, as in training. The Triton kernels run (interpreted), as on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import run_distributed
from layer_config import layer_config

SIZES = (32, 2, 64, 128, 4)  # seq, micro-batch, hidden, FFN, heads
MICRO_BATCHES = 2


def _layers(coat, proj_saved: bool):
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module

    from coat_megatron.spec import get_gpt_layer_coat_spec

    seq, micro_batch, hidden, ffn, heads = SIZES
    tp = parallel_state.get_tensor_model_parallel_world_size()
    model_parallel_cuda_manual_seed(1234)
    config = layer_config(
        hidden, ffn, heads, pipeline_dtype=torch.bfloat16, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
    )  # fmt: skip
    spec = get_gpt_layer_coat_spec(
        coat,
        core_attention=DotProductAttention,
        proj_input_saved_by_attention=proj_saved,
    )
    layers = [build_module(spec, config=config, layer_number=i + 1) for i in range(2)]
    g = torch.Generator().manual_seed(100 + parallel_state.get_tensor_model_parallel_rank())
    weights = []
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() > 1 else 0.1) + (p.dim() == 1))
                p.main_grad = torch.zeros(p.shape, dtype=torch.bfloat16)
                weights.append(p)
    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0)(seq)
    xs = [torch.randn(seq // tp, micro_batch, hidden, generator=g).to(torch.bfloat16) for _ in range(MICRO_BATCHES)]
    dys = [torch.randn(x.shape, generator=g).to(torch.bfloat16) for x in xs]
    return layers, weights, rope, xs, dys


def two_layers(recipe: str, proj_saved: bool, changes: dict) -> list[torch.Tensor]:
    """In each rank: the outputs and input gradients of every micro-batch, then every main_grad, with the
    recipe's ``CoatConfig`` changed as ``changes`` says."""
    import coat_kernels.backend as backend
    from coat_kernels import workspace
    from coat_megatron.config import CoatConfig

    backend._OVERRIDE = "triton"
    workspace.release()
    handed = _count_handed_amaxes()
    layers, weights, rope, xs, dys = _layers(dataclasses.replace(CoatConfig.recipe(recipe), **changes), proj_saved)
    got = []
    for i, (x, dy) in enumerate(zip(xs, dys)):
        for w in weights:
            w.grad_added_to_main_grad = i > 0  # DDP: written at a step's first micro-batch, added after
        x = x.clone().requires_grad_()
        h = x
        for layer in layers:
            h, _ = layer(h, attention_mask=None, rotary_pos_emb=rope)
        h.backward(dy)
        got += [h.detach(), x.grad]
    # scratch buffers unset: CoatConfig's auto, on for these eager layers where they are tensor-parallel
    from megatron.core import parallel_state

    expected = changes.get("scratch_buffers", parallel_state.get_tensor_model_parallel_world_size() > 1)
    resolved = {m.coat.scratch_buffers for layer in layers for m in layer.modules() if hasattr(m, "coat")}
    assert resolved == {expected}, resolved
    held = workspace.nbytes()
    assert (held > 0) == expected, held
    return got + [w.main_grad.clone() for w in weights] + [torch.tensor(handed)]


def _count_handed_amaxes() -> list[int]:
    """A one-element list counting the gradient amaxes the linears took from an op that found them (a
    hand-off), instead of finding them themselves."""
    from coat_megatron.fp8.handoff import AmaxHandoff

    count = [0]
    take = AmaxHandoff.take_grad_amax

    def counted(self, grad):
        amax = take(self, grad)
        count[0] += amax is not None
        return amax

    AmaxHandoff.take_grad_amax = counted
    return count


def _runs(recipe: str, proj_saved: bool, tp: int, changes: list[dict]) -> list[list]:
    """Per configuration (each ``changes`` of the recipe's CoatConfig), every rank's tensors from ``two_layers``."""
    return [
        run_distributed(two_layers, tp, args=(recipe, proj_saved, change), tensor_parallel=tp, timeout=300)
        for change in changes
    ]


def _assert_equal(a_ranks: list, b_ranks: list, what: str) -> list[int]:
    """Asserts that every tensor of two configurations is the same; returns, per rank, how many more gradient
    amaxes the linears were handed in the first."""
    for rank, (a_all, b_all) in enumerate(zip(a_ranks, b_ranks)):
        assert len(a_all) == len(b_all)
        for i, (a, b) in enumerate(zip(a_all[:-1], b_all[:-1])):
            assert a.abs().sum() > 0, f"rank {rank}, tensor {i} is zero: the test would prove nothing"
            assert torch.equal(a, b), f"rank {rank}, tensor {i}: {what} changed it"
    return [int(a[-1] - b[-1]) for a, b in zip(a_ranks, b_ranks)]


@pytest.mark.parametrize("recipe,proj_saved,tp", [("memory", True, 2), ("memory", False, 1)])
def test_scratch_buffers_and_the_norms_residual_gradient_change_no_number(recipe, proj_saved, tp):
    """Against the defaults (scratch buffers auto: on at TP 2, off on one process; the fused residual gradient on):
    scratch buffers the other way, and ``fuse_residual_backward`` off. The fused residual gradient: the norms
    return the residual and add its gradient in their backward, and linear_proj (and, across the two layers, the
    first layer's linear_fc2) quantize dY with the amax the norm found: the same bits as autograd's sum and the
    linears' own amax passes. (Three runs, where two tests of one knob each took four.)"""
    default, scratch, unfused = _runs(
        recipe, proj_saved, tp, [{}, {"scratch_buffers": tp == 1}, {"fuse_residual_backward": False}]
    )
    assert _assert_equal(default, scratch, "scratch_buffers") == [0] * tp
    handed = _assert_equal(default, unfused, "fuse_residual_backward")
    # per micro-batch: both layers' linear_proj, and the first layer's linear_fc2 (whose dY the second
    # layer's input norm wrote); the second layer's linear_fc2 gets the test's own dY
    assert handed == [3 * MICRO_BATCHES] * tp, handed


def test_scratch_buffers_change_no_number_in_the_codes_recipe():
    """The codes recipe (W's codes kept between micro-batches) at TP 2 + SP, linear_proj quantizing its own
    input (proj_input_saved_by_attention off), scratch buffers on against off."""
    on, off = _runs("codes", False, 2, [{"scratch_buffers": True}, {"scratch_buffers": False}])
    _assert_equal(on, off, "scratch_buffers")
