"""Inputs and comparisons shared by the kernel tests."""

import torch


def as_bytes(q: torch.Tensor) -> torch.Tensor:
    return q.detach().cpu().view(torch.uint8)


def random_activations(shape, dtype=torch.bfloat16, seed=None, outliers=True):
    """Normal values with a few per-row outliers, like real activations (fresh seed by default)."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g))
    if outliers and x.numel() >= 64:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 997),), generator=g)
        flat[idx] *= 40.0
    return x.to(dtype)
