"""The ``coat-compare`` command: its sub-commands, each a job that measures rows and writes a report.

``main`` reads the command line (``cli.parse_args``: the ``Options``, checked) and runs its
sub-command: ``run`` (``compare``: each mode in each CUDA graph configuration, a row each),
``search`` (each mode's largest micro-batch), ``resume`` (the checkpoint-resume check),
``layouts`` (the layout check), ``summarize`` (earlier reports combined) or ``protocol`` (the
accuracy protocols, ``coat_compare.protocol``). A job's runs train in processes of their own
(``probe``: under torchrun for several), except a run of one process on a CPU, and a per-layer
preset on one GPU, which run here (``measure_here``). Those processes are ``run --probe``: one
mode measured, its row printed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import glob
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

from . import parallel
from .cli import Options, check_directory, parse_args, refuse
from .goals import evaluate
from .layouts import layout_name, layout_rows, parse_layouts
from .modes import Mode, unavailable_reason
from .plots import draw
from .presets import Preset
from .probe import PROBE_MARK, STACKS_SIGNAL, run_args, run_probe
from .progress import Progress
from .report import RowLog, read_jsonl, write_report
from .resume import resume_check, resume_layouts
from .search import largest_micro_batch, probe_fits


def main(argv=None) -> int:
    """The sub-command the command line names (none: ``run``). A job's exit status: 0 when every
    row ran (or ran out of memory, or cannot run on this machine), 1 when a row failed otherwise
    (after the report is written), 2 for a command line it cannot run."""
    options = parse_args(argv)
    return SUB_COMMANDS[options.command](options)


def run_command(o: Options) -> int:
    """run: each mode in each CUDA graph configuration (``compare``); with ``--probe``, one run in
    this process group, its row printed (``probe``)."""
    if o.probe:
        start(o)
        return probe(o.preset, o.modes[0], o)
    return job(o, compare)


def search_command(o: Options) -> int:
    return job(o, search_all, "search")


def resume_command(o: Options) -> int:
    return job(o, resume_all, "resume")


def layouts_command(o: Options) -> int:
    return job(o, layouts_all, "layouts")


def summarize_command(o: Options) -> int:
    if os.path.isdir(o.out):
        try:
            check_directory(o.out, "--out", create=False)
        except ValueError as e:
            refuse(str(e))
    return summarize(o.out)


def protocol_command(o: Options) -> int:
    from .protocol.__main__ import main as protocol_main

    return protocol_main(list(o.protocol_argv))


def start(o: Options) -> None:
    """Before a job's work: Megatron's deterministic mode where asked, and ``prepare``."""
    if o.deterministic:
        deterministic()
    try:
        prepare(o.preset, o.modes, o)
    except ValueError as e:
        refuse(str(e))


def job(o: Options, measure, kind: str | None = None) -> int:
    """A job: the rows ``measure(o, preset, modes, keep)`` hands to ``keep``, each on disk as it
    comes (``RowLog``), then the report (``{out}/{name}.*``, the name ``PRESET-KIND`` unless
    ``--name``) and the exit status."""
    start(o)
    name = o.name or o.preset.name + (f"-{kind}" if kind else "")
    log = RowLog(o.out, name)
    try:
        measure(o, o.preset, o.modes, log.add)
        report(o.out, name, o.preset, log.rows, plots=not o.no_plots)
    except BaseException as e:
        if log.path and log.rows:
            print(
                f"coat-compare: the job stopped ({type(e).__name__}); the rows it measured ({len(log.rows)}) are in "
                f"{log.path}",
                file=sys.stderr,
                flush=True,
            )
        raise
    log.finish()
    return exit_status(log.rows)


def deterministic() -> None:
    """Megatron's deterministic mode for this process and the runs it starts (which inherit the
    environment): before any cuBLAS or TE kernel runs."""
    from megatron.training.determinism import apply_determinism_env

    apply_determinism_env(os.environ)
    torch.use_deterministic_algorithms(True, warn_only=True)


def compare(args, preset: Preset, modes: list[Mode], keep) -> None:
    """Each mode in each CUDA graph configuration (``graph_runs``), each row handed to ``keep``."""
    runs = [(mode, graphs) for mode in modes for graphs in graph_runs(preset, args)]
    if not measure_here(preset, args):
        for mode, graphs in runs:
            keep(run_in_processes(preset, mode, args, graphs))
        return
    with contextlib.ExitStack() as stack:
        parallel.initialize(args.tp, args.dp, stack, pp=args.pp, vpp=args.vpp)
        for mode, graphs in runs:
            keep(run_mode(preset, mode, args, graphs))


def probe(preset: Preset, mode: Mode, args) -> int:
    """One run (``--probe``: a mode in one CUDA graph configuration) in this process group: its
    row, printed by rank 0 after ``PROBE_MARK``."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the job asks for the stacks of a run it stops
    with contextlib.ExitStack() as stack:
        parallel.initialize(args.tp, args.dp, stack, pp=args.pp, vpp=args.vpp)
        row = run_mode(preset, mode, args, args.cuda_graphs[0], release=False)
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


def prepare(preset: Preset, modes: list[Mode], args) -> None:
    """Before any work: make the directories the job writes into and prove them writable, and check
    that the training text lasts the run; raise ValueError naming the fix."""
    if not args.probe:
        check_directory(args.out, "--out")
    if args.save:
        check_directory(args.save, "--save")
    if args.resume_check and args.checkpoint_dir:
        check_directory(args.checkpoint_dir, "--checkpoint-dir")
    runs = any(why_not_here(preset, mode) is None for mode in modes)
    # a probe's job checked it already; a search try is a few steps
    if preset.kind == "train" and runs and not args.probe and not args.search:
        from .train import training_windows

        layouts = parse_layouts(args.layouts) if args.layouts else [(args.tp, args.pp, args.vpp, args.dp)]
        for _, _, _, dp in layouts:
            training_windows(preset, args.seed if args.data_seed is None else args.data_seed, dp)


def exit_status(rows: list[dict]) -> int:
    """1 when a row failed for another reason than memory ("oom") or this machine ("skipped": no
    TransformerEngine, no GPU), saying which on stderr; else 0."""
    failed = [r for r in rows if r.get("status") == "failed"]
    if not failed:
        return 0
    first = failed[0]
    print(
        f"coat-compare: {len(failed)} of {len(rows)} rows failed, the first {first.get('mode')} "
        f"(graphs: {first.get('graphs', 'none')}): {first.get('reason', '')}",
        file=sys.stderr,
        flush=True,
    )
    return 1


def graph_runs(preset: Preset, args) -> list[str]:
    """The CUDA graph configurations each mode runs in: --cuda-graphs for end-to-end presets; a
    per-layer preset times one layer's GPU work eagerly (at these shapes the GPU, not the host,
    bounds it), so it runs once."""
    return args.cuda_graphs if preset.kind == "train" else ["none"]


def measure_here(preset: Preset, args) -> bool:
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
    one_process = args.tp * args.pp * args.dp == 1
    # a checkpoint that breaks its reader (a corrupt file can kill a process) costs a row, not the job
    return one_process and not args.load and (not torch.cuda.is_available() or preset.kind == "layer")


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
            result = train(
                preset_for(preset, graphs, eval_asked=args.eval_every is not None),
                mode,
                args.seed,
                data_seed=args.data_seed,
                tp=args.tp,
                dp=args.dp,
                pp=args.pp,
                vpp=args.vpp,
                progress=progress,
                save=args.save,
                save_step=save_step,
                save_steps=args.save_steps or (),
                stop_after_save=args.stop_after_save,
                load=args.load,
                graphs=graphs,
                gc_mode=args.gc,
                overlap_grad_reduce=args.overlap_grad_reduce,
                overlap_param_gather=args.overlap_param_gather,
                step_timeout=args.step_timeout,
                checkpoint_format=args.checkpoint_format,
                deterministic=args.deterministic,
            )
        row.update(status="ok", **result)
    except torch.OutOfMemoryError as e:
        row.update(status="oom", reason=out_of_memory_reason(preset, mode, args, str(e).splitlines()[0]))
    except Exception as e:  # noqa: BLE001 - one mode failing is a row of the report, not the end of the job
        if "out of memory" in str(e).lower():
            row.update(status="oom", reason=out_of_memory_reason(preset, mode, args, f"{type(e).__name__}: {e}"))
        else:
            traceback.print_exc(file=sys.stderr)
            row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:300])
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


def resume_all(args, preset: Preset, modes: list[Mode], keep) -> None:
    """The checkpoint-resume check (``resume``) of each mode, each row handed to ``keep`` when done."""
    for mode in modes:
        row = new_row("resume", preset, mode, args)
        if row.get("status") == "skipped":
            keep(row)
            continue
        print(
            f"{preset.name} {mode.name}: a checkpoint at {layout_name(args.tp, args.pp, args.vpp, args.dp)}, resumed at "
            f"{', '.join(layout_name(*layout) for layout in resume_layouts(args))}",
            file=sys.stderr,
            flush=True,
        )
        keep(resume_check(args, preset, mode, row))


def layouts_all(args, preset: Preset, modes: list[Mode], keep) -> None:
    """The layout check (``layouts``): every mode trained in every layout given (each run in
    processes of its own), then one row per (mode, layout) judged against the first layout."""
    layouts = parse_layouts(args.layouts)
    names = [layout_name(*layout) for layout in layouts]
    runs = {}
    for mode in modes:
        for layout, name in zip(layouts, names):
            tp, pp, vpp, dp = layout
            row = new_row("train", preset, mode, args, args.cuda_graphs[0])
            if row.get("status") == "skipped":
                runs[(mode.name, name)] = {**row, "layout": name}
                continue
            print(f"{preset.name} {mode.name}: layout {name}", file=sys.stderr, flush=True)
            line = run_args(
                args, preset, mode.name, graphs=args.cuda_graphs[0], micro_batch=preset.micro_batch, layout=layout
            )
            result = run_probe(line, tp * pp * dp, timeout_s=args.run_timeout)
            run = result.row if result.row is not None else {**row, "status": "failed", "reason": result.error}
            runs[(mode.name, name)] = {**run, "layout": name}
    for row in layout_rows(runs, names, [m.name for m in modes]):
        keep(row)


def search_all(args, preset: Preset, modes: list[Mode], keep) -> None:
    """The largest micro-batch of each mode (end-to-end presets), each try a fresh process; each row
    handed to ``keep`` when done."""
    for mode, graphs in [(m, g) for m in modes for g in args.cuda_graphs]:
        row = new_row("search", preset, mode, args, graphs)
        if row.get("status") == "skipped":
            keep(row)
            continue
        # a try measures fit and speed: no validation
        line = run_args(
            args, preset, mode.name, graphs=graphs, steps=args.search_steps, eval_every=0, global_batch=None
        )
        fits = probe_fits(
            line, args.tp * args.pp * args.dp, args.fit_memory, micro_batches=args.search_micro_batches, dp=args.dp
        )

        def reporting(n, fits=fits, mode=mode, graphs=graphs):
            t = fits(n)
            print(
                f"{preset.name} {mode.name}{'' if graphs == 'none' else ' (graphs: ' + graphs + ')'}: micro-batch {n} {'fits' if t.fits else 'does not fit: ' + t.reason} ({t.seconds:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            return t

        result = largest_micro_batch(
            reporting, start=args.search_start, limit=args.search_max_micro_batch, time_limit_s=args.search_time_limit
        )
        top = result.best()
        row.update(
            status="ok",
            micro_batches_per_step=args.search_micro_batches,
            largest_micro_batch=result.largest,
            smallest_failure=result.smallest_failure,
            stopped=result.stopped,
            tries=[
                {"micro_batch": t.micro_batch, "fits": t.fits, "reason": t.reason, "seconds": round(t.seconds, 1)}
                for t in result.tries
            ],
            tokens_per_s=top.result.get("tokens_per_s") if top else None,
            peak_MiB=top.result.get("peak_MiB") if top else None,
            tokens_per_s_per_gpu=top.result.get("tokens_per_s_per_gpu") if top else None,
            step_ms=top.result.get("step_ms") if top else None,
            # the train row's model FLOPs at the largest micro-batch (coat_compare.flops)
            **{k: top.result.get(k) if top else None for k in ("model_tflops_per_gpu", "mfu_bf16", "mfu_fp8")},
        )
        keep(row)


def new_row(kind: str, preset: Preset, mode: Mode, args, graphs: str = "none") -> dict:
    """A row's identity; already ``status: skipped`` with the reason when the mode cannot run here."""
    row = {
        "kind": kind,
        "preset": preset.name,
        "mode": mode.name,
        "family": mode.family,
        "spec": mode.resolved_spec(),
        "shape": shape(preset),
        "device": parallel.device_name(),
        "software": versions(),
        "seed": args.seed,
        "tp": args.tp,
        "pp": args.pp,
        "vpp": args.vpp,
        "dp": args.dp,
        "graphs": graphs,
        "deterministic": args.deterministic,
    }
    if preset.kind == "train":
        row["data_seed"] = args.seed if args.data_seed is None else args.data_seed
    if args.repeat is not None:
        row["repeat"] = args.repeat
    if mode.family == "coat":  # the recipe itself: what a mode name meant when the row was written
        row["coat_config"] = asdict(mode.coat_config())
    reason = why_not_here(preset, mode)
    if reason is None and graphs != "none" and not torch.cuda.is_available():
        reason = "CUDA graphs need a CUDA GPU"
    return row if reason is None else {**row, "status": "skipped", "reason": reason}


def why_not_here(preset: Preset, mode: Mode) -> str | None:
    """Why ``mode`` cannot run ``preset`` on this machine, or None."""
    reason = unavailable_reason(mode, preset.kind)
    if reason is None and preset.needs_gpu and not torch.cuda.is_available():
        reason = f"preset {preset.name} needs a CUDA GPU; on a CPU run --preset tiny (or tiny-layer)"
    return reason


def shape(preset: Preset) -> str:
    kv = f", {preset.kv_heads} KV heads" if preset.kv_heads else ""
    layers = f"{preset.layers} layers, " if preset.kind == "train" else ""
    batch = (
        f", global batch {preset.global_batch}" if preset.kind == "train" and preset.global_batch is not None else ""
    )
    return f"{layers}hidden {preset.hidden}, FFN {preset.ffn}, {preset.heads} heads{kv}, seq {preset.seq} x micro-batch {preset.micro_batch}{batch}"


def versions() -> str:
    import megatron.core

    from coat_megatron.optional import transformer_engine_available

    te = "not installed"
    if transformer_engine_available():
        import transformer_engine

        te = transformer_engine.__version__
    return f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, TransformerEngine {te}"


def report(out: str, name: str, preset: Preset, rows: list[dict], plots: bool = True) -> None:
    os.makedirs(out, exist_ok=True)
    notes = []
    if plots:
        try:
            _, note = draw(out, name, rows)
        except Exception as e:  # noqa: BLE001 - a plot that fails must not cost the tables
            note = f"Plots failed ({type(e).__name__}: {e}); the tables hold every number."
        notes.append(note)
    header = [
        f"{preset.description}. {versions()}. Command: `coat-compare {' '.join(sys.argv[1:])}`",
        *data_lines(rows),
    ]
    _, md = write_report(out, name, f"coat-compare: {name}", header, rows, evaluate(rows), notes)
    with open(md) as f:
        print(f.read())
    print(f"report: {md} (and {name}.jsonl)", file=sys.stderr)


def data_lines(rows: list[dict]) -> list[str]:
    """What the end-to-end rows trained and were validated on (corpus splits by SHA-256), one
    line per distinct corpus."""
    lines = []
    for r in rows:
        if r.get("kind") != "train" or r.get("status") != "ok" or "corpus" not in r:
            continue
        line = (
            f"Data: the {r['corpus']} corpus ({r['corpus_files']} files), train split {r['corpus_train_bytes']:,} bytes "
            f"(SHA-256 {r['corpus_train_sha256']}), validation split {r['corpus_valid_bytes']:,} bytes (SHA-256 {r['corpus_valid_sha256']}); "
            "each training window used at most once"
        )
        if r.get("eval_every"):
            line += (
                f"; validation loss on {r['eval_windows']} held-out windows of {r['seq'] + 1} bytes (SHA-256 {r['valid_windows_sha256'][:16]}) "
                f"every {r['eval_every']} steps and after the last"
            )
        if line + "." not in lines:
            lines.append(line + ".")
    return lines


def summarize(out: str) -> int:
    """Every report in ``out`` in one markdown file, with the goals judged on all of them. A job
    that did not finish left its rows in ``NAME.partial.jsonl``: they count, unless a finished
    report of the same name holds them, and the summary says it is partial."""
    every = sorted(glob.glob(os.path.join(out, "*.jsonl")))
    finished = [p for p in every if not p.endswith(RowLog.SUFFIX) and os.path.basename(p) != "summary.jsonl"]
    names = {os.path.basename(p)[: -len(".jsonl")] for p in finished}
    partial = [
        p for p in every if p.endswith(RowLog.SUFFIX) and os.path.basename(p)[: -len(RowLog.SUFFIX)] not in names
    ]
    paths = finished + partial
    if not paths:
        refuse(f"no *.jsonl reports in {out}: run coat-compare run --out {out} first")
    rows = [r for p in paths for r in read_jsonl(p) if r.get("kind") != "goal"]
    header = [f"Combined from {', '.join(os.path.basename(p) for p in paths)}."]
    title = "coat-compare summary"
    if partial:
        title += " (partial)"
        header.append(
            f"PARTIAL: {', '.join(os.path.basename(p) for p in partial)} hold the rows of jobs that did not finish; "
            "their missing rows are not in this summary."
        )
    _, md = write_report(out, "summary", title, header, rows, evaluate(rows, every_goal=True), [])
    with open(md) as f:
        print(f.read())
    return 0


def preset_for(preset: Preset, graphs: str, eval_asked: bool = False) -> Preset:
    """``preset`` as one CUDA graph configuration trains it: a graphed run is a speed run, so it
    leaves out the preset's default validation; one asked for with ``--eval-every`` runs (eagerly,
    between the graphed steps: ``train.validation_loss``)."""
    return preset if graphs == "none" or eval_asked else replace(preset, eval_every=0)


SUB_COMMANDS = {
    "run": run_command,
    "search": search_command,
    "resume": resume_command,
    "layouts": layouts_command,
    "summarize": summarize_command,
    "protocol": protocol_command,
}
