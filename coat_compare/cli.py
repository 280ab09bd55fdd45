"""coat-compare: BF16, TransformerEngine FP8 and COAT on the same model, data and seed.

    coat-compare run --preset tiny                                   # CPU: bf16 and coat, TE rows skipped
    coat-compare run --preset llama2-7b-layer --modes all            # one layer: time, activation memory
    coat-compare run --preset gpt-1b --cuda-graphs none,local,full   # every mode eager and with CUDA graphs
    coat-compare run --preset llama2-7b --tp 2 --dp 2 --global-batch 16   # 4 GPUs: TP 2 (sequence parallel) x DP 2
    coat-compare search --preset llama2-7b --modes bf16,coat         # each mode's largest micro-batch
    coat-compare resume --preset gpt-1b --modes coat --dp 2          # a DP 2 checkpoint resumed at DP 1 and DP 2
    coat-compare layouts 1,tp2,pp2,dp2 --preset gpt-1b --global-batch 8 --steps 30   # each layout against one GPU
    coat-compare summarize --out out                                 # every report in out/ -> summary.md
    coat-compare protocol show gpt-125m-wsd                          # the accuracy protocols (its own --help)

Without a sub-command the command line is ``run``'s: ``coat-compare --preset tiny`` is
``coat-compare run --preset tiny``. ``coat-compare SUB-COMMAND --help`` lists a sub-command's
options.

A job writes ``{out}/{name}.jsonl`` (one JSON object per row), ``{out}/{name}.md`` (tables with
ratios, the goals) and PNG plots (with matplotlib), and prints the markdown; the name is the
preset's (``PRESET-search``, ``PRESET-resume``, ``PRESET-layouts``) unless ``--name``. A mode that
cannot run here (no TransformerEngine, no GPU, out of memory) is a row with the reason.

Run it with plain python (not under torchrun): each run (a mode in one CUDA graph configuration,
a try of the search, a run of the resume or layout check) trains in processes of its own,
``--tp`` x ``--pp`` x ``--dp`` of them under torchrun, which the job starts (one GPU each;
sequence parallel on when ``--tp`` > 1), so that no mode inherits another's memory, CUDA graphs
or process-wide state; a run whose rank dies or stalls (``--step-timeout``) is a failed row and
the job goes on. On a CPU a run of one process trains inside the job.

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
import math
import os
import sys
from dataclasses import dataclass, field, replace
from functools import cached_property

from .corpus import SOURCES
from .layouts import parse_layouts
from .modes import DEFAULT_MODES, MODES, Mode, parse_modes
from .presets import PRESETS, Preset, get_preset

SUB_COMMANDS = {
    "run": "each mode of a preset measured (the default sub-command)",
    "search": "each mode's largest micro-batch (end-to-end presets; a fresh process per try)",
    "resume": "a checkpoint saved at the job's layout resumed at others, against the uninterrupted run",
    "layouts": "each mode trained in each layout, step by step against the first (the rule: coat_compare.layouts)",
    "summarize": "every *.jsonl report in --out combined into summary.md",
    "protocol": "the accuracy protocols: show, flags, run, keep, power, judge (python -m coat_compare.protocol)",
}
FLAT_JOBS = {"--search": "search", "--resume-check": "resume", "--layouts": "layouts", "--summarize": "summarize"}


@dataclass(frozen=True)
class Options:
    """A coat-compare command line, checked (``parse_args`` builds it, and nothing else does): the
    sub-command and every option, each under its flag's name (``--micro-batch`` -> ``micro_batch``),
    None where an override was not given; an option a sub-command does not take keeps its default
    here. ``preset`` and ``modes`` are what the options make of the preset and the modes."""

    command: str = "run"
    preset_name: str = "tiny"
    mode_names: str = ",".join(DEFAULT_MODES)
    # the preset's overrides (None: the preset's own)
    steps: int | None = None
    micro_batch: int | None = None
    global_batch: int | None = None
    seq: int | None = None
    lr_warmup_steps: int | None = None
    lr_decay: str | None = None
    lr_cooldown_steps: int | None = None
    lr_min_ratio: float | None = None
    lr: float | None = None
    adam_eps: float | None = None
    corpus: str | None = None
    corpus_bytes: int | None = None
    eval_every: int | None = None
    eval_windows: int | None = None
    seed: int = 1234
    data_seed: int | None = None
    repeat: int | None = None
    # layout
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # training and the report
    gc: str = "manual"
    wgrad_fusion: str = "on"
    wgrad_accumulate: str | None = None
    deterministic: bool = False
    run_timeout: float | None = None
    step_timeout: float = 600.0
    cuda_graphs: list[str] = field(default_factory=lambda: ["none"])
    out: str = field(default_factory=lambda: os.environ.get("OUT", "out"))
    name: str | None = None
    no_plots: bool = False
    # run: checkpoints, and one run of a job in its own processes
    save: str | None = None
    save_step: int | None = None
    save_steps: tuple[int, ...] | None = None
    stop_after_save: bool = False
    load: str | None = None
    checkpoint_format: str = "dp_reshardable"
    probe: bool = False
    # search
    search_start: int = 1
    search_max_micro_batch: int | None = None
    search_time_limit: float | None = None
    search_micro_batches: int = 1
    search_steps: int = 6
    fit_memory: float | None = None
    # resume
    resume_at: str | None = None
    checkpoint_dir: str | None = None
    # layouts: the layouts to train in (as written: 1,tp2,dp2)
    layouts: str | None = None
    # protocol: its own command line (coat_compare.protocol)
    protocol_argv: tuple[str, ...] = ()

    @cached_property
    def preset(self) -> Preset:
        """The preset with the command line's overrides."""
        names = ("steps", "micro_batch", "global_batch", "seq", "lr_warmup_steps", "lr_decay", "lr_cooldown_steps",
                 "lr_min_ratio", "lr", "adam_eps", "corpus", "corpus_bytes", "eval_every", "eval_windows")  # fmt: skip
        return get_preset(self.preset_name).with_overrides(**{name: getattr(self, name) for name in names})

    @cached_property
    def modes(self) -> list[Mode]:
        """The modes, with the recipe options: --wgrad-fusion, and --wgrad-accumulate for their COAT parts."""
        modes = []
        for mode in parse_modes(self.mode_names):
            coat = mode.coat
            if coat is not None and self.wgrad_accumulate is not None:
                coat = replace(coat, wgrad_accumulate=self.wgrad_accumulate)
            modes.append(replace(mode, wgrad_fusion=self.wgrad_fusion == "on", coat=coat))
        return modes

    @cached_property
    def trained_layouts(self) -> list[tuple[int, int, int, int]]:
        """The layouts (TP, PP, VPP, DP) the job trains in: ``layouts``' for that sub-command, else its own."""
        return parse_layouts(self.layouts) if self.layouts else [(self.tp, self.pp, self.vpp, self.dp)]

    @property
    def search(self) -> bool:
        return self.command == "search"

    @property
    def resume_check(self) -> bool:
        return self.command == "resume"


class _Parser(argparse.ArgumentParser):
    """Errors as one line on stderr and exit status 2, without the usage (a screen of options): each
    message names the fix, and ``--help`` lists the options."""

    def error(self, message):
        refuse(message)


def refuse(message: str):
    """End the job before any work: ``message`` (which names the fix) on one line, exit status 2."""
    print(f"coat-compare: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_args(argv=None) -> Options:
    """The command line as ``Options``, checked whole (``check_args``) before the job starts any
    work. No sub-command is ``run``; ``protocol`` hands the rest of the line to its own parser."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["protocol"]:
        return Options(command="protocol", protocol_argv=tuple(argv[1:]))
    if not argv or (argv[0] not in SUB_COMMANDS and argv[0] not in ("-h", "--help")):
        for flag, command in FLAT_JOBS.items():
            if any(a == flag or a.startswith(flag + "=") for a in argv):
                refuse(f"{flag} is the sub-command {command} now: coat-compare {command} [options] (see --help)")
        argv = ["run", *argv]
    options = Options(**vars(parser().parse_args(argv)))
    try:
        check_args(options)
    except ValueError as e:
        refuse(str(e))
    return options


def parser() -> argparse.ArgumentParser:
    """The parser of every sub-command. No option has a default here (``argparse.SUPPRESS``): what
    is not given takes ``Options``' default, the one place each default is written."""
    shared = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    for add in (_run_options, _data_options, _layout_options, _training_options, _report_options):
        add(shared)
    out_only = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    _report_options(out_only)
    p = _Parser(prog="coat-compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="SUB-COMMAND")
    extra = {"run": _checkpoint_options, "search": _search_options, "resume": _resume_options,
             "layouts": _layouts_options, "summarize": None, "protocol": None}  # fmt: skip
    for name, what in SUB_COMMANDS.items():
        parents = [out_only] if name == "summarize" else [] if name == "protocol" else [shared]
        c = sub.add_parser(name, help=what, description=f"coat-compare {name}: {what}.", parents=parents,
                           argument_default=argparse.SUPPRESS)  # fmt: skip
        if extra[name]:
            extra[name](c)
    return p


def _run_options(p: argparse.ArgumentParser) -> None:
    """The preset, the modes and what every run takes: steps, batch, sequence, schedule, seed."""
    p.add_argument("--preset", dest="preset_name", choices=list(PRESETS), help="the model (default tiny)")
    p.add_argument(
        "--modes",
        dest="mode_names",
        help=f"comma-separated, or 'all': {', '.join(MODES)} (te-fp8 = te-fp8-current); "
        f"default: {','.join(DEFAULT_MODES)}",
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
        choices=("constant", "cosine", "linear", "wsd"),
        help="after the warm-up: hold the peak (constant, the default) or decay it, cosine or linear, to "
        "--lr-min-ratio x the peak at the last step (Megatron's --lr-decay-style; Llama 2: cosine), or wsd: hold the "
        "peak, then decay linearly over the last --lr-cooldown-steps steps",
    )
    p.add_argument(
        "--lr-cooldown-steps",
        type=int,
        metavar="N",
        help="--lr-decay wsd: the linear cool-down's length in steps (a run loaded from a longer run's checkpoint "
        "with a shorter --steps is a cool-down branch of its trunk)",
    )
    p.add_argument(
        "--lr-min-ratio",
        type=float,
        metavar="R",
        help="the decayed learning rate at the last step, a fraction of the peak (default: the preset's: 0.1; "
        "gpt-1b-accuracy 0)",
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
    p.add_argument("--seed", type=int, help="initial weights (default 1234) (and the data order, unless --data-seed)")
    p.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help="a label kept in each row: the N-th run of the same seed, data and modes (an accuracy protocol's "
        "MODE@runN, a noise floor); it changes nothing in the run",
    )


def _data_options(p: argparse.ArgumentParser) -> None:
    """What an end-to-end run trains and validates on."""
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


def _layout_options(p: argparse.ArgumentParser) -> None:
    """How a run is split over GPUs, and the layout check."""
    layout = p.add_argument_group("layout (one GPU per process; the job starts tp x pp x dp processes per run)")
    layout.add_argument("--tp", type=int, help="tensor-parallel size, sequence parallel on above 1")
    layout.add_argument("--pp", type=int, help="pipeline-parallel size (end-to-end presets): 1F1B schedule")
    layout.add_argument(
        "--vpp",
        type=int,
        help="virtual pipeline stages per rank (interleaved 1F1B; needs --pp 2 or more, and per-rank micro-batches "
        "a multiple of --pp)",
    )
    layout.add_argument("--dp", type=int, help="data-parallel size (the distributed optimizer)")
    layout.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Megatron's DDP option: reduce-scatter gradients in buckets during backward",
    )
    layout.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="Megatron's DDP option: all-gather the updated parameters during the next forward",
    )


def _training_options(p: argparse.ArgumentParser) -> None:
    """How runs train (collection, wgrad, timeouts, determinism) and where the report goes."""
    p.add_argument(
        "--gc",
        choices=("manual", "auto"),
        help="garbage collection while training: manual (Megatron's --manual-gc: one collection every 50 steps, "
        "none in between; the default) or auto (Python's: a pause can land in any step)",
    )
    p.add_argument(
        "--wgrad-fusion",
        choices=("on", "off"),
        help="each linear adds its weight gradient into DDP's buffer inside its GEMM (TE's and COAT's own, no apex "
        "needed; the default), or off: Megatron adds a BF16 wgrad per micro-batch, in every mode",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        metavar="SECONDS",
        help="a run (a mode in one CUDA graph configuration, in processes of its own) still going after this many "
        "seconds is stopped: its processes print their Python stacks into the failed row's log first (default: none; "
        "--step-timeout catches a stalled step)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="Megatron's deterministic mode in every run: TE's deterministic attention, cuBLAS's fixed workspaces, "
        "NCCL's ring algorithm and torch's deterministic algorithms (megatron.training.determinism), so that a run "
        "repeats bit for bit and two layouts differ only where their arithmetic does; slower",
    )
    p.add_argument(
        "--wgrad-accumulate",
        choices=("auto", "cublaslt", "add"),
        help="COAT modes: how a wgrad is added into a gradient buffer that holds a sum (CoatConfig.wgrad_accumulate: "
        "auto, the default, has the GEMM add where cuBLASLt can; add: an FP32 temporary and an add)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        metavar="SECONDS",
        help="a training step or validation that takes longer ends its run (every rank's Python stack in the run's "
        "log, a failed row) instead of hanging the job (default 600: the first steps compile kernels and capture "
        "CUDA graphs)",
    )
    p.add_argument(
        "--cuda-graphs",
        type=parse_graphs,
        metavar="LIST",
        help="end-to-end presets: run every mode in each of these CUDA graph configurations (comma-separated): "
        "none (eager), local (Megatron's per-layer graphs, cuda_graph_impl=local; under --pp its TE-based ones, as "
        "coat-megatron-run --coat-fp8 picks there: eager, saying why, without TransformerEngine), full (the whole "
        "forward+backward of a step in one graph, Megatron's full_iteration); default none",
    )


def _report_options(p: argparse.ArgumentParser) -> None:
    """Where the report goes."""
    p.add_argument(
        "--out",
        help="report directory, made if missing and checked writable first (default $OUT or ./out)",
    )
    p.add_argument(
        "--name", help="report file names {out}/NAME.* (default: the preset; PRESET-search for search, and so on)"
    )
    p.add_argument("--no-plots", action="store_true")


def _search_options(p: argparse.ArgumentParser) -> None:
    """The micro-batch search."""
    search = p.add_argument_group("micro-batch search (end-to-end presets)")
    search.add_argument("--search-start", type=int, help="the first micro-batch tried (default 1)")
    search.add_argument("--search-max-micro-batch", type=int, help="do not try beyond this micro-batch")
    search.add_argument(
        "--search-time-limit", type=float, help="seconds per mode; stop the search when they have passed"
    )
    search.add_argument(
        "--search-micro-batches",
        type=int,
        help="micro-batches each rank accumulates per optimizer step in every try (default 1): the global "
        "batch of a try at micro-batch n is n x this x DP, a realistic step with gradient accumulation",
    )
    search.add_argument(
        "--search-steps",
        type=int,
        help="steps per try (default 6): more than the preset's warm-up steps, which are not timed "
        f"({warmup_steps_help()})",
    )
    search.add_argument(
        "--fit-memory",
        type=float,
        help="a try fits only if its peak stays under this many GiB (emulates a smaller GPU)",
    )


def _checkpoint_options(p: argparse.ArgumentParser) -> None:
    """run: checkpoints."""
    ckpt = p.add_argument_group("checkpoints (end-to-end presets)")
    ckpt.add_argument(
        "--save",
        metavar="DIR",
        help="write a dist checkpoint (--checkpoint-format) into DIR after --save-step steps, and go on",
    )
    ckpt.add_argument("--save-step", type=int, help="steps before --save writes (default: half of --steps)")
    ckpt.add_argument(
        "--save-steps",
        type=parse_steps,
        metavar="LIST",
        help="with --save DIR: write a checkpoint into DIR/stepN after each of these steps (comma-separated) instead "
        "of one into DIR, and go on: the weights of one run at several points, to measure from "
        "(python -m coat_compare.fidelity --load DIR/stepN)",
    )
    ckpt.add_argument(
        "--stop-after-save",
        action="store_true",
        help="with --save: end the run once the checkpoint is written, and leave the rest of --steps to a later "
        "--load (the learning-rate schedule and the batches stay those of --steps): one run over two commands",
    )
    ckpt.add_argument(
        "--load",
        metavar="DIR",
        help="start from the checkpoint in DIR, at its step (dp_reshardable: any --dp, the saving --tp and --pp; "
        "fully_reshardable: any layout)",
    )
    ckpt.add_argument(
        "--checkpoint-format",
        choices=("dp_reshardable", "fully_reshardable"),
        help="--save/--load: dp_reshardable (Megatron's default; COAT's compressed FP8 states, loads at any DP size) "
        "or fully_reshardable (FP32 Adam states in Megatron's layout; loads at any TP, PP and DP)",
    )
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # one run of a job, in its own processes


def _resume_options(p: argparse.ArgumentParser) -> None:
    """resume: save at the job's layout after --save-step steps, resume at DP 1 (or at --resume-at)
    and at the saving layout, compare the losses with the uninterrupted run."""
    p.add_argument("--save-step", type=int, help="steps before the checkpoint is written (default: half of --steps)")
    p.add_argument(
        "--resume-at",
        metavar="LIST",
        help="the layouts to resume at (as layouts takes them: e.g. dp4,1 after --tp 2 --dp 2; default: DP 1); a TP "
        "or PP change saves fully_reshardable",
    )
    p.add_argument(
        "--checkpoint-dir",
        help="where the checkpoint is written (a temporary directory inside; default: the system's)",
    )


def _layouts_options(p: argparse.ArgumentParser) -> None:
    """layouts: the layouts to compare."""
    p.add_argument(
        "layouts",
        metavar="LAYOUTS",
        help="comma-separated, each 1 or x-joined tpN, ppN, vppN, dpN (e.g. 1,tp2,pp2,dp2,tp2xdp2,tp2xpp2): each "
        "mode trains in each (and in each --cuda-graphs configuration: pp2/local) at one global batch and seed, "
        "and every run's losses are compared step by step with the first's",
    )


def warmup_steps_help() -> str:
    """Each end-to-end preset's warm-up steps, for the help of --steps and --search-steps."""
    return ", ".join(f"{p.name} {p.warmup_steps}" for p in PRESETS.values() if p.kind == "train")


END_TO_END = "an end-to-end preset (tiny, gpt-1b, llama2-7b)"


def check_args(o: Options) -> None:
    """Raise ValueError, naming the fix, for a command line the job cannot run: every value is
    checked here, before the job trains or starts a process, so that a bad one costs nothing."""
    if o.name is not None and (not o.name or os.sep in o.name):
        raise ValueError(
            f"--name {o.name!r} names the report files inside --out: give a file name without "
            f"'{os.sep}' (and the directory as --out)"
        )
    if o.command in ("summarize", "protocol"):
        return
    if o.repeat is not None and o.repeat < 1:
        raise ValueError(f"--repeat {o.repeat}: the N-th run counts from 1 (2: the second run of the same seed)")
    if o.resume_check and o.dp < 2 and not o.resume_at:
        raise ValueError(
            "resume saves at the job's layout and resumes at DP 1 and there: give --dp 2 (or more), "
            "or --resume-at the layouts to resume at"
        )
    if (o.save or o.load) and len(parse_modes(o.mode_names)) > 1:
        raise ValueError("--save and --load hold one run's checkpoint: give one mode (--modes MODE), a job per mode")
    if o.stop_after_save and not o.save:
        raise ValueError("--stop-after-save ends a run at its --save: give --save DIR")
    if o.cuda_graphs != ["none"] and (o.resume_check or o.save or o.load):
        raise ValueError("checkpoints are written and resumed eagerly: drop --cuda-graphs (or give --cuda-graphs none)")
    if o.probe and len(o.cuda_graphs) != 1:
        raise ValueError("--probe is one run: give one --cuda-graphs value")
    for name in ("micro_batch", "global_batch", "seq", "lr_warmup_steps", "lr_cooldown_steps", "corpus_bytes",
                 "eval_windows", "search_start", "search_max_micro_batch", "search_micro_batches"):  # fmt: skip
        value = getattr(o, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be 1 or more")
    if o.lr is not None and not o.lr > 0:
        raise ValueError(f"--lr {o.lr}: the peak learning rate must be above 0")
    if o.lr_min_ratio is not None and not 0 <= o.lr_min_ratio <= 1:
        raise ValueError(f"--lr-min-ratio {o.lr_min_ratio}: a fraction of the peak, 0 to 1")
    if o.adam_eps is not None and not o.adam_eps > 0:
        raise ValueError(f"--adam-eps {o.adam_eps}: must be above 0 (Megatron's default is 1e-8)")
    for name in ("search_time_limit", "fit_memory", "step_timeout", "run_timeout"):
        value = getattr(o, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be more than 0")
    if o.eval_every is not None and o.eval_every < 0:
        raise ValueError(f"--eval-every {o.eval_every}: must be 0 (no validation) or more")
    if o.search_max_micro_batch is not None and o.search_max_micro_batch < o.search_start:
        raise ValueError(
            f"--search-max-micro-batch {o.search_max_micro_batch} is below --search-start "
            f"{o.search_start}: give --search-max-micro-batch {o.search_start} or more"
        )
    o.modes  # noqa: B018 - parsed here, so that an unknown mode is refused before any work
    check_schedule(o.preset)
    check_layout(o.preset, o)
    check_steps(o.preset, o)
    check_processes(o)


def check_schedule(preset: Preset) -> None:
    """Raise ValueError, naming the fix, where the learning-rate schedule cannot run: a wsd decay
    without a cool-down that fits after the warm-up, or a cool-down without wsd."""
    from .train import lr_warmup_steps

    if preset.kind != "train":
        return
    if preset.lr_decay != "wsd":
        if preset.lr_cooldown_steps is not None:
            raise ValueError("--lr-cooldown-steps is the length of wsd's cool-down: add --lr-decay wsd")
        return
    room = preset.steps - lr_warmup_steps(preset)
    if preset.lr_cooldown_steps is None or not 0 < preset.lr_cooldown_steps <= room:
        raise ValueError(
            f"--lr-decay wsd decays over the last --lr-cooldown-steps N steps: give N from 1 to {room} (the "
            f"{preset.steps} steps after the warm-up)"
        )


def check_layout(preset: Preset, args) -> None:
    """Raise ValueError, naming the fix, for what --tp / --pp / --vpp / --dp, the layouts of
    the layouts of ``layouts`` and the checkpoint options cannot do with ``preset``."""
    for name in ("tp", "pp", "vpp", "dp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)}: must be 1 or more")
    layer = preset.kind == "layer"
    if layer and (args.pp > 1 or args.vpp > 1):
        raise ValueError(f"{preset.name} is one layer: pipeline stages (--pp, --vpp) need {END_TO_END}")
    layouts = args.trained_layouts
    for tp, pp, vpp, dp in layouts:
        check_one_layout(preset, tp, pp, vpp, dp)
        if not layer and args.global_batch is not None:
            preset.micro_batches(dp)  # raises, listing the global batches that divide
        if vpp > 1:
            per_rank = preset.micro_batches(dp)
            if per_rank < pp or per_rank % pp:
                raise ValueError(
                    f"the interleaved schedule (--vpp {vpp}) runs the micro-batches of a step in groups of --pp {pp}: "
                    f"{per_rank} per rank is not a multiple of {pp}; give --global-batch {preset.micro_batch * dp * pp} "
                    f"(or another multiple of micro-batch x DP x PP = {preset.micro_batch * dp * pp})"
                )
    if args.resume_at:
        global_batch = preset.global_batch_for(args.dp)
        for tp, pp, vpp, dp in parse_layouts(args.resume_at):
            check_one_layout(preset, tp, pp, vpp, dp)
            if global_batch % dp:
                raise ValueError(
                    f"--resume-at: the global batch {global_batch} does not split over DP {dp}: give --global-batch "
                    f"a multiple of {math.lcm(dp, args.dp * preset.micro_batch)}"
                )
    if args.layouts:
        if layer:
            raise ValueError(f"layouts trains each layout end to end: use {END_TO_END}")
        if len(layouts) * len(args.cuda_graphs) < 2:
            raise ValueError(
                "layouts compares layouts with the first: give two or more, e.g. 1,tp2,dp2 (or one, with two "
                "--cuda-graphs configurations: pp2 --cuda-graphs none,local)"
            )
    if layer and args.dp > 1:
        raise ValueError(
            f"{preset.name} is one layer's fwd+bwd, which has no data-parallel communication: "
            f"--dp {args.dp} would measure the same layer {args.dp} times; use --tp, or {END_TO_END} "
            "for --dp"
        )
    if args.pp > 1 and "full" in args.cuda_graphs:
        raise ValueError(
            "Megatron's whole-step CUDA graph (--cuda-graphs full) runs one pipeline stage: with --pp use "
            "--cuda-graphs none,local"
        )
    if layer and args.search:
        raise ValueError(f"search finds the largest micro-batch of {END_TO_END}; {preset.name} is a per-layer preset")
    if args.global_batch is not None:
        if layer:
            raise ValueError(f"{preset.name} is one layer's fwd+bwd: --global-batch needs {END_TO_END}")
        if args.search:
            raise ValueError(
                "search sets each try's global batch from its micro-batch: drop --global-batch, and give "
                "--search-micro-batches N for N micro-batches per optimizer step"
            )
    if layer and (args.save or args.load or args.resume_check):
        raise ValueError(f"{preset.name} is a per-layer preset: checkpoints need {END_TO_END}")
    if (args.overlap_grad_reduce or args.overlap_param_gather) and layer:
        raise ValueError(f"--overlap-grad-reduce and --overlap-param-gather are DDP options: use {END_TO_END}")


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_one_layout(preset: Preset, tp: int, pp: int, vpp: int, dp: int) -> None:
    """Raise ValueError, naming the valid values, where the model cannot be split ``tp`` x ``pp``
    (x ``vpp``) ways, or the sequence for sequence parallelism."""
    if preset.heads % tp or (preset.kv_heads or preset.heads) % tp:
        groups = preset.kv_heads or preset.heads
        raise ValueError(
            f"--tp {tp}: {preset.name}'s {preset.heads} attention heads ({groups} query groups) do not split over "
            f"{tp} tensor-parallel ranks; use --tp {divisors(math.gcd(preset.heads, groups))}"
        )
    if preset.ffn % tp or preset.hidden % tp:
        raise ValueError(
            f"--tp {tp}: hidden {preset.hidden} and FFN {preset.ffn} must both split over it; use --tp "
            f"{divisors(math.gcd(preset.hidden, preset.ffn))}"
        )
    if preset.seq % tp:
        raise ValueError(
            f"sequence parallel splits the sequence over --tp {tp} ranks; --seq {preset.seq} is not "
            f"a multiple: use --seq {max(tp, preset.seq - preset.seq % tp)}"
        )
    if vpp > 1 and pp < 2:
        raise ValueError(
            f"--vpp {vpp}: virtual pipeline stages interleave 2 or more pipeline stages: give --pp 2 or more"
        )
    if preset.layers % (pp * vpp):
        what = f"--pp {pp}" + (f" x --vpp {vpp}" if vpp > 1 else "")
        raise ValueError(
            f"{what}: {preset.name}'s {preset.layers} layers do not split into {pp * vpp} equal stages; use "
            f"--pp x --vpp in {divisors(preset.layers)}"
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
    first = 0
    if args.load:
        saved = read_checkpoint(args.load)
        check_load_layout(args, saved.get("layout"))
        first = int(saved["step"])
    if steps < fewest_steps(preset, first):
        after = f" after the checkpoint's step {first}" if first else ""
        raise ValueError(
            f"--steps {steps} leaves no step to time{after}: {warmup}; "
            f"use --steps {fewest_steps(preset, first)} or more"
        )
    if args.save_steps is not None:
        if not args.save or args.save_step is not None or args.stop_after_save:
            raise ValueError("--save-steps names the steps of --save DIR's checkpoints: give --save DIR, without "
                             "--save-step or --stop-after-save")  # fmt: skip
        outside = [s for s in args.save_steps if not first <= s < steps]
        if outside:
            raise ValueError(
                f"--save-steps {','.join(map(str, outside))}: not a step of this run (steps {first} .. {steps - 1}), so "
                f"nothing would be written there: give steps from {first} to {steps - 1}"
            )
    elif args.save:
        save_step = steps // 2 if args.save_step is None else args.save_step
        if not first <= save_step < steps:
            raise ValueError(
                f"--save-step {save_step} is not a step of this run (steps {first} .. {steps - 1}), so "
                f"--save would write nothing: give --save-step {first} to {steps - 1}"
            )
        if args.stop_after_save and save_step < fewest_steps(preset, first):
            raise ValueError(
                f"--stop-after-save ends the run after step {save_step}, which leaves no step to time: {warmup}; "
                f"give --save-step {fewest_steps(preset, first)} to {steps - 1}"
            )


def check_resume_steps(preset: Preset, save_step: int | None) -> None:
    """resume saves after ``save_step`` steps (half of --steps by default) and resumes
    there: the runs from the checkpoint time steps of their own after their warm-up."""
    steps, warmup = preset.steps, f"{preset.warmup_steps} steps out of the timing ({preset.name}'s warm-up)"
    if save_step is None:
        fewest = max(2, 2 * preset.warmup_steps + 1)  # the least n with 0 < n // 2 and n // 2 + warm-up < n
        if steps < fewest:
            raise ValueError(
                f"--steps {steps}: resume saves after half of the steps and resumes there, and "
                f"each run leaves its first {warmup}; use --steps {fewest} or more (or --save-step)"
            )
        return
    if save_step < 1:
        raise ValueError(
            f"--save-step {save_step}: resume resumes from a checkpoint written after step 1 or "
            "later: give --save-step 1 or more"
        )
    if steps < fewest_steps(preset, save_step):
        raise ValueError(
            f"--steps {steps} leaves no step to time after --save-step {save_step}: the resumed runs "
            f"leave their first {warmup}; use --steps {fewest_steps(preset, save_step)} or more "
            "(or a smaller --save-step)"
        )


def read_checkpoint(directory: str) -> dict:
    """The common state of the checkpoint in ``directory`` (``--save`` wrote its step, layout and
    format there), once its data files are checked whole (``checkpoint.check_checkpoint``; no
    process group needed); raises ValueError naming the fix."""
    if not os.path.isdir(directory):
        raise ValueError(f"--load {directory}: no such directory; give the DIR an earlier --save DIR wrote")
    from .checkpoint import check_checkpoint

    try:
        common = check_checkpoint(directory)
    except (KeyboardInterrupt, SystemExit):
        raise
    # whatever the reader says (torch's CheckpointException is a BaseException), the directory
    # holds no checkpoint this job can read
    except BaseException as e:  # noqa: BLE001
        cause = (str(e).strip().splitlines() or [""])[0][:200]
        what = cause if isinstance(e, ValueError) else f"{type(e).__name__}: {cause}"
        raise ValueError(
            f"--load {directory}: not a checkpoint this job can read ({what}); give the DIR an earlier --save DIR wrote"
        ) from None
    if common.get("step") is None:
        raise ValueError(f"the checkpoint in {directory} has no step: write it with coat-compare --save")
    return common


def check_load_layout(args, saved: dict | None) -> None:
    """Raise ValueError where --load's checkpoint (``saved``: the layout and format its common state
    records) cannot load at this run's layout or format."""
    if saved is None:
        return
    if saved["format"] != args.checkpoint_format:
        raise ValueError(
            f"--load {args.load} holds a {saved['format']} checkpoint: give --checkpoint-format {saved['format']}"
        )
    here = (args.tp, args.pp, args.vpp)
    there = (saved["tp"], saved["pp"], saved["vpp"])
    if saved["format"] == "dp_reshardable" and here != there:
        raise ValueError(
            f"--load {args.load} was written at TP {there[0]} x PP {there[1]} (x {there[2]} virtual) as dp_reshardable, "
            f"which loads at any DP size but only at that TP x PP: give --tp {there[0]} --pp {there[1]} --vpp {there[2]}, "
            "or save with --checkpoint-format fully_reshardable"
        )


def check_processes(args) -> None:
    """The processes this job runs in. The job is started plainly and starts torchrun itself for
    every run of several processes (each mode, and each try or run of ``search``, ``resume`` and
    ``layouts``); a run (``--probe``) is ``--tp`` x ``--pp`` x ``--dp``
    processes of torchrun. On a GPU every process needs one of this machine's GPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    processes = args.tp * args.pp * args.dp
    if not args.probe:
        if world > 1:
            raise ValueError(
                "run coat-compare with plain python, not under torchrun: it starts the "
                f"{processes} processes of each run itself (one per GPU)"
            )
        layouts = list(args.trained_layouts)
        if args.resume_at:
            layouts += parse_layouts(args.resume_at)
        processes = max(tp * pp * dp for tp, pp, _, dp in layouts)
    elif processes != world:
        raise ValueError(
            f"--tp {args.tp} x --pp {args.pp} x --dp {args.dp} = {processes} processes, but this run has {world}"
        )
    import torch

    if torch.cuda.is_available() and processes > torch.cuda.device_count():
        raise ValueError(
            f"a run of --tp x --pp x --dp = {processes} processes needs {processes} GPUs, one each; this machine has "
            f"{torch.cuda.device_count()}: give a layout of at most {torch.cuda.device_count()} GPUs"
        )


def parse_steps(text: str) -> tuple[int, ...]:
    """``"46,230,459"`` -> (46, 230, 459), sorted, each once."""
    try:
        return tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give steps as comma-separated numbers, e.g. 46,230,459") from None


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
