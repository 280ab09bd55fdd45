"""Worst-case FP8 rounding bounds, used to state the error bounds of the FP8 ops' tests.

Round-to-nearest into a format with m mantissa bits moves a normal value x by at most half a step,
2^-(m+1) |x|: 2^-4 for E4M3, 2^-3 for E5M2. Below the smallest normal (2^-6 for E4M3, 2^-14 for
E5M2, in units of the scale) the step is fixed, so the error is at most half the subnormal step
times the scale: 2^-10 for E4M3, 2^-17 for E5M2. So a quantized value is x + d with

    |d| <= eps |x| + sigma,   (eps, sigma) = (2^-4, 2^-10 scale) or (2^-3, 2^-17 scale).
"""

import torch

EPS = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
SUB = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
BF16 = 2.0**-8  # BF16 rounding of an output: half of its 2^-7 relative step


def quant_error(x: torch.Tensor, fmt: str, scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """Elementwise bound on |quantize(x) - x| for per-tensor scaling (scale from x's amax if None)."""
    x = x.float()
    if scale is None:
        scale = x.abs().amax() / FMAX[fmt]
    return EPS[fmt] * x.abs() + SUB[fmt] * scale


def quant_error_groups(x: torch.Tensor, fmt: str, group_size: int) -> torch.Tensor:
    """As quant_error, with one scale per 1 x group_size group of the last dim."""
    x = x.float()
    groups = x.reshape(*x.shape[:-1], -1, group_size)
    scale = groups.abs().amax(dim=-1, keepdim=True) / FMAX[fmt]
    return (EPS[fmt] * groups.abs() + SUB[fmt] * scale).reshape(x.shape)


def product_error(a, da, b, db):
    """Bound on |(a+ea) @ (b+eb) - a @ b| given |ea| <= da, |eb| <= db (elementwise)."""
    return da @ b.abs() + a.abs() @ db + da @ db


def activations(shape, seed, dtype=torch.bfloat16):
    """Normal values scaled per row, with rare 40x outliers, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(0.5 * torch.randn(*shape[:-1], 1, generator=g))
    flat = x.view(-1)
    flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 499),), generator=g)] *= 40.0
    return x.to(dtype)
