"""log2, exp2 and powers of FP32 values, in Triton and in torch: exact, or fast on NVIDIA GPUs.

What range-expanded FP8 (``coat_kernels.expanded``) needs to raise a group's values to the power k
and back: ``a^k = exp2(k * log2(a))``, elementwise, FP32.

Exact (``log2_ieee``, ``exp2_ieee``, ``pow_ieee`` and their ``*_reference`` twins): written from IEEE
operations only (bit manipulation, +, *, correctly rounded division and square root: ``tl.div_rn``,
``tl.sqrt_rn``, and ``div_rn_reference``, ``sqrt_rn_reference`` on the torch side), with polynomial
coefficients rounded to FP32 once, here. With FMA contraction off (``enable_fp_fusion=False``) the
GPU, the Triton interpreter and torch on the CPU then produce the same bits, so kernels and their
torch references can be compared byte for byte. The tests bound log2's error by 2e-7 relative
(absolute where |log2 x| < 1) and exp2's by 3e-7 relative, and both are exact at powers of two.

Fast (``log2_fast``, ``log2_fast_ftz``, with ``tl.exp2``): compiled for NVIDIA (``PTX``), the
hardware's ``lg2.approx`` as inline PTX (``tl.log2`` itself compiles to a 20-instruction polynomial)
and ``ex2.approx``: about 2^-22 absolute error in log2, one instruction each instead of the exact
path's dozens. The interpreter cannot run PTX and uses numpy's log2 there.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from .formats import FP32_MIN_NORMAL


def f32(value: float) -> float:
    """``value`` rounded to the nearest FP32 (as a Python float): what a Triton scalar argument or
    an FP32 constant holds, so that host-side scalars mean the same on every path."""
    return struct.unpack("f", struct.pack("f", value))[0]


# Coefficients of log2(m) = t * (C1 + t^2 (C3 + ...)), t = (m - 1) / (m + 1), m in [sqrt(1/2), sqrt(2)):
# 2 / (ln 2 * (2i + 1)), the series of 2 atanh(t) / ln 2. |t| <= 0.1716, so the first omitted term
# is 2e-9 of the result (below FP32's 6e-8).
_LOG2_C = [f32(2.0 / (math.log(2.0) * (2 * i + 1))) for i in range(5)]
# 2^f = sum (f ln 2)^i / i! for f in [-0.5, 0.5]; the first omitted term is 5e-9 of the result.
_EXP2_C = [f32(math.log(2.0) ** i / math.factorial(i)) for i in range(8)]
_SQRT2 = f32(math.sqrt(2.0))
_TWO_POW_23 = 2.0**23

L2C0: tl.constexpr = tl.constexpr(_LOG2_C[0])
L2C1: tl.constexpr = tl.constexpr(_LOG2_C[1])
L2C2: tl.constexpr = tl.constexpr(_LOG2_C[2])
L2C3: tl.constexpr = tl.constexpr(_LOG2_C[3])
L2C4: tl.constexpr = tl.constexpr(_LOG2_C[4])
E2C0: tl.constexpr = tl.constexpr(_EXP2_C[0])
E2C1: tl.constexpr = tl.constexpr(_EXP2_C[1])
E2C2: tl.constexpr = tl.constexpr(_EXP2_C[2])
E2C3: tl.constexpr = tl.constexpr(_EXP2_C[3])
E2C4: tl.constexpr = tl.constexpr(_EXP2_C[4])
E2C5: tl.constexpr = tl.constexpr(_EXP2_C[5])
E2C6: tl.constexpr = tl.constexpr(_EXP2_C[6])
E2C7: tl.constexpr = tl.constexpr(_EXP2_C[7])
SQRT2: tl.constexpr = tl.constexpr(_SQRT2)
MIN_NORMAL: tl.constexpr = tl.constexpr(FP32_MIN_NORMAL)
TWO_POW_23: tl.constexpr = tl.constexpr(_TWO_POW_23)


@triton.jit
def log2_ieee(x):
    """log2 of positive finite FP32 values (subnormals included), from IEEE operations only."""
    sub = x < MIN_NORMAL
    x = tl.where(sub, x * TWO_POW_23, x)  # exact: brings a subnormal into the normal range
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - tl.where(sub, 23, 0)
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > SQRT2
    m = tl.where(big, m * 0.5, m)
    e = tl.where(big, e + 1, e)
    t = tl.div_rn(m - 1.0, m + 1.0)
    t2 = t * t
    p = L2C4
    p = p * t2 + L2C3
    p = p * t2 + L2C2
    p = p * t2 + L2C1
    p = p * t2 + L2C0
    return e.to(tl.float32) + t * p


@triton.jit
def exp2_ieee(a):
    """2^a for finite FP32 a, from IEEE operations only (underflows to 0, overflows to inf)."""
    a = tl.minimum(tl.maximum(a, -200.0), 200.0)
    n = tl.floor(a + 0.5)
    f = a - n  # exact, |f| <= 0.5
    p = E2C7
    p = p * f + E2C6
    p = p * f + E2C5
    p = p * f + E2C4
    p = p * f + E2C3
    p = p * f + E2C2
    p = p * f + E2C1
    p = p * f + E2C0
    ni = n.to(tl.int32)
    n1 = ni >> 1  # arithmetic shift: floor(n / 2) for negative n too
    n2 = ni - n1
    # two powers of two within the normal range: only the last product can round (or underflow)
    s1 = ((n1 + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((n2 + 127) << 23).to(tl.float32, bitcast=True)
    return (p * s1) * s2


@triton.jit
def pow_ieee(a, k):
    """a^k for a >= 0 (0^k = 0); exact for k = 1."""
    safe = tl.where(a == 0.0, 1.0, a)
    r = tl.where(k == 1.0, a, exp2_ieee(k * log2_ieee(safe)))
    return tl.where(a == 0.0, 0.0, r)


@triton.jit
def log2_fast(x, PTX: tl.constexpr):
    """log2 of x >= 0, fast: with PTX (compiled for NVIDIA) ``lg2.approx.f32`` (about 2^-22 absolute
    error, subnormal inputs handled, log2 0 = -inf); ``tl.log2`` itself compiles to a
    20-instruction polynomial. Without (the interpreter, which cannot run PTX): ``tl.log2``."""
    if PTX:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def log2_fast_ftz(x, PTX: tl.constexpr):
    """``log2_fast`` for the per-element powers: ``lg2.approx.ftz.f32``, one instruction (the
    subnormal handling of the plain form costs three more). A subnormal x (below 2^-126) counts as
    0 (log2 = -inf), so it encodes to, or decodes from, code 0: below any Adam state that matters."""
    if PTX:
        return tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.log2(tl.where(x < MIN_NORMAL, 0.0, x))


@triton.jit
def copy_sign(mag, x):
    """mag (>= 0) with the sign bit of x: one bitwise instruction instead of compare, negate, select."""
    bits = mag.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)
    return bits.to(tl.float32, bitcast=True)


# --------------------------------------------------------------------------------------------
# torch references: the same operations in the same order
# --------------------------------------------------------------------------------------------


def sqrt_rn_reference(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 sqrt (as ``tl.sqrt_rn``). torch's CPU float32 sqrt is not (some
    results are 1 ULP off); the float64 sqrt rounded to FP32 is exact."""
    return torch.sqrt(x.double()).float()


def div_rn_reference(a: torch.Tensor, b) -> torch.Tensor:
    """Correctly rounded FP32 a / b (as ``tl.div_rn``), through float64 (exact after rounding)."""
    b = b.double() if isinstance(b, torch.Tensor) else b
    return (a.double() / b).float()


def log2_ieee_reference(x: torch.Tensor) -> torch.Tensor:
    sub = x < FP32_MIN_NORMAL
    x = torch.where(sub, x * _TWO_POW_23, x)
    bits = x.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - torch.where(sub, 23, 0).to(torch.int32)
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    e = torch.where(big, e + 1, e)
    t = div_rn_reference(m - 1.0, m + 1.0)
    t2 = t * t
    p = torch.full_like(t, _LOG2_C[4])
    for c in reversed(_LOG2_C[:4]):
        p = p * t2 + c
    return e.to(torch.float32) + t * p


def exp2_ieee_reference(a: torch.Tensor) -> torch.Tensor:
    a = a.clamp(-200.0, 200.0)
    n = torch.floor(a + 0.5)
    f = a - n
    p = torch.full_like(f, _EXP2_C[7])
    for c in reversed(_EXP2_C[:7]):
        p = p * f + c
    ni = n.to(torch.int32)
    n1 = ni >> 1
    n2 = ni - n1
    s1 = ((n1 + 127) << 23).view(torch.float32)
    s2 = ((n2 + 127) << 23).view(torch.float32)
    return (p * s1) * s2


def pow_ieee_reference(a: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    safe = torch.where(a == 0, 1.0, a)
    r = torch.where(k == 1.0, a, exp2_ieee_reference(k * log2_ieee_reference(safe)))
    return torch.where(a == 0, 0.0, r)
