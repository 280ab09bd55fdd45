"""The ``run`` sub-command: each mode of a preset in each CUDA graph configuration, a row each
(``measure``), and one run of a job in this process group (``run --probe``: ``probe``), which the
runs of every sub-command are. A job's runs train in processes of their own (``run_in_processes``),
except a run of one process on a CPU and a per-layer preset on one GPU, which train in the job's
(``measure_here``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from . import parallel
from .modes import Mode
from .presets import Preset
from .probe import PROBE_MARK, STACKS_SIGNAL, new_row, run_args, run_probe
from .progress import Progress


def measure(o, keep) -> None:
    """Each mode in each CUDA graph configuration (``graph_runs``), each row handed to ``keep``."""
    preset = o.preset
    runs = [(mode, graphs) for mode in o.modes for graphs in graph_runs(preset, o.cuda_graphs)]
    if not measure_here(preset, o.tp * o.pp * o.dp, o.load):
        for mode, graphs in runs:
            keep(run_in_processes(preset, mode, o, graphs))
        return
    with contextlib.ExitStack() as stack:
        parallel.initialize(o.tp, o.dp, stack, pp=o.pp, vpp=o.vpp)
        for mode, graphs in runs:
            keep(run_mode(preset, mode, o, graphs))


def probe(o) -> int:
    """One run (``--probe``: a mode in one CUDA graph configuration) in this process group: its
    row, printed by rank 0 after ``PROBE_MARK``."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the job asks for the stacks of a run it stops
    with contextlib.ExitStack() as stack:
        parallel.initialize(o.tp, o.dp, stack, pp=o.pp, vpp=o.vpp)
        row = run_mode(o.preset, o.modes[0], o, o.cuda_graphs[0], release=False)
        # the row first, then the tear-down (CUDA graphs, process groups): a tear-down that stalls
        # costs the run its exit, not its row (``probe.run_probe`` keeps a row printed before a stall)
        if parallel.is_main_rank():
            print(PROBE_MARK + json.dumps(row), flush=True)
        print(f"{time.strftime('%H:%M:%S')} rank {parallel.rank()}: row made; releasing", file=sys.stderr, flush=True)
        with parallel.step_watchdog(TEARDOWN_S):  # past it: the stacks, then exit 1 (the row stands)
            parallel.free_memory()
            stack.close()  # Megatron's groups and the process group
        print(f"{time.strftime('%H:%M:%S')} rank {parallel.rank()}: released; leaving", file=sys.stderr, flush=True)
    return 0


TEARDOWN_S = 60  # a probe's tear-down (CUDA graphs, NCCL groups) takes seconds; past this it is stuck


def graph_runs(preset: Preset, cuda_graphs: list[str]) -> list[str]:
    """The CUDA graph configurations each mode runs in: --cuda-graphs for end-to-end presets; a
    per-layer preset times one layer's GPU work eagerly (at these shapes the GPU, not the host,
    bounds it), so it runs once."""
    return cuda_graphs if preset.kind == "train" else ["none"]


def measure_here(preset: Preset, processes: int, load: str | None) -> bool:
    """Whether the comparison's runs train in this process rather than in processes of their own:
    only a run of one process on a CPU, or one layer on one GPU. Megatron keeps graph state
    process-wide (capture flags, the whole-step graph's memory pool, static buffers), and a
    graph's private memory pool outlives the model it served: on an H100, a mode run after a
    whole-step-graph mode in the same process started with the earlier mode's pool still held,
    a second whole-step capture failed in PyTorch's allocator, and the tiny preset hit an illegal
    memory access. Eager modes too: an out-of-memory mode leaves the allocator fragmented for the
    next, and what one mode leaks counts as the next one's memory (at TP 2 x DP 2, TE FP8 and COAT
    ran out of memory after a graphed BF16 run in the same processes, and fitted in their own). A
    run of several processes needs its own torchrun, and a rank that dies or stalls then ends its
    run, not the job. Processes per run cost a start-up each and leave every row clean."""
    # a checkpoint that breaks its reader (a corrupt file can kill a process) costs a row, not the job
    return processes == 1 and not load and (not torch.cuda.is_available() or preset.kind == "layer")


def run_in_processes(preset: Preset, mode: Mode, args, graphs: str) -> dict:
    """``run_mode`` in processes of its own (``probe``): the row it printed, or a failed row with
    why (and the dead run's whole output in a log beside the report)."""
    row = new_row(preset.kind, preset, mode, args, graphs)
    if row.get("status") == "skipped":
        return row
    processes = args.tp * args.pp * args.dp
    print(f"{preset.name} {mode.name} (graphs: {graphs}): {processes} fresh process(es)", file=sys.stderr, flush=True)
    line = run_args(args, preset, mode.name, graphs=graphs, micro_batch=preset.micro_batch, extra=checkpoint_args(args))
    result = run_probe(line, processes, timeout_s=args.run_timeout)
    if result.row is None:
        reason = result.error
        if result.log and args.out:
            log = Path(args.out) / f"{args.name or preset.name}-{mode.name}-{graphs}-failed.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(result.log)
            reason += f" (log: {log.name})"
        return {**row, "status": "failed", "reason": reason, "seconds": round(result.seconds, 2)}
    return result.row


def checkpoint_args(args) -> tuple[str, ...]:
    """The job's --save / --load options (one mode: cli.check_args), for its run in processes of
    its own."""
    line: list[str] = []
    for option, value in (("--save", args.save), ("--load", args.load)):
        if value:
            line += [option, value]
    if args.save:
        if args.save_step is not None:
            line += ["--save-step", str(args.save_step)]
        if args.save_steps is not None:
            line += ["--save-steps", ",".join(map(str, args.save_steps))]
        if args.stop_after_save:
            line.append("--stop-after-save")
    return tuple(line)


def run_mode(preset: Preset, mode: Mode, args, graphs: str = "none", release: bool = True) -> dict:
    """One mode of one preset in this process group: a measurement row, or a row saying why there
    is none. ``release``: free what the run held (CUDA graphs, cached memory) before returning."""
    from .layer import measure_layer
    from .train import train

    preset = preset_for(preset, graphs, eval_asked=args.eval_every is not None)
    row = new_row(preset.kind, preset, mode, args, graphs)
    if row.get("status") == "skipped":
        return row
    parallel.free_memory()
    parallel.seed_everything(args.seed)
    start = time.perf_counter()
    try:
        if preset.kind == "layer":
            result = measure_layer(preset, mode, args.seed, tp=args.tp)
        else:
            label = f"{preset.name} {mode.name}" + ("" if graphs == "none" else f" (graphs: {graphs})")
            progress = Progress(
                preset.steps, label, enabled=parallel.is_main_rank()
            )  # a probe's: in its log if it fails
            save_step = preset.steps // 2 if args.save_step is None else args.save_step
            same = ("data_seed", "tp", "dp", "pp", "vpp", "save", "stop_after_save", "load", "overlap_grad_reduce",
                    "overlap_param_gather", "step_timeout", "checkpoint_format", "deterministic")  # fmt: skip
            result = train(preset, mode, args.seed, progress=progress, save_step=save_step, save_steps=args.save_steps or (),
                           graphs=graphs, gc_mode=args.gc, **{name: getattr(args, name) for name in same})  # fmt: skip
        row = {**row, "status": "ok", **result}
    except Exception as e:  # noqa: BLE001 - one mode failing is a row of the report, not the end of the job
        oom = isinstance(e, torch.OutOfMemoryError)
        if oom or "out of memory" in str(e).lower():
            error = str(e).splitlines()[0] if oom else f"{type(e).__name__}: {e}"
            row = {**row, "status": "oom", "reason": out_of_memory_reason(preset, mode, args, error)}
        else:
            traceback.print_exc(file=sys.stderr)
            row = {**row, "status": "failed", "reason": f"{type(e).__name__}: {e}"[:300]}
    row["seconds"] = round(time.perf_counter() - start, 2)
    if release:
        parallel.free_memory()
    return row


def out_of_memory_reason(preset: Preset, mode: Mode, args, error: str) -> str:
    """An out-of-memory row's reason: what each GPU holds between steps after TP, PP and DP
    sharding, and which part dominates (``memory.why_it_does_not_fit``), then the allocator's
    first line."""
    from .flops import matmul_parameters
    from .memory import why_it_does_not_fit

    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    params = matmul_parameters(preset) + preset.vocab * preset.hidden  # with the input embedding
    fit = why_it_does_not_fit(mode, params, gpu, tp=args.tp, pp=args.pp, dp=args.dp) if gpu else ""
    return f"out of memory at micro-batch {preset.micro_batch}: {fit}. {error}"[:500]


def preset_for(preset: Preset, graphs: str, eval_asked: bool = False) -> Preset:
    """``preset`` as one CUDA graph configuration trains it: a graphed run is a speed run, so it
    leaves out the preset's default validation; one asked for with ``--eval-every`` runs (eagerly,
    between the graphed steps: ``train.validation_loss``)."""
    return preset if graphs == "none" or eval_asked else replace(preset, eval_every=0)
