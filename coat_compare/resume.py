"""The checkpoint-resume check: a checkpoint written at one layout (e.g. DP = n, or TP 2 x DP 2)
resumes at others (DP = 1 by default; ``--resume-at``: e.g. DP 4, or TP 1) and at its own, with
the losses of the run that was never interrupted.

Runs of the job, each in its own processes (``probe``), on the same global batch (the same
batches in every run):

1. the job's layout, ``--steps S``, a dist checkpoint written after step ``save_step``: the
   uninterrupted losses (``dp_reshardable``, or ``fully_reshardable`` where a resumed layout
   changes TP or PP: ``checkpoint_format``);
2. each resumed layout, loaded from that checkpoint, steps ``save_step`` .. S - 1;
3. the saving layout, loaded likewise.

What to expect: run 3 repeats run 1 bit for bit with ``dp_reshardable`` (same layout, the optimizer
states restored exactly: COAT's FP8 codes and per-group scale, k, centre, the FP32 master weights,
the step). A run at another DP size reshards the states (COAT's group-aligned shards move without
requantization): its losses equal run 1's up to the reduction order of BF16 GEMMs over a batch of
another shape and, for FP8 modes, the per-tensor activation scales, which each rank takes from its
own micro-batch. ``fully_reshardable`` stores FP32 moments (COAT's are dequantized on save and
requantized on load): a resume at another TP or PP also moves within that rounding.
"""

from __future__ import annotations

import os
import sys
import tempfile

from .layouts import layout_name, parse_layouts
from .probe import new_row, run_args, run_probe


def measure(o, keep) -> None:
    """The ``resume`` sub-command: the check (``resume_check``) of each mode, each row handed to
    ``keep`` when done."""
    for mode in o.modes:
        row = new_row("resume", o.preset, mode, o)
        if row.get("status") != "skipped":
            resumed = ", ".join(layout_name(*layout) for layout in resume_layouts(o))
            saved = layout_name(o.tp, o.pp, o.vpp, o.dp)
            print(
                f"{o.preset.name} {mode.name}: a checkpoint at {saved}, resumed at {resumed}",
                file=sys.stderr,
                flush=True,
            )
            row = resume_check(o, o.preset, mode, row)
        keep(row)


def resume_layouts(args) -> list[tuple[int, int, int, int]]:
    """Where the check resumes: ``--resume-at``'s layouts, else DP 1 (the same TP and PP); and
    always the saving layout itself, last (the bit-exact resume)."""
    saving = (args.tp, args.pp, args.vpp, args.dp)
    given = parse_layouts(args.resume_at) if args.resume_at else [(args.tp, args.pp, args.vpp, 1)]
    return [layout for layout in given if layout != saving] + [saving]


def checkpoint_format(args) -> str:
    """``dp_reshardable`` (COAT's compressed states; any DP size at the same TP and PP) where every
    resumed layout keeps the saving TP x PP, else ``fully_reshardable`` (FP32 Adam states in
    Megatron's layout, which reshard over TP and PP too)."""
    same = all(layout[:3] == (args.tp, args.pp, args.vpp) for layout in resume_layouts(args))
    return "dp_reshardable" if same else "fully_reshardable"


def micro_batch_for(global_batch: int, micro_batch: int, dp: int) -> int:
    """The job's micro-batch where DP ranks x it divide the global batch, else one micro-batch per
    rank (the global batch / DP)."""
    return micro_batch if global_batch % (micro_batch * dp) == 0 else global_batch // dp


def resume_check(args, preset, mode, row: dict) -> dict:
    """``row`` (the mode's report row) filled with the runs' losses and their differences: the
    uninterrupted run at the job's layout saves after ``--save-step``, then a run per resumed
    layout (``resume_layouts``) loads it and trains the same global batches."""
    saving = (args.tp, args.pp, args.vpp, args.dp)
    save_step = preset.steps // 2 if args.save_step is None else args.save_step
    global_batch = preset.global_batch_for(args.dp)
    fmt = checkpoint_format(args)
    runs = {}
    parent = args.checkpoint_dir
    if parent:
        os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coat-resume-", dir=parent) as directory:
        plan = [("uninterrupted", saving, ["--save", directory, "--save-step", str(save_step)])]
        plan += [(f"resumed_{layout_name(*layout)}", layout, ["--load", directory]) for layout in resume_layouts(args)]
        for name, layout, extra in plan:
            tp, pp, _, dp = layout
            line = run_args(
                args,
                preset,
                mode.name,
                micro_batch=micro_batch_for(global_batch, preset.micro_batch, dp),
                layout=layout,
                global_batch=global_batch,
                extra=(*extra, "--checkpoint-format", fmt),
            )
            probe = run_probe(line, tp * pp * dp)
            if probe.row is None or probe.row.get("status") != "ok":
                reason = probe.error or probe.row.get("reason", probe.row.get("status"))
                return {**row, "status": "failed", "reason": f"{name}: {reason}"[:400]}
            runs[name] = probe.row
    full = runs["uninterrupted"]["losses"]
    after = full[save_step:]
    resumed = [name for name, _, _ in plan[1:]]
    out = {
        **row,
        "status": "ok",
        "save_step": save_step,
        "steps": preset.steps,
        "micro_batch": preset.micro_batch,
        "global_batch": global_batch,
        "checkpoint_format": fmt,
        "saved_at": layout_name(*saving),
        "resumed": resumed,
        "losses_uninterrupted": full,
    }
    for name in resumed:
        losses = runs[name]["losses"]
        out[f"losses_{name}"] = losses
        out[f"max_abs_diff_{name}"] = max(abs(a - b) for a, b in zip(losses, after))
        out[f"exact_{name}"] = losses == after
    return out
