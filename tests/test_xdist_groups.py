"""The xdist groups hold: tests marked with one ``xdist_group`` run on one worker, so that a session
fixture they share (``tests/compare/test_job.py``'s ``tiny``, ``tests/compare/test_two_processes.py``'s
``dp_runs``, the layer counts of ``tests/megatron/test_layer_launches.py``) is made once, not once per
worker.

With pytest 9.2 and pytest-xdist 3.8, ``--dist loadgroup`` stopped grouping without a word (pytest-xdist
issue 1386): each of those fixtures then ran on every worker, several minutes of CI's CPU. pyproject.toml
pins pytest below 9.2; this test fails if grouping breaks again. Each case records the worker it ran on in
a file shared by the session's workers, and checks that every case so far ran on the same one: four
cases that the scheduler, grouping nothing, hands out round-robin land on more than one worker.
"""

import os

import pytest

CASES = 4


@pytest.mark.xdist_group("guard")
@pytest.mark.parametrize("case", range(CASES))
def test_the_cases_of_one_xdist_group_run_on_one_worker(case, tmp_path_factory):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        pytest.skip("not run by pytest-xdist")
    record = tmp_path_factory.getbasetemp().parent / "xdist-group-guard"  # the session's, all workers'
    with open(record, "a") as f:
        f.write(f"{worker}\n")
    workers = set(record.read_text().split())
    assert workers == {worker}, (
        f"the cases of one xdist_group ran on workers {sorted(workers)}: --dist loadgroup does not group "
        "with these pytest and pytest-xdist versions (pytest-xdist issue 1386; pyproject.toml pins pytest)"
    )
