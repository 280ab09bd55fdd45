"""The bytes this rank contributes to all-gathers, by process group and element width, for tests of
what goes on the wire.

``with all_gather_bytes() as sent:`` replaces torch.distributed's all-gathers, and every alias of
them that Megatron or COAT bound when imported (Megatron's ``dist_all_gather_func``, ...), with
counting wrappers, and COAT's ring all-gather (point-to-point transfers that make up one gather)
with one that counts what this rank passes in. ``sent["tp_fp8"]``: bytes in 1-byte elements (FP8
codes) over the tensor-parallel group; ``"tp_wide"``: in wider ones (BF16, FP32 scales); ``"dp_..."``
over the data-parallel group, ``"other_..."`` over any other. Groups of one rank move nothing and are
not counted. Enter it in every rank, where Megatron's parallel state is set up.
"""

import contextlib
import sys
from collections import Counter

import torch.distributed as dist
from megatron.core import parallel_state

from coat_megatron.layers import chunk_exchange

ENTRY_POINTS = ("all_gather_into_tensor", "_all_gather_base", "all_gather")  # each takes (output, input, group)


def _ranks(group) -> tuple[int, ...]:
    return tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))


@contextlib.contextmanager
def all_gather_bytes():
    sent = Counter()
    names = {_ranks(parallel_state.get_data_parallel_group()): "dp"}
    names[_ranks(parallel_state.get_tensor_model_parallel_group())] = "tp"

    def count(group, tensor) -> None:
        ranks = _ranks(group)
        if len(ranks) > 1:
            width = "fp8" if tensor.element_size() == 1 else "wide"
            sent[f"{names.get(ranks, 'other')}_{width}"] += tensor.numel() * tensor.element_size()

    def counting(real):
        def gather(output, tensor, group=None, *args, **kwargs):
            count(group, tensor)
            return real(output, tensor, group, *args, **kwargs)

        return gather

    ring = chunk_exchange.RingAllGather

    def counting_ring(codes, scale, group, scales=None):
        count(group, codes)
        if scales is None:  # a gather again for the weight gradient sends no scales (kept from the forward)
            count(group, scale)
        return ring(codes, scale, group, scales=scales)

    swaps = [(getattr(dist, name), counting(getattr(dist, name))) for name in ENTRY_POINTS]
    patched = [(chunk_exchange, "RingAllGather", ring)]
    chunk_exchange.RingAllGather = counting_ring
    owners = [dist] + [
        m for n, m in list(sys.modules.items()) if m is not None and n.startswith(("megatron.", "coat_megatron."))
    ]
    for owner in owners:
        for attr, value in list(vars(owner).items()):
            for real, wrapper in swaps:
                if value is real:
                    patched.append((owner, attr, real))
                    setattr(owner, attr, wrapper)
    try:
        yield sent
    finally:
        for owner, attr, real in reversed(patched):
            setattr(owner, attr, real)
