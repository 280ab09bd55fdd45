"""The accuracy protocol (coat_compare.protocol): its rule and parameters are frozen, its judge
shows the noise floor before any verdict and pairs runs as the rule says, on made-up reports; and
the tiny protocol runs end to end on a CPU."""

import json
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
    "gpt-1b-accuracy": "9748896c91cdfaade851cff276e656350ec8ff56baa122ef4179492b76365faa",
    "tiny-accuracy": "cec14e4a450003b168b55545735ed1aaecd3d6020be34fa50ff284a69bfd5863",
    # declared after gpt-1b-accuracy's floor was missed, before any run of theirs
    "gpt-1b-accuracy-lr1e-4": "729992e8305b1a0c444cd650ae484cad68152c909c35c80f31e6a4aac7d5e83c",
    "gpt-1b-accuracy-lr5e-5": "dcfeeb8f5d33027f2ae7c54955ddf6a732d31c846adb56b7fc7c981f7e53aa33",
    "gpt-1b-bytes-accuracy": "3f60c929d17f7c22f18a426061ad9a546f4557cfe3f7c2360df4c3bad1e895f9",
}
FROZEN_RULE = "f8fafbabd09091e056583541132aac41c214ce70c0a1841ec7167ca4f02a8a33"
WHY = (
    "the accuracy protocol's rule must not change after its runs exist (they would be judged by a rule chosen "
    "after seeing them): revert the change, or declare a new protocol under a new name in coat_compare/protocol.py "
    "and pin it here"
)


def test_the_rule_is_frozen():
    assert (P.FLOOR_RMS, P.FLOOR_MIN_PAIRS, P.FLOOR_KINDS) == (0.0015, 4, ("bf16@run2", "bf16@data2")), WHY
    assert (P.GOAL_MEAN, P.GOAL_UPPER, P.GOAL_MIN_SEEDS, P.GOAL_MIN_PARAMS, P.TE_MARGIN) == (
        0.0025,
        0.005,
        6,
        1_000_000_000,
        0.001,
    ), WHY
    assert (P.DEFAULT_MODE, P.TE_REFERENCE, P.REFERENCE, P.DATA_ORDER_STRIDE) == (
        "coat",
        "te-fp8-delayed",
        "bf16",
        1000,
    ), WHY
    assert P.digest(P.rule_constants()) == FROZEN_RULE, WHY


@pytest.mark.parametrize("name", sorted(P.PROTOCOLS))
def test_each_protocol_and_its_preset_are_frozen(name):
    assert name in FROZEN, f"protocol {name} is not pinned: add its digest to FROZEN before any of its runs"
    assert P.protocol_digest(P.PROTOCOLS[name]) == FROZEN[name], WHY


def test_the_gpt_1b_protocol_by_value():
    p, preset = P.get_protocol("gpt-1b-accuracy"), get_preset("gpt-1b-accuracy")
    assert dict(p.settings) == {
        "--steps": 96,
        "--micro-batch": 4,
        "--global-batch": 128,
        "--lr": 3e-4,
        "--lr-warmup-steps": 24,
        "--lr-decay": "linear",
        "--eval-every": 24,
        "--eval-windows": 768,
    }
    assert (p.graphs, p.seeds, p.floor_seeds, p.metric_last) == ("local", (1, 2, 3, 4, 5, 6), (1, 2, 3, 4), 1)
    assert p.modes == ("coat", "coat-fp32-grads", "coat@eps1e-05", "te-fp8-delayed")
    assert (preset.layers, preset.hidden, preset.ffn, preset.heads, preset.vocab, preset.seq) == (
        17,
        2048,
        5632,
        16,
        32000,
        2048,
    )
    assert (preset.lr_min_ratio, preset.adam_eps, preset.corpus) == (0.0, 1e-8, "packages")
    # the preset's own values are the ones the protocol passes: a run without the flags trains the same
    assert all(getattr(preset, P.ROW_FIELDS[o]) == v for o, v in p.settings), p.settings
    # >= 0.25M tokens per step; 17 layers of 51,384,320 and two 32000-row tables: over 1B parameters
    assert 128 * 2048 >= 250_000
    assert 17 * 51_384_320 + 2 * 32000 * 2048 + 2048 >= P.GOAL_MIN_PARAMS


def test_the_screen_and_its_candidates_are_frozen():
    assert P.SCREEN_CANDIDATES == ("gpt-1b-accuracy-lr1e-4", "gpt-1b-accuracy-lr5e-5", "gpt-1b-bytes-accuracy"), WHY
    assert (P.SCREEN_SEEDS, P.SCREEN_KIND, P.SCREEN_BOUND) == ((1, 2), "bf16@data2", 0.003), WHY
    assert P.PART_SE == 2, WHY  # where the loss goes: a variant is lower when mean + 2 se of its difference < 0
    base = dict(P.get_protocol("gpt-1b-accuracy").settings)
    for name, preset, lr in [
        ("gpt-1b-accuracy-lr1e-4", "gpt-1b-accuracy-pool", 1e-4),
        ("gpt-1b-accuracy-lr5e-5", "gpt-1b-accuracy-pool", 5e-5),
        ("gpt-1b-bytes-accuracy", "gpt-1b-bytes-accuracy", 1e-4),
    ]:
        p = P.get_protocol(name)
        assert p.preset == preset and dict(p.settings) == {**base, "--lr": lr}, name  # only the rate differs
        assert (p.graphs, p.seeds, p.floor_seeds, p.modes, p.metric_last) == (
            "local",
            (1, 2, 3, 4, 5, 6),
            (1, 2, 3, 4),
            ("coat", "coat-fp32-grads", "coat@eps1e-05", "te-fp8-delayed"),
            1,
        )
    pool, byte = get_preset("gpt-1b-accuracy-pool"), get_preset("gpt-1b-bytes-accuracy")
    assert pool.data_pool == byte.data_pool == 96 * 128  # one pass over the pool: each window once
    assert (pool.layers, pool.vocab, byte.layers, byte.vocab) == (17, 32000, 20, 256)
    assert (pool.lr_min_ratio, byte.lr_min_ratio, get_preset("gpt-1b-accuracy").data_pool) == (0.0, 0.0, None)
    # 20 layers of 51,384,320 (their norms included) and two 256-row tables: over 1B parameters
    assert 20 * 51_384_320 + 2 * 256 * 2048 + 2048 == 1_028_737_024 >= P.GOAL_MIN_PARAMS


# -- the judge on made-up reports ------------------------------------------------------------------

PROTOCOL = P.get_protocol("gpt-1b-accuracy")
PARAMS = 1_004_607_488


def row(mode, seed, valid, *, order=1, repeat=None, eps=1e-8, **changes):
    """A finished train row of the gpt-1b protocol, as coat-compare writes it."""
    fields = {P.ROW_FIELDS[o]: v for o, v in PROTOCOL.settings}
    out = {
        "kind": "train",
        "status": "ok",
        "preset": "gpt-1b-accuracy",
        "mode": mode,
        "seed": seed,
        "data_seed": seed + 1000 * (order - 1),
        **fields,
        "lr_min_ratio": 0.0,
        "adam_eps": eps,
        "graphs": "local",
        "tp": 1,
        "pp": 1,
        "dp": 1,
        "deterministic": False,
        "first_step": 0,
        "params": PARAMS,
        "losses": [1.0] * 96,
        "valid_losses": [[24, 2.0], [48, 1.5], [72, 1.2], [96, valid]],
        "corpus_train_sha256": "a",
        "corpus_valid_sha256": "b",
        "valid_windows_sha256": "c",
    }
    if repeat is not None:
        out["repeat"] = repeat
    return {**out, **changes}


def write(directory, rows, name="runs"):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{name}.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def floor_rows(run_gap=0.001, data_gap=-0.001, seeds=(1, 2, 3, 4)):
    rows = []
    for s in seeds:
        rows += [row("bf16", s, 1.0), row("bf16", s, 1.0 + run_gap, repeat=2), row("bf16", s, 1.0 + data_gap, order=2)]
    return rows


def mode_rows(mode, gaps, eps=1e-8):
    return [row(mode, s, 1.0 + g, eps=eps) for s, g in gaps.items()]


def judged(tmp_path, rows):
    write(tmp_path / "seed1", rows)  # one file or many: the judge reads every report under the folder
    return P.judge(PROTOCOL, str(tmp_path))


SIX = {1: 0.001, 2: 0.002, 3: -0.001, 4: 0.0, 5: 0.003, 6: 0.001}  # mean 0.1%, se 0.06%


def test_floor_met_then_the_verdict_and_the_goals(tmp_path):
    rows = floor_rows() + [row("bf16", s, 1.0) for s in (5, 6)]
    rows += mode_rows("coat", SIX) + mode_rows("te-fp8-delayed", {s: 0.0005 for s in SIX})
    rows += mode_rows("coat", {s: 0.004 for s in SIX}, eps=1e-5)
    result, lines = judged(tmp_path, rows)
    text = "\n".join(lines)
    assert result["floor"]["shown"] is True
    assert "floor bf16@run2: 4 pair(s), rms 0.100%: met" in text
    v = result["verdict"]
    coat = v["modes"]["coat"]
    assert coat["seeds"] == 6 and coat["mean"] == pytest.approx(0.001) and coat["upper"] < P.GOAL_UPPER
    assert v["modes"]["coat@eps1e-05"]["mean"] == pytest.approx(0.004)
    assert v["modes"]["coat-fp32-grads"]["seeds"] == 0
    assert [g["met"] for g in v["goals"]] == [True, True]  # coat +0.1% against TE's +0.05% + 0.1%
    assert "| coat | +0.100% | +0.200% | -0.100% |" in text
    part = v["against_default"]
    assert set(part) == {"coat-fp32-grads", "coat@eps1e-05"}  # TE is no variant of the default
    assert part["coat@eps1e-05"]["mean"] == pytest.approx(0.003) and part["coat@eps1e-05"]["lower"] is False
    assert part["coat-fp32-grads"]["seeds"] == 0 and part["coat-fp32-grads"]["lower"] is None
    assert "| coat-fp32-grads | 0 | - | - | - | not judged |" in text and "| coat@eps1e-05 | 6 | +0.300% |" in text


def test_a_variant_lower_than_the_default_names_the_part(tmp_path):
    rows = floor_rows() + [row("bf16", s, 1.0) for s in (5, 6)] + mode_rows("coat", SIX)
    wobble = {1: 0.0002, 2: -0.0001, 3: 0.0001, 4: -0.0002, 5: 0.0, 6: 0.0001}
    rows += mode_rows("coat-fp32-grads", {s: g - 0.002 + wobble[s] for s, g in SIX.items()})
    rows += mode_rows("coat", {s: g + 0.001 for s, g in SIX.items() if s <= 5}, eps=1e-5)  # five seeds: not judged
    result, lines = judged(tmp_path, rows)
    part = result["verdict"]["against_default"]
    assert part["coat-fp32-grads"]["lower"] is True and part["coat-fp32-grads"]["mean"] == pytest.approx(
        -0.002, abs=1e-4
    )
    assert part["coat@eps1e-05"]["seeds"] == 5 and part["coat@eps1e-05"]["lower"] is None
    assert "| coat-fp32-grads | 6 | -0.198% |" in "\n".join(lines) and "| **yes** |" in "\n".join(lines)


def test_the_goals_missed_by_the_mean_and_by_the_spread(tmp_path):
    rows = floor_rows() + [row("bf16", s, 1.0) for s in (5, 6)]
    spread = {1: 0.02, 2: -0.02, 3: 0.02, 4: -0.02, 5: 0.02, 6: -0.018}  # mean 0.03%, se 0.8%
    rows += mode_rows("coat", spread) + mode_rows("te-fp8-delayed", {s: -0.01 for s in SIX})
    result, lines = judged(tmp_path, rows)
    first, te = result["verdict"]["goals"]
    assert first["met"] is False and first["note"].startswith("mean + 2 se +1.") and ";" not in first["note"]
    assert te["met"] is False and "coat +0.033% against te-fp8-delayed -1.000% + 0.10%" in te["note"]
    (tmp_path / "seed1" / "runs.jsonl").unlink()
    result, _ = judged(
        tmp_path, floor_rows() + [row("bf16", s, 1.0) for s in (5, 6)] + mode_rows("coat", {s: 0.004 for s in SIX})
    )
    assert result["verdict"]["goals"][0]["met"] is False
    assert result["verdict"]["goals"][0]["note"].startswith("mean +0.400% above 0.25%")
    assert result["verdict"]["goals"][1]["met"] is None  # no TE runs


def test_floor_missed_no_verdict_and_no_gaps_shown(tmp_path):
    rows = floor_rows(data_gap=0.003) + mode_rows("coat", {s: 0.0 for s in (1, 2, 3, 4)})
    result, lines = judged(tmp_path, rows)
    text = "\n".join(lines)
    assert result["floor"]["shown"] is False and result["verdict"] is None
    assert "floor bf16@data2: 4 pair(s), rms 0.300%: MISSED" in text
    assert "Floor missed" in text and "the gaps of the 4 run(s) of other modes are not shown" in text
    assert "| coat |" not in text


def test_too_few_floor_pairs_is_no_floor(tmp_path):
    rows = floor_rows(seeds=(1, 2, 3)) + [row("bf16", 4, 1.0), row("bf16", 4, 1.0, repeat=2)]
    result, lines = judged(tmp_path, rows)
    kinds = result["floor"]["kinds"]
    assert (kinds["bf16@run2"]["met"], kinds["bf16@data2"]["pairs"], kinds["bf16@data2"]["met"]) == (True, 3, None)
    assert result["floor"]["shown"] is None and result["verdict"] is None
    assert "Floor not shown: each kind needs 4 pairs or more" in "\n".join(lines)


def test_too_few_seeds_and_too_small_a_model_are_not_judged(tmp_path):
    rows = floor_rows() + mode_rows("coat", {s: 0.0 for s in (1, 2, 3, 4)})
    rows += mode_rows("te-fp8-delayed", {s: 0.0 for s in (1, 2, 3, 4)})
    result, _ = judged(tmp_path, rows)
    goals = result["verdict"]["goals"]
    assert [g["met"] for g in goals] == [None, None]
    assert goals[0]["note"] == "4 paired seed(s) of coat; the goal needs 6"
    assert goals[1]["note"] == "4 seed(s) with both; the goal needs 6"
    (tmp_path / "seed1" / "runs.jsonl").unlink()
    small = [dict(r, params=953_223_168) for r in floor_rows() + [row("bf16", s, 1.0) for s in (5, 6)]]
    result, _ = judged(tmp_path, small + [dict(r, params=953_223_168) for r in mode_rows("coat", SIX)])
    assert result["verdict"]["goals"][0]["met"] is None
    assert "953,223,168 parameters" in result["verdict"]["goals"][0]["note"]


def test_pairing_mismatches_are_left_out_and_named(tmp_path):
    rows = floor_rows()
    rows += [row("coat", 5, 1.0)]  # no BF16 at seed 5: unpaired
    rows += [row("coat", 1, 1.0), row("coat", 1, 1.01)]  # two rows of one run: which counts is not the judge's pick
    rows += [row("coat", 2, 1.0, steps=95, losses=[1.0] * 95)]  # another protocol's run
    rows += [row("coat", 3, 1.0, lr_min_ratio=0.1)]  # another schedule
    rows += [row("coat", 9, 1.0)]  # an undeclared seed
    rows += [row("coat", 4, 1.0, data_seed=1500)]  # a data seed no data order of its seed
    rows += [row("coat", 4, 1.0, status="failed", reason="boom")]
    rows += [row("coat", 2, 1.0, dp=2)]  # another layout
    runs, notes = P.collect(PROTOCOL, [("f", r) for r in rows])
    text = "\n".join(notes)
    assert "seed 1 coat has 2 rows" in text and "coat" not in runs[1]
    assert "steps 95, the protocol's 96" in text and "lr_min_ratio 0.1, the protocol's 0.0" in text
    assert "seed 9 is not declared" in text and "data seed 1500 is no data order of seed 4" in text
    assert "status failed (boom)" in text and "dp 2, the protocol's 1" in text
    assert P.gaps_of(PROTOCOL, runs, "coat", PROTOCOL.seeds) == {}  # seed 5's COAT has no BF16
    old = row("bf16", 1, 1.0)
    del old["lr_min_ratio"]  # written before the field: the former default 0.1
    assert P.mismatch(PROTOCOL, old) == "lr_min_ratio 0.1, the protocol's 0.0"


def test_runs_on_other_data_are_refused(tmp_path):
    rows = floor_rows() + [row("coat", 1, 1.0, corpus_valid_sha256="other")]
    with pytest.raises(ValueError, match="2 different corpora or validation sets"):
        judged(tmp_path, rows)


def test_run_keys_and_their_flags():
    assert str(P.parse_key("coat@eps1e-5")) == "coat@eps1e-05" and P.parse_key("bf16@data2").order == 2
    flags = P.flags(PROTOCOL, 3, ["bf16@data2"])
    assert flags[:8] == ["--preset", "gpt-1b-accuracy", "--modes", "bf16", "--seed", "3", "--data-seed", "1003"]
    assert flags[-2:] == ["--cuda-graphs", "local"]
    assert P.flags(PROTOCOL, 1, ["coat@eps1e-05"])[-2:] == ["--adam-eps", "1e-05"]
    assert P.flags(PROTOCOL, 1, ["bf16@run2"])[-2:] == ["--repeat", "2"]
    assert P.row_key(PROTOCOL, row("coat", 1, 1.0, eps=1e-5)) == "coat@eps1e-05"
    with pytest.raises(ValueError, match="differ in more than their mode"):
        P.flags(PROTOCOL, 1, ["bf16", "bf16@run2"])
    with pytest.raises(ValueError, match="is not MODE"):
        P.parse_key("bf16@data0")


@pytest.mark.parametrize("name", sorted(P.PROTOCOLS))
def test_every_run_flag_is_a_coat_compare_option(name):
    from coat_compare.cli import parse_args

    protocol = P.get_protocol(name)
    for seed, key in protocol.runs():
        args = parse_args(P.flags(protocol, seed, [key]))
        assert (args.preset, args.steps, args.lr) == (
            protocol.preset,
            protocol.setting("--steps"),
            protocol.setting("--lr"),
        )


def test_the_tiny_protocol_runs_and_is_judged_on_a_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "coat_compare.protocol"]
    done = subprocess.run(
        [*command, "run", "tiny-accuracy", "--seeds", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("coat-compare --preset tiny") == 3  # bf16 and coat in one job; run 2; data order 2
    judge = subprocess.run(
        [*command, "judge", "tiny-accuracy", str(tmp_path), "--json", str(tmp_path / "judgement.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert judge.returncode == 0, judge.stderr[-3000:]
    assert "floor bf16@run2: 1 pair(s), rms 0.000%: not judged (seed 1 +0.000%)" in judge.stdout  # a CPU repeats
    assert "floor bf16@data2: 1 pair(s)" in judge.stdout
    assert "Floor not shown" in judge.stdout and "the gaps of the 1 run(s) of other modes are not shown" in judge.stdout
    result = json.loads((tmp_path / "judgement.json").read_text())
    assert result["floor"]["shown"] is None and result["verdict"] is None


# -- the screen on made-up reports ------------------------------------------------------------------


def candidate_row(name, mode, seed, valid, *, order=1, repeat=None):
    """A finished run of candidate protocol ``name``."""
    p = P.get_protocol(name)
    preset = get_preset(p.preset)
    fields = {P.ROW_FIELDS[o]: v for o, v in p.settings}
    params = 1_028_737_024 if p.preset == "gpt-1b-bytes-accuracy" else PARAMS
    return row(mode, seed, valid, order=order, repeat=repeat, preset=p.preset, data_pool=preset.data_pool, params=params,
               **fields)  # fmt: skip


def screen_rows(gaps):
    """The screen's runs: per candidate, BF16 and BF16 in another data order at seeds 1 and 2."""
    rows = []
    for name, (g1, g2) in gaps.items():
        rows += [candidate_row(name, "bf16", s, 1.0) for s in (1, 2)]
        rows += [candidate_row(name, "bf16", 1, 1.0 + g1, order=2), candidate_row(name, "bf16", 2, 1.0 + g2, order=2)]
    return [("f", r) for r in rows]


LR4, LR5, BYTES = P.SCREEN_CANDIDATES


def test_the_screen_lists_its_runs_first_then_completes_the_best_passing_candidate():
    todo, why = P.next_runs([])
    assert why == "the screen: 12 run(s) missing" and len(todo) == 12
    assert todo[:3] == [(LR4, 1, "bf16"), (LR4, 1, "bf16@data2"), (LR4, 2, "bf16")] and todo[-1] == (
        BYTES,
        2,
        "bf16@data2",
    )
    rows = screen_rows({LR4: (0.004, -0.003), LR5: (0.002, -0.002), BYTES: (0.001, 0.0025)})
    todo, why = P.next_runs(rows[:-1])  # one run short: still the screen
    assert todo == [(BYTES, 2, "bf16@data2")]
    results = {r["protocol"]: r for r in P.screen(rows)}
    assert results[LR4]["rms"] == pytest.approx(0.003536, abs=1e-6) and results[LR4]["passed"] is False
    assert results[LR5]["passed"] and results[BYTES]["passed"]  # 0.200% and 0.190%, both <= 0.30%
    todo, why = P.next_runs(rows)
    assert why.startswith(f"{BYTES} (screen rms 0.190%): 34 run(s) missing")  # the lowest first; 38 - 4
    assert todo[:4] == [(BYTES, 3, "bf16"), (BYTES, 4, "bf16"), (BYTES, 1, "bf16@run2"), (BYTES, 2, "bf16@run2")]
    assert (BYTES, 5, "bf16") in todo and todo[-1] == (BYTES, 6, "te-fp8-delayed")
    # its floor missed (a same-seed pair far apart): the next passing candidate's runs
    missed = [("f", candidate_row(BYTES, "bf16", s, 1.0 + 0.01, repeat=2)) for s in (1, 2, 3, 4)]
    missed += [("f", candidate_row(BYTES, "bf16", s, 1.0)) for s in (3, 4)]
    todo, why = P.next_runs(rows + missed)
    assert why.startswith(f"{LR5} (screen rms 0.200%)") and todo[0] == (LR5, 3, "bf16")
    lines = "\n".join(P.screen_lines(rows + missed))
    assert f"- {BYTES}: rms 0.190% (seed 1 +0.100%, seed 2 +0.250%): passed; floor MISSED" in lines
    assert f"- {LR4}: rms 0.354% (seed 1 +0.400%, seed 2 -0.300%): failed; floor not yet shown" in lines


def test_no_candidate_passing_the_screen_means_no_more_runs():
    rows = screen_rows({LR4: (0.01, -0.01), LR5: (0.005, 0.0), BYTES: (0.0, 0.0045)})
    todo, why = P.next_runs(rows)
    assert todo == [] and why.startswith("no candidate passed the screen (bf16@data2 rms <= 0.30%)")
    assert f"{BYTES} 0.318%" in why
    # the rows of one candidate are not another's: a pool run is no run of gpt-1b-accuracy, nor of another rate
    runs, notes = P.collect(PROTOCOL, rows)
    assert runs == {} and "preset gpt-1b-accuracy-pool, not gpt-1b-accuracy" in "\n".join(notes)
    runs, notes = P.collect(P.get_protocol(LR5), rows)
    assert "lr 0.0001, the protocol's 5e-05" in "\n".join(notes)
    no_pool = dict(candidate_row(LR4, "bf16", 1, 1.0), data_pool=None)
    assert P.mismatch(P.get_protocol(LR4), no_pool) == "data_pool None, the protocol's 12288"


def test_next_on_the_command_line_gives_one_run_per_index(tmp_path):
    command = [sys.executable, "-m", "coat_compare.protocol", "next", str(tmp_path), str(tmp_path / "absent")]
    done = subprocess.run([*command, "--index", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == f"{LR4} 1 bf16@data2\n", done.stderr
    assert "the screen: 12 run(s) missing" in done.stderr
    done = subprocess.run([*command, "--index", "12"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == ""


def test_keep_appends_a_sessions_rows_once_from_packs_reports_and_folders(tmp_path):
    import tarfile

    runs = tmp_path / "gpu0" / "accuracy-next" / "seed1"
    first = row("bf16", 1, 2.26, step_ms_per_step=[3100.0] * 96)
    other = row("bf16", 1, 2.27, order=2, step_ms_per_step=[3150.0] * 96)
    failed = dict(row("bf16", 2, 0.0), status="failed", reason="out of memory")
    write(runs, [first, {"kind": "goal", "goal": "g"}], name="a")
    write(runs, [other, failed], name="b")
    write(runs, [row("bf16", 3, 2.3)], name="c.partial")  # a run still going: not read
    pack = tmp_path / "gpu0" / "accuracy-next.tgz"
    with tarfile.open(pack, "w:gz") as t:
        t.add(tmp_path / "gpu0" / "accuracy-next", arcname=".")
    into = tmp_path / "kept" / "screen-runs.jsonl"
    os.makedirs(into.parent)
    added = P.keep([str(pack)], str(into))
    assert [(r["seed"], r["data_seed"], r["status"]) for r in added] == [
        (1, 1, "ok"),
        (1, 1001, "ok"),
        (2, 2, "failed"),
    ]
    assert all("step_ms_per_step" not in r for r in added)
    # the same rows again, from the folder, a report and the pack: nothing new
    assert P.keep([str(runs), str(runs / "a.jsonl"), str(pack)], str(into)) == []
    kept = [json.loads(line) for line in open(into)]
    assert len(kept) == 3 and kept[0] == {k: v for k, v in first.items() if k != "step_ms_per_step"}
    # what is kept is what the judge and the screen read
    assert {(r["seed"], r["data_seed"]) for _, r in P.read_rows(str(into.parent))} == {(1, 1), (1, 1001), (2, 2)}
    (tmp_path / "gpu0.txt").write_text("=== GPU 0: accuracy-next 0\n")
    with pytest.raises(ValueError, match="not a folder of reports"):
        P.keep([str(tmp_path / "gpu0.txt")], str(into))
    done = subprocess.run(
        [sys.executable, "-m", "coat_compare.protocol", "keep", str(pack), "--into", str(into)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == f"0 row(s) added to {into}", done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "coat_compare.protocol", "keep", str(tmp_path / "absent.tgz"), "--into", str(into)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "absent.tgz does not exist" in done.stderr
