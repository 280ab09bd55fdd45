"""The ``coat-compare`` command: ``main`` reads the command line (``cli.parse_args``: the
``Options``, checked) and runs its sub-command. ``run``, ``search``, ``resume`` and ``layouts`` are
jobs (``job``): the sub-command's ``measure`` (in its module, ``MEASURES``) hands its rows to the
job, which keeps each on disk as it comes, then writes the report and says the exit status; with
``--probe`` the command is one run of a job, in the processes the job started for it (``run.probe``).
``summarize`` combines earlier reports; ``protocol`` is the accuracy protocols' own command line.
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile

import torch

from . import layouts, resume, run, search
from .cli import Options, parse_args, refuse
from .corpus import training_windows
from .goals import evaluate
from .modes import why_not_here
from .probe import versions
from .report import RowLog, read_jsonl, report, write_report

MEASURES = {"run": run.measure, "search": search.measure, "resume": resume.measure, "layouts": layouts.measure}


def main(argv=None) -> int:
    """The sub-command the command line names (none: ``run``). A job's exit status: 0 when every
    row ran (or ran out of memory, or cannot run on this machine), 1 when a row failed otherwise
    (after the report is written), 2 for a command line it cannot run."""
    options = parse_args(argv)
    return SUB_COMMANDS[options.command](options)


def job(o: Options) -> int:
    """A job: the rows ``MEASURES[o.command](o, keep)`` hands to ``keep``, each on disk as it comes
    (``RowLog``), then the report (``{out}/{name}.*``, the name ``PRESET`` for run, else
    ``PRESET-COMMAND``, unless ``--name``) and the exit status; with ``--probe``, ``run.probe``."""
    start(o)
    if o.probe:
        return run.probe(o)
    name = o.name or o.preset.name + ("" if o.command == "run" else f"-{o.command}")
    log = RowLog(o.out, name)
    try:
        MEASURES[o.command](o, log.add)
        header = f"{o.preset.description}. {versions()}. Command: `coat-compare {' '.join(sys.argv[1:])}`"
        report(o.out, name, header, log.rows, plots=not o.no_plots)
    except BaseException as e:
        if log.path and log.rows:
            kept = f"the rows it measured ({len(log.rows)}) are in {log.path}"
            print(f"coat-compare: the job stopped ({type(e).__name__}); {kept}", file=sys.stderr, flush=True)
        raise
    log.finish()
    return exit_status(log.rows)


def start(o: Options) -> None:
    """Before a job's work: Megatron's deterministic mode where asked, then make the directories the
    job writes into and prove them writable, and check that the training text lasts the run."""
    if o.deterministic:
        deterministic()
    try:
        if not o.probe:
            check_directory(o.out, "--out")
        if o.save:
            check_directory(o.save, "--save")
        if o.resume_check and o.checkpoint_dir:
            check_directory(o.checkpoint_dir, "--checkpoint-dir")
        runs = any(why_not_here(o.preset, mode) is None for mode in o.modes)
        # a probe's job checked it already; a search try is a few steps
        if o.preset.kind == "train" and runs and not o.probe and not o.search:
            for _, _, _, dp in o.trained_layouts:
                training_windows(o.preset, o.seed if o.data_seed is None else o.data_seed, dp)
    except ValueError as e:
        refuse(str(e))


def deterministic() -> None:
    """Megatron's deterministic mode for this process and the runs it starts (which inherit the
    environment): before any cuBLAS or TE kernel runs."""
    from megatron.training.determinism import apply_determinism_env

    apply_determinism_env(os.environ)
    torch.use_deterministic_algorithms(True, warn_only=True)


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


def exit_status(rows: list[dict]) -> int:
    """1 when a row failed for another reason than memory ("oom") or this machine ("skipped": no
    TransformerEngine, no GPU), saying which on stderr; else 0."""
    failed = [r for r in rows if r.get("status") == "failed"]
    if not failed:
        return 0
    first = f"{failed[0].get('mode')} (graphs: {failed[0].get('graphs', 'none')}): {failed[0].get('reason', '')}"
    print(f"coat-compare: {len(failed)} of {len(rows)} rows failed, the first {first}", file=sys.stderr, flush=True)
    return 1


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
    write_report(out, "summary", title, header, rows, evaluate(rows, every_goal=True), [])
    return 0


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


SUB_COMMANDS = {
    "run": job,
    "search": job,
    "resume": job,
    "layouts": job,
    "summarize": summarize_command,
    "protocol": protocol_command,
}
