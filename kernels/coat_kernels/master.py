"""A split FP32 master weight: the BF16 model weight is its high half, an int16 word its low half.

An FP32 number is 32 bits; the BF16 number nearest to it shares its sign, exponent and top 7
mantissa bits, and differs from the FP32 bit pattern by less than 2^15 units of that pattern's
integer value. So the FP32 master weight is exactly

    bits(master) = (bits(hi) << 16) + lo        (32-bit integer arithmetic, lo a signed int16)

with hi = the BF16 model weight that the forward reads anyway and lo = the int16 remainder: an
FP32 master for 2 bytes per parameter instead of 4, reconstructed bit-exactly.

The rounding that makes lo fit: hi = (bits + 0x8000) >> 16 on the unsigned pattern, i.e. to
nearest with ties away from zero (the magnitude is in the low 31 bits for either sign). Then
lo = bits - (hi << 16) lies in [-32768, 32767] for every FP32 pattern, a bijection. Round-to-
nearest-even (torch's ``.bfloat16()``) would not do: its two ties round to the same even hi with
remainders +32768 and -32768, one value too many for 16 bits. The BF16 weights therefore differ
from ``master.bfloat16()`` exactly where the master lies halfway between two BF16 numbers (the
low 16 bits are 0x8000, 1 in 65536 values), by one BF16 unit, and are as close to the master.

Non-finite masters are not representable this way in general (an Inf or NaN pattern can carry
into the sign bit); a weight that became Inf/NaN has ruined the run before this matters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi BF16, lo int16) of an FP32 tensor: ``join_master(hi, lo)`` gives it back bit for bit."""
    if master.dtype != torch.float32:
        raise TypeError(f"split_master takes an FP32 tensor, got {master.dtype}")
    u = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    h = ((u + 0x8000) >> 16) & 0xFFFF
    lo = ((u - (h << 16) + 0x8000) & 0xFFFF) - 0x8000
    hi = torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(torch.bfloat16)
    return hi.view(master.shape), lo.to(torch.int16).view(master.shape)


def join_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The FP32 master weight of a BF16 high half and its int16 low word (a new tensor)."""
    if hi.dtype != torch.bfloat16 or lo.dtype != torch.int16 or hi.shape != lo.shape:
        raise TypeError(
            f"join_master takes a BF16 high half and an int16 low word of one shape, got {hi.dtype} {tuple(hi.shape)} and {lo.dtype} {tuple(lo.shape)}"
        )
    b = ((hi.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + lo.to(torch.int64)
    b = b & 0xFFFFFFFF
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32).view(hi.shape)


@triton.jit
def join_master_tile(hi, lo):
    """FP32 values from BF16 bit patterns ``hi`` (int16) and low words ``lo`` (int16)."""
    bits = (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16) + lo.to(tl.int32).to(tl.uint32, bitcast=True)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def split_master_tile(x):
    """(hi, lo) int16 bit patterns of FP32 ``x``: BF16 to nearest, ties away from zero, and the rest."""
    u = x.to(tl.uint32, bitcast=True)
    h = (u + 0x8000) >> 16
    lo = (u - (h << 16)).to(tl.int32, bitcast=True).to(tl.int16)
    hi = h.to(tl.uint16).to(tl.int16, bitcast=True)
    return hi, lo
