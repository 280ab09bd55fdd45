"""Import a script that is not in a package (benchmarks/, scripts/) as a module, for its tests."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_file(relative_path: str, name: str):
    """The module of the file at ``relative_path`` (from the repository root), named ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
