import math

import pytest
import torch
from kernel_inputs import as_bytes

from coat_kernels import ExpandedFp8, NonFiniteInputError, dequantize_expanded, quantize_expanded
from coat_kernels.expanded import dequantize_expanded_reference, k_target, quantize_expanded_reference


def adam_like(kind: str, n: int, seed: int) -> torch.Tensor:
    """Values shaped like Adam's states: m (signed, ~3 decades), v (positive, ~1 decade), or wide."""
    g = torch.Generator().manual_seed(seed)
    if kind == "m":
        return torch.randn(n, generator=g) * 1e-3 * torch.exp(torch.randn(n, generator=g))
    if kind == "v":
        return 1e-6 * torch.exp(torch.rand(n, generator=g) * 2.3)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)


def assert_same_state(a: ExpandedFp8, b: ExpandedFp8):
    assert a.codes.shape == b.codes.shape and a.codes.dtype == b.codes.dtype
    diff = (as_bytes(a.codes) != as_bytes(b.codes)).sum()
    assert diff == 0, f"{diff} of {a.codes.numel()} codes differ"
    for name in ("scale", "k", "center"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x.cpu(), y.cpu()), f"{name} differs in {(x.cpu() != y.cpu()).sum()} groups"


def on(device, state: ExpandedFp8) -> ExpandedFp8:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return ExpandedFp8(
        state.codes.to(device),
        state.scale.to(device),
        move(state.k),
        move(state.center),
        state.group_size,
        state.fmt,
        state.signed,
    )


def off(state: ExpandedFp8) -> ExpandedFp8:
    return on(torch.device("cpu"), state)


@pytest.mark.parametrize("shape", [(1,), (127,), (129,), (1000,), (7, 300), (2, 3, 130)], ids=str)
@pytest.mark.parametrize("kind", ["m", "v", "wide"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_kernel_matches_reference_bit_for_bit(device, shape, kind, fmt, seed):
    x = adam_like(kind, math.prod(shape), seed).view(shape)
    signed = kind != "v"
    state = off(quantize_expanded(x.to(device), 128, fmt, signed, exact_math=True, backend="triton"))
    ref = quantize_expanded_reference(x, 128, fmt, signed=signed)
    assert_same_state(state, ref)
    assert state.scale.shape == (math.ceil(x.numel() / 128),)
    y = dequantize_expanded(on(device, state), exact_math=True, backend="triton").cpu()
    assert torch.equal(y, dequantize_expanded_reference(ref))
    assert y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("expansion", [True, False])
@pytest.mark.parametrize("group_size", [32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_sizes_input_dtypes_and_expansion_off(device, expansion, group_size, dtype, seed):
    x = adam_like("m", 3 * group_size + 5, seed).to(dtype)
    state = off(
        quantize_expanded(x.to(device), group_size, "e4m3", expansion=expansion, exact_math=True, backend="triton")
    )
    assert_same_state(state, quantize_expanded_reference(x, group_size, "e4m3", expansion=expansion))
    y = dequantize_expanded(on(device, state), exact_math=True, backend="triton").cpu()
    assert torch.equal(y, dequantize_expanded_reference(state))
    if not expansion:
        assert state.k is None and state.center is None
        # plain per-group absmax: exactly code * scale
        scale = state.scale.repeat_interleave(group_size)[: x.numel()]
        assert torch.equal(y, state.codes.float() * scale)


def test_edge_groups_are_finite_and_handled_without_expansion(device):
    g = 128
    x = torch.randn(10 * g + 1) * 1e-3
    x[0:g] = 0.0  # all zero
    x[g : 2 * g] = -2.5e-4  # one magnitude (R = 1), signs mixed below
    x[g : 2 * g : 2] = 2.5e-4
    x[2 * g : 3 * g] = 0.0
    x[2 * g + 7] = 3e-5  # a single non-zero value
    x[3 * g : 4 * g] = torch.linspace(1, 2, g) * 1e-44  # FP32 subnormals
    x[4 * g : 5 * g] = torch.logspace(-37, 37, g)  # R = 1e74: k clamps to k_min
    x[5 * g : 6 * g] = 1.0 + torch.arange(g) * 2.0**-20  # R = 1 + 1.2e-4: k clamps to k_max
    x[6 * g : 7 * g] = 1000.0
    x[6 * g] = torch.nextafter(torch.tensor(1000.0), torch.tensor(2000.0))  # R one ULP above 1: below log2's resolution
    x[7 * g : 8 * g : 2] = 0.0  # zeros inside a group are not its minimum
    x[8 * g : 9 * g] = torch.tensor([-1.0, 1.0]).repeat(g // 2) * torch.linspace(0.01, 1, g)
    # 10*g: the last group holds a single element (ragged)
    state = off(quantize_expanded(x.to(device), g, "e4m3", exact_math=True, backend="triton"))
    assert_same_state(state, quantize_expanded_reference(x, g, "e4m3"))
    y = dequantize_expanded_reference(state)
    assert torch.isfinite(state.scale).all() and (state.scale > 0).all()
    assert torch.isfinite(state.k).all() and torch.isfinite(state.center).all() and torch.isfinite(y).all()
    plain = [0, 1, 2, 6, 10]
    assert (state.k[plain] == 1).all() and (state.center[plain] == 1).all()
    assert (y[0:g] == 0).all() and (as_bytes(state.codes[0:g]) == 0).all() and state.scale[0] == 1
    assert torch.allclose(y[g : 2 * g], x[g : 2 * g], rtol=2.0**-22, atol=0)  # a one-magnitude group is exact
    assert y[2 * g + 7] == pytest.approx(3e-5, rel=2.0**-22) and (y[2 * g : 2 * g + 7] == 0).all()
    assert state.k[4] == 1 / 16 and state.k[5] == 16.0
    assert y[10 * g] == pytest.approx(x[10 * g].item(), rel=2.0**-22)
    # a ratio of exactly 2^4: k = floor(16 * log2(448^2/2) / 4) / 16, evaluated in float64
    z = torch.full((g,), 3.0)
    z[5] = 3.0 / 16
    kz = quantize_expanded_reference(z, g).k[0].item()
    assert kz == math.floor(16 * math.log2(448**2 / 2) / 4) / 16 == 4.125
    for i in (3, 4, 5, 7, 8):  # expanded groups: the code's rounding error, raised to the power 1/k
        sl = slice(i * g, (i + 1) * g)
        nz = x[sl] != 0
        q = state.codes[sl].float().abs()[nz]
        assert (q > 0).all()  # R^k <= 448^2/2 keeps the smallest value above E4M3's smallest subnormal
        # half a step relative to the value before rounding: 2^-4 for normal codes, 2^-10 / y below 2^-6
        code_err = torch.where(q >= 2.0**-6, 2.0**-4, 2.0**-10 / (q - 2.0**-10).clamp_min(2.0**-10))
        inv_k = 1 / state.k[i]
        bound = torch.maximum((1 + code_err) ** inv_k - 1, 1 - (1 - code_err).clamp_min(0) ** inv_k)
        rel = ((y[sl] - x[sl]).abs() / x[sl].abs())[nz]
        assert (rel <= bound * 1.01 + 1e-6).all(), (i, (rel / bound).max(), state.k[i])


def test_range_expansion_shrinks_the_error_by_about_k(seed):
    v = adam_like("v", 128 * 512, seed)  # R ~ 10 per group: k ~ 5
    expanded = quantize_expanded_reference(v, 128, signed=False)
    plain = quantize_expanded_reference(v, 128, signed=False, expansion=False)
    err = lambda s: ((dequantize_expanded_reference(s) - v) / v).pow(2).mean().sqrt().item()  # noqa: E731
    k_mean = expanded.k.mean().item()
    assert 4 <= k_mean <= 8, k_mean
    assert err(expanded) < err(plain) / (0.6 * k_mean), (err(expanded), err(plain), k_mean)
    limited = quantize_expanded_reference(v, 128, signed=False, k_max=2.0)
    assert limited.k.max() == 2.0 and err(expanded) < err(limited) < err(plain)


def test_k_target_and_formula_constants():
    assert k_target(448.0) == pytest.approx(16 * math.log2(448**2 / 2), rel=1e-7)
    assert k_target(57344.0) == pytest.approx(16 * math.log2(57344**2 / 2), rel=1e-7)


def test_non_finite_and_negative_input(device):
    x = torch.randn(300)
    x[5] = float("nan")
    x[200] = float("inf")
    with pytest.raises(NonFiniteInputError, match="inf or NaN"):
        quantize_expanded(x.to(device), exact_math=True, backend="triton")
    state = off(quantize_expanded(x.to(device), check_finite=False, exact_math=True, backend="triton"))
    assert_same_state(state, quantize_expanded_reference(x))
    assert torch.isinf(state.scale[0]) and torch.isinf(state.scale[1]) and torch.isfinite(state.scale[2])
    assert (state.codes[:256].float() == 0).all()
    y = dequantize_expanded_reference(state)
    assert torch.isnan(y[:256]).all() and torch.isfinite(y[256:]).all()
    with pytest.raises(ValueError, match="pass signed=True"):
        quantize_expanded(torch.randn(10), signed=False)


def test_zeros_state_is_what_quantizing_zeros_gives():
    z = ExpandedFp8.zeros((3, 100), group_size=128, fmt="e5m2", signed=False)
    assert_same_state(z, quantize_expanded_reference(torch.zeros(3, 100), 128, "e5m2", signed=False))
    assert z.nbytes() == 300 + 3 * 3 * 4
    assert ExpandedFp8.zeros((256,), expansion=False).nbytes() == 256 + 2 * 4


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="power of two"):
        quantize_expanded(torch.randn(10), group_size=100)
    with pytest.raises(ValueError, match="multiple of 1/16"):
        quantize_expanded(torch.randn(10), k_min=0.1)
    with pytest.raises(ValueError, match=r"contiguous\(\)"):
        quantize_expanded(torch.randn(8, 8).t())
    with pytest.raises(ValueError, match="'e4m3'"):
        quantize_expanded(torch.randn(10), fmt="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["m", "v", "wide"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_large_tensor_on_gpu_matches_reference(kind, fmt, seed):
    x = adam_like(kind, 3_000_017, seed)
    state = off(quantize_expanded(x.cuda(), 128, fmt, kind != "v", exact_math=True))
    ref = quantize_expanded_reference(x, 128, fmt, signed=kind != "v")
    assert_same_state(state, ref)
    assert torch.equal(
        dequantize_expanded(on("cuda", state), exact_math=True).cpu(), dequantize_expanded_reference(ref)
    )


def code_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many FP8 steps apart two codes are (codes of equal sign: the 7 low bits are monotonic)."""
    ba, bb = as_bytes(a).int(), as_bytes(b).int()
    same_sign = (ba & 0x80) == (bb & 0x80)
    return torch.where(same_sign, ((ba & 0x7F) - (bb & 0x7F)).abs(), (ba & 0x7F) + (bb & 0x7F))


@pytest.mark.parametrize("kind", ["m", "v", "wide"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fast_math_stays_within_its_tolerance(device, kind, fmt, seed):
    """The CUDA default: logarithms and powers with the hardware's lg2/ex2 (numpy's under the
    interpreter), per element and for the per-group metadata. Their error, about 2^-22 in log2,
    moves the metadata slightly: k (a floor of a ratio) differs by one step of 1/16 in a group whose
    ratio lies within that error of an integer (rare), centre and scale by about 2^-17 relative. In
    groups with the same k, codes match the reference's but for values near a rounding midpoint
    (one step, rarely); the fast state dequantizes as close to x as the exact one does."""
    n = 100_000 if device.type == "cuda" else 8_000
    x = adam_like(kind, n, seed)
    signed = kind != "v"
    fast = off(quantize_expanded(x.to(device), 128, fmt, signed, exact_math=False, backend="triton"))
    ref = quantize_expanded_reference(x, 128, fmt, signed=signed)
    same_k = fast.k == ref.k
    assert same_k.float().mean() >= 0.98, (~same_k).sum()
    assert ((fast.k - ref.k).abs() <= 1 / 16).all()
    for name in ("scale", "center"):
        a, b = getattr(fast, name)[same_k], getattr(ref, name)[same_k]
        assert ((a - b).abs() <= 2.0**-14 * b.abs()).all(), name
    elements_same_k = same_k.repeat_interleave(128)[:n]
    steps = code_steps(fast.codes, ref.codes)[elements_same_k]
    assert steps.max() <= 1 and (steps > 0).float().mean() <= 2e-3, ((steps > 0).sum(), steps.max())
    nonzero = x != 0
    err_fast = ((dequantize_expanded_reference(fast) - x).abs() / x.abs())[nonzero].mean()
    err_ref = ((dequantize_expanded_reference(ref) - x).abs() / x.abs())[nonzero].mean()
    assert err_fast <= 1.02 * err_ref, (err_fast, err_ref)
    y_fast = dequantize_expanded(on(device, ref), exact_math=False, backend="triton").cpu()
    y_ref = dequantize_expanded_reference(ref)
    assert ((y_fast - y_ref).abs() <= 2.0**-15 * y_ref.abs()).all()
