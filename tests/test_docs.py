"""The documentation stays true to the code and to itself: the generated flags reference matches
the ``--coat-*`` flags and CoatConfig's defaults, the README stays a front door (size, CI blocks),
every relative link in the README, docs/ and the results index points at a file that exists, and
every reference to a section of docs/design.md, in code or docs, names one of its headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from load_file import load_file

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_LIMIT = 12 * 1024
CI_BLOCKS = {
    "<!-- ci:install -->": 'python -m pip install -e ".[test]"',
    "<!-- ci:test -->": "python -m pytest -n 3",
}
DESIGN = ROOT / "docs" / "design.md"
# "docs/design.md#the-fused-step" in a docstring, "(design.md#...)" in a markdown link
DESIGN_REFERENCE = re.compile(r"design\.md#([A-Za-z0-9_-]*)")
# a section number ("DESIGN 5.1", "DESIGN section 5"): docs/design.md numbers none
SECTION_NUMBER = re.compile(r"\bDESIGN (?:section )?\d+(?:\.\d+)*")
NUMBERED_ELSEWHERE: set[str] = set()
SOURCES = ("coat_megatron", "coat_compare", "kernels", "patches", "tests", "benchmarks", "scripts", "examples", "docs")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _flags_reference():
    return load_file("scripts/flags_reference.py", "flags_reference")


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md"]


def test_flags_reference_matches_the_code():
    message = _flags_reference().stale_message()
    assert message is None, message


def test_flags_reference_lists_every_knob_and_field():
    from dataclasses import fields

    from coat_megatron.config import CoatConfig
    from coat_patches.arguments import KNOBS, flag

    text = (ROOT / "docs" / "flags.md").read_text()
    for name in KNOBS:
        assert f"`{flag(name)}`" in text
    for f in fields(CoatConfig):
        assert f"`{f.name}`" in text, f"CoatConfig.{f.name} is missing from docs/flags.md"
    for option in ("--coat-fp8", "--coat-expansion", "--coat-report"):
        assert f"`{option}`" in text


def test_readme_is_a_front_door():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move detail into docs/ and link it"


@pytest.mark.parametrize("marker", list(CI_BLOCKS))
def test_readme_keeps_the_ci_blocks(marker):
    # CI reads the command in the fenced block right after each marker
    text = README.read_text()
    assert f"{marker}\n```\n{CI_BLOCKS[marker]}\n```\n" in text, (
        f"README.md must keep {marker} followed by a fenced `{CI_BLOCKS[marker]}`"
    )


@pytest.mark.parametrize("document", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(document):
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)  # code blocks hold no links
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (document.parent / path).exists():
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)} links to missing files: {', '.join(broken)}"


def _heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one suffixed -1, -2, ..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def _text_files() -> list[Path]:
    files = [README]
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".md", ".sh", ".txt") and "results" not in path.relative_to(ROOT).parts[:2]:
                files.append(path)
    return [f for f in files if f != Path(__file__).resolve()]  # this file quotes both forms


def test_heading_anchors_follow_githubs_rule():
    text = "# Design\n## The FP8 optimizer\n### Dynamic range expansion (DRE)\n```\n# not a heading\n```\n## Design\n"
    assert _heading_anchors(text) == {"design", "the-fp8-optimizer", "dynamic-range-expansion-dre", "design-1"}


def test_references_to_the_design_name_its_headings():
    anchors = _heading_anchors(DESIGN.read_text())
    broken, numbered = [], set()
    for path in _text_files():
        name = str(path.relative_to(ROOT))
        text = path.read_text(errors="replace")
        broken += [f"{name}: design.md#{a}" for a in DESIGN_REFERENCE.findall(text) if a not in anchors]
        if SECTION_NUMBER.search(text):
            numbered.add(name)
    assert not broken, (
        f"no such heading in docs/design.md: {', '.join(broken)} (headings: {', '.join(sorted(anchors))})"
    )
    assert numbered <= NUMBERED_ELSEWHERE, (
        f"{', '.join(sorted(numbered - NUMBERED_ELSEWHERE))} cite design sections by number, which docs/design.md "
        "does not have: write docs/design.md#<heading anchor> instead"
    )
    fixed = NUMBERED_ELSEWHERE - numbered
    assert not fixed, f"{', '.join(sorted(fixed))} no longer cite a section number: drop them from NUMBERED_ELSEWHERE"


def test_readme_quotes_the_torch_pin_of_pyproject():
    """The CPU-only torch the README installs first must satisfy the project's pin, or the project's
    own install replaces it with the CUDA build."""
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_pin,) = [d for d in dependencies if re.match(r"torch\b", d)]
    assert f'"{torch_pin}"' in README.read_text(), f"README.md must quote pyproject.toml's pin {torch_pin}"
