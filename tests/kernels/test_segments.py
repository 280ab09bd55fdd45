"""The FP8 parameter gather's segment kernels (``coat_kernels.segments``) against their torch references:
awkward segment lengths (ragged last blocks, 1 element, several blocks), zero, constant and outlier
weights, non-finite values, raw BF16 and FP32 segments, both formats, codes as bytes."""

import pytest
import torch

from coat_kernels.segments import (
    BLOCK,
    pack_segments,
    segment_table,
    segmented_amax,
    segmented_amax_reference,
    unpack_segments,
)

# (length, weight, kind): weight -1 is a raw segment
LAYOUT = [(1, 0, "normal"), (BLOCK + 37, 1, "outlier"), (300, -1, "normal"), (96, 2, "zero"), (17, 1, "normal"),
          (2 * BLOCK + 5, 3, "constant"), (33, -1, "normal"), (64, 4, "tiny")]  # fmt: skip
N_WEIGHTS = 5


def _buffer(dtype, seed):
    """x: the segments laid out with gaps between them (elements no segment covers), and the table."""
    g = torch.Generator().manual_seed(seed)
    segments, parts, start, offset = [], [], 0, 0
    size = torch.empty(0, dtype=dtype).element_size()
    for n, w, kind in LAYOUT:
        gap = int(torch.randint(0, 5, (), generator=g))
        parts.append(torch.full((gap,), 7.0))
        start += gap
        v = torch.randn(n, generator=g)
        if kind == "outlier":
            v[n // 2] = 900.0
        elif kind == "zero":
            v.zero_()
        elif kind == "constant":
            v.fill_(-0.3)
        elif kind == "tiny":
            v *= 1e-30
        parts.append(v)
        offset = -(-offset // 16) * 16  # every segment's stream offset 16-byte aligned
        segments.append((start, offset, n, w))
        start += n
        offset += n * (1 if w >= 0 else size)
    return torch.cat(parts).to(dtype), segments, -(-offset // 16) * 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_pack_amax_and_unpack_equal_the_reference(device, dtype, fmt, seed):
    x, segments, stream_bytes = _buffer(dtype, seed)
    size = x.element_size()
    table = segment_table(segments, "cpu", element_size=size)
    assert int(table[:, 2].sum()) == sum(n for _, _, n, _ in segments)  # the blocks cover the segments
    want_amax = segmented_amax_reference(x, table, N_WEIGHTS)
    amax = segmented_amax(x.to(device), table.to(device), N_WEIGHTS, backend="triton").cpu()
    assert torch.equal(amax, want_amax)
    assert amax[0] == x[segments[0][0]].float().abs() and amax[1] == 900.0 and amax[2] == 0.0
    scales = torch.where(amax == 0, 1.0, amax / (448.0 if fmt == "e4m3" else 57344.0))
    inverse = 1.0 / scales

    want = torch.full((stream_bytes,), 0xAB, dtype=torch.uint8)
    pack_segments(x, table, inverse, fmt, want, backend="reference")
    got = torch.full((stream_bytes,), 0xAB, dtype=torch.uint8, device=device)
    pack_segments(x.to(device), table.to(device), inverse.to(device), fmt, got, backend="triton")
    assert torch.equal(got.cpu(), want), f"{(got.cpu() != want).sum()} bytes differ"
    for start, offset, n, w in segments:  # raw segments are x's own bytes
        if w < 0:
            assert torch.equal(want[offset : offset + n * size], x[start : start + n].view(torch.uint8))

    back_want = torch.full_like(x, -5.0)
    unpack_segments(want, table, scales, fmt, back_want, backend="reference")
    back = torch.full_like(x, -5.0).to(device)
    unpack_segments(got, table.to(device), scales.to(device), fmt, back, backend="triton")
    assert torch.equal(back.cpu().view(torch.uint8), back_want.view(torch.uint8))
    covered = torch.zeros(x.numel(), dtype=torch.bool)
    for start, _, n, w in segments:
        covered[start : start + n] = True
        if w < 0:
            assert torch.equal(back_want[start : start + n], x[start : start + n])
        else:  # the codes, dequantized: within the format's rounding
            rel = 2**-4 if fmt == "e4m3" else 2**-3
            torch.testing.assert_close(back_want[start : start + n].float(), x[start : start + n].float(), rtol=rel,
                                       atol=scales[w].item() * 2**-6)  # fmt: skip
    assert (back.cpu()[~covered] == -5.0).all()  # nothing outside the segments is written


def test_non_finite_weights_give_an_infinite_amax_and_nan_after_the_round_trip(device):
    x = torch.tensor([1.0, float("nan"), 2.0, 3.0, float("inf"), 0.5], dtype=torch.bfloat16)
    segments = [(0, 0, 3, 0), (3, 16, 3, 1)]
    table = segment_table(segments, "cpu")
    amax = segmented_amax(x.to(device), table.to(device), 2, backend="triton").cpu()
    assert torch.isinf(amax).all()
    scales = amax / 448.0
    stream = torch.zeros(32, dtype=torch.uint8, device=device)
    pack_segments(x.to(device), table.to(device), (1.0 / scales).to(device), "e4m3", stream, backend="triton")
    back = torch.zeros_like(x).to(device)
    unpack_segments(stream, table.to(device), scales.to(device), "e4m3", back, backend="triton")
    assert torch.isnan(back.cpu()).all()  # never a finite number for a non-finite weight


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="multiple of 2"):
        segment_table([(0, 3, 10, -1)], "cpu", element_size=2)
    with pytest.raises(ValueError, match="split the bucket"):
        segment_table([(2**31 - 5, 0, 10, 0)], "cpu")
    x = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="uint8"):
        pack_segments(x, segment_table([(0, 0, 8, 0)], "cpu"), torch.ones(1), "e4m3", torch.zeros(8))
