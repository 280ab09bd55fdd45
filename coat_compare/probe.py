"""One run of the job in fresh processes: ``coat-compare ... --probe``, under ``torchrun`` when
it needs more than one process.

Every mode of a comparison on a GPU or on several processes, each try of the micro-batch search
(``search``), each run of the checkpoint-resume check (``resume``) and of the layout check
(``layouts``) is such a run: an out-of-memory error, and whatever state it leaves in the CUDA
caching allocator, TE or Megatron, dies with its processes, a rank that dies or stalls takes its
run down and not the job, and each run can have its own number of processes (a checkpoint written
by 2 resumes in 1). ``new_row`` is a run's row before it runs (what it is, or why it cannot run
here); ``run_args`` builds a run's command line from the job's. The probe prints its one row as a
line starting with ``PROBE_MARK``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from . import parallel
from .modes import why_not_here

PROBE_MARK = "COAT-COMPARE-PROBE "


@dataclass
class ProbeResult:
    row: dict | None  # the probe's row, None when it printed none
    error: str  # why there is no row ("" when there is one)
    seconds: float
    log: str = ""  # the run's stderr when there is no row (the whole of it, for a log file)


# lines that say why a run died, best first: a stalled step (the step watchdog's faulthandler
# dump), a Python exception, a C++ abort, a CUDA error
_CAUSES = (
    re.compile(r"^Timeout \(\d+:\d\d:\d\d\)!"),
    re.compile(r"^coat-compare: error: "),
    re.compile(r"^[\w.]*(Error|Exception): "),
    re.compile(r"what\(\):|terminate called"),
    re.compile(r"CUDA error|illegal memory|Assertion"),
)


def why_it_died(text: str) -> str:
    """The line of a dead run's output that says why (the last Python exception, else an abort
    message or CUDA error), or its last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for cause in _CAUSES:
        hits = [line for line in lines if cause.search(line)]
        if hits and cause is _CAUSES[0]:
            return f"a step went past --step-timeout ({hits[-1]}): every rank's Python stack is in the log"
        if hits:
            return hits[-1]
    return lines[-1] if lines else "no output"


def probe_command(args: list[str], world_size: int) -> list[str]:
    """The command of one probe: ``coat-compare ARGS --probe``, under torchrun for several processes."""
    job = ["-m", "coat_compare", *args, "--probe"]
    if world_size > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}", *job]
    return [sys.executable, *job]


STACKS_SIGNAL = signal.SIGUSR1  # a run's processes print every thread's stack on it (``run.probe``)


def run_probe(args: list[str], world_size: int, timeout_s: float | None = 600) -> ProbeResult:
    """Run one probe and return its row (or why there is none). A run past ``timeout_s`` (None: no
    limit) is sent ``STACKS_SIGNAL`` (its processes print their Python stacks, which land in the
    failed run's log), then killed with everything it started."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **run_environment(args)}
    proc = subprocess.Popen(
        probe_command(args, world_size),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # torchrun and its ranks in one process group, to signal together
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop_with_stacks(proc)
        text = (stderr or "") + (stdout or "")
        rows = [line[len(PROBE_MARK) :] for line in (stdout or "").splitlines() if line.startswith(PROBE_MARK)]
        if rows:  # measured, then stalled in its tear-down: the row stands, the stall is said
            row = json.loads(rows[-1])
            row["teardown"] = f"stalled after the row was printed; stopped at --run-timeout {timeout_s:.0f} s"
            return ProbeResult(row, "", time.monotonic() - start, text)
        return ProbeResult(
            None,
            f"the run went past --run-timeout {timeout_s:.0f} s (stacks in the log)",
            time.monotonic() - start,
            text,
        )
    seconds = time.monotonic() - start
    lines = [line[len(PROBE_MARK) :] for line in stdout.splitlines() if line.startswith(PROBE_MARK)]
    if not lines:
        text = stderr or stdout or ""
        return ProbeResult(
            None, f"the run exited with {proc.returncode} and no result: {why_it_died(text)}"[:400], seconds, text
        )
    return ProbeResult(json.loads(lines[-1]), "", seconds)


def run_environment(args: list[str]) -> dict[str, str]:
    """What a run's processes need in their environment beyond the job's: where Megatron requires it
        (tensor parallelism on GPUs before Blackwell: its sequence-parallel linears overlap their
        communication with the GEMMs only in launch order), ``CUDA_DEVICE_MAX_CONNECTIONS=1``, as
        ``coat-megatron-run`` sets it (``coat_patches.device_connections``). A value the job was started
    with is left as it is."""
    from coat_patches.device_connections import gpu_compute_capability_major, megatron_requires_one_connection

    if "CUDA_DEVICE_MAX_CONNECTIONS" in os.environ:  # the job's own setting, kept as given
        return {}
    tp = args[args.index("--tp") + 1] if "--tp" in args else "1"
    flags = ["--tensor-model-parallel-size", tp]
    if torch.cuda.is_available() and megatron_requires_one_connection(flags, gpu_compute_capability_major()):
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def _children(pid: int) -> dict[int, list[int]]:
    """Every process's children, by parent pid (Linux's /proc); empty where /proc is not there."""
    found: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        found.setdefault(parent, []).append(int(entry))
    return found


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop_with_stacks(proc: subprocess.Popen, grace_s: float = 5.0) -> tuple[str, str]:
    """Ask every rank of the run for its stacks, give them ``grace_s`` to print, then kill the run
    and everything it started; what they printed. torchrun starts each rank in a session of its
    own, so the ranks are found as torchrun's children, not through its process group (a signal to
    that group reaches torchrun alone, which dies of SIGUSR1 and leaves its ranks running)."""
    children = _children(proc.pid)
    ranks = children.get(proc.pid) or [proc.pid]
    _signal_all(ranks, STACKS_SIGNAL)
    try:
        return proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    children = _children(proc.pid)  # again: the ranks may have started processes of their own since
    family, todo = [], [proc.pid]
    while todo:
        pid = todo.pop()
        family.append(pid)
        todo += children.get(pid, [])
    _signal_all(family, signal.SIGKILL)
    try:
        return proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:  # something outside the family holds the pipes: give up on them
        proc.kill()
        return "", "(the run's output pipes stayed open after it was killed)"


def run_args(
    args,
    preset,
    mode: str,
    *,
    graphs: str = "none",
    micro_batch: int | None = None,
    steps: int | None = None,
    layout: tuple[int, int, int, int] | None = None,
    extra: tuple[str, ...] = (),
    **data_overrides,
) -> list[str]:
    """The command line of one run of this job (a mode in one CUDA graph configuration): the
    preset with its overrides, ``mode``, ``args``' seed, layout, training and data options, then
    ``extra``. ``micro_batch``: the run's (None: none given, for the search to add its own);
    ``steps``: the run's (None: the preset's);
    ``layout``: (TP, PP, VPP, DP), default the job's; ``data_overrides`` replace the job's data
    options (``data_args``)."""
    tp, pp, vpp, dp = layout or (args.tp, args.pp, args.vpp, args.dp)
    given = {"--preset": preset.name, "--modes": mode, "--seq": preset.seq, "--seed": args.seed, "--tp": tp, "--pp": pp,
             "--vpp": vpp, "--dp": dp, "--cuda-graphs": graphs, "--gc": args.gc, "--wgrad-fusion": args.wgrad_fusion}  # fmt: skip
    line = [word for flag, value in given.items() for word in (flag, str(value))]
    if preset.kind == "train":  # a per-layer preset takes no optimizer steps
        line += ["--steps", str(preset.steps if steps is None else steps)]
    if micro_batch is not None:
        line += ["--micro-batch", str(micro_batch)]
    if args.deterministic:
        line.append("--deterministic")
    if args.wgrad_accumulate is not None:
        line += ["--wgrad-accumulate", args.wgrad_accumulate]
    for flag in ("overlap_grad_reduce", "overlap_param_gather"):
        if getattr(args, flag):
            line.append("--" + flag.replace("_", "-"))
    if args.step_timeout is not None:
        line += ["--step-timeout", str(args.step_timeout)]
    if args.checkpoint_format != "dp_reshardable" and "--checkpoint-format" not in extra:
        line += ["--checkpoint-format", args.checkpoint_format]
    return [*line, *data_args(args, **data_overrides), *extra]


def data_args(args, **overrides) -> list[str]:
    """The data options given on the command line (or in ``overrides``), the global batch among
    them, and the run's ``--repeat`` label, to pass on to the runs a job starts."""
    given = []
    for name in ("global_batch", "lr_warmup_steps", "lr_decay", "lr_cooldown_steps", "lr_min_ratio", "lr", "adam_eps",
                 "data_seed", "repeat", "corpus", "corpus_bytes", "eval_every", "eval_windows"):  # fmt: skip
        value = overrides.get(name, getattr(args, name, None))
        if value is not None:
            given += [f"--{name.replace('_', '-')}", str(value)]
    return given


def new_row(kind: str, preset, mode, args, graphs: str = "none") -> dict:
    """A row's identity; already ``status: skipped`` with the reason when the mode cannot run here."""
    row = {"kind": kind, "preset": preset.name, "mode": mode.name, "family": mode.family, "spec": mode.resolved_spec(),
           "shape": shape(preset), "device": parallel.device_name(), "software": versions(), "seed": args.seed,
           "tp": args.tp, "pp": args.pp, "vpp": args.vpp, "dp": args.dp, "graphs": graphs,
           "deterministic": args.deterministic}  # fmt: skip
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


def shape(preset) -> str:
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
