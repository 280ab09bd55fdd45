"""Why SwiGLU's backward does not write fc1's FP8 gradient itself: the layouts a fused kernel could use.

    python benchmarks/swiglu_fusion_study.py [TOKENS FFN]      (a CUDA GPU; Llama-2-7B's 8192 x 11008 by default)

A kernel that quantizes SwiGLU's output gradient dh per tensor and also writes its transpose (what
fc1's dgrad and wgrad read) must transpose FP8 codes computed from 1x16-scaled FP8 input. Triton 3.6
miscompiles the in-register transpose of the 3-D (rows x groups x 16) tiles COAT's SwiGLU kernels
use (``per_tensor.transpose_in_pass``), so such a kernel needs a 2-D tile. This times, on the
forward's transposed recompute (the smallest such kernel: read the codes and scales, write the
transposed output codes), each way to build one, against the library's path (3-D tile, codes
written, then a byte transpose), checking every variant's bytes against the library's:

- ``gather``: each element's group scale loaded through its own index (cols // 16);
- ``bcast``: one scale per group loaded, broadcast over its 16 columns through a reshape;
- ``3-D scatter``: the 3-D tile, its codes stored at their transposed addresses (no tl.trans);
- each 2-D variant also without the transpose (codes stored row-major), to separate the costs.

Measured on an H200 (benchmarks/results/kernel-bandwidth-1gpu/commands.txt): the gathered scales run at
0.10 of copy bandwidth; the broadcast ones at 0.5, the library's path at 0.45. A fused backward moves
13 bytes per FFN column per token where the unfused path (the 3-D backward kernel at 0.69 of copy,
then the quantizer at 0.86) moves 16.5: at 0.5 of copy it would still be slower, so it was not kept.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from coat_kernels import quantize_per_group
from coat_kernels import swiglu as S
from coat_kernels.per_tensor import transpose_codes
from coat_kernels.scaling import quantize_with_inverse, scale_from_amax


@triton.jit
def _gather_half(q_ptr, s_ptr, rows64, cols, mask, row_len, GROUP: tl.constexpr):
    q = tl.load(q_ptr + rows64[:, None] * row_len + cols[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + rows64[:, None] * (row_len // GROUP) + (cols // GROUP)[None, :], mask=mask, other=1.0)
    return q.to(tl.float32) * s


@triton.jit
def _bcast_half(
    q_ptr, s_ptr, rows64, cols, groups, mask, maskg, row_len, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr
):
    q = tl.load(q_ptr + rows64[:, None] * row_len + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows64[:, None] * (row_len // GROUP) + groups[None, :], mask=maskg, other=1.0)
    return q * tl.reshape(tl.broadcast_to(s[:, :, None], (BM, BN // GROUP, GROUP)), (BM, BN))


@triton.jit
def _store(q, qt_ptr, rows, cols, n_rows, n_ffn, TRANS: tl.constexpr):
    rows64 = rows.to(tl.int64)
    if TRANS:
        mask_t = (cols[:, None] < n_ffn) & (rows[None, :] < n_rows)
        tl.store(qt_ptr + cols.to(tl.int64)[:, None] * n_rows + rows64[None, :], tl.trans(q), mask=mask_t)
    else:
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_ffn)
        tl.store(qt_ptr + rows64[:, None] * n_ffn + cols[None, :], q, mask=mask)


@triton.jit
def _silu_codes(gate, up, amax_ptr, qt_ptr):
    scale = scale_from_amax(tl.load(amax_ptr), 448.0)
    return quantize_with_inverse(gate * tl.sigmoid(gate) * up, tl.div_rn(1.0, scale), 448.0).to(qt_ptr.dtype.element_ty)


@triton.jit
def tile_2d_kernel(
    hq_ptr,
    hs_ptr,
    amax_ptr,
    qt_ptr,
    n_rows,
    n_ffn,
    GROUP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BCAST: tl.constexpr,
    TRANS: tl.constexpr,
):
    """The 2-D variants: group scales gathered per element, or broadcast from one load per group
    (BCAST); codes stored transposed (TRANS) or row-major."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_ffn)
    rows64 = rows.to(tl.int64)
    if BCAST:
        groups = tl.program_id(1) * (BN // GROUP) + tl.arange(0, BN // GROUP)
        maskg = (rows[:, None] < n_rows) & (groups[None, :] < n_ffn // GROUP)
        gate = _bcast_half(hq_ptr, hs_ptr, rows64, cols, groups, mask, maskg, 2 * n_ffn, BM, BN, GROUP)
        up = _bcast_half(
            hq_ptr + n_ffn, hs_ptr + n_ffn // GROUP, rows64, cols, groups, mask, maskg, 2 * n_ffn, BM, BN, GROUP
        )
    else:
        gate = _gather_half(hq_ptr, hs_ptr, rows64, cols, mask, 2 * n_ffn, GROUP)
        up = _gather_half(hq_ptr + n_ffn, hs_ptr + n_ffn // GROUP, rows64, cols, mask, 2 * n_ffn, GROUP)
    _store(_silu_codes(gate, up, amax_ptr, qt_ptr), qt_ptr, rows, cols, n_rows, n_ffn, TRANS)


@triton.jit
def scatter_kernel(
    hq_ptr, hs_ptr, amax_ptr, qt_ptr, n_rows, n_ffn, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups, cols, mask2 = S._tile(rows, tl.program_id(1) * GROUPS, n_rows, n_ffn // GROUP, GROUPS, GROUP)
    rows64 = rows.to(tl.int64)
    gate = S._load_half(hq_ptr, hs_ptr, rows64, groups, cols, mask2, 2 * n_ffn, GROUP)
    up = S._load_half(hq_ptr + n_ffn, hs_ptr + n_ffn // GROUP, rows64, groups, cols, mask2, 2 * n_ffn, GROUP)
    q = _silu_codes(gate, up, amax_ptr, qt_ptr)
    tl.store(qt_ptr + cols.to(tl.int64) * n_rows + rows64[:, None, None], q, mask=mask2[:, :, None])


def main() -> None:
    tokens, ffn = (8192, 11008) if len(sys.argv) < 3 else (int(sys.argv[1]), int(sys.argv[2]))
    if not torch.cuda.is_available():
        raise SystemExit("swiglu_fusion_study.py times kernels: it needs a CUDA GPU")
    torch.manual_seed(0)
    h = torch.randn(tokens, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    hq, hs = quantize_per_group(h, 16, "e4m3", check_finite=False)
    ref = S.swiglu_to_fp8(hq, hs, 16, transpose=True)
    want_t, want = ref.q_t.view(torch.uint8), ref.q.view(torch.uint8)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")

    copy_gbs = 2 * h.numel() * 2 / bench(lambda: h.clone()) / 1e6
    nbytes = tokens * 2 * ffn * 1.25 + tokens * ffn  # codes and scales read, output codes written
    out_t = torch.empty(ffn, tokens, dtype=torch.float8_e4m3fn, device="cuda")
    out = torch.empty(tokens, ffn, dtype=torch.float8_e4m3fn, device="cuda")
    print(f"tokens {tokens}, FFN {ffn}, {torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s")

    def row(name, fn, got=None, want_bytes=None):
        fn()
        ok = "" if got is None else ("same bytes" if torch.equal(got.view(torch.uint8), want_bytes) else "WRONG")
        ms = bench(fn)
        print(f"{name:48s} {ms:7.3f} ms  {nbytes / ms / 1e6 / copy_gbs:5.2f} of copy  {ok}")

    amax = ref.amax
    row("library: 3-D tile, codes, then byte transpose", lambda: S.swiglu_to_fp8(hq, hs, 16, transpose=True, amax=amax))
    row("byte transpose of the codes alone", lambda: transpose_codes(ref.q))
    for bm, bn, w in [(64, 64, 4), (16, 256, 4), (32, 128, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8)]:
        g = (triton.cdiv(tokens, bm), triton.cdiv(ffn, bn))
        for name, bcast in (("gather", False), ("bcast", True)):
            for trans, dst, want_bytes in ((True, out_t, want_t), (False, out, want)):
                row(
                    f"{name} 2-D {'transposed' if trans else 'row-major'} ({bm}, {bn}, {w})",
                    lambda b=bcast, d=dst, t=trans: tile_2d_kernel[g](
                        hq, hs, amax, d, tokens, ffn, GROUP=16, BM=bm, BN=bn, BCAST=b, TRANS=t, num_warps=w
                    ),
                    dst,
                    want_bytes,
                )
    for bm, bn, w in [(64, 64, 4), (32, 128, 4), (128, 64, 8), (16, 256, 4), (64, 128, 8)]:
        g = (triton.cdiv(tokens, bm), triton.cdiv(ffn, bn))
        row(
            f"3-D scatter ({bm}, {bn}, {w})",
            lambda: scatter_kernel[g](
                hq, hs, amax, out_t, tokens, ffn, GROUP=16, BLOCK_M=bm, GROUPS=bn // 16, num_warps=w
            ),
            out_t,
            want_t,
        )


if __name__ == "__main__":
    main()
