"""Where the kernels under test run: the Triton interpreter on CPU, or a CUDA GPU (marked gpu).

Either way the result is compared with the torch reference computed on the CPU from the same
input, FP8 codes as bytes.
"""

import os

import pytest
import torch

TARGETS = [
    pytest.param("interpreter", id="interpreter"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=TARGETS)
def device(request):
    if request.param == "interpreter":
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "0":
            pytest.skip("interpreter runs only on machines without CUDA")
        return torch.device("cpu")
    return torch.device("cuda")


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


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Poison what torch.empty hands out (FP8: the NaN code 0x7F, FP32/BF16: NaN), so that an
    element a kernel fails to write cannot pass for a correct one."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t.view(torch.uint8).fill_(0x7F)
        elif t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
