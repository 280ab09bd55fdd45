"""The largest micro-batch that fits: doubling, then bisection, each try in a fresh process.

``largest_micro_batch(fits)`` is the search alone: ``fits(n)`` says whether micro-batch ``n``
trains (and may carry measurements); it doubles n from ``start`` until a try fails, then bisects
between the last success and the first failure. A time limit or a largest micro-batch worth trying
stops it early; the answer then says what is known (``largest`` fits, ``smallest_failure`` does
not, or is None when nothing failed).

``measure`` is the ``search`` sub-command: each mode's search, a row each. ``probe_fits`` is the real ``fits``: it runs ``coat-compare --probe`` in a new process (a few
steps at one micro-batch; ``probe``), so that an out-of-memory error, and whatever state it
leaves in the CUDA caching allocator, TE or Megatron, dies with that process. ``--fit-memory GIB`` makes a try
fail when its peak memory exceeds that many GiB, which emulates a smaller GPU (and lets the search
run on a CPU, where nothing runs out of memory).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .probe import new_row, run_args, run_probe


def measure(o, keep) -> None:
    """The largest micro-batch of each mode (end-to-end presets), each try a fresh process; each row
    handed to ``keep`` when done."""
    preset = o.preset
    for mode, graphs in [(m, g) for m in o.modes for g in o.cuda_graphs]:
        row = new_row("search", preset, mode, o, graphs)
        if row.get("status") == "skipped":
            keep(row)
            continue
        # a try measures fit and speed: no validation
        line = run_args(o, preset, mode.name, graphs=graphs, steps=o.search_steps, eval_every=0, global_batch=None)
        fits = probe_fits(line, o.tp * o.pp * o.dp, o.fit_memory, micro_batches=o.search_micro_batches, dp=o.dp)
        label = f"{preset.name} {mode.name}" + ("" if graphs == "none" else f" (graphs: {graphs})")

        def reporting(n, fits=fits, label=label):
            t = fits(n)
            fit = "fits" if t.fits else "does not fit: " + t.reason
            print(f"{label}: micro-batch {n} {fit} ({t.seconds:.0f} s)", file=sys.stderr, flush=True)
            return t

        result = largest_micro_batch(
            reporting, start=o.search_start, limit=o.search_max_micro_batch, time_limit_s=o.search_time_limit
        )
        top = result.best().result if result.best() else {}
        keep(
            {
                **row,
                "status": "ok",
                "micro_batches_per_step": o.search_micro_batches,
                "largest_micro_batch": result.largest,
                "smallest_failure": result.smallest_failure,
                "stopped": result.stopped,
                "tries": [
                    {"micro_batch": t.micro_batch, "fits": t.fits, "reason": t.reason, "seconds": round(t.seconds, 1)}
                    for t in result.tries
                ],
                # at the largest micro-batch; the model FLOPs are the train row's (coat_compare.flops)
                **{
                    k: top.get(k)
                    for k in (
                        "tokens_per_s",
                        "peak_MiB",
                        "tokens_per_s_per_gpu",
                        "step_ms",
                        "model_tflops_per_gpu",
                        "mfu_bf16",
                        "mfu_fp8",
                    )
                },  # fmt: skip
            }
        )


@dataclass
class Try:
    micro_batch: int
    fits: bool
    reason: str = ""
    result: dict = field(default_factory=dict)  # the probe's measurements when it fit
    seconds: float = 0.0


@dataclass
class SearchResult:
    largest: int  # 0: micro-batch `start` does not fit
    smallest_failure: int | None
    tries: list[Try]
    stopped: str = ""  # why the search stopped before pinning the answer down, if it did

    @property
    def exact(self) -> bool:
        return not self.stopped

    def best(self) -> Try | None:
        return next((t for t in self.tries if t.fits and t.micro_batch == self.largest), None)


def largest_micro_batch(
    fits: Callable[[int], Try],
    *,
    start: int = 1,
    limit: int | None = None,
    time_limit_s: float | None = None,
    clock=time.monotonic,
) -> SearchResult:
    """Doubling from ``start``, then bisection: the largest n <= ``limit`` with ``fits(n).fits``.

    Assumes fitting is monotone (if n fits, every smaller n does). Stops early, saying so in
    ``stopped``, when ``time_limit_s`` has passed before a new try would start.
    """
    if start < 1:
        raise ValueError(f"the search starts at a micro-batch >= 1, not {start}")
    deadline = None if time_limit_s is None else clock() + time_limit_s
    tries: list[Try] = []
    lo, hi = 0, None  # lo fits (0: nothing known to fit), hi does not (None: nothing failed)

    def attempt(n: int) -> bool:
        t = fits(n)
        tries.append(t)
        return t.fits

    n = start
    while True:
        if deadline is not None and clock() >= deadline:
            return SearchResult(lo, hi, tries, stopped=f"time limit of {time_limit_s:.0f} s")
        if attempt(n):
            lo = n
            if limit is not None and n >= limit:
                return SearchResult(
                    lo, hi, tries, stopped=f"reached the limit of micro-batch {limit}" if n == limit else ""
                )
            n = min(2 * n, limit) if limit is not None else 2 * n
        else:
            hi = n
            break
    while hi - lo > 1 and lo >= start:
        if deadline is not None and clock() >= deadline:
            return SearchResult(lo, hi, tries, stopped=f"time limit of {time_limit_s:.0f} s")
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(lo, hi, tries)


def probe_args_for(args: list[str], micro_batch: int, micro_batches: int = 1, dp: int = 1) -> list[str]:
    """A try's command line: ``args`` at ``micro_batch``, and where each step accumulates
    ``micro_batches`` micro-batches per rank, the global batch that makes it so."""
    if micro_batches < 1:
        raise ValueError(f"micro-batches per step must be 1 or more, got {micro_batches}")
    extra = [] if micro_batches == 1 else ["--global-batch", str(micro_batch * micro_batches * dp)]
    return [*args, "--micro-batch", str(micro_batch), *extra]


def probe_fits(
    args: list[str],
    world_size: int,
    fit_memory_gib: float | None,
    timeout_s: float = 600,
    *,
    micro_batches: int = 1,
    dp: int = 1,
) -> Callable[[int], Try]:
    """``fits`` for ``largest_micro_batch``: one fresh process per try (see the module docstring);
    each try's step accumulates ``micro_batches`` micro-batches per rank (``dp`` ranks)."""

    def fits(micro_batch: int) -> Try:
        probe = run_probe(probe_args_for(args, micro_batch, micro_batches, dp), world_size, timeout_s)
        row, seconds = probe.row, probe.seconds
        if row is None:
            return Try(micro_batch, False, probe.error.replace("the run", "the try"), seconds=seconds)
        if row.get("status") != "ok":
            return Try(micro_batch, False, row.get("reason", row.get("status", "")), seconds=seconds)
        if fit_memory_gib is not None and row["peak_MiB"] > fit_memory_gib * 1024:
            return Try(
                micro_batch,
                False,
                f"peak {row['peak_MiB']:.1f} MiB > --fit-memory {fit_memory_gib} GiB ({fit_memory_gib * 1024:.1f} MiB)",
                row,
                seconds,
            )
        return Try(micro_batch, True, "", row, seconds)

    return fits
