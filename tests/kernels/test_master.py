"""The split FP32 master weight: BF16 high half + int16 low word, bit-exact, and the fused AdamW
step on it bit-identical to the step on FP32 masters, in Triton and in the reference."""

import copy

import pytest
import torch
from test_fp8_adamw import HYPER, grads_for, make_tensors, to_device

from coat_kernels import fp8_adamw_step, join_master, split_master


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def patterns(*values: int) -> torch.Tensor:
    v = torch.tensor(values, dtype=torch.int64)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32).view(torch.float32)


# both rounding ties of an even and an odd BF16 pattern, either sign; zeros, subnormals, the
# largest finite FP32 below the BF16 overflow threshold, a carry into the exponent (0x3F7FFFFF)
EDGES = patterns(
    0x3F808000,
    0x3F818000,
    0xBF808000,
    0xBF818000,
    0x3F807FFF,
    0x3F80FFFF,
    0x3F7FFFFF,
    0xBF7FFFFF,
    0x00000000,
    0x80000000,
    0x00000001,
    0x80000001,
    0x00008000,
    0x80008000,
    0x007FFFFF,
    0x7F7F7FFF,
    0xFF7F7FFF,
)


def test_split_and_join_are_bit_exact_and_the_high_half_is_a_nearest_bf16(seed):
    g = torch.Generator().manual_seed(seed)
    # random bit patterns over every finite exponent, plus ordinary weights and the edge cases
    raw = torch.randint(0, 2**32, (200000,), generator=g, dtype=torch.int64)
    x = patterns(*raw.tolist())
    x = x[torch.isfinite(x)]
    x = torch.cat([x, torch.randn(10000, generator=g) * 0.02, EDGES])
    hi, lo = split_master(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(bits(join_master(hi, lo)), bits(x))
    finite = torch.isfinite(hi)
    # as near as round-to-nearest-even (ties away from zero instead: equal distance)
    err, err_rne = (hi.float() - x).abs(), (x.bfloat16().float() - x).abs()
    assert torch.equal(err[finite], err_rne[finite])
    differs = (hi != x.bfloat16()) & finite
    assert ((bits(x)[differs] & 0xFFFF) == 0x8000).all(), "the high half differs from RNE only at exact ties"
    assert differs.any() and hi[-len(EDGES) :][0].view(torch.int16) == 0x3F81  # the even tie rounded away from zero


def test_join_checks_its_inputs():
    with pytest.raises(TypeError, match="int16 low word"):
        join_master(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="FP32"):
        split_master(torch.zeros(3, dtype=torch.bfloat16))


SHAPES = [(300,), (64, 65), (1,), (0,), (5000,)]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_step_on_split_masters_equals_the_step_on_fp32_masters_over_many_steps(device, seed, grad_dtype):
    """Reference and Triton, 12 steps: the joined master is the FP32 master bit for bit, the BF16
    half is its nearest BF16 (ties away from zero), the states are the same bytes."""
    fp32 = make_tensors(SHAPES, seed=seed)
    fp32[0][:] = [p * 0.05 for p in fp32[0]]
    split = copy.deepcopy(fp32)
    halves = [split_master(p) for p in split[0]]
    split_dut = to_device(copy.deepcopy(split), device)
    his_dut, los_dut = [h.clone().to(device) for h, _ in halves], [lo.clone().to(device) for _, lo in halves]
    his, los = [h.clone() for h, _ in halves], [lo.clone() for _, lo in halves]
    for step in range(1, 13):
        grads = grads_for(SHAPES, step, seed, grad_dtype)
        fp8_adamw_step(fp32[0], grads, fp32[1], fp32[2], model_params=fp32[3], step=step, backend="reference", **HYPER)
        fp8_adamw_step(his, grads, split[1], split[2], master_lows=los, step=step, backend="reference", **HYPER)
        fp8_adamw_step(
            his_dut,
            [g.to(device) for g in grads],
            split_dut[1],
            split_dut[2],
            master_lows=los_dut,
            step=step,
            exact_math=True,
            backend="triton",
            **HYPER,
        )
        for p, h, lo, hd, ld in zip(fp32[0], his, los, his_dut, los_dut):
            assert torch.equal(bits(join_master(h, lo)), bits(p)), step
            assert torch.equal(hd.cpu().view(torch.int16), h.view(torch.int16)) and torch.equal(ld.cpu(), lo), step
            assert torch.equal(h, split_master(p)[0])
        for a, b, c in zip(fp32[1] + fp32[2], split[1] + split[2], split_dut[1] + split_dut[2]):
            assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
            assert torch.equal(a.codes.view(torch.uint8), c.codes.cpu().view(torch.uint8))
            assert torch.equal(a.scale, c.scale.cpu())
    assert any((lo != 0).any() for lo in los)


def test_split_step_checks_its_arguments():
    params, m, v, model = make_tensors([(10,)])
    grads = grads_for([(10,)], 1, 0)
    hi, lo = split_master(params[0])
    with pytest.raises(ValueError, match="no model_params"):
        fp8_adamw_step([hi], grads, m, v, model_params=model, master_lows=[lo], step=1, **HYPER)
    with pytest.raises(TypeError, match="int16 low word"):
        fp8_adamw_step([hi], grads, m, v, master_lows=[lo.int()], step=1, **HYPER)
    with pytest.raises(TypeError, match="int16 low word"):
        fp8_adamw_step(params, grads, m, v, master_lows=[lo], step=1, **HYPER)
