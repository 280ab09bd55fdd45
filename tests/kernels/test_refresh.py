import pytest
import torch
from kernel_inputs import as_bytes, random_activations

from coat_kernels.per_tensor import quantize_per_tensor, quantize_per_tensor_reference
from coat_kernels.refresh import refresh_per_tensor_amax, refresh_per_tensor_copy

SHAPES = [(7, 96), (33, 5120), (129, 257), (1, 16), (300, 48)]


def buffers(shape, fmt, transpose, device):
    dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    q = torch.empty(shape, dtype=dtype, device=device)  # poisoned (conftest)
    q_t = torch.empty((shape[-1], q.numel() // shape[-1]), dtype=dtype, device=device) if transpose else None
    scale = torch.full((), float("nan"), device=device)
    amax = torch.zeros((), device=device)
    return q, q_t, scale, amax


def snapshot(q, q_t, scale):
    return [as_bytes(q), as_bytes(q_t) if q_t is not None else None, scale.cpu().clone()]


def check_against_reference(x, fmt, q, q_t, scale):
    ref = quantize_per_tensor_reference(x.cpu(), fmt, transpose=q_t is not None)
    assert torch.equal(scale.cpu(), ref[1])
    assert torch.equal(as_bytes(q), as_bytes(ref[0])), f"{(as_bytes(q) != as_bytes(ref[0])).sum()} codes differ"
    if q_t is not None:
        assert torch.equal(as_bytes(q_t), as_bytes(ref[2]))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_refresh_equals_quantize_per_tensor_and_runs_only_when_stale(device, shape, fmt, dtype, backend, seed):
    if backend == "reference" and device.type == "cuda":
        pytest.skip(
            "the torch reference is bit-exact on the CPU (on CUDA torch divides by a scalar through its reciprocal)"
        )
    x = random_activations(shape, dtype, seed=seed).to(device)
    q, q_t, scale, amax = buffers(shape, fmt, dtype == torch.bfloat16, device)
    generation = torch.full((), -1, dtype=torch.int64, device=device)
    current = torch.zeros((), dtype=torch.int64, device=device)
    refresh_per_tensor_copy(x, q, scale, amax, q_t=q_t, generation=generation, current=current, backend=backend)
    check_against_reference(x, fmt, q, q_t, scale)
    assert generation.item() == 0 and amax.item() == 0.0
    # up to date: nothing is written, even for a changed weight
    before = snapshot(q, q_t, scale)
    refresh_per_tensor_copy(x * 3, q, scale, amax, q_t=q_t, generation=generation, current=current, backend=backend)
    after = snapshot(q, q_t, scale)
    assert all(a is None or torch.equal(a, b) for a, b in zip(after, before)) and amax.item() == 0.0
    # the weight changed (current bumped): remade in the same buffers
    y = random_activations(shape, dtype, seed=seed + 1).to(device)
    current.add_(1)
    refresh_per_tensor_copy(y, q, scale, amax, q_t=q_t, generation=generation, current=current, backend=backend)
    check_against_reference(y, fmt, q, q_t, scale)
    assert generation.item() == 1 and amax.item() == 0.0
    # forced: remade although the generations agree
    refresh_per_tensor_copy(
        x, q, scale, amax, q_t=q_t, generation=generation, current=current, force=True, backend=backend
    )
    check_against_reference(x, fmt, q, q_t, scale)


@pytest.mark.parametrize("shape", [(7, 96), (129, 257), (1, 16), (300, 48), (0, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_refresh_amax_keeps_the_amax_only_when_stale(device, shape, dtype, backend, seed):
    x = (
        random_activations(shape, dtype, seed=seed).to(device)
        if shape[0]
        else torch.zeros(shape, dtype=dtype).to(device)
    )
    if shape[0] > 1:
        x[1, 3] = -7.0e3  # an outlier: the amax is its magnitude, whatever its sign
    kept = torch.full((), float("nan"), device=device)  # nothing read from it before a refresh
    work = torch.zeros((), device=device)
    generation = torch.full((), -1, dtype=torch.int64, device=device)
    current = torch.zeros((), dtype=torch.int64, device=device)
    refresh_per_tensor_amax(x, kept, work, generation=generation, current=current, backend=backend)
    expected = x.float().abs().max().item() if x.numel() else 0.0
    assert kept.item() == expected and work.item() == 0.0 and generation.item() == 0
    # codes made from the kept amax are the bytes of a refreshed copy (what the cache used to keep)
    if x.numel() and not (backend == "reference" and device.type == "cuda"):  # (CUDA torch: see above)
        q, scale = quantize_per_tensor(x, "e4m3", amax=kept, backend=backend)
        ref = quantize_per_tensor_reference(x.cpu(), "e4m3")
        assert torch.equal(as_bytes(q), as_bytes(ref[0])) and torch.equal(scale.cpu(), ref[1])
    # up to date: untouched, even for a changed weight
    refresh_per_tensor_amax(x * 3, kept, work, generation=generation, current=current, backend=backend)
    assert kept.item() == expected and work.item() == 0.0
    # stale: remade; forced: remade although the generations agree
    current.add_(1)
    refresh_per_tensor_amax(x * 2, kept, work, generation=generation, current=current, backend=backend)
    assert kept.item() == 2 * expected and generation.item() == 1 and work.item() == 0.0
    refresh_per_tensor_amax(x, kept, work, generation=generation, current=current, force=True, backend=backend)
    assert kept.item() == expected
    # a non-finite weight keeps an infinite amax (its scale is then infinite: the step is lost, not silently wrong)
    if x.numel():
        x[0, 0] = float("nan")
        current.add_(1)
        refresh_per_tensor_amax(x, kept, work, generation=generation, current=current, backend=backend)
        assert kept.item() == float("inf")


def test_refresh_amax_rejects_mismatched_buffers(device):
    x = torch.randn(4, 16, device=device)
    ok = dict(
        generation=torch.zeros((), dtype=torch.int64, device=device),
        current=torch.zeros((), dtype=torch.int64, device=device),
    )
    with pytest.raises(ValueError, match="kept must be a torch.float32 tensor of one element"):
        refresh_per_tensor_amax(x, torch.zeros(2, device=device), torch.zeros((), device=device), **ok)
    with pytest.raises(ValueError, match="generation must be a torch.int64"):
        refresh_per_tensor_amax(
            x, torch.zeros((), device=device), torch.zeros((), device=device),
            generation=torch.zeros((), device=device), current=ok["current"],
        )  # fmt: skip


def test_refresh_without_generations_zero_and_outlier_weights(device):
    for x in (torch.zeros(24, 64), torch.full((5, 32), -3.0), torch.randn(16, 48) * 1e-3):
        x[0, 0] += 0.0
        q, q_t, scale, amax = buffers(tuple(x.shape), "e4m3", True, device)
        x = x.to(torch.bfloat16)
        refresh_per_tensor_copy(x.to(device), q, scale, amax, q_t=q_t, backend="triton")
        check_against_reference(x, "e4m3", q, q_t, scale)
    x = torch.randn(16, 48)
    x[3, 5] = 3.0e4
    q, q_t, scale, amax = buffers((16, 48), "e4m3", True, device)
    refresh_per_tensor_copy(x.to(torch.bfloat16).to(device), q, scale, amax, q_t=q_t, backend="triton")
    check_against_reference(x.to(torch.bfloat16), "e4m3", q, q_t, scale)


def test_refresh_rejects_mismatched_buffers(device):
    x = torch.randn(8, 32, device=device)
    q, q_t, scale, amax = buffers((8, 32), "e4m3", True, device)
    with pytest.raises(ValueError, match="q must be contiguous FP8 codes"):
        refresh_per_tensor_copy(x, q[:4], scale, amax)
    with pytest.raises(ValueError, match="q_t must be"):
        refresh_per_tensor_copy(x, q, scale, amax, q_t=q_t.t())
    with pytest.raises(ValueError, match="give both generation and current"):
        refresh_per_tensor_copy(x, q, scale, amax, generation=torch.zeros((), dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="int64"):
        refresh_per_tensor_copy(x, q, scale, amax, generation=torch.zeros(()), current=torch.zeros(()))


@pytest.mark.gpu
def test_a_captured_refresh_replays_only_after_the_generation_moves(seed):
    x = random_activations((384, 1000), seed=seed).cuda()
    q, q_t, scale, amax = buffers((384, 1000), "e4m3", True, "cuda")
    generation = torch.full((), -1, dtype=torch.int64, device="cuda")
    current = torch.zeros((), dtype=torch.int64, device="cuda")
    refresh_per_tensor_copy(
        x, q, scale, amax, q_t=q_t, generation=generation, current=current
    )  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        refresh_per_tensor_copy(x, q, scale, amax, q_t=q_t, generation=generation, current=current)
    x.mul_(-0.5)  # a new weight, in place (the graph reads x's address)
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(x * -2.0, "e4m3", q, q_t, scale)  # not refreshed: the generation did not move
    current.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(x, "e4m3", q, q_t, scale)
    assert generation.item() == 1 and amax.item() == 0.0
