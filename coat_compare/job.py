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

Every option is checked before any work: a value the job cannot run is one line on stderr and exit
status 2, and ``--out`` is made and written to first. Each row is appended to
``{out}/{name}.partial.jsonl`` as soon as it is measured, so that a job that dies keeps its rows;
the report replaces that file at the end. The exit status is 1 when a row failed for another
reason than memory or this machine (the report is written first), else 0.

End-to-end presets train on a byte corpus (``--corpus``: the standard library's docstrings, or
Python sources of the installed packages; built once into a cache, see ``coat_compare.corpus``),
each window of text at most once, in the order of ``--data-seed``, and measure the loss on its
held-out validation windows every ``--eval-every`` steps (eagerly, also between CUDA-graphed
steps; graphed runs validate only when ``--eval-every`` is given).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import torch

from . import parallel
from .build import wgrad_fusion
from .corpus import SOURCES
from .goals import evaluate
from .modes import DEFAULT_MODES, MODES, Mode, parse_modes, unavailable_reason
from .plots import draw
from .presets import PRESETS, Preset, get_preset
from .probe import PROBE_MARK, data_args, run_probe
from .progress import Progress
from .report import RowLog, read_jsonl, write_report
from .resume import resume_check
from .search import largest_micro_batch, probe_fits


class _Parser(argparse.ArgumentParser):
    """Errors as one line on stderr and exit status 2, without the usage (a screen of options): each
    message names the fix, and ``--help`` lists the options."""

    def error(self, message):
        refuse(message)


def refuse(message: str):
    """End the job before any work: ``message`` (which names the fix) on one line, exit status 2."""
    print(f"coat-compare: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked whole (``check_args``) before the job starts any work."""
    p = _Parser(prog="coat-compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, or 'all': {', '.join(MODES)} (te-fp8 = te-fp8-current)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help="optimizer steps (end-to-end presets; default: the preset's): more than "
        f"the preset's warm-up steps, which are not timed ({warmup_steps_help()})",
    )
    p.add_argument("--micro-batch", type=int, help="micro-batch per data-parallel rank (default: the preset's)")
    p.add_argument(
        "--global-batch",
        type=int,
        metavar="N",
        help="sequences per optimizer step (end-to-end presets): each data-parallel rank accumulates the gradients of "
        "N / (micro-batch x DP) micro-batches (default: one micro-batch per rank)",
    )
    p.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    p.add_argument(
        "--lr-warmup-steps",
        type=int,
        metavar="N",
        help="linear learning-rate warm-up over N steps (default: 10%% of --steps, at least the preset's minimum: "
        "20 steps; tiny 10, llama2-7b 50, llama2-13b 100)",
    )
    p.add_argument(
        "--lr-decay",
        choices=("constant", "cosine", "linear"),
        help="after the warm-up: hold the peak (constant, the default) or decay it, cosine or linear, to 10%% of the "
        "peak at the last step (Megatron's --lr-decay-style; Llama 2: cosine)",
    )
    p.add_argument(
        "--lr",
        type=float,
        metavar="LR",
        help="peak learning rate for every mode (default: the preset's: gpt-1b 6e-4, llama2-7b and llama2-13b 1.5e-4)",
    )
    p.add_argument(
        "--adam-eps",
        type=float,
        metavar="EPS",
        help="Adam's epsilon for every mode (default: the preset's: 1e-8, Megatron's; llama2-7b and llama2-13b 1e-5, Llama 2's)",
    )
    p.add_argument("--seed", type=int, default=1234, help="initial weights (and the data order, unless --data-seed)")
    p.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help="a label kept in each row: the N-th run of the same seed, data and modes (benchmarks/accuracy.py's "
        "MODE@runN, a noise floor); it changes nothing in the run",
    )
    data = p.add_argument_group("data (end-to-end presets)")
    data.add_argument(
        "--data-seed", type=int, help="order of the training windows (default: --seed): another order, same weights"
    )
    data.add_argument(
        "--corpus",
        choices=list(SOURCES),
        help="docstrings (the standard library's, 1.4 MB) or packages (Python sources "
        "of the standard library and the installed packages); default: the preset's (tiny: docstrings)",
    )
    data.add_argument(
        "--corpus-bytes",
        type=int,
        metavar="N",
        help="the corpus's size: whole files until N bytes (default: all of the docstrings; 100 MiB of package sources)",
    )
    data.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        help="validation loss after every N steps and after the last; 0: none (default: the preset's: tiny 20, "
        "gpt-125m 100, others 0; runs with CUDA graphs 0 unless given: validation then runs eagerly between the graphed steps)",
    )
    data.add_argument(
        "--eval-windows",
        type=int,
        metavar="N",
        help="validation windows of seq + 1 bytes (default: the preset's: 64 tiny, 256 others)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch tp x dp processes with torchrun)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument(
        "--out",
        default=os.environ.get("OUT", "out"),
        help="report directory, made if missing and checked writable first (default $OUT or ./out)",
    )
    p.add_argument("--name", help="report file names {out}/NAME.* (default: the preset; PRESET-search with --search)")
    p.add_argument(
        "--cuda-graphs",
        default="none",
        type=parse_graphs,
        metavar="LIST",
        help="end-to-end presets: run every mode in each of these CUDA graph configurations (comma-separated): "
        "none (eager), local (Megatron's per-layer graphs, cuda_graph_impl=local), full (the whole forward+backward "
        "of a step in one graph, Megatron's full_iteration); default none",
    )
    p.add_argument("--no-plots", action="store_true")
    search = p.add_argument_group("micro-batch search (end-to-end presets)")
    search.add_argument(
        "--search", action="store_true", help="find each mode's largest micro-batch (a fresh process per try)"
    )
    search.add_argument("--search-start", type=int, default=1)
    search.add_argument("--search-max-micro-batch", type=int, help="do not try beyond this micro-batch")
    search.add_argument(
        "--search-time-limit", type=float, help="seconds per mode; stop the search when they have passed"
    )
    search.add_argument(
        "--search-micro-batches",
        type=int,
        default=1,
        help="micro-batches each rank accumulates per optimizer step in every try (default 1): the global "
        "batch of a try at micro-batch n is n x this x DP, a realistic step with gradient accumulation",
    )
    search.add_argument(
        "--search-steps",
        type=int,
        default=6,
        help="steps per try (default 6): more than the preset's warm-up steps, which are not timed "
        f"({warmup_steps_help()})",
    )
    search.add_argument(
        "--fit-memory",
        type=float,
        help="a try fits only if its peak stays under this many GiB (emulates a smaller GPU)",
    )
    ckpt = p.add_argument_group("checkpoints (end-to-end presets)")
    ckpt.add_argument(
        "--save",
        metavar="DIR",
        help="write a dist checkpoint (dp_reshardable) into DIR after --save-step steps, and go on",
    )
    ckpt.add_argument("--save-step", type=int, help="steps before --save writes (default: half of --steps)")
    ckpt.add_argument(
        "--load", metavar="DIR", help="start from the checkpoint in DIR, at its step (any --dp; the same --tp)"
    )
    ckpt.add_argument(
        "--resume-check",
        action="store_true",
        help="save at --dp after --save-step steps, resume at DP 1 and at --dp, compare the losses with the uninterrupted run",
    )
    ckpt.add_argument(
        "--checkpoint-dir",
        help="where --resume-check writes its checkpoint (a temporary directory inside; default: the system's)",
    )
    p.add_argument(
        "--probe", action="store_true", help=argparse.SUPPRESS
    )  # one run of --search / --resume-check, in its own processes
    p.add_argument("--summarize", action="store_true", help="combine every *.jsonl report in --out into summary.md")
    args = p.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def warmup_steps_help() -> str:
    """Each end-to-end preset's warm-up steps, for the help of --steps and --search-steps."""
    return ", ".join(f"{p.name} {p.warmup_steps}" for p in PRESETS.values() if p.kind == "train")


def preset_of(args) -> Preset:
    """The preset the command line asks for, with its overrides."""
    names = (
        "steps",
        "micro_batch",
        "global_batch",
        "seq",
        "lr_warmup_steps",
        "lr_decay",
        "lr",
        "adam_eps",
        "corpus",
        "corpus_bytes",
        "eval_every",
        "eval_windows",
    )
    overrides = {name: getattr(args, name) for name in names}
    return get_preset(args.preset).with_overrides(**overrides)


END_TO_END = "an end-to-end preset (tiny, gpt-1b, llama2-7b)"


def check_args(args) -> None:
    """Raise ValueError, naming the fix, for a command line the job cannot run: every value is
    checked here, before the job trains or starts a process, so that a bad one costs nothing."""
    if args.probe and (args.search or args.resume_check):
        raise ValueError("--probe is one run of --search or --resume-check; give one of them")
    if args.search and args.resume_check:
        raise ValueError("--search and --resume-check are separate jobs; run one, then the other")
    if args.name is not None and (not args.name or os.sep in args.name):
        raise ValueError(
            f"--name {args.name!r} names the report files inside --out: give a file name without "
            f"'{os.sep}' (and the directory as --out)"
        )
    if args.summarize:
        return
    if args.repeat is not None and args.repeat < 1:
        raise ValueError(f"--repeat {args.repeat}: the N-th run counts from 1 (2: the second run of the same seed)")
    if args.resume_check and args.dp < 2:
        raise ValueError("--resume-check saves at --dp and resumes at DP 1 and at --dp: give --dp 2 (or more)")
    if args.cuda_graphs != ["none"] and (args.resume_check or args.save or args.load):
        raise ValueError("checkpoints are written and resumed eagerly: drop --cuda-graphs (or give --cuda-graphs none)")
    parallel.gc_mode()  # COAT_COMPARE_GC: refused here, before any work, where it is neither manual nor auto
    wgrad_fusion()  # COAT_COMPARE_WGRAD_FUSION: likewise, where it is neither on nor off
    if args.probe and len(args.cuda_graphs) != 1:
        raise ValueError("--probe is one run: give one --cuda-graphs value")
    for name in (
        "micro_batch",
        "global_batch",
        "seq",
        "lr_warmup_steps",
        "corpus_bytes",
        "eval_windows",
        "search_start",
        "search_max_micro_batch",
        "search_micro_batches",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be 1 or more")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr {args.lr}: the peak learning rate must be above 0")
    if args.adam_eps is not None and not args.adam_eps > 0:
        raise ValueError(f"--adam-eps {args.adam_eps}: must be above 0 (Megatron's default is 1e-8)")
    for name in ("search_time_limit", "fit_memory"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be more than 0")
    if args.eval_every is not None and args.eval_every < 0:
        raise ValueError(f"--eval-every {args.eval_every}: must be 0 (no validation) or more")
    if args.search_max_micro_batch is not None and args.search_max_micro_batch < args.search_start:
        raise ValueError(
            f"--search-max-micro-batch {args.search_max_micro_batch} is below --search-start "
            f"{args.search_start}: give --search-max-micro-batch {args.search_start} or more"
        )
    parse_modes(args.modes)
    preset = preset_of(args)
    check_layout(preset, args)
    check_steps(preset, args)
    check_processes(args)


def out_of_memory_reason(preset: Preset, mode: Mode, error: str) -> str:
    """An out-of-memory row's reason: which bytes dominate (``memory.why_it_does_not_fit``), then
    the allocator's first line."""
    from .flops import matmul_parameters
    from .memory import why_it_does_not_fit

    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    params = matmul_parameters(preset) + preset.vocab * preset.hidden  # with the input embedding
    fit = why_it_does_not_fit(mode, params, gpu) if gpu else ""
    return f"out of memory at micro-batch {preset.micro_batch}: {fit}. {error}"[:500]


def check_layout(preset: Preset, args) -> None:
    """Raise ValueError, naming the fix, for what --tp / --dp and the checkpoint options cannot do
    with ``preset``."""
    if args.tp < 1 or args.dp < 1:
        raise ValueError(f"--tp {args.tp} --dp {args.dp}: both must be 1 or more")
    if preset.seq % args.tp:
        raise ValueError(
            f"sequence parallel splits the sequence over --tp {args.tp} ranks; --seq {preset.seq} is not "
            f"a multiple: use --seq {max(args.tp, preset.seq - preset.seq % args.tp)}"
        )
    layer = preset.kind == "layer"
    if layer and args.dp > 1:
        raise ValueError(
            f"{preset.name} is one layer's fwd+bwd, which has no data-parallel communication: "
            f"--dp {args.dp} would measure the same layer {args.dp} times; use --tp, or {END_TO_END} "
            "for --dp"
        )
    if layer and args.search:
        raise ValueError(f"--search finds the largest micro-batch of {END_TO_END}; {preset.name} is a per-layer preset")
    if args.global_batch is not None:
        if layer:
            raise ValueError(f"{preset.name} is one layer's fwd+bwd: --global-batch needs {END_TO_END}")
        if args.search:
            raise ValueError(
                "--search sets each try's global batch from its micro-batch: drop --global-batch, and give "
                "--search-micro-batches N for N micro-batches per optimizer step"
            )
        preset.micro_batches(args.dp)  # raises, listing the global batches that divide
    if layer and (args.save or args.load or args.resume_check):
        raise ValueError(f"{preset.name} is a per-layer preset: checkpoints need {END_TO_END}")
    if args.resume_check and (args.save or args.load):
        raise ValueError(
            "--resume-check writes and loads a checkpoint of its own (in --checkpoint-dir): drop --save and --load"
        )


def fewest_steps(preset: Preset, first: int = 0) -> int:
    """The fewest --steps that leave a step to time: training starts at step ``first`` (a
    checkpoint's step with --load, else 0), and its first ``preset.warmup_steps`` steps are left
    out of the timing (``train.train``)."""
    return first + preset.warmup_steps + 1


def check_steps(preset: Preset, args) -> None:
    """Raise ValueError, naming the true minimum, where --steps, --search-steps or --save-step
    leave nothing to time or save."""
    warmup = f"{preset.name} leaves its first {preset.warmup_steps} steps out of the timing (warm-up)"
    if preset.kind == "layer":
        if args.steps is not None:
            raise ValueError(
                f"--steps: {preset.name} times one layer's fwd+bwd, which takes no optimizer steps: "
                f"drop --steps, or use {END_TO_END}"
            )
        return
    if args.search:
        if args.search_steps < fewest_steps(preset):
            raise ValueError(
                f"--search-steps {args.search_steps} leaves no step of a try to time: {warmup}; "
                f"use --search-steps {fewest_steps(preset)} or more"
            )
        return
    steps = preset.steps
    if args.resume_check:
        check_resume_steps(preset, args.save_step)
        return
    first = saved_step(args.load) if args.load else 0
    if steps < fewest_steps(preset, first):
        after = f" after the checkpoint's step {first}" if first else ""
        raise ValueError(
            f"--steps {steps} leaves no step to time{after}: {warmup}; "
            f"use --steps {fewest_steps(preset, first)} or more"
        )
    if args.save:
        save_step = steps // 2 if args.save_step is None else args.save_step
        if not first <= save_step < steps:
            raise ValueError(
                f"--save-step {save_step} is not a step of this run (steps {first} .. {steps - 1}), so "
                f"--save would write nothing: give --save-step {first} to {steps - 1}"
            )


def check_resume_steps(preset: Preset, save_step: int | None) -> None:
    """--resume-check saves after ``save_step`` steps (half of --steps by default) and resumes
    there: the runs from the checkpoint time steps of their own after their warm-up."""
    steps, warmup = preset.steps, f"{preset.warmup_steps} steps out of the timing ({preset.name}'s warm-up)"
    if save_step is None:
        fewest = max(2, 2 * preset.warmup_steps + 1)  # the least n with 0 < n // 2 and n // 2 + warm-up < n
        if steps < fewest:
            raise ValueError(
                f"--steps {steps}: --resume-check saves after half of the steps and resumes there, and "
                f"each run leaves its first {warmup}; use --steps {fewest} or more (or --save-step)"
            )
        return
    if save_step < 1:
        raise ValueError(
            f"--save-step {save_step}: --resume-check resumes from a checkpoint written after step 1 or "
            "later: give --save-step 1 or more"
        )
    if steps < fewest_steps(preset, save_step):
        raise ValueError(
            f"--steps {steps} leaves no step to time after --save-step {save_step}: the resumed runs "
            f"leave their first {warmup}; use --steps {fewest_steps(preset, save_step)} or more "
            "(or a smaller --save-step)"
        )


def saved_step(directory: str) -> int:
    """The optimizer step the checkpoint in ``directory`` was written after (``--save``), read
    from its common state (no process group needed)."""
    if not os.path.isdir(directory):
        raise ValueError(f"--load {directory}: no such directory; give the DIR an earlier --save DIR wrote")
    from megatron.core import dist_checkpointing

    try:
        with warnings.catch_warnings():  # torch's note that it reads without a process group, the intent here
            warnings.simplefilter("ignore", UserWarning)
            common = dist_checkpointing.load_common_state_dict(directory)
    except Exception as e:  # noqa: BLE001 - whatever the reader says, the directory holds no checkpoint it can read
        cause = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"--load {directory}: not a checkpoint this job can read ({type(e).__name__}: {cause}); "
            "give the DIR an earlier --save DIR wrote"
        ) from None
    step = common.get("step") if isinstance(common, dict) else None
    if step is None:
        raise ValueError(f"the checkpoint in {directory} has no step: write it with coat-compare --save")
    return int(step)


def check_processes(args) -> None:
    """The processes this job runs in: ``--search`` and ``--resume-check`` start their own, any
    other job is ``--tp`` x ``--dp`` processes of torchrun (one without it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (args.search or args.resume_check) and not args.probe:
        if world > 1:
            raise ValueError(
                f"run {'--search' if args.search else '--resume-check'} with plain python, not under "
                "torchrun: it starts its own --tp x --dp processes for each run"
            )
    elif args.tp * args.dp != world:
        raise ValueError(
            f"--tp {args.tp} x --dp {args.dp} = {args.tp * args.dp} processes, but this job has {world}: "
            f"launch with torchrun --nproc-per-node {args.tp * args.dp} -m coat_compare ..."
        )


def check_directory(path: str, option: str, create: bool = True) -> None:
    """Make ``path`` (when ``create``) and prove it writable by writing and deleting a file there;
    raise ValueError naming the fix when it is not a directory this job can write into."""
    fix = f"give {option} a directory you can write to"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{option} {path} is a file, not a directory: {fix}")
    try:
        if create:
            os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".coat-compare-write-check-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot write there ({e.strerror or type(e).__name__}): {fix}") from None


def preset_for(preset: Preset, graphs: str, eval_asked: bool = False) -> Preset:
    """``preset`` as one CUDA graph configuration trains it: a graphed run is a speed run, so it
    leaves out the preset's default validation; one asked for with ``--eval-every`` runs (eagerly,
    between the graphed steps: ``train.validation_loss``)."""
    return preset if graphs == "none" or eval_asked else replace(preset, eval_every=0)


def parse_graphs(text: str) -> list[str]:
    """``"none,local"`` -> ["none", "local"], each one of CUDA_GRAPHS (``full_iteration`` = ``full``)."""
    from .build import CUDA_GRAPHS

    names = []
    for raw in text.split(","):
        name = {"full_iteration": "full", "off": "none"}.get(raw.strip(), raw.strip())
        if name not in CUDA_GRAPHS:
            raise argparse.ArgumentTypeError(
                f"unknown CUDA graph configuration {raw.strip()!r}: use {', '.join(CUDA_GRAPHS)} (comma-separated)"
            )
        if name not in names:
            names.append(name)
    return names


def main(argv=None) -> int:
    """The job: 0 when every row ran (or ran out of memory, or cannot run on this machine), 1 when
    a row failed otherwise (after the report is written), 2 for a command line it cannot run."""
    args = parse_args(argv)
    if args.summarize:
        if os.path.isdir(args.out):
            try:
                check_directory(args.out, "--out", create=False)
            except ValueError as e:
                refuse(str(e))
        return summarize(args.out)
    preset, modes = preset_of(args), parse_modes(args.modes)
    try:
        prepare(preset, modes, args)
    except ValueError as e:
        refuse(str(e))
    name = args.name or preset.name + ("-search" if args.search else "-resume" if args.resume_check else "")
    # rank 0 writes (the process group is joined later, so its rank is torchrun's)
    log = RowLog(args.out, name, enabled=not args.probe and int(os.environ.get("RANK", "0")) == 0)
    try:
        if args.search:
            search_all(args, preset, modes, log.add)
        elif args.resume_check:
            resume_all(args, preset, modes, log.add)
        elif isolate_runs(preset, args):
            for mode in modes:
                for graphs in graph_runs(preset, args):
                    log.add(run_isolated(preset, mode, args, graphs))
        else:
            with contextlib.ExitStack() as stack:
                parallel.initialize(args.tp, args.dp, stack)
                for mode in modes:
                    for graphs in graph_runs(preset, args):
                        log.add(run_mode(preset, mode, args, graphs))
            if args.probe:
                if parallel.is_main_rank():
                    print(PROBE_MARK + json.dumps(log.rows[0]), flush=True)
                return 0
        if parallel.is_main_rank():
            report(args.out, name, preset, log.rows, plots=not args.no_plots)
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

        training_windows(preset, args.seed if args.data_seed is None else args.data_seed, args.dp)


def exit_status(rows: list[dict]) -> int:
    """1 when a row failed for another reason than memory ("oom") or this machine ("skipped": no
    TransformerEngine, no GPU), saying which on stderr; else 0."""
    failed = [r for r in rows if r.get("status") == "failed"]
    if not failed:
        return 0
    if parallel.is_main_rank():
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


def isolate_runs(preset: Preset, args) -> bool:
    """Whether each (mode, CUDA graph configuration) of this job trains in a fresh process: on one
    GPU, always. Megatron keeps graph state process-wide (capture flags, the whole-step graph's
    memory pool, static buffers), and a graph's private memory pool outlives the model it served:
    on an H100, a mode run after a whole-step-graph mode in the same process started with the
    earlier mode's pool still held (its peak memory was the earlier mode's), a second whole-step capture failed
    in PyTorch's allocator, and the tiny preset hit an illegal memory access. Eager modes too: an
    out-of-memory mode (BF16 on Llama-2-7B) leaves the allocator fragmented for the next, and what
    one mode leaks (caches, references held by Megatron's globals) counts as the next one's memory.
    A process per configuration costs a start-up and leaves every row clean."""
    return (
        preset.kind == "train"
        and torch.cuda.is_available()
        and not args.probe
        and args.tp * args.dp == 1
        and int(os.environ.get("WORLD_SIZE", "1")) == 1
    )


def run_isolated(preset: Preset, mode: Mode, args, graphs: str) -> dict:
    """``run_mode`` in a fresh process (``probe``): the row it printed, or a failed row with why."""
    row = new_row(preset.kind, preset, mode, args, graphs)
    if row.get("status") == "skipped":
        return row
    print(f"{preset.name} {mode.name} (graphs: {graphs}): a fresh process", file=sys.stderr, flush=True)
    probe_args = [
        "--preset",
        preset.name,
        "--modes",
        mode.name,
        "--steps",
        str(preset.steps),
        "--micro-batch",
        str(preset.micro_batch),
        "--seq",
        str(preset.seq),
        "--seed",
        str(args.seed),
        "--cuda-graphs",
        graphs,
        *data_args(args),
    ]
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
            result = train(
                preset_for(preset, graphs, eval_asked=args.eval_every is not None),
                mode,
                args.seed,
                data_seed=args.data_seed,
                tp=args.tp,
                dp=args.dp,
                progress=progress,
                save=args.save,
                save_step=save_step,
                load=args.load,
                graphs=graphs,
            )
        row.update(status="ok", **result)
    except torch.OutOfMemoryError as e:
        row.update(status="oom", reason=out_of_memory_reason(preset, mode, str(e).splitlines()[0]))
    except Exception as e:  # noqa: BLE001 - one mode failing is a row of the report, not the end of the job
        if "out of memory" in str(e).lower():
            row.update(status="oom", reason=out_of_memory_reason(preset, mode, f"{type(e).__name__}: {e}"))
        else:
            traceback.print_exc(file=sys.stderr)
            row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:300])
    row["seconds"] = round(time.perf_counter() - start, 2)
    parallel.free_memory()
    return row


def resume_all(args, preset: Preset, modes: list[Mode], keep=lambda row: row) -> list[dict]:
    """The checkpoint-resume check (``resume``) of each mode, each row handed to ``keep`` when done."""
    rows = []
    for mode in modes:
        row = new_row("resume", preset, mode, args)
        if row.get("status") == "skipped":
            rows.append(keep(row))
            continue
        print(
            f"{preset.name} {mode.name}: checkpoint at DP {args.dp}, resumed at DP 1 and DP {args.dp}",
            file=sys.stderr,
            flush=True,
        )
        rows.append(keep(resume_check(args, preset, mode, row)))
    return rows


def search_all(args, preset: Preset, modes: list[Mode], keep=lambda row: row) -> list[dict]:
    """The largest micro-batch of each mode (end-to-end presets), each try a fresh process; each row
    handed to ``keep`` when done."""
    rows = []
    for mode, graphs in [(m, g) for m in modes for g in args.cuda_graphs]:
        row = new_row("search", preset, mode, args, graphs)
        if row.get("status") == "skipped":
            rows.append(keep(row))
            continue
        # a try measures fit and speed: no validation
        probe_args = [
            "--preset",
            preset.name,
            "--modes",
            mode.name,
            "--steps",
            str(args.search_steps),
            "--seq",
            str(preset.seq),
            "--seed",
            str(args.seed),
            "--tp",
            str(args.tp),
            "--dp",
            str(args.dp),
            "--cuda-graphs",
            graphs,
            *data_args(args, eval_every=0),
        ]
        fits = probe_fits(
            probe_args, args.tp * args.dp, args.fit_memory, micro_batches=args.search_micro_batches, dp=args.dp
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
        rows.append(keep(row))
    return rows


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
        "dp": args.dp,
        "graphs": graphs,
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
    """Every report in ``out`` in one markdown file, with the goals judged on all of them."""
    every = sorted(glob.glob(os.path.join(out, "*.jsonl")))
    partial = [p for p in every if p.endswith(RowLog.SUFFIX)]
    paths = [p for p in every if os.path.basename(p) != "summary.jsonl" and p not in partial]
    if not paths:
        refuse(f"no *.jsonl reports in {out}: run coat-compare --out {out} first")
    rows = [r for p in paths for r in read_jsonl(p) if r.get("kind") != "goal"]
    header = [f"Combined from {', '.join(os.path.basename(p) for p in paths)}."]
    if partial:  # a job that died: its rows may repeat those of an earlier report of the same name
        names = ", ".join(os.path.basename(p) for p in partial)
        header.append(f"Left out the rows of jobs that did not finish ({names}): rename one to NAME.jsonl to count it.")
    _, md = write_report(out, "summary", "coat-compare summary", header, rows, evaluate(rows, every_goal=True), [])
    with open(md) as f:
        print(f.read())
    return 0
