"""Range-expanded FP8 (COAT's dynamic range expansion) for optimizer states.

Granularity: 1-D groups of ``group_size`` (default 128) consecutive elements of the flattened
tensor; group j covers elements [j*G, (j+1)*G), the last group may be shorter (ragged). Each group
stores FP8 codes (1 byte per element) and FP32 ``scale``, ``k`` and ``center``
(docs/design.md#dynamic-range-expansion-dre):

    amax = max |x|, amin = min |x| over the non-zero elements, R = amax / amin
    k    = floor(K_RESOLUTION * log2(fmax^2 / 2) / log2 R) / K_RESOLUTION, clamped to [k_min, k_max]
    c    = sqrt(amax) * sqrt(amin)                       (geometric centre: keeps (|x|/c)^k finite)
    y    = sign(x) * (|x| / c)^k,  scale = (amax / c)^k / fmax,  q = fp8(clamp(y / scale))
    x'   = sign(q) * (|q| * scale)^(1/k) * c               (dequantization)

The relative error of a value in FP8's normal range shrinks by about k. A group whose range cannot
be measured (all zero, one distinct magnitude, R within the resolution of log2) gets k = 1, c = 1
and plain absmax scaling; so does every group when expansion is off (then k and c are not stored).
A group holding inf or NaN gets an infinite scale and zero codes, so it dequantizes to NaN (the
flag, as in ``coat_kernels.scaling``), never to a finite number.

Exactness: ``a^k`` is ``exp2(k * log2(a))``, from ``coat_kernels.log2_exp2``. The torch reference
uses its exact functions (IEEE operations only), and so can the Triton kernels (``exact_math=True``,
which also turns FMA contraction off): then the GPU, the Triton interpreter and torch on the CPU
produce the same bits, and kernel and reference are compared byte for byte. That costs hundreds of
FP32 instructions per element in the AdamW step (the per-group metadata is computed redundantly by
every thread holding part of the group), which makes the step compute-bound on the GPU. So on CUDA
the kernels default to the fast functions (the hardware's ``lg2.approx``/``ex2.approx``) and
approximate division and square root (``exact_math=False``), per element and for the metadata: the
centre is ``exp2((log2 amax + log2 amin) / 2)`` and the largest expanded value
``exp2(k log2(amax / c))``. Their error, about 2^-22 in log2, is amplified by k (or 1/k) <= 16 in
the exponent: at most about 2^-16 relative, 2^-12 of an E4M3 step. A code differs from the
reference's only when the value lies that close to a rounding midpoint (about 1 in 10^4 codes), and
then by one step; k differs (by 1/16) only in a group whose ratio ``k_target / log2 R`` lies within
that error of an integer. The stored metadata is what dequantization uses, so a fast-math state is
self-consistent. Under the interpreter the default is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .backend import interpreter_enabled, use_triton
from .formats import fp8_format
from .launch import cdiv, lean
from .log2_exp2 import (
    MIN_NORMAL,
    copy_sign,
    div_rn_reference,
    f32,
    log2_fast,
    log2_fast_ftz,
    log2_ieee,
    log2_ieee_reference,
    pow_ieee,
    pow_ieee_reference,
    sqrt_rn_reference,
)
from .scaling import (
    NonFiniteInputError,
    abs_or_inf,
    abs_or_inf_reference,
    fp8_bits,
    quantize_with_inverse,
    quantize_with_inverse_reference,
    scale_from_amax,
    scale_from_amax_reference,
)

K_RESOLUTION = 16  # k is a multiple of 1/16
DEFAULT_K_MIN = 1 / K_RESOLUTION
DEFAULT_K_MAX = 16.0


def k_target(fmax: float) -> float:
    """K_RESOLUTION * log2(fmax^2 / 2), FP32: the numerator of k's formula.

    The target ratio fmax^2/2 (100352 for E4M3, not E4M3's full 2^17.8) puts the smallest element of
    a group at 2/fmax, 1.2 binades above the format's smallest subnormal, where it keeps some
    precision (docs/design.md#dynamic-range-expansion-dre); for E5M2 the same rule gives the same headroom.
    """
    return f32(K_RESOLUTION * math.log2(fmax * fmax / 2))


# --------------------------------------------------------------------------------------------
# Triton device functions (shared with the fused AdamW step in fp8_adamw.py)
# --------------------------------------------------------------------------------------------


@triton.jit
def quantize_expanded_tile(
    x,
    FMAX: tl.constexpr,
    EXPAND: tl.constexpr,
    K_TARGET: tl.constexpr,
    K_MIN16: tl.constexpr,
    K_MAX16: tl.constexpr,
    FAST: tl.constexpr,
    PTX: tl.constexpr,
):
    """Quantize a (groups, G) FP32 tile (padding lanes hold 0) group by group.

    Returns (y, scale, k, center): y is the FP32 value to convert with ``fp8_bits`` (y / scale
    already applied, NaN made 0, clamped to the format's range unless PTX, whose conversion saturates), scale/k/center are (groups,) FP32. Without EXPAND, k and center are 1.
    FAST computes the metadata and the per-element powers with approximate log2/exp2 (see the
    module docstring), otherwise the exact IEEE-only functions; PTX: compiled for NVIDIA.
    """
    ax = abs_or_inf(x)
    amax = tl.max(ax, axis=1)
    if EXPAND and FAST:
        amin = tl.min(tl.where(ax > 0.0, ax, float("inf")), axis=1)
        plain = (amax == 0.0) | (amax == float("inf")) | (amin == amax)
        log2_hi = log2_fast(tl.where(plain, 1.0, amax), PTX)
        log2_lo = log2_fast(tl.where(plain, 1.0, amin), PTX)
        log2_range = log2_hi - log2_lo
        plain = plain | (log2_range <= 0.0)
        k16 = tl.floor(K_TARGET / tl.where(plain, 1.0, log2_range))
        k16 = tl.minimum(tl.maximum(k16, K_MIN16), K_MAX16)
        k = tl.where(plain, 1.0, k16 * (1.0 / 16.0))
        log2_center = 0.5 * (log2_hi + log2_lo)
        center = tl.where(plain, 1.0, tl.maximum(tl.exp2(log2_center), MIN_NORMAL))
        # a plain group has k = 1 and log2 c = 0: mag is |x| to within the approximation, so no
        # per-element select; inf (and NaN, as inf) stays inf and becomes code 0 below
        mag = tl.exp2(log2_fast_ftz(ax, PTX) * k[:, None] - (k * log2_center)[:, None])
        y = copy_sign(mag, x)
        ymax = tl.where(plain, amax, tl.exp2(k * (log2_hi - log2_center)))
    elif EXPAND:
        amin = tl.min(tl.where(ax > 0.0, ax, float("inf")), axis=1)
        # zero, non-finite or single-magnitude groups: plain absmax (COAT's kernel writes NaN codes
        # here, which its dequantization turns into +centre)
        plain = (amax == 0.0) | (amax == float("inf")) | (amin == amax)
        hi = tl.where(plain, 1.0, amax)
        lo = tl.where(plain, 1.0, amin)
        log2_range = log2_ieee(hi) - log2_ieee(lo)
        plain = plain | (log2_range <= 0.0)
        k16 = tl.floor(tl.div_rn(K_TARGET, tl.where(plain, 1.0, log2_range)))
        k16 = tl.minimum(tl.maximum(k16, K_MIN16), K_MAX16)
        k = tl.where(plain, 1.0, k16 * (1.0 / 16.0))
        center = tl.where(plain, 1.0, tl.sqrt_rn(hi) * tl.sqrt_rn(lo))
        mag = pow_ieee(tl.div_rn(ax, center[:, None]), k[:, None])
        y = tl.where(plain[:, None], x, tl.where(x < 0.0, -mag, mag))
        ymax = tl.where(plain, amax, pow_ieee(tl.div_rn(hi, center), k))
    else:
        k = tl.full(amax.shape, 1.0, tl.float32)
        center = k
        y = x
        ymax = amax
    scale = scale_from_amax(ymax, FMAX)
    if FAST:
        inv_scale = (1.0 / scale)[:, None]
    else:
        inv_scale = tl.div_rn(1.0, scale)[:, None]
    if PTX:  # the conversion (cvt.rn.satfinite, scaling.fp8_bits) saturates: no clamp needed
        y = y * inv_scale
        y = tl.where(y != y, 0.0, y)
    else:
        y = quantize_with_inverse(y, inv_scale, FMAX)
    return y, scale, k, center


@triton.jit
def dequantize_expanded_tile(q, scale, k, center, EXPAND: tl.constexpr, FAST: tl.constexpr, PTX: tl.constexpr):
    """FP32 values of a (groups, G) tile of FP8 codes ``q`` (as FP32) with (groups,) metadata."""
    if EXPAND:
        if FAST:
            # (|q| s)^(1/k) c = 2^(log2|q| / k + (log2 s / k + log2 c)): one FMA and two MUFU
            # operations per element, the rest per group
            inv_k = 1.0 / k
            offset = log2_fast(scale, PTX) * inv_k + log2_fast(center, PTX)
            mag = tl.exp2(log2_fast_ftz(tl.abs(q), PTX) * inv_k[:, None] + offset[:, None])
            return copy_sign(mag, q)
        else:
            a = tl.abs(q) * scale[:, None]
            mag = pow_ieee(a, tl.div_rn(1.0, k)[:, None]) * center[:, None]
            return tl.where(q < 0.0, -mag, mag)
    return q * scale[:, None]


# --------------------------------------------------------------------------------------------
# torch reference: the same operations in the same order
# --------------------------------------------------------------------------------------------


def quantize_expanded_groups_reference(x: torch.Tensor, fmax: float, expand: bool, k_min: float, k_max: float):
    """Reference of ``quantize_expanded_tile`` on a (groups, G) FP32 tensor (padding lanes 0)."""
    ax = abs_or_inf_reference(x)
    amax = ax.amax(dim=1)
    if expand:
        amin = torch.where(ax > 0, ax, torch.inf).amin(dim=1)
        plain = (amax == 0) | (amax == torch.inf) | (amin == amax)
        hi = torch.where(plain, 1.0, amax)
        lo = torch.where(plain, 1.0, amin)
        log2_range = log2_ieee_reference(hi) - log2_ieee_reference(lo)
        plain = plain | (log2_range <= 0)
        k16 = torch.floor(div_rn_reference(torch.full_like(amax, k_target(fmax)), torch.where(plain, 1.0, log2_range)))
        k16 = k16.clamp(k_min * K_RESOLUTION, k_max * K_RESOLUTION)
        k = torch.where(plain, 1.0, k16 * (1.0 / 16.0))
        center = torch.where(plain, 1.0, sqrt_rn_reference(hi) * sqrt_rn_reference(lo))
        mag = pow_ieee_reference(div_rn_reference(ax, center[:, None]), k[:, None])
        y = torch.where(plain[:, None], x, torch.where(x < 0, -mag, mag))
        ymax = torch.where(plain, amax, pow_ieee_reference(div_rn_reference(hi, center), k))
    else:
        k = center = torch.ones_like(amax)
        y, ymax = x, amax
    scale = scale_from_amax_reference(ymax, fmax)
    y = quantize_with_inverse_reference(y, div_rn_reference(torch.ones_like(scale), scale)[:, None], fmax)
    return y, scale, k, center


def dequantize_expanded_groups_reference(q: torch.Tensor, scale, k, center, expand: bool) -> torch.Tensor:
    if expand:
        a = q.abs() * scale[:, None]
        mag = pow_ieee_reference(a, div_rn_reference(torch.ones_like(k), k)[:, None]) * center[:, None]
        return torch.where(q < 0, -mag, mag)
    return q * scale[:, None]


# --------------------------------------------------------------------------------------------
# The state type and the public functions
# --------------------------------------------------------------------------------------------


@dataclass
class ExpandedFp8:
    """A tensor in range-expanded FP8: codes plus per-group FP32 metadata.

    Attributes:
        codes: FP8 (``float8_e4m3fn`` or ``float8_e5m2``), the original tensor's shape.
        scale: FP32, (n_groups,), n_groups = ceil(codes.numel() / group_size).
        k, center: FP32, (n_groups,); None when expansion is off (k = 1, center = 1 implied).
        group_size: elements per group along the flattened tensor.
        fmt: "e4m3" or "e5m2".
        signed: False for a tensor of magnitudes (Adam's v): its input was checked non-negative.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    k: torch.Tensor | None
    center: torch.Tensor | None
    group_size: int
    fmt: str
    signed: bool = True

    @property
    def expansion(self) -> bool:
        return self.k is not None

    @property
    def n_groups(self) -> int:
        return self.scale.numel()

    def nbytes(self) -> int:
        """Bytes held: codes + metadata."""
        meta = [t for t in (self.scale, self.k, self.center) if t is not None]
        return self.codes.numel() * self.codes.element_size() + sum(t.numel() * 4 for t in meta)

    @classmethod
    def zeros(
        cls,
        shape,
        *,
        group_size: int = 128,
        fmt: str = "e4m3",
        signed: bool = True,
        expansion: bool = True,
        device=None,
    ) -> "ExpandedFp8":
        """The state of an all-zero tensor (what quantizing zeros gives: scale 1, k 1, centre 1)."""
        f = fp8_format(fmt)
        numel = math.prod(shape)
        n_groups = -(-numel // group_size)
        ones = lambda: torch.ones(n_groups, dtype=torch.float32, device=device)  # noqa: E731
        return cls(
            codes=torch.zeros(shape, dtype=f.dtype, device=device),
            scale=ones(),
            k=ones() if expansion else None,
            center=ones() if expansion else None,
            group_size=group_size,
            fmt=fmt,
            signed=signed,
        )


@lean
@triton.jit
def _quantize_expanded_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    k_ptr,
    c_ptr,
    n,
    FMAX: tl.constexpr,
    EXPAND: tl.constexpr,
    K_TARGET: tl.constexpr,
    K_MIN16: tl.constexpr,
    K_MAX16: tl.constexpr,
    FAST: tl.constexpr,
    PTX: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
):
    groups = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y, scale, k, center = quantize_expanded_tile(x, FMAX, EXPAND, K_TARGET, K_MIN16, K_MAX16, FAST, PTX)
    code = fp8_bits(y, FMAX != 448.0, PTX)
    tl.store(q_ptr + offs, code.to(q_ptr.dtype.element_ty, bitcast=True), mask=mask)
    gmask = groups * GROUP < n
    tl.store(s_ptr + groups, scale, mask=gmask)
    if EXPAND:
        tl.store(k_ptr + groups, k, mask=gmask)
        tl.store(c_ptr + groups, center, mask=gmask)


@lean
@triton.jit
def _dequantize_expanded_kernel(
    q_ptr,
    s_ptr,
    k_ptr,
    c_ptr,
    out_ptr,
    n,
    EXPAND: tl.constexpr,
    FAST: tl.constexpr,
    PTX: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
):
    groups = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < n
    gmask = groups * GROUP < n
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr + groups, mask=gmask, other=1.0)
    if EXPAND:
        k = tl.load(k_ptr + groups, mask=gmask, other=1.0)
        center = tl.load(c_ptr + groups, mask=gmask, other=1.0)
    else:
        k = scale
        center = scale
    x = dequantize_expanded_tile(q, scale, k, center, EXPAND, FAST, PTX)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def use_exact_math(x: torch.Tensor, exact_math: bool | None) -> bool:
    """The kernels' math mode: exact (IEEE-only, bit-identical to the reference) unless on CUDA."""
    return not x.is_cuda if exact_math is None else bool(exact_math)


def compiled_for_nvidia() -> bool:
    """The kernels' PTX constexpr: inline PTX is usable (not under the interpreter)."""
    return not interpreter_enabled()


def _groups_per_program(group_size: int) -> int:
    return max(1, 1024 // group_size)


def _check_limits(k_min: float, k_max: float) -> None:
    for name, value in (("k_min", k_min), ("k_max", k_max)):
        if value * K_RESOLUTION != round(value * K_RESOLUTION):
            raise ValueError(
                f"{name}={value} is not a multiple of 1/{K_RESOLUTION}; round it, e.g. to {round(value * K_RESOLUTION) / K_RESOLUTION}"
            )
    if not DEFAULT_K_MIN <= k_min <= 1.0 <= k_max <= 64.0:
        raise ValueError(
            f"expansion limits k_min={k_min}, k_max={k_max} must satisfy 1/16 <= k_min <= 1 <= k_max <= 64"
        )


def _check_input(x: torch.Tensor, group_size: int) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_expanded takes float32, bfloat16 or float16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"x of shape {tuple(x.shape)} is not contiguous; pass x.contiguous()")
    if group_size < 1 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size} must be a power of two (128 is COAT's)")


def quantize_expanded_reference(
    x: torch.Tensor,
    group_size: int = 128,
    fmt: str = "e4m3",
    *,
    signed: bool = True,
    expansion: bool = True,
    k_min: float = DEFAULT_K_MIN,
    k_max: float = DEFAULT_K_MAX,
) -> ExpandedFp8:
    f = fp8_format(fmt)
    _check_input(x, group_size)
    n = x.numel()
    n_groups = -(-n // group_size)
    flat = torch.nn.functional.pad(x.reshape(-1).float(), (0, n_groups * group_size - n))
    y, scale, k, center = quantize_expanded_groups_reference(
        flat.view(n_groups, group_size), f.max, expansion, k_min, k_max
    )
    codes = y.reshape(-1)[:n].to(f.dtype).view(x.shape)
    return ExpandedFp8(codes, scale, k if expansion else None, center if expansion else None, group_size, fmt, signed)


def dequantize_expanded_reference(state: ExpandedFp8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = state.codes.numel()
    g = state.group_size
    q = torch.nn.functional.pad(state.codes.reshape(-1).float(), (0, state.n_groups * g - n)).view(-1, g)
    x = dequantize_expanded_groups_reference(q, state.scale, state.k, state.center, state.expansion)
    return x.reshape(-1)[:n].to(dtype).view(state.codes.shape)


def quantize_expanded(
    x: torch.Tensor,
    group_size: int = 128,
    fmt: str = "e4m3",
    signed: bool = True,
    *,
    expansion: bool = True,
    k_min: float = DEFAULT_K_MIN,
    k_max: float = DEFAULT_K_MAX,
    check_finite: bool = True,
    exact_math: bool | None = None,
    backend: str = "auto",
) -> ExpandedFp8:
    """Quantize ``x`` to range-expanded FP8, one (scale, k, centre) per group of ``group_size``
    consecutive elements of the flattened tensor (the last group may be shorter).

    Args:
        x: FP32/BF16/FP16, any shape, contiguous.
        group_size: a power of two; 128 as COAT.
        fmt: "e4m3" (default; Adam's m and v) or "e5m2".
        signed: False for magnitudes (Adam's v); then negative input is an error.
        expansion: False gives plain per-group absmax scaling (k and center not stored).
        k_min, k_max: limits of k, multiples of 1/16 with k_min <= 1 <= k_max.
        check_finite: raise ``NonFiniteInputError`` (and, unsigned, ValueError for negative values)
            after one device sync; with False such groups come back with an infinite scale.
        exact_math: Triton only: True makes the kernel bit-identical to the torch reference, False
            uses the hardware's exp2/log2 per element; None: exact except on CUDA (module docstring).
    Returns:
        ``ExpandedFp8`` with codes of x's shape and FP32 metadata of shape (ceil(numel / group_size),).
    """
    f = fp8_format(fmt)
    _check_input(x, group_size)
    _check_limits(k_min, k_max)
    if check_finite and not signed and x.numel() and bool((x < 0).any()):
        raise ValueError("quantize_expanded(signed=False) got negative values; pass signed=True for signed data")
    if not use_triton(x, backend):
        state = quantize_expanded_reference(
            x, group_size, fmt, signed=signed, expansion=expansion, k_min=k_min, k_max=k_max
        )
    else:
        n = x.numel()
        n_groups = -(-n // group_size)
        state = ExpandedFp8(
            codes=torch.empty(x.shape, dtype=f.dtype, device=x.device),
            scale=torch.empty(n_groups, dtype=torch.float32, device=x.device),
            k=torch.empty(n_groups, dtype=torch.float32, device=x.device) if expansion else None,
            center=torch.empty(n_groups, dtype=torch.float32, device=x.device) if expansion else None,
            group_size=group_size,
            fmt=fmt,
            signed=signed,
        )
        if n:
            groups = _groups_per_program(group_size)
            fast = not use_exact_math(x, exact_math)
            _quantize_expanded_kernel[(cdiv(n_groups, groups),)](
                x,
                state.codes,
                state.scale,
                state.k if expansion else state.scale,
                state.center if expansion else state.scale,
                n,
                FMAX=f.max,
                EXPAND=expansion,
                K_TARGET=k_target(f.max),
                K_MIN16=k_min * K_RESOLUTION,
                K_MAX16=k_max * K_RESOLUTION,
                FAST=fast,
                PTX=compiled_for_nvidia(),
                GROUP=group_size,
                GROUPS=groups,
                num_warps=4,
                enable_fp_fusion=fast,
            )
    if check_finite and state.n_groups and not bool(torch.isfinite(state.scale).all()):
        bad = int((~torch.isfinite(state.scale)).sum())
        raise NonFiniteInputError(
            f"quantize_expanded: input holds inf or NaN ({bad} of {state.n_groups} groups); find where they come "
            f"from, or pass check_finite=False to get infinite scales as a flag instead"
        )
    return state


def dequantize_expanded(
    state: ExpandedFp8, dtype: torch.dtype = torch.float32, *, exact_math: bool | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Inverse of ``quantize_expanded``: x' = sign(q) (|q| scale)^(1/k) center per group, in ``dtype``
    (FP32 by default), shaped like ``state.codes``. ``exact_math`` as for ``quantize_expanded``."""
    if state.codes.dtype != fp8_format(state.fmt).dtype:
        raise TypeError(f"codes are {state.codes.dtype} but the state says {state.fmt!r}")
    n = state.codes.numel()
    n_groups = -(-n // state.group_size)
    for name in ("scale", "k", "center"):
        t = getattr(state, name)
        if t is not None and (t.dtype != torch.float32 or t.shape != (n_groups,) or not t.is_contiguous()):
            raise ValueError(
                f"state.{name} must be contiguous float32 of shape ({n_groups},), got {t.dtype} {tuple(t.shape)}"
            )
    if not use_triton(state.codes, backend):
        return dequantize_expanded_reference(state, dtype)
    out = torch.empty(state.codes.shape, dtype=dtype, device=state.codes.device)
    if n:
        groups = _groups_per_program(state.group_size)
        fast = not use_exact_math(state.codes, exact_math)
        meta = state.scale
        _dequantize_expanded_kernel[(cdiv(n_groups, groups),)](
            state.codes.contiguous(),
            state.scale,
            state.k if state.expansion else meta,
            state.center if state.expansion else meta,
            out,
            n,
            EXPAND=state.expansion,
            FAST=fast,
            PTX=compiled_for_nvidia(),
            GROUP=state.group_size,
            GROUPS=groups,
            num_warps=4,
            enable_fp_fusion=fast,
        )
    return out
