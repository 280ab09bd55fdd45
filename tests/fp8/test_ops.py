"""Each FP8 op, forward and backward, against an FP32 autograd reference on exact inputs.

Bounds are worst cases built from the FP8 rounding bound in conftest (|d| <= eps |x| + sigma):
a product of two perturbed operands moves by at most da @ |b| + |a| @ db + da @ db; a BF16 output
adds half its step, 2^-8 of the value; FP32 statistics (rstd, mean) add ~1e-5 relative.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from fp8_bounds import BF16, activations, product_error, quant_error, quant_error_groups

from coat_megatron.config import CoatConfig
from coat_megatron.fp8 import (
    Fp8Tensor,
    Fp8WeightCache,
    OutputForm,
    fp8_linear,
    layernorm_to_fp8,
    rmsnorm_to_fp8,
    swiglu_fp8,
)

SLACK = 1e-5  # FP32 arithmetic in another order than the reference


def leaf(t, dtype=None, device="cpu"):
    return t.detach().clone().to(device=device, dtype=dtype or t.dtype).requires_grad_()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Where the COAT ops run (the FP32 reference always runs on the CPU)."""
    return request.param


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("shape", [(13, 5120), (2, 7, 320)], ids=str)
def test_norm(device, kind, shape, seed):
    h = shape[-1]
    x = activations(shape, seed)
    x.view(-1, h)[0] = 0.0  # an all-zero row
    x.view(-1, h)[1] = 3.0  # a constant row
    g = torch.Generator().manual_seed(seed)
    w = 1.0 + 0.2 * torch.randn(h, generator=g)
    b = 0.1 * torch.randn(h, generator=g) if kind == "layernorm" else None

    xr, wr, br = leaf(x, torch.float32), leaf(w), leaf(b) if b is not None else None
    yr = F.rms_norm(xr, (h,), wr, 1e-5) if kind == "rmsnorm" else F.layer_norm(xr, (h,), wr, br, 1e-5)
    xc, wc, bc = leaf(x, device=device), leaf(w, device=device), leaf(b, device=device) if b is not None else None
    y = rmsnorm_to_fp8(xc, wc, 1e-5) if kind == "rmsnorm" else layernorm_to_fp8(xc, wc, bc, 1e-5)

    assert isinstance(y, Fp8Tensor) and y.granularity == "tensor" and y.shape == x.shape and y.dtype == torch.bfloat16
    assert y.transposed is not None and y.transposed.shape == (h, x.numel() // h)
    err = (y.dequantize(torch.float32).cpu() - yr).abs()
    assert (err <= quant_error(yr.detach(), "e4m3") + SLACK * yr.abs()).all(), err.max()

    dy = activations(shape, seed + 1)
    yr.backward(dy.float())
    y.backward(dy.to(device))
    # backward reads x from its 1x16 E4M3 copy: |x~ - x| <= delta; mean and rstd are exact
    x2 = x.float().view(-1, h)
    delta = quant_error_groups(x2, "e4m3", 16)
    mean = x2.mean(-1, keepdim=True) if kind == "layernorm" else torch.zeros_like(x2[:, :1])
    rstd = 1.0 / torch.sqrt(((x2 - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
    xhat = (x2 - mean) * rstd
    gw = dy.float().view(-1, h) * w
    c1 = (gw * xhat).mean(-1, keepdim=True)
    dc1 = rstd * (gw.abs() * delta).mean(-1, keepdim=True)
    dx_bound = rstd * (rstd * delta * (c1.abs() + dc1) + xhat.abs() * dc1)
    dx_ref = xr.grad.view(-1, h)
    err = (xc.grad.float().cpu().view(-1, h) - dx_ref).abs()
    assert (err <= dx_bound + BF16 * dx_ref.abs() + SLACK * rstd * gw.abs().amax()).all(), (err - dx_bound).max()
    dw_bound = (dy.float().view(-1, h).abs() * rstd * delta).sum(0)
    assert ((wc.grad.cpu() - wr.grad).abs() <= dw_bound + SLACK * wr.grad.abs().amax()).all()
    if b is not None:
        assert torch.allclose(bc.grad.cpu(), br.grad, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n_in,n_out", [(5120, 256), (320, 1376)])
@pytest.mark.parametrize("save_original_input", [False, True])
def test_linear(device, n_in, n_out, save_original_input, seed):
    x = activations((24, n_in), seed)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(torch.bfloat16)
    b = (0.1 * torch.randn(n_out, generator=g)).to(torch.bfloat16)
    xr, wr, br = leaf(x, torch.float32), leaf(w, torch.float32), leaf(b, torch.float32)
    yr = xr @ wr.t() + br
    xc, wc, bc = leaf(x, device=device), leaf(w, device=device), leaf(b, device=device)
    y = fp8_linear(xc, wc, bc, save_original_input=save_original_input)
    assert y.dtype == torch.bfloat16 and y.shape == (24, n_out) and not isinstance(y, Fp8Tensor)
    y = y.cpu()

    xf, wf = x.float(), w.float()
    bound = product_error(xf, quant_error(xf, "e4m3"), wf.t(), quant_error(wf, "e4m3").t())
    err = (y.float() - yr).abs()
    assert (err <= bound + BF16 * yr.abs() + SLACK).all(), (err - bound).max()

    dy = activations((24, n_out), seed + 1)
    yr.backward(dy.float())
    y.backward(dy)
    dyf = dy.float()
    gx, gw, gb = xc.grad.float().cpu(), wc.grad.float().cpu(), bc.grad.float().cpu()
    dx_bound = product_error(dyf, quant_error(dyf, "e5m2"), wf, quant_error(wf, "e4m3"))
    assert ((gx - xr.grad).abs() <= dx_bound + BF16 * xr.grad.abs() + SLACK).all()
    dw_bound = product_error(dyf.t(), quant_error(dyf, "e5m2").t(), xf, quant_error(xf, "e4m3"))
    assert ((gw - wr.grad).abs() <= dw_bound + BF16 * wr.grad.abs() + SLACK).all()
    assert torch.allclose(gb, br.grad, rtol=2**-7, atol=1e-3)


def test_linear_saving_the_original_input_gives_identical_gradients(seed):
    x, w = activations((16, 320), seed), activations((64, 320), seed + 1)
    dy = activations((16, 64), seed + 2)
    grads = []
    for save_original_input in (False, True):
        xc, wc = leaf(x), leaf(w)
        fp8_linear(xc, wc, save_original_input=save_original_input).backward(dy)
        grads.append((xc.grad, wc.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("shape", [(16, 320, 64), (3, 5, 48, 80)], ids=str)
def test_linear_keeping_fewer_weight_codes_gives_identical_results(device, shape, seed):
    """W and W^T kept (2 bytes per parameter), W kept and transposed in backward (1), no codes kept
    (W and W^T quantized from the weight with its kept amax): the same outputs and gradients."""
    *lead, n_in, n_out = shape
    x, w = activations((*lead, n_in), seed), activations((n_out, n_in), seed + 1)
    dy = activations((*lead, n_out), seed + 2)
    results = []
    for codes, transpose in ((True, True), (True, False), (False, False)):
        config = CoatConfig(cache_weight=codes, cache_weight_transpose=transpose)
        cache = Fp8WeightCache("e4m3", keep_transpose=transpose, keep_codes=codes)
        xc, wc = leaf(x, device=device), leaf(w, device=device)
        for _ in range(2):  # the second micro-batch reuses what the cache kept
            xc.grad = wc.grad = None
            y = fp8_linear(xc, wc, config=config, weight_cache=cache)
            y.backward(dy.to(device))
        results.append((y.detach(), xc.grad, wc.grad, cache.nbytes))
    for other in results[1:]:
        for a, b in zip(results[0][:3], other[:3]):
            assert torch.equal(a, b)
    # + the FP32 scale and work amax and the int64 generation; without codes, the kept amax too (the scale is
    # where each forward's quantizing pass writes it, for the backward: Fp8WeightCache.amax_and_scale)
    assert [r[3] for r in results] == [2 * n_in * n_out + 16, n_in * n_out + 16, 20]
    # the transposed codes are the bytes of quantizing W^T with W's scale
    q, q_t, scale = Fp8WeightCache("e4m3").get(w.to(device))
    assert torch.equal(q.view(torch.uint8).t(), q_t.view(torch.uint8))
    assert Fp8WeightCache("e4m3", keep_transpose=False).get(w.to(device))[1] is None
    amax = Fp8WeightCache("e4m3", keep_transpose=False, keep_codes=False).amax(w.to(device))
    assert amax.item() == w.abs().max().item()


def test_weight_cache_refuses_contradictions():
    with pytest.raises(ValueError, match="use keep_codes=False with keep_transpose=False"):
        Fp8WeightCache("e4m3", keep_transpose=True, keep_codes=False)
    with pytest.raises(ValueError, match="--coat-cache-weight-transpose off --coat-cache-weight off"):
        CoatConfig(cache_weight=False, cache_weight_transpose=True)
    with pytest.raises(ValueError, match="cache_weight=None, cache_weight_transpose=True"):
        dataclasses.replace(CoatConfig(), cache_weight_transpose=True)  # the default resolved cache_weight to False
    assert dataclasses.replace(CoatConfig(), cache_weight=None, cache_weight_transpose=True).cache_weight
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="quantize with its amax"):
        Fp8WeightCache("e4m3", keep_transpose=False, keep_codes=False).get(w)
    with pytest.raises(RuntimeError, match="take them from get"):
        Fp8WeightCache("e4m3").amax(w)


def test_wgrad_goes_into_main_grad_written_first_then_added(device, seed):
    """Megatron's gradient-accumulation fusion: the first micro-batch after DDP zeroed main_grad
    (grad_added_to_main_grad False) writes it, later ones add; a weight without DDP's flag adds."""
    x1, x2 = activations((64, 96), seed), activations((64, 96), seed + 1)
    w = activations((48, 96), seed + 2)
    dy1, dy2 = activations((64, 48), seed + 3), activations((64, 48), seed + 4)
    plain = []
    for x, dy in ((x1, dy1), (x2, dy2)):
        wc = leaf(w, torch.float32, device=device)  # an FP32 weight: its wgrad comes out in FP32, as main_grad's
        fp8_linear(leaf(x, device=device), wc).backward(dy.to(device))
        plain.append(wc.grad)
    wf = leaf(w, device=device)
    wf.main_grad = torch.full(w.shape, float("nan"), device=device)  # DDP zeroed it: nothing may read it
    wf.grad_added_to_main_grad = False
    for x, dy in ((x1, dy1), (x2, dy2)):
        fp8_linear(leaf(x, device=device), wf, accumulate_into_main_grad=True).backward(dy.to(device))
        if len(plain) == 2:
            assert wf.grad_added_to_main_grad and torch.equal(wf.main_grad, plain[0])
            plain.append(None)
    assert torch.equal(wf.main_grad, plain[0] + plain[1])
    flagless = leaf(w, device=device)
    flagless.main_grad = torch.ones(w.shape, device=device)
    fp8_linear(leaf(x1, device=device), flagless, accumulate_into_main_grad=True).backward(dy1.to(device))
    assert torch.equal(flagless.main_grad, plain[0] + 1)
    # DDP reducing in BF16 (grad_reduce_in_fp32=False, split master weights): the GEMM writes BF16
    bf = leaf(w, device=device)
    bf.main_grad = torch.full(w.shape, float("nan"), dtype=torch.bfloat16, device=device)
    bf.grad_added_to_main_grad = False
    fp8_linear(leaf(x1, device=device), bf, accumulate_into_main_grad=True).backward(dy1.to(device))
    assert bf.main_grad.dtype == torch.bfloat16 and torch.equal(bf.main_grad, plain[0].to(torch.bfloat16))
    fp8_linear(leaf(x2, device=device), bf, accumulate_into_main_grad=True).backward(dy2.to(device))
    want = (plain[0].to(torch.bfloat16).float() + plain[1]).to(torch.bfloat16)
    if device == "cpu":
        assert torch.equal(bf.main_grad, want)
    else:  # cuBLASLt adds inside the GEMM (beta = 1), in another kernel than the separate product's.
        # Measured on an H100 and an H200 (pytest only; a lone script matched bit for bit): up to 3 BF16
        # ulps of a small sum, as if the product were rounded to BF16 before the add (an in-place
        # split-K reduction in the output type). Bound: one rounding of the sum, one of the product,
        # and Hopper's FP8 accumulation error (about 2^-13 of sum |dy||x|)
        magnitude = (dy2.abs().t() @ x2.abs()).to(device)
        err = (bf.main_grad.float() - want.float()).abs()
        assert (err <= 2**-7 * want.float().abs() + 2**-8 * plain[1].abs() + 2**-11 * magnitude).all()


def test_the_placeholder_weight_gradients_share_one_buffer(device, seed):
    """With DDP's flag, autograd gets a placeholder for the weight gradient that went into main_grad:
    a view of one buffer per device and dtype (no allocation per linear and micro-batch), which
    autograd keeps as the weight's .grad without copying it; zero_out_wgrad still gets zeros."""
    x, dy = activations((32, 64), seed), activations((32, 48), seed + 1)
    grads = []
    for shape in ((48, 64), (16, 64), (48, 64)):
        w = leaf(activations(shape, seed + 2), device=device)
        w.main_grad = torch.zeros(shape, device=device)
        w.grad_added_to_main_grad = False
        fp8_linear(leaf(x, device=device), w, accumulate_into_main_grad=True).backward(dy[:, : shape[0]].to(device))
        assert w.grad.shape == shape and w.grad.dtype == w.dtype and w.main_grad.abs().sum() > 0
        grads.append(w.grad)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1  # one buffer; autograd copied none
    w.zero_out_wgrad = True
    w.grad = None
    fp8_linear(leaf(x, device=device), w, accumulate_into_main_grad=True).backward(dy[:, :48].to(device))
    assert not w.grad.any() and w.grad.untyped_storage().data_ptr() != grads[0].untyped_storage().data_ptr()


@pytest.mark.gpu
def test_wgrad_accumulated_in_the_gemm_matches_the_temporary_and_add(seed):
    """wgrad_accumulate="cublaslt": later micro-batches add their wgrad into a BF16 main_grad inside
    the GEMM (beta = 1); the sum equals the FP32 temporary's and add's within BF16 rounding."""
    dev = torch.device("cuda")
    xs = [activations((512, 1024), seed + i) for i in range(3)]
    dys = [activations((512, 2048), seed + 10 + i) for i in range(3)]
    w = activations((2048, 1024), seed + 20)
    sums = {}
    for way in ("add", "cublaslt"):
        config = CoatConfig(wgrad_accumulate=way)
        weight = leaf(w, device=dev)
        weight.main_grad = torch.zeros(w.shape, dtype=torch.bfloat16, device=dev)
        weight.grad_added_to_main_grad = False
        for x, dy in zip(xs, dys):
            fp8_linear(leaf(x, device=dev), weight, config=config, accumulate_into_main_grad=True).backward(dy.to(dev))
        sums[way] = weight.main_grad.float()
    assert (sums["cublaslt"] - sums["add"]).abs().max() <= 2**-6 * sums["add"].abs().max()
    assert (sums["cublaslt"] != 0).any()


@pytest.mark.parametrize("way", ["auto", "cublaslt", "add"])
def test_the_configured_wgrad_accumulation_reaches_the_gemm(monkeypatch, way, seed):
    """CoatConfig.wgrad_accumulate is the backend of the accumulating GEMM of every micro-batch after
    the first (the first writes into main_grad); the sum is the plain wgrads' sum."""
    from coat_megatron.fp8 import linear as linear_mod

    backends = []
    real = linear_mod.fp8_gemm_accumulate

    def recording(*args, backend, **kwargs):
        backends.append(backend)
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(linear_mod, "fp8_gemm_accumulate", recording)
    xs = [activations((24, 64), seed + i) for i in range(3)]
    dys = [activations((24, 32), seed + 10 + i) for i in range(3)]
    w = activations((32, 64), seed + 20)
    weight = leaf(w)
    weight.main_grad = torch.zeros(w.shape)
    weight.grad_added_to_main_grad = False
    plain = torch.zeros(w.shape)
    config = CoatConfig(wgrad_accumulate=way)
    for x, dy in zip(xs, dys):
        fp8_linear(leaf(x), weight, config=config, accumulate_into_main_grad=True).backward(dy)
        alone = leaf(w, torch.float32)  # an FP32 weight: its wgrad comes out in FP32, as main_grad's
        fp8_linear(leaf(x), alone).backward(dy)
        plain += alone.grad
    assert backends == [way, way]
    assert torch.equal(weight.main_grad, plain)


def test_an_unknown_wgrad_accumulation_is_refused():
    with pytest.raises(
        ValueError, match=r"wgrad_accumulate='sometimes' is not supported: use one of auto, cublaslt, add"
    ):
        CoatConfig(wgrad_accumulate="sometimes")


def test_linear_per_group_output_is_1x16(seed):
    x, w = activations((24, 320), seed), activations((256, 320), seed + 1) / 18
    xr, wr = x.float(), w.float()
    yr = xr @ wr.t()
    y = fp8_linear(leaf(x), leaf(w), output_form=OutputForm.PER_GROUP)
    assert isinstance(y, Fp8Tensor) and y.granularity == "1x16" and y.scale.shape == (24, 16)
    gemm = product_error(xr, quant_error(xr, "e4m3"), wr.t(), quant_error(wr, "e4m3").t()) + BF16 * yr.abs()
    bound = gemm + quant_error_groups(yr.abs() + gemm, "e4m3", 16) + SLACK
    assert ((y.dequantize(torch.float32) - yr).abs() <= bound).all()


@pytest.mark.parametrize("n_ffn", [13824, 96])
def test_swiglu(device, n_ffn, seed):
    h = activations((6, 2 * n_ffn), seed)
    h[0, :n_ffn] = 0.0  # a zero gate half-row
    hr = leaf(h, torch.float32)
    gate, up = hr.chunk(2, dim=-1)
    ar = F.silu(gate) * up
    hc = leaf(h, device=device)
    a = swiglu_fp8(hc)
    assert isinstance(a, Fp8Tensor) and a.granularity == "tensor" and a.shape == (6, n_ffn)
    assert a.transposed is None and a.transposed_codes().shape == (n_ffn, 6)  # recomputed, not stored

    d = quant_error_groups(h.float(), "e4m3", 16)
    dg, du = d.chunk(2, dim=-1)
    g, u = h.float().chunk(2, dim=-1)
    # silu is 1.1-Lipschitz; |silu''| <= 0.5
    pre = 1.1 * dg * (u.abs() + du) + F.silu(g).abs() * du
    scale = (ar.detach().abs() + pre).amax() / 448
    bound = pre + 2**-4 * (ar.detach().abs() + pre) + 2**-10 * scale
    assert ((a.dequantize(torch.float32).cpu() - ar).abs() <= bound + SLACK).all()

    da = activations((6, n_ffn), seed + 1)
    ar.backward(da.float())
    a.backward(da.to(device))
    daf = da.float().abs()
    dh_bound = torch.cat([daf * (1.1 * du + 0.5 * (u.abs() + du) * dg), daf * 1.1 * dg], dim=-1)
    err = (hc.grad.float().cpu() - hr.grad).abs()
    assert (err <= dh_bound + BF16 * hr.grad.abs() + SLACK).all(), (err - dh_bound).max()


def test_whole_mlp_chain_at_llama_13b_width(device, seed):
    """norm -> fc1 -> SwiGLU -> fc2 at hidden 5120, FFN 13824, against FP32 autograd.

    Bounds: five E4M3 roundings in the forward path (norm output, W1, fc1 output, SwiGLU output,
    W2), each of RMS relative size ~2^-4/sqrt(3) = 0.036 when independent: sqrt(5) x 0.036 = 0.08,
    and 0.16 with a 2x margin. The gradients add two E5M2 roundings (dY of fc2, dh of fc1), RMS
    ~0.072 each: sqrt(5 x 0.036^2 + 2 x 0.072^2) = 0.13, and 0.26 with the margin.
    """
    hidden, ffn, tokens = 5120, 13824, 8
    g = torch.Generator().manual_seed(seed)
    x = activations((tokens, hidden), seed)
    wn = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    w1 = (torch.randn(2 * ffn, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(hidden, ffn, generator=g) / ffn**0.5).to(torch.bfloat16)
    dy = activations((tokens, hidden), seed + 1)

    ref = [leaf(t, torch.float32) for t in (x, wn, w1, w2)]
    gate, up = (F.rms_norm(ref[0], (hidden,), ref[1], 1e-5) @ ref[2].t()).chunk(2, dim=-1)
    yr = (F.silu(gate) * up) @ ref[3].t()
    yr.backward(dy.float())

    ours = [leaf(t, device=device) for t in (x, wn, w1, w2)]
    y = fp8_linear(
        swiglu_fp8(fp8_linear(rmsnorm_to_fp8(ours[0], ours[1], 1e-5), ours[2], output_form=OutputForm.SWIGLU_INPUT)),
        ours[3],
    )
    y.backward(dy.to(device))

    def rel(a, b):
        return ((a.float().cpu() - b.float()).norm() / b.float().norm()).item()

    assert rel(y, yr) <= 0.16
    for mine, theirs in zip(ours, ref):
        assert rel(mine.grad, theirs.grad) <= 0.26, rel(mine.grad, theirs.grad)


def test_norm_output_recompute_for_wgrad_stays_within_one_more_rounding(device, seed):
    """With transpose="recompute" the next linear's wgrad reads the norm output recomputed from
    the norm's 1x16 E4M3 input copy: one more E4M3 rounding (2^-4) than with the stored copy."""
    x = activations((48, 320), seed)
    w = (torch.randn(64, 320, generator=torch.Generator().manual_seed(seed)) / 18).to(torch.bfloat16)
    dy = activations((48, 64), seed + 1)
    grads = {}
    for mode in ("store", "recompute"):
        wc = leaf(w, device=device)
        fp8_linear(rmsnorm_to_fp8(leaf(x, device=device), torch.ones(320, device=device), transpose=mode), wc).backward(
            dy.to(device)
        )
        grads[mode] = wc.grad.float().cpu()
    xf = x.float()
    rstd = 1.0 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    xn = xf * rstd
    # the two wgrad operands differ by the norm of the 1x16 rounding of x, plus one per-tensor
    # E4M3 rounding on each side; both GEMMs read the same E5M2 dY (|dY_q| <= (1 + 2^-3) |dy|)
    operand = rstd * quant_error_groups(xf, "e4m3", 16) + 2 * quant_error(xn, "e4m3")
    bound = (1 + 2**-3) * dy.float().abs().t() @ operand
    assert ((grads["recompute"] - grads["store"]).abs() <= bound + 2 * BF16 * grads["store"].abs() + SLACK).all()
