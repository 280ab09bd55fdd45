"""The tree passes ruff's lint and format checks (configured in pyproject.toml), as CI runs them."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(command):
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is missing: pip install -e '.[test]'"
    done = subprocess.run([ruff, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"ruff {' '.join(command)} failed; run it and fix (or `ruff format .`):\n{done.stdout[-3000:]}"
    )
