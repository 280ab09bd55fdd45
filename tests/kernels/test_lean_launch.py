"""The lean launch path (coat_kernels.launch): when it reuses a compiled kernel, and that it
launches the same binary with the same arguments as Triton's own path would."""

import pytest
import torch
import triton

import coat_kernels.launch as launch
from coat_kernels.launch import LeanKernel, cdiv, next_power_of_2


class _Param:
    def __init__(self, name: str):
        self.name = name
        self.is_constexpr = name.isupper()


class _Compiled:
    function = "function"
    packed_metadata = "metadata"

    def __init__(self, calls: list):
        self.run = lambda *a: calls.append(("fast", a))


class _FakeKernel:
    """Stands in for a JITFunction: records Triton-path launches, returns a compiled kernel whose
    launcher records fast-path launches."""

    def __init__(self, names: str):
        self.params = [_Param(n) for n in names.split()]
        self.calls: list = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return _Compiled(self.calls)

        return run


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(launch, "_current_device", lambda: 3)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 1000 + device)
    kernel = _FakeKernel("x_ptr out_ptr n eps FMAX BLOCK")
    return kernel, LeanKernel(kernel, enabled=True)


def _kinds(kernel):
    return [c[0] for c in kernel.calls]


def test_the_second_launch_goes_to_the_launcher_with_every_argument_in_order(fake):
    kernel, lean = fake
    x, out = torch.zeros(64), torch.zeros(64)
    lean[(4,)](x, out, 64, 1e-5, FMAX=448.0, BLOCK=16, num_warps=4)
    lean[(4,)](x, out, 64, 1e-5, FMAX=448.0, BLOCK=16, num_warps=4)
    assert _kinds(kernel) == ["triton", "fast"] and lean.misses == 1
    grid_and_handles = kernel.calls[1][1][:9]
    assert grid_and_handles == (4, 1, 1, 1003, "function", "metadata", None, None, None)
    args = kernel.calls[1][1][9:]
    assert args[0] is x and args[1] is out and args[2:] == (64, 1e-5, 448.0, 16)


@pytest.mark.parametrize(
    "change",
    ["int value", "alignment", "dtype", "constexpr", "num_warps", "device"],
)
def test_a_launch_triton_would_specialize_differently_takes_its_path(fake, monkeypatch, change):
    kernel, lean = fake
    x = torch.zeros(64)
    args, kw = [x, x, 64, 1.0], {"FMAX": 448.0, "BLOCK": 16, "num_warps": 4}
    lean[(1,)](*args, **kw)
    if change == "int value":
        args[2] = 65
    elif change == "alignment":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[1] = torch.zeros(64, dtype=torch.bfloat16)
    elif change == "constexpr":
        kw["BLOCK"] = 32
    elif change == "num_warps":
        kw["num_warps"] = 8
    else:
        monkeypatch.setattr(launch, "_current_device", lambda: 4)
    lean[(1,)](*args, **kw)
    assert _kinds(kernel) == ["triton", "triton"]
    lean[(1,)](*args, **kw)  # and then that key has its own entry
    assert _kinds(kernel)[-1] == "fast"


def test_a_new_float_or_new_tensor_of_the_same_kind_reuses_the_entry(fake):
    kernel, lean = fake
    lean[(2, 3)](torch.zeros(8), torch.zeros(8), 8, 1.0, FMAX=448.0, BLOCK=16)
    lean[(2, 3)](torch.ones(32), torch.zeros(32), 8, 2.5, FMAX=448.0, BLOCK=16)
    assert _kinds(kernel) == ["triton", "fast"]
    assert kernel.calls[1][1][:3] == (2, 3, 1)


def test_what_the_fast_path_does_not_cover_always_takes_tritons_path(fake, monkeypatch):
    kernel, lean = fake
    x = torch.zeros(8)
    for _ in range(2):  # a callable grid
        lean[lambda meta: (1,)](x, x, 8, 1.0, FMAX=448.0, BLOCK=16)
    for _ in range(2):  # a pointer by keyword: no entry is made
        lean[(1,)](x, out_ptr=x, n=8, eps=1.0, FMAX=448.0, BLOCK=16)
    for _ in range(2):  # a constexpr left to its default: no entry either
        lean[(1,)](x, x, 8, 1.0, FMAX=448.0)
    assert _kinds(kernel) == ["triton"] * 6
    lean[(1,)](x, x, 8, 1.0, FMAX=448.0, BLOCK=16)
    monkeypatch.setattr(launch, "_hooks_set", lambda: True)  # a launch hook (Proton) set
    lean[(1,)](x, x, 8, 1.0, FMAX=448.0, BLOCK=16)
    assert _kinds(kernel)[-2:] == ["triton", "triton"]


def test_switched_off_it_is_tritons_path(monkeypatch):
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 0)
    kernel = _FakeKernel("x_ptr n BLOCK")
    lean = LeanKernel(kernel, enabled=False)
    for _ in range(3):
        lean[(1,)](torch.zeros(4), 4, BLOCK=4)
    assert _kinds(kernel) == ["triton"] * 3


def test_the_table_is_bounded(fake, monkeypatch):
    kernel, lean = fake
    monkeypatch.setattr(launch, "MAX_ENTRIES", 3)
    x = torch.zeros(8)
    for n in range(10):
        lean[(1,)](x, x, n, 1.0, FMAX=448.0, BLOCK=16)
    assert len(lean.entries) <= 3


def test_interpreted_kernels_and_attributes_pass_through():
    @triton.jit
    def probe(x_ptr):
        pass

    wrapped = LeanKernel(probe)
    assert wrapped.enabled == isinstance(probe, triton.runtime.jit.JITFunction)
    assert wrapped.fn is probe.fn  # every other attribute is the kernel's


@pytest.mark.parametrize("n", [0, 1, 2, 3, 15, 16, 17, 1000, 4096, 5632, 2**20 + 1])
def test_integer_helpers_match_tritons(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)
    for d in (1, 3, 16, 64, 128):
        assert cdiv(n, d) == triton.cdiv(n, d)


@pytest.mark.gpu
def test_fast_path_launches_match_tritons_bit_for_bit(seed):
    """The per-tensor quantizer through both paths, on aligned and misaligned inputs and several shapes:
    the same codes, transposes and scales; a misaligned input gets its own compiled kernel."""
    from coat_kernels import per_tensor

    kernel = per_tensor._quantize_per_tensor_kernel
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(4099 * 257 + 7, device="cuda", generator=g).to(torch.bfloat16)
    cases = [base[: 512 * 256].view(512, 256), base[3 : 3 + 300 * 96].view(300, 96), base[: 4099 * 257].view(4099, 257)]
    for x in cases:
        outs = []
        for enabled in (True, False, True):
            kernel.enabled = enabled
            try:
                outs.append(per_tensor.quantize_per_tensor(x, "e4m3", transpose=True, check_finite=False))
            finally:
                kernel.enabled = True
        q, scale, q_t = outs[0]
        for q2, scale2, q_t2 in outs[1:]:
            assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
            assert torch.equal(q_t.view(torch.uint8), q_t2.view(torch.uint8))
            assert torch.equal(scale, scale2)
    # the misaligned view (6 bytes past the allocation) got an entry of its own
    assert any(key[1] == (torch.bfloat16, False) for key in kernel.entries)
    assert any(key[1] == (torch.bfloat16, True) for key in kernel.entries)
