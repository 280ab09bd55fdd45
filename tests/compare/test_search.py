"""The micro-batch search (doubling, then bisection) against fake ``fits`` functions, and the
command a try runs."""

import sys

import pytest

from coat_compare.probe import probe_command, why_it_died
from coat_compare.search import Try, largest_micro_batch


def fits_up_to(threshold: int, calls: list):
    def fits(n: int) -> Try:
        calls.append(n)
        return Try(n, n <= threshold, "" if n <= threshold else "OOM", {"tokens_per_s": 100.0 * n})

    return fits


@pytest.mark.parametrize("threshold", [1, 2, 3, 5, 7, 8, 9, 31, 64, 100, 1000])
def test_finds_the_largest_that_fits_in_logarithmic_tries(threshold):
    calls = []
    result = largest_micro_batch(fits_up_to(threshold, calls))
    assert result.largest == threshold and result.smallest_failure == threshold + 1 and result.exact
    # doubling past the threshold, then bisecting the last octave
    doublings = threshold.bit_length() + 1
    assert len(calls) <= 2 * doublings, calls
    assert calls[:doublings] == [2**i for i in range(doublings)]
    assert len(set(calls)) == len(calls)  # no micro-batch tried twice
    assert result.best().result["tokens_per_s"] == 100.0 * threshold


def test_nothing_fits():
    calls = []
    result = largest_micro_batch(fits_up_to(0, calls))
    assert (result.largest, result.smallest_failure, calls, result.best()) == (0, 1, [1], None)


def test_start_above_one_and_a_start_that_does_not_fit():
    calls = []
    assert largest_micro_batch(fits_up_to(13, calls), start=4).largest == 13
    assert calls[:3] == [4, 8, 16]
    calls = []
    result = largest_micro_batch(fits_up_to(3, calls), start=4)
    assert (result.largest, calls) == (0, [4])  # below start is not searched
    with pytest.raises(ValueError, match=">= 1"):
        largest_micro_batch(fits_up_to(3, []), start=0)


def test_limit_stops_the_doubling_and_says_so():
    calls = []
    result = largest_micro_batch(fits_up_to(1000, calls), limit=12)
    assert calls == [1, 2, 4, 8, 12]
    assert result.largest == 12 and result.smallest_failure is None
    assert "limit of micro-batch 12" in result.stopped
    calls = []
    result = largest_micro_batch(fits_up_to(10, calls), limit=12)
    assert result.largest == 10 and result.exact  # the failure at 12 came before the limit mattered


def test_time_limit_keeps_what_is_known():
    now = [0.0]

    def fits(n):
        now[0] += 10.0  # each try takes 10 s
        return Try(n, n <= 40)

    result = largest_micro_batch(fits, time_limit_s=45, clock=lambda: now[0])
    assert [t.micro_batch for t in result.tries] == [1, 2, 4, 8, 16]
    assert (result.largest, result.smallest_failure) == (16, None)
    assert "time limit of 45 s" in result.stopped and not result.exact


def test_a_try_runs_this_job_in_a_fresh_process():
    single = probe_command(["--preset", "tiny", "--modes", "coat", "--micro-batch", "8"], world_size=1)
    assert single == [
        sys.executable,
        "-m",
        "coat_compare",
        "--preset",
        "tiny",
        "--modes",
        "coat",
        "--micro-batch",
        "8",
        "--probe",
    ]
    multi = probe_command(["--tp", "2", "--micro-batch", "4"], world_size=2)
    assert multi[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert multi[5:] == ["-m", "coat_compare", "--tp", "2", "--micro-batch", "4", "--probe"]


def test_a_dead_run_is_reported_by_the_line_that_says_why():
    python = (
        'Traceback (most recent call last):\n  File "x.py", line 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried\n'
    )
    assert why_it_died(python) == "torch.OutOfMemoryError: CUDA out of memory. Tried"
    abort = (
        "terminate called after throwing an instance of 'c10::Error'\n  what():  CUDA error: operation not permitted\n"
        "Exception raised from c10_cuda_check_implementation at /c.cpp:43 (most recent call first):\n"
        "frame #0: <unknown function> + 0x12 (0x7f in /lib/libc.so.6)\n"
    )
    assert why_it_died(abort) == "what():  CUDA error: operation not permitted"  # not the stack's last frame
    assert why_it_died("step 1\nKilled\n") == "Killed"
    assert why_it_died("") == "no output"
