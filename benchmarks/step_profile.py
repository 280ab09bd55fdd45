"""Where one end-to-end training step spends its time: GPU kernels vs the host, per mode.

    python benchmarks/step_profile.py [--preset gpt-1b] [--modes bf16,coat] [--steps 3] [--cuda-graphs none,local,full]
        [--micro-batch N] [--global-batch N] [--tp N] [--dp N] [--config-timeout S] [--out DIR]

Builds the model and optimizer exactly as ``coat-compare`` does (``coat_compare``), runs a
few warm-up steps, then profiles ``--steps`` steps with ``torch.profiler``. Per mode: the wall time
of a step, the time the GPU was busy (the union of kernel intervals: a step whose GPU is busy far
less than its wall time is bound by the host: Python, launches), the kernels run and the host's
launch calls (a CUDA graph replay runs many kernels on one cudaGraphLaunch),
the kernels that take the most GPU time and the host functions that take the most CPU time; then
the same steps again under cProfile: the Python functions by cumulative and by own time (where an
eager step's host time goes). ``--global-batch`` accumulates that many sequences per step in
micro-batches, as coat-compare does. ``--tp`` / ``--dp``: the step of one rank (rank 0) of a
TP x DP run (each configuration's processes started by torchrun, as coat-compare starts them);
its kernel table then includes the NCCL collectives, and GPU busy counts compute and
communication streams together.
Writes step_profile.md and step_profile.jsonl to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import torch

# what the host calls to put work on the GPU (a graph replay is one cudaGraphLaunch)
LAUNCH_CALLS = {
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cudaMemsetAsync",
    "cudaMemcpyAsync",
}


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in, milliseconds out)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


ROW_MARK = "STEP-PROFILE-ROW "

# kernel classes for the step's GPU time: the collectives and the optimizer first, then the layer's
COLLECTIVE, OPTIMIZER = "collectives (NCCL)", "optimizer"
LAYER_CLASSES = [  # (class, substrings of kernel names), first match wins
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "_scaled_mm")),
    ("attention", ("flash", "fmha", "sdpa", "attn", "softmax", "dot_do_o", "convert_dq")),
    ("norm", ("norm",)),
    ("SwiGLU", ("swiglu", "silu")),
    ("quantize / cast / transpose", ("quantize", "cast", "transpose", "amax", "scale", "refresh")),
    ("rope", ("rope", "rotary", "cos_kernel", "sin_kernel")),
    ("elementwise / copy / reduce", ("elementwise", "copy", "reduce", "fill", "cat", "memset", "memcpy")),
]


def step_kernel_class(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return COLLECTIVE
    if "adam" in low or "multi_tensor" in low:
        return OPTIMIZER
    return next((cls for cls, keys in LAYER_CLASSES if any(k in low for k in keys)), "other")


def class_times(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """Per step: GPU time by kernel class (summed over streams) and how much of the collectives' time
    no other kernel overlaps (the communication the step waits for). ``kernels``: (name, start us, end us)."""
    by_class: dict[str, float] = {}
    every, compute = [], []
    for name, start, end in kernels:
        cls = step_kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + (end - start) / 1e3 / steps
        every.append((start, end))
        if cls != COLLECTIVE:
            compute.append((start, end))
    compute_ms = busy_ms(compute)
    return {
        "class_ms_per_step": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
        "exposed_collective_ms_per_step": (busy_ms(every) - compute_ms) / steps,
        "compute_busy_ms_per_step": compute_ms / steps,
    }


def python_profile(run_steps) -> tuple[str, str]:
    """(by cumulative time, by own time): cProfile of ``run_steps()``, the top 40 functions each."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run_steps()
    torch.cuda.synchronize()
    prof.disable()
    tables = []
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(40)
        tables.append(buf.getvalue().strip())
    return tables[0], tables[1]


def profile_mode(preset, mode, graphs: str = "none", *, seed: int, steps: int, tp: int = 1, dp: int = 1) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from coat_compare import parallel
    from coat_compare.build import build_gpt
    from coat_compare.corpus import training_windows
    from coat_compare.train import forward_backward_function, set_learning_rate, train_step

    parallel.free_memory()
    parallel.seed_everything(seed)
    chunks, optimizer = build_gpt(preset, mode, seed, tp, graphs=graphs)
    forward_backward = forward_backward_function(graphs)
    data = training_windows(preset.with_overrides(steps=preset.warmup_steps + 1 + 2 * steps), seed, dp)

    count = preset.micro_batches(dp)

    def step(i):
        batch = data.batch(i)  # the same windows on every rank: the timing does not depend on which
        size = preset.micro_batch
        batches = [{k: v[j * size : (j + 1) * size].cuda() for k, v in batch.items()} for j in range(count)]
        set_learning_rate(optimizer, preset, i)
        return train_step(chunks, optimizer, batches, preset, None, forward_backward)

    for i in range(preset.warmup_steps + 1):
        step(i)
    torch.cuda.synchronize()
    # as coat-compare trains by default (--gc manual): no automatic collection inside the measured steps
    with parallel.manual_gc(True):
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(steps):
                step(preset.warmup_steps + 1 + i)
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / steps
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        host_launches = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name in LAUNCH_CALLS]
        gpu = busy_ms([(e.time_range.start, e.time_range.end) for e in kernels]) / steps
        classes = class_times([(e.name, e.time_range.start, e.time_range.end) for e in kernels], steps)
        table_gpu = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
        table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70)
        first = preset.warmup_steps + 1 + steps
        by_cumulative, by_own = python_profile(lambda: [step(first + i) for i in range(steps)])
    return {
        "mode": mode.name,
        "graphs": graphs,
        "preset": preset.name,
        "tp": tp,
        "dp": dp,
        "wall_ms_per_step": wall,
        "gpu_busy_ms_per_step": gpu,
        "gpu_busy_fraction": gpu / wall,
        "kernel_launches_per_step": len(kernels) / steps,
        "host_launch_calls_per_step": len(host_launches) / steps,
        **classes,
        "top_gpu": table_gpu,
        "top_cpu": table_cpu,
        "top_python_cumulative": by_cumulative,
        "top_python_own": by_own,
    }


def class_table(rows: list[dict]) -> list[str]:
    """Markdown: each mode's GPU time per step by kernel class, the collectives' exposed part, and the
    host's share (wall time when no kernel runs)."""
    classes = sorted(
        {c for r in rows for c in r["class_ms_per_step"]},
        key=lambda c: -max(r["class_ms_per_step"].get(c, 0) for r in rows),
    )
    lines = [
        "",
        "GPU time per step by kernel class, ms (summed over streams, so collectives that overlap compute count "
        "in full); exposed collectives: time when only collectives run; host: wall time when no kernel runs.",
        "",
        "| mode | CUDA graphs | "
        + " | ".join(classes)
        + " | exposed collectives | compute busy | host (wall - busy) |",
        "|---|---|" + "---:|" * (len(classes) + 3),
    ]
    for r in rows:
        cells = [f"{r['class_ms_per_step'].get(c, 0.0):.1f}" for c in classes]
        lines.append(
            f"| {r['mode']} | {r['graphs']} | " + " | ".join(cells) + f" | {r['exposed_collective_ms_per_step']:.1f} "
            f"| {r['compute_busy_ms_per_step']:.1f} | {r['wall_ms_per_step'] - r['gpu_busy_ms_per_step']:.1f} |"
        )
    return lines


def run_config(cmd: list[str], env: dict, timeout: float) -> tuple[str, str, str]:
    """Run one configuration's processes: (stdout, stderr, status). Past ``timeout`` seconds they are
    stopped and what they printed is returned (a row printed before a stalled tear-down counts)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as stopped:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        return text(stopped.stdout), text(stopped.stderr), f"stopped after {timeout:.0f} s"
    return proc.stdout, proc.stderr, f"exit {proc.returncode}"


def launcher(processes: int) -> list[str]:
    """How one configuration's processes start: this Python alone, or torchrun with one per GPU."""
    if processes == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-1b")
    p.add_argument("--modes", default="bf16,coat")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (micro-batches accumulated)")
    p.add_argument(
        "--cuda-graphs", default="none", help="comma-separated: none, local, full (as coat-compare --cuda-graphs)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallel), one process per GPU")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--config-timeout",
        type=float,
        default=400,
        help="seconds for one configuration's processes; past it they are stopped and a row they printed is kept",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one configuration, its row printed as JSON
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/step_profile.py profiles GPU steps: run it on a CUDA machine")

    from coat_compare import parallel
    from coat_compare.cli import parse_graphs
    from coat_compare.modes import parse_modes
    from coat_compare.presets import get_preset
    from coat_compare.probe import run_environment

    preset = get_preset(args.preset).with_overrides(
        micro_batch=args.micro_batch, global_batch=args.global_batch, steps=100
    )
    configs = [(m, g) for m in parse_modes(args.modes) for g in parse_graphs(args.cuda_graphs)]
    if args.one:
        from coat_compare.run import TEARDOWN_S

        with contextlib.ExitStack() as stack:
            parallel.initialize(args.tp, args.dp, stack)
            row = profile_mode(preset, *configs[0], seed=args.seed, steps=args.steps, tp=args.tp, dp=args.dp)
            if parallel.is_main_rank():
                print(ROW_MARK + json.dumps(row), flush=True)
            # the row first, then the tear-down, as coat-compare's runs: after CUDA graphs at TP the
            # destruction of the process groups may never return; past TEARDOWN_S this process
            # exits (status 1) and the parent keeps the row printed above
            with parallel.step_watchdog(TEARDOWN_S):
                parallel.free_memory()
                stack.close()
        return
    rows = []
    for mode, graphs in configs:
        # each configuration in a fresh process: CUDA graph memory pools outlive their models
        # (see coat_compare.run.isolate_runs)
        cmd = [
            *launcher(args.tp * args.dp),
            os.path.abspath(__file__),
            "--tp",
            str(args.tp),
            "--dp",
            str(args.dp),
            "--preset",
            args.preset,
            "--modes",
            mode.name,
            "--cuda-graphs",
            graphs,
            "--steps",
            str(args.steps),
            "--seed",
            str(args.seed),
            "--one",
        ]
        if args.micro_batch:
            cmd += ["--micro-batch", str(args.micro_batch)]
        if args.global_batch:
            cmd += ["--global-batch", str(args.global_batch)]
        env = {**os.environ, **run_environment(["--tp", str(args.tp)])}
        stdout, stderr, status = run_config(cmd, env, args.config_timeout)
        found = [line[len(ROW_MARK) :] for line in stdout.splitlines() if line.startswith(ROW_MARK)]
        if not found:
            print(f"{mode.name} (graphs {graphs}) failed ({status}): {stderr[-2000:]}", flush=True)
            continue
        r = json.loads(found[-1])
        rows.append(r)
        print(
            f"{r['mode']} (graphs {graphs}): {r['wall_ms_per_step']:.1f} ms/step, GPU busy {r['gpu_busy_ms_per_step']:.1f} ms "
            f"({r['gpu_busy_fraction']:.2f}), {r['kernel_launches_per_step']:.0f} kernels/step, "
            f"{r['host_launch_calls_per_step']:.0f} host launch calls/step",
            flush=True,
        )
    lines = [
        f"# One training step, {args.preset} (micro-batch {preset.micro_batch}, global batch "
        f"{preset.global_batch_for(args.dp)}, TP {args.tp} x DP {args.dp}: rank 0's step), {torch.cuda.get_device_name()}",
        "",
        "`python " + " ".join(sys.argv) + "`",
        "",
        "| mode | CUDA graphs | wall ms/step | GPU busy ms/step | busy fraction | kernels run/step | host launch calls/step |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['mode']} | {r['graphs']} | {r['wall_ms_per_step']:.1f} | {r['gpu_busy_ms_per_step']:.1f} | {r['gpu_busy_fraction']:.2f} | "
        f"{r['kernel_launches_per_step']:.0f} | {r['host_launch_calls_per_step']:.0f} |"
        for r in rows
    ]
    lines += class_table(rows)
    for r in rows:
        name = r["mode"] + ("" if r["graphs"] == "none" else f" with {r['graphs']} CUDA graphs")
        lines += [
            "",
            f"## {name}: GPU time by kernel",
            "",
            "```",
            r["top_gpu"],
            "```",
            "",
            f"## {name}: host time by function",
            "",
            "```",
            r["top_cpu"],
            "```",
            "",
            f"## {name}: Python functions by cumulative time (cProfile, {args.steps} more steps)",
            "",
            "```",
            r["top_python_cumulative"],
            "```",
            "",
            f"## {name}: Python functions by own time",
            "",
            "```",
            r["top_python_own"],
            "```",
        ]
    text = "\n".join(lines) + "\n"
    from coat_compare.report import write_markdown_and_rows

    write_markdown_and_rows(
        args.out, "step_profile", text, [{k: v for k, v in r.items() if not k.startswith("top_")} for r in rows]
    )


if __name__ == "__main__":
    main()
