"""benchmarks/pa_optimizer_emulation.py: why te-fp8-pa (Megatron's precision-aware optimizer with FP8
moments, i.e. TE FusedAdam's per-tensor E4M3 m and v) diverges, and that coat-compare asks Megatron
for exactly what megatron.training's flags ask for."""

import math
import sys

import pytest
import torch
from load_file import load_file

emulation = load_file("benchmarks/pa_optimizer_emulation.py", "pa_optimizer_emulation")

BETAS = (0.9, 0.95)
# E4M3's smallest subnormal is 2^-9 and one scale maps the tensor's amax to 448: an element below
# half the smallest subnormal after scaling, x / amax < 2^-10 / 448, is stored as 0.
E4M3_ZERO_BELOW = 2.0**-10 / 448.0


def output_layer_gradient(seed: int) -> torch.Tensor:
    """(512, 128) FP32: an output layer's gradient under a byte corpus and a large vocabulary. Rows of
    tokens that occur get gradients of about 1e-2; the rest (p_j * h, p_j shrinking as training
    pushes their logits down) get row scales spread log-uniformly over 1e-3 .. 1e-7 of that."""
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.cat([torch.full((64,), 1e-2), 1e-2 * 10.0 ** -torch.empty(448).uniform_(3, 7, generator=g)])
    return torch.randn(512, 128, generator=g) * row_scale[:, None]


def test_per_tensor_e4m3_zeroes_exactly_what_its_range_cannot_hold(seed):
    x = output_layer_gradient(seed).abs()
    stored = emulation.te_per_tensor_e4m3(x, signed=False)
    ratio = x / x.max()
    assert torch.all(stored[ratio < E4M3_ZERO_BELOW * 0.99] == 0)
    assert torch.all(stored[ratio > E4M3_ZERO_BELOW * 1.01] > 0)
    normal = ratio > 2.0**-6 / 448  # E4M3 normals: 3 mantissa bits, relative error <= 2^-4
    assert torch.allclose(stored[normal], x[normal], rtol=2.0**-4, atol=0)


def test_v_underflows_per_tensor_but_not_in_coats_format_while_m_survives(seed):
    """One Adam step's moments: v = (1 - b2) g^2 spans twice m's octaves, so one scale per tensor
    loses v for every element with |g| < 2^-9.4 of the largest while keeping its m; COAT's groups of
    128 with range expansion keep both."""
    g = output_layer_gradient(seed)
    m, v = (1 - BETAS[0]) * g, (1 - BETAS[1]) * g * g
    te_m, te_v = emulation.te_per_tensor_e4m3(m), emulation.te_per_tensor_e4m3(v, signed=False)
    coat_m, coat_v = emulation.coat_expanded(m), emulation.coat_expanded(v, signed=False)

    te_v_lost = ((v > 0) & (te_v == 0)).float().mean().item()
    te_m_alive_v_dead = ((te_m != 0) & (te_v == 0)).float().mean().item()
    assert te_v_lost > 0.5, te_v_lost
    assert te_m_alive_v_dead > 0.2, te_m_alive_v_dead
    assert ((v > 0) & (coat_v == 0)).sum() == 0
    assert ((m != 0) & (coat_m == 0)).sum() == 0
    # E4M3 rounding, coarser at the bottom of a group's expanded range: every element kept to well
    # within a factor 1.5 (1.22 in sqrt(v), the update's denominator), most to a few percent
    kept = v > 0  # a gradient can be exactly 0 (or square to 0 in FP32): its v is 0, and so is COAT's
    assert (coat_v[~kept] == 0).all()
    relative = (coat_v[kept] - v[kept]).abs() / v[kept]
    assert relative.max() < 0.5 and relative.median() < 0.05, (relative.max(), relative.median())


def test_adam_update_bound_is_exact_adams_largest_update():
    """Gradients shrinking by b1 / b2 per step attain the bound (Cauchy-Schwarz with equality);
    any other sequence, heavy-tailed or not, stays below it."""
    b1, b2 = BETAS
    for steps in (1, 2, 5, 30, 200):
        m = v = 0.0
        for i in range(1, steps + 1):
            grad = (b1 / b2) ** -i  # grows: g_i proportional to (b1 / b2)^(steps - i), up to a constant
            m, v = b1 * m + (1 - b1) * grad, b2 * v + (1 - b2) * grad * grad
        u = (m / (1 - b1**steps)) / math.sqrt(v / (1 - b2**steps))
        assert u == pytest.approx(emulation.adam_update_bound(steps, b1, b2), rel=1e-9)
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(200, 4096, generator=g) * torch.exp(3 * torch.randn(200, 4096, generator=g))
    m, v = torch.zeros(4096, dtype=torch.float64), torch.zeros(4096, dtype=torch.float64)
    for t in range(1, 201):
        m = b1 * m + (1 - b1) * grads[t - 1].double()
        v = b2 * v + (1 - b2) * grads[t - 1].double() ** 2
        u = (m / (1 - b1**t)) / (v / (1 - b2**t)).sqrt()
        assert u.abs().max().item() <= emulation.adam_update_bound(t, b1, b2) * (1 + 1e-9)


def test_stored_moments_make_updates_exact_adam_cannot():
    """An element 1e-4 below its tensor's largest keeps m but loses v under per-tensor E4M3: a
    steady gradient then gets an update above exact Adam's bound, and a zero gradient (a token
    absent from the batch) one of m_hat / eps. COAT's format keeps v and the update in bound."""
    b1, b2 = BETAS
    steady = [1e-4] * 20
    for fmt, blows_up in (("fp32", False), ("coat", False), ("te-fp8", True)):
        param = torch.nn.Parameter(torch.zeros(2))
        opt = emulation.EmulatedAdamW(
            [("w", param)], fmt, lr=1.0, weight_decay=0.0, clip_grad=math.inf, betas=BETAS, eps=1e-8
        )
        largest = 0.0
        for t, small in enumerate(steady + [0.0], start=1):
            before = param.detach().clone()
            param.grad = torch.tensor([1.0, small])
            opt.step()
            largest = max(largest, (before - param.detach())[1].abs().item())  # lr 1: the update itself
        bound = emulation.adam_update_bound(len(steady) + 1, b1, b2)
        if blows_up:
            assert opt.v["w"][1] == 0 and opt.m["w"][1] != 0
            assert largest > 100 * bound, largest  # m_hat / eps at the zero-gradient step
        else:
            assert largest <= bound * 1.1, (fmt, largest)  # E4M3 rounding of m and v at most


def test_coat_compare_asks_megatron_for_what_megatron_trainings_flags_ask_for(monkeypatch):
    """te-fp8-pa's optimizer fields equal megatron.training's parse of --use-precision-aware-optimizer
    --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 --fp8-recipe tensorwise (training.py
    get_megatron_optimizer_config copies every OptimizerConfig field from these args)."""
    pytest.importorskip("megatron.training")
    from megatron.training import arguments

    from coat_compare.build import PRECISION_AWARE_FP8_FIELDS
    from coat_compare.modes import MODES

    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--vocab-size 256 --micro-batch-size 1 --train-iters 1 --lr 3e-4 --bf16 --use-distributed-optimizer "
        "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise --mock-data "
        "--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"
    ).split()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    # parse_and_validate_args without setting Megatron's global args (other tests set their own)
    args = arguments.parse_args()
    arguments.validate_args(args, {"tokenizer_type": "NullTokenizer"})
    for field, value in PRECISION_AWARE_FP8_FIELDS.items():
        assert getattr(args, field) == value, field
    assert args.fp8_recipe == MODES["te-fp8-pa"].fp8_recipe
    assert args.accumulate_allreduce_grads_in_fp32 == MODES["te-fp8-pa"].grad_fp32
