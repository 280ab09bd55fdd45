"""An accuracy protocol's runs on one host, several at once per GPU, within one command's deadline.

A 125M-parameter run leaves most of a Hopper GPU idle (its eager steps wait on the host), so
``per_device`` coat-compare processes share each GPU. Every run of a seed goes to the same GPU
(``device_of``), so that a seed's arms are paired on one device as well as on weights and batches.
Runs start in the protocol's order (seed by seed, the reference first; a cool-down protocol's trunk
before its main and branch, which load the trunk's checkpoint), and a run starts only if it would
end before the deadline by the slowest rate measured so far: ``seconds = start-up + steps x step
time``, both read from the finished runs of this command (``guess_step_s`` before any). At the
deadline whatever still runs is stopped and comes back in a later command; a checkpoint is kept in
the state directory until both runs that load it are done.

State directory: ``seedS/NAME.jsonl`` (each run's report), ``seedS/NAME.log`` and
``checkpoints/seedS-KEY/``; a later command on the same machine goes on from it. Nothing here prints
a loss: the protocol's power gate is read blind (``coat_compare.protocol``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from . import Protocol, flags, place_of, read_rows, run_name

STARTUP_GUESS_S = 60.0  # a run's start-up (imports, model, corpus, first step) before any was measured
POLL_S = 2.0


@dataclass
class Job:
    seed: int
    key: str
    segment: str
    name: str
    argv: list[str]
    device: int | None
    steps: int  # the steps it trains
    needs: str | None = None  # the trunk whose checkpoint it loads
    started: float | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)


def device_of(seed: int, devices: list[int | None]) -> int | None:
    return devices[(seed - 1) % len(devices)]


def checkpoint_dir(state: str, seed: int, key: str) -> str:
    return os.path.join(state, "checkpoints", f"seed{seed}-{key.replace('@', '-')}")


def segment_steps(protocol: Protocol, segment: str) -> int:
    steps = protocol.setting("--steps")
    if protocol.branch is None:
        return steps
    step, cooldown = protocol.branch
    return {"trunk": step, "main": steps - step, "branch": cooldown}[segment]


def made_runs(protocol: Protocol, rows: list[tuple[str, dict]]) -> set[tuple[int, str, str]]:
    """(seed, key, segment) of every run that ``rows`` hold finished. Unlike the judge's ``collect``,
    a run with two finished rows counts as made: a trunk made again in a later session, after the
    machine that held its checkpoint went back, is made; neither of its rows enters a figure, and
    counting it missing would make it a third time."""
    return {place for place, _ in (place_of(protocol, row) for _, row in rows) if place is not None}


def plan(protocol: Protocol, state: str, seeds: list[int], devices: list[int | None], done: set) -> list[Job]:
    """The runs ``seeds`` still need, in the order they should start: (seed, key, segment) in
    ``done`` are made. A key whose loading runs are all made needs no trunk; one that needs its
    trunk's checkpoint but has none in ``state`` makes the trunk again."""
    jobs = []
    for seed in seeds:
        for key in protocol.keys(seed):
            todo = [s for s in protocol.segments() if s != "trunk" and (seed, key, s) not in done]
            saved = (seed, key, "trunk") in done and os.path.isdir(checkpoint_dir(state, seed, key))
            if protocol.branch and todo and not saved:
                todo = ["trunk", *todo]
            ckpt = checkpoint_dir(state, seed, key) if protocol.branch else None
            trunk = run_name(protocol, seed, key, "trunk") if "trunk" in todo else None
            for segment in sorted(todo, key=("trunk", "branch", "main", "full").index):
                jobs.append(
                    Job(
                        seed,
                        key,
                        segment,
                        run_name(protocol, seed, key, segment),
                        flags(protocol, seed, key, segment, ckpt),
                        device_of(seed, devices),
                        segment_steps(protocol, segment),
                        needs=trunk if segment in ("main", "branch") else None,
                    )
                )
    return jobs


@dataclass
class Rates:
    """Start-up seconds and seconds per step, the slowest seen per mode (``guess_step_s`` before any)."""

    guess_step_s: float
    step_s: dict[str, float] = field(default_factory=dict)
    startup_s: float = STARTUP_GUESS_S

    def seconds(self, job: Job) -> float:
        mode = job.key.split("@")[0]
        return self.startup_s + job.steps * self.step_s.get(mode, max(self.step_s.values(), default=self.guess_step_s))

    def learn(self, job: Job, row: dict, wall_s: float) -> None:
        mode = job.key.split("@")[0]
        step_s = row.get("step_ms", 0.0) / 1e3
        self.step_s[mode] = max(self.step_s.get(mode, 0.0), step_s)
        startup = wall_s - job.steps * step_s
        self.startup_s = startup if self.startup_s == STARTUP_GUESS_S else max(self.startup_s, startup)


def gpu_devices() -> list[int | None]:
    import torch

    return list(range(torch.cuda.device_count())) or [None]


def visible_device(index: int) -> str:
    """What CUDA_VISIBLE_DEVICES names device ``index`` as this process sees it: the inherited list's
    entry. A runner given GPU 1 alone (CUDA_VISIBLE_DEVICES=1) sees it as device 0, and its runs must
    go to GPU 1, not to the host's GPU 0 (where two runners once shared one GPU and no run ended)."""
    inherited = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return inherited[index] if index < len(inherited) else str(index)


def start(job: Job, state: str) -> None:
    folder = os.path.join(state, f"seed{job.seed}")
    os.makedirs(folder, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if job.device is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_device(job.device)
    command = [sys.executable, "-m", "coat_compare", *job.argv, "--out", folder, "--name", job.name, "--no-plots"]
    with open(os.path.join(folder, f"{job.name}.log"), "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        job.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    job.started = time.monotonic()


def stop(job: Job) -> None:
    """End a run and everything it started (its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(job.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            job.proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def report_row(state: str, job: Job) -> dict | None:
    path = os.path.join(state, f"seed{job.seed}", f"{job.name}.jsonl")
    if not os.path.exists(path):
        return None
    rows = [r for _, r in read_rows(path) if r.get("mode") == job.key.split("@")[0]]
    return rows[-1] if rows else None


def run_protocol(
    protocol: Protocol,
    state: str,
    seeds: list[int],
    *,
    deadline_s: float,
    per_device: int,
    guess_step_s: float,
    done: list[str] = (),
    devices: list[int | None] | None = None,
) -> int:
    """Make the runs ``seeds`` still need (``done``: rows of earlier sessions), ``per_device`` at
    once per GPU, none started that would end after ``deadline_s``; 0 when every run was made, 75
    when some are left for a later command, 1 when a run failed."""
    began = time.monotonic()
    devices = gpu_devices() if devices is None else devices
    os.makedirs(state, exist_ok=True)
    made = made_runs(protocol, read_rows([state, *done]))
    pending = plan(protocol, state, seeds, devices, made)
    rates = Rates(guess_step_s)
    running: list[Job] = []
    failed, finished, cut = [], [], []
    trunks_ok: set[str] = set()
    print(f"{len(pending)} run(s) to make on {len(devices)} device(s), {per_device} at once each", flush=True)
    while pending or running:
        for job in list(running):
            if job.proc.poll() is None:
                continue
            running.remove(job)
            wall = time.monotonic() - job.started
            row = report_row(state, job)
            if row is not None and row.get("status") == "ok":
                finished.append(job)
                rates.learn(job, row, wall)
                if job.segment == "trunk":
                    trunks_ok.add(job.name)
                made.add((job.seed, job.key, job.segment))
                print(f"{time.monotonic() - began:6.0f} s  done   {job.name} ({wall:.0f} s)", flush=True)
                if protocol.branch and all((job.seed, job.key, s) in made for s in ("main", "branch")):
                    shutil.rmtree(checkpoint_dir(state, job.seed, job.key), ignore_errors=True)
            else:
                failed.append(job)
                why = "no row" if row is None else f"{row.get('status')}: {row.get('reason', '')}"
                why += f" (log: {os.path.join(state, f'seed{job.seed}', job.name + '.log')})"
                print(f"{time.monotonic() - began:6.0f} s  FAILED {job.name}: {why}", flush=True)
                if job.segment == "trunk":  # what loads it cannot run
                    pending = [j for j in pending if j.needs != job.name]
                    shutil.rmtree(checkpoint_dir(state, job.seed, job.key), ignore_errors=True)
        now = time.monotonic() - began
        if now >= deadline_s:
            for job in running:
                stop(job)
                cut.append(job)
                if job.segment == "trunk":
                    shutil.rmtree(checkpoint_dir(state, job.seed, job.key), ignore_errors=True)
            running = []
            break
        for job in list(pending):
            busy = sum(1 for j in running if j.device == job.device)
            ready = job.needs is None or job.needs in trunks_ok
            if busy < per_device and ready and now + rates.seconds(job) <= deadline_s:
                start(job, state)
                running.append(job)
                pending.remove(job)
                print(
                    f"{now:6.0f} s  start  {job.name} on {job.device} (expect {rates.seconds(job):.0f} s)", flush=True
                )
        if not running:
            break  # nothing fits before the deadline, or nothing is ready
        time.sleep(POLL_S)
    left = len(pending) + len(cut)
    rates_text = ", ".join(f"{m} {s:.3f} s/step" for m, s in sorted(rates.step_s.items()))
    print(
        f"made {len(finished)}, failed {len(failed)}, stopped at the deadline {len(cut)}, not started {len(pending)}; "
        f"{time.monotonic() - began:.0f} s; start-up {rates.startup_s:.0f} s; {rates_text or 'no rate measured'}",
        flush=True,
    )
    return 1 if failed else 75 if left else 0
