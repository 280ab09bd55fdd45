"""The gloo harness itself: failures, deaths and hangs come back to the test as errors."""

import os
import time

import psutil
import pytest
import torch.distributed as dist
from distributed import RankFailed, run_distributed


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits for rank 1, which has gone
    return "unreachable"


def test_first_failure_is_reraised_with_its_rank_traceback():
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        run_distributed(_raise_on_rank_1, 2, timeout=60)
    assert any("rank 1 of 2 failed first" in note for note in info.value.__notes__)
    cause = str(info.value.__cause__)
    assert "traceback of rank 1" in cause and "_raise_on_rank_1" in cause


def _die_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def test_a_rank_that_dies_silently_is_reported():
    with pytest.raises(RankFailed, match="rank 1 of 2 failed first: exited with code 3"):
        run_distributed(_die_on_rank_1, 2, timeout=60)


def _rank_and_size():
    return dist.get_rank(), dist.get_world_size()


def _hang_on_rank_1(pid_dir):
    (pid_dir / f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def test_hung_collective_times_out_and_the_ranks_are_killed(tmp_path):
    # A first run starts the fork server, so that the timeout below covers the hang only.
    assert run_distributed(_rank_and_size, 2) == [(0, 2), (1, 2)]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish"):
        run_distributed(_hang_on_rank_1, 2, args=(tmp_path,), timeout=8)
    assert time.monotonic() - start < 8 + 15
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
