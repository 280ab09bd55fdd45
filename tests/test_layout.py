"""The product tests itself: no test of coat_megatron, coat_kernels or coat_patches imports coat_compare
(the comparison tool, which the product never imports) or runs it. Tests of coat_compare live in
tests/compare/; a helper that a product test needs lives in tests/."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# project-wide tests (the docs, the scripts, the results tree), not tests of the product
PROJECT_WIDE = {"test_docs.py", "test_scripts.py", "test_results_tree.py"}
USES = re.compile(
    r"^[ \t]*(?:from\s+coat_compare\b|import\s+(?:[\w.]+\s*,\s*)*coat_compare\b)"  # import statements
    r"|-m[\"',\s]+coat_compare\b",  # the tool run as a module: in a command line or an argument list
    re.MULTILINE,
)


def test_product_tests_do_not_use_coat_compare():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        relative = path.relative_to(TESTS)
        if relative.parts[0] == "compare" or str(relative) in PROJECT_WIDE:
            continue
        text = path.read_text(encoding="utf-8")
        for match in USES.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"tests/{relative.as_posix()}:{line}: {match.group().strip()}")
    assert not found, (
        "product tests use coat_compare (the comparison tool, which the product never imports):\n  "
        + "\n  ".join(found)
        + "\na test of coat_compare belongs in tests/compare/; a product test keeps the helper it needs in tests/"
    )


def test_module_names_are_unique():
    """The test folders are no packages (pytest puts each on sys.path): two modules of one name, in
    two folders, stop the collection ("import file mismatch") or import the other's helpers."""
    folders: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        if path.name != "conftest.py" and "__pycache__" not in path.parts:
            folders.setdefault(path.name, []).append(path.parent.relative_to(TESTS.parent).as_posix())
    twice = {name: where for name, where in folders.items() if len(where) > 1}
    assert not twice, f"modules of one name in several test folders (rename one): {twice}"
