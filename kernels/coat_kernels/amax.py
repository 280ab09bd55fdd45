"""A per-tensor amax finished inside the kernel that computes its parts: no reduction launch.

Group scaling (docs/design.md#mixed-granularity): the kernel that produces a tensor, or reads it once, has every program
store the amax of its tile or row (a *partial*). Reducing those partials used to take a separate
launch (``partials.amax()``), 8 per transformer layer fwd+bwd. Here the program that finishes last
reduces them in the same launch:

    every program:  store its partial; barrier; ticket = atomic_add(counter, 1)   (acquire-release)
    last program:   (ticket == programs - 1) amax = max of all partials; counter = 0

The atomic's release makes each program's partial visible before its ticket is counted, its acquire
makes every partial visible to the program that draws the last ticket, and the partials are read
through L2 (``.cg``). The counter is one int32 of a small per-device pool, handed out in turn and
left at zero by the last program of each launch: it needs no reset launch either. Launches that
share a stream run one after another; the pool has ``SLOTS`` counters, so that kernels running at
once on other streams (fewer than ``SLOTS`` of them) never share one.

Partials are ``abs_or_inf`` maxima (never NaN), so the maximum is exact and equals
``partials.amax()`` bit for bit.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from . import workspace

SLOTS = 256
_REDUCE_BLOCK = tl.constexpr(1024)
_pools: dict[torch.device, torch.Tensor] = {}
# each pool's one-element views, sliced once: (the pool, its views), checked against _pools
_counters: dict[torch.device, tuple[torch.Tensor, list[torch.Tensor]]] = {}
_turn = itertools.count()


@triton.jit
def finish_amax(partials_ptr, amax_ptr, counter_ptr):
    """Called by every program of a launch after it stored its partial at ``partials_ptr + its index``
    (one partial per program: ``partials`` holds as many as the grid has programs): the program that
    arrives last writes their maximum to ``amax_ptr`` and resets the counter."""
    tl.debug_barrier()  # every thread's store of this program's partial precedes its ticket
    n_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if ticket == n_programs - 1:
        acc = tl.zeros((_REDUCE_BLOCK,), dtype=tl.float32)
        for start in range(0, n_programs, _REDUCE_BLOCK):
            offs = start + tl.arange(0, _REDUCE_BLOCK)
            part = tl.load(partials_ptr + offs, mask=offs < n_programs, other=0.0, cache_modifier=".cg")
            acc = tl.maximum(acc, part)
        tl.store(amax_ptr, tl.max(acc, axis=0))
        tl.atomic_xchg(counter_ptr, 0)


def pool(device: torch.device) -> torch.Tensor:
    """``device``'s pool of ``SLOTS`` int32 counters ("cuda" means the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _pools.get(device)
    if counters is None:
        counters = _pools[device] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    return counters


def counter(device: torch.device) -> torch.Tensor:
    """The next int32 counter of ``device``'s pool (a one-element view; zero between launches)."""
    entry = _counters.get(device)
    if entry is None or len(entry[1]) != SLOTS or _pools.get(entry[0].device) is not entry[0]:
        counters = pool(device)
        entry = _counters[device] = (counters, [counters[i : i + 1] for i in range(SLOTS)])
    return entry[1][next(_turn) % SLOTS]


def amax_outputs(
    n_programs: int, device: torch.device, scratch: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(partials, amax, counter)`` for a launch of ``n_programs`` programs that calls
    ``finish_amax``: one partial per program, the 0-d FP32 amax it leaves (one allocation for both,
    or the ``scratch`` buffer of that name where the amax is read only by the caller's next pass:
    ``workspace``), and its counter."""
    buf = workspace.empty(n_programs + 1, torch.float32, device, scratch)
    return buf[:n_programs], buf[n_programs], counter(device)
