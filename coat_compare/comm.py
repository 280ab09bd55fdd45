"""Bytes moved by all-gathers, counted where they are called, by process group and element width.

Megatron, TransformerEngine and COAT all-gather through torch.distributed, some of it under names
bound when a module was imported:

==========================================  ===================================================
entry point                                 who calls it
==========================================  ===================================================
``torch.distributed.all_gather_into_tensor``  TE's ``gather_along_first_dim`` (BF16, and FP8 codes
                                            for its FP8 recipes), COAT's FP8 sequence-parallel
                                            gather (the default; one uint8 message per rank:
                                            its codes, then its FP32 scale in a 16-byte row)
``coat_megatron.layers.chunk_exchange.``    COAT's FP8 sequence-parallel gather as a ring of
``RingAllGather``                           point-to-point transfers (``tp_comm_overlap`` on):
                                            counted as the all-gather it makes up
``torch.distributed._all_gather_base``      the old name of the same (Megatron binds it on old
                                            torch)
``torch.distributed.all_gather``            the list form: Megatron's uneven sequence gathers
``dist_all_gather_func`` and any other      Megatron's aliases (tensor_parallel.mappings,
module-level alias of the three above in    .layers, .utils; the distributed optimizer's
``megatron.*``, ``transformer_engine.*``,    parameter gather in param_and_grad_buffer; ...)
``coat_megatron.*``
==========================================  ===================================================

``AllGatherBytes`` replaces every one of them while it is active, and counts what this rank
contributes to each gather: its input's bytes (each rank of a group of size n receives n times
that). A gather is filed under its group: ``tp`` when its ranks are the tensor-parallel group's
(under sequence parallelism: the gathered inputs of column-parallel linears, their regathers for
the weight gradient, the gathered output gradients of row-parallel linears, the output layer's
input), ``dp`` when they are the data-parallel group's (the distributed optimizer's parameter
gather), ``other`` otherwise; and under its element width: ``fp8`` for 1-byte elements (FP8
codes, as float8 or a uint8 view), ``wide`` for the rest (BF16, FP32). Gathers over a group of
one rank move nothing and are not counted.

COAT's sequence-parallel gathers move each rank's chunk of FP8 codes with the FP32 scale its
producer quantized it with (in the collective all counted as ``fp8``, the scale's 16 bytes packed
behind the codes so that cuBLASLt finds it 16-byte aligned; in the ring ``fp8`` codes and a 4-byte
``wide`` scale); a gather made again for the weight
gradient moves codes only (the scales are kept). Its ring passes each chunk on from rank to rank,
as NCCL's own all-gather does inside: what a rank contributes, and what is counted, is its own
chunk and scale once, whether the ring or one collective moves them.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.distributed as dist

ENTRY_POINTS = ("all_gather_into_tensor", "_all_gather_base", "all_gather")
PACKAGES = ("megatron.", "transformer_engine.", "coat_megatron.")


class AllGatherBytes:
    """Count all-gather bytes while active::

        with AllGatherBytes() as gathered:
            ...                         # steps
        gathered.bytes[("tp", "fp8")]   # bytes this rank sent in FP8 over the TP group

    Enter it in every rank (it needs Megatron's parallel state to name the groups).
    """

    def __init__(self):
        self.bytes: Counter[tuple[str, str]] = Counter()
        self._patched: list[tuple[object, str, object]] = []
        self._groups: dict[int, str] = {}

    def snapshot(self) -> dict[str, int]:
        """{"tp_wide": ..., "tp_fp8": ..., "dp_wide": ..., ...}: the counts so far."""
        return {f"{group}_{width}": n for (group, width), n in sorted(self.bytes.items())}

    def __enter__(self) -> "AllGatherBytes":
        from megatron.core import parallel_state

        self._named = {
            "tp": _ranks(parallel_state.get_tensor_model_parallel_group()),
            "dp": _ranks(parallel_state.get_data_parallel_group()),
        }
        reals = {name: getattr(dist, name) for name in ENTRY_POINTS}
        wrappers = {id(real): self._counting(real, name) for name, real in reals.items()}
        owners = [dist] + [m for n, m in list(sys.modules.items()) if m is not None and n.startswith(PACKAGES)]
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                if any(value is real for real in reals.values()):
                    self._patched.append((owner, attr, value))
                    setattr(owner, attr, wrappers[id(value)])
        from coat_megatron.layers import chunk_exchange

        self._patched.append((chunk_exchange, "RingAllGather", chunk_exchange.RingAllGather))
        chunk_exchange.RingAllGather = self._counting_ring(chunk_exchange.RingAllGather)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, real in reversed(self._patched):
            setattr(owner, attr, real)
        self._patched.clear()

    def _counting(self, real, name: str):
        def gather(*args, **kwargs):
            group = kwargs["group"] if "group" in kwargs else (args[2] if len(args) > 2 else None)
            inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("tensor"))
            where = self._group_name(group)
            if where is not None and isinstance(inp, torch.Tensor):
                width = "fp8" if inp.element_size() == 1 else "wide"
                self.bytes[(where, width)] += inp.numel() * inp.element_size()
            return real(*args, **kwargs)

        gather.__name__ = gather.__qualname__ = f"counting_{name}"
        return gather

    def _counting_ring(self, ring):
        def start(codes, scale, group, scales=None):
            where = self._group_name(group)
            if where is not None:
                for t in [codes] + ([scale] if scales is None else []):
                    self.bytes[(where, "fp8" if t.element_size() == 1 else "wide")] += t.numel() * t.element_size()
            return ring(codes, scale, group, scales=scales)

        return start

    def _group_name(self, group) -> str | None:
        """ "tp", "dp", "other", or None for a group of one rank."""
        key = id(group)
        if key not in self._groups:
            ranks = _ranks(group)
            if len(ranks) <= 1:
                self._groups[key] = None
            else:
                self._groups[key] = next((n for n, r in self._named.items() if r == ranks), "other")
        return self._groups[key]


def _ranks(group) -> tuple[int, ...]:
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def per_step(before: dict[str, int], after: dict[str, int], steps: int) -> dict[str, float]:
    """Bytes per step between two snapshots: {"tp_wide": ..., ...} for every key of either."""
    keys = sorted(set(before) | set(after))
    return {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in keys}


def all_gather_fields(per_step_bytes: dict[str, float], *, graphed_layers: bool = False) -> dict:
    """The row fields of all-gather bytes per step (or per fwd+bwd): ``sp_all_gather_bytes``
    (over the tensor-parallel group: sequence parallel), ``sp_all_gather_fp8_bytes`` (of which
    1-byte elements), ``dp_all_gather_bytes`` (the distributed optimizer's parameter gather) and
    every count (``all_gather_bytes``).

    ``graphed_layers``: the steps replayed CUDA graphs of the transformer layers, whose gathers
    run on the GPU without a Python call, so that only the gathers outside the layers were
    counted (the output layer's input). The sequence-parallel fields are then None (shown as "-")
    rather than a part passed off as the whole; the same mode's eager row has them. The
    distributed optimizer's gather runs outside any graph and stays counted."""
    tp = per_step_bytes.get("tp_wide", 0) + per_step_bytes.get("tp_fp8", 0)
    dp = per_step_bytes.get("dp_wide", 0) + per_step_bytes.get("dp_fp8", 0)
    return {
        "sp_all_gather_bytes": None if graphed_layers else tp,
        "sp_all_gather_fp8_bytes": None if graphed_layers else per_step_bytes.get("tp_fp8", 0),
        "dp_all_gather_bytes": dp,
        "all_gather_bytes": dict(per_step_bytes),
    }
