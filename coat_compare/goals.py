"""The goals of the comparison, judged on measured rows.

Each goal names the measured ratio, the target, whether it is met and, if not, by how much it is
missed (relative to the target). A goal whose rows are missing is listed as not measured, with the
command that measures it. Ratios use the ``coat`` mode (COAT's default recipe); "best BF16" /
"best TE FP8" are the best row of that family in the same preset (least memory, least time, most
tokens/s), and of the coat rows the best too: with ``--cuda-graphs`` every mode is judged in its
fastest configuration. "The fastest COAT configuration" is the fastest row of any COAT recipe
(``CONFIGURATIONS``), so that the default is held against what it gives up for memory.

Speed goals (tokens/s, time ratios) are GPU goals: judged on rows measured on a CPU they are not
applicable (``met`` None, the ratio still shown). Memory goals are judged on a CPU too: there the
bytes are counted from the tensors (weights, gradients, optimizer states, tensors saved for
backward), which is what the ratios compare.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

COAT = "coat"
# COAT recipes that differ from the default in bytes or speed only (not the ablations): the
# default is judged against the fastest of them. Rows written before coat-mem became the default
# ("coat-mem") are the default's recipe; "coat-min" rows (before 2026-11-25's two-H100 run) are the
# default's recipe since then.
CONFIGURATIONS = ("coat", "coat-mem", "coat-codes", "coat-cached", "coat-min", "coat-fp32-grads", "coat-fp32")
DEFAULT_NAMES = ("coat", "coat-mem")
SPEED_KEYS = ("tokens_per_s", "ms", "step_ms")
NOT_APPLICABLE = "not applicable"


@dataclass
class Goal:
    goal: str
    preset: str
    target: str
    measured: float | str | None
    met: bool | None
    missed_by: str = ""
    note: str = ""

    def as_row(self) -> dict:
        return {"kind": "goal", **asdict(self)}


def layout(row: dict) -> tuple[int, int, int, int]:
    """(TP, PP, VPP, DP) of a row; rows written before the job took --tp/--pp/--dp ran on one GPU."""
    return row.get("tp", 1), row.get("pp", 1), row.get("vpp", 1), row.get("dp", 1)


ONE_GPU = (1, 1, 1, 1)


def group_name(preset: str, tp: int, pp: int, vpp: int, dp: int) -> str:
    """What a table or a goal is about: the preset, and its layout when it is not one GPU."""
    if (tp, pp, vpp, dp) == ONE_GPU:
        return preset
    stages = f"PP {pp}" + (f" (x {vpp} virtual)" if vpp > 1 else "")
    return f"{preset} at TP {tp} x {stages} x DP {dp}"


def groups(rows: list[dict]) -> list[tuple[str, int, int, int, int]]:
    """(preset, TP, PP, VPP, DP) of the rows, in order of appearance: rows compare within one group only."""
    return list(dict.fromkeys((r["preset"], *layout(r)) for r in rows if "preset" in r))


def _ok(rows, group, kind):
    preset = group[0]
    return [
        r
        for r in rows
        if r.get("kind") == kind and r.get("preset") == preset and layout(r) == group[1:] and r.get("status") == "ok"
    ]


def _by_mode(rows) -> dict[str, dict]:
    return {r["mode"]: r for r in rows}


def _best_of_mode(rows: list[dict], mode: str, key: str, lowest: bool = True) -> dict | None:
    """The best row of ``mode`` by ``key`` (of its CUDA graph configurations)."""
    candidates = [r for r in rows if r.get("mode") == mode and r.get(key) is not None]
    if not candidates:
        return None
    return (min if lowest else max)(candidates, key=lambda r: r[key])


def _memory_rows(train: list[dict]) -> list[dict]:
    """The rows whose peak memory the memory goals compare: the eager ones when the run has any.
    Under CUDA graphs the allocator's peak misses the graphs' private pools (a tensor made during a
    capture counts as freed though the replays keep using its memory), so graphed peaks understate
    what a mode holds and do not compare with each other or with eager ones."""
    eager = [r for r in train if r.get("graphs", "none") == "none"]
    return eager or train


def best(rows: list[dict], family: str, key: str, lowest: bool = True) -> dict | None:
    """The best ``family`` row by ``key`` (lowest, or highest when ``lowest`` is False)."""
    candidates = [r for r in rows if r.get("family") == family and r.get(key) is not None]
    if not candidates:
        return None
    return (min if lowest else max)(candidates, key=lambda r: r[key])


def on_cpu(row: dict) -> bool:
    """Whether ``row`` was measured on a CPU (where the job counts memory from saved tensors)."""
    return row.get("device") == "CPU" or row.get("memory_source") == "saved-tensors"


def _ratio_goal(goal, preset, num, den, key, target, at_most, reference) -> Goal:
    """num[key] / den[key] against ``target`` (at most, or at least); ``reference`` names den."""
    if num is None or den is None:
        missing = "coat row" if num is None else f"{reference} row"
        return Goal(
            goal, preset, f"{'<=' if at_most else '>='} {target}", None, None, note=f"not measured: no {missing}"
        )
    ratio = num[key] / den[key]
    if on_cpu(num) or on_cpu(den):
        # a CPU has no GPU allocator (memory is counted from saved tensors, without the GPU's workspaces,
        # caches or fragmentation) and no GPU's speed: the ratio is shown, not judged
        what = "speed" if key in SPEED_KEYS else "memory"
        where = f"vs {den['mode']}; measured on {den.get('device', '?')}"
        return Goal(
            goal,
            preset,
            f"{'<=' if at_most else '>='} {target}",
            round(ratio, 4),
            None,
            note=f"{NOT_APPLICABLE}: {what} goals are judged on a GPU ({where})",
        )
    met = ratio <= target if at_most else ratio >= target
    missed = "" if met else f"{abs(ratio - target) / target:.1%} {'above' if at_most else 'below'} the target"
    where = (
        f"{den.get('device', '?')}, memory from {den['memory_source']}"
        if "memory_source" in den
        else den.get("device", "?")
    )
    if key == "peak_MiB" and den.get("graphs", "none") != "none":
        where += f"; CUDA graphs {den['graphs']}: the allocated peak, without the graphs' private pools"
    return Goal(
        goal,
        preset,
        f"{'<=' if at_most else '>='} {target}",
        round(ratio, 4),
        met,
        missed,
        f"vs {den['mode']}; {where}",
    )


def evaluate(rows: list[dict], every_goal: bool = False) -> list[Goal]:
    """The goals measurable from ``rows``; with ``every_goal`` (the summary) also those that are
    not, each with the command that measures it."""
    goals = []
    for group in groups(rows):
        preset = group_name(*group)
        layer = _ok(rows, group, "layer")
        if layer:
            goals += _layer_goals(layer, preset)
        train = _ok(rows, group, "train")
        if train:
            goals += _train_goals(train, preset)
        search = _ok(rows, group, "search")
        if search:
            goals += _search_goals(search, preset)
    if every_goal:
        measured = {g.goal for g in goals}
        goals += [
            Goal(goal, preset, target, None, None, note=f"not measured: {command}")
            for goal, preset, target, command in UNMEASURED
            if goal not in measured
        ]
    if every_goal or any(r.get("preset") == "llama2-7b" and layout(r) == ONE_GPU for r in rows):
        goals.append(_llama2_7b_fits(rows))
        goals.append(_fits_one_gpu(rows, "llama2-7b", 2, 12000.0, 16, "80 GB", "H100"))
    if every_goal or any(r.get("preset") == "llama2-13b" and layout(r) == ONE_GPU for r in rows):
        goals.append(_fits_one_gpu(rows, "llama2-13b", 2, None, None, "141 GB", "H200"))
    return goals


def _layer_goals(layer: list[dict], preset: str) -> list[Goal]:
    """The per-layer goals of one preset's layer rows: activation memory and time."""
    coat = _by_mode(layer).get(COAT)
    return [
        _ratio_goal(
            "per-layer activation memory vs the best BF16",
            preset,
            coat,
            best(layer, "bf16", "activation_MiB"),
            "activation_MiB",
            0.61,
            True,
            "BF16",
        ),
        _ratio_goal(
            "per-layer activation memory vs the best TE FP8 mode",
            preset,
            coat,
            best(layer, "te-fp8", "activation_MiB"),
            "activation_MiB",
            0.92,
            True,
            "TE FP8",
        ),
        _ratio_goal(
            "per-layer fwd+bwd time vs TE FP8 current scaling",
            preset,
            coat,
            _by_mode(layer).get("te-fp8-current"),
            "ms",
            0.90,
            True,
            "te-fp8-current",
        ),
    ]


def _train_goals(train: list[dict], preset: str) -> list[Goal]:
    """The end-to-end goals of one preset's training rows: peak memory and tokens/s at equal
    micro-batch, the default against the other COAT configurations, the start-up."""
    held = _memory_rows(train)
    coat = min((r for r in held if r["mode"] in DEFAULT_NAMES), key=lambda r: r["peak_MiB"], default=None)
    mb = coat["micro_batch"] if coat else None
    same = [r for r in train if r["micro_batch"] == mb]
    same_held = [r for r in held if r["micro_batch"] == mb]
    fastest = max((r for r in same if r["mode"] in DEFAULT_NAMES), key=lambda r: r["tokens_per_s"], default=None)
    coat_rows = [r for r in same if r["mode"] in CONFIGURATIONS]
    others = [r for r in coat_rows if r["mode"] not in DEFAULT_NAMES]
    goals = [
        _ratio_goal(
            "end-to-end peak memory vs BF16, equal micro-batch",
            preset,
            coat,
            best(same_held, "bf16", "peak_MiB"),
            "peak_MiB",
            0.55,
            True,
            "BF16",
        ),
        _ratio_goal(
            "end-to-end peak memory vs te-fp8-pa, equal micro-batch",
            preset,
            coat,
            _best_of_mode(same_held, "te-fp8-pa", "peak_MiB"),
            "peak_MiB",
            0.70,
            True,
            "te-fp8-pa",
        ),
        _ratio_goal(
            "tokens/s at equal micro-batch vs the best BF16, each in its fastest configuration",
            preset,
            fastest,
            best(same, "bf16", "tokens_per_s", lowest=False),
            "tokens_per_s",
            1.10,
            False,
            "BF16",
        ),
        _ratio_goal(
            "tokens/s at equal micro-batch vs the best TE FP8 mode, each in its fastest configuration",
            preset,
            fastest,
            best(same, "te-fp8", "tokens_per_s", lowest=False),
            "tokens_per_s",
            1.10,
            False,
            "TE FP8",
        ),
    ]
    if others:
        goals.append(
            _ratio_goal(
                "default coat tokens/s vs the fastest COAT configuration, equal micro-batch",
                preset,
                fastest,
                max(coat_rows, key=lambda r: r["tokens_per_s"]),
                "tokens_per_s",
                0.97,
                False,
                "fastest COAT",
            )
        )
    start_up = _start_up_goal(train, preset)
    if start_up is not None:
        goals.append(start_up)
    return goals


def _search_goals(search: list[dict], preset: str) -> list[Goal]:
    """The goals of one preset's micro-batch search rows: tokens/s at each mode's largest micro-batch."""
    fitted = [r for r in search if r.get("largest_micro_batch", 0) > 0]
    coat = _best_of_mode(fitted, COAT, "tokens_per_s", lowest=False)
    return [
        _ratio_goal(
            "tokens/s at each mode's largest micro-batch vs BF16",
            preset,
            coat,
            best(fitted, "bf16", "tokens_per_s", lowest=False),
            "tokens_per_s",
            1.5,
            False,
            "BF16",
        ),
        _ratio_goal(
            "tokens/s at each mode's largest micro-batch vs the best TE mode",
            preset,
            coat,
            best(fitted, "te-fp8", "tokens_per_s", lowest=False),
            "tokens_per_s",
            1.15,
            False,
            "TE FP8",
        ),
    ]


UNMEASURED = [
    (
        "per-layer activation memory vs the best BF16",
        "llama2-7b-layer",
        "<= 0.61",
        "coat-compare --preset llama2-7b-layer --modes all",
    ),
    (
        "per-layer activation memory vs the best TE FP8 mode",
        "llama2-7b-layer",
        "<= 0.92",
        "coat-compare --preset llama2-7b-layer --modes all",
    ),
    (
        "per-layer fwd+bwd time vs TE FP8 current scaling",
        "llama2-7b-layer",
        "<= 0.9",
        "coat-compare --preset llama2-7b-layer --modes all",
    ),
    ("end-to-end peak memory vs BF16, equal micro-batch", "gpt-1b", "<= 0.55", "coat-compare --preset gpt-1b"),
    ("end-to-end peak memory vs te-fp8-pa, equal micro-batch", "gpt-1b", "<= 0.7", "coat-compare --preset gpt-1b"),
    (
        "default coat tokens/s vs the fastest COAT configuration, equal micro-batch",
        "gpt-1b",
        ">= 0.97",
        "coat-compare --preset gpt-1b --micro-batch 4 --modes coat,coat-cached --cuda-graphs local",
    ),
    (
        "tokens/s at equal micro-batch vs the best BF16, each in its fastest configuration",
        "gpt-1b",
        ">= 1.1",
        "coat-compare --preset gpt-1b --micro-batch 4 --cuda-graphs none,local,full",
    ),
    (
        "tokens/s at equal micro-batch vs the best TE FP8 mode, each in its fastest configuration",
        "gpt-1b",
        ">= 1.1",
        "coat-compare --preset gpt-1b --micro-batch 4 --cuda-graphs none,local,full",
    ),
    (
        "tokens/s at each mode's largest micro-batch vs BF16",
        "gpt-1b",
        ">= 1.5",
        "coat-compare search --preset gpt-1b",
    ),
    (
        "tokens/s at each mode's largest micro-batch vs the best TE mode",
        "gpt-1b",
        ">= 1.15",
        "coat-compare search --preset gpt-1b",
    ),
]


def _llama2_7b_fits(rows: list[dict]) -> Goal:
    """COAT trains llama2-7b (micro-batch >= 1) on the GPU where BF16 does not fit, from the search
    rows or from end-to-end rows (BF16 out of memory)."""
    goal = "llama2-7b trains on one GPU with COAT where BF16 does not fit"
    coat = bf16 = None
    for r in rows:
        if r.get("preset") != "llama2-7b" or r.get("mode") not in (*DEFAULT_NAMES, "bf16") or layout(r) != ONE_GPU:
            continue
        if r.get("kind") == "search" and r.get("status") == "ok":
            fits = r["largest_micro_batch"] > 0
        elif r.get("kind") == "train" and r.get("status") in ("ok", "oom"):
            fits = r["status"] == "ok"
        else:
            continue
        if r["mode"] in DEFAULT_NAMES:
            coat = coat or fits
        else:
            bf16 = fits
    if coat is None or bf16 is None:
        return Goal(
            goal,
            "llama2-7b",
            "coat fits, bf16 does not",
            None,
            None,
            note="not measured: coat-compare search --preset llama2-7b --modes bf16,coat --search-max-micro-batch 1",
        )
    met = coat and not bf16
    missed = "" if met else ("COAT does not fit" if not coat else "BF16 fits too")
    return Goal(
        goal,
        "llama2-7b",
        "coat fits, bf16 does not",
        f"coat {'fits' if coat else 'OOM'}, bf16 {'fits' if bf16 else 'OOM'}",
        met,
        missed,
    )


def _fits_one_gpu(
    rows: list[dict],
    preset: str,
    micro_batch: int,
    tokens_per_s: float | None,
    global_batch: int | None,
    memory: str,
    gpu: str,
) -> Goal:
    """Default COAT trains ``preset`` on one ``gpu`` at ``micro_batch`` or more (and at least
    ``tokens_per_s``, at a global batch of ``global_batch`` sequences or more), judged on its
    end-to-end rows there (the largest micro-batch that ran)."""
    target = (
        f"micro-batch >= {micro_batch}"
        + (f", >= {tokens_per_s:.0f} tokens/s" if tokens_per_s else "")
        + (f" at global batch >= {global_batch}" if global_batch else "")
        + f" on one {memory} {gpu}"
    )
    goal = f"{preset} trains with default coat on one {memory} GPU"
    runs = [
        r
        for r in rows
        if r.get("preset") == preset
        and r.get("mode") in DEFAULT_NAMES
        and r.get("kind") == "train"
        and layout(r) == ONE_GPU
        and gpu in str(r.get("device", ""))
        and (global_batch is None or r.get("global_batch", r.get("micro_batch", 0)) >= global_batch)
    ]
    if not runs:
        batch = f" --global-batch {global_batch}" if global_batch else ""
        return Goal(
            goal,
            preset,
            target,
            None,
            None,
            note=f"not measured: coat-compare --preset {preset} --modes bf16,te-fp8-current,te-fp8-pa,coat --micro-batch {micro_batch}{batch} on an {gpu}",
        )
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return Goal(
            goal,
            preset,
            target,
            f"{runs[0]['status']} at micro-batch {runs[0]['micro_batch']}",
            False,
            "does not train",
            runs[0].get("reason", "")[:120],
        )
    top = max(ok, key=lambda r: (r["micro_batch"], r["tokens_per_s"]))
    met = top["micro_batch"] >= micro_batch and (tokens_per_s is None or top["tokens_per_s"] >= tokens_per_s)
    measured = (
        f"micro-batch {top['micro_batch']}, {top['tokens_per_s']:.0f} tokens/s, peak {top['peak_MiB'] / 1024:.1f} GiB"
    )
    missed = ""
    if not met:
        missed = (
            f"micro-batch {top['micro_batch']} < {micro_batch}"
            if top["micro_batch"] < micro_batch
            else f"{(tokens_per_s - top['tokens_per_s']) / tokens_per_s:.1%} below {tokens_per_s:.0f} tokens/s"
        )
    return Goal(goal, preset, target, measured, met, missed, top.get("device", "?"))


START_UP_STEPS = 10


def _start_up_goal(train: list[dict], preset: str) -> Goal | None:
    """No mode's training loss above ln(vocab), what uniform guessing scores, after the first
    ``START_UP_STEPS`` steps: a start-up spike past it means the run is not learning yet, and
    what it measures says nothing of accuracy. Judged on rows that ran longer than that."""
    rows = [r for r in train if r.get("vocab") and len(r.get("losses", [])) > START_UP_STEPS]
    if not rows:
        return None
    bound = math.log(rows[0]["vocab"])
    worst = max(rows, key=lambda r: max(r["losses"][START_UP_STEPS:]))
    peak = max(worst["losses"][START_UP_STEPS:])
    met = peak <= bound
    graphs = "" if worst.get("graphs", "none") == "none" else f" (graphs {worst['graphs']})"
    return Goal(
        f"training loss below ln(vocab) after step {START_UP_STEPS}, every mode",
        preset,
        f"<= {bound:.2f}",
        round(peak, 3),
        met,
        "" if met else f"{worst['mode']}{graphs} reaches {peak:.2f}",
        f"highest: {worst['mode']}{graphs}; warm-up {worst.get('lr_warmup_steps', '?')} steps",
    )
