"""The accuracy verdicts recompute from their committed rows: `judge` on the rows file prints verdict.md
exactly, and the figures README.md and docs/ quote are the judgement's, rounded as quoted. Two protocols:
gpt-125m-wsd (the powered verdict) and gpt-1b-check (the 1B check with TE beside)."""

import math
import os
import statistics
from pathlib import Path

import pytest
from test_readme_figures import check_index

from coat_compare import protocol as P

ROOT = Path(__file__).resolve().parents[2]
FOLDER = "benchmarks/results/accuracy-gpt-125m-paired-2gpu"
CHECK_FOLDER = "benchmarks/results/accuracy-gpt-1b-check-2gpu"


def rows_file(folder: str) -> str:
    """The folder's rows, as text (``rows.jsonl``), or gzip-compressed (``rows.jsonl.gz``) where a folder keeps them so."""
    text = f"{folder}/rows.jsonl"
    return text if (ROOT / text).exists() else f"{text}.gz"


def judge_in_root(name: str, folder: str):
    cwd = Path.cwd()
    os.chdir(ROOT)  # the report names the rows file by the path it was given
    try:
        return P.judge(P.get_protocol(name), P.read_rows([rows_file(folder)]))
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def judged():
    return judge_in_root("gpt-125m-wsd", FOLDER)


@pytest.fixture(scope="module")
def judged_1b():
    return judge_in_root("gpt-1b-check", CHECK_FOLDER)


def pct(x, digits, sign=True):
    return f"{x * 100:+.{digits}f}%" if sign else f"{x * 100:.{digits}f}%"


def rng(s, digits):
    """An interval as the docs quote it: -0.24..+0.85%."""
    return f"{s['low'] * 100:+.{digits}f}..{s['high'] * 100:+.{digits}f}%"


def assert_quoted(text: str, quotes) -> None:
    """Every quoted figure is in ``text``; the assertion names the ones that are not."""
    missing = [q for q in quotes if q not in text]
    assert not missing, missing


def test_verdict_md_is_the_judgement_of_the_committed_rows(judged):
    result, lines = judged
    assert (ROOT / FOLDER / "verdict.md").read_text() == "\n".join(lines) + "\n"
    assert result["power"]["n"] == 24 and not result["power"]["underpowered"]
    v = result["verdict"]
    assert v["verdict"] == "pass" and v["seeds"] == list(range(1, 25)) and v["coat"]["n"] == 24


def test_the_quoted_figures_are_the_judgements(judged):
    v = judged[0]["verdict"]
    coat, te, vs_te = v["coat"], v["te"], v["coat_minus_te"]
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "gpt-125m-wsd" in line and line.startswith("| accuracy"))
    assert_quoted(
        row,
        (
            f"**pass**: default - BF16 **{pct(coat['mean'], 2)}**",
            f"se {pct(coat['se'], 2, False)}",
            f"upper {pct(coat['upper'], 2)}",
            f"TE FP8 delayed - BF16 {pct(te['mean'], 2)} ({te['n']} seeds)",
            f"default - TE {pct(vs_te['mean'], 2)} ({rng(vs_te, 2)})",
        ),
    )
    results = (ROOT / "docs" / "results.md").read_text()
    assert_quoted(
        results,
        (
            f"default - BF16 {pct(coat['mean'], 3)} (se {pct(coat['se'], 3, False)}, one-sided 95% bounds "
            f"{pct(coat['lower'], 3)} / {pct(coat['upper'], 3)}; 95% interval {rng(coat, 3)})",
            f"at the branch (8.2M tokens) {pct(v['branch']['mean'], 3)}, growth {pct(v['growth']['mean'], 3)} "
            f"({rng(v['growth'], 3)})",
            f"TE FP8 delayed - BF16 {pct(te['mean'], 3)} ({te['n']} seeds, se {pct(te['se'], 3, False)})",
            f"BF16 again {pct(v['sanity']['mean'], 3)}",
            f"| {pct(coat['mean'], 3)}, {pct(coat['upper'], 3)} | met (pass) |",
        ),
    )
    accuracy = (ROOT / "docs" / "accuracy.md").read_text()
    for name, key in (("**COAT - BF16 (the verdict: pass)**", "coat"), ("TE FP8 delayed - BF16", "te")):
        s = v[key]
        mean = f"**{pct(s['mean'], 3)}**" if key == "coat" else pct(s["mean"], 3)
        assert f"| {name} | {s['n']} | {mean} | {pct(s['se'], 3, False)} |" in accuracy, name


def test_results_index_quotes_the_125m_judgement_recomputed_from_its_rows():
    """docs/results.md's gpt-125m-wsd row: the protocol's judge run again on the committed rows."""
    check_index("accuracy-gpt-125m-paired-2gpu", accuracy_125m())


def accuracy_125m():
    # the protocol's own judgement, run again on the committed rows
    path = str(ROOT / rows_file(FOLDER))
    result, _ = P.judge(P.get_protocol("gpt-125m-wsd"), P.read_rows([path]))
    v, gate = result["verdict"], result["power"]
    coat, te, both, again = v["coat"], v["te"], v["coat_minus_te"], v["sanity"]
    growth = v["growth"]

    def pct(x):
        return f"{x:+.3%}"

    def span(low, high):  # the row writes a range's first end without its % sign
        return f"{100 * low:+.3f}..{pct(high)}"

    return [
        f"{v['verdict']} over the {coat['n']} seeds its blind power gate fixed (sd {gate['sd']:.4%} at seeds 1-6)",
        f"default - BF16 {pct(coat['mean'])} (se {coat['se']:.3%}, one-sided 95% bounds {pct(coat['lower'])} / "
        f"{pct(coat['upper'])}; 95% interval {span(coat['low'], coat['high'])})",
        f"at the branch (8.2M tokens) {pct(v['branch']['mean'])}, growth {pct(growth['mean'])} "
        f"({span(growth['low'], growth['high'])})",
        f"TE FP8 delayed - BF16 {pct(te['mean'])} ({te['n']} seeds, se {te['se']:.3%})",
        f"default - TE {pct(both['mean'])} ({span(both['low'], both['high'])})",
        f"BF16 again {pct(again['mean'])} ({again['n']} seeds)",
    ]


def test_the_1b_check_verdict_md_is_the_judgement_of_its_18_rows(judged_1b):
    result, lines = judged_1b
    assert (ROOT / CHECK_FOLDER / "verdict.md").read_text() == "\n".join(lines) + "\n"
    gate, v = result["power"], result["verdict"]
    assert gate["n"] == 6 and gate["underpowered"]  # the cap is 6: said before any mean was read
    assert v["seeds"] == list(range(1, 7)) and all(v[k]["n"] == 6 for k in ("coat", "te", "coat_minus_te"))
    # the rule's two 1B goals: the upper bound (missed) and COAT within TE + 0.25% (met)
    assert v["verdict"] == "not passed" and v["coat"]["upper"] > 0.01
    assert v["te_goal"]["met"] and v["te_goal"]["seeds"] == list(range(1, 7))


def check_1b():
    """The figures README.md, docs/results.md and docs/accuracy.md quote from the 1B check."""
    result, _ = judge_in_root("gpt-1b-check", CHECK_FOLDER)
    v, gate = result["verdict"], result["power"]
    coat, te, both = v["coat"], v["te"], v["coat_minus_te"]
    per_seed = ", ".join(pct(d, 2) for _, d in sorted(coat["d"].items()))
    return (
        v,
        gate,
        {
            "readme": [
                f"default - BF16 {pct(coat['mean'], 2)} (se {pct(coat['se'], 2, False)}, upper {pct(coat['upper'], 2)} > 1.0%)",
                f"TE FP8 delayed - BF16 {pct(te['mean'], 2)} (upper {pct(te['upper'], 2)})",
                f"default - TE {pct(both['mean'], 2)} ({rng(both, 2)})",
            ],
            "results": [
                f"sd {gate['sd']:.3%} per seed, underpowered at its cap of 6",
                f"default - BF16 {pct(coat['mean'], 3)} (se {pct(coat['se'], 3, False)}, one-sided 95% bounds "
                f"{pct(coat['lower'], 3)} / {pct(coat['upper'], 3)}; 95% interval {rng(coat, 3)})",
                f"TE FP8 delayed - BF16 {pct(te['mean'], 3)} (se {pct(te['se'], 3, False)}, upper {pct(te['upper'], 3)})",
                f"default - TE {pct(both['mean'], 3)} ({rng(both, 3)})",
                f"per seed {per_seed}",
            ],
        },
    )


def test_the_quoted_1b_check_figures_are_the_judgements():
    v, _, quoted = check_1b()
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "gpt-1b-check" in line and line.startswith("| accuracy"))
    assert_quoted(row, quoted["readme"])
    check_index("accuracy-gpt-1b-check-2gpu", quoted["results"])
    guide = " ".join((ROOT / "docs" / "user-guide.md").read_text().split())
    coat, te, both = v["coat"], v["te"], v["coat_minus_te"]
    assert_quoted(
        guide,
        (
            f"(+{coat['upper']:.2%}; TE's would be +{te['upper']:.2%})",
            f"COAT {pct(coat['mean'], 2)} above BF16, TE FP8 delayed {pct(te['mean'], 2)}",
            f"COAT level with TE ({pct(both['mean'], 2)})",
            f"({statistics.stdev(coat['d'].values()):.2%} per seed)",
        ),
    )
    accuracy = (ROOT / "docs" / "accuracy.md").read_text()
    flat = " ".join(accuracy.split())
    assert_quoted(
        flat,
        (
            f"level with TE delayed ({pct(both['mean'], 2)}, interval {rng(both, 2)})",  # the fidelity section
            # the status
            f"**{pct(coat['mean'], 2)}** above BF16's (se {pct(coat['se'], 2, False)}; one-sided 95% upper bound "
            f"{pct(coat['upper'], 2)}",
            f"TE FP8 delayed's {pct(te['mean'], 2)} (upper {pct(te['upper'], 2)}), and COAT - TE is "
            f"{pct(both['mean'], 2)} ({rng(both, 2)})",
            f"(sd {statistics.stdev(coat['d'].values()):.2%} per seed",
        ),
    )
    for name, key in (("COAT - BF16 (the verdict: not passed)", "coat"), ("TE FP8 delayed - BF16", "te"),
                      ("COAT - TE FP8 delayed", "coat_minus_te")):  # fmt: skip
        s = v[key]
        interval = f"{pct(s['low'], 3)} .. {pct(s['high'], 3)}"
        assert f"| {name} | {s['n']} | {pct(s['mean'], 3)} | {pct(s['se'], 3, False)} | {interval} |" in accuracy, name
    # the per-seed table: every seed's gap per arm
    for label, key in (("COAT - BF16", "coat"), ("TE FP8 delayed - BF16", "te")):
        cells = " | ".join(pct(d, 2) for _, d in sorted(v[key]["d"].items()))
        assert f"| {label} | {cells} |" in accuracy, label


def test_the_1b_checks_derived_figures_recompute():
    """docs/accuracy.md's reading of the 1B check: BF16's losses, the spreads, how the FP8 arms move
    together, and the paired seeds that would bring the upper bound under the goal's 1.0%."""
    protocol = P.get_protocol("gpt-1b-check")
    runs, _ = P.collect(protocol, P.read_rows([str(ROOT / rows_file(CHECK_FOLDER))]))
    v = judge_in_root("gpt-1b-check", CHECK_FOLDER)[0]["verdict"]
    coat, te = ([v[k]["d"][s] for s in range(1, 7)] for k in ("coat", "te"))
    bf16 = " | ".join(f"{P.final_loss(protocol, runs, s, 'bf16'):.4f}" for s in range(1, 7))
    mean, sd = statistics.fmean(coat), statistics.stdev(coat)

    def upper(n):  # the one-sided 95% bound at n seeds, were the mean and sd what six gave
        return mean + P.t_quantile(0.95, n - 1) * sd / math.sqrt(n)

    needed = next(n for n in range(6, 100) if upper(n) <= protocol.pass_upper)
    accuracy = (ROOT / "docs" / "accuracy.md").read_text()
    assert_quoted(
        accuracy,
        (
            f"| BF16's held-out loss | {bf16} |",
            f"the per-seed spread is {sd:.2%} (TE's {statistics.stdev(te):.2%})",
            f"six seeds put the one-sided bound about {upper(6) - mean:.1%} above the mean",
            f"at about {needed} paired seeds",
            f"(correlation\n  {statistics.correlation(coat, te):.2f} of their gaps)",
        ),
    )
