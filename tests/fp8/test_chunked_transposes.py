"""The wgrad operand that a producer recomputes for a sequence-parallel row-parallel linear, made for
every chunk in one go (``transposed_fn(chunks=n)``: each chunk's transposed codes, chunk-major) is,
byte for byte, what the producer recomputes chunk by chunk (``transposed_fn(rows)``), the path it
replaces. On the CPU with Triton (the interpreter) and with the torch references; rows that are
zero and outliers included.
"""

from __future__ import annotations

import pytest
import torch
from fp8_bounds import activations

import coat_kernels.backend as kernel_backend
from coat_megatron.fp8 import rmsnorm_to_fp8, swiglu_fp8


@pytest.fixture(params=["triton", "reference"])
def backend(request, monkeypatch):
    monkeypatch.setattr(kernel_backend, "_OVERRIDE", request.param)
    return request.param


def _input(shape, seed):
    x = activations(shape, seed)
    x[0] = 0.0  # a zero row
    x[-1, 3] = 300.0  # an outlier
    return x


def _producers(seed):
    rows, hidden = 24, 64
    x = _input((rows, hidden), seed)
    w = 1.0 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    h = _input((rows, 2 * 48), seed + 1)
    return {
        "swiglu": swiglu_fp8(h),
        "swiglu-bf16-input": swiglu_fp8(h, input_store="bf16"),
        "norm-recompute": rmsnorm_to_fp8(x, w, transpose="recompute"),
        "norm-recompute-bf16-input": rmsnorm_to_fp8(x, w, transpose="recompute", input_store="bf16"),
    }


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_every_chunk_at_once_is_each_chunk_recomputed_alone(backend, chunks, seed):
    for name, t in _producers(seed).items():
        rows = t.shape[0]
        r_c = rows // chunks
        got = t.transposed_fn(chunks=chunks)
        if chunks == 1:  # the (N, R) transpose of every row, as before
            assert torch.equal(got.view(torch.uint8), t.transposed_fn().view(torch.uint8)), name
            continue
        assert got.shape == (chunks, t.shape[-1], r_c) and got.is_contiguous(), name
        for j in range(chunks):
            alone = t.transposed_fn(slice(j * r_c, (j + 1) * r_c))
            assert torch.equal(got[j].view(torch.uint8), alone.view(torch.uint8)), (name, j)
