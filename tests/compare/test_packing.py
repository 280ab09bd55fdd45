"""The packing runner's plan across sessions: what earlier rows and the state on the machine make
unnecessary, and what must be made again (a trunk whose checkpoint went back with its machine)."""

import os

from test_protocol import PROTOCOL, row

from coat_compare.protocol import runner as packing


def places(jobs):
    return [(j.seed, j.key, j.segment) for j in jobs]


def test_a_trunk_made_in_two_sessions_is_made_and_its_checkpoint_is_used(tmp_path):
    # session 1 made seed 1's bf16 trunk and branch; session 2 made the trunk again (its checkpoint had
    # gone with the machine) and saved it; main still runs from that checkpoint, and no third trunk
    earlier = [("a", row(1, "bf16", "trunk", 0.0)), ("a", row(1, "bf16", "branch", 1.1))]
    state = [("b", row(1, "bf16", "trunk", 0.0))]
    made = packing.made_runs(PROTOCOL, earlier + state)
    assert {(1, "bf16", "trunk"), (1, "bf16", "branch")} <= made
    os.makedirs(packing.checkpoint_dir(str(tmp_path), 1, "bf16"))
    jobs = [j for j in packing.plan(PROTOCOL, str(tmp_path), [1], [0], made) if j.key == "bf16"]
    assert places(jobs) == [(1, "bf16", "main")] and jobs[0].needs is None


def test_a_made_trunk_without_its_checkpoint_is_made_once_more_for_what_loads_it(tmp_path):
    made = packing.made_runs(PROTOCOL, [("a", row(1, "coat", "trunk", 0.0)), ("a", row(1, "coat", "main", 1.0))])
    jobs = [j for j in packing.plan(PROTOCOL, str(tmp_path), [1], [0], made) if j.key == "coat"]
    assert places(jobs) == [(1, "coat", "trunk"), (1, "coat", "branch")]
    assert jobs[1].needs == jobs[0].name


def test_failed_and_foreign_rows_are_not_made():
    rows = [
        ("a", row(1, "bf16", "trunk", 0.0, status="failed")),
        ("a", row(1, "bf16", "main", 1.0, preset="gpt-1b")),
        ("a", row(PROTOCOL.cap + 1, "bf16", "main", 1.0)),
    ]
    assert packing.made_runs(PROTOCOL, rows) == set()
