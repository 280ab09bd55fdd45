import pytest
import torch

from coat_kernels import quantize_per_tensor
from coat_kernels.gemm import fp8_gemm, fp8_gemm_reference


def operands(m, k, n, a_fmt="e4m3", b_fmt="e4m3", seed=0):
    g = torch.Generator().manual_seed(seed)
    a_q, a_s = quantize_per_tensor(torch.randn(m, k, generator=g), a_fmt)
    b_q, b_s, b_t = quantize_per_tensor(torch.randn(n, k, generator=g), b_fmt, transpose=True)
    return a_q, a_s, b_q.t(), b_s  # b (k, n) column-major


def test_reference_is_the_dequantized_product():
    a_q, a_s, b, b_s = operands(8, 32, 16)
    bias = torch.randn(16)
    want = (a_q.float() * a_s) @ (b.float() * b_s) + bias
    assert torch.allclose(fp8_gemm(a_q, a_s, b, b_s, out_dtype=torch.float32, bias=bias), want, rtol=1e-6, atol=1e-6)


def test_bad_operands_are_rejected():
    a_q, a_s, b, b_s = operands(8, 32, 16, "e5m2", "e5m2")
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        fp8_gemm(a_q, a_s, b, b_s)
    with pytest.raises(TypeError, match="FP8 operands"):
        fp8_gemm(torch.randn(4, 4), a_s, b, b_s)
    a_q, a_s, b, b_s = operands(8, 32, 16)
    with pytest.raises(ValueError, match="shapes do not match"):
        fp8_gemm(a_q, a_s, b[:16], b_s)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4096, 4096, 11008), (100, 4096, 4096), (4096, 2047, 512)])
@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
def test_scaled_mm_matches_reference(m, k, n, fmts):
    a_q, a_s, b, b_s = (t.cuda() for t in operands(m, k, n, *fmts))
    b = b.t().contiguous().t()
    got = fp8_gemm(a_q, a_s, b, b_s, out_dtype=torch.float32)
    want = fp8_gemm_reference(a_q, a_s, b, b_s, out_dtype=torch.float32)
    # both accumulate the same products in FP32, in different orders: error <= k * 2^-23 * sum|a||b|
    bound = k * 2**-23 * ((a_q.float().abs() * a_s) @ (b.float().abs() * b_s))
    assert ((got - want).abs() <= bound + 1e-6).all()
