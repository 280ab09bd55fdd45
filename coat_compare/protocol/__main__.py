"""``python -m coat_compare.protocol``: show, flags, run, keep, power and judge (the rule and the
protocols are the package, ``coat_compare.protocol``; the runs are made by ``.runner``)."""

import argparse
import json
import sys

from . import __doc__ as PROTOCOL_DOC
from . import (
    collect,
    flags,
    get_protocol,
    judge,
    keep,
    power,
    read_rows,
    seed_list,
    show,
)
from .runner import run_protocol


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=PROTOCOL_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("show").add_argument("name")
    f = sub.add_parser("flags")
    f.add_argument("name")
    f.add_argument("seed", type=int)
    f.add_argument("key")
    f.add_argument("segment")
    f.add_argument("--checkpoint")
    r = sub.add_parser("run", help="the protocol's runs, several at once per GPU, within a deadline")
    r.add_argument("name")
    r.add_argument("--state", required=True, help="where reports and checkpoints live (kept between commands)")
    r.add_argument("--seeds", required=True, help="e.g. 1-8")
    r.add_argument("--deadline", type=float, default=560.0, help="seconds: no run starts that would end later")
    r.add_argument("--per-device", type=int, default=6, help="runs at once on each GPU (a CPU counts as one)")
    r.add_argument("--guess-step-s", type=float, default=1.0, help="seconds per step before any run has finished")
    r.add_argument("--done", nargs="*", default=[], help="rows of earlier sessions: their runs are not made again")
    for name in ("power", "judge"):
        c = sub.add_parser(name)
        c.add_argument("name")
        c.add_argument("rows", nargs="+")
        if name == "judge":
            c.add_argument("--json", help="also write the judgement here")
    k = sub.add_parser("keep", help="append a session's run rows to one file (per-step timings left out)")
    k.add_argument("source", nargs="+")
    k.add_argument("--into", required=True)
    args = p.parse_args(argv)
    try:
        if args.command == "keep":
            added = keep(args.source, args.into)
            print(f"{len(added)} row(s) added to {args.into}")
            return 0
        protocol = get_protocol(args.name)
        if args.command == "show":
            print("\n".join(show(protocol)))
        elif args.command == "flags":
            print(" ".join(flags(protocol, args.seed, args.key, args.segment, args.checkpoint)))
        elif args.command == "run":
            return run_protocol(
                protocol,
                args.state,
                seed_list(args.seeds),
                deadline_s=args.deadline,
                per_device=args.per_device,
                guess_step_s=args.guess_step_s,
                done=args.done,
            )
        elif args.command == "power":
            runs, _ = collect(protocol, read_rows(args.rows))
            gate = power(protocol, runs)
            if not gate["ready"]:
                print(f"not ready: {gate['complete']} of seeds 1..{protocol.power_after} complete")
            else:
                print(
                    f"sd {gate['sd']:.4%} over seeds 1..{protocol.power_after}; wanted {gate['wanted']} seeds; n = {gate['n']}"
                    f" (se {gate['se_at_n']:.4%})" + ("; UNDERPOWERED at the cap" if gate["underpowered"] else "")
                )
        else:
            result, lines = judge(protocol, read_rows(args.rows))
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
