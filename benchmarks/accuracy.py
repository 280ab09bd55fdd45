"""BF16 vs COAT validation loss over several seeds: the accuracy claim, with its noise floor.

    python benchmarks/accuracy.py [--preset tiny] [--steps 600] [--seeds 1,2,3] [--modes bf16,coat,bf16@data2]
                                  [--micro-batch N] [--global-batch N] [--lr-decay cosine] [--adam-eps EPS]
                                  [--tail 0.1] [--eval-every N] [--max-runs N] [--jobs N] [--out DIR]
    bash scripts/gpu_evidence.sh accuracy-gpt-125m SEEDS   # the GPU runs of gpt-125m (as many per command as fit)

For each seed, ``coat-compare --preset P --modes ... --steps N --seed S`` jobs: the same initial
weights and the same data order for every mode of a seed, and the same held-out validation
windows for every mode and seed. A mode key is a mode of coat-compare, optionally with a variant:
``MODE@dpN`` trains at DP N on the same global batch (only the order of reductions differs),
``MODE@dataN`` with the N-th data order (data seed = seed + 1000 (N - 1)), the same initial
weights, ``MODE@runN`` the N-th run of the same seed, data and code (on a GPU only the order of
nondeterministic reductions differs; on a CPU it repeats the first bit for bit). ``bf16@data2``,
``bf16@dp2`` and ``bf16@run2`` are noise floors: BF16 against BF16.

Per seed and mode: the validation loss after the last step (the primary figure) and the mean
training loss over the last ``--tail`` of the steps (beside it); the gap (mode - BF16) / BF16 of
each. Over seeds: the mean of the per-seed gaps and its standard error (sample standard deviation
/ sqrt(seeds)).

Two verdicts, each fixed here before the runs it judges:

- ``paired_verdict`` (the goal), for every mode compared with BF16 (coat, TE's, ablations): on the
  paired per-seed validation gaps (same initial weights, same batches), met iff the mean gap <=
  ``PAIRED_RULES[preset][0]`` AND the mean + 2 standard errors <= ``PAIRED_RULES[preset][1]``
  (None: a single run, judged on its gap alone). A mode that gains accuracy passes; one whose gaps
  scatter widely fails the second bound even with a small mean.
- ``verdict`` (the noise-floor reading, beside it): COAT's mean validation gap <= 0.25% and within
  two standard errors of the noise floor: |gap_coat| <= 2 noise_rms / sqrt(seeds), noise_rms the
  root mean square of the BF16-vs-BF16 per-seed gaps (their sign is arbitrary).

Modes whose finished rows are already in ``--out``/seedN are not run again, so long runs can be
split over several commands and an ablation added to finished seeds; ``--max-runs`` runs at most
that many (seed, mode) runs and exits with status 75 when some are left (call again); ``--jobs N``
runs up to N of them at once, each in its own process. Once all are
there: accuracy.md, accuracy.jsonl, losses.json (every curve, 4 decimals) and accuracy.png (with
matplotlib).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

from coat_compare.presets import get_preset

GOAL_GAP = 0.0025  # COAT's mean validation-loss gap to BF16 at most 0.25% (the noise-floor reading)
# The paired rule per preset: (bound on the mean per-seed gap, bound on mean + 2 standard errors, or
# None where one run is judged on its gap alone). gpt-125m: the multi-seed study; gpt-1b and
# llama2-7b: one long run each, 0.25% and 0.5% of BF16's final validation loss.
PAIRED_RULES = {"gpt-1b": (0.0025, None), "llama2-7b": (0.005, None), "llama2-13b": (0.005, None)}
DEFAULT_PAIRED_RULE = (0.0025, 0.005)
DATA_ORDER_STRIDE = 1000  # data seed of the N-th data order: seed + DATA_ORDER_STRIDE * (N - 1)
MORE_RUNS_LEFT = 75  # exit status when --max-runs left runs to do (EX_TEMPFAIL: call again)
LEGEND = {
    "coat-act": "coat-act: the COAT layer spec with Megatron's Adam (FP32 states).",
    "coat-opt": "coat-opt: the BF16 layer spec with COAT's FP8 AdamW.",
    "coat-opt-states": (
        "coat-opt-states: the BF16 layer spec with COAT's FP8 AdamW, an FP32 master copy and FP32 gradient buffers: "
        "the FP8 states alone."
    ),
    "bf16-grads": "bf16-grads: BF16 with BF16 gradient buffers (Megatron's Adam): the BF16 gradient sum alone.",
    "bf16@dp2": (
        "bf16@dp2: BF16 at DP 2 with the same global batch (two processes): the same math and data, only the order "
        "of the gradient reduction differs: a noise floor."
    ),
    "bf16@run2": (
        "bf16@run2: BF16 run again with the same seed, batches and code: only the order of nondeterministic reductions "
        "(attention's backward, atomics) differs: a noise floor for one paired gap."
    ),
    "bf16@data2": (
        "bf16@data2: BF16 with the same initial weights and another order of the training windows (data seed = "
        f"seed + {DATA_ORDER_STRIDE}): a noise floor, what a gap of this size means between two BF16 runs."
    ),
}


def software_line(rows: list[dict]) -> str:
    """Where the runs ran, from their rows (a report re-made elsewhere still names the GPU)."""
    devices = sorted({r.get("device", "?") for r in rows})
    if "software" in rows[0]:
        return f"On {', '.join(devices)}, {rows[0]['software']}."
    return f"On {', '.join(devices)} (software versions: the per-run reports in seedN/)."


KEY = re.compile(r"(?P<mode>[a-z0-9][a-z0-9.-]*?)(?:@dp(?P<dp>\d+))?(?:@data(?P<order>\d+))?(?:@run(?P<run>\d+))?")


def parse_key(key: str) -> tuple[str, int, int, int]:
    """``"bf16@data2"`` -> ("bf16", DP 1, data order 2, run 1); ``"bf16@dp2"`` -> ("bf16", 2, 1, 1);
    ``"bf16@run2"`` -> ("bf16", 1, 1, 2)."""
    match = KEY.fullmatch(key)
    if match is None or min(int(match[g] or 1) for g in ("dp", "order", "run")) < 1:
        raise SystemExit(
            f"--modes: {key!r} is not MODE, MODE@dpN, MODE@dataN or MODE@runN (e.g. coat, bf16@dp2, bf16@data2, bf16@run2)"
        )
    return match["mode"], int(match["dp"] or 1), int(match["order"] or 1), int(match["run"] or 1)


def mode_key(mode: str, dp: int = 1, order: int = 1, run: int = 1) -> str:
    return (
        mode
        + (f"@dp{dp}" if dp > 1 else "")
        + (f"@data{order}" if order > 1 else "")
        + (f"@run{run}" if run > 1 else "")
    )


def data_seed(seed: int, order: int) -> int:
    return seed + DATA_ORDER_STRIDE * (order - 1)


def lr_decay_of(row: dict) -> str:
    """A row's learning-rate schedule after the warm-up (rows written before it was recorded held
    the peak: constant)."""
    return row.get("lr_decay") or "constant"


def adam_eps_of(row: dict) -> float:
    """A row's Adam epsilon (rows written before it was recorded ran with Megatron's 1e-8)."""
    return row.get("adam_eps", 1e-8)


def read_runs(
    directory: str, seed: int, steps: int, lr_decay: str = "constant", adam_eps: float = 1e-8
) -> dict[str, dict]:
    """The finished train rows (with a validation loss) of ``seed`` with schedule ``lr_decay`` and
    Adam epsilon ``adam_eps`` in the reports (``*.jsonl``) of its directory, by mode key."""
    runs = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                row = json.loads(line)
                if (
                    row.get("kind") != "train"
                    or row.get("status") != "ok"
                    or row.get("seed") != seed
                    or len(row.get("losses", [])) != steps
                    or row.get("valid_loss") is None
                    or lr_decay_of(row) != lr_decay
                    or adam_eps_of(row) != adam_eps
                ):
                    continue
                order, rest = divmod(row.get("data_seed", seed) - seed, DATA_ORDER_STRIDE)
                if rest == 0 and order >= 0:
                    runs[mode_key(row["mode"], row.get("dp", 1), order + 1, row.get("repeat", 1))] = row
    return runs


def adam_eps(args) -> float:
    """The epsilon this report's runs train with: ``--adam-eps``, else the preset's."""
    return args.adam_eps if args.adam_eps is not None else get_preset(args.preset).adam_eps


def finished_runs(args, seed: int) -> dict[str, dict]:
    """The finished rows of ``seed``: those in ``--rows`` folders (earlier sessions' results, in
    the order given), then ``--out``'s, which win where a key is in both."""
    runs = {}
    for directory in [*args.rows, args.out]:
        runs.update(read_runs(os.path.join(directory, f"seed{seed}"), seed, args.steps, args.lr_decay, adam_eps(args)))
    return runs


def coat_compare(args, seed: int, names: list[str], dp: int, order: int, run: int = 1) -> float:
    """One coat-compare job: ``names`` at DP ``dp`` in data order ``order``, the ``run``-th time;
    returns its seconds."""
    preset = get_preset(args.preset)
    name = (
        f"{args.preset}-{'+'.join(names)}"
        + (f"-dp{dp}" if dp > 1 else "")
        + (f"-data{order}" if order > 1 else "")
        + (f"-run{run}" if run > 1 else "")
        + (f"-{args.lr_decay}" if args.lr_decay != "constant" else "")  # beside the constant runs' reports
    )
    cmd = [
        "-m",
        "coat_compare",
        "--preset",
        args.preset,
        "--modes",
        ",".join(names),
        "--steps",
        str(args.steps),
        "--seed",
        str(seed),
        "--data-seed",
        str(data_seed(seed, order)),
        "--out",
        os.path.join(args.out, f"seed{seed}"),
        "--name",
        name,
        "--no-plots",
    ]
    if args.eval_every is not None:
        cmd += ["--eval-every", str(args.eval_every)]
    if args.lr_decay != "constant":
        cmd += ["--lr-decay", args.lr_decay]
    if args.adam_eps is not None:
        cmd += ["--adam-eps", str(args.adam_eps)]
    if run > 1:
        cmd += ["--repeat", str(run)]
    micro_batch = args.micro_batch or preset.micro_batch
    if args.global_batch is not None:
        cmd += ["--global-batch", str(args.global_batch)]
    if dp > 1:  # the same global batch: micro-batch / DP per rank (coat-compare starts the DP processes)
        if micro_batch % dp:
            raise SystemExit(f"{names[0]}@dp{dp}: the micro-batch {micro_batch} does not split over {dp} ranks")
        cmd += ["--dp", str(dp), "--micro-batch", str(micro_batch // dp)]
    elif args.micro_batch is not None:
        cmd += ["--micro-batch", str(micro_batch)]
    directory = os.path.join(args.out, f"seed{seed}")
    os.makedirs(directory, exist_ok=True)
    log = os.path.join(directory, f"{name}.log")  # progress and warnings: the job's stderr
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, *cmd], stdout=subprocess.DEVNULL, stderr=f)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read().splitlines()[-20:]
        raise SystemExit(
            "\n".join(
                [*tail, f"seed {seed}: coat-compare {' '.join(cmd[1:])} failed ({proc.returncode}); its output: {log}"]
            )
        )
    print(
        f"seed {seed}: {', '.join(mode_key(n, dp, order, run) for n in names)} in {seconds:.0f} s (log: {log})",
        flush=True,
    )
    return seconds


def prepare_corpus(args) -> None:
    """Build (or check) the preset's corpus in the cache that every coat-compare job reads."""
    from coat_compare.corpus import load_corpus

    preset = get_preset(args.preset)
    load_corpus(preset.corpus, preset.corpus_max_bytes)


def run_missing(args, seeds: list[int], keys: list[str]) -> list[tuple[int, str]]:
    """Run the (seed, key) pairs that have no finished row, at most ``args.max_runs`` of them (in
    seed order, then --modes order), one coat-compare job per seed, DP size, data order and run.
    Returns the pairs still missing afterwards."""
    done = {s: finished_runs(args, s) for s in seeds}
    missing = [(s, k) for s in seeds for k in keys if k not in done[s]]
    chosen = missing if args.max_runs is None else missing[: args.max_runs]
    jobs: dict[tuple[int, int, int, int, str], list[str]] = {}
    for seed, key in chosen:
        mode, dp, order, run = parse_key(key)
        # --jobs > 1: one job per run, so that runs can share the GPU
        jobs.setdefault((seed, dp, order, run, mode if args.jobs > 1 else ""), []).append(mode)
    if args.jobs > 1 and len(jobs) > 1:
        prepare_corpus(args)  # built once, before processes that would all build it at once
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for future in [
                pool.submit(coat_compare, args, seed, names, dp, order, run)
                for (seed, dp, order, run, _), names in jobs.items()
            ]:
                future.result()
    else:
        for (seed, dp, order, run, _), names in jobs.items():
            coat_compare(args, seed, names, dp, order, run)
    done = {s: finished_runs(args, s) for s in seeds}
    still = [(s, k) for s, k in missing if k not in done[s]]
    failed = [p for p in chosen if p in still]
    if failed:
        raise SystemExit(
            f"no finished row for {', '.join(f'seed {s} {k}' for s, k in failed)} in {args.out}/seedN: see its .md reports"
        )
    return still


def tail_mean(losses: list[float], tail: float) -> float:
    n = max(1, int(len(losses) * tail))
    return statistics.fmean(losses[-n:])


def standard_error(values: list[float]) -> float | None:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def verdict(coat_gaps: list[float], noise_gaps: list[float] | None, noise: str | None = None) -> dict:
    """The goal on per-seed validation gaps (fractions of BF16's loss): met iff the mean COAT gap
    <= GOAL_GAP and |mean COAT gap| <= 2 noise_rms / sqrt(seeds), where noise_rms is the root mean
    square of the noise floor's per-seed gaps. A BF16-vs-BF16 gap has no sign of its own (which of
    the two runs is the reference is arbitrary), so the floor is that spread about zero, and
    noise_rms / sqrt(seeds) is the standard error of a mean of as many such gaps: COAT's mean gap
    must be one that two BF16 runs could show. Also reported: COAT's own standard error and the
    signed reading (gap_coat - gap_noise against 2 sqrt(se_coat^2 + se_noise^2)), which flips with
    the arbitrary sign. ``met`` is None (not judged) without a noise floor or with one seed."""
    coat, se_coat = statistics.fmean(coat_gaps), standard_error(coat_gaps)
    out = {
        "kind": "verdict",
        "goal_gap": GOAL_GAP,
        "seeds": len(coat_gaps),
        "gap_coat": coat,
        "se_coat": se_coat,
        "noise_floor": noise,
        "gap_noise": None,
        "se_noise": None,
        "noise_rms": None,
        "noise_se": None,
        "allowed_gap": None,
        "signed_difference": None,
        "signed_allowed": None,
        "met": None,
    }
    if noise_gaps is None:
        out["note"] = "no noise floor: add bf16@data2 to --modes"
        return out
    rms = math.sqrt(statistics.fmean(g * g for g in noise_gaps))
    out.update(
        gap_noise=statistics.fmean(noise_gaps),
        se_noise=standard_error(noise_gaps),
        noise_rms=rms,
        noise_se=rms / math.sqrt(len(noise_gaps)),
        signed_difference=coat - statistics.fmean(noise_gaps),
    )
    if se_coat is None or out["se_noise"] is None:
        out["note"] = "standard errors need 2 seeds or more"
        return out
    out["allowed_gap"] = 2 * out["noise_se"]
    out["signed_allowed"] = 2 * math.sqrt(se_coat**2 + out["se_noise"] ** 2)
    out["met"] = coat <= GOAL_GAP and abs(coat) <= out["allowed_gap"]
    out["note"] = (
        ""
        if out["met"]
        else (
            "mean gap above 0.25%"
            if coat > GOAL_GAP
            else "further from zero than two standard errors of the noise floor"
        )
    )
    return out


def paired_verdict(mode: str, gaps: list[float], preset: str) -> dict:
    """The goal on ``mode``'s paired per-seed validation gaps (fractions of BF16's loss): met iff
    mean <= rule[0] and, where rule[1] is set, mean + 2 standard errors <= rule[1]. ``met`` is None
    when rule[1] needs a standard error and there is one seed only."""
    mean_bound, upper_bound = PAIRED_RULES.get(preset, DEFAULT_PAIRED_RULE)
    mean, se = statistics.fmean(gaps), standard_error(gaps)
    out = {
        "kind": "paired_verdict",
        "mode": mode,
        "preset": preset,
        "seeds": len(gaps),
        "gap_mean": mean,
        "gap_se": se,
        "mean_bound": mean_bound,
        "upper_bound": upper_bound,
        "upper": None if se is None else mean + 2 * se,
        "met": None,
    }
    if upper_bound is not None and se is None:
        out["note"] = "mean + 2 standard errors needs 2 seeds or more"
        return out
    misses = []
    if mean > mean_bound:
        misses.append(f"mean gap {mean:+.3%} above {mean_bound:.2%}")
    if upper_bound is not None and out["upper"] > upper_bound:
        misses.append(f"mean + 2 se {out['upper']:+.3%} above {upper_bound:.2%}")
    out["met"] = not misses
    out["note"] = "; ".join(misses)
    return out


def paired_verdict_line(v: dict) -> str:
    rule = f"mean gap <= {v['mean_bound']:.2%}" + (
        f" and mean + 2 se <= {v['upper_bound']:.2%}" if v["upper_bound"] is not None else ""
    )
    measured = f"{v['gap_mean']:+.3%}" + (
        f" (se {v['gap_se']:.3%}, mean + 2 se {v['upper']:+.3%})" if v["gap_se"] is not None else ""
    )
    result = "not judged" if v["met"] is None else ("**met**" if v["met"] else "**NOT met**")
    return f"- {v['mode']} vs BF16 over {v['seeds']} seed(s), rule {rule}: {measured}: {result}" + (
        f" ({v['note']})" if v.get("note") else ""
    )


def verdict_line(v: dict) -> str:
    rule = (
        "Noise-floor reading: COAT's mean validation-loss gap to BF16 <= 0.25% and within two standard errors of the noise floor, "
        "i.e. gap_coat <= 0.25% and |gap_coat| <= 2 noise_rms / sqrt(seeds) (gap_coat: the mean of the per-seed gaps; noise_rms: "
        "the root mean square of the noise floor's per-seed gaps, whose sign is arbitrary: which BF16 run is the reference)."
    )
    measured = f" Measured over {v['seeds']} seed(s): COAT {v['gap_coat']:+.3%}" + (
        f" (its own se {v['se_coat']:.3%})" if v["se_coat"] is not None else ""
    )
    if v["gap_noise"] is not None:
        measured += (
            f"; noise floor {v['noise_floor']}: per-seed gaps rms {v['noise_rms']:.3%}, mean {v['gap_noise']:+.3%}"
        )
        if v["allowed_gap"] is not None:
            measured += (
                f"; |gap_coat| {abs(v['gap_coat']):.3%} against at most {v['allowed_gap']:.3%}. The signed reading, gap_coat - gap_noise "
                f"= {v['signed_difference']:+.3%} against 2 sqrt(se_coat^2 + se_noise^2) = {v['signed_allowed']:.3%}, "
                f"would say {'met' if v['signed_difference'] <= v['signed_allowed'] else 'not met'} (and the opposite of the "
                f"noise floor's sign, {v['gap_coat'] + v['gap_noise']:+.3%}, {'met' if v['gap_coat'] + v['gap_noise'] <= v['signed_allowed'] else 'not met'})"
            )
    result = "not judged" if v["met"] is None else ("**met**" if v["met"] else "**NOT met**")
    return f"{rule}{measured}: {result}" + (f" ({v['note']})." if v.get("note") else ".")


def table(title: str, per_seed: list[dict], keys: list[str]) -> list[str]:
    """One markdown table: a loss per key per seed, the gaps to bf16, their mean and standard error."""
    others = keys[1:]
    names = [k.upper() if k in ("bf16", "coat") else k for k in keys]
    lines = [
        title,
        "",
        "| seed | " + " | ".join(names) + " | " + " | ".join(f"gap {n}" for n in names[1:]) + " |",
        "|" + "---|" * (1 + len(keys) + len(others)),
    ]
    for r in per_seed:
        lines.append(
            f"| {r['seed']} | "
            + " | ".join(f"{r['loss'][k]:.4f}" for k in keys)
            + " | "
            + " | ".join(f"{r['gap'][k]:+.2%}" for k in others)
            + " |"
        )
    mean = {k: statistics.fmean(r["loss"][k] for r in per_seed) for k in keys}
    gaps = {k: [r["gap"][k] for r in per_seed] for k in others}
    lines.append(
        "| **mean** | "
        + " | ".join(f"{mean[k]:.4f}" for k in keys)
        + " | "
        + " | ".join(f"**{statistics.fmean(gaps[k]):+.2%}**" for k in others)
        + " |"
    )
    if len(per_seed) > 1:
        lines.append(
            "| standard error | "
            + " | ".join("" for _ in keys)
            + " | "
            + " | ".join(f"{standard_error(gaps[k]):.2%}" for k in others)
            + " |"
        )
    return lines


def summarize(per_seed: list[dict], keys: list[str]) -> dict:
    """The mean row of one figure: mean loss per key, mean gap and its standard error per key."""
    others = keys[1:]
    return {
        "loss": {k: statistics.fmean(r["loss"][k] for r in per_seed) for k in keys},
        "gap": {k: statistics.fmean(r["gap"][k] for r in per_seed) for k in others},
        "se": {k: standard_error([r["gap"][k] for r in per_seed]) for k in others},
    }


def figure(runs: dict[int, dict[str, dict]], keys: list[str], value) -> list[dict]:
    """Per seed: {seed, loss: {key: value(row)}, gap: {key: (loss - bf16's) / bf16's}}."""
    out = []
    for seed, rows in runs.items():
        loss = {k: value(rows[k]) for k in keys}
        out.append({"seed": seed, "loss": loss, "gap": {k: (loss[k] - loss["bf16"]) / loss["bf16"] for k in keys[1:]}})
    return out


def data_line(rows: list[dict]) -> str:
    first = rows[0]
    width = first["seq"] + 1
    windows = first["steps"] * first.get("global_batch", first["micro_batch"] * first.get("dp", 1))
    return (
        f"Data: the {first['corpus']} corpus ({first['corpus_files']} files; train split {first['corpus_train_bytes']:,} bytes, "
        f"SHA-256 `{first['corpus_train_sha256']}`; validation split {first['corpus_valid_bytes']:,} bytes, SHA-256 "
        f"`{first['corpus_valid_sha256']}`; split by file). Each run trains on {windows:,} distinct windows of {width} bytes "
        f"({windows * width / first['corpus_train_bytes']:.1%} of the train split, each byte at most once). Validation: "
        f"{first['eval_windows']} windows of {width} held-out bytes (SHA-256 `{first['valid_windows_sha256'][:16]}`), the same "
        f"for every mode and seed, every {first['eval_every']} steps and after the last (forward only, mean per-token loss)."
        + schedule_line(first)
    )


def schedule_line(row: dict) -> str:
    """The runs' learning-rate schedule, where their rows record it."""
    if row.get("lr") is None or row.get("lr_warmup_steps") is None:
        return ""
    after = {
        "constant": "then held to the end",
        "cosine": "then a cosine down to 10% of it at the last step",
        "linear": "then a straight line down to 10% of it at the last step",
    }
    return f" Learning rate: peak {row['lr']:g} after a {row['lr_warmup_steps']}-step linear warm-up, {after[lr_decay_of(row)]}."


def check_same_data(runs: dict[int, dict[str, dict]], out: str) -> list[dict]:
    """Every row's corpus and validation windows must be the same ones: otherwise the validation
    losses are not comparable. Returns the rows."""
    rows = [row for per_key in runs.values() for row in per_key.values()]
    fields = ("corpus_train_sha256", "corpus_valid_sha256", "valid_windows_sha256", "eval_every")
    for field in fields:
        values = {row.get(field) for row in rows}
        if len(values) > 1:
            raise SystemExit(
                f"the runs in {out}/seedN differ in {field} ({', '.join(map(str, sorted(values, key=str)))}): "
                "they trained or validated on other data; run them again into a fresh --out"
            )
    return rows


def plot(runs, keys, valid_rows, noise, args, plt) -> None:
    """Left: each key's validation loss averaged over seeds (and its training loss, moving
    average, thin). Right: each key's validation gap to BF16 per seed (dots), their mean and its
    standard error (bar), the goal."""
    others = keys[1:]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    window = max(1, args.steps // 30)
    start = args.steps // 10
    for key, style in zip(keys, itertools.cycle(("-", "--", ":", "-."))):
        steps = [s for s, _ in runs[next(iter(runs))][key]["valid_losses"]]
        valid = [statistics.fmean(runs[seed][key]["valid_losses"][i][1] for seed in runs) for i in range(len(steps))]
        (line,) = left.plot(steps, valid, style, marker="o", markersize=3, label=f"{key} validation", linewidth=1.4)
        train = [statistics.fmean(runs[seed][key]["losses"][i] for seed in runs) for i in range(args.steps)]
        smooth = [statistics.fmean(train[max(0, i - window + 1) : i + 1]) for i in range(args.steps)]
        left.plot(
            range(start + 1, args.steps + 1), smooth[start:], style, color=line.get_color(), linewidth=0.6, alpha=0.5
        )
    left.set_xlabel("step")
    left.set_ylabel(f"loss, mean of {len(runs)} seeds")
    left.set_title(
        f"{args.preset}: validation loss (markers), training loss (thin, moving average of {window})", fontsize=9
    )
    left.legend(fontsize=8)
    for x, key in enumerate(others):
        gaps = [100 * r["gap"][key] for r in valid_rows]
        right.scatter([x] * len(gaps), gaps, s=14, alpha=0.6, color="grey" if key == noise else None)
        if len(gaps) > 1:
            right.errorbar(
                [x + 0.15],
                [statistics.fmean(gaps)],
                yerr=[statistics.stdev(gaps) / math.sqrt(len(gaps))],
                fmt="o",
                color="black",
                capsize=4,
            )
    right.axhline(0, color="grey", linewidth=0.8)
    right.axhline(100 * GOAL_GAP, color="red", linewidth=0.8, linestyle="--", label="goal: +0.25%")
    right.set_xticks(range(len(others)), [k + (" (noise floor)" if k == noise else "") for k in others], fontsize=8)
    right.set_ylabel("validation gap to BF16, % (per seed; mean +- se)")
    right.set_title("final validation-loss gap")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "accuracy.png"), dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument(
        "--modes",
        default="bf16,coat,bf16@data2",
        help="bf16 first (the reference), then coat and any ablations (coat-act: COAT layers, FP32 Adam; coat-opt: BF16 "
        "layers, COAT's AdamW; coat-opt-states: its FP8 states alone; bf16-grads: BF16 gradient buffers alone) and noise floors (bf16@data2: another data order; bf16@dp2: BF16 at DP 2, the same "
        "global batch, another reduction order; bf16@run2: the same run again); the first bf16 variant listed is the "
        "verdict's noise floor",
    )
    p.add_argument("--micro-batch", type=int, help="micro-batch per data-parallel rank (default: the preset's)")
    p.add_argument(
        "--global-batch",
        type=int,
        help="sequences per optimizer step: global batch / micro-batch micro-batches "
        "accumulated per step (default: one micro-batch per step)",
    )
    p.add_argument(
        "--lr-decay",
        choices=("constant", "cosine", "linear"),
        default="constant",
        help="every run's learning rate after the warm-up (coat-compare --lr-decay); rows of another schedule in "
        "--out or --rows are neither used nor counted as done",
    )
    p.add_argument(
        "--adam-eps",
        type=float,
        metavar="EPS",
        help="every run's Adam epsilon (coat-compare --adam-eps; default: the preset's, 1e-8, llama2-7b and llama2-13b "
        "1e-5); rows of another epsilon in --out or --rows are neither used nor counted as done",
    )
    p.add_argument(
        "--tail", type=float, default=0.1, help="fraction of the last steps whose mean training loss is shown"
    )
    p.add_argument(
        "--eval-every", type=int, help="validation every N steps (default: the preset's: tiny 20, gpt-125m 100)"
    )
    p.add_argument(
        "--max-runs", type=int, help="run at most N missing (seed, mode) runs, then exit (status 75 when some are left)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once, each its own process (on one GPU: an eager run of a small model leaves the GPU idle "
        "between launches, which another run's kernels fill; each run's numbers do not depend on it)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument(
        "--rows",
        action="append",
        default=[],
        metavar="DIR",
        help="also read finished rows from DIR/seedN (repeatable): runs an earlier session committed elsewhere "
        "join this report without copies; rows in --out win where both have one",
    )
    args = p.parse_args(argv)
    keys = [m.strip() for m in args.modes.split(",")]
    if keys[0] != "bf16" or "coat" not in keys:
        p.error(
            "--modes: start with bf16 (the reference) and include coat, e.g. bf16,coat,bf16@data2,coat-act,coat-opt"
        )
    for key in keys:
        parse_key(key)
    if args.eval_every == 0:
        p.error("--eval-every 0 turns validation off, and validation loss is what this compares: give N > 0")
    return args, keys


def main(argv=None) -> int:
    args, keys = parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(args.out, exist_ok=True)
    left = run_missing(args, seeds, keys)
    if left:
        print(
            f"{len(left)} run(s) left ({', '.join(f'seed {s} {k}' for s, k in left)}): run the same command again",
            flush=True,
        )
        return MORE_RUNS_LEFT

    runs = {seed: {k: done[k] for k in keys} for seed in seeds for done in [finished_runs(args, seed)]}
    rows = check_same_data(runs, args.out)
    others = keys[1:]
    noise = next((k for k in others if parse_key(k)[0] == "bf16"), None)
    valid = figure(runs, keys, lambda row: row["valid_loss"])
    train = figure(runs, keys, lambda row: tail_mean(row["losses"], args.tail))
    result = verdict([r["gap"]["coat"] for r in valid], [r["gap"][noise] for r in valid] if noise else None, noise)
    paired = [paired_verdict(k, [r["gap"][k] for r in valid], args.preset) for k in others if k != noise]

    with open(os.path.join(args.out, "accuracy.jsonl"), "w") as f:
        common = {
            "preset": args.preset,
            "steps": args.steps,
            "tail": args.tail,
            "corpus": rows[0]["corpus"],
            "corpus_train_sha256": rows[0]["corpus_train_sha256"],
            "corpus_valid_sha256": rows[0]["corpus_valid_sha256"],
        }
        for v, t in zip(valid, train):
            f.write(
                json.dumps(
                    {
                        **common,
                        "kind": "seed",
                        "seed": v["seed"],
                        "valid": v["loss"],
                        "gap_valid": v["gap"],
                        "train_tail": t["loss"],
                        "gap_train_tail": t["gap"],
                    }
                )
                + "\n"
            )
        mv, mt = summarize(valid, keys), summarize(train, keys)
        f.write(
            json.dumps(
                {
                    **common,
                    "kind": "mean",
                    "seed": "mean",
                    "valid": mv["loss"],
                    "gap_valid": mv["gap"],
                    "se_gap_valid": mv["se"],
                    "train_tail": mt["loss"],
                    "gap_train_tail": mt["gap"],
                    "se_gap_train_tail": mt["se"],
                }
            )
            + "\n"
        )
        f.write(json.dumps({**common, **result}) + "\n")
        for v in paired:
            f.write(json.dumps({**common, **v}) + "\n")
    with open(os.path.join(args.out, "losses.json"), "w") as f:  # every curve, compact: what the plot draws
        json.dump(
            {
                "preset": args.preset,
                "steps": args.steps,
                "modes": keys,
                "losses": {str(s): {k: [round(x, 4) for x in runs[s][k]["losses"]] for k in keys} for s in seeds},
                "valid_losses": {
                    str(s): {k: [[n, round(x, 4)] for n, x in runs[s][k]["valid_losses"]] for k in keys} for s in seeds
                },
            },
            f,
        )

    command = f"python benchmarks/accuracy.py --preset {args.preset} --steps {args.steps} --seeds {args.seeds} --modes {args.modes} --tail {args.tail}"
    for name in ("micro_batch", "global_batch"):
        if getattr(args, name) is not None:
            command += f" --{name.replace('_', '-')} {getattr(args, name)}"
    if args.eval_every is not None:
        command += f" --eval-every {args.eval_every}"
    if args.lr_decay != "constant":
        command += f" --lr-decay {args.lr_decay}"
    if args.adam_eps is not None:
        command += f" --adam-eps {args.adam_eps:g}"
    command += "".join(f" --rows {d}" for d in args.rows)
    lines = [
        f"# BF16 vs COAT validation loss, preset {args.preset}, {args.steps} steps, seeds {args.seeds}",
        "",
        f"`{command}`",
        "",
        software_line(rows),
        "",
        data_line(rows),
        "",
        "Every column of a seed starts from the same initial weights and, but for the `@dataN` columns, trains on the same "
        "batches. " + " ".join(text for key, text in LEGEND.items() if key in others),
        "",
        *table(
            "Validation loss after the last step (the primary figure); gap: (mode - BF16) / BF16 per seed; mean: over seeds, "
            "with the standard error of the mean gap (sample standard deviation / sqrt(seeds)).",
            valid,
            keys,
        ),
        "",
        *table(
            f"Training loss, mean over the last {args.tail:.0%} of the steps, beside it (also on text each run sees once; "
            "the `@dataN` columns average other batches).",
            train,
            keys,
        ),
        "",
        "The goal, on the paired per-seed validation gaps (rule fixed in benchmarks/accuracy.py before the runs, "
        "``PAIRED_RULES``):",
        "",
        *[paired_verdict_line(v) for v in paired],
        "",
        verdict_line(result),
    ]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plot(runs, keys, valid, noise, args, plt)
        lines += ["", "![validation and training loss, gaps per seed](accuracy.png)"]
    except ImportError:
        lines += ["", "(plots skipped: pip install matplotlib)"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "accuracy.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
