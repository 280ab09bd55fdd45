import pytest
import torch
from kernel_inputs import as_bytes, random_activations

from coat_kernels import NonFiniteInputError, dequantize_per_group, fp8_format, quantize_per_group
from coat_kernels.per_group import dequantize_per_group_reference, quantize_per_group_reference

# Odd row counts and hidden sizes that are not powers of two (Llama-2-13B 5120, Llama-2-7B FFN
# 11008, 13824) next to small and 1-D cases.
SHAPES = [(48,), (7, 96), (3, 5, 160), (33, 5120), (5, 11008), (2, 3, 13824)]


def quantize_on(device, x, group_size, fmt, **kw):
    q, s = quantize_per_group(x.to(device), group_size, fmt, backend="triton", **kw)
    return q.cpu(), s.cpu()


def check_matches_reference(device, x, group_size, fmt):
    q, s = quantize_on(device, x, group_size, fmt)
    q_ref, s_ref = quantize_per_group_reference(x, group_size, fmt)
    assert q.shape == x.shape and q.dtype == fp8_format(fmt).dtype
    assert s.shape == (*x.shape[:-1], x.shape[-1] // group_size) and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert torch.equal(as_bytes(q), as_bytes(q_ref)), f"{(as_bytes(q) != as_bytes(q_ref)).sum()} codes differ"
    return q, s


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_matches_reference_on_awkward_shapes(device, shape, fmt, seed):
    check_matches_reference(device, random_activations(shape, seed=seed), 16, fmt)


@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_group_size_and_input_dtype(device, group_size, dtype, seed):
    check_matches_reference(device, random_activations((9, 384), dtype, seed=seed), group_size, "e4m3")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4099, 14336), (2, 2047, 5120)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_large_shapes_on_gpu(shape, dtype, fmt, seed):
    check_matches_reference(torch.device("cuda"), random_activations(shape, dtype, seed=seed), 16, fmt)


@pytest.mark.parametrize("fmt,bound", [("e4m3", 2.0**-4), ("e5m2", 2.0**-3)])
@pytest.mark.parametrize("group_size", [16, 128])
def test_round_trip_error_within_one_step_of_the_format(device, fmt, bound, group_size, seed):
    x = random_activations((17, 1024), torch.float32, seed=seed)
    q, s = quantize_on(device, x, group_size, fmt)
    y = dequantize_per_group(q.to(device), s.to(device), group_size, torch.float32, backend="triton").cpu()
    assert torch.equal(y, dequantize_per_group_reference(q, s, group_size, torch.float32))
    # Relative error of round-to-nearest is at most half a step (2^-mantissa_bits) in the normal
    # range; the bound is one full step. Subnormal codes (|x|/scale below the smallest normal
    # code) only have an absolute bound, half the subnormal step, times the scale.
    f = fp8_format(fmt)
    min_normal, sub_step = (2.0**-6, 2.0**-9) if fmt == "e4m3" else (2.0**-14, 2.0**-16)
    scale = s.repeat_interleave(group_size, dim=-1)
    normal = x.abs() / scale >= min_normal
    assert normal.float().mean() > 0.9
    rel = ((y - x).abs() / x.abs())[normal]
    assert rel.max() <= bound, rel.max()
    assert ((y - x).abs()[~normal] <= scale[~normal] * sub_step / 2).all()
    assert q.float().abs().amax() <= f.max


def test_zero_constant_outlier_and_subnormal_groups(device, seed):
    g = 16
    x = torch.randn(4, 8 * g, generator=torch.Generator().manual_seed(seed))
    x[0, 0:g] = 0.0  # all-zero group
    x[1, g : 2 * g] = -3.25  # constant group
    x[2, 2 * g : 3 * g] = 1e-3
    x[2, 2 * g + 5] = 3.0e4  # one huge outlier in a group of small values
    x[3, 3 * g : 4 * g] = torch.linspace(1, 16, g) * 1e-45  # FP32 subnormals only
    x[3, 4 * g : 5 * g] = torch.logspace(-8, 0, g)  # values in E4M3's subnormal range after scaling
    q, s = check_matches_reference(device, x, g, "e4m3")
    assert s[0, 0] == 1.0 and (as_bytes(q)[0, 0:g] == 0).all()
    assert s[1, 1] == torch.tensor(3.25) / 448
    y = dequantize_per_group_reference(q, s, g, torch.float32)
    assert torch.allclose(y[1, g : 2 * g], x[1, g : 2 * g], rtol=2.0**-23, atol=0)
    assert y[2, 2 * g + 5] == pytest.approx(3.0e4, rel=2.0**-4)
    assert torch.isfinite(s).all() and (s > 0).all() and torch.isfinite(y).all()
    # the outlier costs only its own group: the other groups of its row keep their precision (one
    # E4M3 step relative; an element below the group's smallest normal code, |x| < amax * 2^-6 / 448,
    # half a subnormal step (2^-9) times the group's scale)
    other = torch.cat([x[2, : 2 * g], x[2, 3 * g :]])
    other_scale = torch.cat([s[2, :2], s[2, 3:]]).repeat_interleave(g)
    tolerance = torch.maximum(other.abs() * 2.0**-4, other_scale * 2.0**-9 / 2)
    assert ((torch.cat([y[2, : 2 * g], y[2, 3 * g :]]) - other).abs() <= tolerance).all()
    assert (s[3, 3] > 0) and torch.isfinite(s[3, 3])
    assert (y[3, 3 * g : 4 * g] - x[3, 3 * g : 4 * g]).abs().max() < 1e-38


def test_non_finite_input_is_an_error_or_an_infinite_scale(device):
    x = torch.randn(3, 64)
    x[1, 20] = float("nan")
    x[2, 63] = float("inf")
    with pytest.raises(NonFiniteInputError, match="inf or NaN"):
        quantize_per_group(x.to(device), 16, "e4m3", backend="triton")
    q, s = quantize_on(device, x, 16, "e4m3", check_finite=False)
    assert torch.isinf(s[1, 1]) and torch.isinf(s[2, 3])
    assert torch.isfinite(s).sum() == s.numel() - 2
    assert (q[1, 16:32].float() == 0).all()  # +-0: the codes carry no value
    y = dequantize_per_group_reference(q, s, 16, torch.float32)
    assert torch.isnan(y[1, 16:32]).all() and torch.isfinite(y[0]).all()


def test_strided_rows_are_read_in_place_and_transposed_input_is_rejected(device):
    base = torch.randn(6, 80, dtype=torch.bfloat16)
    view = base[:, :64]
    q, s = quantize_on(device, view, 16, "e4m3")
    q_ref, s_ref = quantize_per_group_reference(view.contiguous(), 16, "e4m3")
    assert torch.equal(as_bytes(q), as_bytes(q_ref)) and torch.equal(s, s_ref)
    with pytest.raises(ValueError, match=r"contiguous\(\)"):
        quantize_per_group(torch.randn(64, 32, device=device).t(), 16, "e4m3", backend="triton")


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="not a multiple of the FP8 group size 16"):
        quantize_per_group(torch.randn(4, 40), 16)
    with pytest.raises(ValueError, match="use one of 16, 32, 64, 128"):
        quantize_per_group(torch.randn(4, 48), 24)
    with pytest.raises(ValueError, match="use 'e4m3'"):
        quantize_per_group(torch.randn(4, 48), 16, "e4m2")
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize_per_group(torch.randn(4, 48).double(), 16)
    with pytest.raises(ValueError, match="1 to 3 dimensions"):
        quantize_per_group(torch.randn(2, 2, 2, 48), 16)


def test_empty_input(device):
    q, s = quantize_on(device, torch.empty(0, 32), 16, "e4m3")
    assert q.shape == (0, 32) and s.shape == (0, 2)
