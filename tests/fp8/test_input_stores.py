"""CoatConfig.norm_input_store and swiglu_input_store: "fp8" (the default) is the 1xG copy's
backward, unchanged; "bf16" is the exact backward of the op from its BF16 input.

"Exact" here: the FP32 arithmetic of the op's backward from the exact input and the forward's FP32
statistics, rounded once to BF16, so it stays within one BF16 rounding (2^-8 relative) of FP32
autograd on the same BF16 values; the 1xG copy's backward is further off by the E4M3 rounding of x.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from fp8_bounds import BF16, activations

from coat_kernels import dequantize_per_group, quantize_per_group, quantize_per_tensor
from coat_kernels.norm import norm_backward_from_input
from coat_kernels.swiglu import swiglu_backward_from_input, swiglu_from_input
from coat_megatron import CoatConfig
from coat_megatron.fp8 import Fp8Tensor, OutputForm, fp8_linear, layernorm_to_fp8, rmsnorm_to_fp8, swiglu_fp8

SLACK = 1e-6  # FP32 arithmetic in another order than autograd's


def leaf(t, dtype=None, device="cpu"):
    return t.detach().clone().to(device=device, dtype=dtype or t.dtype).requires_grad_()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Where the COAT ops run (the FP32 references always run on the CPU)."""
    return request.param


def norm(kind, x, w, b, **kw):
    return rmsnorm_to_fp8(x, w, 1e-5, **kw) if kind == "rmsnorm" else layernorm_to_fp8(x, w, b, 1e-5, **kw)


def norm_grads(kind, x, w, b, dy, device="cpu", **kw):
    xs, ws, bs = leaf(x, device=device), leaf(w, device=device), leaf(b, device=device) if b is not None else None
    norm(kind, xs, ws, bs, **kw).backward(dy.to(device))
    return xs.grad.cpu(), ws.grad.cpu()


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_a_norm_keeping_its_bf16_input_has_the_exact_backward(kind, device, seed):
    x = activations((24, 320), seed)
    g = torch.Generator().manual_seed(seed)
    w, b = 1.0 + 0.2 * torch.randn(320, generator=g), 0.1 * torch.randn(320, generator=g)
    b = b if kind == "layernorm" else None
    dy = activations((24, 320), seed + 1)

    xr, wr = leaf(x, torch.float32), leaf(w)
    yr = F.rms_norm(xr, (320,), wr, 1e-5) if kind == "rmsnorm" else F.layer_norm(xr, (320,), wr, b, 1e-5)
    yr.backward(dy.float())
    dx_exact, dw_exact = norm_grads(kind, x, w, b, dy, device, input_store="bf16")
    err = (dx_exact.float() - xr.grad).abs()
    assert (err <= BF16 * xr.grad.abs() + SLACK * xr.grad.abs().amax()).all(), err.max()
    assert torch.allclose(dw_exact, wr.grad, rtol=1e-5, atol=1e-5)

    # the default reads x from its 1xG E4M3 copy: further off (in dw, which no BF16 rounding hides),
    # and exactly the copy's backward
    dx_copy, dw_copy = norm_grads(kind, x, w, b, dy, device)
    assert (dx_copy.float() - xr.grad).norm() > err.norm()
    assert (dw_copy - wr.grad).norm() > 100 * (dw_exact - wr.grad).norm()
    copy = dequantize_per_group(*quantize_per_group(x, 16, "e4m3"), 16, torch.float32)
    x2 = x.float()
    mean = x2.mean(-1) if kind == "layernorm" else None
    centred = x2 - mean[:, None] if mean is not None else x2
    rstd = 1.0 / torch.sqrt(centred.pow(2).mean(-1) + 1e-5)
    dx_of_copy = norm_backward_from_input(dy, copy, w, mean, rstd, has_bias=b is not None, dx_dtype=torch.bfloat16)[0]
    assert (dx_copy.float() - dx_of_copy.float()).abs().max() <= 2 * BF16 * dx_of_copy.float().abs().max()


def test_the_default_norm_store_is_the_fp8_copy_and_the_forward_does_not_change(seed):
    x, w = activations((16, 64), seed), torch.ones(64)
    dy = activations((16, 64), seed + 1)
    for transpose in ("store", "recompute"):
        default, fp8, exact = (norm(kind, leaf(x), w, None, transpose=transpose, **kw) for kind, kw in (
            ("rmsnorm", {}), ("rmsnorm", {"input_store": "fp8"}), ("rmsnorm", {"input_store": "bf16"})))  # fmt: skip
        assert torch.equal(default.data_fp8, fp8.data_fp8) and torch.equal(default.data_fp8, exact.data_fp8)
    assert torch.equal(
        norm_grads("rmsnorm", x, w, None, dy)[0], norm_grads("rmsnorm", x, w, None, dy, input_store="fp8")[0]
    )
    with pytest.raises(ValueError, match="input_store='e4m3': use one of fp8, bf16"):
        rmsnorm_to_fp8(leaf(x), w, input_store="e4m3")


def test_the_recomputed_norm_output_comes_from_the_exact_input_with_bf16(seed):
    """transpose="recompute" makes the wgrad operand in backward from what the norm saved: with
    input_store="bf16" that is x itself, so it equals the stored transposed copy bit for bit."""
    x, w = activations((16, 64), seed), 1.0 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(seed))
    stored = rmsnorm_to_fp8(leaf(x), w, transpose="store", input_store="bf16")
    recomputed = rmsnorm_to_fp8(leaf(x), w, transpose="recompute", input_store="bf16")
    assert recomputed.transposed is None and torch.equal(recomputed.transposed_codes(), stored.transposed)
    assert torch.equal(recomputed.transposed_codes(slice(3, 9)), stored.transposed[:, 3:9])


def test_swiglu_keeping_its_bf16_input_is_exact_forward_and_backward(device, seed):
    n_ffn = 96
    h = activations((10, 2 * n_ffn), seed)
    da = activations((10, n_ffn), seed + 1)
    hr = leaf(h, torch.float32)
    gate, up = hr.chunk(2, dim=-1)
    ar = F.silu(gate) * up
    ar.backward(da.float())

    hc = leaf(h, device=device)
    a = swiglu_fp8(hc, input_store="bf16")
    assert isinstance(a, Fp8Tensor) and a.granularity == "tensor" and a.transposed is None
    # the exact output, per tensor E4M3 (from the same FP32 values: elementwise torch, on the device)
    q, scale, q_t = quantize_per_tensor(swiglu_from_input(hc.detach()), "e4m3", transpose=True)
    assert torch.equal(a.scale, scale)
    assert torch.equal(a.data_fp8.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(a.transposed_codes(), q_t) and torch.equal(a.transposed_codes(slice(2, 5)), q_t[:, 2:5])
    err = (a.dequantize(torch.float32).cpu() - ar.detach()).abs()
    assert (err <= 2**-4 * ar.detach().abs() + 2**-10 * scale.cpu() + SLACK).all()  # one E4M3 rounding
    a.backward(da.to(device))
    err = (hc.grad.float().cpu() - hr.grad).abs()
    assert (err <= BF16 * hr.grad.abs() + SLACK * hr.grad.abs().amax()).all(), err.max()
    assert torch.equal(hc.grad, swiglu_backward_from_input(da.to(device), hc.detach(), torch.bfloat16))

    # the default saves the 1xG copy: further off
    hd = leaf(h, device=device)
    swiglu_fp8(hd).backward(da.to(device))
    assert (hd.grad.float().cpu() - hr.grad).norm() > 4 * err.norm()
    with pytest.raises(ValueError, match="give fc1 OutputForm.BF16"):
        swiglu_fp8(fp8_linear(leaf(h[:, :32]), torch.ones(2 * n_ffn, 32), output_form=OutputForm.PER_GROUP),
                   input_store="bf16")  # fmt: skip


@pytest.mark.parametrize("field", ["norm_input_store", "swiglu_input_store"])
def test_the_stores_are_validated_config_fields(field):
    assert getattr(CoatConfig(), field) == "fp8"
    assert getattr(CoatConfig(**{field: "bf16"}), field) == "bf16"
    with pytest.raises(ValueError, match=f"{field}='fp16' is not supported: use one of fp8, bf16"):
        CoatConfig(**{field: "fp16"})
    assert dataclasses.replace(CoatConfig(), **{field: "bf16"}) != CoatConfig()
