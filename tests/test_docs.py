"""The documentation stays true to the code and to itself: the generated flags reference matches
the ``--coat-*`` flags and CoatConfig's defaults, the README stays a front door (size, CI blocks),
and every relative link in the README, docs/ and the results index points at a file that exists."""

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
    "<!-- ci:test -->": "python -m pytest -n 2",
}
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
