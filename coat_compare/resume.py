"""The checkpoint-resume check: a checkpoint written at DP = n resumes at DP = 1 and at DP = n
with the losses of the run that was never interrupted.

Three runs of the job, each in its own processes (``probe``), on the same global batch
(micro-batch x DP sequences per step, the same batches in every run):

1. DP = n, ``--steps S``, a dist checkpoint (``dp_reshardable``) written after step ``save_step``:
   the uninterrupted losses;
2. DP = 1 (micro-batch x n), loaded from that checkpoint, steps ``save_step`` .. S - 1;
3. DP = n, loaded likewise.

What to expect: run 3 repeats run 1 bit for bit (same layout, the optimizer states restored
exactly: COAT's FP8 codes and per-group scale, k, centre, the FP32 master weights, the step).
Run 2 reshards the states (COAT's group-aligned shards move without requantization) and computes
the same global batch on one rank: its losses equal run 1's up to the reduction order of BF16
GEMMs over a batch of another shape and, for FP8 modes, the per-tensor activation scales, which each
rank takes from its own micro-batch (one scale over the whole batch at DP = 1).
"""

from __future__ import annotations

import os
import tempfile

from .probe import run_args, run_probe


def resume_check(args, preset, mode, row: dict) -> dict:
    """``row`` (the mode's report row) filled with the three runs' losses and their differences."""
    dp, save_step = args.dp, args.save_step
    if save_step is None:
        save_step = preset.steps // 2
    if not 0 < save_step < preset.steps - preset.warmup_steps:
        raise SystemExit(
            f"--save-step {save_step} must lie between 0 and --steps {preset.steps} minus {preset.warmup_steps} warm-up steps "
            f"(the resumed runs measure their own warm-up); use --steps {save_step + preset.warmup_steps + 1} or more"
        )
    runs = {}
    parent = args.checkpoint_dir
    if parent:
        os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coat-resume-", dir=parent) as directory:
        plan = [
            ("uninterrupted", dp, ["--save", directory, "--save-step", str(save_step)]),
            ("resumed_dp1", 1, ["--load", directory]),
            (f"resumed_dp{dp}", dp, ["--load", directory]),
        ]
        for name, run_dp, extra in plan:
            micro_batch = preset.micro_batch * dp // run_dp  # the same global batch
            line = run_args(
                args,
                preset,
                mode.name,
                micro_batch=micro_batch,
                layout=(args.tp, args.pp, args.vpp, run_dp),
                extra=tuple(extra),
            )
            probe = run_probe(line, args.tp * args.pp * run_dp)
            if probe.row is None or probe.row.get("status") != "ok":
                reason = probe.error or probe.row.get("reason", probe.row.get("status"))
                return {**row, "status": "failed", "reason": f"{name} (DP {run_dp}): {reason}"[:400]}
            runs[name] = probe.row
    full = runs["uninterrupted"]["losses"]
    after = full[save_step:]
    out = {
        **row,
        "status": "ok",
        "tp": args.tp,
        "dp": dp,
        "save_step": save_step,
        "steps": preset.steps,
        "micro_batch": preset.micro_batch,
        "losses_uninterrupted": full,
    }
    for name in ("resumed_dp1", f"resumed_dp{dp}"):
        losses = runs[name]["losses"]
        out[f"losses_{name}"] = losses
        out[f"max_abs_diff_{name}"] = max(abs(a - b) for a, b in zip(losses, after))
        out[f"exact_{name}"] = losses == after
    return out
