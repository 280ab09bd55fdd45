"""The product tests itself: no test of coat_megatron, coat_kernels or coat_patches imports coat_compare
(the comparison tool, which the product never imports) or runs it. Tests of coat_compare live in
tests/compare/; a helper that a product test needs lives in tests/."""

import ast
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


# the product's packages, each in the folder of its import name
PRODUCT = ("coat_megatron", "kernels/coat_kernels", "patches/coat_patches")
LONGEST = 80  # lines of one function, its signature and docstring included
# functions allowed past it, each with the reason
LONG_FUNCTIONS = {
    "kernels/coat_kernels/fp8_adamw.py:_fp8_adamw_kernel": (
        "the fused step is one Triton program: 40 parameters and two 17-argument state calls, one per line; "
        "moving its offsets into a @triton.jit helper must keep the tl.multiple_of hints that give 16-byte "
        "vectors, which only a GPU run shows"
    ),
}


def test_no_function_of_the_product_is_longer_than_the_bound():
    root = TESTS.parent
    found = {}
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > LONGEST:
                        found[f"{path.relative_to(root).as_posix()}:{node.name}"] = lines
    over = {name: lines for name, lines in found.items() if name not in LONG_FUNCTIONS}
    assert not over, f"functions over {LONGEST} lines (split them, or name the reason in LONG_FUNCTIONS): {over}"
    stale = sorted(set(LONG_FUNCTIONS) - set(found))
    assert not stale, f"LONG_FUNCTIONS names functions no longer over {LONGEST} lines: {stale}"
