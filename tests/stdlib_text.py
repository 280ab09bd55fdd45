"""Real English text that needs no download, for tests that train on text: the docstrings of the
standard library, present wherever Python is."""

import ast
import os
import sysconfig

SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_docstrings(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the standard library's docstrings longer than 80 characters (of
    modules, classes and functions, files and folders in sorted order), each followed by a blank line."""
    parts, total = [], 0
    for directory, subdirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                doc = ast.get_docstring(node) if isinstance(node, DOCUMENTED) else None
                if doc and len(doc) > 80:
                    parts.append(doc.encode("utf-8") + b"\n\n")
                    total += len(parts[-1])
            if total >= max_bytes:
                return b"".join(parts)[:max_bytes]
    return b"".join(parts)
