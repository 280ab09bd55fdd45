"""BF16 vs COAT final loss over several seeds: the accuracy claim, with its loss curves.

    python benchmarks/accuracy.py [--preset tiny] [--steps 600] [--seeds 1,2,3] [--tail 0.1] [--out DIR]
    bash scripts/gpu_accuracy.sh        # the GPU run: gpt-125m, 2000 steps, 3 seeds (one seed per command)

For each seed, one ``coat-compare --preset P --modes bf16,coat --steps N --seed S`` job (same
data, same initial weights for both modes), then per mode the mean loss over the last ``--tail``
fraction of the steps (one step's loss is noisy), averaged over seeds; the gap
(COAT - BF16) / BF16 of those means, per seed and overall; and a plot of the curves (moving
average) when matplotlib is installed. Writes accuracy.md, accuracy.jsonl (and accuracy.png).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def read_losses(path: str, steps: int) -> dict[str, list[float]]:
    losses = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if row.get("status") == "ok" and len(row.get("losses", [])) == steps:
                    losses[row["mode"]] = row["losses"]
    return losses


def run_seed(preset: str, steps: int, seed: int, out: str) -> dict[str, list[float]]:
    """The seed's losses per mode; a seed whose report in ``out`` already holds both modes at
    ``steps`` steps is not run again (so that long runs can be split, one seed per command)."""
    directory = os.path.join(out, f"seed{seed}")
    path = os.path.join(directory, f"{preset}.jsonl")
    losses = read_losses(path, steps)
    if set(losses) != {"bf16", "coat"}:
        cmd = [sys.executable, "-m", "coat_megatron.compare", "--preset", preset, "--modes", "bf16,coat",
               "--steps", str(steps), "--seed", str(seed), "--out", directory, "--no-plots"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        losses = read_losses(path, steps)
    if set(losses) != {"bf16", "coat"}:
        raise SystemExit(f"seed {seed}: the report {path} lacks a finished bf16 or coat row; see its .md")
    return losses


def tail_mean(losses: list[float], tail: float) -> float:
    n = max(1, int(len(losses) * tail))
    return statistics.fmean(losses[-n:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--tail", type=float, default=0.1, help="fraction of the last steps whose mean loss is compared")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(args.out, exist_ok=True)

    runs = {seed: run_seed(args.preset, args.steps, seed, args.out) for seed in seeds}
    rows = []
    for seed, losses in runs.items():
        bf16, coat = tail_mean(losses["bf16"], args.tail), tail_mean(losses["coat"], args.tail)
        rows.append({"seed": seed, "bf16": bf16, "coat": coat, "gap": (coat - bf16) / bf16})
    mean_bf16 = statistics.fmean(r["bf16"] for r in rows)
    mean_coat = statistics.fmean(r["coat"] for r in rows)
    gap = (mean_coat - mean_bf16) / mean_bf16
    with open(os.path.join(args.out, "accuracy.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps({"preset": args.preset, "steps": args.steps, "tail": args.tail, **r}) + "\n")
        f.write(json.dumps({"preset": args.preset, "steps": args.steps, "tail": args.tail, "seed": "mean", "bf16": mean_bf16, "coat": mean_coat, "gap": gap}) + "\n")

    lines = [f"# BF16 vs COAT loss, preset {args.preset}, {args.steps} steps, seeds {args.seeds}", "",
             f"`python benchmarks/accuracy.py --preset {args.preset} --steps {args.steps} --seeds {args.seeds} --tail {args.tail}`", "",
             f"Loss: mean over the last {args.tail:.0%} of the steps.", "",
             "| seed | BF16 | COAT | gap (COAT - BF16) / BF16 |", "|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['bf16']:.4f} | {r['coat']:.4f} | {r['gap']:+.2%} |" for r in rows]
    lines += [f"| **mean** | {mean_bf16:.4f} | {mean_coat:.4f} | **{gap:+.2%}** |", "",
              f"Goal (issue 7): gap <= 0.25% of the BF16 loss, averaged over seeds: {'met' if gap <= 0.0025 else 'NOT met'}."]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        window = max(1, args.steps // 30)
        for seed, losses in runs.items():
            for mode, style in (("bf16", "-"), ("coat", "--")):
                y = losses[mode]
                smooth = [statistics.fmean(y[max(0, i - window + 1) : i + 1]) for i in range(len(y))]
                ax.plot(smooth, style, label=f"{mode} seed {seed}", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel(f"loss (moving average of {window})")
        ax.set_title(f"BF16 vs COAT, {args.preset}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "accuracy.png"), dpi=110)
        lines += ["", "![loss curves](accuracy.png)"]
    except ImportError:
        lines += ["", "(plots skipped: pip install matplotlib)"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "accuracy.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
