"""COAT's sequence-parallel linears and their chunk exchanges on gloo, at TP 2 and TP 4, against
a torch reference that quantizes each rank's chunk with its own scale and multiplies chunk by
chunk in FP32 (what ``coat_megatron.layers.sequence_parallel`` says it computes).

Every rank draws the same full tensors (one seed) and keeps its part, so each rank can build the
reference from every rank's part. With FP32 activations the only differences from the reference
are the order of FP32 sums (the CPU GEMMs are the reference's own dequantize-and-matmul); with
BF16 ones the outputs are rounded to BF16 as the reference's are, and a reduce-scatter over more
than two ranks rounds each partial sum it passes on. On two GPUs (``@pytest.mark.gpu``)
``sequence_parallel_gpu.py`` checks the NCCL ring, its CUDA-graph capture and the Triton/cuBLASLt path.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from megatron.core import parallel_state

from coat_kernels.per_tensor import dequantize_per_tensor_reference, quantize_per_tensor_reference
from coat_megatron.config import CoatConfig
from coat_megatron.fp8 import OutputForm, rmsnorm_to_fp8, swiglu_fp8
from coat_megatron.fp8.weights import weight_cache_for
from coat_megatron.layers import sequence_parallel as sequence_parallel_module
from coat_megatron.layers.chunk_exchange import all_gather_chunks, reduce_scatter_chunks
from coat_megatron.layers.sequence_parallel import column_parallel_fp8_linear, row_parallel_fp8_linear

# WIDTH: the linear's other dimension, split over TP (16 per rank at TP 4: SwiGLU's group size)
SEQ, BATCH, HIDDEN, WIDTH = 16, 2, 32, 64


def _group():
    group = parallel_state.get_tensor_model_parallel_group()
    return group, dist.get_rank(group), dist.get_world_size(group)


def _exchanges(overlap: bool) -> dict:
    """Each rank's chunk is 16 * rank + position (as E4M3 codes), its scale 10 + rank; its partial
    sum of chunk c is 100 * c + rank."""
    group, rank, n = _group()
    codes = (torch.arange(12, dtype=torch.float32).view(4, 3) + 16 * rank).to(torch.float8_e4m3fn)
    scale = torch.tensor(10.0 + rank)
    gather = all_gather_chunks(codes, scale, group, overlap=overlap)
    taken = [gather.take() for _ in range(n)]
    # known scales: the codes alone travel
    regather = all_gather_chunks(codes, None, group, overlap=overlap, scales=[torch.tensor(10.0 + j) for j in range(n)])
    retaken = [regather.take() for _ in range(n)]
    scatter = reduce_scatter_chunks((4, 3), torch.float32, "cpu", group, overlap=overlap)
    order = []
    for _ in range(n):
        c, part = scatter.partial()
        order.append(c)
        part.copy_(torch.full((4, 3), float(100 * c + rank)))  # rank's partial sum of chunk c
        scatter.reduce(part)
    return dict(
        gathered=[(j, chunk.float(), s.item()) for j, chunk, s in taken],
        regathered=[(j, chunk.float(), s.item()) for j, chunk, s in retaken],
        order=order,
        reduced=scatter.result(),
    )


@pytest.mark.parametrize("n", [2, 4])
def test_chunk_exchanges_hand_out_every_chunk_in_ring_order_with_or_without_overlap(n):
    ring = run_distributed(_exchanges, n, args=(True,), tensor_parallel=n)
    collective = run_distributed(_exchanges, n, args=(False,), tensor_parallel=n)
    for rank, (a, b) in enumerate(zip(ring, collective)):
        want = [
            (j, (torch.arange(12.0).view(4, 3) + 16 * j).to(torch.float8_e4m3fn).float(), 10.0 + j) for j in range(n)
        ]
        ring_order = [(rank - s) % n for s in range(n)]  # its own chunk first, then r - 1, r - 2, ...
        for got in (a["gathered"], a["regathered"], b["gathered"], b["regathered"]):
            assert [j for j, _, _ in got] == ring_order
            for j, chunk, s in got:
                assert torch.equal(chunk, want[j][1]) and s == want[j][2]
        assert a["order"] == b["order"] == [(rank - s - 1) % n for s in range(n)]  # its own chunk last
        total = float(100 * rank * n + sum(range(n)))  # chunk `rank` summed over the ranks
        assert torch.equal(a["reduced"], torch.full((4, 3), total)) and torch.equal(b["reduced"], a["reduced"])


def _q(x, fmt):
    """A tensor quantized per tensor with its own amax, dequantized to FP32: what a chunk's GEMM sees."""
    q, scale = quantize_per_tensor_reference(x, fmt)
    return dequantize_per_tensor_reference(q, scale, torch.float32)


def _full_tensors(dtype):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    x[3, 1, 5] = 9.0  # chunks with very different amaxes: their scales must not be shared
    w = torch.randn(WIDTH, HIDDEN, generator=g) * 0.1
    bias = torch.randn(WIDTH, generator=g)
    dy = torch.randn(SEQ, BATCH, WIDTH, generator=g)
    return x.to(dtype), w, bias, dy.to(dtype)


def _column(dtype, overlap: bool, source: str, main_grad: bool) -> dict:
    """This rank's column-parallel output, input gradient and weight (and bias) gradient, and the
    per-chunk reference of each."""
    group, rank, n = _group()
    config = CoatConfig(tp_comm_overlap=overlap, fprop_fast_accumulation=False)
    x_full, w_full, b_full, dy_full = _full_tensors(dtype)
    s_c, out_c = SEQ // n, WIDTH // n
    x_chunks = list(x_full.chunk(n, dim=0))
    w = w_full[rank * out_c : (rank + 1) * out_c].clone().requires_grad_()
    bias = b_full[rank * out_c : (rank + 1) * out_c].clone().requires_grad_()
    dy = dy_full[:, :, rank * out_c : (rank + 1) * out_c]  # this rank's output columns, whole sequence
    x = x_chunks[rank].clone().requires_grad_()
    if source == "norm":  # the COAT norm's per-tensor FP8 output (under SP: no transposed copy)
        norm_w = torch.ones(HIDDEN, dtype=dtype)
        inp = rmsnorm_to_fp8(x, norm_w, 1e-5, transpose=None)
        normed = [rmsnorm_to_fp8(c, norm_w, 1e-5, transpose=None) for c in x_chunks]
        ref_x = [c.dequantize(torch.float32) for c in normed]  # FP8 values on each rank's own scale
        x_scales = [c.scale for c in normed]
    else:
        inp = x
        ref_x = [_q(c, "e4m3") for c in x_chunks]
        x_scales = [quantize_per_tensor_reference(c, "e4m3")[1] for c in x_chunks]
    if main_grad:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    y = column_parallel_fp8_linear(
        inp,
        w,
        bias,
        group=group,
        config=config,
        weight_cache=weight_cache_for(config),
        accumulate_into_main_grad=main_grad,
    )
    # the gradient of the linear's own input (under "norm", the norm's output)
    dx, dw, db = torch.autograd.grad(y, [inp, w, bias], dy)
    placeholder, dw = dw, w.main_grad if main_grad else dw

    ref_w = _q(w.detach(), "e4m3")
    ref_y = torch.cat([c.reshape(-1, HIDDEN) @ ref_w.t() + bias.detach().float() for c in ref_x]).to(dtype)
    rows = s_c * BATCH

    def folded_dy(k):  # rank k's whole dY, chunk j quantized against X chunk j's scale (one product of scales)
        dy_k = dy_full[:, :, k * out_c : (k + 1) * out_c].reshape(-1, out_c)
        amax = dy_k.float().abs().max()
        s_max = max(float(t) for t in x_scales)
        chunks, products = [], []
        for j in range(n):
            amax_j = amax * (torch.tensor(s_max) / x_scales[j])
            q, g = quantize_per_tensor_reference(dy_k[j * rows : (j + 1) * rows], "e5m2", amax=amax_j)
            chunks.append(dequantize_per_tensor_reference(q, g, torch.float32))
            products.append(float(g) * float(x_scales[j]))
        assert max(products) - min(products) <= 1e-6 * max(products)  # the fold: one product of scales
        return torch.cat(chunks)

    ref_dy = folded_dy(rank)
    # dX of this rank's chunk: every rank's partial for it (each rank its own dY columns and W rows)
    partials = []
    for k in range(n):
        dy_k = folded_dy(k)
        w_k = _q(w_full[k * out_c : (k + 1) * out_c], "e4m3")
        partials.append((dy_k[rank * rows : (rank + 1) * rows] @ w_k).to(dtype))
    ref_dx = torch.stack(partials).float().sum(0).to(dtype).view(x.shape)
    ref_dw = sum(ref_dy[j * rows : (j + 1) * rows].t() @ ref_x[j].reshape(-1, HIDDEN) for j in range(n))
    assert len({round(float(t), 12) for t in x_scales}) == n  # the chunks' scales differ: the fold is tested
    return dict(
        y=y.detach(),
        dx=dx,
        dw=dw.float(),
        db=db,
        ref_y=ref_y.view(y.shape),
        ref_dx=ref_dx,
        ref_dw=ref_dw,
        ref_db=dy.float().reshape(-1, out_c).sum(0),
        placeholder=placeholder,
    )


def _row(dtype, overlap: bool, source: str, main_grad: bool) -> dict:
    """This rank's row-parallel output chunk, input gradient and weight gradient, and their references."""
    group, rank, n = _group()
    config = CoatConfig(tp_comm_overlap=overlap, fprop_fast_accumulation=False)
    _, w_full, _, _ = _full_tensors(dtype)
    # the row-parallel layer maps WIDTH -> HIDDEN: the full input is (SEQ, BATCH, WIDTH), split by columns
    g = torch.Generator().manual_seed(99)
    h_full = torch.randn(SEQ, BATCH, 2 * WIDTH, generator=g).to(dtype)  # a SwiGLU input [gate | up]
    in_c = WIDTH // n
    w_t_full = w_full.t().contiguous()  # (HIDDEN, WIDTH)
    w = w_t_full[:, rank * in_c : (rank + 1) * in_c].clone().requires_grad_()
    rows = SEQ // n * BATCH
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)
    dy_chunks = list(dy.chunk(n, dim=0))

    def local_input(k):  # rank k's columns of the input, whole sequence, as its producer hands them over
        if source == "swiglu":
            gate, up = h_full[..., :WIDTH], h_full[..., WIDTH:]
            h_k = torch.cat([gate[..., k * in_c : (k + 1) * in_c], up[..., k * in_c : (k + 1) * in_c]], dim=-1)
            return h_k.clone().requires_grad_()
        x_k = torch.randn(SEQ, BATCH, in_c, generator=torch.Generator().manual_seed(7 + k))
        x_k[k, 0, 0] = 5.0 * (k + 1)  # each rank's input its own amax
        return x_k.to(dtype).requires_grad_()

    def gemm_input(t):
        return swiglu_fp8(t) if source == "swiglu" else t

    def ref_input(t):
        if source == "swiglu":
            return swiglu_fp8(t.detach()).dequantize(torch.float32)
        return _q(t.detach(), "e4m3")

    x = local_input(rank)
    if main_grad:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    inp = gemm_input(x)
    y = row_parallel_fp8_linear(
        inp,
        w,
        group=group,
        config=config,
        weight_cache=weight_cache_for(config),
        save_original_input=source == "saved",
        accumulate_into_main_grad=main_grad,
    )
    dx, dw = torch.autograd.grad(y, [inp, w], dy_chunks[rank])  # dx: the linear's own input's gradient
    placeholder, dw = dw, w.main_grad if main_grad else dw

    ref_inputs = [ref_input(local_input(k)).reshape(-1, in_c) for k in range(n)]
    ref_ws = [_q(w_t_full[:, k * in_c : (k + 1) * in_c], "e4m3") for k in range(n)]
    partials = [(ref_inputs[k][rank * rows : (rank + 1) * rows] @ ref_ws[k].t()).to(dtype) for k in range(n)]
    ref_y = torch.stack(partials).float().sum(0).to(dtype).view(y.shape)
    ref_dy = torch.cat([_q(c, "e5m2").reshape(-1, HIDDEN) for c in dy_chunks])  # each chunk its own scale
    ref_a = ref_inputs[rank]
    ref_dx = (ref_dy @ ref_ws[rank]).to(dtype).view(dx.shape)
    ref_dw = sum(ref_dy[j * rows : (j + 1) * rows].t() @ ref_a[j * rows : (j + 1) * rows] for j in range(n))
    return dict(y=y.detach(), dx=dx, dw=dw.float(), ref_y=ref_y, ref_dx=ref_dx, ref_dw=ref_dw, placeholder=placeholder)


def _close(got, want, dtype, what):
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    assert scale > 0, f"{what}: the reference is zero, which tests nothing"
    # FP32: sums in another order; BF16: a value on either side of a rounding boundary (one unit)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("source", ["plain", "norm"])
def test_column_parallel_linear_equals_the_per_chunk_reference(n, source):
    dtype = torch.float32 if source == "plain" else torch.bfloat16
    for main_grad in (False, True):
        ranks = run_distributed(_column, n, args=(dtype, True, source, main_grad), tensor_parallel=n)
        for r in ranks:
            _close(r["y"], r["ref_y"], dtype, "Y")
            _close(r["dx"], r["ref_dx"], dtype, "dX")
            _close(r["dw"], r["ref_dw"], torch.float32, "dW")
            _close(r["db"], r["ref_db"], torch.float32, "db")
            # main_grad took dW; autograd got Megatron's placeholder (no second addition)
            assert (r["placeholder"] is not None) and (not main_grad or r["placeholder"].shape == r["dw"].shape)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("source", ["plain", "saved", "swiglu"])
def test_row_parallel_linear_equals_the_per_chunk_reference(n, source):
    dtype = torch.float32
    for main_grad in (False, True):
        ranks = run_distributed(_row, n, args=(dtype, True, source, main_grad), tensor_parallel=n)
        for r in ranks:
            _close(r["y"], r["ref_y"], dtype, "Y")
            _close(r["dx"], r["ref_dx"], dtype, "dX")
            _close(r["dw"], r["ref_dw"], torch.float32, "dW")


def _column_into_swiglu(hand_over: bool) -> dict:
    """fc1 under SP feeding SwiGLU: its gradients, and how many times its backward computed dY's amax
    (``hand_over``: SwiGLU's dh reaches fc1 as is; otherwise as a copy, which no amax was left for)."""
    group, rank, n = _group()
    config = CoatConfig(fprop_fast_accumulation=False)
    x_full, w_full, _, _ = _full_tensors(torch.bfloat16)
    out_c = WIDTH // n  # [gate | up] of this rank: F = out_c / 2 (16 at TP 2, one group)
    x = x_full.chunk(n, dim=0)[rank].clone().requires_grad_()
    w = w_full[rank * out_c : (rank + 1) * out_c].clone().requires_grad_()
    da = torch.randn(SEQ, BATCH, out_c // 2, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    h = column_parallel_fp8_linear(
        x,
        w,
        None,
        group=group,
        config=config,
        weight_cache=weight_cache_for(config),
        output_form=OutputForm.SWIGLU_INPUT,
    )
    a = swiglu_fp8(h, group_size=config.group_size)
    amax_passes = []
    real_amax = sequence_parallel_module.tensor_amax
    sequence_parallel_module.tensor_amax = lambda t, **kw: amax_passes.append(t) or real_amax(t, **kw)
    try:
        if hand_over:
            dx, dw = torch.autograd.grad(a, [x, w], da)
        else:
            (dh,) = torch.autograd.grad(a, h, da, retain_graph=True)
            dx, dw = torch.autograd.grad(h, [x, w], dh.clone())
    finally:
        sequence_parallel_module.tensor_amax = real_amax
    return dict(dx=dx, dw=dw, amax_passes=len(amax_passes))


def test_a_sequence_parallel_fc1_quantizes_dy_with_the_amax_swiglu_handed_it():
    handed = run_distributed(_column_into_swiglu, 2, args=(True,), tensor_parallel=2)
    computed = run_distributed(_column_into_swiglu, 2, args=(False,), tensor_parallel=2)
    for a, b in zip(handed, computed):
        assert (a["amax_passes"], b["amax_passes"]) == (0, 1)
        assert torch.equal(a["dx"], b["dx"]) and torch.equal(a["dw"], b["dw"])


@pytest.mark.parametrize("n", [2, 4])
def test_overlap_on_and_off_compute_the_same(n):
    """The ring and the collectives hand the same chunks to the same GEMMs in the same order: the
    same outputs and weight gradients bit for bit; the input gradients too where the reduce-scatter
    adds two partial sums (TP 2), within rounding over more ranks."""
    # the ring runs one GEMM per chunk where the collectives run one over every row (the row-parallel
    # forward, X from SwiGLU or requantized from a kept input): the same products
    for fn, source in ((_column, "norm"), (_row, "swiglu"), (_row, "saved")):
        on = run_distributed(fn, n, args=(torch.bfloat16, True, source, False), tensor_parallel=n)
        off = run_distributed(fn, n, args=(torch.bfloat16, False, source, False), tensor_parallel=n)
        for a, b in zip(on, off):
            if fn is _column or n == 2:  # the column-parallel forward reduces nothing
                assert torch.equal(a["y"], b["y"])
            else:
                _close(a["y"], b["y"], torch.bfloat16, "Y")
            assert torch.equal(a["dw"], b["dw"])
            if fn is _row or n == 2:  # the row-parallel backward reduces nothing
                assert torch.equal(a["dx"], b["dx"])
            else:
                _close(a["dx"], b["dx"], torch.bfloat16, "dX")


@pytest.mark.gpu
def test_on_two_gpus_with_nccl():
    """sequence_parallel_gpu.py under torchrun: the linears against the reference, the ring against
    the collectives, no host synchronisation, and a CUDA graph of the layer replaying like eager."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sequence_parallel_gpu.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NCCL_NVLS_ENABLE": "0"},
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = proc.stdout.splitlines()
    for rank in (0, 1):
        for check in ("equal the per-chunk reference", "overlap on and off is bit-identical", "never synchronises",
                      "replays bit-identical to eager"):  # fmt: skip
            assert any(line.startswith(f"rank {rank}: ") and check in line for line in lines), (rank, check)


def _packed_and_apart(overlap: bool) -> dict:
    """The norm's output gathered as the producer packed it and as apart (copied into a message),
    with what each gather launched, and the column-parallel linear's results from each."""
    from launch_counter import LaunchCounter

    group, rank, n = _group()
    config = CoatConfig(tp_comm_overlap=overlap, fprop_fast_accumulation=False)
    x_full, w_full, _, dy_full = _full_tensors(torch.bfloat16)
    x_full[SEQ // n * rank] = 0.0  # a zero row and an outlier in each rank's chunk
    x_full[SEQ // n * rank + 1, 0, rank] = 900.0
    out_c = WIDTH // n
    got = {}
    for packed in (True, False):
        x = x_full.chunk(n)[rank].clone().requires_grad_()
        w = w_full[rank * out_c : (rank + 1) * out_c].clone().requires_grad_()
        inp = rmsnorm_to_fp8(x, torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-5, transpose=None, packed=packed)
        with LaunchCounter() as counted:
            gather = all_gather_chunks(inp.data_fp8.view(-1, HIDDEN), inp.scale, group, overlap=overlap)
            taken = sorted((gather.take() for _ in range(n)), key=lambda t: t[0])
        y = column_parallel_fp8_linear(inp, w, None, group=group, config=config, weight_cache=weight_cache_for(config))
        dx, dw = torch.autograd.grad(y, [x, w], dy_full[..., rank * out_c : (rank + 1) * out_c])
        got[packed] = dict(
            chunks=[c.view(torch.uint8).clone() for _, c, _ in taken],
            scales=[s.clone() for _, _, s in taken],
            launches=counted.summary()["by_launch"],
            y=y.detach(),
            dx=dx,
            dw=dw,
        )
    return got


@pytest.mark.parametrize("overlap", [False, True], ids=["collective", "ring"])
def test_a_packed_producer_output_is_gathered_as_it_is_with_the_same_results(overlap):
    """The norm under SP writes its codes and scale as the all-gather's message: gathered without
    a copy, the same chunks and scales, and the column-parallel linear's results bit for bit."""
    for got in run_distributed(_packed_and_apart, 2, args=(overlap,), tensor_parallel=2):
        packed, apart = got[True], got[False]
        for a, b in zip(packed["chunks"] + packed["scales"], apart["chunks"] + apart["scales"]):
            assert torch.equal(a, b)
        for name in ("y", "dx", "dw"):
            assert torch.equal(packed[name], apart[name]), name
        if not overlap:
            assert "aten.copy_" not in packed["launches"], packed["launches"]
            assert apart["launches"]["aten.copy_"] == 2, apart["launches"]  # the codes and the scale
        # one collective, or at TP 2 one ring step
        assert sum(v for k, v in packed["launches"].items() if k.startswith("nccl")) == 1
