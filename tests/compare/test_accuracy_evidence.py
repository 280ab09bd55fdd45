"""The accuracy verdict recomputes from its committed rows: `judge` on rows.jsonl.gz prints verdict.md
exactly, and the figures README.md and docs/ quote are the judgement's, rounded as quoted."""

import os
from pathlib import Path

import pytest
from test_readme_figures import RESULTS, check_index

from coat_compare import protocol as P

ROOT = Path(__file__).resolve().parents[2]
FOLDER = "benchmarks/results/accuracy-gpt-125m-paired-2gpu"


@pytest.fixture(scope="module")
def judged():
    cwd = Path.cwd()
    os.chdir(ROOT)  # the report names the rows file by the path it was given
    try:
        result, lines = P.judge(P.get_protocol("gpt-125m-wsd"), P.read_rows([f"{FOLDER}/rows.jsonl.gz"]))
    finally:
        os.chdir(cwd)
    return result, lines


def pct(x, digits, sign=True):
    return f"{x * 100:+.{digits}f}%" if sign else f"{x * 100:.{digits}f}%"


def rng(s, digits):
    """An interval as the docs quote it: -0.24..+0.85%."""
    return f"{s['low'] * 100:+.{digits}f}..{s['high'] * 100:+.{digits}f}%"


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
    for quoted in (
        f"**pass**: default - BF16 **{pct(coat['mean'], 2)}**",
        f"se {pct(coat['se'], 2, False)}",
        f"upper {pct(coat['upper'], 2)}",
        f"TE FP8 delayed - BF16 {pct(te['mean'], 2)} ({te['n']} seeds)",
        f"default - TE {pct(vs_te['mean'], 2)} ({rng(vs_te, 2)})",
    ):
        assert quoted in row, (quoted, row)
    results = (ROOT / "docs" / "results.md").read_text()
    for quoted in (
        f"default - BF16 {pct(coat['mean'], 3)} (se {pct(coat['se'], 3, False)}, one-sided 95% bounds "
        f"{pct(coat['lower'], 3)} / {pct(coat['upper'], 3)}; 95% interval {rng(coat, 3)})",
        f"at the branch (8.2M tokens) {pct(v['branch']['mean'], 3)}, growth {pct(v['growth']['mean'], 3)} "
        f"({rng(v['growth'], 3)})",
        f"TE FP8 delayed - BF16 {pct(te['mean'], 3)} ({te['n']} seeds, se {pct(te['se'], 3, False)})",
        f"BF16 again {pct(v['sanity']['mean'], 3)}",
        f"| {pct(coat['mean'], 3)}, {pct(coat['upper'], 3)} | met (pass) |",
    ):
        assert quoted in results, quoted
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
    path = str(RESULTS / "accuracy-gpt-125m-paired-2gpu" / "rows.jsonl.gz")
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
