"""COAT's FP8 paths under a growing outlier: 1x16 per-group and per-tensor quantization, and the fused
RMSNorm -> FP8 and SwiGLU -> FP8 ops that feed them, from ordinary values to near BF16's largest.

A few channels of a BF16 tensor carry an outlier of magnitude A, grown geometrically from 1 through
E4M3's largest value (448) and E5M2's (57344) to 3e38. Every FP8 output is decoded from its bytes by
``decode_fp8`` (bit fields only, no FP8 cast) and multiplied by its scale in float64. What must hold:

* nothing non-finite: A scale is A / FMAX, so the outlier itself is never out of range;
* every value within the rounding bound of ``fp8_bounds``: |x~ - x| <= eps |x| + sigma s, with s the
  group's (1x16) or the tensor's scale amax / FMAX (so |x~ - x| / amax <= eps + sigma / FMAX: 2^-4 for
  E4M3, 2^-3 for E5M2, relative to the group's or tensor's amax), and the outlier (the amax) lands on
  the format's largest code, exact to FP32 rounding;
* 1x16: a group without an outlier comes out bit for bit as if the outlier were not there;
* per tensor, the price: x / s below half the smallest subnormal code rounds to 0, and with s = A / FMAX
  that takes every ordinary value once A is large enough (E4M3: |x| < A / 448 * 2^-10), while 1x16 loses
  only the outlier's own group.

Beyond FP32's range of squares and products, two documented limits (shared with BF16 torch): RMSNorm's
sum of squares overflows for |x| >~ 1.8e19 and the rows come out as zeros (torch's rms_norm does the
same); SwiGLU's gate * up overflows for A >~ 1.8e19 and the output is flagged (infinite scale, NaN when
dequantized) as BF16's is inf. Non-finite inputs: the standalone quantizers raise by default; with
``check_finite=False`` and inside the fused ops (which never sync the device) the affected group or
tensor gets an infinite scale, so it dequantizes to NaN and never to a finite value.
"""

import pytest
import torch
import torch.nn.functional as F
from fp8_bounds import EPS, FMAX, quant_error, quant_error_groups

from coat_kernels import NonFiniteInputError, quantize_per_group, quantize_per_tensor
from coat_kernels.formats import fp8_format
from coat_kernels.norm import norm_to_fp8
from coat_kernels.per_group import quantize_per_group_reference
from coat_kernels.per_tensor import quantize_per_tensor_reference
from coat_kernels.swiglu import quantize_swiglu_input, swiglu_to_fp8

G = 16
FORMATS = ["e4m3", "e5m2"]
# Outlier magnitudes: geometric from 1, through E4M3's largest (448) and E5M2's (57344), to near
# BF16's largest (3.39e38). All are BF16 values (1e6 and up after rounding to BF16).
MAGNITUDES = [1.0, 8.0, 64.0, 448.0, 512.0, 4096.0, 57344.0, 65536.0, 1e6, 1e10, 1e20, 1e30, 3e38]
# The fused ops compute squares (RMSNorm) and gate * up (SwiGLU) in FP32: finite below ~1.8e19.
FUSED_MAGNITUDES = [a for a in MAGNITUDES if a <= 1e10] + [1e15, 1e18]
OVERFLOW_MAGNITUDES = [2e19, 1e30, 3e38]
# Smallest positive (subnormal) code of each format: x / scale below half of it rounds to zero.
MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}
FP32_SLACK = 2.0**-20  # FP32 roundings of x / s (and of the fused ops' arithmetic) before the FP8 rounding
_FIELDS = {"e4m3": (3, 7), "e5m2": (2, 15)}  # mantissa bits, exponent bias


@pytest.fixture(
    params=[
        "interpreter",
        "reference",
        pytest.param("cuda", marks=pytest.mark.gpu),
    ]
)
def target(request):
    """(device, backend): the Triton kernels under the interpreter, the torch references, or the GPU."""
    if request.param == "interpreter":
        if torch.cuda.is_available():
            pytest.skip("the interpreter runs only on machines without CUDA")
        return torch.device("cpu"), "triton"
    if request.param == "reference":
        return torch.device("cpu"), "reference"
    return torch.device("cuda"), "triton"


def decode_fp8(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 codes -> float64 values from their sign, exponent and mantissa bits (no FP8 cast involved).
    E4M3 (fn): bias 7, no infinities, S.1111.111 is NaN. E5M2: bias 15, exponent 31 is inf (mantissa 0)
    or NaN."""
    mbits, bias = _FIELDS[fmt]
    b = q.detach().cpu().contiguous().view(torch.uint8).to(torch.int64)
    sign = torch.where((b & 0x80) != 0, -1.0, 1.0).double()
    e = (b >> mbits) & ((1 << (7 - mbits)) - 1)
    m = (b & ((1 << mbits) - 1)).double()
    frac = m / 2**mbits
    value = torch.where(e == 0, frac * 2.0 ** (1 - bias), (1.0 + frac) * torch.pow(2.0, (e - bias).double()))
    if fmt == "e4m3":
        value = torch.where((e == 15) & (m == 7), torch.nan, value)
    else:
        value = torch.where(e == 31, torch.where(m == 0, torch.inf, torch.nan), value)
    return sign * value


def dequantize_groups(q, scales, fmt):
    """1xG codes and FP32 scales -> float64 values."""
    v = decode_fp8(q, fmt)
    return (v.view(*v.shape[:-1], -1, G) * scales.detach().cpu().double()[..., None]).view(v.shape)


def base_values(shape, seed):
    """BF16, |x| in [0.25, 4) with random signs: nothing near 0, so a 0 after quantization is underflow."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.rand(shape, generator=g) * 4 - 2)
    return (magnitude * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)).to(torch.bfloat16)


def outlier_channels(n):
    """Three channels of a row of n, each in its own 1x16 group (the first, one mid-row, the last)."""
    return [1, n // 2 + 3, n - 1]


def with_outliers(x, channels, magnitude, rows=None):
    """x with +-magnitude (alternating signs) in ``channels`` of ``rows`` (default every row)."""
    x = x.clone()
    flat = x.view(-1, x.shape[-1])
    rows = slice(None) if rows is None else rows
    for i, c in enumerate(channels):
        flat[rows, c] = (-1) ** i * magnitude
    return x


def check_within_bound(got, x, bound):
    err = (got - x).abs()
    assert torch.isfinite(got).all(), f"{(~torch.isfinite(got)).sum()} non-finite values"
    over = err > bound + FP32_SLACK * x.abs()
    assert not over.any(), (
        f"{over.sum()} values off by more than the bound, e.g. x={x[over][:3].tolist()} got={got[over][:3].tolist()}"
    )


def check_underflow_rule(got, x, scale, fmt, mask):
    """Where ``mask``: a value rounds to 0 exactly when |x| / scale is below half the smallest
    subnormal code (values within 1e-4 of that threshold are not judged: FP32 roundings decide them).
    Returns the fraction of ``mask``'s values that came out 0."""
    ratio = x.abs() / scale
    half = MIN_SUBNORMAL[fmt] / 2
    below = mask & (ratio < half * (1 - 1e-4))
    above = mask & (ratio > half * (1 + 1e-4))
    assert (got[below] == 0).all(), f"{(got[below] != 0).sum()} values below the threshold did not round to 0"
    assert (got[above] != 0).all(), f"{(got[above] == 0).sum()} values above the threshold rounded to 0"
    return (got[mask] == 0).double().mean().item()


def test_reference_decoder_agrees_with_torch_on_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    for fmt in FORMATS:
        want = codes.view(fp8_format(fmt).dtype).double()
        got = decode_fp8(codes, fmt)
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
        assert same.all(), codes[~same]


# ----------------------------------------------------------------------------------- 1x16 per group


@pytest.mark.parametrize("shape", [(3, 5, 160), (17, 96), (2, 9, 1040)], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_per_group_outlier_growing_to_bf16_max(target, shape, fmt, seed):
    """One magnitude per row (cycled), carried by the row's three outlier channels."""
    device, backend = target
    clean = base_values(shape, seed)
    n = shape[-1]
    channels = outlier_channels(n)
    n_rows = clean.numel() // n
    magnitude = torch.tensor([MAGNITUDES[r % len(MAGNITUDES)] for r in range(n_rows)])
    x = clean.clone()
    for r in range(n_rows):
        x = with_outliers(x, channels, magnitude[r].item(), rows=r)

    q, s = quantize_per_group(x.to(device), G, fmt, backend=backend)  # raises on any non-finite scale
    q, s = q.cpu(), s.cpu()
    q_ref, s_ref = quantize_per_group_reference(x, G, fmt)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))

    got, x64 = dequantize_groups(q, s, fmt), x.double()
    assert torch.isfinite(s).all()
    check_within_bound(got, x64, quant_error_groups(x, fmt, G).double())

    # where the outlier is its group's amax: the largest code, and back to within FP32 rounding
    outlier_rows = magnitude > 4
    codes = q.view(-1, n).view(torch.uint8)[outlier_rows] & 0x7F
    rows_got, rows_x = got.view(-1, n)[outlier_rows], x64.view(-1, n)[outlier_rows]
    for c in channels:
        assert (decode_fp8(codes[:, c], fmt) == FMAX[fmt]).all()
        rel = ((rows_got[:, c] - rows_x[:, c]).abs() / rows_x[:, c].abs()).max()
        assert rel <= 2.0**-21, rel

    # a group without an outlier: bit for bit what it is without any outlier in the tensor
    q_clean, s_clean = quantize_per_group(clean.to(device), G, fmt, backend=backend)
    far = torch.ones(n // G, dtype=torch.bool)
    far[[c // G for c in channels]] = False
    groups = q.view(torch.uint8).reshape(-1, n // G, G)
    clean_groups = q_clean.cpu().view(torch.uint8).reshape(-1, n // G, G)
    assert torch.equal(groups[:, far], clean_groups[:, far])
    assert torch.equal(s.view(-1, n // G)[:, far], s_clean.cpu().view(-1, n // G)[:, far])


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_tensor_loses_the_small_values_that_1x16_keeps(target, fmt, seed):
    """As the outlier grows, per-tensor FP8 rounds more and more ordinary values to 0, then all of
    them; 1x16 keeps every value outside the outlier's own groups within the rounding bound."""
    device, backend = target
    clean = base_values((24, 320), seed)
    channels = outlier_channels(320)
    ordinary = torch.ones(clean.shape, dtype=torch.bool)
    ordinary[:, channels] = False
    in_outlier_group = torch.zeros(clean.shape, dtype=torch.bool)
    for c in channels:
        in_outlier_group[:, c // G * G : c // G * G + G] = True
    far = ordinary & ~in_outlier_group

    zero_tensor, zero_group_far, zero_group_near = [], [], []
    for a in MAGNITUDES:
        x = with_outliers(clean, channels, a)
        x64 = x.double()
        q, scale = quantize_per_tensor(x.to(device), fmt, backend=backend)
        tensor_got = decode_fp8(q, fmt) * scale.cpu().double()
        check_within_bound(tensor_got, x64, quant_error(x, fmt).double())
        zero_tensor.append(check_underflow_rule(tensor_got, x64, scale.cpu().double(), fmt, ordinary))

        qg, sg = quantize_per_group(x.to(device), G, fmt, backend=backend)
        group_got = dequantize_groups(qg.cpu(), sg.cpu(), fmt)
        group_scale = sg.cpu().double().repeat_interleave(G, dim=-1)
        zero_group_far.append(check_underflow_rule(group_got, x64, group_scale, fmt, far))
        zero_group_near.append(check_underflow_rule(group_got, x64, group_scale, fmt, ordinary & in_outlier_group))
        rel_far = ((group_got - x64).abs() / x64.abs())[far]
        assert rel_far.max() <= EPS[fmt], (a, rel_far.max())  # every far value is in the normal range of its group

    print("fraction of ordinary values rounded to 0, per tensor:", dict(zip(MAGNITUDES, zero_tensor)))
    assert zero_tensor == sorted(zero_tensor)  # the loss only grows with the outlier
    # |x| < 4: all of them are gone once A / FMAX * MIN_SUBNORMAL / 2 > 4
    gone_from = 4 * FMAX[fmt] * 2 / MIN_SUBNORMAL[fmt]
    assert all(z == 1.0 for a, z in zip(MAGNITUDES, zero_tensor) if a > gone_from)
    assert all(z == 0.0 for a, z in zip(MAGNITUDES, zero_tensor) if a <= FMAX[fmt])
    # 1x16: the groups without an outlier never lose a value; those with one lose what per tensor loses
    assert zero_group_far == [0.0] * len(MAGNITUDES)
    assert zero_group_near[-1] == 1.0


@pytest.mark.parametrize("shape", [(3, 5, 160), (33, 1040), (130,)], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_per_tensor_outlier_growing_to_bf16_max(target, shape, fmt, seed):
    device, backend = target
    clean = base_values(shape, seed)
    n = shape[-1]
    channels = outlier_channels(n)
    transpose = fmt == "e4m3"  # the activation format: also the transposed copy for wgrad
    for a in MAGNITUDES:
        x = with_outliers(clean, channels, a)
        out = quantize_per_tensor(x.to(device), fmt, transpose=transpose, backend=backend)
        q, scale = out[0].cpu(), out[1].cpu()
        ref = quantize_per_tensor_reference(x, fmt, transpose=transpose)
        assert torch.equal(scale, ref[1]) and torch.equal(q.view(torch.uint8), ref[0].view(torch.uint8)), a
        if transpose:
            assert torch.equal(out[2].cpu().view(torch.uint8), q.view(torch.uint8).reshape(-1, n).t())
        assert torch.isfinite(scale) and scale == x.float().abs().amax() / FMAX[fmt]
        got, x64 = decode_fp8(q, fmt) * scale.double(), x.double()
        check_within_bound(got, x64, quant_error(x, fmt).double())
        if a > 4:  # the outliers are the tensor's amax
            flat_got, flat_x = got.view(-1, n), x64.view(-1, n)
            for c in channels:
                assert ((flat_got[:, c] - flat_x[:, c]).abs() <= 2.0**-21 * flat_x[:, c].abs()).all(), a


# ------------------------------------------------------------------------------- fused producers


def rmsnorm_inputs(shape, seed):
    """x as ``base_values``, the norm weight in [0.8, 1.2) (FP32)."""
    g = torch.Generator().manual_seed(seed + 1)
    return base_values(shape, seed), 0.8 + 0.4 * torch.rand(shape[-1], generator=g)


@pytest.mark.parametrize("shape", [(3, 5, 160), (33, 1040)], ids=str)
def test_rmsnorm_to_fp8_residual_outlier(target, shape, seed):
    """RMSNorm of a residual stream whose outlier channels grow: the per-tensor output within the
    bound of its scale (the ordinary channels underflowing by the rule as the outlier takes over the
    norm), and the saved 1x16 copy of the input exactly the per-group path's."""
    device, backend = target
    clean, w = rmsnorm_inputs(shape, seed)
    n = shape[-1]
    channels = outlier_channels(n)
    ordinary = torch.ones(clean.shape, dtype=torch.bool)
    ordinary[..., channels] = False
    zeros = []
    for a in FUSED_MAGNITUDES:
        x = with_outliers(clean, channels, a)
        r = norm_to_fp8(x.to(device), w.to(device), eps=1e-5, backend=backend)
        x64 = x.double().view(-1, n)
        rstd = r.rstd.cpu().double()
        assert torch.allclose(rstd, 1 / torch.sqrt((x64 * x64).mean(-1) + 1e-5), rtol=1e-4, atol=0), a
        y = (x64 * rstd[:, None] * w.double()).view(x.shape)  # the exact output for the kernel's rstd
        scale = r.scale.cpu().double()
        got = decode_fp8(r.q, "e4m3") * scale
        assert torch.isfinite(scale) and torch.isfinite(r.amax.cpu())
        check_within_bound(got, y, quant_error(y.float(), "e4m3", scale.float()).double())
        assert torch.equal(r.q_t.cpu().view(torch.uint8), r.q.cpu().view(torch.uint8).reshape(-1, n).t())
        zeros.append(check_underflow_rule(got, y, scale, "e4m3", ordinary))
        x_q, x_s = quantize_per_group_reference(x, G, "e4m3")
        assert torch.equal(r.x_q.cpu().view(torch.uint8), x_q.view(torch.uint8)) and torch.equal(r.x_scales.cpu(), x_s)
        assert torch.isfinite(dequantize_groups(r.x_q.cpu(), r.x_scales.cpu(), "e4m3")).all()
    print("fraction of ordinary norm outputs rounded to 0:", dict(zip(FUSED_MAGNITUDES, zeros)))
    assert zeros == sorted(zeros) and zeros[0] == 0.0 and zeros[-1] == 1.0


def test_rmsnorm_to_fp8_beyond_fp32_squares_gives_zeros_as_torch_does(target, seed):
    """Known limit (reported, not changed): past |x| ~ 1.8e19 the FP32 sum of squares overflows,
    rstd = 1/sqrt(inf) = 0 and the rows normalise to 0, finite. torch's own rms_norm (FP32 or BF16,
    what the BF16 baseline runs) gives the same zeros; nothing here turns into NaN or Inf."""
    device, backend = target
    clean, w = rmsnorm_inputs((5, 160), seed)
    for a in OVERFLOW_MAGNITUDES:
        x = with_outliers(clean, outlier_channels(160), a)
        r = norm_to_fp8(x.to(device), w.to(device), eps=1e-5, backend=backend)
        got = decode_fp8(r.q, "e4m3") * r.scale.cpu().double()
        assert torch.isfinite(got).all() and (got == 0).all() and (r.rstd.cpu() == 0).all()
        assert (F.rms_norm(x, (160,), w.to(torch.bfloat16), 1e-5) == 0).all()
        assert (F.rms_norm(x.float(), (160,), w, 1e-5) == 0).all()
        assert torch.isfinite(r.x_scales.cpu()).all()  # the saved 1x16 copy of x is still exact to its bound


def swiglu(h, device, backend):
    """fc1's path: h quantized 1x16 with SwiGLU's output amax found in the same pass, then SwiGLU's
    per-tensor FP8 output. Returns (h_q, h_scales, SwigluFp8)."""
    h_q, h_s, amax = quantize_swiglu_input(h.to(device), G, backend=backend)
    return h_q, h_s, swiglu_to_fp8(h_q, h_s, G, amax=amax, backend=backend)


def swiglu_input(shape, seed, magnitude):
    """h = [gate | up] with the same outlier channels in both halves, the gate positive (silu(A) ~ A)
    and the up sign alternating: SwiGLU's output there is ~ +-A^2 (aligned gate/up weights, as in the
    FP8 divergences Fishman et al. traced to SwiGLU)."""
    h = base_values(shape, seed)
    f = shape[-1] // 2
    flat = h.view(-1, 2 * f)
    for i, c in enumerate(outlier_channels(f)):
        flat[:, c] = magnitude
        flat[:, f + c] = (-1) ** i * magnitude
    return h


@pytest.mark.parametrize("shape", [(3, 5, 96), (17, 352)], ids=str)
def test_swiglu_to_fp8_outlier(target, shape, seed):
    device, backend = target
    f = shape[-1] // 2
    channels = outlier_channels(f)
    ordinary = torch.ones(*shape[:-1], f, dtype=torch.bool)
    ordinary[..., channels] = False
    zeros = []
    for a in FUSED_MAGNITUDES:
        h = swiglu_input(shape, seed, a)
        h_q, h_s, r = swiglu(h, device, backend)
        q_ref, s_ref = quantize_per_group_reference(h, G, "e4m3")  # the input: exactly the per-group path
        assert torch.equal(h_q.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(h_s.cpu(), s_ref)
        gate, up = dequantize_groups(h_q.cpu(), h_s.cpu(), "e4m3").chunk(2, dim=-1)
        out = gate * torch.sigmoid(gate) * up  # float64, from the values the kernel reads
        amax, scale = r.amax.cpu(), r.scale.cpu()
        assert torch.isfinite(scale) and torch.isfinite(amax)
        assert torch.allclose(amax.double(), out.abs().max(), rtol=2e-5, atol=0), a
        assert torch.equal(scale, (amax / FMAX["e4m3"]).clamp_min(2.0**-126))
        got = decode_fp8(r.q, "e4m3") * scale.double()
        # SiLU's exp in FP32 (and on the GPU, approximate): 2e-5 of the value on top of the rounding bound
        check_within_bound(got, out, quant_error(out.float(), "e4m3", scale).double() + 2e-5 * out.abs())
        if a >= 64:  # the outlier channels are the output's amax
            for c in channels:
                assert ((got[..., c] - out[..., c]).abs() <= 2e-5 * out[..., c].abs()).all(), a
        ratio = out.abs() / scale.double()
        settled = ordinary & (
            (ratio / (MIN_SUBNORMAL["e4m3"] / 2) - 1).abs() > 1e-3
        )  # SiLU's last bits decide the rest
        zeros.append(check_underflow_rule(got, out, scale.double(), "e4m3", settled))
    print("fraction of ordinary SwiGLU outputs rounded to 0:", dict(zip(FUSED_MAGNITUDES, zeros)))
    assert zeros == sorted(zeros) and zeros[0] == 0.0 and zeros[-1] == 1.0


def test_swiglu_to_fp8_beyond_fp32_products_is_flagged_as_bf16_overflows(target, seed):
    """gate * up past FP32's range: BF16's SwiGLU gives inf; COAT's output gets an infinite scale and
    dequantizes to NaN, never to finite values."""
    device, backend = target
    for a in OVERFLOW_MAGNITUDES:
        h = swiglu_input((4, 96), seed, a)
        gate, up = h.chunk(2, dim=-1)
        assert torch.isinf(F.silu(gate) * up).any()
        _, _, r = swiglu(h, device, backend)
        assert torch.isinf(r.scale.cpu()) and torch.isinf(r.amax.cpu())
        assert torch.isnan(decode_fp8(r.q, "e4m3") * r.scale.cpu().double()).all()


# --------------------------------------------------------------------------------- non-finite input


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")], ids=["+inf", "-inf", "nan"])
def test_non_finite_input_is_flagged_never_finite(target, bad, seed):
    """The decision: standalone quantizers raise (default ``check_finite=True``); the training path
    (``check_finite=False``, the fused ops) flags the affected 1x16 group or whole per-tensor output with
    an infinite scale, so it dequantizes to NaN, like BF16 arithmetic propagates it."""
    device, backend = target
    clean = base_values((6, 96), seed)
    x = clean.clone()
    x[2, 37] = bad  # group 2 of row 2
    dev = x.to(device)

    with pytest.raises(NonFiniteInputError, match="inf or NaN"):
        quantize_per_group(dev, G, "e4m3", backend=backend)
    with pytest.raises(NonFiniteInputError, match="inf or NaN"):
        quantize_per_tensor(dev, "e5m2", backend=backend)

    q, s = quantize_per_group(dev, G, "e4m3", check_finite=False, backend=backend)
    got = dequantize_groups(q.cpu(), s.cpu(), "e4m3")
    assert torch.isinf(s.cpu()[2, 2]) and torch.isnan(got[2, 32:48]).all()
    q_clean, s_clean = quantize_per_group(clean.to(device), G, "e4m3", backend=backend)
    others = torch.ones(6, 96, dtype=torch.bool)
    others[2, 32:48] = False
    assert torch.equal(q.cpu().view(torch.uint8)[others], q_clean.cpu().view(torch.uint8)[others])

    for fmt in FORMATS:
        q, scale = quantize_per_tensor(dev, fmt, check_finite=False, backend=backend)
        assert torch.isinf(scale.cpu()) and torch.isnan(decode_fp8(q, fmt) * scale.cpu().double()).all()

    w = torch.ones(96)
    r = norm_to_fp8(dev, w.to(device), eps=1e-5, backend=backend)
    assert torch.isinf(r.scale.cpu()) and torch.isnan(decode_fp8(r.q, "e4m3") * r.scale.cpu().double()).all()
    assert torch.isinf(r.x_scales.cpu()[2, 2]) and torch.isfinite(r.x_scales.cpu()[torch.arange(6) != 2]).all()

    _, h_s, r = swiglu(x, device, backend)  # as [gate | up], F = 48: the bad value is in group 2 of the gate
    assert torch.isinf(h_s.cpu()[2, 2]) and torch.isinf(r.scale.cpu())
    assert torch.isnan(decode_fp8(r.q, "e4m3") * r.scale.cpu().double()).all()
