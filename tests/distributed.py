"""Run a test function in N processes on gloo, with real Megatron-Core on the CPU.

``run_distributed(fn, world_size, ...)`` starts ``world_size`` fresh processes (torch.multiprocessing,
``forkserver``: see below), joins them into one gloo process group, optionally initialises Megatron's model
parallel state, calls ``fn(*args)`` in each inside ``coat_patches.cpu.megatron_on_cpu()``, and
returns the per-rank return values (a list indexed by rank). ``fn`` must be importable by name
(a module-level function of a test module); what it returns must pickle.

Failures come back to the test: the first rank to raise has its exception re-raised in the parent,
chained to that rank's traceback (and the other ranks' errors are listed); a rank that dies without
reporting, or a run that outlives ``timeout``, fails the test and the processes are killed, so that
a hung collective cannot hang CI.

Start-up: a child that imports torch and Megatron from scratch (``spawn``) spends 3-5 s on imports
before 0.1 s of tiny-GPT work, and the tests start some 25 of them on 2 cores. ``forkserver`` runs
those imports once per test process, in a server that has started no threads, and forks each child
from it (0.1 s); like ``spawn``, it never forks the test process itself. The server starts with
the first run and exits with the test process.

Rendezvous: the parent hosts the ``TCPStore`` on a port the OS picks (bound, never guessed), so
concurrent runs (pytest-xdist workers) cannot collide. gloo then connects the ranks through that
store. Children see no GPU (``CUDA_VISIBLE_DEVICES=""``) and use ``threads`` CPU threads each.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"

# Imported once by the fork server (what the tiny-GPT tests use); a module missing here is skipped.
PRELOAD = [
    "torch",
    "torch.distributed",
    "coat_patches.cpu",
    "megatron.core.dist_checkpointing",
    "megatron.core.distributed",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "coat_megatron.optimizer.distributed",
]


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in a rank (the __cause__ of the re-raised one)."""

    def __str__(self) -> str:
        return self.args[0]


class RankFailed(RuntimeError):
    """A rank failed with an exception that could not be sent back as itself, or died silently."""


def run_distributed(
    fn: Callable,
    world_size: int,
    *,
    args: Sequence = (),
    tensor_parallel: int | None = None,
    pipeline_parallel: int = 1,
    model_parallel_kwargs: dict | None = None,
    timeout: float = 120.0,
    threads: int = 1,
) -> list:
    """Call ``fn(*args)`` on ranks 0..world_size-1 and return their results, indexed by rank.

    Args:
        fn: a module-level function (pickled by reference into each child).
        world_size: number of processes.
        args: positional arguments for ``fn`` (pickled).
        tensor_parallel: if given, ``megatron.core.parallel_state.initialize_model_parallel`` is
            called with this TP size and ``pipeline_parallel`` before ``fn`` (data parallel is the
            rest of ``world_size``), and the model-parallel state is destroyed after it.
        model_parallel_kwargs: further keyword arguments for ``initialize_model_parallel``.
        timeout: seconds for the whole run; also the gloo timeout of every collective.
        threads: ``torch.set_num_threads`` in each child.

    Raises:
        The first failing rank's exception (with its traceback as __cause__), RankFailed, or
        TimeoutError naming the ranks that had not finished.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts: at the first run
    results = ctx.Queue()
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout))
    setup = dict(
        port=store.port,
        world_size=world_size,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        model_parallel_kwargs=model_parallel_kwargs or {},
        timeout=timeout,
        threads=threads,
    )
    procs = []
    reports = {}
    try:
        # The fork server (and so every child) keeps the environment it starts with. Hide GPUs
        # from it: CUDA must not be initialised in a process that forks, and without CUDA
        # megatron_on_cpu() applies on any machine.
        with _environment(CUDA_VISIBLE_DEVICES=""):
            for rank in range(world_size):
                # Not daemonic: Megatron's checkpoint writer starts processes of its own.
                p = ctx.Process(target=_child, args=(rank, setup, fn, tuple(args), results))
                p.start()
                procs.append(p)
        reports = _collect(procs, results, world_size, deadline=time.monotonic() + timeout)
    finally:
        _stop(procs, wait=len(reports) == world_size and all(r["status"] == "ok" for r in reports.values()))
        results.close()
        results.join_thread()
        del store

    failures = sorted((r for r in reports.values() if r["status"] != "ok"), key=lambda r: r["time"])
    if failures:
        first = failures[0]
        others = "".join(f"\n  rank {r['rank']}: {r['summary']}" for r in failures[1:])
        note = f"rank {first['rank']} of {world_size} failed first" + (f"; then{others}" if others else "")
        cause = RemoteTraceback(f"\n--- traceback of rank {first['rank']} ---\n{first['traceback']}")
        exc = first["exception"]
        if exc is None:
            raise RankFailed(f"{note}: {first['summary']}") from cause
        exc.add_note(note)
        raise exc from cause
    return [reports[rank]["value"] for rank in range(world_size)]


@contextlib.contextmanager
def _environment(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _collect(procs, results, world_size: int, deadline: float) -> dict:
    """Reports by rank. Once one rank has failed, the others get a short grace period to report
    theirs (they usually fail too, in a collective with the failed rank), then are given up."""
    reports: dict[int, dict] = {}
    silent_since: dict[int, float] = {}  # exited without a report (yet): when first seen
    grace_end = None
    while len(reports) < world_size:
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        if now >= deadline:
            missing = [r for r in range(world_size) if r not in reports]
            raise TimeoutError(
                f"ranks {missing} of {world_size} did not finish within the timeout (a hung "
                f"collective, or a rank waiting for one that failed); finished: {sorted(reports)}"
            )
        try:
            report = pickle.loads(results.get(timeout=min(0.2, deadline - now)))
            reports[report["rank"]] = report
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank in reports or p.exitcode is None:
                    continue
                # A report written just before the exit may still be in the pipe: wait a moment.
                if now - silent_since.setdefault(rank, now) > 1.0:
                    summary = f"exited with code {p.exitcode} without reporting (see its stderr)"
                    reports[rank] = _report(rank, "died", summary=summary)
        if grace_end is None and any(r["status"] != "ok" for r in reports.values()):
            grace_end = time.monotonic() + 5.0
    return reports


def _stop(procs, wait: bool) -> None:
    """Join the children; kill those that do not exit (at once when wait is False), with any
    processes they started (e.g. a checkpoint writer's)."""
    for p in procs:
        p.join(timeout=10.0 if wait else 0.0)
    for p in procs:
        if p.is_alive():
            try:
                descendants = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                descendants = []
            p.kill()
            p.join(timeout=10.0)
            for d in descendants:
                with contextlib.suppress(psutil.NoSuchProcess):
                    d.kill()


def _report(rank: int, status: str, *, value=None, exception=None, summary="", tb="") -> dict:
    return dict(
        rank=rank, status=status, value=value, exception=exception, summary=summary, traceback=tb, time=time.time()
    )


def _pickled(report: dict) -> bytes:
    """The report as bytes (plain pickle: no shared memory outliving the child). An exception
    that does not survive a pickle round trip is sent as its text only."""
    try:
        raw = pickle.dumps(report)
        pickle.loads(raw)
        return raw
    except Exception as e:
        if report["status"] == "ok":
            report.update(
                status="error", value=None, summary=f"its return value does not pickle: {type(e).__name__}: {e}"
            )
        report.update(exception=None)
        return pickle.dumps(report)


def _child(rank: int, setup: dict, fn: Callable, args: tuple, results) -> None:
    torch.set_num_threads(setup["threads"])
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's exact float casts, as in the test process
        from triton_interpreter import install

        install()
    world_size = setup["world_size"]
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(setup["port"]),
    )
    timeout = datetime.timedelta(seconds=setup["timeout"])
    try:
        from coat_patches.cpu import megatron_on_cpu

        store = dist.TCPStore(HOST, setup["port"], is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        with megatron_on_cpu():
            if setup["tensor_parallel"] is None:
                value = fn(*args)
            else:
                from megatron.core import parallel_state

                parallel_state.initialize_model_parallel(
                    setup["tensor_parallel"],
                    setup["pipeline_parallel"],
                    distributed_timeout_minutes=math.ceil(setup["timeout"] / 60),
                    **setup["model_parallel_kwargs"],
                )
                try:
                    value = fn(*args)
                finally:
                    parallel_state.destroy_model_parallel()
        report = _report(rank, "ok", value=value)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        report = _report(rank, "error", exception=e, summary=f"{type(e).__name__}: {e}", tb=tb)
    results.put(_pickled(report))
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()
