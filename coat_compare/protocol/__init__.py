"""The accuracy protocol: which runs judge an FP8 recipe's held-out loss against BF16, and the rule
that judges them, both fixed in code before the runs (tests/compare/test_protocol.py pins them by
value and by digest; a protocol that must change gets a new name).

The unit is the seed. Each seed's arms start from the same initial weights and train the same
batches in the same order; the paired difference of the default COAT recipe at seed i is

    d_i = (L_coat,i - L_bf16,i) / L_bf16,i     (L: the validation loss after the last step)

and the rule is a one-sided paired t-test on the d_i, declared before the runs:

- **pass** when mean(d) <= ``pass_mean`` and the one-sided 95% upper bound
  mean(d) + t(0.95, n-1) se <= ``pass_upper``;
- **fail** when the one-sided 95% lower bound mean(d) - t(0.95, n-1) se > ``fail_lower``;
- otherwise **inconclusive**, reported with its interval.

How many seeds: **the power gate**. Once the first ``power_after`` seeds are complete, the
standard deviation of their d_i (computed, and printed, without their mean) fixes n: the
declared ``seeds``, raised to ceil((sd / SE_TARGET)^2) where that is more, at most ``cap``.
Where even ``cap`` seeds leave se > SE_TARGET the protocol is **underpowered**, said before any
mean is read. No mean, of any arm, is printed before the n seeds are complete: a verdict read on
the way invites stopping when it looks good.

Reported beside the verdict, never gating it: TE FP8 delayed (its own d_i, and COAT - TE, at the
seeds that have it) with 95% intervals; the sanity arm ``bf16@run2`` (BF16 run again on the same
seed and batches: its d_i should straddle zero; one whose interval excludes zero says the harness
favours one run); and, where the protocol has a cool-down branch, the gap at the branch's shorter
annealed end, the paired growth d_i(final) - d_i(branch), and the compute-equivalent gap
eps_i = d_i / g_i, g_i the slope of BF16's log-loss against log-tokens between the two ends.

Why not a noise floor first: the loss difference of two runs that share weights and batches has a
standard deviation of about lambda x g (g: the end slope of log-loss against log-step, lambda a few
percent), which no in-budget 1B run brings under 0.15% (docs/accuracy.md); a gate on one noise
component at a fixed bound says nothing about the variance the verdict divides by.

    python -m coat_compare.protocol show NAME                   # parameters, rule, runs
    python -m coat_compare.protocol flags NAME SEED KEY SEGMENT  # one run's coat-compare arguments
    python -m coat_compare.protocol run NAME --state DIR --seeds 1-8 [--deadline S] [--per-device K]
    python -m coat_compare.protocol power NAME ROWS...          # the blinded power gate: sd and n, no mean
    python -m coat_compare.protocol judge NAME ROWS... [--json F]
    python -m coat_compare.protocol keep SOURCE... --into FILE   # a session's rows, into one committed file

ROWS and SOURCE: folders of coat-compare reports (any depth), reports or rows files (``.jsonl``,
``.jsonl.gz``) or packs of reports (``.tgz``). A run key is a coat-compare mode, or ``MODE@runN``: the N-th run of the same
seed, batches and code (coat-compare's ``--repeat N``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import re
import statistics
import tarfile
from dataclasses import asdict, dataclass

from ..corpus import DEFAULT_MAX_BYTES, VALID_FRACTION, VALIDATION_SEED
from ..presets import get_preset

# -- the rule's constants --------------------------------------------------------------------------

REFERENCE = "bf16"
DEFAULT_MODE = "coat"
TE_REFERENCE = "te-fp8-delayed"
SANITY = "bf16@run2"
CONFIDENCE = 0.95  # the one-sided bounds of the verdict
INTERVAL = 0.95  # the two-sided intervals reported beside it
SE_TARGET = 0.0009  # se that detects a true +0.25% with 80% power at one-sided 2.5%: 0.25% / 2.80


def rule_constants() -> dict:
    """Everything the rule's outcome depends on besides a protocol's own fields: the constants, and
    how the held-out windows are drawn."""
    return {
        "REFERENCE": REFERENCE,
        "DEFAULT_MODE": DEFAULT_MODE,
        "TE_REFERENCE": TE_REFERENCE,
        "SANITY": SANITY,
        "CONFIDENCE": CONFIDENCE,
        "INTERVAL": INTERVAL,
        "SE_TARGET": SE_TARGET,
        "VALID_FRACTION": VALID_FRACTION,
        "VALIDATION_SEED": VALIDATION_SEED,
        "DEFAULT_MAX_BYTES": DEFAULT_MAX_BYTES,
    }


# -- Student's t -----------------------------------------------------------------------------------


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _beta_regularized(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _beta_regularized(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = ``p`` (0 < p < 1), by bisection on ``t_cdf``."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile({p}, {df}): needs 0 < p < 1 and df >= 1")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def paired(d: dict[int, float]) -> dict:
    """The statistics of paired differences ``d`` (by seed): n, mean, sd, se, the one-sided
    ``CONFIDENCE`` bounds (``upper``, ``lower``) and the two-sided ``INTERVAL`` (``low``, ``high``);
    None where fewer than two seeds."""
    values = [d[s] for s in sorted(d)]
    out = {"d": dict(sorted(d.items())), "n": len(values), "mean": None, "sd": None, "se": None}
    out |= {"upper": None, "lower": None, "low": None, "high": None}
    if len(values) < 2:
        out["mean"] = values[0] if values else None
        return out
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    se = sd / math.sqrt(len(values))
    one, two = t_quantile(CONFIDENCE, len(values) - 1), t_quantile(0.5 + INTERVAL / 2, len(values) - 1)
    out |= {"mean": mean, "sd": sd, "se": se, "upper": mean + one * se, "lower": mean - one * se}
    out |= {"low": mean - two * se, "high": mean + two * se}
    return out


# -- the protocols ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    """A run key besides the reference, at the first ``seeds`` seeds of the protocol (None: every one)."""

    key: str
    seeds: int | None = None


@dataclass(frozen=True)
class Protocol:
    """Attributes:
    name: what ``NAME`` takes.
    preset: the coat-compare preset every run trains.
    settings: coat-compare options every run takes, as (option, value) pairs; each is checked
        against the rows (``--lr-decay`` -> the row's ``lr_decay``).
    graphs: ``--cuda-graphs`` of every run.
    seeds: the declared number of seeds (seeds 1..seeds); the power gate may raise it to ``cap``.
    cap: the most seeds the power gate may ask for.
    power_after: the seeds whose differences' standard deviation the power gate reads.
    arms: the run keys besides ``bf16`` (the reference), in run order.
    branch: (step, cooldown), or None: the run trains to ``step`` and saves (the trunk), then
        ``main`` goes on to the last step and ``branch`` cools down to zero over ``cooldown`` steps
        from the same checkpoint (``--lr-decay wsd``): a second annealed end from the same trunk.
    pass_mean, pass_upper, fail_lower: the verdict's bounds on the default's d (fractions); a
        ``fail_lower`` of None: the protocol can pass or not, never fail.
    te_margin: a goal beside the verdict: the default's mean d at most TE FP8 delayed's + this, on
        the seeds with both (None: no such goal).
    """

    name: str
    preset: str
    settings: tuple[tuple[str, object], ...]
    graphs: str
    seeds: int
    cap: int
    power_after: int
    arms: tuple[Arm, ...]
    branch: tuple[int, int] | None
    pass_mean: float | None
    pass_upper: float
    fail_lower: float | None
    te_margin: float | None = None
    description: str = ""

    def setting(self, option: str):
        return dict(self.settings)[option]

    def segments(self) -> tuple[str, ...]:
        """The runs one (seed, key) takes: ``full``; or ``trunk`` then ``main`` and ``branch``."""
        return ("trunk", "main", "branch") if self.branch else ("full",)

    def keys(self, seed: int) -> list[str]:
        """The run keys of ``seed``, the reference first."""
        return [REFERENCE] + [a.key for a in self.arms if a.seeds is None or seed <= a.seeds]


def wsd(steps: int, warmup: int, cooldown: int, lr: float, windows: int) -> tuple[tuple[str, object], ...]:
    """The settings of a warm-up-stable-decay run to zero, validated after the last step."""
    return (
        ("--steps", steps),
        ("--lr", lr),
        ("--lr-warmup-steps", warmup),
        ("--lr-decay", "wsd"),
        ("--lr-cooldown-steps", cooldown),
        ("--lr-min-ratio", 0.0),
        ("--eval-every", steps),
        ("--eval-windows", windows),
    )


PROTOCOLS: dict[str, Protocol] = {
    p.name: p
    for p in [
        Protocol(
            "gpt-125m-wsd",
            "gpt-125m",
            settings=(("--micro-batch", 8), ("--global-batch", 16), *wsd(1000, 100, 200, 6e-4, 1024)),
            graphs="none",
            seeds=16,
            cap=24,
            power_after=6,
            arms=(Arm("coat"), Arm("te-fp8-delayed", 8), Arm("bf16@run2", 4)),
            branch=(400, 100),
            pass_mean=0.0025,
            pass_upper=0.005,
            fail_lower=0.0025,
            te_margin=None,
            description="113.7M parameters, 1000 steps of 16 x 1024 tokens (16.4M), warm-up 100, the peak 6e-4 to step "
            "800, linear to zero at 1000; a cool-down branch from step 400 to zero at 500 (8.2M tokens); the loss on "
            "1024 held-out windows after each end; eager (the branch loads the trunk's checkpoint)",
        ),
        Protocol(
            "gpt-1b-check",
            "gpt-1b-accuracy",
            settings=(
                ("--micro-batch", 4),
                ("--global-batch", 32),
                ("--steps", 460),
                ("--lr", 3e-4),
                ("--lr-warmup-steps", 46),
                ("--lr-decay", "linear"),
                ("--lr-min-ratio", 0.0),
                ("--eval-every", 460),
                ("--eval-windows", 768),
            ),
            graphs="local",
            seeds=6,
            cap=6,
            power_after=6,
            arms=(Arm("coat"), Arm("te-fp8-delayed")),
            branch=None,
            pass_mean=None,
            pass_upper=0.01,
            fail_lower=None,
            te_margin=0.0025,
            description="1.005B parameters, 460 steps of 32 x 2048 tokens (30.1M), warm-up 46, linear to zero; the loss "
            "on 768 held-out windows after the last step; per-layer CUDA graphs; BF16, COAT and TE FP8 delayed at each "
            "seed: a coarse check at 1B (resolves about 1%, not 0.25%)",
        ),
        Protocol(
            "tiny-wsd",
            "tiny",
            settings=(("--micro-batch", 4), ("--global-batch", 8), *wsd(12, 2, 4, 3e-3, 16)),
            graphs="none",
            seeds=2,
            cap=3,
            power_after=2,
            arms=(Arm("coat"), Arm("bf16@run2", 1)),
            branch=(6, 3),
            pass_mean=0.0025,
            pass_upper=0.005,
            fail_lower=0.0025,
            description="the machinery on a CPU in a minute: a dry run, never a verdict",
        ),
    ]
}


def get_protocol(name: str) -> Protocol:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}") from None


def digest(value) -> str:
    """SHA-256 of ``value`` as canonical JSON: what the frozen-constants test pins."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()


def protocol_digest(protocol: Protocol) -> str:
    """The protocol with its preset's every field: a change to either changes the runs."""
    return digest({"protocol": asdict(protocol), "preset": asdict(get_preset(protocol.preset))})


# -- one run's command line ------------------------------------------------------------------------

KEY = re.compile(r"(?P<mode>[a-z0-9][a-z0-9.-]*?)(?:@run(?P<run>[1-9]\d*))?")


def parse_key(text: str) -> tuple[str, int]:
    """``"bf16@run2"`` -> ("bf16", 2); ``"coat"`` -> ("coat", 1)."""
    match = KEY.fullmatch(text)
    if match is None:
        raise ValueError(f"run key {text!r} is not MODE or MODE@runN (e.g. coat, bf16@run2)")
    return match["mode"], int(match["run"] or 1)


def segment_settings(protocol: Protocol, segment: str) -> dict[str, object]:
    """The coat-compare options of one segment: the protocol's, with the branch's own length and
    cool-down."""
    settings = dict(protocol.settings)
    if segment == "branch":
        step, cooldown = protocol.branch
        settings |= {"--steps": step + cooldown, "--lr-cooldown-steps": cooldown}
    return settings


def flags(protocol: Protocol, seed: int, key: str, segment: str, checkpoint: str | None = None) -> list[str]:
    """The coat-compare arguments (without ``--out`` and ``--name``) of one run: ``segment`` of
    ``protocol.segments()``; ``checkpoint``: the trunk's checkpoint directory (trunk, main, branch)."""
    if segment not in protocol.segments():
        raise ValueError(f"{protocol.name} runs the segments {', '.join(protocol.segments())}, not {segment!r}")
    if segment != "full" and not checkpoint:
        raise ValueError(f"the {segment} of {protocol.name} needs the trunk's checkpoint directory")
    mode, run = parse_key(key)
    argv = ["--preset", protocol.preset, "--modes", mode, "--seed", str(seed)]
    for option, value in segment_settings(protocol, segment).items():
        argv += [option, str(value)]
    argv += ["--cuda-graphs", protocol.graphs]
    if run > 1:
        argv += ["--repeat", str(run)]
    if segment == "trunk":
        argv += ["--save", checkpoint, "--save-step", str(protocol.branch[0]), "--stop-after-save"]
    elif segment in ("main", "branch"):
        argv += ["--load", checkpoint]
    return argv


def run_name(protocol: Protocol, seed: int, key: str, segment: str) -> str:
    """The report name of one run: ``seedS/NAME.*`` under the state directory."""
    return f"{protocol.name}-{key.replace('@', '-')}-seed{seed}-{segment}"


# -- reading rows ----------------------------------------------------------------------------------


def is_report(name: str) -> bool:
    """A finished coat-compare report (``NAME.jsonl``); a partial one (``.partial.jsonl``) is not."""
    return name.endswith(".jsonl") and not name.endswith(".partial.jsonl")


def train_rows(lines) -> list[dict]:
    """The train rows among a report's lines."""
    return [row for row in map(json.loads, filter(str.strip, lines)) if row.get("kind") == "train"]


def read_rows(sources: str | list[str]) -> list[tuple[str, dict]]:
    """(where, row) of every train row in ``sources``: folders of reports (any depth), reports
    (``.jsonl``; partial ones are not read) or packs of them (``.tgz``)."""
    if isinstance(sources, str):
        sources = [sources]
    rows = []
    for source in sources:
        if os.path.isdir(source):
            for root, _, files in sorted(os.walk(source)):
                for name in sorted(filter(is_report, files)):
                    with open(os.path.join(root, name)) as f:
                        rows += [(os.path.join(root, name), r) for r in train_rows(f)]
        elif source.endswith((".tgz", ".tar.gz")):
            with tarfile.open(source) as pack:
                members = sorted(
                    (m for m in pack.getmembers() if m.isfile() and is_report(m.name)), key=lambda m: m.name
                )
                for m in members:
                    lines = pack.extractfile(m).read().decode().splitlines()
                    rows += [(f"{source}:{m.name}", r) for r in train_rows(lines)]
        elif source.endswith((".jsonl", ".jsonl.gz")) and os.path.isfile(source):
            rows += [(source, r) for r in train_rows(read_lines(source))]
        else:
            raise ValueError(f"{source}: not a folder of reports, a report (.jsonl) or a pack of them (.tgz)")
    return rows


def read_lines(path: str) -> list[str]:
    """The lines of a JSON-lines file, gzip-compressed where its name ends in ``.gz``."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        return f.read().splitlines()


def keep(sources: list[str], into: str) -> list[dict]:
    """Append to ``into`` (JSON lines; gzip-compressed where it ends in ``.gz``, rewritten whole
    without a time stamp so that the same rows give the same bytes) each train row in ``sources`` (a
    failed run's too: the judge names it and leaves it out) that it does not hold yet, and return
    those rows. Each kept row drops its per-step timings (``step_ms_per_step``: no rule reads them);
    a row met twice is kept once."""

    def text(row: dict) -> str:
        return json.dumps({k: v for k, v in row.items() if k != "step_ms_per_step"}, sort_keys=True)

    held = [line for line in read_lines(into) if line.strip()] if os.path.exists(into) else []
    seen = {text(json.loads(line)) for line in held}
    added = []
    for source in sources:
        if not os.path.exists(source):
            raise ValueError(f"{source} does not exist")
        for _, row in read_rows(source):
            line = text(row)
            if line not in seen:
                seen.add(line)
                added.append(json.loads(line))
    if added and into.endswith(".gz"):
        lines = [text(json.loads(line)) for line in held] + [text(r) for r in added]
        with open(into, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write("".join(line + "\n" for line in lines).encode())
    elif added:
        with open(into, "a") as f:
            f.writelines(text(r) + "\n" for r in added)
    return added


ROW_FIELDS = {
    "--steps": "steps",
    "--micro-batch": "micro_batch",
    "--global-batch": "global_batch",
    "--lr": "lr",
    "--lr-warmup-steps": "lr_warmup_steps",
    "--lr-decay": "lr_decay",
    "--lr-cooldown-steps": "lr_cooldown_steps",
    "--lr-min-ratio": "lr_min_ratio",
    "--eval-every": "eval_every",
    "--eval-windows": "eval_windows",
}


def segment_of(protocol: Protocol, row: dict) -> str | None:
    """Which segment of ``protocol`` a row is, by where it started and stopped, or None."""
    first, last, steps = row.get("first_step"), row.get("last_step"), row.get("steps")
    if protocol.branch is None:
        return "full" if (first, last) == (0, protocol.setting("--steps")) else None
    step, cooldown = protocol.branch
    if (first, last, steps) == (0, step, protocol.setting("--steps")):
        return "trunk"
    if (first, last, steps) == (step, steps, protocol.setting("--steps")):
        return "main"
    if (first, last, steps) == (step, step + cooldown, step + cooldown):
        return "branch"
    return None


def mismatch(protocol: Protocol, row: dict) -> str | None:
    """Why ``row`` is not a finished run of ``protocol``, or None."""
    if row.get("status") != "ok":
        return f"status {row.get('status')} ({row.get('reason', '')})"
    if row.get("preset") != protocol.preset:
        return f"preset {row.get('preset')}, not {protocol.preset}"
    segment = segment_of(protocol, row)
    if segment is None:
        return (
            f"steps {row.get('first_step')}..{row.get('last_step')} of {row.get('steps')} is no segment of "
            f"{protocol.name} ({', '.join(protocol.segments())})"
        )
    expected = {ROW_FIELDS[o]: v for o, v in segment_settings(protocol, segment).items()}
    expected |= {"graphs": protocol.graphs, "tp": 1, "pp": 1, "dp": 1, "deterministic": False}
    expected |= {"data_seed": row.get("seed"), "data_pool": None, "adam_eps": get_preset(protocol.preset).adam_eps}
    for field, value in expected.items():
        if row.get(field) != value:
            return f"{field} {row.get(field)}, the protocol's {value}"
    if len(row.get("losses", [])) != row["last_step"] - row["first_step"]:
        return f"{len(row.get('losses', []))} steps of losses, not {row['last_step'] - row['first_step']}"
    valid = row.get("valid_losses") or []
    if segment != "trunk" and (not valid or valid[-1][0] != row["last_step"]):
        return "no validation after the last step"
    return None


def row_key(row: dict) -> str:
    return row["mode"] + (f"@run{row['repeat']}" if row.get("repeat", 1) > 1 else "")


DATA_FIELDS = ("corpus_train_sha256", "corpus_valid_sha256", "valid_windows_sha256")

Runs = dict[int, dict[str, dict[str, dict]]]  # seed -> key -> segment -> row


def place_of(protocol: Protocol, row: dict) -> tuple[tuple[int, str, str] | None, str | None]:
    """The (seed, key, segment) a finished run of ``protocol`` fills, and None; or None and why the
    row is no such run."""
    why = mismatch(protocol, row)
    if why is None and not 1 <= row["seed"] <= protocol.cap:
        why = f"seed {row['seed']} is outside the protocol's 1..{protocol.cap}"
    if why is None and row_key(row) not in protocol.keys(row["seed"]):
        why = f"{row_key(row)} is not a run of seed {row['seed']} ({', '.join(protocol.keys(row['seed']))})"
    return (None, why) if why is not None else ((row["seed"], row_key(row), segment_of(protocol, row)), None)


def collect(protocol: Protocol, rows: list[tuple[str, dict]]) -> tuple[Runs, list[str]]:
    """The protocol's runs by seed, key and segment, and a line per row left out (and why). A run
    with two rows is left out altogether: which one counts is not the judge's to pick. Rows whose
    status is not ok are named and left out (a re-run of the same run may stand)."""
    found: dict[tuple[int, str, str], list[str]] = {}
    rows_by_place: dict[tuple[int, str, str], dict] = {}
    notes = []
    for where, row in rows:
        place, why = place_of(protocol, row)
        if why is not None:
            if row.get("preset") == protocol.preset:
                notes.append(f"left out: {where} {row.get('mode')} seed {row.get('seed')}: {why}")
            continue
        found.setdefault(place, []).append(where)
        rows_by_place[place] = row
    runs: Runs = {}
    for place, where in sorted(found.items()):
        if len(where) > 1:
            notes.append(f"left out: seed {place[0]} {place[1]} {place[2]} has {len(where)} rows ({', '.join(where)})")
            continue
        seed, key, segment = place
        runs.setdefault(seed, {}).setdefault(key, {})[segment] = rows_by_place[place]
    data = {tuple(r.get(f) for f in DATA_FIELDS) for k in runs.values() for s in k.values() for r in s.values()}
    if len(data) > 1:
        raise ValueError(
            f"the runs trained or validated on {len(data)} different corpora or validation sets: their losses do not "
            "compare; judge each set of runs made on one corpus apart"
        )
    return runs, notes


def final_loss(protocol: Protocol, runs: Runs, seed: int, key: str, end: str = "final") -> float | None:
    """The validation loss after the last step of (seed, key): of ``main`` (or ``full``) for
    ``end="final"``, of ``branch`` for ``end="branch"``; None where the run is missing."""
    segment = ("main" if protocol.branch else "full") if end == "final" else "branch"
    row = runs.get(seed, {}).get(key, {}).get(segment)
    return None if row is None else row["valid_losses"][-1][1]


def differences(protocol: Protocol, runs: Runs, key: str, seeds, end: str = "final", against: str = REFERENCE):
    """d per seed that has both: (key's loss - against's) / against's, at the same seed and batches."""
    out = {}
    for seed in seeds:
        x, ref = final_loss(protocol, runs, seed, key, end), final_loss(protocol, runs, seed, against, end)
        if x is not None and ref is not None:
            out[seed] = (x - ref) / ref
    return out


# -- the rule ----------------------------------------------------------------------------------------


def power(protocol: Protocol, runs: Runs) -> dict:
    """The power gate, blind to every mean: the sample standard deviation of the default's d over
    seeds 1..``power_after`` (None until each has both runs), the seeds it fixes (``n``), and
    whether even ``cap`` seeds leave se above ``SE_TARGET`` (``underpowered``)."""
    first = range(1, protocol.power_after + 1)
    d = differences(protocol, runs, DEFAULT_MODE, first)
    if len(d) < protocol.power_after:
        return {"ready": False, "complete": len(d), "sd": None, "n": None, "underpowered": None}
    sd = statistics.stdev(d.values()) if len(d) > 1 else 0.0
    wanted = math.ceil((sd / SE_TARGET) ** 2)
    n = min(protocol.cap, max(protocol.seeds, wanted))
    return {
        "ready": True,
        "complete": len(d),
        "sd": sd,
        "wanted": wanted,
        "n": n,
        "se_at_n": sd / math.sqrt(n),
        "underpowered": sd / math.sqrt(protocol.cap) > SE_TARGET,
    }


def verdict(protocol: Protocol, stats: dict) -> str:
    """pass / fail / inconclusive of the default's paired statistics, by the protocol's bounds."""
    passes = stats["upper"] <= protocol.pass_upper and (
        protocol.pass_mean is None or stats["mean"] <= protocol.pass_mean
    )
    if passes:
        return "pass"
    if protocol.fail_lower is not None and stats["lower"] > protocol.fail_lower:
        return "fail"
    return "inconclusive" if protocol.fail_lower is not None else "not passed"


def rule_lines(protocol: Protocol) -> list[str]:
    """The rule in words, from the protocol's fields and the constants."""
    c = f"{CONFIDENCE:.0%}"
    lines = [
        f"d_i = (L_{DEFAULT_MODE} - L_{REFERENCE}) / L_{REFERENCE}, the held-out loss after the last step, paired by seed",
        f"pass: upper one-sided {c} t bound <= {protocol.pass_upper:.2%}"
        + (f" and mean <= {protocol.pass_mean:.2%}" if protocol.pass_mean is not None else ""),
    ]
    if protocol.fail_lower is not None:
        lines.append(f"fail: lower one-sided {c} t bound > {protocol.fail_lower:.2%}; otherwise inconclusive")
    lines.append(
        f"power gate: after seeds 1..{protocol.power_after}, n = min({protocol.cap}, max({protocol.seeds}, "
        f"ceil((sd / {SE_TARGET:.2%})^2))), sd read without the mean; underpowered if sd / sqrt({protocol.cap}) > "
        f"{SE_TARGET:.2%}; no mean is read before seeds 1..n are complete"
    )
    if protocol.te_margin is not None:
        lines.append(f"goal: mean d <= {TE_REFERENCE}'s mean d + {protocol.te_margin:.2%}, on the seeds with both")
    return lines


def judge(protocol: Protocol, rows: list[tuple[str, dict]]) -> tuple[dict, list[str]]:
    """The judgement of ``rows`` and its report as markdown lines: the power gate first; the verdict
    and every reported comparison only once seeds 1..n are complete."""
    runs, notes = collect(protocol, rows)
    gate = power(protocol, runs)
    result: dict = {"protocol": protocol.name, "digest": protocol_digest(protocol), "power": gate, "verdict": None}
    lines = [f"# Accuracy protocol {protocol.name}", "", f"Protocol digest `{result['digest']}`.", ""]
    lines += [f"- {line}" for line in rule_lines(protocol)] + [""]
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    if not gate["ready"]:
        lines.append(
            f"Power gate not read: {gate['complete']} of seeds 1..{protocol.power_after} complete. No mean is shown."
        )
        return result, lines
    lines.append(
        f"Power gate (blind): sd of d over seeds 1..{protocol.power_after} = {gate['sd']:.3%}; wanted "
        f"{gate['wanted']} seeds; n = **{gate['n']}** (se {gate['se_at_n']:.3%} expected)"
        + ("; **underpowered**: even the cap leaves se above the target" if gate["underpowered"] else "")
        + "."
    )
    seeds = range(1, gate["n"] + 1)
    missing = [s for s in seeds if final_loss(protocol, runs, s, DEFAULT_MODE) is None
               or final_loss(protocol, runs, s, REFERENCE) is None]  # fmt: skip
    if missing:
        lines += [
            "",
            f"Not complete: seeds {', '.join(map(str, missing))} of 1..{gate['n']} lack a run. No mean is shown.",
        ]
        return result, lines
    result["verdict"] = v = read_verdict(protocol, runs, seeds)
    lines += ["", *verdict_lines(protocol, runs, v, seeds)]
    return result, lines


def read_verdict(protocol: Protocol, runs: Runs, seeds) -> dict:
    """The verdict and the comparisons reported beside it, over ``seeds``."""
    coat = paired(differences(protocol, runs, DEFAULT_MODE, seeds))
    out = {"seeds": list(seeds), "coat": coat, "verdict": verdict(protocol, coat)}
    te = paired(differences(protocol, runs, TE_REFERENCE, seeds))
    out["te"] = te
    out["coat_minus_te"] = paired(differences(protocol, runs, DEFAULT_MODE, seeds, against=TE_REFERENCE))
    if protocol.te_margin is not None:
        both = sorted(set(te["d"]) & set(coat["d"]))
        c = statistics.fmean(coat["d"][s] for s in both) if both else None
        t = statistics.fmean(te["d"][s] for s in both) if both else None
        out["te_goal"] = {"seeds": both, "coat": c, "te": t, "met": None if not both else c <= t + protocol.te_margin}
    out["sanity"] = paired(differences(protocol, runs, SANITY, seeds))
    if protocol.branch:
        early = differences(protocol, runs, DEFAULT_MODE, seeds, end="branch")
        late = coat["d"]
        out["branch"] = paired(early)
        out["growth"] = paired({s: late[s] - early[s] for s in sorted(set(early) & set(late))})
        out["epsilon"] = paired(epsilon(protocol, runs, seeds, late))
    return out


def epsilon(protocol: Protocol, runs: Runs, seeds, d: dict[int, float]) -> dict[int, float]:
    """eps_i = d_i / g_i, g_i = ln(L_branch / L_final) / ln(tokens_final / tokens_branch) of the
    seed's BF16 run: the gap as a fraction of the training it would take BF16 to close it."""
    step, cooldown = protocol.branch
    ratio = math.log(protocol.setting("--steps") / (step + cooldown))
    out = {}
    for s in seeds:
        early, late = final_loss(protocol, runs, s, REFERENCE, "branch"), final_loss(protocol, runs, s, REFERENCE)
        if s in d and early is not None and late is not None and early > late:
            out[s] = d[s] / (math.log(early / late) / ratio)
    return out


def _cells(stats: dict) -> list[str]:
    pct = [
        "-" if stats["mean"] is None else f"{stats['mean']:+.3%}",
        "-" if stats["se"] is None else f"{stats['se']:.3%}",
    ]
    interval = "-" if stats["low"] is None else f"{stats['low']:+.3%} .. {stats['high']:+.3%}"
    bounds = "-" if stats["lower"] is None else f"{stats['lower']:+.3%} / {stats['upper']:+.3%}"
    return [str(stats["n"]), *pct, interval, bounds]


def verdict_lines(protocol: Protocol, runs: Runs, v: dict, seeds) -> list[str]:
    c = v["coat"]
    lines = [
        f"**Verdict: {v['verdict']}** ({DEFAULT_MODE} - {REFERENCE} over seeds 1..{len(v['seeds'])}: mean {c['mean']:+.3%}, "
        f"se {c['se']:.3%}, one-sided {CONFIDENCE:.0%} bounds {c['lower']:+.3%} / {c['upper']:+.3%}).",
        "",
        f"| comparison | seeds | mean | se | {INTERVAL:.0%} interval | one-sided {CONFIDENCE:.0%} lower / upper |",
        "|---|---:|---:|---:|---|---|",
    ]
    named = [
        (f"{DEFAULT_MODE} - {REFERENCE} (the verdict)", v["coat"]),
        (f"{TE_REFERENCE} - {REFERENCE}", v["te"]),
        (f"{DEFAULT_MODE} - {TE_REFERENCE}", v["coat_minus_te"]),
        (f"{SANITY} - {REFERENCE} (sanity, not a gate)", v["sanity"]),
    ]
    if protocol.branch:
        step, cooldown = protocol.branch
        named += [
            (f"{DEFAULT_MODE} - {REFERENCE} at the branch's end (step {step + cooldown})", v["branch"]),
            ("growth: d(final) - d(branch)", v["growth"]),
            ("epsilon = d / g (compute-equivalent gap)", v["epsilon"]),
        ]
    lines += [f"| {name} | " + " | ".join(_cells(s)) + " |" for name, s in named]
    sanity = v["sanity"]
    if sanity["low"] is not None and not sanity["low"] <= 0 <= sanity["high"]:
        lines += ["", f"Sanity: {SANITY}'s interval excludes zero: the harness favours one of two identical runs."]
    if "te_goal" in v:
        g = v["te_goal"]
        state = "not judged" if g["met"] is None else "met" if g["met"] else "NOT met"
        lines += ["", f"Goal {DEFAULT_MODE} <= {TE_REFERENCE} + {protocol.te_margin:.2%}: {state}"
                  + ("" if g["met"] is None else f" ({g['coat']:+.3%} against {g['te']:+.3%}, seeds {len(g['seeds'])})")]  # fmt: skip
    keys = sorted({k for s in seeds for k in protocol.keys(s)}, key=[REFERENCE, *(a.key for a in protocol.arms)].index)
    ends = ["final", "branch"] if protocol.branch else ["final"]
    lines += ["", "Per seed, the held-out loss" + (" (final / branch end)" if protocol.branch else "") + ":", ""]
    lines += ["| seed | " + " | ".join(keys) + " | d " + DEFAULT_MODE + " |", "|---" * (len(keys) + 2) + "|"]
    for s in seeds:
        cells = []
        for k in keys:
            losses = [final_loss(protocol, runs, s, k, e) for e in ends]
            cells.append(" / ".join("-" if x is None else f"{x:.4f}" for x in losses))
        d = v["coat"]["d"].get(s)
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {'-' if d is None else f'{d:+.3%}'} |")
    return lines


# -- the command line --------------------------------------------------------------------------------


def show(protocol: Protocol) -> list[str]:
    preset = get_preset(protocol.preset)
    tokens = protocol.setting("--steps") * protocol.setting("--global-batch") * preset.seq
    lines = [
        f"protocol {protocol.name}: {protocol.description}",
        f"digest {protocol_digest(protocol)}",
        f"preset {protocol.preset}: {preset.description}",
        f"every run: coat-compare --preset {protocol.preset} "
        + " ".join(f"{o} {v}" for o, v in protocol.settings)
        + f" --cuda-graphs {protocol.graphs} ({tokens:,} tokens)",
        *[f"rule: {line}" for line in rule_lines(protocol)],
        f"seeds 1..{protocol.seeds} (up to {protocol.cap} by the power gate); per seed: "
        + ", ".join(
            f"{a.key}" + ("" if a.seeds is None else f" (seeds 1..{a.seeds})") for a in (Arm(REFERENCE), *protocol.arms)
        ),
        f"runs of each: {', '.join(protocol.segments())}",
    ]
    return lines


def seed_list(text: str) -> list[int]:
    """``"1-4,7"`` -> [1, 2, 3, 4, 7]."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            seeds += list(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"--seeds {text!r}: give seeds as 1-8 or 1,2,5") from None
    return seeds
