"""The accuracy protocol: which runs judge an FP8 recipe's validation loss against BF16, and the
rule that judges them, fixed before the runs.

A protocol names a preset and the settings every run takes (steps, batch, schedule, validation),
the seeds it declares, the runs of each seed and the metric. Its rule has two stages, in order:

1. The noise floor. BF16 against BF16, paired as the verdict pairs (the same initial weights; the
   gap (run - reference) / reference of the metric), in two kinds: ``bf16@run2``, the same seed and
   batches run again (only nondeterministic reductions differ), and ``bf16@data2``, another order
   of the training windows. Shown iff each kind has at least ``FLOOR_MIN_PAIRS`` pairs and the root
   mean square of its gaps is at most ``FLOOR_RMS``. A BF16-vs-BF16 gap has no sign of its own
   (which run is the reference is arbitrary), hence the root mean square, not the mean.
2. The verdict, only once the floor is shown: per mode the paired per-seed gaps to BF16 (same seed,
   same data order), their mean, standard error (sample standard deviation / sqrt(seeds)) and
   mean + 2 standard errors; the goals of ``GOALS`` on the declared seeds.

Until the floor is shown no gap of any other mode is printed: a verdict read before the floor is
known invites changing the protocol after seeing the answer. The protocols and the rule must not
change once runs exist; tests/compare/test_protocol.py pins both by value and by digest. A new
protocol gets a new name.

    python -m coat_compare.protocol show NAME            # the parameters, the rule and the runs in order
    python -m coat_compare.protocol flags NAME SEED KEY  # one run's coat-compare arguments (on a GPU)
    python -m coat_compare.protocol run NAME --out DIR [--seeds 1,2] [--keys bf16,coat]   # runs, one at a time
    python -m coat_compare.protocol judge NAME DIR       # the floor, then the verdict, from DIR's reports
    python -m coat_compare.protocol keep SOURCE... --into FILE   # a session's rows, into one committed file

A run key is a coat-compare mode with optional variants: ``MODE@epsE`` (Adam's epsilon E instead of
the protocol's), ``MODE@dataN`` (the N-th data order: data seed = seed + 1000 (N - 1)) and
``MODE@runN`` (the N-th run of the same seed, data and code; coat-compare's ``--repeat N``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass

from .corpus import DEFAULT_MAX_BYTES, POOL_SEED, VALID_FRACTION, VALIDATION_SEED
from .presets import get_preset

# The rule. Gaps are fractions of the BF16 reference's metric.
FLOOR_RMS = 0.0015  # BF16 against BF16: root mean square of the paired gaps, each kind
FLOOR_MIN_PAIRS = 4  # pairs of each kind before the floor counts as shown
FLOOR_KINDS = ("bf16@run2", "bf16@data2")  # the same seed run again; another data order
GOAL_MEAN = 0.0025  # the default COAT's mean paired gap
GOAL_UPPER = 0.005  # ... and its mean + 2 standard errors
GOAL_MIN_SEEDS = 6  # paired seeds the goals need
GOAL_MIN_PARAMS = 1_000_000_000  # the model the goals speak of
TE_MARGIN = 0.001  # the default COAT's mean gap at most TE FP8 delayed's + this, on the same seeds
DEFAULT_MODE = "coat"
TE_REFERENCE = "te-fp8-delayed"
REFERENCE = "bf16"
DATA_ORDER_STRIDE = 1000  # data seed of the N-th data order: seed + DATA_ORDER_STRIDE * (N - 1)
GOALS = (
    f"noise floor: BF16 against BF16, each kind ({', '.join(FLOOR_KINDS)}), root mean square of the paired gaps "
    f"<= {FLOOR_RMS:.2%} over >= {FLOOR_MIN_PAIRS} pairs",
    f"{DEFAULT_MODE}: mean paired gap <= {GOAL_MEAN:.2%} and mean + 2 se <= {GOAL_UPPER:.2%}, over >= {GOAL_MIN_SEEDS} "
    f"seeds, on a model of >= {GOAL_MIN_PARAMS / 1e9:g}B parameters",
    f"{DEFAULT_MODE}: mean paired gap <= {TE_REFERENCE}'s + {TE_MARGIN:.2%}, on the same >= {GOAL_MIN_SEEDS} seeds",
)


# The screen, fixed before its runs, after gpt-1b-accuracy's floor was missed: which candidate
# protocol is completed. Each candidate first runs the reference and the other data order at the
# screen's seeds; one passes when the root mean square of its SCREEN_KIND gaps over those seeds is at
# most SCREEN_BOUND (twice the floor's bound: two pairs estimate it to within about a factor of 2).
# Passing candidates are completed in the order of that root mean square (ties: the order below);
# one whose floor is then missed gives way to the next. The runs a screen makes are runs of the
# candidate's protocol: they count toward its floor.
SCREEN_CANDIDATES = ("gpt-1b-accuracy-lr1e-4", "gpt-1b-accuracy-lr5e-5", "gpt-1b-bytes-accuracy")
SCREEN_SEEDS = (1, 2)
SCREEN_KIND = "bf16@data2"
SCREEN_BOUND = 2 * FLOOR_RMS

# Where the loss goes, fixed before any verdict was read: a variant of the default (another mode of
# the protocol but TE's) is lower than the default when, over the declared seeds that have both, the
# mean of the paired differences (variant's gap - the default's gap, seed by seed) plus
# PART_SE standard errors is below zero, over >= GOAL_MIN_SEEDS seeds. Such a variant names a part
# of the loss, and only such a variant may become the default.
PART_SE = 2


@dataclass(frozen=True)
class Protocol:
    """Attributes:
    name: what ``NAME`` takes.
    preset: the coat-compare preset every run trains.
    settings: coat-compare options every run takes, as (option, value) pairs; each is checked
        against the rows (option ``--lr-decay`` -> field ``lr_decay``).
    graphs: ``--cuda-graphs`` of every run.
    seeds: the declared seeds: the verdict reads these and no other.
    floor_seeds: the seeds whose floor pairs (``FLOOR_KINDS``) run.
    modes: the run keys of every declared seed besides ``bf16`` (the reference), in run order.
    metric_last: the metric is the mean of the last this many validation losses.
    """

    name: str
    preset: str
    settings: tuple[tuple[str, object], ...]
    graphs: str
    seeds: tuple[int, ...]
    floor_seeds: tuple[int, ...]
    modes: tuple[str, ...]
    metric_last: int = 1
    description: str = ""

    def setting(self, option: str):
        return dict(self.settings)[option]

    def adam_eps(self) -> float:
        return get_preset(self.preset).adam_eps

    def runs(self) -> list[tuple[int, str]]:
        """(seed, key) of every run, in the order they should run: the floor's first (the
        references and the pairs), then the verdict's, one mode at a time over the seeds."""
        order = [(s, REFERENCE) for s in self.floor_seeds]
        order += [(s, k) for k in FLOOR_KINDS for s in self.floor_seeds]
        order += [(s, REFERENCE) for s in self.seeds if s not in self.floor_seeds]
        order += [(s, k) for k in self.modes for s in self.seeds]
        return order


def candidate(name: str, preset: str, lr: float, description: str) -> Protocol:
    """A protocol with gpt-1b-accuracy's steps, batch, schedule shape, validation, graphs, seeds and
    modes, on ``preset`` at peak learning rate ``lr``."""
    settings = (("--steps", 96), ("--micro-batch", 4), ("--global-batch", 128), ("--lr", lr))
    settings += (("--lr-warmup-steps", 24), ("--lr-decay", "linear"), ("--eval-every", 24), ("--eval-windows", 768))
    return Protocol(
        name,
        preset,
        settings=settings,
        graphs="local",
        seeds=(1, 2, 3, 4, 5, 6),
        floor_seeds=(1, 2, 3, 4),
        modes=("coat", "coat-fp32-grads", "coat@eps1e-05", "te-fp8-delayed"),
        description=description,
    )


PROTOCOLS: dict[str, Protocol] = {
    p.name: p
    for p in [
        Protocol(
            "gpt-1b-accuracy",
            "gpt-1b-accuracy",
            settings=(
                ("--steps", 96),
                ("--micro-batch", 4),
                ("--global-batch", 128),
                ("--lr", 3e-4),
                ("--lr-warmup-steps", 24),
                ("--lr-decay", "linear"),
                ("--eval-every", 24),
                ("--eval-windows", 768),
            ),
            graphs="local",
            seeds=(1, 2, 3, 4, 5, 6),
            floor_seeds=(1, 2, 3, 4),
            modes=("coat", "coat-fp32-grads", "coat@eps1e-05", "te-fp8-delayed"),
            description="1.005B parameters, 25.2M tokens (96 steps of 128 x 2048), warm-up 24 steps, linear decay to zero, "
            "final validation loss on 768 held-out windows; one run per GPU in one command (docs/accuracy.md)",
        ),
        # The candidates declared after gpt-1b-accuracy's floor was missed (0.69% and 2.44% rms): the
        # same tokens, schedule shape and validation; each data order trains the same windows
        # (a data pool); a lower peak learning rate, since same-seed runs part only once the rate
        # is at its peak. SCREEN_CANDIDATES picks which of them is completed.
        candidate(
            "gpt-1b-accuracy-lr1e-4",
            "gpt-1b-accuracy-pool",
            1e-4,
            "gpt-1b-accuracy with a data pool (each data order trains the same 12,288 windows) and a peak learning "
            "rate of 1e-4 (3x lower)",
        ),
        candidate(
            "gpt-1b-accuracy-lr5e-5",
            "gpt-1b-accuracy-pool",
            5e-5,
            "gpt-1b-accuracy with a data pool and a peak learning rate of 5e-5 (6x lower)",
        ),
        candidate(
            "gpt-1b-bytes-accuracy",
            "gpt-1b-bytes-accuracy",
            1e-4,
            "a 256-row vocabulary (the bytes the corpus has) and 20 layers (1.029B parameters), a data pool, peak "
            "learning rate 1e-4",
        ),
        Protocol(
            "tiny-accuracy",
            "tiny",
            settings=(
                ("--steps", 8),
                ("--micro-batch", 4),
                ("--global-batch", 8),
                ("--lr", 3e-3),
                ("--lr-warmup-steps", 2),
                ("--lr-decay", "linear"),
                ("--eval-every", 4),
                ("--eval-windows", 16),
            ),
            graphs="none",
            seeds=(1, 2),
            floor_seeds=(1, 2),
            modes=("coat",),
            description="the same machinery on a CPU in a minute: a dry run, never a verdict (the model is too small)",
        ),
    ]
}


def get_protocol(name: str) -> Protocol:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}") from None


def rule_constants() -> dict:
    """Everything the rule's outcome depends on besides the protocol: its bounds, and how the
    held-out windows are drawn."""
    return {
        "FLOOR_RMS": FLOOR_RMS,
        "FLOOR_MIN_PAIRS": FLOOR_MIN_PAIRS,
        "FLOOR_KINDS": list(FLOOR_KINDS),
        "GOAL_MEAN": GOAL_MEAN,
        "GOAL_UPPER": GOAL_UPPER,
        "GOAL_MIN_SEEDS": GOAL_MIN_SEEDS,
        "GOAL_MIN_PARAMS": GOAL_MIN_PARAMS,
        "TE_MARGIN": TE_MARGIN,
        "DEFAULT_MODE": DEFAULT_MODE,
        "TE_REFERENCE": TE_REFERENCE,
        "REFERENCE": REFERENCE,
        "DATA_ORDER_STRIDE": DATA_ORDER_STRIDE,
        "VALID_FRACTION": VALID_FRACTION,
        "VALIDATION_SEED": VALIDATION_SEED,
        "DEFAULT_MAX_BYTES": DEFAULT_MAX_BYTES,
    }


def digest(value) -> str:
    """SHA-256 of ``value`` as canonical JSON: what the frozen-constants test pins."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()


LATER_PRESET_FIELDS = {"data_pool": None}  # preset fields added after protocols were pinned, and their defaults


def protocol_digest(protocol: Protocol) -> str:
    """The protocol with its preset's every field: a change to either changes the runs. A field
    added to presets later counts only where a preset sets it (the pinned digests stay valid), and
    a data pool with the seed that picks its windows."""
    fields = asdict(get_preset(protocol.preset)).items()
    preset = {k: v for k, v in fields if k not in LATER_PRESET_FIELDS or v != LATER_PRESET_FIELDS[k]}
    value = {"protocol": asdict(protocol), "preset": preset}
    if preset.get("data_pool") is not None:
        value["pool_seed"] = POOL_SEED
    return digest(value)


KEY = re.compile(
    r"(?P<mode>[a-z0-9][a-z0-9.-]*?)(?:@eps(?P<eps>[0-9.e+-]+))?(?:@data(?P<order>\d+))?(?:@run(?P<run>\d+))?"
)


@dataclass(frozen=True)
class Key:
    mode: str
    adam_eps: float | None = None  # None: the protocol's
    order: int = 1
    run: int = 1

    def __str__(self) -> str:
        return (
            self.mode
            + (f"@eps{self.adam_eps:g}" if self.adam_eps is not None else "")
            + (f"@data{self.order}" if self.order > 1 else "")
            + (f"@run{self.run}" if self.run > 1 else "")
        )


def parse_key(text: str) -> Key:
    """``"coat@eps1e-05"`` -> Key("coat", 1e-5); ``"bf16@data2"`` -> Key("bf16", order=2)."""
    match = KEY.fullmatch(text)
    if match is None or int(match["order"] or 1) < 1 or int(match["run"] or 1) < 1:
        raise ValueError(f"run key {text!r} is not MODE[@epsE][@dataN][@runN] (e.g. coat, coat@eps1e-05, bf16@data2)")
    try:
        eps = None if match["eps"] is None else float(match["eps"])
    except ValueError:
        raise ValueError(f"run key {text!r}: {match['eps']!r} is not a number") from None
    return Key(match["mode"], eps, int(match["order"] or 1), int(match["run"] or 1))


def flags(protocol: Protocol, seed: int, keys: list[str]) -> list[str]:
    """The coat-compare arguments (without ``--out`` and ``--name``) of the runs ``keys`` of
    ``seed``, one job: keys that differ in their mode alone."""
    parsed = [parse_key(k) for k in keys]
    k = parsed[0]
    if any((p.adam_eps, p.order, p.run) != (k.adam_eps, k.order, k.run) for p in parsed):
        raise ValueError(f"runs {', '.join(keys)} differ in more than their mode: one coat-compare job each")
    argv = ["--preset", protocol.preset, "--modes", ",".join(p.mode for p in parsed), "--seed", str(seed)]
    argv += ["--data-seed", str(seed + DATA_ORDER_STRIDE * (k.order - 1))]
    for option, value in protocol.settings:
        argv += [option, str(value)]
    argv += ["--cuda-graphs", protocol.graphs]
    if k.adam_eps is not None:
        argv += ["--adam-eps", repr(k.adam_eps)]
    if k.run > 1:
        argv += ["--repeat", str(k.run)]
    return argv


def run_name(protocol: Protocol, seed: int, keys: list[str]) -> str:
    """The report name of one job: its files are ``seedS/NAME.*`` under the protocol's folder."""
    parsed = [parse_key(k) for k in keys]
    variant = str(parsed[0])[len(parsed[0].mode) :].replace("@", "-")
    return f"{protocol.name}-{'+'.join(p.mode for p in parsed)}{variant}-seed{seed}"


# -- reading the reports --------------------------------------------------------------------------


def is_report(name: str) -> bool:
    """A finished coat-compare report (``NAME.jsonl``); a partial one (``.partial.jsonl``) is not."""
    return name.endswith(".jsonl") and not name.endswith(".partial.jsonl")


def train_rows(lines) -> list[dict]:
    """The train rows among a report's lines."""
    return [row for row in map(json.loads, filter(str.strip, lines)) if row.get("kind") == "train"]


def read_rows(directory: str | list[str]) -> list[tuple[str, dict]]:
    """(file, row) of every train row in the reports (``*.jsonl``, any depth) under ``directory``
    (or under each of a list of them)."""
    if not isinstance(directory, str):
        return [r for d in directory for r in read_rows(d)]
    rows = []
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            if is_report(name):
                path = os.path.join(root, name)
                with open(path) as f:
                    rows += [(path, row) for row in train_rows(f)]
    return rows


def keep(sources: list[str], into: str) -> list[dict]:
    """Append to ``into`` (JSON lines) each run's row (``kind`` train; a failed run's too: the
    judge names it and leaves it out) found in ``sources`` that it does not hold yet, and return
    those rows. A source is a folder of reports (any depth), a report (``.jsonl``) or a pack of
    them (``.tgz``, as ``--each-gpu`` returns them); partial reports (``.partial.jsonl``) are not
    read. Each kept row drops its per-step timings (``step_ms_per_step``: the bulk of a row, and no
    rule reads them); a row equal to one already in ``into`` (or met twice in the sources) is kept
    once."""

    def rows_of(source: str) -> list[dict]:
        if os.path.isdir(source):
            return [r for _, r in read_rows(source)]
        if source.endswith((".tgz", ".tar.gz")):
            with tarfile.open(source) as pack:
                members = sorted(
                    (m for m in pack.getmembers() if m.isfile() and is_report(m.name)), key=lambda m: m.name
                )
                return [r for m in members for r in train_rows(pack.extractfile(m).read().decode().splitlines())]
        if source.endswith(".jsonl"):
            with open(source) as f:
                return train_rows(f)
        raise ValueError(f"{source}: not a folder of reports, a report (.jsonl) or a pack of them (.tgz)")

    def text(row: dict) -> str:
        return json.dumps({k: v for k, v in row.items() if k != "step_ms_per_step"}, sort_keys=True)

    seen = set()
    if os.path.exists(into):
        with open(into) as f:
            seen = {text(json.loads(line)) for line in f if line.strip()}
    added = []
    for source in sources:
        if not os.path.exists(source):
            raise ValueError(f"{source} does not exist")
        for row in rows_of(source):
            line = text(row)
            if line not in seen:
                seen.add(line)
                added.append(json.loads(line))
    if added:
        with open(into, "a") as f:
            f.writelines(text(r) + "\n" for r in added)
    return added


ROW_FIELDS = {"--steps": "steps", "--micro-batch": "micro_batch", "--global-batch": "global_batch", "--lr": "lr"}
ROW_FIELDS |= {"--lr-warmup-steps": "lr_warmup_steps", "--lr-decay": "lr_decay", "--eval-every": "eval_every"}
ROW_FIELDS |= {"--eval-windows": "eval_windows"}


def mismatch(protocol: Protocol, row: dict) -> str | None:
    """Why ``row`` is not a finished run of ``protocol``, or None."""
    if row.get("status") != "ok":
        return f"status {row.get('status')} ({row.get('reason', '')})"
    if row.get("preset") != protocol.preset:
        return f"preset {row.get('preset')}, not {protocol.preset}"
    expected = {ROW_FIELDS[o]: v for o, v in protocol.settings}
    expected |= {"graphs": protocol.graphs, "tp": 1, "pp": 1, "dp": 1, "deterministic": False, "first_step": 0}
    expected["lr_min_ratio"] = get_preset(protocol.preset).lr_min_ratio
    expected["data_pool"] = get_preset(protocol.preset).data_pool
    for field, value in expected.items():
        got = row.get(field, 0.1 if field == "lr_min_ratio" else None)  # rows before it was recorded: 0.1
        if got != value:
            return f"{field} {got}, the protocol's {value}"
    if len(row.get("losses", [])) != protocol.setting("--steps"):
        return f"{len(row.get('losses', []))} steps of losses, not {protocol.setting('--steps')}"
    valid = row.get("valid_losses") or []
    if len(valid) < protocol.metric_last or valid[-1][0] != protocol.setting("--steps"):
        return "no validation after the last step"
    if (row["data_seed"] - row["seed"]) % DATA_ORDER_STRIDE or row["data_seed"] < row["seed"]:
        return (
            f"data seed {row['data_seed']} is no data order of seed {row['seed']} (seed + {DATA_ORDER_STRIDE} (N - 1))"
        )
    return None


def row_key(protocol: Protocol, row: dict) -> str:
    eps = row.get("adam_eps", 1e-8)
    return str(
        Key(
            row["mode"],
            None if eps == protocol.adam_eps() else eps,
            (row["data_seed"] - row["seed"]) // DATA_ORDER_STRIDE + 1,
            row.get("repeat", 1),
        )
    )


def metric(protocol: Protocol, row: dict) -> float:
    """The mean of the last ``metric_last`` validation losses."""
    return statistics.fmean(loss for _, loss in row["valid_losses"][-protocol.metric_last :])


DATA_FIELDS = ("corpus_train_sha256", "corpus_valid_sha256", "valid_windows_sha256")


def collect(protocol: Protocol, rows: list[tuple[str, dict]]) -> tuple[dict[int, dict[str, dict]], list[str]]:
    """The protocol's runs by seed and key, and a line per row left out (and why). A (seed, key)
    with two rows is left out altogether: which one counts is not the judge's to pick."""
    runs: dict[int, dict[str, list[tuple[str, dict]]]] = {}
    notes = []
    declared = set(protocol.seeds) | set(protocol.floor_seeds)
    for path, row in rows:
        why = mismatch(protocol, row)
        if why is None and row["seed"] not in declared:
            why = f"seed {row['seed']} is not declared ({', '.join(map(str, sorted(declared)))})"
        if why is not None:
            notes.append(f"left out: {path} {row.get('mode')} seed {row.get('seed')}: {why}")
            continue
        runs.setdefault(row["seed"], {}).setdefault(row_key(protocol, row), []).append((path, row))
    out: dict[int, dict[str, dict]] = {}
    for seed, keys in sorted(runs.items()):
        for key, found in keys.items():
            if len(found) > 1:
                notes.append(
                    f"left out: seed {seed} {key} has {len(found)} rows ({', '.join(p for p, _ in found)}): keep one"
                )
            else:
                out.setdefault(seed, {})[key] = found[0][1]
    data = {tuple(r.get(f) for f in DATA_FIELDS) for keys in out.values() for r in keys.values()}
    if len(data) > 1:
        raise ValueError(
            f"the runs trained or validated on {len(data)} different corpora or validation sets "
            f"({'; '.join(str(d[2])[:16] for d in sorted(data, key=str))}): their losses do not compare; judge each set "
            "of runs made on one corpus apart"
        )
    return out, notes


# -- the rule -------------------------------------------------------------------------------------


def gaps_of(protocol: Protocol, runs: dict[int, dict[str, dict]], key: str, seeds) -> dict[int, float]:
    """Per seed that has both: (key's metric - BF16's) / BF16's, BF16 at the same seed and data order."""
    out = {}
    for seed in seeds:
        rows = runs.get(seed, {})
        if key in rows and REFERENCE in rows:
            ref = metric(protocol, rows[REFERENCE])
            out[seed] = (metric(protocol, rows[key]) - ref) / ref
    return out


def stats(gaps: dict[int, float]) -> dict:
    values = list(gaps.values())
    mean = statistics.fmean(values) if values else None
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {"gaps": gaps, "seeds": len(values), "mean": mean, "se": se, "upper": None if se is None else mean + 2 * se}


def floor(protocol: Protocol, runs: dict[int, dict[str, dict]]) -> dict:
    """Each kind's paired gaps and root mean square, and whether the floor is shown: ``shown`` is
    True (both kinds met over enough pairs), False (a kind missed it) or None (too few pairs)."""
    kinds = {}
    for kind in FLOOR_KINDS:
        gaps = gaps_of(protocol, runs, kind, protocol.floor_seeds)
        rms = math.sqrt(statistics.fmean(g * g for g in gaps.values())) if gaps else None
        enough = len(gaps) >= FLOOR_MIN_PAIRS
        kinds[kind] = {"gaps": gaps, "pairs": len(gaps), "rms": rms, "met": None if not enough else rms <= FLOOR_RMS}
    met = [k["met"] for k in kinds.values()]
    shown = False if False in met else None if None in met else True
    return {"kinds": kinds, "shown": shown}


def params_of(runs: dict[int, dict[str, dict]]) -> int | None:
    counts = {r.get("params") for keys in runs.values() for r in keys.values()}
    return min((c for c in counts if c is not None), default=None)


def verdict(protocol: Protocol, runs: dict[int, dict[str, dict]]) -> dict:
    """Per mode the paired gaps over the declared seeds, and each goal: met True/False, or None
    (not judged) with the reason."""
    modes = {k: stats(gaps_of(protocol, runs, k, protocol.seeds)) for k in protocol.modes}
    params = params_of(runs)
    coat = modes.get(DEFAULT_MODE)
    goals = []
    why = None
    if coat is None or coat["seeds"] < GOAL_MIN_SEEDS:
        why = (
            f"{0 if coat is None else coat['seeds']} paired seed(s) of {DEFAULT_MODE}; the goal needs {GOAL_MIN_SEEDS}"
        )
    elif params is None or params < GOAL_MIN_PARAMS:
        why = f"the model has {params:,} parameters; the goal speaks of >= {GOAL_MIN_PARAMS:,}"
    if why:
        goals.append({"goal": GOALS[1], "met": None, "note": why})
    else:
        misses = [f"mean {coat['mean']:+.3%} above {GOAL_MEAN:.2%}"] * (coat["mean"] > GOAL_MEAN)
        misses += [f"mean + 2 se {coat['upper']:+.3%} above {GOAL_UPPER:.2%}"] * (coat["upper"] > GOAL_UPPER)
        goals.append({"goal": GOALS[1], "met": not misses, "note": "; ".join(misses)})
    te = gaps_of(protocol, runs, TE_REFERENCE, protocol.seeds)
    both = sorted(set(te) & set((coat or {"gaps": {}})["gaps"]))
    if len(both) < GOAL_MIN_SEEDS:
        goals.append(
            {"goal": GOALS[2], "met": None, "note": f"{len(both)} seed(s) with both; the goal needs {GOAL_MIN_SEEDS}"}
        )
    elif params < GOAL_MIN_PARAMS:
        goals.append({"goal": GOALS[2], "met": None, "note": why})
    else:
        c, t = statistics.fmean(coat["gaps"][s] for s in both), statistics.fmean(te[s] for s in both)
        goals.append(
            {
                "goal": GOALS[2],
                "met": c <= t + TE_MARGIN,
                "note": f"{DEFAULT_MODE} {c:+.3%} against {TE_REFERENCE} {t:+.3%} + {TE_MARGIN:.2%} over seeds "
                + ", ".join(map(str, both)),
            }
        )
    return {"modes": modes, "params": params, "goals": goals, "against_default": against_default(protocol, runs)}


def against_default(protocol: Protocol, runs: dict[int, dict[str, dict]]) -> dict[str, dict]:
    """Per variant of the default (every mode of the protocol but the default and TE): the paired
    differences of its gap to the default's over the declared seeds with both, their statistics, and
    ``lower``: True where mean + ``PART_SE`` standard errors < 0 over >= ``GOAL_MIN_SEEDS`` seeds,
    None where too few seeds."""
    default = gaps_of(protocol, runs, DEFAULT_MODE, protocol.seeds)
    out = {}
    for key in protocol.modes:
        if key in (DEFAULT_MODE, TE_REFERENCE):
            continue
        gaps = gaps_of(protocol, runs, key, protocol.seeds)
        d = stats({s: gaps[s] - default[s] for s in sorted(set(gaps) & set(default))})
        enough = d["seeds"] >= GOAL_MIN_SEEDS
        d["lower"] = None if not enough else d["mean"] + PART_SE * d["se"] < 0
        out[key] = d
    return out


def judge(protocol: Protocol, directory: str | list[str]) -> tuple[dict, list[str]]:
    """The judgement of the runs in ``directory``, and its report as lines: the floor first; the
    verdict (per mode's gaps and the goals) only where the floor is shown."""
    runs, notes = collect(protocol, read_rows(directory))
    result = {"protocol": protocol.name, "floor": floor(protocol, runs), "verdict": None}
    where = directory if isinstance(directory, str) else ", ".join(directory)
    lines = [f"# Accuracy protocol {protocol.name}: {where}", "", *notes, ""] if notes else []
    lines = lines or [f"# Accuracy protocol {protocol.name}: {where}", ""]
    lines += [f"Rule (coat_compare.protocol, fixed before the runs): {GOALS[0]}.", ""]
    for kind, k in result["floor"]["kinds"].items():
        per_seed = ", ".join(f"seed {s} {g:+.3%}" for s, g in k["gaps"].items()) or "no pairs"
        state = "not judged" if k["met"] is None else "met" if k["met"] else "MISSED"
        rms = "-" if k["rms"] is None else f"{k['rms']:.3%}"
        lines.append(f"- floor {kind}: {k['pairs']} pair(s), rms {rms}: {state} ({per_seed})")
    shown = result["floor"]["shown"]
    if shown is not True:
        others = sum(1 for keys in runs.values() for key in keys if key != REFERENCE and key not in FLOOR_KINDS)
        lines += [
            "",
            (
                f"Floor not shown: each kind needs {FLOOR_MIN_PAIRS} pairs or more (seeds "
                f"{', '.join(map(str, protocol.floor_seeds))})"
                if shown is None
                else f"Floor missed: BF16 against BF16 differs by more than {FLOOR_RMS:.2%} rms; this protocol cannot "
                "resolve the goals, whatever the runs show"
            )
            + f". No verdict; the gaps of the {others} run(s) of other modes are not shown.",
        ]
        return result, lines
    result["verdict"] = v = verdict(protocol, runs)
    lines += [
        "",
        f"Floor shown. Paired gaps to BF16 (metric: mean of the last {protocol.metric_last} validation(s)):",
        "",
    ]
    lines += ["| mode | " + " | ".join(f"seed {s}" for s in protocol.seeds) + " | mean | se | mean + 2 se |"]
    lines += ["|---|" + "---|" * (len(protocol.seeds) + 3)]
    for key, m in v["modes"].items():
        cells = [f"{m['gaps'][s]:+.3%}" if s in m["gaps"] else "-" for s in protocol.seeds]
        numbers = [m[f] for f in ("mean", "se", "upper")]
        cells += ["-" if x is None else f"{x:+.3%}" for x in numbers]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", f"Goals ({v['params']:,} parameters):", ""]
    for g in v["goals"]:
        state = "not judged" if g["met"] is None else "**met**" if g["met"] else "**NOT met**"
        lines.append(f"- {g['goal']}: {state}" + (f" ({g['note']})" if g["note"] else ""))
    lines += [
        "",
        f"Where the loss goes: each variant's gap minus {DEFAULT_MODE}'s, seed by seed; lower when mean + {PART_SE} se < 0 "
        f"over >= {GOAL_MIN_SEEDS} seeds:",
        "",
        "| variant | seeds | mean | se | mean + 2 se | lower than the default |",
        "|---|---|---|---|---|---|",
    ]
    for key, d in v["against_default"].items():
        numbers = ["-" if d[f] is None else f"{d[f]:+.3%}" for f in ("mean", "se", "upper")]
        state = "not judged" if d["lower"] is None else "**yes**" if d["lower"] else "no"
        lines.append(f"| {key} | {d['seeds']} | " + " | ".join(numbers) + f" | {state} |")
    return result, lines


# -- the screen: which candidate protocol is completed ---------------------------------------------


def screen(rows: list[tuple[str, dict]]) -> list[dict]:
    """Per candidate of ``SCREEN_CANDIDATES``, in order: its ``SCREEN_KIND`` gaps at the screen's
    seeds, their root mean square, whether the screen is complete and passed, its floor and its
    runs (by seed and key)."""
    out = []
    for name in SCREEN_CANDIDATES:
        protocol = get_protocol(name)
        runs, _ = collect(protocol, rows)
        gaps = gaps_of(protocol, runs, SCREEN_KIND, SCREEN_SEEDS)
        complete = len(gaps) == len(SCREEN_SEEDS)
        rms = math.sqrt(statistics.fmean(g * g for g in gaps.values())) if gaps else None
        out.append(
            {
                "protocol": name,
                "gaps": gaps,
                "rms": rms,
                "complete": complete,
                "passed": complete and rms <= SCREEN_BOUND,
                "floor": floor(protocol, runs)["shown"],
                "runs": runs,
            }
        )
    return out


def next_runs(rows: list[tuple[str, dict]]) -> tuple[list[tuple[str, int, str]], str]:
    """The runs to make next, as (protocol, seed, key) in order, and why: first every candidate's
    missing screen runs; once the screen is complete, the missing runs of the passing candidate
    with the lowest root mean square whose floor is not missed (the floor's first, in the order
    ``Protocol.runs`` gives)."""
    results = screen(rows)
    missing = [
        (r["protocol"], seed, key)
        for r in results
        for seed in SCREEN_SEEDS
        for key in (REFERENCE, SCREEN_KIND)
        if key not in r["runs"].get(seed, {})
    ]
    if missing:
        return missing, f"the screen: {len(missing)} run(s) missing"
    passing = sorted((r for r in results if r["passed"]), key=lambda r: r["rms"])
    if not passing:
        return [], (
            f"no candidate passed the screen ({SCREEN_KIND} rms <= {SCREEN_BOUND:.2%}): "
            + ", ".join(f"{r['protocol']} {r['rms']:.3%}" for r in results)
        )
    for r in passing:
        if r["floor"] is False:
            continue
        protocol = get_protocol(r["protocol"])
        todo = [(r["protocol"], s, k) for s, k in protocol.runs() if k not in r["runs"].get(s, {})]
        if todo:
            return todo, f"{r['protocol']} (screen rms {r['rms']:.3%}): {len(todo)} run(s) missing"
        return [], f"{r['protocol']}: every run is made; judge it"
    return [], "every passing candidate's floor is missed: " + ", ".join(r["protocol"] for r in passing)


def screen_lines(rows: list[tuple[str, dict]]) -> list[str]:
    lines = [
        f"Screen (coat_compare.protocol, fixed before its runs): {SCREEN_KIND} at seeds "
        f"{', '.join(map(str, SCREEN_SEEDS))}, root mean square <= {SCREEN_BOUND:.2%} passes; the passing candidate "
        "with the lowest is completed first.",
        "",
    ]
    for r in screen(rows):
        gaps = ", ".join(f"seed {s} {g:+.3%}" for s, g in r["gaps"].items()) or "no pairs"
        state = "incomplete" if not r["complete"] else "passed" if r["passed"] else "failed"
        rms = "-" if r["rms"] is None else f"{r['rms']:.3%}"
        floor_state = {True: "shown", False: "MISSED", None: "not yet shown"}[r["floor"]]
        lines.append(f"- {r['protocol']}: rms {rms} ({gaps}): {state}; floor {floor_state}")
    todo, why = next_runs(rows)
    lines += ["", f"Next: {why}", *[f"  {p} seed {s} {k}" for p, s, k in todo]]
    return lines


# -- the command line -----------------------------------------------------------------------------


def show(protocol: Protocol) -> list[str]:
    preset = get_preset(protocol.preset)
    tokens = protocol.setting("--steps") * protocol.setting("--global-batch") * preset.seq
    return [
        f"protocol {protocol.name}: {protocol.description}",
        f"preset {protocol.preset}: {preset.description}",
        f"every run: coat-compare --preset {protocol.preset} "
        + " ".join(f"{o} {v}" for o, v in protocol.settings)
        + f" --cuda-graphs {protocol.graphs} ({tokens:,} tokens; learning rate down to {preset.lr_min_ratio:g} x the peak)",
        f"metric: the mean of the last {protocol.metric_last} validation loss(es); gap (mode - BF16) / BF16 per seed",
        f"seeds {', '.join(map(str, protocol.seeds))}; floor pairs at seeds {', '.join(map(str, protocol.floor_seeds))}",
        *[f"rule: {g}" for g in GOALS],
        f"runs, in order ({len(protocol.runs())}):",
        *[f"  seed {s} {k}" for s, k in protocol.runs()],
    ]


def run(protocol: Protocol, out: str, seeds: list[int], keys: list[str] | None) -> int:
    """Each run of ``seeds`` x ``keys`` (default: all of the protocol's) without a finished row in
    ``out``, one coat-compare process at a time; the runs of a seed that differ in their mode alone
    share one process (on a GPU, give one key per GPU instead: ``scripts/gpu_evidence.sh``)."""
    done, _ = collect(protocol, read_rows(out)) if os.path.isdir(out) else ({}, [])
    jobs: dict[tuple, list[str]] = {}
    for seed, key in protocol.runs():
        if seed in seeds and (keys is None or key in keys) and key not in done.get(seed, {}):
            k = parse_key(key)
            jobs.setdefault((seed, k.adam_eps, k.order, k.run), []).append(key)
    for (seed, *_), names in jobs.items():
        folder = os.path.join(out, f"seed{seed}")
        name = run_name(protocol, seed, names)
        argv = [*flags(protocol, seed, names), "--out", folder, "--name", name, "--no-plots"]
        print(f"seed {seed} {', '.join(names)}: coat-compare {' '.join(argv)}", flush=True)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.log"), "w") as log:
            proc = subprocess.run([sys.executable, "-m", "coat_compare", *argv], stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            print(f"seed {seed}: coat-compare failed ({proc.returncode}): {folder}/{name}.log", file=sys.stderr)
            return proc.returncode
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("show").add_argument("name")
    f = sub.add_parser("flags")
    f.add_argument("name")
    f.add_argument("seed", type=int)
    f.add_argument("keys", help="run keys of one job, comma-separated (on a GPU: one)")
    r = sub.add_parser("run")
    r.add_argument("name")
    r.add_argument("--out", required=True)
    r.add_argument("--seeds", help="comma-separated (default: every seed of the protocol)")
    r.add_argument("--keys", help="comma-separated run keys (default: every run of the protocol)")
    j = sub.add_parser("judge")
    j.add_argument("name")
    j.add_argument("directory", nargs="+", help="folders of coat-compare reports (any depth)")
    j.add_argument("--json", help="also write the judgement here")
    c = sub.add_parser("screen", help="the screen of SCREEN_CANDIDATES, and the runs to make next")
    c.add_argument("directory", nargs="+")
    n = sub.add_parser("next", help="the runs to make next, one 'PROTOCOL SEED KEY' per line")
    n.add_argument("directory", nargs="+", help="folders of reports; one that does not exist counts as empty")
    n.add_argument("--index", type=int, help="only the run at this place in the list (nothing past its end)")
    k = sub.add_parser("keep", help="append a session's run rows to one file (per-step timings left out)")
    k.add_argument("source", nargs="+", help="folders of reports, reports (.jsonl) or packs of them (.tgz)")
    k.add_argument("--into", required=True, help="the JSON-lines file to append to (made if absent)")
    args = p.parse_args(argv)
    try:
        if args.command == "keep":
            added = keep(args.source, args.into)
            for r in added:
                print(
                    f"kept: {r.get('preset')} lr {r.get('lr')} seed {r.get('seed')} data seed {r.get('data_seed')} "
                    f"{r.get('mode')}"
                    + (f" run {r['repeat']}" if r.get("repeat") else "")
                    + f": {r.get('status')}, valid {r.get('valid_loss')}"
                )
            print(f"{len(added)} row(s) added to {args.into}")
            return 0
        if args.command in ("screen", "next"):
            dirs = [d for d in args.directory if os.path.isdir(d)]
            if args.command == "screen":
                print("\n".join(screen_lines(read_rows(dirs))))
                return 0
            todo, why = next_runs(read_rows(dirs))
            print(why, file=sys.stderr)
            if args.index is not None:
                todo = todo[args.index : args.index + 1] if args.index >= 0 else []
            print("\n".join(f"{p} {s} {k}" for p, s, k in todo))
            return 0
        protocol = get_protocol(args.name)
        if args.command == "show":
            print("\n".join(show(protocol)))
        elif args.command == "flags":
            print(" ".join(flags(protocol, args.seed, args.keys.split(","))))
        elif args.command == "run":
            seeds = sorted(set(protocol.seeds) | set(protocol.floor_seeds))
            seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else seeds
            keys = [str(parse_key(k)) for k in args.keys.split(",")] if args.keys else None
            return run(protocol, args.out, seeds, keys)
        else:
            for d in args.directory:
                if not os.path.isdir(d):
                    raise ValueError(f"{d} is not a directory of coat-compare reports")
            result, lines = judge(protocol, args.directory)
            print("\n".join(lines))
            if args.json:
                with open(args.json, "w") as out:
                    json.dump(result, out, indent=1, default=str)
    except ValueError as e:
        print(f"coat_compare.protocol: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
