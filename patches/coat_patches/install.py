"""All of ``coat_patches`` applied at once: what ``coat-megatron-run`` does before a script runs.

``coat_megatron_patches()`` installs, in this order:

- ``wheel``: Megatron's start-up skips compiling the dataset helpers the wheel ships prebuilt;
- ``arguments``: ``--coat-fp8``, the ``--coat-*`` knobs and their validation, and the default
  of Megatron's per-layer CUDA graphs with ``--coat-fp8``;
- ``parallel_layout``: TP, PP (and virtual stages) and the world size checked against the model
  before Megatron's checks, naming the sizes that fit;
- ``pipeline_outputs``: pipeline stages with per-layer CUDA graphs (a graph's output, a view, is
  pseudo-freed like any stage output, where megatron-core 0.19 asserts on it, BF16 or COAT; the one
  patch that acts without ``--coat-fp8``, where the unpatched run stops at its first micro-batch);
- ``model``: the COAT layer spec in every ``GPTModel`` of a ``--coat-fp8`` run;
- ``optimizer``: COAT's distributed FP8 optimizer and its group-aligned DDP layout;
- ``report``: ``--coat-report PATH``;
- ``telemetry``: COAT's optimizer-state statistics (k, underflow) at every log interval;
- on a machine without CUDA (or with ``cpu=True``), ``training_cpu``: the training loop on CPU
  and gloo, inside ``coat_patches.cpu.megatron_on_cpu()``;
- ``argument_errors``, last so that it wraps the other patches' argument hooks: a bad argument
  ends in one message (Megatron's table of arguments comes out only once every check passed).

Without ``--coat-fp8`` on the command line the hooks pass everything through to Megatron, so a
patched process trains exactly what the unpatched one would (where the unpatched one runs at all:
``pipeline_outputs``). Every patch checks the megatron-core
version first; leaving the context restores everything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import (
    argument_errors,
    arguments,
    model,
    optimizer,
    parallel_layout,
    pipeline_outputs,
    report,
    telemetry,
    training_cpu,
    wheel,
)
from .replacements import Replacements


@contextlib.contextmanager
def coat_megatron_patches(cpu: bool | None = None) -> Iterator[None]:
    """Run ``megatron.training`` with COAT inside this context (see the module docstring).

    Args:
        cpu: run Megatron's training loop on the CPU (gloo); default: when CUDA is not available.
    """
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if cpu and torch.cuda.is_available():
        raise ValueError("cpu=True needs a process that does not see a GPU: set CUDA_VISIBLE_DEVICES= (empty)")
    replacements = Replacements()
    try:
        with contextlib.ExitStack() as stack:
            for patch in (wheel, arguments, parallel_layout, pipeline_outputs, model, optimizer, report, telemetry):
                patch.install(replacements)
            if cpu:
                stack.enter_context(training_cpu.install(replacements))
            argument_errors.install(replacements)
            yield
    finally:
        replacements.restore()
