"""The layout check: one model trained in several parallel layouts, step by step against the first.

    coat-compare layouts 1,tp2,pp2,dp2,tp2xdp2,tp2xpp2 --preset gpt-1b --modes bf16,coat \\
        --micro-batch 2 --global-batch 8 --steps 30

Every layout trains each mode from the same full weights (``build.init_weights_by_name``: a TP
rank keeps its slice of the one-GPU tensor, a pipeline stage its layers), on the same global
batches in the same order, each in processes of its own (``probe``). A layout is written ``1``
(one GPU) or as ``x``-joined sizes: ``tp2``, ``pp2``, ``vpp2``, ``dp2``, ``tp2xdp2``,
``tp2xpp2xvpp2``. With several ``--cuda-graphs`` configurations each layout trains in each (a
run named ``pp2/local``), judged as a layout: ``layouts pp2 --cuda-graphs none,local`` holds
graphed PP 2 to eager PP 2. What differs between two layouts is the order of reductions (BF16 GEMMs split
over TP, gradients summed over DP) and, for COAT, the data each per-tensor FP8 scale is taken
from (a TP rank's sequence slice, a DP rank's micro-batch): never the math.

The rule, fixed before any run it judges (``judge``): against the first layout,

- the first step's loss (the initial weights' forward on the first global batch) within
  ``FIRST_STEP_RELATIVE`` relative;
- every step's loss within ``DRIFT_ABSOLUTE`` absolute, or within ``BF16_DRIFT_FACTOR`` x BF16's
  own largest difference between the same two layouts (where the job ran bf16 too): a drift that
  BF16's own reduction order makes grow is no fault of the FP8 recipe.
"""

from __future__ import annotations

import re
import sys

from .probe import new_row, run_args, run_probe

FIRST_STEP_RELATIVE = 2e-3
DRIFT_ABSOLUTE = 0.05
BF16_DRIFT_FACTOR = 3.0

_SIZE = re.compile(r"^(tp|pp|vpp|dp)([1-9][0-9]*)$")


def measure(o, keep) -> None:
    """The ``layouts`` sub-command: every mode trained in every layout given, in each ``--cuda-graphs``
    configuration (each run in processes of its own), then one row per (mode, layout, configuration)
    judged against the first (``layout_rows``; a run is named LAYOUT/CONFIGURATION where there are several)."""
    preset, several = o.preset, len(o.cuda_graphs) > 1
    trained = [(layout, graphs) for layout in o.trained_layouts for graphs in o.cuda_graphs]
    names = [layout_name(*layout) + (f"/{graphs}" if several else "") for layout, graphs in trained]
    runs = {}
    for mode in o.modes:
        for ((tp, pp, vpp, dp), graphs), name in zip(trained, names):
            run = new_row("train", preset, mode, o, graphs)
            if run.get("status") != "skipped":
                print(f"{preset.name} {mode.name}: layout {name}", file=sys.stderr, flush=True)
                layout = (tp, pp, vpp, dp)
                line = run_args(o, preset, mode.name, graphs=graphs, micro_batch=preset.micro_batch, layout=layout)
                result = run_probe(line, tp * pp * dp, timeout_s=o.run_timeout)
                run = result.row if result.row is not None else {**run, "status": "failed", "reason": result.error}
            runs[(mode.name, name)] = {**run, "layout": name}
    for row in layout_rows(runs, names, [m.name for m in o.modes]):
        keep(row)


def parse_layouts(text: str) -> list[tuple[int, int, int, int]]:
    """``"1,tp2,tp2xdp2"`` -> [(TP, PP, VPP, DP), ...]; raises ValueError naming the form."""
    layouts = []
    for raw in text.split(","):
        name = raw.strip()
        sizes = {"tp": 1, "pp": 1, "vpp": 1, "dp": 1}
        if name != "1":
            seen = set()
            for part in name.split("x"):
                m = _SIZE.match(part)
                if m is None or m.group(1) in seen:
                    raise ValueError(
                        f"layout {name!r}: write 1 (one GPU) or x-joined sizes, each once, of tpN, ppN, vppN, dpN "
                        "(e.g. tp2xdp2)"
                    )
                seen.add(m.group(1))
                sizes[m.group(1)] = int(m.group(2))
        layout = (sizes["tp"], sizes["pp"], sizes["vpp"], sizes["dp"])
        if layout in layouts:
            raise ValueError(f"layout {name!r} is given twice")
        layouts.append(layout)
    return layouts


def layout_name(tp: int, pp: int, vpp: int, dp: int) -> str:
    """(2, 1, 1, 2) -> "tp2xdp2"; (1, 1, 1, 1) -> "1"."""
    parts = [f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("vpp", vpp), ("dp", dp)) if v > 1]
    return "x".join(parts) or "1"


def largest_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def judge(reference: list[float], losses: list[float], bf16_drift: float | None) -> dict:
    """The rule (module docstring) for one layout's losses against the reference layout's: the
    measured differences, the bound each is held to, and whether it holds."""
    first = abs(losses[0] - reference[0]) / abs(reference[0])
    drift = largest_difference(losses, reference)
    bound = DRIFT_ABSOLUTE if bf16_drift is None else max(DRIFT_ABSOLUTE, BF16_DRIFT_FACTOR * bf16_drift)
    return {
        "first_step_relative": first,
        "first_step_ok": first <= FIRST_STEP_RELATIVE,
        "drift": drift,
        "drift_bound": bound,
        "drift_ok": drift <= bound,
        "bf16_drift": bf16_drift,
        "agrees": first <= FIRST_STEP_RELATIVE and drift <= bound,
    }


def layout_rows(runs: dict[tuple[str, str], dict], layouts: list[str], modes: list[str]) -> list[dict]:
    """One ``kind: layout`` row per (mode, layout) from the runs' rows (keyed (mode, layout name)),
    each judged against the first layout's run of the same mode; a run that did not finish (or
    whose reference did not) is a failed row with the reason."""
    rows = []
    reference = layouts[0]
    for mode in modes:
        for name in layouts:
            run = runs[(mode, name)]
            row = {
                "kind": "layout",
                "mode": mode,
                "layout": name,
                "reference": reference,
                **{k: run.get(k) for k in ("preset", "family", "spec", "device", "seed", "graphs") if k in run},
            }
            ref = runs[(mode, reference)]
            if run.get("status") != "ok" or ref.get("status") != "ok":
                why = run if run.get("status") != "ok" else ref
                rows.append(
                    {**row, "status": "failed", "reason": f"{why.get('layout', name)}: {why.get('reason', '')}"}
                )
                continue
            row.update(status="ok", losses=run["losses"], tokens_per_s=run.get("tokens_per_s"))
            if name != reference:
                bf16, bf16_ref = runs.get(("bf16", name), {}), runs.get(("bf16", reference), {})
                bf16_drift = None
                if mode != "bf16" and bf16.get("status") == "ok" and bf16_ref.get("status") == "ok":
                    bf16_drift = largest_difference(bf16["losses"], bf16_ref["losses"])
                row.update(judge(ref["losses"], run["losses"], bf16_drift))
            rows.append(row)
    return rows
