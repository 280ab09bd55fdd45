"""The runs of scripts/gpu_pretrain_layouts.sh, read back from Megatron's logs in one folder.

    python3 scripts/pretrain_summary.py FOLDER > FOLDER/summary.md      # also writes FOLDER/rows.jsonl

Each LAYOUT-MODE.log gives one row (rows.jsonl, one JSON line per run, the figures the table quotes):
tokens/s and ms per iteration (medians of the iterations after the first half), Megatron's own
TFLOP/s per GPU (its causal count, printed with --log-throughput; the same median), the peak memory
per rank (Megatron's report after the last iteration), the logged losses, each logged interval's ms per
iteration, and a status. The table on
stdout sets each run against BF16 in the same layout, TE FP8 with the same graphs, the mode without
its +options, and the same mode in layout "one" (the largest loss difference at the same logged
iterations)."""

import json
import pathlib
import re
import statistics
import sys

ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
TFLOPS = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)")
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([\d.Ee+-]+)")
MEMORY = re.compile(
    r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\) \| allocated: [\d.]+ \| "
    r"max allocated: ([\d.]+) \| reserved: [\d.]+ \| max reserved: ([\d.]+)"
)


def arg(name, text):
    """An argument as Megatron's log lists it ("  name ....... value"), "?" where absent."""
    found = re.search(rf"^\s+{name} \.+ (\S+)$", text, re.M)
    return found[1] if found else "?"


def read(log):
    return parse(log.name, log.read_text(errors="replace"))


def parse(name, text):
    """A run's row from its log's text; ``name`` is the log's file name, LAYOUT-MODE.log."""
    layout, mode = name.removesuffix(".log").split("-", 1)
    times = [(int(i), int(n), float(ms)) for i, n, ms in ITERATION.findall(text)]
    total = times[-1][1] if times else 0
    steady = [ms for i, n, ms in times if i > n // 2]
    tflops = [float(t) for i, n, t in TFLOPS.findall(text) if int(i) > int(n) // 2]
    memory = {}
    for rank, peak, reserved in MEMORY.findall(text):
        memory[int(rank)] = (float(peak), float(reserved))  # the last report of each rank
    batch, seq = arg("global_batch_size", text), arg("seq_length", text)
    tokens = int(batch) * int(seq) if times and "?" not in (batch, seq) else 0  # 0: a log without its arguments
    done = bool(times) and times[-1][0] == total
    lines = text.splitlines()
    errors = [line.strip() for line in lines if re.search(r"coat-megatron-run: error|\w+Error(: |$)", line)]
    error = next((e for e in errors if "ChildFailedError" not in e), "")  # the rank's, not torchrun's
    if error.endswith("AssertionError"):  # a bare assertion: name the failed statement
        asserts = [line.split("]:", 1)[-1].strip() for line in lines if re.search(r"^\S*\s+assert ", line)]
        error = f"{error}: {asserts[-1]}" if asserts else error
    ms = statistics.median(steady) if done and steady else None
    return dict(
        layout=layout,
        mode=mode,
        gpus=arg("world_size", text),
        graphs=arg("cuda_graph_impl", text),
        iterations=len(times),
        timed_iterations=len(steady),
        ms_per_iteration=ms,
        tokens_s=tokens * 1000 / ms if ms and tokens else None,
        megatron_tflops_per_gpu=statistics.median(tflops) if done and tflops else None,
        peak=max((p for p, _ in memory.values()), default=None),
        peak_reserved_mib={str(r): pr for r, (_, pr) in sorted(memory.items())},
        peak_allocated_mib={str(r): p for r, (p, _) in sorted(memory.items())},
        status="ok" if done else f"stopped: {error[:90] or 'no iteration finished (see the log)'}",
        losses={str(i): float(v) for i, v in LOSS.findall(text)},
        interval_ms={str(i): ms for i, _, ms in times},  # each logged interval's ms per iteration
        log=name,
    )


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else ""


def loss_cells(rows, row):
    got = {int(i): v for i, v in row["losses"].items()}
    first_last = f"{got[min(got)]:.4f} -> {got[max(got)]:.4f}" if got else ""
    ref = {int(i): v for i, v in rows.get(("one", row["mode"]), {}).get("losses", {}).items()}
    common = sorted(set(got) & set(ref))
    if row["layout"] == "one" or not common:
        return first_last, ""
    return first_last, f"{max(abs(got[i] - ref[i]) for i in common):.2e}"


def main(folder):
    out = pathlib.Path(folder)
    rows = {}
    for log in sorted(out.glob("*-*.log")):
        row = read(log)
        rows[row["layout"], row["mode"]] = row
    with open(out / "rows.jsonl", "w") as f:
        for row in rows.values():
            f.write(json.dumps(row) + "\n")
    print(
        "| layout | mode | GPUs | graphs | tokens/s | tokens/s per GPU | x BF16 eager | x BF16 same graphs "
        "| peak x BF16 eager | loss first -> last | largest loss difference vs one | x TE FP8 same graphs "
        "| x the mode without +options | Megatron TFLOP/s per GPU | peak allocated (reserved) MiB per rank | status |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|")
    for (layout, mode), row in sorted(rows.items()):
        eager = rows.get((layout, "bf16"), {})
        same = rows.get((layout, "bf16-graphs" if row["graphs"] != "none" else "bf16"), {})
        te = rows.get((layout, "te-fp8-graphs" if row["graphs"] != "none" else "te-fp8"), {})
        plain = rows.get((layout, mode.split("+")[0]), {}) if "+" in mode else {}
        tps = row["tokens_s"]
        per_gpu = f"{tps / int(row['gpus']):,.0f}" if tps and row["gpus"].isdigit() else ""
        memory = " / ".join(
            f"{p:,.0f} ({row['peak_reserved_mib'][r]:,.0f})" for r, p in row["peak_allocated_mib"].items()
        )
        tflops = row["megatron_tflops_per_gpu"]
        print(
            f"| {layout} | {mode} | {row['gpus']} | {row['graphs']} | {f'{tps:,.0f}' if tps else ''} | {per_gpu} "
            f"| {ratio(tps, eager.get('tokens_s'))} | {ratio(tps, same.get('tokens_s'))} "
            f"| {ratio(row['peak'], eager.get('peak'))} | {' | '.join(loss_cells(rows, row))} "
            f"| {ratio(tps, te.get('tokens_s'))} | {ratio(tps, plain.get('tokens_s'))} "
            f"| {'' if tflops is None else f'{tflops:.1f}'} | {memory} | {row['status']} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
