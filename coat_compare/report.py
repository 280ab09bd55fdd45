"""The report: JSON lines (one object per measurement), markdown tables with ratios, the goals.

Row kinds (the ``kind`` field): ``layer`` (one transformer layer), ``train`` (end to end at one
micro-batch), ``search`` (the largest micro-batch that fits), ``resume`` (the checkpoint-resume
check), ``goal``. Every measurement row has ``preset``, ``mode``, ``family`` (bf16 / te-fp8 /
coat), ``tp``, ``dp``, ``status`` ("ok", "skipped", "oom", "failed") and, unless ok, ``reason``.
One table per preset, kind and layout (TP x DP). Ratios in the tables are this row / the
reference row: "vs BF16" the best BF16 row, "vs best TE" the best TE FP8 row of the same table
(least time or memory, most tokens/s), so below 1 is better for time and memory and above 1 for
tokens/s. Tables of runs on several GPUs add the per-GPU columns and the all-gather bytes.
"""

from __future__ import annotations

import json
import os
import sys

from .flops import FORMULA, FORMULA_FULL_ATTN
from .goals import NOT_APPLICABLE, Goal, best, evaluate, group_name, groups, layout
from .layouts import BF16_DRIFT_FACTOR, DRIFT_ABSOLUTE, FIRST_STEP_RELATIVE
from .plots import draw


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


class RowLog:
    """The rows of a job as they come: each appended to ``{out}/{name}.partial.jsonl`` as soon as it
    is measured (and flushed to disk), so that a job that dies later keeps every row it measured;
    ``finish`` deletes that file once the whole report (``write_report``) is written. With
    ``enabled`` False (a probe, a rank other than 0) the rows are kept in memory only."""

    SUFFIX = ".partial.jsonl"

    def __init__(self, out: str, name: str, enabled: bool = True):
        self.rows: list[dict] = []
        self.path = os.path.join(out, name + self.SUFFIX) if enabled else None
        if self.path:
            os.makedirs(out, exist_ok=True)
            open(self.path, "w").close()

    def add(self, row: dict) -> dict:
        """Keep ``row`` and append it to the file; returns it."""
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return row

    def finish(self) -> None:
        if self.path and os.path.exists(self.path):
            os.remove(self.path)


def write_markdown_and_rows(out: str, name: str, text: str, rows: list[dict]) -> None:
    """``{out}/{name}.md`` (``text``) and ``{out}/{name}.jsonl`` (``rows``), then print the text:
    how the benchmark scripts hand in their results."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text)
    write_jsonl(os.path.join(out, f"{name}.jsonl"), rows)
    print(text)


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


def _not_ok(row: dict, columns: int, lead: list[str]) -> str:
    reason = str(row.get("reason", "")).replace("|", "/").replace("\n", " ")
    return "| " + " | ".join(lead) + f" | {row['status']}: {reason} |" + " |" * (columns - len(lead) - 1)


def _table(head: list[str], rows: list[dict], lines_of, lead=lambda r: [r["mode"]]) -> list[str]:
    """A markdown table: the header, then ``lines_of(row)`` (a list of lines) for each row that
    ran, and for each row that did not, its ``lead`` cells and its status and reason."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines += lines_of(r) if r["status"] == "ok" else [_not_ok(r, len(head), lead(r))]
    return lines


def _mode_and_graphs(r: dict) -> list[str]:
    return [r["mode"], _graphs(r)]


def _graphs(r: dict) -> str:
    """The CUDA graph configuration, and under pipeline parallelism what ran it: TE's per-layer
    graphs, or none (the row's ``cuda_graph_note`` says why)."""
    impl = {"transformer_engine": " (TE's)", "none": " (eager)"}.get(r.get("cuda_graph_impl"), "")
    return r.get("graphs", "none") + (impl if r.get("graphs") == "local" else "")


def _several_gpus(rows: list[dict]) -> bool:
    tp, pp, _, dp = layout(rows[0])
    return tp * pp * dp > 1


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def _gathers(r: dict, bf16: dict | None) -> str:
    """SP all-gather MiB (FP8 part) | vs BF16."""
    return (
        f"{_mib(r.get('sp_all_gather_bytes'))} ({_mib(r.get('sp_all_gather_fp8_bytes'))}) | "
        f"{_ratio(r, bf16, 'sp_all_gather_bytes')}"
    )


TFLOPS_HEAD = "model TFLOP/s per GPU: Megatron's causal count (full-attention count)"
MFU_HEAD = "MFU BF16 / FP8 (Megatron's count)"


def _before_megatron_count(r: dict) -> bool:
    """A layer or train row written before coat-compare took Megatron's count (2026-11-28): its
    ``model_tflops_per_gpu`` and MFU are of the full-attention count, and it has no
    ``model_tflops_per_gpu_full_attn``. (A search row copies only ``model_tflops_per_gpu`` and MFU,
    so an old one cannot be told apart.)"""
    return (
        r.get("kind") in ("layer", "train")
        and r.get("model_tflops_per_gpu") is not None
        and "model_tflops_per_gpu_full_attn" not in r
    )


def _tflops(r: dict) -> str:
    """Megatron's causal count, then the full-attention count in brackets (``coat_compare.flops``)."""
    if r.get("model_tflops_per_gpu") is None:
        return "-"
    if _before_megatron_count(r):
        return f"- ({_fmt(r['model_tflops_per_gpu'], 0)})"
    return f"{_fmt(r['model_tflops_per_gpu'], 0)} ({_fmt(r.get('model_tflops_per_gpu_full_attn'), 0)})"


def layer_table(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok"]
    bf16_t, te_t = best(ok, "bf16", "ms"), best(ok, "te-fp8", "ms")
    bf16_m, te_m = best(ok, "bf16", "activation_MiB"), best(ok, "te-fp8", "activation_MiB")
    bf16_g = best(ok, "bf16", "sp_all_gather_bytes")
    current = next((r for r in ok if r["mode"] == "te-fp8-current"), None)
    several = _several_gpus(rows)
    head = [
        "mode",
        "spec",
        "fwd+bwd ms",
        "vs BF16",
        "vs TE FP8 current",
        "vs best TE",
        TFLOPS_HEAD,
        MFU_HEAD,
        "activation MiB",
        "vs BF16",
        "vs best TE",
    ]
    if several:
        head += ["SP all-gather MiB (FP8)", "vs BF16"]

    def lines_of(r):
        line = (
            f"| {r['mode']} | {r['spec']} | {_fmt(r['ms'])} | {_ratio(r, bf16_t, 'ms')} | {_ratio(r, current, 'ms')} | {_ratio(r, te_t, 'ms')} | "
            f"{_tflops(r)} | {_mfu(r)} | "
            f"{_fmt(r['activation_MiB'], 1)} | {_ratio(r, bf16_m, 'activation_MiB')} | {_ratio(r, te_m, 'activation_MiB')} |"
        )
        return [line + (f" {_gathers(r, bf16_g)} |" if several else "")]

    return _table(head, rows, lines_of)


def _mfu(r: dict) -> str:
    """Of Megatron's count; "-" for a row that has only the full-attention count's."""
    if r.get("mfu_bf16") is None or _before_megatron_count(r):
        return "-"
    return f"{100 * r['mfu_bf16']:.1f}% / {100 * r['mfu_fp8']:.1f}%"


def _spread(r: dict) -> str:
    """(slowest - fastest) / median of the timed steps, in percent: a host-bound (eager) step on a shared
    host varies by tens of percent between steps and between runs."""
    steps = sorted(r.get("step_ms_per_step") or [])
    if len(steps) < 2 or not r.get("step_ms"):
        return "-"
    return f"{100 * (steps[-1] - steps[0]) / r['step_ms']:.0f}%"


def train_table(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok"]
    bf16_s, te_s = best(ok, "bf16", "tokens_per_s", lowest=False), best(ok, "te-fp8", "tokens_per_s", lowest=False)
    bf16_m, te_m = best(ok, "bf16", "peak_MiB"), best(ok, "te-fp8", "peak_MiB")
    bf16_g = best(ok, "bf16", "sp_all_gather_bytes")
    several = _several_gpus(rows)
    head = [
        "mode",
        "CUDA graphs",
        "micro-batch",
        "global batch",
        "step ms",
        "step spread",
        "tokens/s",
        "vs BF16",
        "vs best TE",
        TFLOPS_HEAD,
        MFU_HEAD,
        "peak MiB",
        "vs BF16",
        "vs best TE",
        "weights MiB",
        "grads MiB",
        "optimizer MiB",
        "activations MiB",
        "optimizer B/param",
        "loss first -> last",
        "valid loss",
    ]
    if several:
        head += [
            "tokens/s per GPU",
            "peak MiB per GPU",
            "peak MiB per pipeline stage",
            "optimizer MiB per GPU",
            "SP all-gather MiB/step (FP8)",
            "vs BF16",
            "DP all-gather MiB/step",
        ]

    def lines_of(r):
        line = (
            f"| {r['mode']} | {_graphs(r)} | {r['micro_batch']} | {_fmt(r.get('global_batch', r['micro_batch'] * r.get('dp', 1)), 0)} | "
            f"{_fmt(r['step_ms'])} | {_spread(r)} | {_fmt(r['tokens_per_s'], 0)} | {_ratio(r, bf16_s, 'tokens_per_s')} | "
            f"{_ratio(r, te_s, 'tokens_per_s')} | {_tflops(r)} | {_mfu(r)} | {_fmt(r['peak_MiB'], 1)} | {_ratio(r, bf16_m, 'peak_MiB')} | {_ratio(r, te_m, 'peak_MiB')} | "
            f"{_fmt(r['weights_MiB'], 1)} | {_fmt(r['grads_MiB'], 1)} | {_fmt(r['optimizer_MiB'], 1)} | {_fmt(r['activations_MiB'], 1)} | "
            f"{_fmt(r['optimizer_bytes_per_param'])} | {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} | {_fmt(r.get('valid_loss'), 4)} |"
        )
        if several:
            line += (
                f" {_fmt(r.get('tokens_per_s_per_gpu'), 0)} | {' / '.join(_fmt(v, 1) for v in r.get('peak_MiB_per_rank', []))} | "
                f"{' / '.join(_fmt(v, 1) for v in r.get('peak_MiB_per_stage', []))} | "
                f"{' / '.join(_fmt(v, 1) for v in r.get('optimizer_MiB_per_rank', []))} | {_gathers(r, bf16_g)} | {_mib(r.get('dp_all_gather_bytes'))} |"
            )
        return [line]

    return _table(head, rows, lines_of, _mode_and_graphs)


BUDGET_PARTS = [
    ("weights", "weights"),
    ("fp8_copies", "FP8 copies"),
    ("grads", "grads"),
    ("master_weights", "master weights"),
    ("states", "optimizer states"),
]


def budget_table(rows: list[dict]) -> list[str]:
    """Bytes per parameter each GPU holds between steps, by part (``memory.static_parts``)."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("bytes_per_param")]
    if not ok:
        return []
    bf16_m = best(ok, "bf16", "peak_MiB")
    head = [
        "mode",
        "CUDA graphs",
        *[name for _, name in BUDGET_PARTS],
        "counted",
        "other",
        "activations MiB",
        "peak MiB",
        "reserved MiB",
        "vs BF16",
    ]

    def lines_of(r):
        b = r["bytes_per_param"]
        counted = sum(b.get(k, 0.0) for k, _ in BUDGET_PARTS)
        return [
            f"| {r['mode']} | {_graphs(r)} | "
            + " | ".join(_fmt(b.get(k)) for k, _ in BUDGET_PARTS)
            + f" | {_fmt(counted)} | {_fmt(b.get('other'))} | {_fmt(r['activations_MiB'], 1)} | {_fmt(r['peak_MiB'], 1)} | "
            f"{_fmt(r.get('peak_reserved_MiB'), 1)} | {_ratio(r, bf16_m, 'peak_MiB')} |"
        ]

    return _table(head, ok, lines_of, _mode_and_graphs)


def search_table(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s") is not None]
    bf16_s, te_s = best(ok, "bf16", "tokens_per_s", lowest=False), best(ok, "te-fp8", "tokens_per_s", lowest=False)
    several = _several_gpus(rows)
    head = [
        "mode",
        "CUDA graphs",
        "largest micro-batch",
        "tokens/s there",
        "vs BF16",
        "vs best TE",
        "model TFLOP/s per GPU (Megatron's causal count)",
        MFU_HEAD,
        "peak MiB there",
        "tries",
        "note",
    ]
    if several:
        head.insert(4, "tokens/s per GPU")

    def lines_of(r):
        tries = ", ".join(f"{t['micro_batch']}{'+' if t['fits'] else 'x'}" for t in r["tries"])
        first = r["tries"][0]["micro_batch"] if r["tries"] else 1
        notes = [r.get("stopped") or (f"does not fit at micro-batch {first}" if r["largest_micro_batch"] == 0 else "")]
        if r.get("micro_batches_per_step", 1) > 1:
            notes.append(f"{r['micro_batches_per_step']} micro-batches per step")
        note = "; ".join(n for n in notes if n)
        per_gpu = f" {_fmt(r.get('tokens_per_s_per_gpu'), 0)} |" if several else ""
        return [
            f"| {r['mode']} | {r.get('graphs', 'none')} | {r['largest_micro_batch']} | {_fmt(r.get('tokens_per_s'), 0)} |{per_gpu} "
            f"{_ratio(r, bf16_s, 'tokens_per_s')} | {_ratio(r, te_s, 'tokens_per_s')} | {_fmt(r.get('model_tflops_per_gpu'), 0)} | "
            f"{_mfu(r)} | {_fmt(r.get('peak_MiB'), 1)} | {tries} | {note} |"
        ]

    return _table(head, rows, lines_of, _mode_and_graphs)


def resume_table(rows: list[dict]) -> list[str]:
    """One line per step after the checkpoint: the uninterrupted loss and the resumed ones."""
    ok = next((r for r in rows if r.get("status") == "ok"), rows[0])
    names = ok.get("resumed", [])
    head = ["mode", "step", f"uninterrupted ({ok.get('saved_at', '-')})"]
    for name in names:
        head += [f"resumed at {name[len('resumed_') :]}", "difference"]

    def lines_of(r):
        lines = []
        after = r["losses_uninterrupted"][r["save_step"] :]
        for i, loss in enumerate(after):
            cells = [f"{r['losses_' + n][i]:.5f} | {r['losses_' + n][i] - loss:+.1e}" for n in names]
            lines.append(f"| {r['mode']} | {r['save_step'] + i + 1} | {loss:.5f} | {' | '.join(cells)} |")
        summary = [f"| max {r['max_abs_diff_' + n]:.1e}" + (" (bit-exact)" if r["exact_" + n] else "") for n in names]
        return lines + [
            f"| {r['mode']} | all | saved after step {r['save_step']} ({r['checkpoint_format']}) | {' | '.join(summary)} |"
        ]

    return _table(head, rows, lines_of)


def layout_table(rows: list[dict]) -> list[str]:
    """One line per (mode, layout): its losses against the first layout's, judged by the rule
    written before the runs (``coat_compare.layouts``)."""
    head = [
        "mode",
        "layout",
        "loss first -> last",
        "tokens/s",
        "first step vs reference (relative)",
        "largest step difference",
        "BF16's own",
        "bound",
        "agrees",
    ]

    def lines_of(r):
        losses = f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        if r["layout"] == r["reference"]:
            return [
                f"| {r['mode']} | {r['layout']} | {losses} | {_fmt(r.get('tokens_per_s'), 0)} | reference | | | | |"
            ]
        bf16 = "-" if r.get("bf16_drift") is None else f"{r['bf16_drift']:.2e}"
        return [
            f"| {r['mode']} | {r['layout']} | {losses} | {_fmt(r.get('tokens_per_s'), 0)} | "
            f"{r['first_step_relative']:.2e} (<= {FIRST_STEP_RELATIVE:g}) | {r['drift']:.2e} | {bf16} | "
            f"{r['drift_bound']:.3g} | {'yes' if r['agrees'] else 'NO'} |"
        ]

    return _table(head, rows, lines_of, lambda r: [r["mode"], r["layout"]])


def same_batch_table(rows: list[dict]) -> list[str]:
    """End-to-end runs of one preset and mode at DP > 1 and at DP 1 with the same global batch
    (micro-batch x DP), seq, steps and TP: how far apart their losses are. Empty when there are none."""

    def key(r):
        return (
            r["preset"],
            r["mode"],
            r.get("tp", 1),
            r["seq"],
            r["steps"],
            r.get("first_step", 0),
            r["micro_batch"] * r.get("dp", 1),
        )

    train = [r for r in rows if r.get("kind") == "train" and r.get("status") == "ok"]
    single = {key(r): r for r in train if r.get("dp", 1) == 1}
    lines = []
    for r in train:
        one = single.get(key(r))
        if r.get("dp", 1) == 1 or one is None:
            continue
        diffs = [abs(a - b) for a, b in zip(r["losses"], one["losses"])]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        lines.append(
            f"| {r['preset']} | {r['mode']} | {r.get('tp', 1)} | {key(r)[-1]} x {r['seq']} | {r['dp']} x {r['micro_batch']} | "
            f"{diffs[worst]:.1e} (step {r.get('first_step', 0) + worst + 1}) | {one['losses'][0]:.4f} / {r['losses'][0]:.4f} | "
            f"{one['losses'][-1]:.4f} / {r['losses'][-1]:.4f} |"
        )
    if not lines:
        return []
    head = [
        "preset",
        "mode",
        "TP",
        "global batch (sequences x seq)",
        "DP x micro-batch",
        "max loss difference to DP 1",
        "first loss DP 1 / DP n",
        "last loss DP 1 / DP n",
    ]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines]


def goals_table(goals: list[Goal]) -> list[str]:
    """met: yes, NO, n/a (not applicable here: a speed goal measured on a CPU) or - (not measured)."""
    lines = ["| goal | preset | target | measured | met | missed by | note |", "|---|---|---|---|---|---|---|"]
    for g in goals:
        met = ("n/a" if g.note.startswith(NOT_APPLICABLE) else "-") if g.met is None else ("yes" if g.met else "NO")
        lines.append(f"| {g.goal} | {g.preset} | {g.target} | {_fmt(g.measured)} | {met} | {g.missed_by} | {g.note} |")
    return lines


FLOPS_NOTE = (
    f"model TFLOP/s per GPU: tokens/s per GPU x FLOPs per token / 1e12, by {FORMULA}, the TFLOP/s Megatron's "
    f"training loop prints; in brackets by the full-attention count ({FORMULA_FULL_ATTN}; no causal halving, "
    "norms counted), coat-compare's before 2026-11-28, which a row written before then has alone (its MFU: -). "
    "MFU: Megatron's count over the GPU's dense BF16 / FP8 peak (H100 and H200 SXM: 989 / 1979 TFLOP/s; - where unknown)"
)
COLUMNS = {
    "layer": "fwd+bwd ms: median of one layer's forward + backward. activation MiB: memory the layer keeps for backward "
    "(GPU: allocated after the forward minus before, minus the output; CPU: bytes of the tensors saved for backward). "
    f"{FLOPS_NOTE}, with one layer's share of each count over the fwd+bwd time, divided by TP.",
    "train": "CUDA graphs: none (eager), local (Megatron's per-layer graphs) or full (a step's forward+backward in one graph); "
    "vs BF16 / vs best TE: against the fastest BF16 / TE FP8 row of any configuration. "
    "global batch: sequences per optimizer step (micro-batch x DP x accumulated micro-batches); "
    "step ms: median optimizer-step time after the warm-up steps; step spread: (slowest - fastest) / median of those "
    "steps (an eager step bound by its host varies by tens of percent on a shared host, and between runs: compare such "
    "rows over several runs); tokens/s: global tokens per second at that step time; "
    f"{FLOPS_NOTE}; "
    "peak MiB: most memory allocated at once (on a CPU: the sum of the parts); weights: BF16 parameters; grads: DDP's "
    "gradient buffers (FP32, or BF16 where the mode's CoatConfig says so: the coat default); optimizer: master weights + Adam states as stored; activations: peak during a step minus "
    "memory held between steps (CPU: bytes saved for backward); optimizer B/param: optimizer bytes per parameter; loss: training "
    "loss of the first and last step; valid loss: mean per-token loss on the held-out validation windows after the last step "
    "(- without validation: --eval-every 0, or CUDA graphs without --eval-every).",
    "search": "largest micro-batch: the largest that trains (doubling, then bisection, each try a fresh process; "
    "one micro-batch per optimizer step unless the note says more: --search-micro-batches); "
    "tries: micro-batches tried, + fits, x does not; tokens/s, model TFLOP/s per GPU (Megatron's causal count, as in "
    "the end-to-end table), MFU and peak at the largest.",
    "layout": "Every layout trains the same weights on the same global batches; the first is the reference. The rule, fixed "
    f"before the runs: the first step's loss within {FIRST_STEP_RELATIVE:g} relative, and every step's within "
    f"{DRIFT_ABSOLUTE:g} absolute or {BF16_DRIFT_FACTOR:g} x BF16's own largest difference between the same two layouts.",
    "resume": "A dist checkpoint written after the step named (its format in brackets), by the uninterrupted run; the resumed "
    "runs load it at each layout named and at the saving one, and train the same steps on the same global batches. "
    "difference: resumed minus uninterrupted loss.",
}
BUDGET_NOTE = (
    "Bytes each GPU holds between steps per parameter (of its model shard), counted from the tensors: weights (BF16 "
    "parameters), FP8 copies (COAT's per-linear weight caches), grads (DDP's buffers, FP32 or BF16), master weights "
    "(FP32 main params, TE's master params, COAT's split-master low words), optimizer states (moments as stored, with "
    "their scales); counted: their sum; other (GPU): allocated between steps beyond them (TE's FP8 weight copies, "
    "workspaces, RNG states). Activations and peak as in the table above; reserved MiB: the most memory the "
    "allocator took from the GPU (GPU only). With CUDA graphs the allocated peak misses the graphs' private pools (a "
    "captured tensor counts as freed though its memory stays taken for the replays): reserved is the footprint "
    "there, and the memory goals are judged on eager rows when the run has them."
)
SEVERAL_GPUS = (
    "On several GPUs: memory columns are rank 0's, except the per-GPU lists (rank 0 / rank 1 / ...) and peak MiB "
    "(the fullest GPU's); tokens/s is global. SP all-gather: bytes each rank sends per step (per fwd+bwd for a layer) "
    "in all-gathers over the tensor-parallel group (sequence parallel), with the 1-byte (FP8) part in brackets "
    "(- with CUDA graphs: a replayed layer's gathers make no Python call to count; the eager row has them); "
    "DP all-gather: the distributed optimizer's parameter gather."
)
TABLES = {
    "layer": layer_table,
    "train": train_table,
    "search": search_table,
    "resume": resume_table,
    "layout": layout_table,
}
TITLES = {
    "layer": "Per-layer",
    "train": "End to end",
    "search": "Largest micro-batch",
    "resume": "Checkpoint resume",
    "layout": "Parallel layouts against the first",
}


def markdown(title: str, header: list[str], rows: list[dict], goals: list[Goal], notes: list[str] = ()) -> str:
    """The report: a title, run facts, one table per (preset, kind), the goals, notes (plots)."""
    lines = [f"# {title}", "", *header, ""]
    for group in groups(rows):
        preset, tp, pp, _, dp = group
        for kind, table in TABLES.items():
            chosen = [r for r in rows if r.get("preset") == preset and layout(r) == group[1:] and r.get("kind") == kind]
            if chosen:
                first = chosen[0]
                shape = first.get("shape", "")
                several = tp * pp * dp > 1
                gpus = f"{tp * pp * dp} x " if several and kind != "resume" else ""
                notes_for = [COLUMNS[kind]] + ([SEVERAL_GPUS] if several and kind in ("layer", "train") else [])
                lines += [
                    f"## {TITLES[kind]}: {group_name(*group)} ({shape}) on {gpus}{first.get('device', '?')}",
                    "",
                    *table(chosen),
                    "",
                    *notes_for,
                    "",
                ]
                budget = budget_table(chosen) if kind == "train" else []
                if budget:
                    lines += [
                        f"### Bytes per parameter between steps: {group_name(*group)}",
                        "",
                        *budget,
                        "",
                        BUDGET_NOTE,
                        "",
                    ]
    same = same_batch_table(rows)
    if same:
        lines += [
            "## The same global batch at DP n and at DP 1",
            "",
            *same,
            "",
            "Each rank of DP n trains on its micro-batch of the global batch; DP 1 trains on all of it. The math is the same; "
            "the order of reductions differs, and for FP8 modes which micro-batch sets each per-tensor scale.",
            "",
        ]
    lines += ["## Goals", "", *goals_table(goals), ""]
    lines += list(notes)
    return "\n".join(lines).rstrip() + "\n"


def write_report(
    out: str, name: str, title: str, header: list[str], rows: list[dict], goals: list[Goal], notes: list[str]
) -> str:
    """``{out}/{name}.jsonl`` (rows, then goals) and ``{out}/{name}.md``, which it prints; returns its path."""
    os.makedirs(out, exist_ok=True)
    jsonl, md = os.path.join(out, f"{name}.jsonl"), os.path.join(out, f"{name}.md")
    write_jsonl(jsonl, rows + [g.as_row() for g in goals])
    text = markdown(title, header, rows, goals, notes)
    with open(md, "w") as f:
        f.write(text)
    print(text)
    return md


def report(out: str, name: str, header: str, rows: list[dict], plots: bool = True) -> None:
    """A job's report (``write_report``): ``header`` and what the rows trained on over the tables,
    the goals judged on the rows, the plots (``plots.draw``)."""
    os.makedirs(out, exist_ok=True)
    notes = []
    if plots:
        try:
            _, note = draw(out, name, rows)
        except Exception as e:  # noqa: BLE001 - a plot that fails must not cost the tables
            note = f"Plots failed ({type(e).__name__}: {e}); the tables hold every number."
        notes.append(note)
    md = write_report(out, name, f"coat-compare: {name}", [header, *data_lines(rows)], rows, evaluate(rows), notes)
    print(f"report: {md} (and {name}.jsonl)", file=sys.stderr)


def data_lines(rows: list[dict]) -> list[str]:
    """What the end-to-end rows trained and were validated on (corpus splits by SHA-256), one
    line per distinct corpus."""
    lines = []
    for r in rows:
        if r.get("kind") != "train" or r.get("status") != "ok" or "corpus" not in r:
            continue
        line = (
            f"Data: the {r['corpus']} corpus ({r['corpus_files']} files), train split {r['corpus_train_bytes']:,} bytes "
            f"(SHA-256 {r['corpus_train_sha256']}), validation split {r['corpus_valid_bytes']:,} bytes (SHA-256 {r['corpus_valid_sha256']}); "
            "each training window used at most once"
        )
        if r.get("eval_every"):
            line += (
                f"; validation loss on {r['eval_windows']} held-out windows of {r['seq'] + 1} bytes (SHA-256 {r['valid_windows_sha256'][:16]}) "
                f"every {r['eval_every']} steps and after the last"
            )
        if line + "." not in lines:
            lines.append(line + ".")
    return lines
