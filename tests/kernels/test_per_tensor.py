import pytest
import torch
from kernel_inputs import as_bytes, random_activations

from coat_kernels import (
    NonFiniteInputError,
    dequantize_per_tensor,
    fp8_format,
    quantize_per_tensor,
    quantize_per_tensor_transposed,
    tensor_amax,
    transpose_codes,
)
from coat_kernels.per_tensor import dequantize_per_tensor_reference, quantize_per_tensor_reference

SHAPES = [(50,), (7, 96), (3, 5, 160), (33, 5120), (5, 11008), (2, 3, 13824), (129, 257)]


def quantize_on(device, x, fmt, **kw):
    return tuple(t.cpu() for t in quantize_per_tensor(x.to(device), fmt, backend="triton", **kw))


def check_matches_reference(device, x, fmt, transpose):
    out = quantize_on(device, x, fmt, transpose=transpose)
    ref = quantize_per_tensor_reference(x, fmt, transpose=transpose)
    q, scale = out[:2]
    assert q.shape == x.shape and q.dtype == fp8_format(fmt).dtype
    assert scale.shape == () and scale.dtype == torch.float32
    assert torch.equal(scale, ref[1])
    assert torch.equal(as_bytes(q), as_bytes(ref[0])), f"{(as_bytes(q) != as_bytes(ref[0])).sum()} codes differ"
    if transpose:
        q_t = out[2]
        assert q_t.shape == (x.shape[-1], x.numel() // x.shape[-1]) and q_t.is_contiguous()
        assert torch.equal(as_bytes(q_t), as_bytes(q).reshape(-1, x.shape[-1]).t())
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transpose"])
def test_matches_reference_on_awkward_shapes(device, shape, fmt, transpose, seed):
    check_matches_reference(device, random_activations(shape, seed=seed), fmt, transpose)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_input_dtypes(device, dtype, seed):
    check_matches_reference(device, random_activations((19, 200), dtype, seed=seed), "e4m3", True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4099, 14336), (2, 2047, 5120)], ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_shapes_on_gpu(shape, fmt, dtype, seed):
    check_matches_reference(torch.device("cuda"), random_activations(shape, dtype, seed=seed), fmt, True)


def test_amax_by_group_scaling_and_from_the_producer(device, seed):
    x = random_activations((37, 600), seed=seed)
    amax = tensor_amax(x.to(device), backend="triton").cpu()
    assert amax.shape == () and amax == x.float().abs().amax()
    # a producer hands over one amax per row (any shape): same result as the internal pass
    per_row = x.float().abs().amax(dim=1)
    given = quantize_on(device, x, "e4m3", transpose=True, amax=per_row.to(device))
    own = quantize_on(device, x, "e4m3", transpose=True)
    assert torch.equal(given[1], own[1]) and torch.equal(as_bytes(given[0]), as_bytes(own[0]))
    assert torch.equal(as_bytes(given[2]), as_bytes(own[2]))
    # a shared (e.g. all-reduced) amax larger than the local one is what the scale follows
    shared = quantize_on(device, x, "e4m3", amax=(amax * 4).to(device))
    assert shared[1] == (amax * 4) / 448


@pytest.mark.parametrize("fmt,bound", [("e4m3", 2.0**-4), ("e5m2", 2.0**-3)])
def test_round_trip_error_within_one_step_of_the_format(device, fmt, bound, seed):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
    q, scale = quantize_on(device, x, fmt)
    y = dequantize_per_tensor(q.to(device), scale.to(device), torch.float32, backend="triton").cpu()
    assert torch.equal(y, dequantize_per_tensor_reference(q, scale, torch.float32))
    min_normal = 2.0**-6 if fmt == "e4m3" else 2.0**-14
    normal = x.abs() / scale >= min_normal
    assert ((y - x).abs()[normal] <= bound * x.abs()[normal]).all()


@pytest.mark.parametrize("shape", [(5, 48), (3, 40), (37, 600), (1, 17), (130, 3), (7, 96)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_transposed_code_is_written(device, shape, dtype):
    # outputs are poisoned (conftest), so a code the kernel skips cannot read as correct
    x = torch.zeros(shape, dtype=dtype)
    x.view(-1)[::3] = 1.0
    q, scale, q_t = quantize_on(device, x, "e4m3", transpose=True)
    assert torch.equal(as_bytes(q_t), as_bytes(q).t()) and not (as_bytes(q_t) == 0x7F).any()


@pytest.mark.parametrize("shape", [(1, 1), (5, 48), (130, 3), (3, 5, 160), (65, 129), (257, 70)], ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_transpose_codes_matches_a_byte_transpose(device, shape, fmt):
    # every byte value, NaN codes included, in a random order: the kernel moves bytes, never values
    g = torch.Generator().manual_seed(sum(shape))
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    q = codes.view(fp8_format(fmt).dtype)
    q_t = transpose_codes(q.to(device), backend="triton").cpu()
    assert q_t.dtype == q.dtype and q_t.shape == (shape[-1], codes.numel() // shape[-1]) and q_t.is_contiguous()
    assert torch.equal(as_bytes(q_t), codes.reshape(-1, shape[-1]).t())
    assert torch.equal(as_bytes(transpose_codes(q, backend="reference")), as_bytes(q_t))


@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 160), (129, 257), (1, 16), (0, 32)], ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("given_amax", [False, True], ids=["own-amax", "given-amax"])
def test_quantize_transposed_only_matches_the_reference(device, shape, fmt, dtype, given_amax, seed):
    x = random_activations(shape, dtype, seed=seed) if shape[0] else torch.zeros(shape, dtype=dtype)
    amax = (x.float().abs().amax() * 2).reshape(()) if given_amax and x.numel() else None
    q_t, scale = quantize_per_tensor_transposed(
        x.to(device), fmt, amax=None if amax is None else amax.to(device), backend="triton"
    )
    ref = quantize_per_tensor_reference(x, fmt, transpose=True, amax=amax)
    assert q_t.shape == (shape[-1], x.numel() // shape[-1]) and q_t.is_contiguous()
    assert torch.equal(scale.cpu(), ref[1]) and torch.equal(as_bytes(q_t), as_bytes(ref[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 2048), (4096, 11008), (22016, 4096), (4099, 14337)], ids=str)
def test_quantize_transposed_only_of_weight_shapes_on_gpu(shape, seed):
    x = random_activations(shape, torch.bfloat16, seed=seed).cuda()
    q, scale, q_t = quantize_per_tensor(x, "e4m3", transpose=True)
    q_t_only, scale_only = quantize_per_tensor_transposed(x, "e4m3")
    assert torch.equal(scale_only, scale) and torch.equal(q_t_only.view(torch.uint8), q_t.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6144, 2048), (4096, 11008), (22016, 4096), (4099, 14337)], ids=str)
def test_transpose_codes_of_weight_shapes_on_gpu(shape):
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    q_t = transpose_codes(codes.view(torch.float8_e4m3fn))
    assert torch.equal(q_t.view(torch.uint8), codes.t())


def test_zero_constant_outlier_and_subnormal_tensors(device):
    zero = quantize_on(device, torch.zeros(5, 48), "e4m3", transpose=True)
    assert zero[1] == 1.0 and (as_bytes(zero[0]) == 0).all() and (as_bytes(zero[2]) == 0).all()
    const = check_matches_reference(device, torch.full((3, 40), -7.5), "e4m3", True)
    assert const[1] == torch.tensor(7.5) / 448
    assert torch.allclose(dequantize_per_tensor_reference(const[0], const[1], torch.float32), torch.full((3, 40), -7.5))
    x = torch.randn(16, 64) * 1e-2
    x[3, 7] = 2.0e5
    q, scale = check_matches_reference(device, x, "e5m2", False)
    assert dequantize_per_tensor_reference(q, scale, torch.float32)[3, 7] == pytest.approx(2.0e5, rel=2.0**-3)
    tiny = torch.linspace(1, 64, 64).reshape(4, 16) * 1e-45
    q, scale = check_matches_reference(device, tiny, "e4m3", True)[:2]
    assert torch.isfinite(scale) and scale > 0
    assert (dequantize_per_tensor_reference(q, scale, torch.float32) - tiny).abs().max() < 1e-38


def test_non_finite_input_is_an_error_or_an_infinite_scale(device):
    x = torch.randn(4, 32)
    x[2, 3] = float("nan")
    with pytest.raises(NonFiniteInputError, match="inf or NaN"):
        quantize_per_tensor(x.to(device), "e4m3", backend="triton")
    q, scale = quantize_on(device, x, "e4m3", check_finite=False)
    assert torch.isinf(scale) and (q.float() == 0).all()
    assert torch.isnan(dequantize_per_tensor_reference(q, scale, torch.float32)).all()
    x[2, 3] = -float("inf")
    assert torch.isinf(tensor_amax(x.to(device), backend="triton"))


def test_strided_rows_and_rejected_layouts(device):
    base = torch.randn(10, 70, dtype=torch.bfloat16)
    view = base[1:8, 3:67]
    out = quantize_on(device, view, "e4m3", transpose=True)
    ref = quantize_per_tensor_reference(view.contiguous(), "e4m3", transpose=True)
    assert all(
        torch.equal(as_bytes(a) if a.dtype != torch.float32 else a, as_bytes(b) if b.dtype != torch.float32 else b)
        for a, b in zip(out, ref)
    )
    with pytest.raises(ValueError, match=r"contiguous\(\)"):
        quantize_per_tensor(torch.randn(16, 8, device=device).t(), "e4m3", backend="triton")
    with pytest.raises(ValueError, match="amax must be a non-empty float32"):
        quantize_per_tensor(
            torch.randn(4, 4, device=device), "e4m3", amax=torch.ones(1, dtype=torch.float64, device=device)
        )
    with pytest.raises(ValueError, match="use 'e4m3'"):
        quantize_per_tensor(torch.randn(4, 4), "fp8")


def test_empty_input(device):
    q, scale, q_t = quantize_on(device, torch.empty(0, 24), "e4m3", transpose=True)
    assert q.shape == (0, 24) and q_t.shape == (24, 0) and scale == 1.0


@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 160), (2, 8), (1, 17), (5, 3), (0, 32)], ids=str)
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transpose"])
def test_packed_outputs_hold_the_same_codes_and_scale_in_one_message(device, shape, backend, transpose, seed):
    """A packed output (what a sequence-parallel all-gather sends) is the unpacked one's bytes: its
    codes, then its scale in a 16-byte row; where the codes fill no whole rows it stays apart."""
    from coat_kernels.per_tensor import SCALE_ROW_BYTES, packed_message

    x = random_activations(shape, seed=seed).to(device)
    if x.numel():
        x.view(-1)[0] = 300.0  # an outlier: the scale is not 1
    apart = quantize_per_tensor(x, "e5m2", transpose=transpose, backend=backend)
    packed = quantize_per_tensor(x, "e5m2", transpose=transpose, backend=backend, packed=True)
    for a, b in zip(apart, packed):
        assert a.shape == b.shape and torch.equal(
            a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)
        )
    message = packed_message(packed[0], packed[1])
    n = x.numel()
    if n and n % SCALE_ROW_BYTES == 0:
        assert message is not None and message.shape == (n + SCALE_ROW_BYTES,) and message.dtype == torch.uint8
        assert torch.equal(message[:n].cpu(), as_bytes(apart[0]).reshape(-1))
        assert torch.equal(message[n : n + 4].view(torch.float32).cpu(), apart[1].reshape(1).cpu())
    else:
        assert message is None
    assert packed_message(apart[0], apart[1]) is None


FOLDED_CASES = [  # (chunks, rows, cols): ragged tiles (rows or cols no multiple of a block), one chunk, many
    (2, 64, 96),
    (3, 33, 40),
    (4, 4, 16),
    (1, 7, 24),
    (2, 130, 257),
]


def _chunk_by_chunk(x, fmt, chunks, amax, x_scales, transpose):
    """What the sequence-parallel column-parallel backward did before the one-pass kernel: the folded
    amaxes in torch, then quantize_per_tensor of each chunk with its own, the transposes side by side."""
    rows = x.reshape(-1, x.shape[-1])
    r_c = rows.shape[0] // chunks
    amaxes = amax * (x_scales.max() / x_scales) if x_scales is not None else [amax] * chunks
    parts = [
        quantize_per_tensor_reference(rows[c * r_c : (c + 1) * r_c], fmt, transpose=transpose, amax=amaxes[c])
        for c in range(chunks)
    ]
    q = torch.cat([as_bytes(p[0]) for p in parts])
    q_t = torch.cat([as_bytes(p[2]) for p in parts], dim=1) if transpose else None
    return q, torch.stack([p[1] for p in parts]), q_t


@pytest.mark.parametrize("case", FOLDED_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "one-amax"])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transpose"])
def test_folded_chunks_in_one_pass_are_each_chunk_quantized_with_its_folded_amax(
    device, case, dtype, fold, transpose, seed
):
    """``quantize_folded_chunks`` (one launch) against the chunk-by-chunk path it replaces, codes as
    bytes and scales: x scales 2^112 apart, a zero chunk, outliers."""
    from coat_kernels.per_tensor import quantize_folded_chunks

    chunks, n_rows, n_cols = case
    x = random_activations((n_rows, n_cols), dtype, seed=seed)
    r_c = n_rows // chunks
    if chunks > 1:
        x[r_c : 2 * r_c] = 0.0  # a chunk of zeros
    x[0, -1] = 2000.0  # an outlier
    x_scales = torch.tensor([0.75, 2.0**-100, 3.5e3, 1e-3][:chunks], dtype=torch.float32)
    amax = x.float().abs().max()
    q, scales, q_t = quantize_folded_chunks(
        x.to(device),
        "e5m2",
        chunks=chunks,
        amax=amax.to(device),
        x_scales=x_scales.to(device) if fold else None,
        transpose=transpose,
        backend="triton",
    )
    want_q, want_scales, want_q_t = _chunk_by_chunk(x, "e5m2", chunks, amax, x_scales if fold else None, transpose)
    assert q.shape == (n_rows, n_cols) and torch.equal(as_bytes(q), want_q)
    assert torch.equal(scales.cpu(), want_scales)
    assert all(s.data_ptr() % 16 == 0 for s in scales.unbind())  # cuBLASLt takes scale pointers there
    if transpose:
        assert q_t.shape == (n_cols, n_rows) and torch.equal(as_bytes(q_t), want_q_t)
    else:
        assert q_t is None
    if fold and chunks > 1:  # the fold: one product of scales for every chunk pair
        products = scales.cpu() * x_scales
        assert torch.allclose(products, products[0].expand(chunks), rtol=1e-6, atol=0)


def test_folded_chunks_of_a_zero_tensor_and_bad_arguments():
    from coat_kernels.per_tensor import quantize_folded_chunks

    x = torch.zeros(8, 32, dtype=torch.bfloat16)
    for backend in ("triton", "reference"):
        q, scales, _ = quantize_folded_chunks(
            x, "e5m2", chunks=2, amax=torch.zeros(()), x_scales=torch.tensor([1.0, 2.0]), backend=backend
        )
        assert torch.equal(scales, torch.ones(2)) and not as_bytes(q).any()
    with pytest.raises(ValueError, match="equal chunks"):
        quantize_folded_chunks(x, "e5m2", chunks=3, amax=torch.zeros(()))
    with pytest.raises(ValueError, match="x_scales"):
        quantize_folded_chunks(x, "e5m2", chunks=2, amax=torch.zeros(()), x_scales=torch.ones(3))


@pytest.mark.parametrize("chunks,r_c,n_cols", [(2, 32, 96), (3, 33, 40), (1, 70, 129), (4, 1, 16), (2, 65, 3)], ids=str)
@pytest.mark.parametrize("gap", [0, 16], ids=["stacked", "messages"])
@pytest.mark.parametrize("chunk_major", [False, True], ids=["stacked-transpose", "chunk-major"])
def test_transpose_chunk_codes_matches_a_byte_transpose(device, chunks, r_c, n_cols, gap, chunk_major):
    """Chunks side by side or with a 16-byte scale row between them (gathered messages), to the
    transpose of the stacked chunks or each chunk's transpose: every byte where it belongs."""
    from coat_kernels.per_tensor import transpose_chunk_codes

    g = torch.Generator().manual_seed(chunks * 1000 + r_c)
    message = r_c * n_cols + gap
    buffer = torch.randint(0, 256, (chunks * message,), generator=g, dtype=torch.uint8)

    def as_chunks(buffer):
        return buffer.view(chunks, message)[:, : r_c * n_cols].view(torch.float8_e5m2).view(chunks, r_c, n_cols)

    codes = as_chunks(buffer)
    stacked = torch.cat([as_bytes(c) for c in codes.unbind()])  # (n R_c, N)
    want = torch.stack([c.t() for c in stacked.split(r_c)]) if chunk_major else stacked.t()
    got = transpose_chunk_codes(as_chunks(buffer.to(device)), chunk_major=chunk_major, backend="triton")
    assert got.dtype == torch.float8_e5m2 and got.is_contiguous() and torch.equal(as_bytes(got), want)
    assert torch.equal(as_bytes(transpose_chunk_codes(codes, chunk_major=chunk_major, backend="reference")), want)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks,n_rows,n_cols", [(2, 8192, 2048), (4, 4096, 7168), (2, 4098, 1024)], ids=str)
def test_folded_chunks_and_chunk_transposes_of_layer_shapes_on_gpu(chunks, n_rows, n_cols, seed):
    """The one-pass dY quantization and the chunk transposes at a layer's shapes on the GPU, against the
    chunk-by-chunk torch path on the CPU (codes as bytes)."""
    from coat_kernels.per_tensor import quantize_folded_chunks, transpose_chunk_codes

    x = random_activations((n_rows, n_cols), seed=seed)
    x_scales = torch.tensor([0.02, 3e-5, 1.5, 7e-3][:chunks])
    amax = x.float().abs().max()
    cuda = torch.device("cuda")
    q, scales, q_t = quantize_folded_chunks(
        x.to(cuda), "e5m2", chunks=chunks, amax=amax.to(cuda), x_scales=x_scales.to(cuda), transpose=True
    )
    want_q, want_scales, want_q_t = _chunk_by_chunk(x, "e5m2", chunks, amax, x_scales, True)
    assert torch.equal(as_bytes(q), want_q) and torch.equal(scales.cpu(), want_scales)
    assert torch.equal(as_bytes(q_t), want_q_t)
    r_c = n_rows // chunks
    major = transpose_chunk_codes(q.view(chunks, r_c, n_cols), chunk_major=True)
    assert torch.equal(as_bytes(major), torch.stack([c.t() for c in want_q.split(r_c)]))


@pytest.mark.parametrize("shape,chunks", [((64, 96), 2), ((3, 11, 40), 3), ((4, 16), 4), ((2, 130, 257), 2)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_transposed_chunk_by_chunk_is_each_chunks_transpose(device, shape, chunks, dtype, seed):
    """``quantize_per_tensor_transposed(chunks=n)``, every chunk's transposed codes in one pass (from
    registers for BF16, a byte pass for FP32), against the whole tensor's transpose cut into chunks,
    bytes and scale, with the forward's amax given (a zero row and an outlier)."""
    x = random_activations(shape, dtype, seed=seed)
    x.view(-1, shape[-1])[0] = 0.0
    x.view(-1)[-1] = 700.0
    amax = x.float().abs().max()
    q_t, scale = quantize_per_tensor_transposed(
        x.to(device), "e4m3", amax=amax.to(device), chunks=chunks, check_finite=False, backend="triton"
    )
    want_q_t, want_scale = quantize_per_tensor_transposed(x, "e4m3", amax=amax, backend="reference")
    n_cols, n_rows = want_q_t.shape
    want = as_bytes(want_q_t).view(n_cols, chunks, n_rows // chunks).transpose(0, 1)
    assert q_t.shape == (chunks, n_cols, n_rows // chunks) and q_t.is_contiguous()
    assert torch.equal(as_bytes(q_t), want) and torch.equal(scale.cpu(), want_scale)
    ref = quantize_per_tensor_transposed(x, "e4m3", amax=amax, chunks=chunks, backend="reference")[0]
    assert torch.equal(as_bytes(ref), want)


@pytest.mark.parametrize("shape,chunks", [((64, 96), 2), ((3, 11, 40), 3), ((4, 16), 4), ((2, 130, 257), 2)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_quantize_with_chunked_transposes_writes_the_codes_and_each_chunks_transpose(
    device, shape, chunks, dtype, backend, seed
):
    """``quantize_per_tensor(transpose=True, chunks=n)`` (a row-parallel linear's BF16 input: its codes
    for the forward GEMM and every chunk's transposed codes for the wgrad, one pass): the codes and scale
    of the whole tensor's quantization, bit for bit, and the transpose cut into chunks, chunk-major."""
    if backend == "reference" and device.type == "cuda":
        pytest.skip("the reference runs on the CPU")
    x = random_activations(shape, dtype, seed=seed)
    x.view(-1, shape[-1])[0] = 0.0
    x.view(-1)[-1] = 700.0
    amax = x.float().abs().max()
    q, scale, q_t = quantize_per_tensor(
        x.to(device), "e4m3", transpose=True, amax=amax.to(device), chunks=chunks, check_finite=False, backend=backend
    )
    want_q, want_scale, want_q_t = quantize_per_tensor_reference(x, "e4m3", transpose=True, amax=amax)
    n_cols, n_rows = want_q_t.shape
    assert (
        q.shape == x.shape and torch.equal(as_bytes(q.cpu()), as_bytes(want_q)) and torch.equal(scale.cpu(), want_scale)
    )
    want = as_bytes(want_q_t).view(n_cols, chunks, n_rows // chunks).transpose(0, 1)
    assert q_t.shape == (chunks, n_cols, n_rows // chunks) and q_t.is_contiguous()
    assert torch.equal(as_bytes(q_t.cpu()), want)


def test_chunked_transposes_need_a_transpose_and_equal_chunks():
    x = torch.randn(6, 16)
    for kw in (dict(transpose=False), dict(transpose=True, packed=True), dict(transpose=True, chunks=4)):
        with pytest.raises(ValueError, match="needs transpose=True, packed=False and rows that split"):
            quantize_per_tensor(x, "e4m3", **({"chunks": 2} | kw))
