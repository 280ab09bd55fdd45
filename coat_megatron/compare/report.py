"""The report: JSON lines (one object per measurement), markdown tables with ratios, the goals.

Row kinds (the ``kind`` field): ``layer`` (one transformer layer), ``train`` (end to end at one
micro-batch), ``search`` (the largest micro-batch that fits), ``goal``. Every measurement row has
``preset``, ``mode``, ``family`` (bf16 / te-fp8 / coat), ``status`` ("ok", "skipped", "oom",
"failed") and, unless ok, ``reason``. Ratios in the tables are this row / the reference row:
"vs BF16" the best BF16 row, "vs best TE" the best TE FP8 row of the same table (least time or
memory, most tokens/s), so below 1 is better for time and memory and above 1 for tokens/s.
"""

from __future__ import annotations

import json
import os

from .goals import Goal, best


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _fmt(value, digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _ratio(row: dict, ref: dict | None, key: str) -> str:
    if ref is None or row.get(key) is None or not ref.get(key):
        return "-"
    return f"{row[key] / ref[key]:.2f}"


def _not_ok(row: dict, columns: int) -> str:
    reason = str(row.get("reason", "")).replace("|", "/").replace("\n", " ")
    return f"| {row['mode']} | {row['status']}: {reason} |" + " |" * (columns - 2)


def layer_table(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok"]
    bf16_t, te_t = best(ok, "bf16", "ms"), best(ok, "te-fp8", "ms")
    bf16_m, te_m = best(ok, "bf16", "activation_MiB"), best(ok, "te-fp8", "activation_MiB")
    current = next((r for r in ok if r["mode"] == "te-fp8-current"), None)
    head = ["mode", "spec", "fwd+bwd ms", "vs BF16", "vs TE FP8 current", "vs best TE", "activation MiB", "vs BF16", "vs best TE"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(_not_ok(r, len(head)))
            continue
        lines.append(
            f"| {r['mode']} | {r['spec']} | {_fmt(r['ms'])} | {_ratio(r, bf16_t, 'ms')} | {_ratio(r, current, 'ms')} | {_ratio(r, te_t, 'ms')} | "
            f"{_fmt(r['activation_MiB'], 1)} | {_ratio(r, bf16_m, 'activation_MiB')} | {_ratio(r, te_m, 'activation_MiB')} |"
        )
    return lines


def train_table(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok"]
    bf16_s, te_s = best(ok, "bf16", "tokens_per_s", lowest=False), best(ok, "te-fp8", "tokens_per_s", lowest=False)
    bf16_m, te_m = best(ok, "bf16", "peak_MiB"), best(ok, "te-fp8", "peak_MiB")
    head = ["mode", "micro-batch", "step ms", "tokens/s", "vs BF16", "vs best TE", "peak MiB", "vs BF16", "vs best TE",
            "weights MiB", "grads MiB", "optimizer MiB", "activations MiB", "optimizer B/param", "loss first -> last"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(_not_ok(r, len(head)))
            continue
        lines.append(
            f"| {r['mode']} | {r['micro_batch']} | {_fmt(r['step_ms'])} | {_fmt(r['tokens_per_s'], 0)} | {_ratio(r, bf16_s, 'tokens_per_s')} | "
            f"{_ratio(r, te_s, 'tokens_per_s')} | {_fmt(r['peak_MiB'], 1)} | {_ratio(r, bf16_m, 'peak_MiB')} | {_ratio(r, te_m, 'peak_MiB')} | "
            f"{_fmt(r['weights_MiB'], 1)} | {_fmt(r['grads_MiB'], 1)} | {_fmt(r['optimizer_MiB'], 1)} | {_fmt(r['activations_MiB'], 1)} | "
            f"{_fmt(r['optimizer_bytes_per_param'])} | {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |"
        )
    return lines


def search_table(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s") is not None]
    bf16_s, te_s = best(ok, "bf16", "tokens_per_s", lowest=False), best(ok, "te-fp8", "tokens_per_s", lowest=False)
    head = ["mode", "largest micro-batch", "tokens/s there", "vs BF16", "vs best TE", "peak MiB there", "tries", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(_not_ok(r, len(head)))
            continue
        tries = ", ".join(f"{t['micro_batch']}{'+' if t['fits'] else 'x'}" for t in r["tries"])
        note = r.get("stopped") or ("does not fit at micro-batch 1" if r["largest_micro_batch"] == 0 else "")
        lines.append(
            f"| {r['mode']} | {r['largest_micro_batch']} | {_fmt(r.get('tokens_per_s'), 0)} | {_ratio(r, bf16_s, 'tokens_per_s')} | "
            f"{_ratio(r, te_s, 'tokens_per_s')} | {_fmt(r.get('peak_MiB'), 1)} | {tries} | {note} |"
        )
    return lines


def goals_table(goals: list[Goal]) -> list[str]:
    lines = ["| goal | preset | target | measured | met | missed by | note |", "|---|---|---|---|---|---|---|"]
    for g in goals:
        met = "-" if g.met is None else ("yes" if g.met else "NO")
        lines.append(f"| {g.goal} | {g.preset} | {g.target} | {_fmt(g.measured)} | {met} | {g.missed_by} | {g.note} |")
    return lines


COLUMNS = {
    "layer": "fwd+bwd ms: median of one layer's forward + backward. activation MiB: memory the layer keeps for backward "
    "(GPU: allocated after the forward minus before, minus the output; CPU: bytes of the tensors saved for backward).",
    "train": "step ms: median optimizer-step time after the warm-up steps; tokens/s: global tokens per second at that step time; "
    "peak MiB: most memory allocated at once (on a CPU: the sum of the parts); weights: BF16 parameters; grads: DDP's FP32 "
    "gradient buffers; optimizer: FP32 main parameters + Adam states as stored; activations: peak during a step minus "
    "memory held between steps (CPU: bytes saved for backward); optimizer B/param: optimizer bytes per parameter.",
    "search": "largest micro-batch: the largest that trains (doubling, then bisection, each try a fresh process); "
    "tries: micro-batches tried, + fits, x does not; tokens/s and peak at the largest.",
}
TABLES = {"layer": layer_table, "train": train_table, "search": search_table}
TITLES = {"layer": "Per-layer", "train": "End to end", "search": "Largest micro-batch"}


def markdown(title: str, header: list[str], rows: list[dict], goals: list[Goal], notes: list[str] = ()) -> str:
    """The report: a title, run facts, one table per (preset, kind), the goals, notes (plots)."""
    lines = [f"# {title}", "", *header, ""]
    for preset in dict.fromkeys(r["preset"] for r in rows if "preset" in r):
        for kind, table in TABLES.items():
            chosen = [r for r in rows if r.get("preset") == preset and r.get("kind") == kind]
            if chosen:
                first = chosen[0]
                shape = first.get("shape", "")
                lines += [f"## {TITLES[kind]}: {preset} ({shape}) on {first.get('device', '?')}", "", *table(chosen), "", COLUMNS[kind], ""]
    lines += ["## Goals", "", *goals_table(goals), ""]
    lines += list(notes)
    return "\n".join(lines).rstrip() + "\n"


def write_report(out: str, name: str, title: str, header: list[str], rows: list[dict], goals: list[Goal], notes: list[str]) -> tuple[str, str]:
    """``{out}/{name}.jsonl`` (rows, then goals) and ``{out}/{name}.md``; returns both paths."""
    os.makedirs(out, exist_ok=True)
    jsonl, md = os.path.join(out, f"{name}.jsonl"), os.path.join(out, f"{name}.md")
    write_jsonl(jsonl, rows + [g.as_row() for g in goals])
    with open(md, "w") as f:
        f.write(markdown(title, header, rows, goals, notes))
    return jsonl, md
