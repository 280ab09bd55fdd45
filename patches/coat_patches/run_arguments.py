"""What megatron-core 0.19 finds late, or not at all, about a run's own arguments, checked before
its ``validate_args`` (with or without ``--coat-fp8``), each a line that names the fix:

- a size or count below 1 (``--hidden-size -5``): Megatron's checks divide by them or index with
  them and end in a traceback;
- ``--save DIR`` that cannot be written: Megatron finds out at its first save, after training;
- ``--load DIR`` whose ``latest_checkpointed_iteration.txt`` holds neither an iteration nor
  ``release``: Megatron prints one line and calls ``sys.exit()``, which ends the run with status 0
  before any training;
- ``--load DIR`` that does not exist: Megatron trains from scratch without a word. That may be
  meant (a first run whose ``--load`` and ``--save`` are one folder), so it is a warning line, not
  an error.

And where apex's fused weight-gradient extension is missing (``gradient_accumulation_fusion``), the
launcher turns Megatron's gradient-accumulation fusion off with one line: Megatron's default needs
it, and its ``ColumnParallelLinear`` (the output layer, in every mode) raises without it. COAT's
linears add their weight gradients inside their own GEMMs either way.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile

POSITIVE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "seq_length",
    "max_position_embeddings",
    "micro_batch_size",
    "global_batch_size",
    "train_iters",
)
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name for the checkpoint folder's index
NO_FUSION = "--no-gradient-accumulation-fusion"
APEX_WGRAD = "fused_weight_gradient_mlp_cuda"


class RunArgumentError(ValueError):
    """A run argument that Megatron would refuse late, or in a traceback; the message names the fix."""


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_run_args(args: argparse.Namespace) -> list[str]:
    """Raise ``RunArgumentError`` for the first argument above that cannot run; return the warning
    lines (a ``--load`` folder that does not exist)."""
    for name in POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise RunArgumentError(f"{option(name)} {value}: must be 1 or more")
    save = getattr(args, "save", None)
    if save:
        try:
            os.makedirs(save, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=save, prefix=".coat-megatron-run-write-check-"):
                pass
        except OSError as e:
            raise RunArgumentError(
                f"--save {save}: cannot write there ({e.strerror or type(e).__name__}); Megatron would find out only at "
                "its first save, after training: give --save a directory you can write to"
            ) from None
    load = getattr(args, "load", None)
    if not load:
        return []
    if not os.path.isdir(load):
        return [
            f"--load {load} does not exist: training starts from scratch (give the folder an earlier --save wrote to resume)"
        ]
    tracker = os.path.join(load, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text != "release" and not (text.isdigit() and int(text) >= 0):
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise RunArgumentError(
                f"--load {load}: {TRACKER} holds {shown!r}, neither an iteration number nor 'release' (Megatron would "
                f"exit with status 0 without training): write the iteration of the checkpoint to load into it, or remove "
                "it to load nothing"
            )
    return []


def gradient_fusion_args(script_args: list[str], gpu: bool) -> tuple[list[str], str | None]:
    """``script_args`` with ``--no-gradient-accumulation-fusion`` added where Megatron's fusion cannot
    run (a GPU without apex's fused weight-gradient extension), and the line that says so; on a CPU
    the training loop turns the fusion off itself (``coat_patches.training_cpu``)."""
    if not gpu or NO_FUSION in script_args or importlib.util.find_spec(APEX_WGRAD) is not None:
        return script_args, None
    return [*script_args, NO_FUSION], (
        f"apex's {APEX_WGRAD} is not installed, so Megatron's gradient-accumulation fusion cannot run: added "
        f"{NO_FUSION} (every mode; COAT's linears add their weight gradients inside their GEMMs either way)"
    )
