"""coat_kernels.log2_exp2: the exact log2, exp2 and power against float64, and the Triton device
functions against their torch references, bit for bit (FMA contraction off, as the exact kernels run)."""

import torch
import triton
import triton.language as tl

from coat_kernels.log2_exp2 import (
    exp2_ieee,
    exp2_ieee_reference,
    log2_ieee,
    log2_ieee_reference,
    pow_ieee,
    pow_ieee_reference,
)


def test_log2_and_exp2_are_accurate_and_exact_at_powers_of_two(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(200_000, generator=g, dtype=torch.float64) * 25).float()
    x = torch.cat([x[torch.isfinite(x) & (x > 0)], torch.tensor([1e-45, 3e-39, 1.17549435e-38, 3.4e38])])
    exact = torch.log2(x.double())
    assert ((log2_ieee_reference(x).double() - exact).abs() / exact.abs().clamp_min(1)).max() < 2e-7
    powers = torch.arange(-149, 128, dtype=torch.float64)
    assert torch.equal(log2_ieee_reference(torch.exp2(powers).float()).double(), powers)
    assert torch.equal(exp2_ieee_reference(powers.float()).double(), torch.exp2(powers))
    a = (torch.rand(200_000, generator=g, dtype=torch.float64) * 250 - 125).float()
    ref = torch.exp2(a.double())
    assert ((exp2_ieee_reference(a).double() - ref) / ref).abs().max() < 3e-7


def test_pow_is_exact_at_k_1_zero_at_0_and_close_to_float64(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.exp(torch.randn(20_000, generator=g))  # |log2 a| up to about 6: a^16 stays normal
    k = torch.randint(1, 16 * 16 + 1, (20_000,), generator=g).float() / 16  # the multiples of 1/16 in (0, 16]
    assert torch.equal(pow_ieee_reference(a, torch.ones_like(a)), a)
    assert torch.equal(pow_ieee_reference(torch.zeros(3), torch.tensor([0.5, 1.0, 16.0])), torch.zeros(3))
    want = a.double() ** k.double()
    got = pow_ieee_reference(a, k).double()
    # a^k = 2^(k log2 a): log2's error (2e-7 of max(|log2 a|, 1)) and the rounding of k log2 a
    # (6e-8 of it) move the exponent, which moves the result by ln 2 times as much, relative;
    # exp2 adds its own 3e-7
    log2_a = torch.log2(a.double()).abs()
    exponent_error = k.double() * 2e-7 * log2_a.clamp_min(1) + 6e-8 * k.double() * log2_a
    assert ((got - want).abs() <= (0.7 * exponent_error + 3e-7) * want).all()


@triton.jit
def _elementwise_kernel(x_ptr, k_ptr, a_ptr, log2_ptr, exp2_ptr, pow_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    k = tl.load(k_ptr + offs, mask=mask, other=1.0)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0)
    tl.store(log2_ptr + offs, log2_ieee(tl.where(x > 0.0, x, 1.0)), mask=mask)
    tl.store(exp2_ptr + offs, exp2_ieee(a), mask=mask)
    tl.store(pow_ptr + offs, pow_ieee(x, k), mask=mask)


def test_triton_functions_equal_their_references_bit_for_bit(device, seed):
    g = torch.Generator().manual_seed(seed)
    n = 3000
    x = torch.exp(torch.randn(n, generator=g) * 20)
    x[:4] = torch.tensor([1e-45, 3e-39, 1.0, 3.4e38])  # subnormals, 1 and the largest binade
    x[4] = 0.0  # pow's special case
    k = torch.randint(1, 16 * 16 + 1, (n,), generator=g).float() / 16
    k[5:9] = 1.0
    a = torch.rand(n, generator=g) * 500 - 250  # past +-200, where exp2 saturates to 0 and inf
    outs = [torch.empty(n, device=device) for _ in range(3)]
    block = 1024
    _elementwise_kernel[(triton.cdiv(n, block),)](
        x.to(device), k.to(device), a.to(device), *outs, n, BLOCK=block, enable_fp_fusion=False
    )
    log2_got, exp2_got, pow_got = (o.cpu() for o in outs)
    assert torch.equal(log2_got, log2_ieee_reference(torch.where(x > 0, x, 1.0)))
    assert torch.equal(exp2_got, exp2_ieee_reference(a))
    assert torch.equal(pow_got, pow_ieee_reference(x, k))
    assert exp2_got.isinf().any() and (exp2_got == 0).any()
