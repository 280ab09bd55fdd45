"""fp8_gemm_accumulate: out += (a * a_scale) @ (b * b_scale), in the GEMM (cuBLASLt, beta = 1) on a
GPU, by an FP32 temporary and an add on a CPU; both round the sum once into out's dtype."""

import pytest
import torch

from coat_kernels import gemm_accumulate as ga
from coat_kernels import quantize_per_tensor
from coat_kernels.gemm import fp8_gemm_reference


def operands(m, k, n, a_fmt="e5m2", b_fmt="e4m3", seed=0, device="cpu"):
    """A wgrad's operands: a = dY^T (E5M2, (M, K)), b = X^T's column-major view (E4M3, (K, N))."""
    g = torch.Generator().manual_seed(seed)
    a_q, a_s = quantize_per_tensor(torch.randn(m, k, generator=g), a_fmt)
    b_q, b_s = quantize_per_tensor(torch.randn(n, k, generator=g) * 3, b_fmt)
    return a_q.to(device), a_s.to(device), b_q.to(device).t(), b_s.to(device)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_cpu_adds_the_fp32_product_in_one_rounding(out_dtype, seed):
    a, sa, b, sb = operands(32, 48, 16, seed=seed)
    start = torch.randn(32, 16, generator=torch.Generator().manual_seed(seed)).to(out_dtype)
    out = start.clone()
    assert ga.backend_for(out) == "add"
    got = ga.fp8_gemm_accumulate(a, sa, b, sb, out)
    assert got is out
    want = (start.float() + fp8_gemm_reference(a, sa, b, sb, out_dtype=torch.float32)).to(out_dtype)
    assert torch.equal(out, want)


def test_bad_operands_and_outputs_are_refused():
    a, sa, b, sb = operands(32, 48, 16)
    with pytest.raises(TypeError, match="FP8 operands"):
        ga.fp8_gemm_accumulate(a.float(), sa, b, sb, torch.zeros(32, 16))
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        ga.fp8_gemm_accumulate(a, sa, b.to(torch.float8_e5m2), sb, torch.zeros(32, 16))
    with pytest.raises(ValueError, match="shapes do not match"):
        ga.fp8_gemm_accumulate(a, sa, b[:16], sb, torch.zeros(32, 16))
    with pytest.raises(ValueError, match="BF16 or FP32 tensor of shape"):
        ga.fp8_gemm_accumulate(a, sa, b, sb, torch.zeros(32, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="must be contiguous"):
        ga.fp8_gemm_accumulate(a, sa, b, sb, torch.zeros(16, 32).t())
    with pytest.raises(ValueError, match="use 'auto', 'cublaslt' or 'add'"):  # refused before any work, on any device
        ga.fp8_gemm_accumulate(a, sa, b, sb, torch.zeros(32, 16), backend="cublas")


def test_the_library_is_the_one_torch_ships():
    """Found without a GPU (the CPU's torch wheel ships it too); a CPU tensor still takes the add."""
    path = ga._library_path()
    if path is None:
        pytest.skip("this torch ships no cuBLASLt")
    assert "libcublasLt.so" in path and ga._cublaslt() is not None
    assert ga.backend_for(torch.zeros(1)) == "add"


def test_the_binding_builds_descriptors_without_a_gpu():
    """cuBLASLt makes its descriptors on the host: the argument types of those calls are checked here,
    where a wrong one (an untyped size_t) would otherwise first show on a GPU."""
    import ctypes

    lt = ga._cublaslt()
    if lt is None:
        pytest.skip("this torch ships no cuBLASLt")
    desc = ctypes.c_void_p()
    lt._check(lt.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), ga._CUBLAS_COMPUTE_32F, ga._CUDA_R_32F), "create")
    lt._set(desc, ga._DESC_TRANSA, ctypes.c_int32(ga._OP_T))
    lt._set(desc, ga._DESC_FAST_ACCUM, ctypes.c_int8(1))
    scale = torch.ones(())
    lt._set(desc, ga._DESC_A_SCALE_POINTER, ctypes.c_void_p(scale.data_ptr()))
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32):
        assert lt._layout(dtype, 8192, 2048, 8192).value
    pref = ctypes.c_void_p()
    lt._check(lt.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    size = ctypes.c_uint64(ga._WORKSPACE_BYTES)
    status = lt.lib.cublasLtMatmulPreferenceSetAttribute(
        pref, ga._PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.sizeof(size)
    )
    assert status == 0
    with pytest.raises(ga.CublasLtError, match="cublasLtMatmulDescSetAttribute returned cuBLAS status"):
        lt._set(desc, 10_000, ctypes.c_int32(0))  # no such attribute


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(2048, 8192, 2048), (11264, 8192, 2048), (4096, 2047, 4096)], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmts", [("e5m2", "e4m3"), ("e4m3", "e4m3")])
def test_cublaslt_accumulates_as_the_temporary_and_add_do(m, k, n, out_dtype, fmts, seed):
    a, sa, b, sb = operands(m, k, n, *fmts, seed=seed, device="cuda")
    b = b.t().contiguous().t()
    start = torch.randn(m, n, device="cuda").to(out_dtype)
    got, want = start.clone(), start.clone()
    assert ga.backend_for(got) == "cublaslt"
    for _ in range(3):  # a step's micro-batches; the plan is cached after the first
        ga.fp8_gemm_accumulate(a, sa, b, sb, got, backend="cublaslt")
        ga.fp8_gemm_accumulate(a, sa, b, sb, want, backend="add")
    # the same FP32 products, summed in other orders, then one rounding each time: within a few ulps
    ulp = 2.0**-7 if out_dtype == torch.bfloat16 else 2.0**-20
    bound = 4 * ulp * want.float().abs() + k * 2**-22 * ((a.float().abs() * sa) @ (b.float().abs() * sb))
    assert ((got.float() - want.float()).abs() <= bound + 1e-6).all()


@pytest.mark.gpu
def test_new_scales_reach_a_cached_plan_and_a_cuda_graph_replays_it():
    a, sa, b, sb = operands(2048, 4096, 1024, device="cuda")
    b = b.t().contiguous().t()
    out = torch.zeros(2048, 1024, device="cuda", dtype=torch.float32)
    ga.fp8_gemm_accumulate(a, sa, b, sb, out, backend="cublaslt")
    once = out.clone()
    out.zero_()
    ga.fp8_gemm_accumulate(a, sa * 2, b, sb, out, backend="cublaslt")  # the same plan, another scale tensor
    assert torch.allclose(out, 2 * once, rtol=1e-6, atol=1e-6)
    out.zero_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        ga.fp8_gemm_accumulate(a, sa, b, sb, out, backend="cublaslt")
    torch.cuda.current_stream().wait_stream(stream)
    out.zero_()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, 3 * once, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_auto_takes_the_add_where_cublaslt_cannot_write_the_output():
    """cuBLASLt's FP8 GEMM wants the output's height (its leading dimension here) a multiple of 16:
    "auto" adds through the temporary there, and the result is the same sum."""
    a, sa, b, sb = operands(40, 64, 32, seed=1, device="cuda")
    ragged = torch.zeros(40, 32, device="cuda")
    assert ga.backend_for(ragged) == "add" and ga.backend_for(torch.zeros(48, 32, device="cuda")) == "cublaslt"
    ga.fp8_gemm_accumulate(a, sa, b, sb, ragged)
    assert torch.equal(ragged, ga.accumulate_by_add(a, sa, b, sb, torch.zeros_like(ragged)))
    # Hopper's FP8 tensor cores keep about 13 mantissa bits between the GEMM's promotions to FP32
    # (measured on an H100: 1.2e-4 of the largest output at K = 64), so the bound is 2^-11 of sum |a||b|
    want = fp8_gemm_reference(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), out_dtype=torch.float32)
    magnitude = (a.cpu().float().abs() * sa.cpu()) @ (b.cpu().float().abs() * sb.cpu())
    assert ((ragged.cpu() - want).abs() <= 2**-11 * magnitude + 1e-6).all()
