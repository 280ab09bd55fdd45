"""The accuracy protocol (coat_compare.protocol): its rule and parameters are frozen; Student's t
and the paired statistics are right; the judge reads the power gate blind, shows no mean before
the seeds it fixed are complete, pairs runs as the rule says and leaves out what does not match;
and the tiny protocol runs end to end on a CPU through the packing runner."""

import json
import math
import os
import subprocess
import sys

import pytest

from coat_compare import protocol as P
from coat_compare.presets import get_preset

# Pinned when the protocols were declared, before any of their runs. A test that fails here means
# the rule or a protocol changed: runs already made under it would be judged by a rule chosen after
# seeing them. Do not update these values; declare a new protocol under a new name instead.
FROZEN = {
    "gpt-125m-wsd": "3731706169201d2e801a3b5936b4e53c9070ca18904805e3fda4426f55b8d3e9",
    "gpt-1b-check": "9948e7a92082b7e98893d1a787bed574e79ba1f78d8e814105a3aeb5ddde6193",
    "tiny-wsd": "026d3fcc4d1eaec9e3415fc0f9d1ac4a3a191b2b357d4412a3d5b9492955494b",
}
FROZEN_RULE = "a2c36d3b443efbd59e86d4c63f1bd498355753d887b0a2d7744d2f2b26879969"
WHY = (
    "the accuracy protocol's rule must not change after its runs exist (they would be judged by a rule chosen "
    "after seeing them): revert the change, or declare a new protocol under a new name in coat_compare/protocol.py "
    "and pin it here"
)


def test_the_rule_is_frozen():
    assert (P.REFERENCE, P.DEFAULT_MODE, P.TE_REFERENCE, P.SANITY) == ("bf16", "coat", "te-fp8-delayed", "bf16@run2")
    assert (P.CONFIDENCE, P.INTERVAL, P.SE_TARGET) == (0.95, 0.95, 0.0009), WHY
    assert P.digest(P.rule_constants()) == FROZEN_RULE, WHY


@pytest.mark.parametrize("name", sorted(P.PROTOCOLS))
def test_each_protocol_and_its_preset_are_frozen(name):
    assert name in FROZEN, f"protocol {name} is not pinned: add its digest to FROZEN before any of its runs"
    assert P.protocol_digest(P.PROTOCOLS[name]) == FROZEN[name], WHY


def test_the_125m_protocol_by_value():
    p = P.get_protocol("gpt-125m-wsd")
    assert p.preset == "gpt-125m" and p.graphs == "none"
    assert dict(p.settings) == {
        "--micro-batch": 8,
        "--global-batch": 16,
        "--steps": 1000,
        "--lr": 6e-4,
        "--lr-warmup-steps": 100,
        "--lr-decay": "wsd",
        "--lr-cooldown-steps": 200,
        "--lr-min-ratio": 0.0,
        "--eval-every": 1000,
        "--eval-windows": 1024,
    }
    assert (p.seeds, p.cap, p.power_after, p.branch) == (16, 24, 6, (400, 100))
    assert (p.pass_mean, p.pass_upper, p.fail_lower, p.te_margin) == (0.0025, 0.005, 0.0025, None)
    assert p.keys(1) == ["bf16", "coat", "te-fp8-delayed", "bf16@run2"]
    assert p.keys(8) == ["bf16", "coat", "te-fp8-delayed"] and p.keys(9) == ["bf16", "coat"]
    tokens = 1000 * 16 * get_preset("gpt-125m").seq
    assert tokens >= 16_000_000


def test_the_1b_check_by_value():
    p = P.get_protocol("gpt-1b-check")
    preset = get_preset(p.preset)
    assert preset.layers == 17 and preset.hidden == 2048  # 1.005B parameters
    assert p.setting("--steps") * p.setting("--global-batch") * preset.seq >= 30_000_000
    assert (p.setting("--lr-decay"), p.setting("--lr-min-ratio")) == ("linear", 0.0)
    assert p.keys(6) == ["bf16", "coat", "te-fp8-delayed"] and p.branch is None
    assert (p.pass_upper, p.te_margin, p.fail_lower) == (0.01, 0.0025, None)


# -- Student's t and the paired statistics ------------------------------------------------------------


@pytest.mark.parametrize(
    "p, df, t",
    [(0.95, 1, 6.3138), (0.95, 5, 2.0150), (0.95, 15, 1.7531), (0.975, 3, 3.1824), (0.975, 11, 2.2010),
     (0.975, 23, 2.0687), (0.95, 120, 1.6577), (0.05, 7, -1.8946)],
)  # fmt: skip
def test_student_t_quantiles_match_the_tables(p, df, t):
    assert P.t_quantile(p, df) == pytest.approx(t, abs=2e-4)
    assert P.t_cdf(P.t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)


def test_paired_statistics_by_hand():
    d = {1: 0.001, 2: 0.003, 3: -0.002, 4: 0.004}
    s = P.paired(d)
    mean = sum(d.values()) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in d.values()) / 3)
    assert (s["n"], s["mean"], s["sd"]) == (4, pytest.approx(mean), pytest.approx(sd))
    assert s["se"] == pytest.approx(sd / 2)
    assert s["upper"] == pytest.approx(mean + 2.3534 * sd / 2, abs=1e-7)
    assert s["low"] == pytest.approx(mean - 3.1824 * sd / 2, abs=1e-7)
    assert P.paired({1: 0.01})["se"] is None and P.paired({})["mean"] is None


# -- made-up rows ------------------------------------------------------------------------------------

PROTOCOL = P.get_protocol("gpt-125m-wsd")
DATA = {"corpus_train_sha256": "t", "corpus_valid_sha256": "v", "valid_windows_sha256": "w"}


def row(seed, key, segment, loss, protocol=PROTOCOL, **changes):
    """A finished run of ``protocol``'s ``segment`` with validation loss ``loss`` after its last step."""
    mode, run = P.parse_key(key)
    settings = P.segment_settings(protocol, segment)
    fields = {P.ROW_FIELDS[o]: v for o, v in settings.items()}
    first, last = {
        "trunk": (0, protocol.branch and protocol.branch[0]),
        "main": (protocol.branch and protocol.branch[0], settings["--steps"]),
        "branch": (protocol.branch and protocol.branch[0], settings["--steps"]),
        "full": (0, settings["--steps"]),
    }[segment]
    r = {"kind": "train", "status": "ok", "preset": protocol.preset, "mode": mode, "seed": seed, "data_seed": seed}
    r |= {"graphs": protocol.graphs, "tp": 1, "pp": 1, "dp": 1, "deterministic": False, "data_pool": None}
    r |= {"adam_eps": get_preset(protocol.preset).adam_eps, "first_step": first, "last_step": last, **fields, **DATA}
    r |= {"losses": [5.0] * (last - first), "valid_losses": [] if segment == "trunk" else [[last, loss]]}
    if run > 1:
        r["repeat"] = run
    return {**r, **changes}


def seed_rows(seed, gaps, base=1.0, early_base=1.2, early_gaps=None, protocol=PROTOCOL):
    """Every segment of every key of ``seed``: the reference at ``base`` (``early_base`` at the
    branch), each other key at base x (1 + gap)."""
    rows = []
    for key in protocol.keys(seed):
        gap = 0.0 if key == "bf16" else gaps.get(key, 0.0)
        early = 0.0 if key == "bf16" else (early_gaps or gaps).get(key, 0.0)
        for segment in protocol.segments():
            loss = early_base * (1 + early) if segment == "branch" else base * (1 + gap)
            rows.append(("made-up", row(seed, key, segment, loss, protocol)))
    return rows


def made_up(coat_gaps, te=0.0, run2=0.0, **kw):
    rows = []
    for seed, g in enumerate(coat_gaps, start=1):
        rows += seed_rows(seed, {"coat": g, "te-fp8-delayed": te, "bf16@run2": run2}, **kw)
    return rows


def test_the_gate_is_blind_and_no_mean_shows_before_the_seeds_are_complete():
    # seeds 1-6 only, with a large mean: the gate prints their sd, and no mean of any arm
    gaps = [0.05 + 0.001 * i for i in range(6)]
    result, lines = P.judge(PROTOCOL, made_up(gaps))
    text = "\n".join(lines)
    gate = result["power"]
    assert gate["ready"] and gate["sd"] == pytest.approx(0.001 * math.sqrt(3.5), rel=1e-6)
    assert gate["n"] == 16 and not gate["underpowered"]
    assert result["verdict"] is None
    assert "Not complete: seeds 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 of 1..16" in text
    assert "5.0" not in text and "+5." not in text and "mean +" not in text  # no mean, no loss


def test_a_noisy_first_block_raises_the_seeds_and_past_the_cap_is_underpowered():
    noisy = [0.004, -0.004, 0.003, -0.003, 0.0, 0.0]  # sd 0.0033: (0.0033 / 0.0009)^2 = 13.4 -> 16 still
    assert P.judge(PROTOCOL, made_up(noisy))[0]["power"]["n"] == 16
    noisier = [0.006, -0.006, 0.005, -0.005, 0.0, 0.0]  # sd 0.00494: wants 31 -> the cap, underpowered
    gate = P.judge(PROTOCOL, made_up(noisier))[0]["power"]
    assert (gate["wanted"], gate["n"], gate["underpowered"]) == (31, 24, True)
    middle = [0.0042, -0.0042, 0.0042, -0.0042, 0.0, 0.0]  # sd 0.00376: wants 18
    assert P.judge(PROTOCOL, made_up(middle))[0]["power"]["n"] == 18


def alternating(mean, spread, n=16):
    return [mean + (spread if i % 2 else -spread) for i in range(n)]


@pytest.mark.parametrize(
    "gaps, expected",
    [
        (alternating(0.001, 0.002), "pass"),  # mean 0.1%, upper 0.19%
        (alternating(0.0026, 0.0001), "fail"),  # lower bound 0.256% > 0.25%
        (alternating(0.0026, 0.002), "inconclusive"),  # mean above 0.25%, lower bound below it
        (alternating(0.002, 0.008), "inconclusive"),  # mean 0.2%, upper 0.56% > 0.5%
    ],
)
def test_the_verdict_on_sixteen_seeds(gaps, expected):
    assert P.verdict(PROTOCOL, P.paired(dict(enumerate(gaps, start=1)))) == expected
    result, lines = P.judge(PROTOCOL, made_up(gaps))
    if result["power"]["n"] > len(gaps):  # the spread of seeds 1-6 asked for more seeds than were run
        assert result["verdict"] is None and "Not complete: seeds 17" in "\n".join(lines)
        return
    assert result["verdict"]["verdict"] == expected
    assert f"**Verdict: {expected}**" in "\n".join(lines)


def test_the_reported_comparisons_the_sanity_arm_and_the_branch():
    gaps = alternating(0.001, 0.002)
    rows = made_up(gaps, te=0.0005, run2=0.0, early_gaps={"coat": 0.003, "te-fp8-delayed": 0.0, "bf16@run2": 0.0})
    result, lines = P.judge(PROTOCOL, rows)
    v = result["verdict"]
    assert v["te"]["n"] == 8 and v["te"]["mean"] == pytest.approx(0.0005)
    assert v["coat_minus_te"]["n"] == 8
    assert v["sanity"]["n"] == 4 and v["sanity"]["mean"] == pytest.approx(0.0)
    assert v["branch"]["mean"] == pytest.approx(0.003)
    assert v["growth"]["mean"] == pytest.approx(0.001 - 0.003)
    g = math.log(1.2 / 1.0) / math.log(1000 / 500)
    assert v["epsilon"]["d"][2] == pytest.approx(gaps[1] / g)
    assert "| 1 | 1.0000 / 1.2000 |" in "\n".join(lines)


def test_a_biased_sanity_arm_is_said():
    rows = made_up(alternating(0.001, 0.002), run2=0.01)
    rows = [(w, {**r, "valid_losses": [[r["last_step"], r["valid_losses"][0][1] * (1 + 0.001 * r["seed"])]]})
            if r["mode"] == "bf16" and r.get("repeat") and r["valid_losses"] else (w, r) for w, r in rows]  # fmt: skip
    _, lines = P.judge(PROTOCOL, rows)
    assert "interval excludes zero" in "\n".join(lines)


def test_rows_that_do_not_match_are_named_and_left_out():
    rows = made_up(alternating(0.001, 0.002))
    bad = [
        row(3, "coat", "main", 1.0, lr=3e-4),
        row(4, "coat", "main", 1.0, data_seed=1004),
        row(5, "coat", "main", 1.0, status="failed", reason="boom"),
        row(6, "coat", "branch", 1.0, lr_cooldown_steps=200),
        row(25, "coat", "main", 1.0),
        row(9, "te-fp8-delayed", "main", 1.0),
    ]
    _, notes = P.collect(PROTOCOL, rows + [("bad", r) for r in bad])
    text = "\n".join(notes)
    for why in ("lr 0.0003", "data_seed 1004", "status failed (boom)", "lr_cooldown_steps 200, the protocol's 100",
                "seed 25 is outside", "te-fp8-delayed is not a run of seed 9"):  # fmt: skip
        assert why in text
    # a run made twice counts for neither: the judge does not pick
    twice = rows + [("again", row(2, "coat", "main", 0.9))]
    runs, notes = P.collect(PROTOCOL, twice)
    assert "main" not in runs[2]["coat"] and "has 2 rows" in "\n".join(notes)


def test_runs_on_another_corpus_are_refused():
    rows = made_up([0.0] * 6)
    rows.append(("other", row(7, "bf16", "main", 1.0, corpus_valid_sha256="x")))
    with pytest.raises(ValueError, match="different corpora"):
        P.collect(PROTOCOL, rows)


def test_the_flags_of_each_segment_are_coat_compare_options():
    from coat_compare.cli import parse_args

    for segment in PROTOCOL.segments():
        argv = P.flags(PROTOCOL, 3, "bf16@run2", segment, "/tmp/ckpt")
        assert "--repeat" in argv and argv[argv.index("--seed") + 1] == "3"
        if segment == "branch":
            assert argv[argv.index("--steps") + 1] == "500" and argv[argv.index("--lr-cooldown-steps") + 1] == "100"
        if segment == "trunk":
            assert argv[-5:] == ["--save", "/tmp/ckpt", "--save-step", "400", "--stop-after-save"]
    # every option is coat-compare's (parse_args ends the process on a bad one; --load needs a real checkpoint,
    # which the tiny run below loads)
    parse_args([*P.flags(P.get_protocol("tiny-wsd"), 1, "coat", "trunk", "/tmp/ckpt"), "--out", "/tmp/x"])
    parse_args([*P.flags(P.get_protocol("gpt-1b-check"), 1, "te-fp8-delayed", "full"), "--out", "/tmp/x"])
    with pytest.raises(ValueError, match="checkpoint"):
        P.flags(PROTOCOL, 1, "coat", "main")


def test_keep_appends_rows_once_from_reports_folders_and_packs(tmp_path):
    import tarfile

    report = tmp_path / "runs" / "seed1" / "a.jsonl"
    report.parent.mkdir(parents=True)
    rows = [row(1, "bf16", "main", 1.0, step_ms_per_step=[1.0] * 5), row(1, "coat", "main", 1.01)]
    report.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "runs" / "seed1" / "b.partial.jsonl").write_text(json.dumps(row(1, "coat", "branch", 1.0)) + "\n")
    pack = tmp_path / "pack.tgz"
    with tarfile.open(pack, "w:gz") as t:
        t.add(report, arcname="seed1/a.jsonl")
    into = tmp_path / "rows.jsonl"
    assert len(P.keep([str(tmp_path / "runs"), str(pack), str(report)], str(into))) == 2
    assert P.keep([str(pack)], str(into)) == []
    kept = [json.loads(line) for line in into.read_text().splitlines()]
    assert all("step_ms_per_step" not in r for r in kept)
    assert len(P.read_rows([str(into)])) == 2
    with pytest.raises(ValueError, match="does not exist"):
        P.keep([str(tmp_path / "nowhere")], str(into))


# -- the tiny protocol on a CPU, through the packing runner ------------------------------------------


def test_the_tiny_protocol_runs_packed_and_is_judged_on_a_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "coat_compare.protocol"]
    state = tmp_path / "state"
    done = subprocess.run(
        [
            *command,
            "run",
            "tiny-wsd",
            "--state",
            str(state),
            "--seeds",
            "1",
            "--per-device",
            "2",
            "--guess-step-s",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "made 9, failed 0" in done.stdout  # bf16, coat, bf16@run2: trunk, branch, main each
    assert not os.listdir(state / "checkpoints")  # each checkpoint went once both of its loads were made
    runs, notes = P.collect(P.get_protocol("tiny-wsd"), P.read_rows(str(state)))
    assert not notes and set(runs[1]) == {"bf16", "coat", "bf16@run2"}
    bf16 = runs[1]["bf16"]
    # the main run goes on from the trunk's step: its losses follow the trunk's, on the same schedule
    assert (bf16["trunk"]["last_step"], bf16["main"]["first_step"], bf16["branch"]["first_step"]) == (6, 6, 6)
    assert bf16["main"]["valid_losses"][-1][0] == 12 and bf16["branch"]["valid_losses"][-1][0] == 9
    # on a CPU a repeat is the same run bit for bit, from the same checkpoint format
    assert runs[1]["bf16@run2"]["main"]["valid_losses"] == bf16["main"]["valid_losses"]
    # a second command has nothing left to make
    again = subprocess.run(
        [*command, "run", "tiny-wsd", "--state", str(state), "--seeds", "1"], capture_output=True, text=True, env=env
    )
    assert again.returncode == 0 and "0 run(s) to make" in again.stdout
    gate = subprocess.run([*command, "power", "tiny-wsd", str(state)], capture_output=True, text=True, env=env)
    assert gate.returncode == 0 and "not ready: 1 of seeds 1..2 complete" in gate.stdout
