"""Which training batches a start-up loss spike falls on: each step's bytes beside the runs' losses.

    python benchmarks/spike_batches.py --preset llama2-13b --global-batch 4 --steps 40 \\
        [--seed 1234] [--data-seed N] [--rows REPORT.jsonl ...] [--from-step 11] [--out DIR]

A loss above ln(vocab) after the warm-up's first steps is either the training (initialisation,
learning rate, numerics) or the text: a batch the young model finds far stranger than the ones
before it. This rebuilds the batches of a coat-compare run (the preset's corpus, the global batch,
the data order of ``--data-seed``, default ``--seed``: the ones every mode of that run trained on)
and gives, per step:

- ``non-ASCII``: the share of bytes >= 128 (UTF-8 beyond ASCII, binary data);
- ``surprisal``: the batch's mean -ln p(byte) under the train split's byte frequencies (a unigram
  model of the corpus; ln 256 = 5.55 for uniform bytes);
- ``rare``: the share of bytes whose frequency in the train split is below 1e-5;

and, with ``--rows`` (coat-compare ``.jsonl`` reports of runs with that seed, data order and
global batch), each run's training loss at that step. For each run it gives the Pearson correlation
of its loss with ``surprisal`` and with ``non-ASCII`` from ``--from-step`` on: a spike that the
text explains sits on the strange batches in every mode. Run it where the runs ran (the packages
corpus is built from the machine's installed packages: ``corpus_train_sha256`` must match the rows').
Writes spike_batches.md and spike_batches.jsonl to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from coat_compare.corpus import load_corpus
from coat_compare.presets import get_preset
from coat_compare.report import write_markdown_and_rows
from coat_compare.train import training_windows

RARE = 1e-5


def batch_stats(windows: torch.Tensor, log_p: torch.Tensor, freq: torch.Tensor) -> dict:
    """Byte statistics of one batch of windows (uint8, (sequences, seq + 1)): its labels, the
    bytes the loss scores."""
    labels = windows[:, 1:].reshape(-1).long()
    return {
        "non_ascii": (labels >= 128).float().mean().item(),
        "surprisal": -log_p[labels].mean().item(),
        "rare": (freq[labels] < RARE).float().mean().item(),
    }


def pearson(x: list[float], y: list[float]) -> float | None:
    if len(x) < 3:
        return None
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sx = math.sqrt(sum((a - mx) ** 2 for a in x))
    sy = math.sqrt(sum((b - my) ** 2 for b in y))
    if sx == 0 or sy == 0:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / (sx * sy)


def read_runs(paths: list[str], corpus_sha: str, seed: int, data_seed: int, global_batch: int) -> dict[str, list]:
    """The training losses of the finished train rows in ``paths`` that trained on these batches,
    by a label (mode, and the report's name where several reports give one mode)."""
    runs = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if row.get("kind") != "train" or row.get("status") != "ok" or not row.get("losses"):
                    continue
                same = (
                    row.get("corpus_train_sha256") == corpus_sha
                    and row.get("seed") == seed
                    and row.get("data_seed", row.get("seed")) == data_seed
                    and row.get("global_batch") == global_batch
                )
                if not same:
                    raise SystemExit(
                        f"{path}: its {row['mode']} row trained on other batches (corpus {row.get('corpus_train_sha256')}, "
                        f"seed {row.get('seed')}, data seed {row.get('data_seed')}, global batch {row.get('global_batch')}) "
                        f"than these (corpus {corpus_sha}, seed {seed}, data seed {data_seed}, global batch {global_batch}): "
                        "run this where the runs ran, with their --seed, --data-seed and --global-batch"
                    )
                label = row["mode"] if row["mode"] not in runs else f"{row['mode']} ({os.path.basename(path)})"
                runs[label] = row["losses"]
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-seed", type=int, help="the data order (default: --seed)")
    p.add_argument("--rows", nargs="*", default=[], help="coat-compare .jsonl reports of runs on these batches")
    p.add_argument("--from-step", type=int, default=11, help="correlations over this step and later (1-based)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)

    preset = get_preset(args.preset).with_overrides(global_batch=args.global_batch)
    data_seed = args.seed if args.data_seed is None else args.data_seed
    corpus = load_corpus(preset.corpus, preset.corpus_max_bytes)
    data = training_windows(preset, data_seed, corpus=corpus)
    data.check_steps(args.steps)
    freq = torch.bincount(corpus.train.long(), minlength=256).double()
    freq = freq / freq.sum()
    log_p = freq.clamp_min(1e-12).log()
    global_batch = data.batch_size
    runs = read_runs(args.rows, corpus.identity()["corpus_train_sha256"], args.seed, data_seed, global_batch)

    rows = []
    for step in range(args.steps):
        chosen = data.order[step * global_batch : (step + 1) * global_batch]
        stats = batch_stats(data.windows[chosen], log_p, freq)
        losses = {label: losses[step] for label, losses in runs.items() if step < len(losses)}
        rows.append({"kind": "step", "step": step + 1, **stats, "losses": losses})
    late = [r for r in rows if r["step"] >= args.from_step]
    correlations = []
    for label in runs:
        have = [r for r in late if label in r["losses"]]
        loss = [r["losses"][label] for r in have]
        correlations.append(
            {
                "kind": "correlation",
                "run": label,
                "steps": len(have),
                "with_surprisal": pearson(loss, [r["surprisal"] for r in have]),
                "with_non_ascii": pearson(loss, [r["non_ascii"] for r in have]),
                "max_loss": max(loss, default=None),
                "max_loss_step": have[loss.index(max(loss))]["step"] if loss else None,
            }
        )

    def fmt(x):
        return "-" if x is None else f"{x:.2f}"

    command = (
        f"python benchmarks/spike_batches.py --preset {args.preset} --global-batch {global_batch} --steps {args.steps} "
        f"--seed {args.seed}" + (f" --data-seed {data_seed}" if data_seed != args.seed else "")
    )
    command += "".join(f" --rows {r}" for r in args.rows)
    lines = [
        f"# The batches of {args.preset} (global batch {global_batch}, data order {data_seed}) and the losses on them",
        "",
        f"`{command}`",
        "",
        f"Corpus `{preset.corpus}`, train split SHA-256 `{corpus.identity()['corpus_train_sha256']}`. Per step: the share of "
        f"bytes >= 128, the mean surprisal of the batch's bytes under the split's byte frequencies (ln 256 = 5.55 for "
        f"uniform bytes), the share of bytes rarer than {RARE:g}; each run's training loss (ln(vocab) = "
        f"{math.log(preset.vocab):.2f}).",
        "",
        "| step | non-ASCII | surprisal | rare | " + " | ".join(runs) + " |",
        "|---|---|---|---|" + "---|" * len(runs),
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['non_ascii']:.2%} | {r['surprisal']:.2f} | {r['rare']:.2%} | "
            + " | ".join(fmt(r["losses"].get(label)) for label in runs)
            + " |"
        )
    if correlations:
        lines += [
            "",
            f"Pearson correlation of each run's loss with the batch's bytes, steps {args.from_step}-{args.steps}:",
            "",
            "| run | steps | with surprisal | with non-ASCII | highest loss (step) |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {c['run']} | {c['steps']} | {fmt(c['with_surprisal'])} | {fmt(c['with_non_ascii'])} | "
            f"{fmt(c['max_loss'])} ({c['max_loss_step']}) |"
            for c in correlations
        ]
    write_markdown_and_rows(args.out, "spike_batches", "\n".join(lines) + "\n", rows + correlations)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
