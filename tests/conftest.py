"""Test set-up: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when it
decorates), so this runs first. The interpreter's float casts are then replaced with exact ones.
"""

import os
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# One intra-op thread per test process: `pytest -n 3` on two cores otherwise oversubscribes them, and
# OpenMP's spinning barriers make small CPU ops 10-100x slower. (Three workers on two cores: many tests
# wait on the processes they start, on rendezvous and on deliberate stalls; a third worker fills those
# waits: with two, CI's tests took 1236-1264 s of wall for 30 min of CPU. Those runs had pytest 9.2, whose
# xdist groups did not hold (tests/test_xdist_groups.py); with them held, -n 3 and -n 4 took 1178 and 1163 s
# here, 2026-11-29: the host's CPU is the bound.)
torch.set_num_threads(1)
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # megatron-core wraps its fused kernels in torch.compile when it is imported, which loads
    # TorchDynamo's backends and Inductor: about 1.4 s of CPU in every Megatron process the tests
    # start (inherited by the subprocesses). A CPU run never calls those kernels
    # (coat_patches.training_cpu skips their warm-up); with this, torch.compile hands them back as
    # they are. GPU test runs keep it.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    # the processes the tests start (launchers, torchrun ranks, gloo workers): one intra-op thread
    # each too, as above (torchrun sets this only for more than one process per node)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from triton_interpreter import install

    install()


def pytest_collection_modifyitems(config, items):
    fp8_gpu = HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)
    skip = pytest.mark.skip(reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)")
    for item in items:
        if "gpu" in item.keywords and not fp8_gpu:
            item.add_marker(skip)


@pytest.fixture
def seed(request):
    """A seed fixed per test (a hash of its id, parameters included), so that every run, CI's too,
    draws the same inputs and a failure replays as it is. COAT_TEST_SEED=N pins another;
    COAT_TEST_SEED=random draws a fresh one per test, to explore (printed, for replay)."""
    pinned = os.environ.get("COAT_TEST_SEED", "")
    if pinned == "random":
        s = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    elif pinned:
        s = int(pinned)
    else:
        s = zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
    print(f"seed={s}")
    return s
