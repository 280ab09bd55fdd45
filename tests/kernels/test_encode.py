"""scaling.encode_fp8 (FP8 bytes by integer arithmetic) against torch's casts, every case."""

import pytest
import torch
import triton
import triton.language as tl

from coat_kernels.scaling import encode_fp8

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0, 3, 7), "e5m2": (torch.float8_e5m2, 57344.0, 2, 15)}


@triton.jit
def _encode_kernel(y_ptr, out_ptr, n, MBITS: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(y_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, encode_fp8(y, MBITS, BIAS), mask=offs < n)


def every_case(fmt):
    """Every FP8 value, the midpoints between neighbours (ties), points just off them, zeros and
    FP32 subnormals, both signs, clamped to the format's range."""
    dtype, fmax, _, _ = FORMATS[fmt]
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20), values * (1 + 2.0**-12)])
    y = torch.cat([values, mids, near, torch.tensor([0.0, -0.0, 1e-45, -3e-42, 2.0**-40])])
    y = torch.cat([y, -y]).clamp(-fmax, fmax)
    return y, y.to(dtype).view(torch.uint8)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encode_matches_torch_casts(device, fmt):
    y, want = every_case(fmt)
    out = torch.empty(y.numel(), dtype=torch.uint8, device=device)
    _, _, mbits, bias = FORMATS[fmt]
    _encode_kernel[(triton.cdiv(y.numel(), 1024),)](y.to(device), out, y.numel(), MBITS=mbits, BIAS=bias, BLOCK=1024)
    got = out.cpu()
    assert torch.equal(got, want), f"{(got != want).sum()} of {y.numel()} differ, e.g. {y[got != want][:5].tolist()}"
