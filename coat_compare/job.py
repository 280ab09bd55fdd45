"""coat-compare: BF16, TransformerEngine FP8 and COAT on the same model, data and seed.

    coat-compare --preset tiny                                   # CPU: bf16 and coat, TE rows skipped
    coat-compare --preset llama2-7b-layer --modes all            # one layer: time, activation memory
    coat-compare --preset gpt-1b --steps 30 --micro-batch 4      # end to end, equal micro-batch
    coat-compare --preset gpt-1b --cuda-graphs none,local,full   # every mode eager and with CUDA graphs
    coat-compare --preset llama2-7b --modes bf16,coat --search   # largest micro-batch that fits
    coat-compare --summarize --out out                           # every report in out/ -> summary.md
    torchrun --nproc-per-node 2 -m coat_compare --preset gpt-1b --tp 2   # TP 2, sequence parallel
    torchrun --nproc-per-node 2 -m coat_compare --preset gpt-1b --dp 2   # DP 2, distributed optimizer
    coat-compare --preset gpt-1b --modes coat --dp 2 --resume-check   # DP 2 checkpoint -> DP 1 and DP 2
    coat-compare --preset gpt-125m --modes bf16,coat --seed 1 --data-seed 2   # same weights, another data order

Writes ``{out}/{preset}.jsonl`` (one JSON object per row), ``{out}/{preset}.md`` (tables with
ratios, the goals) and PNG plots (with matplotlib), and prints the markdown. ``--search`` writes
``{preset}-search.*``, ``--resume-check`` ``{preset}-resume.*``. A mode that cannot run here (no
TransformerEngine, no GPU, out of memory) is a row with the reason. ``--cuda-graphs`` runs every
mode of an end-to-end preset in each CUDA graph configuration named (one row each), so that every
mode is also reported in its fastest configuration, and the goals compare those. Under ``torchrun``, ``--tp`` x
``--dp`` processes share the model (sequence parallel on when ``--tp`` > 1) and rank 0 writes the
report; ``--search`` and ``--resume-check`` start their own processes (run them with plain python).

End-to-end presets train on a byte corpus (``--corpus``: the standard library's docstrings, or
Python sources of the installed packages; built once into a cache, see ``coat_compare.corpus``),
each window of text at most once, in the order of ``--data-seed``, and measure the loss on its
held-out validation windows every ``--eval-every`` steps (eager runs only).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from .corpus import SOURCES
from . import parallel
from .goals import evaluate
from .modes import DEFAULT_MODES, MODES, Mode, parse_modes, unavailable_reason
from .plots import draw
from .presets import PRESETS, Preset, get_preset
from .probe import PROBE_MARK, data_args, run_probe
from .progress import Progress
from .report import read_jsonl, write_report
from .resume import resume_check
from .search import largest_micro_batch, probe_fits


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="coat-compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, or 'all': {', '.join(MODES)} (te-fp8 = te-fp8-current)")
    p.add_argument("--steps", type=int, help="optimizer steps (end-to-end presets; default: the preset's)")
    p.add_argument("--micro-batch", type=int, help="micro-batch per data-parallel rank (default: the preset's)")
    p.add_argument("--global-batch", type=int, metavar="N",
                   help="sequences per optimizer step (end-to-end presets): each data-parallel rank accumulates the gradients of "
                        "N / (micro-batch x DP) micro-batches (default: one micro-batch per rank)")
    p.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    p.add_argument("--seed", type=int, default=1234, help="initial weights (and the data order, unless --data-seed)")
    data = p.add_argument_group("data (end-to-end presets)")
    data.add_argument("--data-seed", type=int, help="order of the training windows (default: --seed): another order, same weights")
    data.add_argument("--corpus", choices=list(SOURCES), help="docstrings (the standard library's, 1.4 MB) or packages (Python sources "
                      "of the standard library and the installed packages); default: the preset's (tiny: docstrings)")
    data.add_argument("--corpus-bytes", type=int, metavar="N",
                      help="the corpus's size: whole files until N bytes (default: all of the docstrings; 100 MiB of package sources)")
    data.add_argument("--eval-every", type=int, metavar="N",
                      help="validation loss after every N steps and after the last; 0: none (default: the preset's: tiny 20, "
                           "gpt-125m 100, others 0; runs with CUDA graphs 0)")
    data.add_argument("--eval-windows", type=int, metavar="N", help="validation windows of seq + 1 bytes (default: the preset's: 64 tiny, 256 others)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch tp x dp processes with torchrun)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="report directory (default $OUT or ./out)")
    p.add_argument("--name", help="report file names {out}/NAME.* (default: the preset; PRESET-search with --search)")
    p.add_argument("--cuda-graphs", default="none", type=parse_graphs, metavar="LIST",
                   help="end-to-end presets: run every mode in each of these CUDA graph configurations (comma-separated): "
                        "none (eager), local (Megatron's per-layer graphs, cuda_graph_impl=local), full (the whole forward+backward "
                        "of a step in one graph, Megatron's full_iteration); default none")
    p.add_argument("--no-plots", action="store_true")
    search = p.add_argument_group("micro-batch search (end-to-end presets)")
    search.add_argument("--search", action="store_true", help="find each mode's largest micro-batch (a fresh process per try)")
    search.add_argument("--search-start", type=int, default=1)
    search.add_argument("--search-max-micro-batch", type=int, help="do not try beyond this micro-batch")
    search.add_argument("--search-time-limit", type=float, help="seconds per mode; stop the search when they have passed")
    search.add_argument("--search-steps", type=int, default=6, help="steps per try (default 6: 3 warm-up + 3 timed)")
    search.add_argument("--fit-memory", type=float, help="a try fits only if its peak stays under this many GiB (emulates a smaller GPU)")
    ckpt = p.add_argument_group("checkpoints (end-to-end presets)")
    ckpt.add_argument("--save", metavar="DIR", help="write a dist checkpoint (dp_reshardable) into DIR after --save-step steps, and go on")
    ckpt.add_argument("--save-step", type=int, help="steps before --save writes (default: half of --steps)")
    ckpt.add_argument("--load", metavar="DIR", help="start from the checkpoint in DIR, at its step (any --dp; the same --tp)")
    ckpt.add_argument("--resume-check", action="store_true",
                      help="save at --dp after --save-step steps, resume at DP 1 and at --dp, compare the losses with the uninterrupted run")
    ckpt.add_argument("--checkpoint-dir", help="where --resume-check writes its checkpoint (a temporary directory inside; default: the system's)")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # one run of --search / --resume-check, in its own processes
    p.add_argument("--summarize", action="store_true", help="combine every *.jsonl report in --out into summary.md")
    args = p.parse_args(argv)
    if args.probe and (args.search or args.resume_check):
        p.error("--probe is one run of --search or --resume-check; give one of them")
    if args.search and args.resume_check:
        p.error("--search and --resume-check are separate jobs; run one, then the other")
    if args.resume_check and args.dp < 2:
        p.error("--resume-check saves at --dp and resumes at DP 1 and at --dp: give --dp 2 (or more)")
    if args.cuda_graphs != ["none"] and (args.resume_check or args.save or args.load):
        p.error("checkpoints are written and resumed eagerly: drop --cuda-graphs (or give --cuda-graphs none)")
    if args.probe and len(args.cuda_graphs) != 1:
        p.error("--probe is one run: give one --cuda-graphs value")
    if args.eval_every and args.cuda_graphs != ["none"]:
        p.error("validation loss is measured eagerly (Megatron's CUDA graphs capture the training step only): "
                "give --cuda-graphs none, or --eval-every 0")
    for name in ("corpus_bytes", "eval_windows"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be 1 or more")
    if args.eval_every is not None and args.eval_every < 0:
        p.error("--eval-every must be 0 (no validation) or more")
    return args


def preset_for(preset: Preset, graphs: str) -> Preset:
    """``preset`` as one CUDA graph configuration trains it: validation runs eagerly only, so a
    graphed run leaves out the preset's default validation (an asked-for one is refused above)."""
    return preset if graphs == "none" else replace(preset, eval_every=0)


def parse_graphs(text: str) -> list[str]:
    """``"none,local"`` -> ["none", "local"], each one of CUDA_GRAPHS (``full_iteration`` = ``full``)."""
    from .build import CUDA_GRAPHS

    names = []
    for raw in text.split(","):
        name = {"full_iteration": "full", "off": "none"}.get(raw.strip(), raw.strip())
        if name not in CUDA_GRAPHS:
            raise argparse.ArgumentTypeError(f"unknown CUDA graph configuration {raw.strip()!r}: use {', '.join(CUDA_GRAPHS)} (comma-separated)")
        if name not in names:
            names.append(name)
    return names


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        return summarize(args.out)
    preset = get_preset(args.preset).with_overrides(steps=args.steps, micro_batch=args.micro_batch, global_batch=args.global_batch,
                                                    seq=args.seq, corpus=args.corpus,
                                                    corpus_bytes=args.corpus_bytes, eval_every=args.eval_every, eval_windows=args.eval_windows)
    modes = parse_modes(args.modes)
    check_layout(preset, args)
    if args.search or args.resume_check:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit(f"run {'--search' if args.search else '--resume-check'} with plain python, not under torchrun: "
                             "it starts its own --tp x --dp processes for each run")
        rows = search_all(args, preset, modes) if args.search else resume_all(args, preset, modes)
        name = args.name or f"{preset.name}-{'search' if args.search else 'resume'}"
    elif isolate_runs(preset, args):
        rows = [run_isolated(preset, mode, args, graphs) for mode in modes for graphs in graph_runs(preset, args)]
        name = args.name or preset.name
    else:
        with contextlib.ExitStack() as stack:
            parallel.initialize(args.tp, args.dp, stack)
            rows = [run_mode(preset, mode, args, graphs) for mode in modes for graphs in graph_runs(preset, args)]
        if args.probe:
            if parallel.is_main_rank():
                print(PROBE_MARK + json.dumps(rows[0]), flush=True)
            return 0
        name = args.name or preset.name
    if parallel.is_main_rank():
        report(args.out, name, preset, rows, plots=not args.no_plots)
    return 0


def graph_runs(preset: Preset, args) -> list[str]:
    """The CUDA graph configurations each mode runs in: --cuda-graphs for end-to-end presets; a
    per-layer preset times one layer's GPU work eagerly (at these shapes the GPU, not the host,
    bounds it), so it runs once."""
    return args.cuda_graphs if preset.kind == "train" else ["none"]


def isolate_runs(preset: Preset, args) -> bool:
    """Whether each (mode, CUDA graph configuration) of this job trains in a fresh process: on one
    GPU, always. Megatron keeps graph state process-wide (capture flags, the whole-step graph's
    memory pool, static buffers), and a graph's private memory pool outlives the model it served:
    measured on an H100, a mode run after a whole-step-graph mode in the same process started with
    ~16 GiB still held (its peak memory was the earlier mode's), a second whole-step capture failed
    in PyTorch's allocator, and the tiny preset hit an illegal memory access. Eager modes too: an
    out-of-memory mode (BF16 on Llama-2-7B) leaves the allocator fragmented for the next, and what
    one mode leaks (caches, references held by Megatron's globals) counts as the next one's memory.
    A process per configuration costs a start-up (~20 s) and leaves every row clean."""
    return (preset.kind == "train" and torch.cuda.is_available() and not args.probe and args.tp * args.dp == 1
            and int(os.environ.get("WORLD_SIZE", "1")) == 1)


def run_isolated(preset: Preset, mode: Mode, args, graphs: str) -> dict:
    """``run_mode`` in a fresh process (``probe``): the row it printed, or a failed row with why."""
    row = new_row(preset.kind, preset, mode, args, graphs)
    if row.get("status") == "skipped":
        return row
    print(f"{preset.name} {mode.name} (graphs: {graphs}): a fresh process", file=sys.stderr, flush=True)
    probe_args = ["--preset", preset.name, "--modes", mode.name, "--steps", str(preset.steps), "--micro-batch", str(preset.micro_batch),
                  "--seq", str(preset.seq), "--seed", str(args.seed), "--cuda-graphs", graphs, *data_args(args)]
    result = run_probe(probe_args, 1)
    if result.row is None:
        reason = result.error
        if result.log and args.out:  # the whole output of the dead run, beside the report
            log = Path(args.out) / f"{args.name or preset.name}-{mode.name}-{graphs}-failed.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(result.log)
            reason += f" (log: {log.name})"
        return {**row, "status": "failed", "reason": reason, "seconds": round(result.seconds, 2)}
    return result.row


def run_mode(preset: Preset, mode: Mode, args, graphs: str = "none") -> dict:
    """One mode of one preset: a measurement row, or a row saying why there is none."""
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
            progress = Progress(preset.steps, label, enabled=parallel.is_main_rank() and not args.probe)
            save_step = preset.steps // 2 if args.save_step is None else args.save_step
            result = train(preset_for(preset, graphs), mode, args.seed, data_seed=args.data_seed, tp=args.tp, dp=args.dp,
                           progress=progress, save=args.save, save_step=save_step, load=args.load, graphs=graphs)
        row.update(status="ok", **result)
    except torch.OutOfMemoryError as e:
        row.update(status="oom", reason=f"out of memory at micro-batch {preset.micro_batch}: {str(e).splitlines()[0]}"[:300])
    except Exception as e:  # noqa: BLE001 - one mode failing is a row of the report, not the end of the job
        if "out of memory" in str(e).lower():
            row.update(status="oom", reason=f"out of memory at micro-batch {preset.micro_batch}: {type(e).__name__}: {e}"[:300])
        else:
            traceback.print_exc(file=sys.stderr)
            row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:300])
    row["seconds"] = round(time.perf_counter() - start, 2)
    parallel.free_memory()
    return row


def check_layout(preset: Preset, args) -> None:
    """Refuse, naming the fix, what --tp / --dp and the checkpoint options cannot do with ``preset``."""
    if args.tp < 1 or args.dp < 1:
        raise SystemExit(f"--tp {args.tp} --dp {args.dp}: both must be 1 or more")
    if preset.seq % args.tp:
        raise SystemExit(f"sequence parallel splits the sequence over --tp {args.tp} ranks; --seq {preset.seq} is not a multiple: use --seq {preset.seq - preset.seq % args.tp}")
    if preset.kind == "layer" and args.dp > 1:
        raise SystemExit(f"{preset.name} is one layer's fwd+bwd, which has no data-parallel communication: --dp {args.dp} would measure "
                         f"the same layer {args.dp} times; use --tp, or an end-to-end preset (tiny, gpt-1b, llama2-7b) for --dp")
    if args.global_batch is not None:
        if preset.kind == "layer":
            raise SystemExit(f"{preset.name} is one layer's fwd+bwd: --global-batch needs an end-to-end preset (tiny, gpt-1b, llama2-7b)")
        if args.search:
            raise SystemExit("--search measures each micro-batch with one micro-batch per optimizer step: drop --global-batch")
        try:
            preset.micro_batches(args.dp)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if preset.kind == "layer" and (args.save or args.load or args.resume_check):
        raise SystemExit(f"{preset.name} is a per-layer preset: checkpoints need an end-to-end preset (tiny, gpt-1b, llama2-7b)")


def resume_all(args, preset: Preset, modes: list[Mode]) -> list[dict]:
    """The checkpoint-resume check (``resume``) of each mode."""
    rows = []
    for mode in modes:
        row = new_row("resume", preset, mode, args)
        if row.get("status") == "skipped":
            rows.append(row)
            continue
        print(f"{preset.name} {mode.name}: checkpoint at DP {args.dp}, resumed at DP 1 and DP {args.dp}", file=sys.stderr, flush=True)
        rows.append(resume_check(args, preset, mode, row))
    return rows


def search_all(args, preset: Preset, modes: list[Mode]) -> list[dict]:
    """The largest micro-batch of each mode (end-to-end presets), each try a fresh process."""
    if preset.kind != "train":
        raise SystemExit(f"--search finds the largest micro-batch of an end-to-end preset; {preset.name} is a per-layer preset")
    rows = []
    for mode, graphs in [(m, g) for m in modes for g in args.cuda_graphs]:
        row = new_row("search", preset, mode, args, graphs)
        if row.get("status") == "skipped":
            rows.append(row)
            continue
        # a try measures fit and speed: no validation
        probe_args = ["--preset", preset.name, "--modes", mode.name, "--steps", str(args.search_steps), "--seq", str(preset.seq),
                      "--seed", str(args.seed), "--tp", str(args.tp), "--dp", str(args.dp), "--cuda-graphs", graphs,
                      *data_args(args, eval_every=0)]
        fits = probe_fits(probe_args, args.tp * args.dp, args.fit_memory)

        def reporting(n, fits=fits, mode=mode, graphs=graphs):
            t = fits(n)
            print(f"{preset.name} {mode.name}{'' if graphs == 'none' else ' (graphs: ' + graphs + ')'}: micro-batch {n} {'fits' if t.fits else 'does not fit: ' + t.reason} ({t.seconds:.0f} s)", file=sys.stderr, flush=True)
            return t

        result = largest_micro_batch(reporting, start=args.search_start, limit=args.search_max_micro_batch, time_limit_s=args.search_time_limit)
        top = result.best()
        row.update(status="ok", largest_micro_batch=result.largest, smallest_failure=result.smallest_failure, stopped=result.stopped,
                   tries=[{"micro_batch": t.micro_batch, "fits": t.fits, "reason": t.reason, "seconds": round(t.seconds, 1)} for t in result.tries],
                   tokens_per_s=top.result.get("tokens_per_s") if top else None, peak_MiB=top.result.get("peak_MiB") if top else None,
                   tokens_per_s_per_gpu=top.result.get("tokens_per_s_per_gpu") if top else None,
                   step_ms=top.result.get("step_ms") if top else None)
        rows.append(row)
    return rows


def new_row(kind: str, preset: Preset, mode: Mode, args, graphs: str = "none") -> dict:
    """A row's identity; already ``status: skipped`` with the reason when the mode cannot run here."""
    row = {"kind": kind, "preset": preset.name, "mode": mode.name, "family": mode.family, "spec": mode.resolved_spec(),
           "shape": shape(preset), "device": parallel.device_name(), "software": versions(), "seed": args.seed, "tp": args.tp, "dp": args.dp, "graphs": graphs}
    if preset.kind == "train":
        row["data_seed"] = args.seed if args.data_seed is None else args.data_seed
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
    batch = f", global batch {preset.global_batch}" if preset.kind == "train" and preset.global_batch is not None else ""
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
        _, note = draw(out, name, rows)
        notes.append(note)
    header = [f"{preset.description}. {versions()}. Command: `coat-compare {' '.join(sys.argv[1:])}`", *data_lines(rows)]
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
        line = (f"Data: the {r['corpus']} corpus ({r['corpus_files']} files), train split {r['corpus_train_bytes']:,} bytes "
                f"(SHA-256 {r['corpus_train_sha256']}), validation split {r['corpus_valid_bytes']:,} bytes (SHA-256 {r['corpus_valid_sha256']}); "
                "each training window used at most once")
        if r.get("eval_every"):
            line += (f"; validation loss on {r['eval_windows']} held-out windows of {r['seq'] + 1} bytes (SHA-256 {r['valid_windows_sha256'][:16]}) "
                     f"every {r['eval_every']} steps and after the last")
        if line + "." not in lines:
            lines.append(line + ".")
    return lines


def summarize(out: str) -> int:
    """Every report in ``out`` in one markdown file, with the goals judged on all of them."""
    paths = sorted(p for p in glob.glob(os.path.join(out, "*.jsonl")) if os.path.basename(p) != "summary.jsonl")
    if not paths:
        raise SystemExit(f"no *.jsonl reports in {out}: run coat-compare --out {out} first")
    rows = [r for p in paths for r in read_jsonl(p) if r.get("kind") != "goal"]
    header = [f"Combined from {', '.join(os.path.basename(p) for p in paths)}."]
    _, md = write_report(out, "summary", "coat-compare summary", header, rows, evaluate(rows, every_goal=True), [])
    with open(md) as f:
        print(f.read())
    return 0
