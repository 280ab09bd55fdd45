"""coat_kernels.workspace: named scratch buffers reused from call to call (CoatConfig.scratch_buffers).

A name gives views of one buffer, grown when a request is larger, 16-byte aligned for any dtype;
no name, or CUDA graph capture, allocates as torch.empty does; release() frees them."""

from __future__ import annotations

import pytest
import torch

from coat_kernels import workspace


@pytest.fixture(autouse=True)
def fresh():
    workspace.release()
    yield
    workspace.release()


def test_a_name_hands_out_one_buffer_again():
    a = workspace.empty((4, 8), torch.float32, "cpu", "t.a")
    b = workspace.empty((2, 16), torch.float32, "cpu", "t.a")
    assert a.data_ptr() == b.data_ptr() and b.shape == (2, 16) and b.dtype == torch.float32
    assert workspace.nbytes("cpu") == 128
    assert workspace.empty((2, 16), torch.float32, "cpu", "t.a") is b  # a request seen before: its view again
    assert workspace.empty([2, 16], torch.float32, "cpu", "t.a").shape == (2, 16)


def test_another_dtype_or_a_smaller_request_reuses_it_and_a_larger_one_grows_it():
    a = workspace.empty(100, torch.uint8, "cpu", "t.b")
    small = workspace.empty((3, 5), torch.bfloat16, "cpu", "t.b")
    assert small.data_ptr() == a.data_ptr() and small.dtype == torch.bfloat16
    big = workspace.empty(1000, torch.float8_e4m3fn, "cpu", "t.b")
    assert big.numel() == 1000 and workspace.nbytes() == 1008  # rounded up to 16 bytes
    moved = workspace.empty(100, torch.uint8, "cpu", "t.b")  # the grown buffer's view, not the old one's
    assert moved.data_ptr() == big.data_ptr() != a.data_ptr()
    again = workspace.empty(1001, torch.uint8, "cpu", "t.b")  # within the rounding: not grown
    assert again.data_ptr() == big.data_ptr()


def test_names_never_share_memory():
    a = workspace.empty(64, torch.uint8, "cpu", "t.c")
    b = workspace.empty(64, torch.uint8, "cpu", "t.d")
    a.fill_(1)
    b.fill_(2)
    assert a.data_ptr() != b.data_ptr() and int(a.sum()) == 64


def test_no_name_allocates_a_new_tensor_each_time():
    a = workspace.empty(64, torch.uint8, "cpu")
    b = workspace.empty(64, torch.uint8, "cpu", workspace.name(False, "t.e"))
    assert a.data_ptr() != b.data_ptr() and workspace.nbytes() == 0
    assert workspace.name(True, "t.e") == "t.e" and workspace.sub("t.e", "q") == "t.e.q"
    assert workspace.sub(None, "q") is None


def test_graph_capture_allocates(monkeypatch):
    """While a CUDA graph is captured a request allocates (from the graph's pool), never from a buffer."""
    kept = workspace.empty(64, torch.uint8, "cpu", "t.f")
    monkeypatch.setattr(workspace, "_capturing", lambda: True)
    during = workspace.empty(64, torch.uint8, "cpu", "t.f")
    assert during.data_ptr() != kept.data_ptr() and workspace.nbytes() == 64


def test_empty_shapes_and_release():
    z = workspace.empty((0, 7), torch.float32, "cpu", "t.g")
    assert z.shape == (0, 7) and workspace.nbytes() == 16
    workspace.release()
    assert workspace.nbytes() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_and_its_index_are_one_buffer():
    a = workspace.empty(256, torch.uint8, "cuda", "t.h")
    b = workspace.empty(256, torch.uint8, f"cuda:{torch.cuda.current_device()}", "t.h")
    assert a.data_ptr() == b.data_ptr() and a.data_ptr() % 16 == 0
