import pytest
import torch
from kernel_inputs import as_bytes, random_activations

from coat_kernels.norm import norm_backward, norm_backward_reference, norm_quantize, norm_to_fp8, norm_to_fp8_reference

SHAPES = [(7, 96), (3, 5, 160), (9, 5120), (2, 640)]


def weights(n, kind, seed):
    g = torch.Generator().manual_seed(seed)
    w = 1.0 + 0.3 * torch.randn(n, generator=g)
    b = 0.1 * torch.randn(n, generator=g) if kind == "layernorm" else None
    return w, b


def run_forward(device, x, w, b, kind, group_size=16, out_fmt="e4m3"):
    r = norm_to_fp8(
        x.to(device),
        w.to(device),
        None if b is None else b.to(device),
        eps=1e-5,
        kind=kind,
        group_size=group_size,
        out_fmt=out_fmt,
        backend="triton",
    )
    return type(r)(*(t.cpu() if t is not None else None for t in r))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_forward_matches_reference(device, shape, kind, seed):
    x = random_activations(shape, seed=seed)
    w, b = weights(shape[-1], kind, seed)
    r = run_forward(device, x, w, b, kind)
    free = norm_to_fp8_reference(x, w, b, eps=1e-5, kind=kind)
    # the statistics are reductions in another order: equal to FP32 rounding
    assert torch.allclose(r.rstd, free.rstd, rtol=1e-5, atol=0)
    if kind == "layernorm":
        assert torch.allclose(r.mean, free.mean, rtol=1e-5, atol=1e-6)
    # given the kernel's statistics, every code and scale is the reference's, bit for bit
    ref = norm_to_fp8_reference(x, w, b, eps=1e-5, kind=kind, stats=(r.mean, r.rstd))
    assert torch.equal(r.scale, ref.scale)
    for got, want in ((r.q, ref.q), (r.q_t, ref.q_t), (r.x_q, ref.x_q)):
        assert got.shape == want.shape and torch.equal(as_bytes(got), as_bytes(want))
    assert torch.equal(r.x_scales, ref.x_scales)
    assert r.q_t.shape == (shape[-1], x.numel() // shape[-1])


@pytest.mark.parametrize("rows_per_program", [2, 8])
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_a_stats_pass_of_several_rows_per_program_is_the_one_row_pass(
    device, kind, rows_per_program, monkeypatch, seed
):
    """_STATS_BLOCKS tiles the stats pass by several rows (a ragged last tile here: 37 rows). Its row
    sums reduce in another order than one row per program (on a GPU the 2-D tile's reduction tree
    differs: measured on an H200, 2026-11-26, rstd a few ulps apart), so: the statistics and scales
    within FP32 rounding, every code the same or its neighbour."""
    from coat_kernels import norm as norm_module

    x = random_activations((37, 160), seed=seed)
    w, b = weights(160, kind, seed)
    one = run_forward(device, x, w, b, kind)
    monkeypatch.setitem(norm_module._STATS_BLOCKS, 256, (rows_per_program, 4))
    tiled = run_forward(device, x, w, b, kind)
    for name, a, c in zip(one._fields, one, tiled):
        if a is None:
            assert c is None, name
        elif a.dtype.itemsize == 1:  # FP8 codes (x_q, q, q_t): same sign, at most one step apart
            assert (as_bytes(a).int() - as_bytes(c).int()).abs().max() <= 1, name
        else:
            assert torch.allclose(a, c, rtol=2**-20, atol=0), name


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_a_bf16_weight_is_read_as_its_fp32_value(device, kind, seed):
    # the COAT norm hands the kernels its BF16 parameter (no FP32 copy): same codes, same gradients
    x = random_activations((37, 160), seed=seed)
    w, b = weights(160, kind, seed)
    w16, b16 = w.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16)
    half = run_forward(device, x, w16, b16, kind)
    full = run_forward(device, x, w16.float(), None if b16 is None else b16.float(), kind)
    for a, c in zip(half, full):
        assert (a is None and c is None) or torch.equal(
            a.view(torch.uint8) if a.dtype.itemsize == 1 else a, c.view(torch.uint8) if c.dtype.itemsize == 1 else c
        )
    dy = random_activations((37, 160), seed=seed + 1)
    args = (half.x_q.to(device), half.x_scales.to(device))
    stats = (None if half.mean is None else half.mean.to(device), half.rstd.to(device))
    g16 = norm_backward(
        dy.to(device), *args, w16.to(device), *stats, group_size=16, has_bias=b is not None, backend="triton"
    )
    g32 = norm_backward(
        dy.to(device), *args, w16.float().to(device), *stats, group_size=16, has_bias=b is not None, backend="triton"
    )
    for a, c in zip(g16, g32):
        assert (a is None and c is None) or torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4099, 4096), (2, 1023, 5120)], ids=str)
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_large_shapes_on_gpu(shape, kind, seed):
    test_forward_matches_reference(torch.device("cuda"), shape, kind, seed)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_zero_and_constant_rows(device, kind):
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    x[1] = 0.0
    x[3] = 2.5
    w, b = weights(64, kind, 0)
    r = run_forward(device, x, w, b, kind)
    ref = norm_to_fp8_reference(x, w, b, eps=1e-5, kind=kind, stats=(r.mean, r.rstd))
    assert torch.equal(as_bytes(r.q), as_bytes(ref.q)) and torch.isfinite(r.rstd).all()
    assert (r.x_scales[1] == 1.0).all() and (as_bytes(r.x_q[1]) == 0).all()
    if kind == "layernorm":  # a constant row centres to zero: its output is the bias alone
        assert r.mean[3] == 2.5


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("shape", [(7, 96), (33, 640)], ids=str)
def test_backward_matches_reference(device, kind, shape, seed):
    x = random_activations(shape, seed=seed)
    w, b = weights(shape[-1], kind, seed)
    r = norm_to_fp8_reference(x, w, b, eps=1e-5, kind=kind)
    dy = random_activations(shape, seed=seed + 1, outliers=False)
    args = (r.x_q, r.x_scales, w, r.mean, r.rstd)
    got = norm_backward(
        dy.to(device),
        *(a.to(device) if a is not None else None for a in args),
        group_size=16,
        has_bias=b is not None,
        backend="triton",
    )
    want = norm_backward_reference(dy, *args, group_size=16, has_bias=b is not None, dx_dtype=torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and got[0].shape == x.shape
    # FP32 sums in another order, then dx rounded to BF16: within 2 BF16 ulps
    assert torch.allclose(got[0].cpu().float(), want[0].float(), rtol=2**-7, atol=1e-5)
    assert torch.allclose(got[1].cpu(), want[1], rtol=1e-4, atol=1e-4)
    if b is not None:
        assert torch.allclose(got[2].cpu(), want[2], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("shape", [(7, 96), (2, 17, 640)], ids=str)
@pytest.mark.parametrize("residual", ["random", "zero", "outlier"])
def test_backward_adds_the_residual_gradient_and_finds_its_amax(device, kind, shape, residual, seed):
    """The fused residual branch: dx is the unfused kernel's dx plus the residual's gradient as autograd
    adds them (BF16 bits equal), and its amax is that tensor's, bit for bit."""
    x = random_activations(shape, seed=seed)
    w, b = weights(shape[-1], kind, seed)
    r = norm_to_fp8_reference(x, w, b, eps=1e-5, kind=kind)
    dy = random_activations(shape, seed=seed + 1, outliers=False)
    res = {
        "random": random_activations(shape, seed=seed + 2),
        "zero": torch.zeros(shape, dtype=torch.bfloat16),
        "outlier": random_activations(shape, seed=seed + 2, outliers=False),
    }[residual]
    if residual == "outlier":  # one element far above the rest: the amax is its sum with dx there
        res.view(-1)[res.numel() // 3] = 3.0e4
    args = [a.to(device) if a is not None else None for a in (r.x_q, r.x_scales, w, r.mean, r.rstd)]
    kw = dict(group_size=16, has_bias=b is not None, backend="triton")
    plain = norm_backward(dy.to(device), *args, **kw)
    fused = norm_backward(dy.to(device), *args, residual_grad=res.to(device), dx_amax=True, **kw)
    want = (plain[0].cpu() + res).to(torch.bfloat16)  # autograd's add of the two branches
    assert len(fused) == 4 and torch.equal(fused[0].cpu(), want)
    assert torch.equal(fused[3].cpu(), want.float().abs().amax())
    assert torch.equal(fused[1].cpu(), plain[1].cpu())
    # the reference does the same, from its own dx
    ref = norm_backward_reference(dy, r.x_q, r.x_scales, w, r.mean, r.rstd, group_size=16, has_bias=b is not None,
                                  dx_dtype=torch.bfloat16, residual_grad=res)  # fmt: skip
    assert torch.allclose(fused[0].cpu().float(), ref[0].float(), rtol=2**-6, atol=1e-4)
    only_amax = norm_backward(dy.to(device), *args, dx_amax=True, **kw)
    assert torch.equal(only_amax[0].cpu(), plain[0].cpu())
    assert torch.equal(only_amax[3].cpu(), plain[0].cpu().float().abs().amax())


def test_backward_rejects_a_residual_gradient_of_another_shape():
    r = norm_to_fp8_reference(torch.randn(4, 32), torch.ones(32), None, eps=1e-5, kind="rmsnorm")
    with pytest.raises(ValueError, match="residual_grad must be contiguous and of dy's shape"):
        norm_backward(torch.randn(4, 32), r.x_q, r.x_scales, torch.ones(32), r.mean, r.rstd, group_size=16,
                      residual_grad=torch.randn(4, 16))  # fmt: skip


def test_bad_arguments_name_the_fix():
    x = torch.randn(4, 40)
    with pytest.raises(
        ValueError, match="hidden size 40 is not a multiple of the FP8 group size 16; use --coat-group-size"
    ):
        norm_to_fp8(x, torch.ones(40), eps=1e-5)
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        norm_to_fp8(torch.randn(4, 32), torch.ones(32), torch.zeros(32), eps=1e-5)
    with pytest.raises(ValueError, match="contiguous float32/bfloat16/float16 vector of 32"):
        norm_to_fp8(torch.randn(4, 32), torch.ones(32, dtype=torch.float64), eps=1e-5)
    with pytest.raises(ValueError, match="vector of 32 elements"):
        norm_to_fp8(torch.randn(4, 32), torch.ones(2, 16), eps=1e-5)
    with pytest.raises(ValueError, match="use 'rmsnorm' or 'layernorm'"):
        norm_to_fp8(torch.randn(4, 32), torch.ones(32), eps=1e-5, kind="batchnorm")


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_quantize_pass_alone_with_given_stats(device, kind, seed):
    x = random_activations((13, 320), seed=seed)
    w, b = weights(320, kind, seed)
    r = norm_to_fp8_reference(x, w, b, eps=1e-5, kind=kind)
    args = [t.to(device) if t is not None else None for t in (x, w, b, r.mean, r.rstd, r.amax)]
    q, scale, q_t = (t.cpu() for t in norm_quantize(*args, transpose=True, backend="triton"))
    assert (
        torch.equal(scale, r.scale)
        and torch.equal(as_bytes(q), as_bytes(r.q))
        and torch.equal(as_bytes(q_t), as_bytes(r.q_t))
    )


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 160), (0, 64)], ids=str)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_packed_output_is_the_same_codes_and_scale_in_one_message(device, kind, shape, backend, seed):
    """Under sequence parallelism the norm writes its per-tensor output packed (the all-gather's
    message, ``per_tensor.packed_message``): the same bytes as apart, zero and outlier rows included."""
    from coat_kernels.per_tensor import packed_message

    if backend == "reference" and 0 in shape:
        pytest.skip("the torch reference takes no empty input")
    x = random_activations(shape, seed=seed)
    if x.numel():
        x.view(-1, shape[-1])[0] = 0.0  # a zero row
        x.view(-1)[-1] = 1000.0  # an outlier
    w, b = weights(shape[-1], kind, seed)
    args = (x.to(device), w.to(device), None if b is None else b.to(device))
    kw = dict(eps=1e-5, kind=kind, transpose=False, backend=backend)
    apart, packed = norm_to_fp8(*args, **kw), norm_to_fp8(*args, **kw, packed=True)
    for name, a, p in zip(apart._fields, apart, packed):
        if a is None:
            assert p is None, name
        else:
            assert torch.equal(a.cpu().reshape(-1).view(torch.uint8), p.cpu().reshape(-1).view(torch.uint8)), name
    message = packed_message(packed.q, packed.scale)
    assert (message is None) == (x.numel() == 0)
    if message is not None:
        assert torch.equal(message[: x.numel()].cpu(), as_bytes(apart.q).reshape(-1))
        assert torch.equal(message[x.numel() : x.numel() + 4].view(torch.float32).cpu(), apart.scale.reshape(1).cpu())


def partials_input(shape, case, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[-1], generator=g))
    if case == "zero":
        p.zero_()
    elif case == "constant":
        p.fill_(0.25)  # every partial sum exact in FP32
    elif case == "outlier":
        p[shape[0] // 2, shape[1] // 3] = 3.0e5
    return p


# parts of one block, of several (a ragged last block past 64 parts), and columns of a ragged last program
@pytest.mark.parametrize("shape", [(1, 16), (7, 96), (130, 160), (3, 5120)], ids=str)
@pytest.mark.parametrize("case", ["random", "zero", "constant", "outlier"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_the_partials_sum_into_a_vector_as_the_reference(device, shape, case, out_dtype, accumulate, seed):
    """sum_partials: out (+)= the column sums of the backward's FP32 partials, rounded once to out's
    dtype. The kernel sums in another order than torch: FP32 rounding of sum |p|, then one rounding to
    out's dtype (BF16: the same value or its neighbour)."""
    from coat_kernels.norm import sum_partials, write_or_add

    p = partials_input(shape, case, seed)
    start = (torch.randn(shape[1], generator=torch.Generator().manual_seed(seed + 1)) * 4).to(out_dtype)
    got = sum_partials(p.to(device), start.clone().to(device), accumulate=accumulate, backend="triton").cpu()
    want = write_or_add(start.clone(), p.sum(dim=0), accumulate)
    assert got.dtype == out_dtype and got.shape == (shape[1],)
    bound = 2**-22 * (p.abs().sum(dim=0) + start.float().abs() * accumulate) + (
        2**-7 * want.float().abs() if out_dtype == torch.bfloat16 else 0
    )
    assert ((got.float() - want.float()).abs() <= bound).all()
    if case in ("zero", "constant") or shape[0] == 1:  # exact sums: the same bits
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_the_backward_writes_or_adds_its_weight_gradient_into_a_given_buffer(device, kind, accumulate, seed):
    """dw_out / db_out (a weight's BF16 main_grad): the backward's dW lands there, added to what it
    holds with accumulate, rounded once; the vector returned is that buffer."""
    shape = (37, 160)
    x = random_activations(shape, seed=seed)
    w, b = weights(shape[-1], kind, seed)
    r = norm_to_fp8_reference(x, w, b, eps=1e-5, kind=kind)
    dy = random_activations(shape, seed=seed + 1, outliers=False)
    args = [t.to(device) if t is not None else None for t in (r.x_q, r.x_scales, w, r.mean, r.rstd)]
    g = torch.Generator().manual_seed(seed + 2)
    held = [torch.randn(shape[-1], generator=g).to(torch.bfloat16) for _ in range(2)]
    outs = [h.clone().to(device) for h in held]
    got = norm_backward(
        dy.to(device),
        *args,
        group_size=16,
        has_bias=b is not None,
        dw_out=outs[0],
        db_out=outs[1] if b is not None else None,
        accumulate=accumulate,
        backend="triton",
    )
    want = norm_backward_reference(
        dy, r.x_q, r.x_scales, w, r.mean, r.rstd, group_size=16, has_bias=b is not None, dx_dtype=torch.bfloat16
    )
    assert got[1] is outs[0] and (b is None or got[2] is outs[1])
    for out, start, ref in zip(got[1:], held, want[1:]):
        if ref is None:
            continue
        expected = (start.float() + ref if accumulate else ref).to(torch.bfloat16).float()
        # FP32 sums in another order, then one rounding to BF16: the same value or a neighbour
        assert torch.allclose(out.cpu().float(), expected, rtol=2**-7, atol=1e-3)


def test_bad_partials_name_the_fix():
    from coat_kernels.norm import sum_partials

    with pytest.raises(ValueError, match="contiguous FP32 \\(P, H\\) matrix"):
        sum_partials(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8))
    with pytest.raises(ValueError, match="contiguous float vector of 8 elements"):
        sum_partials(torch.zeros(4, 8), torch.zeros(9))
