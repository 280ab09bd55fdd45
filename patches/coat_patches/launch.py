"""``coat-megatron-run``: run a Megatron pretrain script with ``--coat-fp8`` available.

    coat-megatron-run [--cpu] SCRIPT.py [Megatron arguments] [--coat-fp8 ...]
    torchrun --nproc-per-node 8 $(which coat-megatron-run) SCRIPT.py ...
    python -m coat_patches.launch SCRIPT.py ...

The script runs unmodified, as ``__main__`` (``runpy``), with ``sys.argv`` set to
``[SCRIPT.py, arguments...]`` and the script's directory first on ``sys.path`` (as ``python
SCRIPT.py`` would; Megatron-LM's ``pretrain_gpt.py`` imports ``gpt_builders`` from there), inside
``coat_megatron_patches()``. Without a GPU, or with ``--cpu``, Megatron's training loop runs on
the CPU with gloo. A single process started without torchrun gets torchrun's environment for a
world of one (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, a free ``MASTER_PORT``), so
``coat-megatron-run pretrain_gpt.py ...`` works on its own.

``coat-megatron-run --coat-help`` lists the ``--coat-*`` flags. A bad command line ends in one
line on stderr and exit code 2 (``coat_patches.argument_errors``; the run's own arguments that
Megatron checks late: ``coat_patches.run_arguments``): Megatron's table of arguments comes out only
once Megatron's and COAT's checks passed. Without apex's fused weight-gradient extension on a GPU
it adds ``--no-gradient-accumulation-fusion``, with a line saying so. Ctrl-C ends it with one line
and exit code 130.

Before anything starts CUDA, the launcher sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` where Megatron
requires it (tensor or context parallelism before Blackwell: ``coat_patches.device_connections``).
A rank whose script raises exits with the exception (torchrun then stops the other ranks); a rank
whose script returned waits at most ``CLOSE_TIMEOUT_S`` for the others before it closes the process
groups, and exits with code 1 if they do not come (a rank that died or hangs).

To see where a hung run waits: ``COAT_STACKS_AFTER=SECONDS`` makes each rank write every thread's
Python stack to ``coat-stacks-rank{RANK}.txt`` in ``COAT_STACKS_DIR`` (default: the working
directory) if its script is still running that many seconds after it started (``faulthandler``,
which needs no GIL; once, and the run goes on). A script that returns before then removes its
empty file, and the folder once no rank's file is left in it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import runpy
import socket
import sys
import threading
import time

from .cuda_graphs import release_cuda_graphs

USAGE = (
    "usage: coat-megatron-run [--cpu] SCRIPT.py [Megatron arguments ...] [--coat-fp8 --coat-* ...]\n"
    "       coat-megatron-run --coat-help | --help"
)
HELP_FLAGS = ("-h", "--help")
# How long a rank whose script returned waits for the others at the closing barrier. Megatron's
# pretrain() ends with collectives of its own, so healthy ranks arrive together; one that does not
# arrive within this time died or hangs, and the job must end rather than wait for Megatron's
# collective timeout (10 minutes by default).
CLOSE_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_environment() -> None:
    """torchrun's variables for a world of one, where the launcher was not started by torchrun."""
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def run_script(script: str, script_args: list[str], *, cpu: bool | None = None) -> None:
    """Run ``script`` as ``__main__`` with ``script_args`` inside ``coat_megatron_patches(cpu)``;
    a bad argument prints one line (on rank 0) and exits with code 2."""
    from .argument_errors import ARGUMENT_ERRORS, held_output
    from .device_connections import gpu_compute_capability_major, set_device_max_connections
    from .run_arguments import gradient_fusion_args

    script = os.path.abspath(script)
    if not os.path.isfile(script):
        raise FileNotFoundError(f"no pretrain script at {script}")
    single_process_environment()
    if (notice := set_device_max_connections(script_args, cpu=bool(cpu))) is not None:  # before anything starts CUDA
        _say(notice)
    gpu = not cpu and gpu_compute_capability_major() is not None  # NVML: starts no CUDA context
    script_args, notice = gradient_fusion_args(script_args, gpu)
    if notice is not None:
        _say(notice)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(script))
    stacks = _stacks_after()
    try:
        with held_output(streams=False):  # megatron-core's import warnings wait for the arguments' check
            from .install import coat_megatron_patches

            with coat_megatron_patches(cpu=cpu):
                runpy.run_path(script, run_name="__main__")
    except ARGUMENT_ERRORS as e:
        _fail(str(e))
    finally:
        _cancel_stacks(stacks)
    # Only a script that returned gets here: a rank that raised must not wait at a barrier that
    # the others, stopped by torchrun or failing on it, may never reach.
    try:
        _close_process_groups(CLOSE_TIMEOUT_S)
    except PeersLostError as e:
        print(f"coat-megatron-run: rank {os.environ.get('RANK', '0')}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # not sys.exit: the process groups' destructors would wait on the dead peer


def _stacks_after():
    """Arm ``COAT_STACKS_AFTER``: the open stack file, or None when the variable is unset."""
    value = os.environ.get("COAT_STACKS_AFTER", "")
    if not value:
        return None
    try:
        seconds = float(value)
        if seconds <= 0:
            raise ValueError
    except ValueError:
        _fail(f"COAT_STACKS_AFTER={value!r}: give the seconds after which each rank writes its stacks, e.g. 90")
    folder = os.environ.get("COAT_STACKS_DIR") or os.getcwd()
    os.makedirs(folder, exist_ok=True)
    stacks = open(os.path.join(folder, f"coat-stacks-rank{os.environ.get('RANK', '0')}.txt"), "w")  # noqa: SIM115 (faulthandler keeps it)
    faulthandler.dump_traceback_later(seconds, repeat=False, file=stacks)
    return stacks


def _cancel_stacks(stacks) -> None:
    """The script is done: no stacks later, and no empty file left behind."""
    if stacks is None:
        return
    faulthandler.cancel_dump_traceback_later()
    stacks.close()
    if os.path.getsize(stacks.name) == 0:
        os.remove(stacks.name)
        with contextlib.suppress(OSError):  # the folder too, once no rank's file is left in it
            os.rmdir(os.path.dirname(stacks.name))


class PeersLostError(RuntimeError):
    """Ranks did not reach the end of the script (they died or hang)."""


def _close_process_groups(timeout_s: float) -> None:
    """Tear down torch.distributed after the script returns, as torchrun-launched programs should:
    Megatron's ``pretrain()`` leaves its process groups open, and a process that exits with gloo's
    threads still running can abort in their destructors ("terminate called without an active
    exception", seen once in CI after training had finished, exit code -6).

    In order: every CUDA graph is released (``cuda_graphs.release_cuda_graphs``: NCCL's destroy, and
    its abort alike, waits for each graph that captured one of its kernels, and Megatron's own
    clean-up leaves the per-layer graphs of ``--cuda-graph-impl local`` alive, the cause of the
    destroy that never returned after graphed TP runs); the ranks meet at a barrier kept by the
    rendezvous store, on the host (no NCCL kernel that a stuck stream could hold), which waits at
    most ``timeout_s`` seconds (``PeersLostError`` if the other ranks do not come); then the process
    groups are destroyed one at a time, in the order ``destroy_process_group()`` takes them, so that
    a destroy that still takes more than ``TEARDOWN_S`` can name its group. Such a destroy leaves the
    process with a line saying so and exit status 0: every rank finished the script, so the
    training's work is done and saved. Where graphs were released, rank 0 says how many and how long
    the release and the destroy took (``gpu_evidence.sh pretrain-graphs-tp2`` reads that line)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    start = time.monotonic()
    closing = _Closing(graphs=release_cuda_graphs())
    released = time.monotonic()
    _store_barrier(timeout_s)
    timer = threading.Timer(TEARDOWN_S, _leave_without_closing, args=(closing,))
    timer.daemon = True
    timer.start()
    destroy = time.monotonic()
    try:
        _destroy_process_groups(closing)
    finally:
        timer.cancel()
    if closing.graphs:
        _say(
            f"{closing.graphs} CUDA graphs released in {released - start:.1f} s, then the process groups "
            f"closed in {time.monotonic() - destroy:.1f} s"
        )


class _Closing:
    """How far the closing of the process groups got: the timer that ends a stuck one reads it."""

    def __init__(self, graphs: int):
        self.graphs = graphs  # CUDA graphs released before the groups were destroyed
        self.group = "the process groups"  # the group being destroyed


def _destroy_process_groups(closing: _Closing) -> None:
    """``destroy_process_group()``, one group at a time: Megatron's groups in the order torch's own
    destroy takes them (by name, reversed), then the default group (which also clears
    torch.distributed's state)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    default = distributed_c10d.GroupMember.WORLD
    names = distributed_c10d._world.pg_names
    for group in sorted(names, key=names.get, reverse=True):
        if group is not default:
            closing.group = _describe_group(group)
            dist.destroy_process_group(group)
    closing.group = _describe_group(default)
    dist.destroy_process_group()


def _describe_group(group) -> str:
    """A process group as the teardown's line names it: Megatron's description, backend and size."""
    import torch.distributed as dist

    described = getattr(group, "group_desc", "")  # Megatron names its groups; torch's default is "undefined"
    what = {"default_pg": "the default group", "undefined": ""}.get(described, described) or "a process group"
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):
        backend = "?"
    ranks = group.size()
    return f"{what} ({backend}, {ranks} rank{'' if ranks == 1 else 's'})"


TEARDOWN_S = 15.0  # destroying the process groups takes well under a second when nothing is stuck
_ARRIVED, _LEFT = "coat-megatron-run/arrived", "coat-megatron-run/left"


def _store_barrier(timeout_s: float) -> None:
    """Wait until every rank has called this, counting arrivals in the default process group's
    store; ``PeersLostError`` after ``timeout_s`` seconds. Rank 0 then waits (at most 5 s) until
    every rank has seen the count, because where it hosts the store (a launch by environment
    variables, not torchrun's agent) its exit would cut off a rank still reading."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store, world, rank = distributed_c10d._get_default_store(), dist.get_world_size(), dist.get_rank()
    deadline = time.monotonic() + timeout_s

    def lost(detail: str) -> PeersLostError:
        return PeersLostError(
            f"the other ranks did not reach the end of the script within {timeout_s:g} s (one died or hangs; see "
            f"their output): exiting without closing the process groups ({detail})"
        )

    try:
        arrived = store.add(_ARRIVED, 1)
        while arrived < world:
            if time.monotonic() > deadline:
                raise lost(f"{arrived} of {world} arrived")
            time.sleep(0.05)
            arrived = store.add(_ARRIVED, 0)
    except PeersLostError:
        raise
    except (RuntimeError, OSError) as e:  # the store's host went away: a rank ended
        raise lost(str(e).splitlines()[0]) from e
    left = store.add(_LEFT, 1)
    give_up = time.monotonic() + 5.0
    while rank == 0 and left < world and time.monotonic() < give_up:
        time.sleep(0.05)
        left = store.add(_LEFT, 0)


def _leave_without_closing(closing: _Closing) -> None:
    rank = os.environ.get("RANK", "0")
    print(
        f"coat-megatron-run: rank {rank}: the script finished on every rank, but closing the process groups took "
        f"more than {TEARDOWN_S:g} s; leaving without them (stuck in destroying {closing.group}; "
        f"{closing.graphs} CUDA graphs released before)",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cpu = None
    while argv and argv[0].startswith("-"):
        option = argv.pop(0)
        if option == "--cpu":
            cpu = True
        elif option == "--coat-help":
            _exit_with_help(coat_help=True)
        elif option in HELP_FLAGS:
            _exit_with_help()
        else:
            _fail(
                f"{option} is not an option of coat-megatron-run (it has --cpu, --coat-help and --help): "
                f"Megatron's arguments and the --coat-* flags go after SCRIPT.py"
            )
    if not argv:
        _fail("no pretrain script: pass one first, e.g. coat-megatron-run examples/pretrain_gpt.py --num-layers 2 ...")
    script, script_args = argv[0], argv[1:]
    _check_script(script)
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch looks for a GPU
    if "--coat-help" in script_args:
        _exit_with_help(coat_help=True)
    if any(arg in HELP_FLAGS for arg in script_args):
        _exit_with_script_help(script)
    try:
        run_script(script, script_args, cpu=cpu)
    except KeyboardInterrupt:
        # one line, as coat-compare says it, not the traceback of wherever the script was
        if os.environ.get("RANK", "0") == "0":
            print("coat-megatron-run: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _check_script(script: str) -> None:
    if not script.endswith(".py"):
        _fail(
            f"{script} is not a Python script: pass a pretrain script (a .py file) first, e.g. examples/pretrain_gpt.py"
        )
    if not os.path.isfile(script):
        where = "" if os.path.isabs(script) else f" ({os.path.abspath(script)})"
        what = "is a directory" if os.path.isdir(script) else "does not exist"
        _fail(f"{script}{where} {what}: pass the path of a pretrain script, e.g. examples/pretrain_gpt.py")


def _say(message: str) -> None:
    """A line of the launcher's on stdout, from rank 0 only."""
    if os.environ.get("RANK", "0") == "0":
        print(f"coat-megatron-run: {message}", flush=True)


def _fail(message: str) -> None:
    """The error on stderr (from rank 0 only, under torchrun) and exit code 2, as argparse does."""
    if os.environ.get("RANK", "0") == "0":
        print(f"coat-megatron-run: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _exit_with_help(coat_help: bool = False) -> None:
    from .help import coat_flags_help

    _print_help(coat_flags_help() if coat_help else f"{USAGE}\n\n{__doc__.strip()}\n\n{coat_flags_help()}")


def _exit_with_script_help(script: str) -> None:
    """``SCRIPT.py --help``: Megatron's parser prints it where megatron-core can (with the COAT flags);
    where its help formatting fails, the COAT flags and why Megatron's are missing."""
    import warnings

    from .help import coat_flags_help, megatron_help_failure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's import warnings (TransformerEngine or apex missing)
        failure = megatron_help_failure()
    if failure is None:
        return
    _print_help(
        f"{USAGE}\n\n{coat_flags_help()}\n\n"
        f"{os.path.basename(script)} --help: {failure}. Megatron's flags are in megatron/training/arguments.py."
    )


def _print_help(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # coat-megatron-run --help | head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(0)


if __name__ == "__main__":
    main()
