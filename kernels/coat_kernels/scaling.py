"""How a scale is derived from an amax: the one rule every quantizer follows, in Triton and torch.

``scale = amax / fmt_max`` (IEEE division), raised to the smallest normal FP32 so that a tiny
amax never yields a subnormal scale, and 1 for an all-zero group or tensor. A non-finite input
makes the amax +inf (NaN is mapped to +inf first), hence an infinite scale and all-zero codes:
the scale is the explicit flag of non-finite input, and dequantization gives NaN, never a finite
number.

Quantization multiplies by ``1 / scale`` (IEEE division once per group, then one rounded multiply
per element) and dequantization multiplies by ``scale``: the scale returned is the one used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import FP32_MIN_NORMAL

_MIN_NORMAL = tl.constexpr(FP32_MIN_NORMAL)


@triton.jit
def abs_or_inf(x):
    """|x| with NaN mapped to +inf, so a max over it is +inf for any non-finite input."""
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def scale_from_amax(amax, FMAX: tl.constexpr):
    scale = tl.maximum(tl.div_rn(amax, FMAX), _MIN_NORMAL)
    return tl.where(amax == 0.0, 1.0, scale)


@triton.jit
def quantize_with_inverse(x, inv_scale, FMAX: tl.constexpr):
    """x * (1/scale), clamped to the format's range; NaN (only in a non-finite group) becomes 0."""
    y = x * inv_scale
    y = tl.where(y != y, 0.0, y)
    return tl.minimum(tl.maximum(y, -FMAX), FMAX)


def abs_or_inf_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.inf, x.abs())


def scale_from_amax_reference(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    scale = torch.clamp_min(amax.float() / fmax, FP32_MIN_NORMAL)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize_with_inverse_reference(x: torch.Tensor, inv_scale: torch.Tensor, fmax: float) -> torch.Tensor:
    y = x * inv_scale
    y = torch.where(torch.isnan(y), torch.zeros_like(y), y)
    return y.clamp(-fmax, fmax)


class NonFiniteInputError(ValueError):
    """A tensor handed to an FP8 quantizer held inf or NaN."""


def raise_if_nonfinite(scales: torch.Tensor, op: str) -> None:
    """Raise if any scale is non-finite, i.e. its group or tensor held inf/NaN (syncs the device)."""
    if scales.numel() and not bool(torch.isfinite(scales).all()):
        bad = int((~torch.isfinite(scales)).sum())
        raise NonFiniteInputError(
            f"{op}: input holds inf or NaN ({bad} of {scales.numel()} scale groups affected); FP8 cannot "
            f"represent it. Find where the non-finite values come from (loss scale, learning rate), or "
            f"pass check_finite=False to get infinite scales as a flag instead"
        )


@triton.jit
def encode_fp8(y, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """The bits (uint8) of the FP8 value nearest to y, ties to even, by integer and exact FP32
    arithmetic: for y finite and within the format's range (clamped), the same byte as a cast.

    Why not ``y.to(fp8)``: Triton 3.6's FP32 -> FP8 conversion on Hopper (cvt ... e4m3x2/e5m2x2,
    two values per instruction) writes constant garbage (0x60, 0xFC) into half of the bytes in
    some register layouts, the fused optimizer step's among them. Rounding: adding and subtracting
    c = 2^(e - MBITS + 23), whose FP32 ulp is the FP8 step of y's binade (the smallest normal
    binade's step below it), rounds |y| to that step, ties to even; the result is an FP8 value whose
    bits are then assembled.
    """
    a = tl.abs(y)
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, 1 - BIAS)
    c = ((e - MBITS + 150) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c
    rb = r.to(tl.int32, bitcast=True)
    er = ((rb >> 23) & 0xFF) - 127
    normal = ((er + BIAS) << MBITS) | ((rb >> (23 - MBITS)) & ((1 << MBITS) - 1))
    subnormal_unit = tl.full((), (BIAS - 1 + MBITS + 127) << 23, tl.int32).to(
        tl.float32, bitcast=True
    )  # 2^(BIAS-1+MBITS)
    subnormal = (r * subnormal_unit).to(tl.int32)
    code = tl.where(er >= 1 - BIAS, normal, subnormal) | ((bits >> 24) & 0x80)
    return code.to(tl.uint8)


@triton.jit
def fp8_bits(y, E5M2: tl.constexpr, PTX: tl.constexpr):
    """The FP8 (E4M3 or E5M2) bits (uint8) of y, finite and already clamped to the format's range.

    PTX (compiled for NVIDIA): the hardware conversion written as inline PTX, two values per
    ``cvt.rn.satfinite`` (half an instruction per element). It is not ``y.to(fp8)``: Triton 3.6's own
    lowering of that cast on Hopper writes garbage into half of the bytes in some register layouts
    (see ``encode_fp8``), while the instruction itself is correct. Otherwise (the interpreter, which
    cannot run PTX): ``encode_fp8``, the same rounding by integer arithmetic.
    """
    if PTX:
        if E5M2:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
                "=r,r,r,r,r",
                [y],
                dtype=tl.uint8,
                is_pure=True,
                pack=4,
            )
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r",
            [y],
            dtype=tl.uint8,
            is_pure=True,
            pack=4,
        )
    elif E5M2:
        return encode_fp8(y, 2, 15)
    else:
        return encode_fp8(y, 3, 7)
