"""coat_kernels.backend: which path a kernel call takes, and its two environment variables, read
once at import (each case runs in a fresh interpreter, as a user sets them before the run)."""

import os
import subprocess
import sys

import pytest
import torch

from coat_kernels.backend import use_triton

PROBE = """
import torch
from coat_kernels.backend import interpreter_enabled, use_triton
x = torch.zeros(4)
print(interpreter_enabled(), use_triton(x), use_triton(x, "reference"))
"""


def probe(**variables: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "COAT_KERNELS_BACKEND")}
    env.update(CUDA_VISIBLE_DEVICES="", **variables)
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, "False False False"),
        ({"TRITON_INTERPRET": "1"}, "True False False"),
        ({"TRITON_INTERPRET": "1", "COAT_KERNELS_BACKEND": "triton"}, "True True False"),
    ],
    ids=["default", "interpreter", "forced-triton"],
)
def test_the_variables_pick_the_path_of_an_auto_call(variables, expected):
    done = probe(**variables)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == expected


def test_an_unknown_backend_variable_is_refused_at_import_naming_the_fix():
    done = probe(COAT_KERNELS_BACKEND="fast")
    assert done.returncode != 0
    assert "COAT_KERNELS_BACKEND='fast': use one of auto, triton, reference, or unset it" in done.stderr


def test_an_explicit_backend_argument():
    x = torch.zeros(4)
    assert not use_triton(x, "reference") and not use_triton(x, "auto")
    with pytest.raises(ValueError, match="unknown kernel backend 'fast': use one of auto, triton, reference"):
        use_triton(x, "fast")
