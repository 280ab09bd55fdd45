"""benchmarks/results/ stays the evidence of current claims, small enough to travel with every GPU
command: at most 150 files and 5.5 MiB; one folder per claim, named for what it shows and its GPU
count, each with a commands.txt that names the date, the commit, the GPU (or CPU) and the command;
each folder indexed in docs/results.md. Superseded runs belong in git history, not here."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MAX_FILES = 150
# 5.5 MiB: every claim's rows as text (5.1 MB in all with the 125M accuracy protocol's 204 runs, 2.0 MB of
# them, as text since 2026-11-29 so that every folder's rows read as JSON lines); the whole tracked tree
# (7.3 MB then) stays under the 8 MiB that travels to the GPU with every command
MAX_BYTES = 11 * 2**19
FOLDERS = sorted(p for p in RESULTS.iterdir() if p.is_dir())


def test_the_tree_fits_its_limits():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert len(files) <= MAX_FILES, (
        f"benchmarks/results holds {len(files)} files, over {MAX_FILES}: delete superseded runs (git keeps them)"
    )
    assert size <= MAX_BYTES, (
        f"benchmarks/results holds {size} bytes, over {MAX_BYTES}: keep reports and the rows a claim needs, "
        "drop per-step logs and plots"
    )


def test_the_top_level_holds_claim_folders_and_the_readme():
    loose = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")
    assert not loose, f"files outside a claim's folder: {loose}"
    assert len(FOLDERS) >= 10


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_a_folder_is_named_for_its_claim_and_says_how_it_was_measured(folder):
    name = folder.name
    assert re.fullmatch(r"[a-z0-9][a-z0-9.-]*-(\d+gpu|cpu)", name), (
        f"{name}: name it for what it shows, ending in its GPU count (-1gpu, -2gpu, ...) or -cpu"
    )
    assert not re.search(r"\b(issue\d*|before|now|latest|h100x\d|h200x\d)\b|\d{4}-\d\d", name), (
        f"{name}: name the claim, not its history"
    )
    commands = folder / "commands.txt"
    assert commands.is_file(), f"{name} has no commands.txt (claim, GPU, date, commit, command)"
    text = commands.read_text()
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{name}/commands.txt names no date"
    assert re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", text), (
        f"{name}/commands.txt names no commit"
    )
    assert re.search(r"\b(H100|H200|CPU)\b", text), f"{name}/commands.txt names no GPU"
    assert re.search(r"coat-compare |python3? (-m \S+ )?(benchmarks|tests)/|bash scripts/", text), (
        f"{name}/commands.txt names no command"
    )
    others = [p for p in folder.rglob("*") if p.is_file() and p.name != "commands.txt"]
    assert others, f"{name} holds no evidence beside its commands.txt"


def test_every_folder_is_in_the_index():
    index = (ROOT / "docs" / "results.md").read_text()
    missing = [p.name for p in FOLDERS if f"benchmarks/results/{p.name}/" not in index]
    assert not missing, f"evidence folders docs/results.md does not index: {missing}"
