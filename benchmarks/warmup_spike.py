"""Whether a short learning-rate warm-up makes the first steps' loss spike past ln(vocab).

    python benchmarks/warmup_spike.py [--layers 12] [--hidden 1024] [--vocab 256] [--lr 3e-4]
                                      [--seq 64] [--micro-batch 8] [--warmups 5,10] [--steps 30]
                                      [--modes bf16] [--out DIR]

Trains a Llama-shaped GPT (coat-compare's harness: ``build_gpt``, the docstrings corpus of byte
tokens, seq 64 x micro-batch 8 unless given) from the same initial weights once per warm-up length, and
reports each run's highest training loss after step 1 against ln(vocab), what uniform guessing
scores. Small enough for a CPU at the default shape; any shape on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from dataclasses import replace

from coat_compare import parallel
from coat_compare.modes import parse_modes
from coat_compare.presets import get_preset
from coat_compare.train import train


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step (one micro-batch)")
    p.add_argument("--warmups", default="5,10", help="warm-up lengths in steps, comma-separated")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--modes", default="bf16")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    base = replace(
        get_preset("tiny"), layers=args.layers, hidden=args.hidden, ffn=2 * args.hidden, heads=max(1, args.hidden // 64),
        vocab=args.vocab, seq=args.seq, micro_batch=args.micro_batch, steps=args.steps, lr=args.lr, eval_every=0,
    )  # fmt: skip
    rows = []
    with contextlib.ExitStack() as stack:
        parallel.initialize(1, 1, stack)
        for mode in parse_modes(args.modes):
            for warmup in (int(w) for w in args.warmups.split(",")):
                parallel.seed_everything(args.seed)
                result = train(replace(base, lr_warmup_steps=warmup), mode, args.seed)
                losses = result["losses"]
                rows.append({"mode": mode.name, "lr_warmup_steps": warmup, "ln_vocab": math.log(args.vocab),
                             "peak_after_step_1": max(losses[1:]), "losses": losses, "device": parallel.device_name()})  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "warmup_spike.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lines = [
        f"# Start-up loss by warm-up length: {args.layers} layers x {args.hidden}, vocab {args.vocab}, lr {args.lr:g}, "
        f"{args.steps} steps, seq {args.seq} x micro-batch {args.micro_batch}, on {rows[0]['device']}",
        "",
        f"`python benchmarks/warmup_spike.py --layers {args.layers} --hidden {args.hidden} --vocab {args.vocab} --lr {args.lr:g} "
        f"--seq {args.seq} --micro-batch {args.micro_batch} "
        f"--warmups {args.warmups} --steps {args.steps} --modes {args.modes}`",
        "",
        "| mode | warm-up steps | first loss | highest loss after step 1 | ln(vocab) | spike past ln(vocab) | losses, first 12 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spike = "yes" if r["peak_after_step_1"] > r["ln_vocab"] else "no"
        first = ", ".join(f"{x:.2f}" for x in r["losses"][:12])
        lines.append(
            f"| {r['mode']} | {r['lr_warmup_steps']} | {r['losses'][0]:.3f} | {r['peak_after_step_1']:.3f} | "
            f"{r['ln_vocab']:.3f} | {spike} | {first} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "warmup_spike.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
