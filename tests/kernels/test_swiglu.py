import pytest
import torch
from kernel_inputs import as_bytes, random_activations

from coat_kernels import dequantize_per_group, quantize_per_group
from coat_kernels.swiglu import (
    quantize_swiglu_input,
    quantize_swiglu_input_reference,
    swiglu_backward,
    swiglu_backward_reference,
    swiglu_to_fp8,
    swiglu_to_fp8_reference,
)

SHAPES = [(7, 2 * 64), (3, 5, 2 * 160), (5, 2 * 1376)]


def fp8_input(shape, seed, group_size=16):
    return quantize_per_group(random_activations(shape, seed=seed), group_size, "e4m3")


def codes_close(got, want, max_fraction):
    """SiLU's exp differs in its last bits between Triton and torch, so a value right at a rounding
    boundary may land on the neighbouring FP8 code; never further, and rarely."""
    g, w = as_bytes(got).int(), as_bytes(want).int()
    differ = g != w
    assert ((g - w).abs()[differ] <= 1).all(), "a code is more than one step away"
    assert differ.float().mean() <= max_fraction, differ.float().mean()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("group_size", [16, 32])
def test_forward_matches_reference(device, shape, group_size, seed):
    h_q, h_s = fp8_input(shape, seed, group_size)
    got = swiglu_to_fp8(h_q.to(device), h_s.to(device), group_size, transpose=True, backend="triton")
    ref = swiglu_to_fp8_reference(h_q, h_s, group_size, transpose=True)
    assert got.q.shape == (*shape[:-1], shape[-1] // 2) and got.q_t.shape == (shape[-1] // 2, h_q.numel() // shape[-1])
    assert torch.allclose(got.amax.cpu(), ref.amax, rtol=1e-6) and torch.allclose(got.scale.cpu(), ref.scale, rtol=1e-6)
    # compare against the reference quantized with the kernel's own amax: only SiLU's last bits differ
    ref = swiglu_to_fp8_reference(h_q, h_s, group_size, transpose=True, amax=got.amax.cpu())
    codes_close(got.q.cpu(), ref.q, 1e-3)
    assert torch.equal(as_bytes(got.q_t).t(), as_bytes(got.q).reshape(-1, shape[-1] // 2))


@pytest.mark.gpu
def test_large_shape_on_gpu(seed):
    test_forward_matches_reference(torch.device("cuda"), (4099, 2 * 11008), 16, seed)


def test_transposed_recompute_is_bit_identical(device, seed):
    h_q, h_s = fp8_input((37, 2 * 96), seed)
    h_q, h_s = h_q.to(device), h_s.to(device)
    full = swiglu_to_fp8(h_q, h_s, 16, transpose=True, backend="triton")
    again = swiglu_to_fp8(h_q, h_s, 16, transpose=True, amax=full.amax, store_q=False, backend="triton")
    assert (
        again.q is None
        and torch.equal(as_bytes(again.q_t), as_bytes(full.q_t))
        and torch.equal(again.scale, full.scale)
    )


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_matches_reference(device, shape, seed):
    h_q, h_s = fp8_input(shape, seed)
    da = random_activations((*shape[:-1], shape[-1] // 2), seed=seed + 1, outliers=False)
    dh, amax = swiglu_backward(da.to(device), h_q.to(device), h_s.to(device), 16, backend="triton")
    dh_ref, amax_ref = swiglu_backward_reference(da, h_q, h_s, 16)
    assert dh.shape == h_q.shape and dh.dtype == torch.bfloat16
    assert torch.allclose(dh.cpu().float(), dh_ref.float(), rtol=2**-7, atol=1e-6)
    # the amax is that of dh as written (so a per-tensor quantization of dh can use it), one value
    assert amax.shape == () and amax.cpu() == dh.cpu().float().abs().amax()


def test_zero_input_and_bad_width():
    h_q, h_s = quantize_per_group(torch.zeros(4, 64), 16, "e4m3")
    r = swiglu_to_fp8(h_q, h_s, 16, transpose=True)
    assert r.scale == 1.0 and (as_bytes(r.q) == 0).all()
    h_q, h_s = quantize_per_group(torch.randn(4, 48), 16, "e4m3")
    with pytest.raises(ValueError, match="must be 2 x a multiple of the FP8 group size 16"):
        swiglu_to_fp8(h_q, h_s, 16)


def test_gate_up_order_is_megatrons():
    # [gate | up]: a = silu(gate) * up
    h = torch.cat([torch.full((2, 16), 2.0), torch.full((2, 16), 3.0)], dim=1)
    h_q, h_s = quantize_per_group(h, 16, "e4m3")
    r = swiglu_to_fp8(h_q, h_s, 16)
    a = dequantize_per_group(r.q, r.scale.reshape(1, 1).expand(2, 1).contiguous(), 16, torch.float32)
    assert torch.allclose(a, torch.full((2, 16), 3.0 * 2.0 * torch.sigmoid(torch.tensor(2.0)).item()), rtol=2**-4)


@pytest.mark.parametrize("shape", [(7, 2 * 64), (3, 5, 2 * 160), (33, 2 * 1376)], ids=str)
def test_fused_input_quantization_gives_the_swiglu_amax(device, shape, seed):
    h = random_activations(shape, seed=seed)
    h_q, h_s, amax = quantize_swiglu_input(h.to(device), 16, backend="triton")
    q_ref, s_ref = quantize_per_group(h, 16, "e4m3")
    assert torch.equal(as_bytes(h_q), as_bytes(q_ref)) and torch.equal(h_s.cpu(), s_ref)
    # the amax the producer computed is the one SwiGLU's own amax pass finds in the codes
    own = swiglu_to_fp8(h_q, h_s, 16, backend="triton")
    assert amax.shape == () and torch.equal(amax, own.amax)
    given = swiglu_to_fp8(h_q, h_s, 16, amax=amax, backend="triton")
    assert torch.equal(as_bytes(given.q), as_bytes(own.q)) and torch.equal(given.scale, own.scale)
    ref = quantize_swiglu_input_reference(h, 16)
    assert torch.allclose(amax.cpu(), ref[2], rtol=1e-6)
