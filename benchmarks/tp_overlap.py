"""What overlapping COAT's tensor-parallel exchanges with its GEMMs is worth: one transformer layer
fwd+bwd at TP 2 with sequence parallel, COAT with ``tp_comm_overlap`` on (the default) and off,
BF16 and TE FP8 beside them.

    torchrun --nproc-per-node 2 benchmarks/tp_overlap.py [--preset llama2-7b-layer] [--micro-batches 1,4]
        [--modes bf16,te-fp8-current] [--trace] [--out DIR]

Each row is coat-compare's per-layer measurement (``coat_compare.layer.measure_layer``): the median
of CUDA-event timings of fwd+bwd, the same count of repeats on every rank, after warm-up; the
activation memory a rank keeps for backward; the bytes a rank contributes to tensor-parallel
all-gathers. The two COAT rows differ only in ``CoatConfig.tp_comm_overlap``: on, every
sequence-parallel gather and reduce-scatter passes its chunks from rank to rank while the GEMM of
the chunk in hand runs; off, the same chunks, scales and GEMMs wait for one blocking collective
per exchange. coat-compare's modes do not set that switch, so this script sets it on the coat
mode's CoatConfig while the layer is built. ``--trace`` also writes one fwd+bwd of each COAT row
as a Chrome trace per rank (torch.profiler), where the NCCL kernels can be seen beside the GEMMs.
Rank 0 prints the table and writes tp_overlap.md and tp_overlap.jsonl to ``--out``. On a CPU (gloo)
``--preset tiny-layer`` runs the same rows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import torch

COAT_ROWS = (("coat, overlap on", True), ("coat, overlap off", False))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama2-7b-layer", help="a per-layer preset of coat-compare")
    p.add_argument("--micro-batches", default="1,4", help="micro-batch sizes, comma-separated")
    p.add_argument("--modes", default="bf16,te-fp8-current", help="coat-compare modes measured beside COAT's two rows")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--trace", action="store_true", help="write a Chrome trace of one fwd+bwd per COAT row and rank")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    from coat_compare.modes import parse_modes
    from coat_compare.presets import get_preset

    preset = get_preset(args.preset)
    if preset.kind != "layer":
        p.error(f"--preset {args.preset} trains a model; name a per-layer preset (e.g. llama2-7b-layer)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        p.error("tensor parallelism needs processes: launch with torchrun --nproc-per-node 2 benchmarks/tp_overlap.py")
    args.tp = world
    args.preset = preset
    args.micro_batches = [int(m) for m in args.micro_batches.split(",")]
    args.modes = [m for m in parse_modes(args.modes) if m.name != "coat"] if args.modes else []
    return args


@contextlib.contextmanager
def coat_overlap(on: bool):
    """COAT layers built inside take ``tp_comm_overlap=on`` (coat-compare builds them from its
    modes' CoatConfig, ``coat_compare.build.coat_config``, which leaves the switch at its default)."""
    from coat_compare import build

    real, built = build.coat_config, []

    def coat_config(mode):
        built.append(mode.name)
        return dataclasses.replace(real(mode), tp_comm_overlap=on)

    build.coat_config = coat_config
    try:
        yield
    finally:
        build.coat_config = real
    if not built:
        raise RuntimeError(
            "no COAT layer was built through coat_compare.build.coat_config: update coat_overlap() to where "
            "coat-compare now makes the COAT layers' CoatConfig"
        )


def trace_step(preset, mode, seed: int, tp: int, path: str) -> None:
    """One fwd+bwd of the layer, after warm-up, as a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    from coat_compare.layer import LayerStep

    run = LayerStep(preset, mode, seed, tp)
    for _ in range(3):
        run.step()
        run.clear_grads()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def measure_rows(args) -> list[dict]:
    from coat_compare import parallel
    from coat_compare.layer import measure_layer
    from coat_compare.modes import MODES, unavailable_reason

    rows = []
    for micro_batch in args.micro_batches:
        preset = dataclasses.replace(args.preset, micro_batch=micro_batch)
        runs = [(m.name, m, None) for m in args.modes] + [(name, MODES["coat"], on) for name, on in COAT_ROWS]
        for name, mode, overlap in runs:
            row = {"row": name, "micro_batch": micro_batch, "seq": preset.seq, "tp": args.tp}
            reason = unavailable_reason(mode, "layer")
            if reason:
                rows.append({**row, "status": "skipped", "reason": reason})
                continue
            parallel.free_memory()
            parallel.seed_everything(args.seed)
            with coat_overlap(overlap) if overlap is not None else contextlib.nullcontext():
                rows.append({**row, "status": "ok", **measure_layer(preset, mode, args.seed, tp=args.tp)})
                if args.trace and overlap is not None and torch.cuda.is_available():
                    label = "on" if overlap else "off"
                    rank = torch.distributed.get_rank()
                    path = os.path.join(args.out, f"trace-mb{micro_batch}-overlap-{label}-rank{rank}.json")
                    trace_step(preset, mode, args.seed, args.tp, path)
            if parallel.is_main_rank():
                print(f"micro-batch {micro_batch}, {name}: {rows[-1]['ms']:.2f} ms", flush=True)
    return rows


def table(args, rows: list[dict]) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [
        f"# One {args.preset.name} layer fwd+bwd at TP {args.tp} + sequence parallel ({device})",
        "",
        f"`torchrun --nproc-per-node {args.tp} benchmarks/tp_overlap.py {' '.join(sys.argv[1:])}`",
        "",
        "| micro-batch | row | ms fwd+bwd | vs BF16 | vs overlap off | activation MiB | SP all-gather MiB (FP8) |",
        "|---|---|---|---|---|---|---|",
    ]
    for micro_batch in args.micro_batches:
        same = {r["row"]: r for r in rows if r["micro_batch"] == micro_batch and r["status"] == "ok"}
        bf16, off = same.get("bf16"), same.get(COAT_ROWS[1][0])
        for r in (r for r in rows if r["micro_batch"] == micro_batch):
            if r["status"] != "ok":
                lines.append(f"| {micro_batch} | {r['row']} | {r['status']}: {r['reason']} | | | | |")
                continue
            vs_bf16 = f"{bf16['ms'] / r['ms']:.2f}x" if bf16 else "-"
            vs_off = f"{off['ms'] / r['ms']:.2f}x" if off and r["row"].startswith("coat") else "-"
            gathered = f"{r['sp_all_gather_bytes'] / 2**20:.2f} ({r['sp_all_gather_fp8_bytes'] / 2**20:.2f})"
            lines.append(
                f"| {micro_batch} | {r['row']} | {r['ms']:.2f} | {vs_bf16} | {vs_off} | "
                f"{r['activation_MiB']:.1f} | {gathered} |"
            )
    lines += [
        "",
        "vs BF16 and vs overlap off: speed-ups (the other row's time over this one's). Times are each rank's "
        "median over the same repeats; rank 0's are shown.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from coat_compare import parallel
    from coat_compare.report import write_markdown_and_rows

    with contextlib.ExitStack() as stack:
        parallel.initialize(args.tp, 1, stack)
        rows = measure_rows(args)
        if parallel.is_main_rank():
            write_markdown_and_rows(args.out, "tp_overlap", table(args, rows), rows)


if __name__ == "__main__":
    main()
