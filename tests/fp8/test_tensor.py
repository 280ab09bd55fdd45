import warnings

import pytest
import torch

from coat_kernels import quantize_per_group, quantize_per_tensor
from coat_megatron.fp8 import (
    HANDLED_OPS,
    Fp8Tensor,
    Fp8WeightCache,
    fp8_linear,
    invalidate_weight_caches,
    rmsnorm_to_fp8,
)
from coat_megatron.fp8 import tensor as tensor_module
from coat_megatron.fp8 import weights as weights_module


def per_tensor(shape=(6, 32), seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    q, s, q_t = quantize_per_tensor(x, "e4m3", transpose=True)
    return x, Fp8Tensor(q, s, transposed=q_t)


def per_group(shape=(6, 32)):
    x = torch.randn(shape).to(torch.bfloat16)
    q, s = quantize_per_group(x, 16, "e4m3")
    return x, Fp8Tensor(q, s, group_size=16)


@pytest.fixture(autouse=True)
def fresh_warnings():
    tensor_module._WARNED.clear()


def test_reports_logical_shape_and_bf16_dtype():
    x, t = per_tensor()
    assert t.shape == x.shape and t.dtype == torch.bfloat16 and t.device == x.device
    assert t.granularity == "tensor" and per_group()[1].granularity == "1x16"
    assert "float8_e4m3fn" in repr(t) and "transposed=stored" in repr(t)
    assert ((t.dequantize(torch.float32) - x.float()).abs() <= 2**-4 * x.float().abs() + t.scale * 2**-10).all()
    with pytest.raises(TypeError, match="FP8 codes"):
        Fp8Tensor(torch.zeros(3), torch.ones(()))


def test_handled_ops_keep_fp8_without_warning():
    x, t = per_tensor((2, 3, 32))
    _, g = per_group((2, 3, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for v in (t.detach(), t.view(6, 32), t.reshape(-1, 32), g.view(6, 32), t.clone()):
            assert isinstance(v, Fp8Tensor)
        assert torch.equal(t.view(6, 32).dequantize(), t.dequantize().view(6, 32))
        assert torch.equal(g.view(6, 32).dequantize(), g.dequantize().view(6, 32))
        assert t.view(6, 32).transposed is t.transposed  # rows regroup; the (N, R) copy stays valid
        z = torch.zeros_like(t)
        assert type(z) is torch.Tensor and z.dtype == torch.bfloat16 and z.shape == t.shape and (z == 0).all()
        f = t.float()  # an explicit high-precision copy: no warning
        assert type(f) is torch.Tensor and f.dtype == torch.float32 and torch.equal(f, t.dequantize(torch.float32))
    assert set(HANDLED_OPS) >= {torch.ops.aten.detach.default, torch.ops.aten.view.default}


def test_unhandled_op_dequantizes_and_warns_once_naming_it():
    x, t = per_tensor()
    with pytest.warns(UserWarning, match=r"aten\.mul\.Tensor is not handled by Fp8Tensor"):
        y = t * 2
    assert type(y) is torch.Tensor and torch.equal(y, t.dequantize() * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time is silent
        t * 3
    with pytest.warns(UserWarning, match=r"aten\.view\.default"):  # regrouping the last dim
        v = t.view(12, 16)
    assert type(v) is torch.Tensor and torch.equal(v, t.dequantize().view(12, 16))


def test_gradients_arrive_as_plain_bf16():
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen["grad"] = grad
            return grad

    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    y = rmsnorm_to_fp8(Probe.apply(x), torch.ones(32, requires_grad=True))
    assert isinstance(y, Fp8Tensor) and y.requires_grad and y.grad_fn is not None
    w = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    fp8_linear(y, w).sum().backward()
    assert type(seen["grad"]) is torch.Tensor and seen["grad"].dtype == torch.bfloat16 and x.grad.shape == x.shape


def test_weight_copies_are_made_once_per_optimizer_step(monkeypatch):
    w = torch.nn.Parameter(torch.randn(16, 32))
    cache = Fp8WeightCache()
    calls = []
    real = weights_module.refresh_per_tensor_copy
    monkeypatch.setattr(weights_module, "refresh_per_tensor_copy", lambda *a, **k: (calls.append(1), real(*a, **k)))

    def codes():
        return cache.get(w)[0].view(torch.uint8).clone()

    first = codes()
    assert torch.equal(codes(), first) and len(calls) == 1  # every micro-batch of a step reuses them
    w.grad = torch.randn_like(w)
    torch.optim.SGD([w], lr=0.1).step()
    after_step = codes()
    assert len(calls) == 2 and not torch.equal(after_step, first)
    assert cache.get(w)[0] is cache.get(w)[0]  # refreshed in place: the buffers never move
    scale = cache.get(w)[2].clone()
    with torch.no_grad():
        w.mul_(2)  # an in-place change outside an optimizer (same codes, twice the scale)
    assert torch.equal(codes(), after_step) and cache.get(w)[2] == 2 * scale and len(calls) == 3
    invalidate_weight_caches()
    codes()
    assert len(calls) == 4
    q, q_t, scale = cache.get(w)
    assert q.shape == (16, 32) and q_t.shape == (32, 16) and torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())
