"""A COAT norm's weight (and bias) gradient under Megatron's gradient-accumulation protocol
(``into_main_grad``, ``CoatConfig.fuse_wgrad_accumulation``), as COAT's linears follow it: where the
parameter has DDP's ``main_grad``, the backward's own kernels write dW there at a step's first
micro-batch (``grad_added_to_main_grad`` False) and add it after, rounding once, and autograd gets a
placeholder with the flag set, which DDP's hook drops; without a ``main_grad``, or with
``into_main_grad`` off, autograd gets dW in the parameter's dtype. Both backends: the torch
references and the Triton kernels (interpreted on a CPU), each against itself."""

from __future__ import annotations

import pytest
import torch
from fp8_bounds import activations

import coat_kernels.backend as backend
from coat_megatron.fp8 import layernorm_to_fp8, rmsnorm_to_fp8

SHAPE = (24, 160)
GARBAGE = 7.0  # what main_grad holds before a step's first micro-batch: written over, not added to


@pytest.fixture(params=["reference", "triton", pytest.param("cuda", marks=pytest.mark.gpu)])
def kernels(request, monkeypatch):
    """Where and how the norm runs: the torch references or the Triton kernels (interpreted) on the
    CPU, or the GPU's kernels."""
    if request.param != "cuda":
        monkeypatch.setattr(backend, "_OVERRIDE", request.param)
    return request.param


def inputs(kind, seed, kernels):
    device = "cuda" if kernels == "cuda" else "cpu"
    g = torch.Generator().manual_seed(seed)
    w = (1.0 + 0.2 * torch.randn(SHAPE[1], generator=g)).to(torch.bfloat16)
    b = (0.1 * torch.randn(SHAPE[1], generator=g)).to(torch.bfloat16) if kind == "layernorm" else None
    batches = [(activations(SHAPE, seed + 2 * i), activations(SHAPE, seed + 2 * i + 1)) for i in range(2)]
    move = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return move(w), move(b), [(move(x), move(dy)) for x, dy in batches]


def params(w, b, main_dtype=None, flag=None):
    out = []
    for t in (w, b):
        if t is None:
            out.append(None)
            continue
        p = torch.nn.Parameter(t.clone())
        if main_dtype is not None:
            p.main_grad = torch.full(t.shape, GARBAGE, dtype=main_dtype, device=t.device)
        if flag is not None:
            p.grad_added_to_main_grad = flag
        out.append(p)
    return out


def micro_batch(kind, w, b, x, dy, **kw):
    x = x.detach().clone().requires_grad_()
    y = rmsnorm_to_fp8(x, w, 1e-5, **kw) if kind == "rmsnorm" else layernorm_to_fp8(x, w, b, 1e-5, **kw)
    y.backward(dy)
    return x.grad


KINDS = pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
STORES = pytest.mark.parametrize("store", ["fp8", "bf16"])


@KINDS
@STORES
def test_a_steps_first_micro_batch_writes_main_grad_and_autograd_gets_a_placeholder(kernels, kind, store, seed):
    w, b, batches = inputs(kind, seed, kernels)
    (x, dy), _ = batches
    plain = params(w, b)
    dx_plain = micro_batch(kind, *plain, x, dy, input_store=store)  # no main_grad: dW to autograd
    fused = params(w, b, torch.bfloat16, flag=False)
    dx_fused = micro_batch(kind, *fused, x, dy, input_store=store, into_main_grad=True)
    assert torch.equal(dx_fused, dx_plain)
    for p, q in zip(plain, fused):
        if p is None:
            continue
        assert p.grad.dtype == p.dtype
        assert torch.equal(q.main_grad, p.grad), "written over the garbage, rounded once as the plain dW"
        assert q.grad_added_to_main_grad is True
        assert q.grad is not None and q.grad.shape == q.shape  # the placeholder, which DDP's hook drops


@KINDS
@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_later_micro_batches_add_into_main_grad_rounding_once(kernels, kind, main_dtype, seed):
    w, b, batches = inputs(kind, seed, kernels)
    alone = []
    for x, dy in batches:  # each micro-batch's dW alone, in FP32
        ps = params(w, b, torch.float32, flag=False)
        micro_batch(kind, *ps, x, dy, into_main_grad=True)
        alone.append([p.main_grad.clone() if p is not None else None for p in ps])
    ps = params(w, b, main_dtype, flag=False)
    for x, dy in batches:
        micro_batch(kind, *ps, x, dy, into_main_grad=True)  # the first sets the flag: the second adds
    for i, p in enumerate(ps):
        if p is None:
            continue
        first = alone[0][i].to(main_dtype).float()
        assert torch.equal(p.main_grad, (first + alone[1][i]).to(main_dtype))


@KINDS
def test_without_the_protocol_autograd_gets_the_gradient(kernels, kind, seed):
    w, b, batches = inputs(kind, seed, kernels)
    (x, dy), _ = batches
    plain = params(w, b)
    micro_batch(kind, *plain, x, dy)
    # into_main_grad off: DDP's hook adds what autograd gets; main_grad is left alone
    off = params(w, b, torch.bfloat16, flag=False)
    micro_batch(kind, *off, x, dy, into_main_grad=False)
    # a main_grad without Megatron's flag (nobody says it was zeroed, no DDP hook to drop a placeholder):
    # added to, as a linear's, and autograd gets None
    no_flag = params(w, b, torch.float32)
    micro_batch(kind, *no_flag, x, dy, into_main_grad=True)
    fresh = params(w, b, torch.float32, flag=False)
    micro_batch(kind, *fresh, x, dy, into_main_grad=True)
    for p, q, r, f in zip(plain, off, no_flag, fresh):
        if p is None:
            continue
        assert torch.equal(q.grad, p.grad) and (q.main_grad == GARBAGE).all() and q.grad_added_to_main_grad is False
        assert r.grad is None and torch.equal(r.main_grad, GARBAGE + f.main_grad)


def test_zero_out_wgrad_gets_zeros(kernels, seed):
    w, b, batches = inputs("rmsnorm", seed, kernels)
    (x, dy), _ = batches
    (p, _) = params(w, b, torch.float32, flag=False)
    p.zero_out_wgrad = True
    micro_batch("rmsnorm", p, None, x, dy, into_main_grad=True)
    assert p.grad is not None and not p.grad.any() and p.main_grad.abs().sum() > 0
