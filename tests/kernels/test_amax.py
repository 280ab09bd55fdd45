"""``amax.finish_amax``: the last program of a launch reduces every program's partial amax.

What could go wrong: a partial left out (the reduction loop's bounds, a grid of more programs
than one block of the loop), a partial read before it was written (memory ordering: on a GPU the
stress test launches many programs many times), or a counter left non-zero, which would make the
next launch that draws it finish early or never.
"""

import pytest
import torch
import triton
import triton.language as tl

from coat_kernels import amax as amax_mod
from coat_kernels import tensor_amax
from coat_kernels.amax import amax_outputs, finish_amax


@triton.jit
def _one_value_per_program(x_ptr, partials_ptr, amax_ptr, counter_ptr):
    """Each program's partial is one input value (a 2-D grid, row-major program index)."""
    i = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(partials_ptr + i, tl.abs(tl.load(x_ptr + i)))
    finish_amax(partials_ptr, amax_ptr, counter_ptr)


def _launch(x: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    partials, amax, count = amax_outputs(grid[0] * grid[1], x.device)
    _one_value_per_program[grid](x, partials, amax, count)
    return partials, amax, count


@pytest.mark.parametrize("grid", [(1, 1), (3, 7), (2, 1025)], ids=str)
def test_the_last_program_reduces_every_partial(device, grid, seed):
    n = grid[0] * grid[1]
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g)
    x[torch.randint(n, (1,), generator=g)] = -7.5  # the maximum, anywhere (past the first 1024 too)
    partials, amax, count = _launch(x.to(device), grid)
    assert amax.shape == () and amax.dtype == torch.float32
    assert amax.item() == 7.5 == partials.max().item()
    assert count.item() == 0, "the last program leaves its counter at zero for the next launch"


def test_the_maximum_sits_in_the_last_partial_and_an_inf_wins(device):
    x = torch.zeros(2 * 1025)
    x[-1] = 3.0
    assert _launch(x.to(device), (2, 1025))[1].item() == 3.0
    x[1500] = -float("inf")
    assert _launch(x.to(device), (2, 1025))[1].item() == float("inf")


def test_one_counter_serves_launch_after_launch(device, monkeypatch, seed):
    """The pool hands its counters out in turn; with a pool of one, every launch draws the same
    counter, which each launch's last program must have reset."""
    monkeypatch.setattr(amax_mod, "SLOTS", 1)
    monkeypatch.setattr(amax_mod, "_pools", {})
    g = torch.Generator().manual_seed(seed)
    for grid in [(5, 3), (1, 2), (4, 9), (1, 1)]:
        x = torch.randn(grid[0] * grid[1], generator=g)
        partials, amax, count = _launch(x.to(device), grid)
        assert amax.item() == x.abs().max().item() and count.item() == 0
        assert count.data_ptr() == amax_mod.pool(device).data_ptr()


def test_the_pool_hands_out_distinct_counters_in_turn(monkeypatch):
    monkeypatch.setattr(amax_mod, "_pools", {})
    cpu = torch.device("cpu")
    drawn = [amax_mod.counter(cpu).data_ptr() for _ in range(amax_mod.SLOTS)]
    assert len(set(drawn)) == amax_mod.SLOTS
    assert amax_mod.counter(cpu).data_ptr() in drawn  # then round again
    assert (amax_mod.pool(cpu) == 0).all()


@pytest.mark.gpu
def test_many_programs_many_times_on_gpu(seed):
    """Memory ordering under load: 200 launches of 65536 programs (and of tensor_amax on a large
    activation), the maximum in a random program each time; every launch must find it."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    grid = (64, 1024)
    for _ in range(200):
        x = torch.rand(grid[0] * grid[1], device=dev, generator=g)
        x[torch.randint(x.numel(), (1,), device=dev, generator=g)] = 2.0
        assert _launch(x, grid)[1].item() == 2.0
    for _ in range(20):
        x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16, generator=g)
        assert torch.equal(tensor_amax(x), x.float().abs().amax())
    assert (amax_mod.pool(dev) == 0).all()
