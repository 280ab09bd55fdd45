"""The amax hand-off between fc1 and SwiGLU (``AmaxHandoff``) and the output forms (``OutputForm``).

Backward, SwiGLU's backward finds dh's amax as it writes dh and leaves it in the hand-off that fc1's
output carried; fc1's backward quantizes dh with it. What it must give is what fc1 would have
computed itself: the same scale, the same gradients, bit for bit. Nothing rides on a plain tensor.
"""

import gc
import weakref

import pytest
import torch
from fp8_bounds import activations

from coat_kernels import quantize_per_tensor
from coat_megatron.config import CoatConfig
from coat_megatron.fp8 import AmaxHandoff, OutputForm, fp8_linear, swiglu_fp8
from coat_megatron.fp8 import linear as linear_module
from coat_megatron.fp8 import swiglu as swiglu_module

CONFIG = CoatConfig()


def _mlp_inputs(seed):
    x = activations((24, 64), seed).requires_grad_()
    w1 = (activations((96, 64), seed + 1) / 8).requires_grad_()  # fc1: [gate | up], F = 48
    w2 = (activations((64, 48), seed + 2) / 8).requires_grad_()
    return x, w1, w2, activations((24, 64), seed + 3)


def _record(monkeypatch, module, name, calls):
    real = getattr(module, name)

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(module, name, recording)


def test_swiglu_backward_hands_fc1_the_amax_of_dh(monkeypatch, seed):
    x, w1, w2, dy = _mlp_inputs(seed)
    h = fp8_linear(x, w1, config=CONFIG, output_form=OutputForm.SWIGLU_INPUT)
    y = fp8_linear(swiglu_fp8(h, group_size=CONFIG.group_size), w2, config=CONFIG)
    swiglu_calls, quantize_calls = [], []
    _record(monkeypatch, swiglu_module, "swiglu_backward", swiglu_calls)
    _record(monkeypatch, linear_module, "quantize_per_tensor", quantize_calls)
    y.backward(dy)

    (_, _, (dh, dh_amax)), *_ = swiglu_calls
    fc1_dy = quantize_calls[-1]  # backward runs fc2, SwiGLU, fc1: fc1's dY is the last one quantized
    assert fc1_dy[1]["amax"] is dh_amax
    assert torch.equal(fc1_dy[1]["amax"], dh.float().abs().amax())
    # the scale fc1 used is the one it would compute from dh itself
    assert torch.equal(fc1_dy[2][1], quantize_per_tensor(dh.view(-1, dh.shape[-1]), CONFIG.backward_format)[1])
    assert vars(dh) == {}, "the gradient carries an attribute"


def test_the_handed_amax_gives_the_gradients_that_a_computed_one_gives(seed):
    grads = []
    for hand_over in (True, False):
        x, w1, w2, dy = _mlp_inputs(seed)
        h = fp8_linear(x, w1, config=CONFIG, output_form=OutputForm.SWIGLU_INPUT)
        y = fp8_linear(swiglu_fp8(h, group_size=CONFIG.group_size), w2, config=CONFIG)
        if hand_over:
            y.backward(dy)
        else:  # dh reaches fc1 as a copy, not the tensor its amax was left for: fc1 computes the amax
            (dh,) = torch.autograd.grad(y, h, dy)
            h.backward(dh.clone())
        grads.append((x.grad, w1.grad))  # fc1's: what its dY's scale decides
    for handed, computed in zip(*grads):
        assert torch.equal(handed, computed)


def test_a_gradient_summed_over_two_consumers_gets_its_own_amax(monkeypatch, seed):
    """fc1's output feeds SwiGLU and another op: autograd adds the two gradients, so what reaches
    fc1 is not the dh that SwiGLU left an amax for (or is, changed in place): fc1 must compute it."""
    grads = []
    for whole_graph in (True, False):
        x, w1, w2, dy = _mlp_inputs(seed)
        h = fp8_linear(x, w1, config=CONFIG, output_form=OutputForm.SWIGLU_INPUT)
        y = fp8_linear(swiglu_fp8(h, group_size=CONFIG.group_size), w2, config=CONFIG)
        loss = (y.float() * dy.float()).sum() + 64.0 * h.float().sum()  # the other op's gradient dwarfs dh
        if whole_graph:
            calls = []
            _record(monkeypatch, linear_module, "quantize_per_tensor", calls)
            loss.backward()
            assert calls[-1][1]["amax"] is None
            monkeypatch.undo()
        else:
            (dh,) = torch.autograd.grad(loss, h)
            h.backward(dh.clone())
        grads.append((x.grad, w1.grad))
    for summed, reference in zip(*grads):
        assert torch.equal(summed, reference)


def test_a_handoff_gives_the_amax_only_for_the_unchanged_tensor_it_was_left_for():
    handoff, grad, amax = AmaxHandoff(), torch.ones(4), torch.tensor(1.0)
    handoff.deposit_grad_amax(grad, amax)
    assert handoff.take_grad_amax(torch.ones(4)) is None  # another tensor of the same values
    handoff.deposit_grad_amax(grad, amax)
    assert handoff.take_grad_amax(grad) is amax
    assert handoff.take_grad_amax(grad) is None  # taken: the hand-off is empty
    handoff.deposit_grad_amax(grad, amax)
    grad.add_(1.0)
    assert handoff.take_grad_amax(grad) is None


def test_a_handoff_does_not_keep_the_gradient_alive():
    handoff, grad = AmaxHandoff(), torch.ones(4)
    alive = weakref.ref(grad)
    handoff.deposit_grad_amax(grad, torch.tensor(1.0))
    del grad
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("bad", ["swiglu", "1xG", None])
def test_an_output_form_that_is_not_one_is_refused_naming_the_valid_ones(bad):
    x, w = activations((4, 32), 0), activations((32, 32), 1)
    valid = "OutputForm.BF16, OutputForm.PER_GROUP, OutputForm.SWIGLU_INPUT"
    with pytest.raises(ValueError, match=f"output_form={bad!r} is not an output form; use one of {valid}"):
        fp8_linear(x, w, output_form=bad)
