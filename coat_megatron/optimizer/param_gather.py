"""The distributed optimizer's parameter all-gather with COAT's linear weights as FP8 codes.

Megatron's distributed optimizer steps each data-parallel rank's shard of every gradient bucket;
then each bucket group all-gathers the shards of the BF16 parameter buffer, 2 bytes per parameter
(``_ParamAndGradBucketGroup.start_param_sync``, in the step, or overlapped with the next forward
under ``overlap_param_gather``). A COAT linear uses its weight only through per-tensor FP8
quantization (its forward and dgrad GEMMs), so the gather can move the codes instead:
``install_fp8_param_gather`` (``CoatConfig.fp8_param_gather``, ``--coat-fp8-param-gather on``)
replaces ``start_param_sync`` and ``_post_param_sync`` on each bucket group with
``Fp8ParamGather``'s:

1. amax: each rank takes the amax of its part of every COAT linear weight in the group, and one
   all-reduce (MAX) of these few numbers over the data-parallel group gives each weight's amax;
   the scale follows by the rule of every COAT quantizer (``coat_kernels.scaling``).
2. pack: each rank writes its shard as one byte stream: the COAT weights' FP8 codes (1 byte per
   element, in the linear's ``weight_format``) and every other parameter's own bytes (norm
   weights, embeddings, the output layer, biases: 2 per element in BF16), padded to the longest
   rank's.
3. gather: one ``all_gather_into_tensor`` of the streams per bucket, received in the bucket's
   gradient buffer, which holds nothing between the step and the next backward and has at least
   as many bytes per element as a stream needs: no buffer is added.
4. unpack: the other ranks' parts are written into the parameter buffer (codes x scale, rounded to
   BF16), and the gradient buffer's bytes are zeroed again (the backward adds into it).

Steps 1, 2 and 4 are one kernel launch per bucket each (``coat_kernels.segments``, from tables of
the bucket's segments made once), not a few torch operations per parameter shard.

Each rank's own shard stays as the step wrote it: exact, and under split master weights the FP32
master's high half. The other shards hold dequantized codes, and the layers compute the same FP8
weight on every rank: the amax is unchanged (the largest element's code is the format's largest,
times the scale is the amax, in BF16 exactly), so the scale is the same, and a BF16 value within
2^-9 of code x scale quantizes back to that code (tests/megatron/test_fp8_param_gather.py checks
the layers' codes bit for bit). The data-parallel gather then moves 1 byte per COAT weight
element instead of 2, plus 4 bytes per weight for the amax.

Because the replicas differ in BF16 (not in FP8), a checkpoint must not save the dequantized
values as the model's weights: ``gather_exact_params`` gathers the BF16 shards once more, and
``CoatDistributedOptimizer`` runs it before it hands out a state dict. Megatron's
``--check-weight-hash-across-dp-replicas-interval`` would see the replicas differ; it is refused
with this option.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from coat_kernels.formats import fp8_format
from coat_kernels.scaling import scale_from_amax_reference
from coat_kernels.segments import pack_segments, segment_table, segmented_amax, unpack_segments


@dataclass(frozen=True)
class Segment:
    """One parameter's part of one rank's shard of a bucket: elements [start, end) of the bucket,
    packed at byte ``offset`` of that rank's stream, ``nbytes`` long; ``weight`` indexes the
    group's COAT weights (-1: a parameter sent as its own bytes, BF16 or FP32)."""

    start: int
    end: int
    offset: int
    weight: int
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    """Where each rank's stream lies in the bucket's gradient buffer, what it holds, and the
    kernels' tables of this rank's work (``coat_kernels.segments``; weight segments by format, the
    raw ones with the first format's)."""

    stream_bytes: int  # per rank (every rank's stream padded to the longest)
    segments: tuple[tuple[Segment, ...], ...]  # per rank
    amax_table: torch.Tensor  # this rank's weight segments
    pack_tables: dict[str, torch.Tensor]  # format -> this rank's segments, offsets within its stream
    unpack_tables: dict[str, torch.Tensor]  # format -> the other ranks' segments, offsets within all streams


def _plan_bucket(bucket, data_parallel_size: int, rank: int, weight_index: dict, formats: list[str]) -> BucketPlan:
    numel = bucket.param_data.numel()
    if numel % data_parallel_size:
        raise ValueError(
            f"bucket {bucket.bucket_id} ({numel} elements) does not split into {data_parallel_size} shards"
        )
    shard = numel // data_parallel_size
    wide = bucket.param_data.element_size()
    ranges = sorted((s, e, p) for p, (s, e) in ((p, bucket.param_to_index[p]) for p in bucket.params_list))
    per_rank = []
    for r in range(data_parallel_size):
        lo, hi = r * shard, (r + 1) * shard
        offset, segs = 0, []
        for s, e, p in ranges:
            a, b = max(s, lo), min(e, hi)
            if a >= b:
                continue
            weight = weight_index.get(p, -1)
            offset = -(-offset // 16) * 16  # aligned: a raw segment moves as integers of its element size
            seg = Segment(a, b, offset, weight, (b - a) * (1 if weight >= 0 else wide))
            segs.append(seg)
            offset += seg.nbytes
        per_rank.append(tuple(segs))
    longest = max((segs[-1].offset + segs[-1].nbytes for segs in per_rank if segs), default=0)
    stream = -(-longest // 16) * 16
    room = bucket.grad_data.numel() * bucket.grad_data.element_size()
    if stream * data_parallel_size > room:  # never where the gradients are at least as wide as the parameters
        raise ValueError(
            f"bucket {bucket.bucket_id}: the FP8 parameter gather needs {stream * data_parallel_size} bytes of the "
            f"gradient buffer, which has {room}: use BF16 or FP32 gradient buffers"
        )
    device = bucket.param_data.device
    kinds = sorted(set(formats)) or ["e4m3"]

    def tables(pairs) -> dict[str, torch.Tensor]:  # pairs: (base byte offset, segment)
        by_format = {}
        for fmt in kinds:
            rows = [
                (seg.start, base + seg.offset, seg.end - seg.start, seg.weight)
                for base, seg in pairs
                if (seg.weight >= 0 and formats[seg.weight] == fmt) or (seg.weight < 0 and fmt == kinds[0])
            ]
            by_format[fmt] = segment_table(rows, device, element_size=wide)
        return by_format

    mine = [(0, seg) for seg in per_rank[rank]]
    others = [(r * stream, seg) for r in range(data_parallel_size) if r != rank for seg in per_rank[r]]
    amax_rows = [(seg.start, seg.offset, seg.end - seg.start, seg.weight) for seg in per_rank[rank] if seg.weight >= 0]
    return BucketPlan(
        stream, tuple(per_rank), segment_table(amax_rows, device, element_size=wide), tables(mine), tables(others)
    )


class Fp8ParamGather:
    """The FP8 parameter all-gather of one Megatron bucket group (see the module docstring).

    ``weights``: the group's COAT linear weights, each with the FP8 format its layer quantizes it in.
    """

    def __init__(self, bucket_group, weights: dict[torch.nn.Parameter, str]):
        self.group = bucket_group
        self.process_group = bucket_group.intra_distributed_optimizer_instance_group
        self.size = bucket_group.intra_distributed_optimizer_instance_size
        self.rank = bucket_group.intra_distributed_optimizer_instance_rank
        order = [p for b in bucket_group.buckets for p in b.params_list if p in weights]
        self.weight_index = {p: i for i, p in enumerate(order)}
        formats = [weights[p] for p in order]
        self.plans = [_plan_bucket(b, self.size, self.rank, self.weight_index, formats) for b in bucket_group.buckets]
        device = bucket_group.buckets[0].param_data.device if bucket_group.buckets else torch.device("cpu")
        self.fmax = torch.tensor([fp8_format(f).max for f in formats], dtype=torch.float32, device=device)
        self.amax = torch.zeros(len(order), dtype=torch.float32, device=device)
        self.scales: torch.Tensor | None = None
        self.pending = False  # gathered bytes wait in the gradient buffers to be unpacked

    # ------------------------------------------------------------------ Megatron's two entry points

    def start_param_sync(self, force_sync: bool = False) -> None:
        """``_ParamAndGradBucketGroup.start_param_sync`` with FP8 codes on the wire."""
        g = self.group
        overlap = g.ddp_config.overlap_param_gather
        if force_sync and g.param_gather_handle is not None:
            g.param_gather_handle.wait()
            g.param_gather_handle = None
            self.post_param_sync()
            return
        if not force_sync:
            assert g.param_gather_handle is None
        async_op = overlap and not force_sync
        self._pack()
        handles = [
            dist.all_gather_into_tensor(
                self._streams(bucket, plan),
                self._stream(bucket, plan, self.rank),
                group=self.process_group,
                async_op=async_op,
            )
            for bucket, plan in zip(g.buckets, self.plans)
        ]
        self.pending = True
        g.param_gather_handle = _Handles(handles) if async_op else None
        if force_sync and overlap:
            self.post_param_sync()
        g.param_gather_dispatched = True

    def post_param_sync(self) -> None:
        """``_ParamAndGradBucketGroup._post_param_sync``: unpack what the gather brought."""
        if not self.pending:
            return
        self.pending = False
        with torch.no_grad():
            for bucket, plan in zip(self.group.buckets, self.plans):
                streams = self._streams(bucket, plan)
                for fmt, table in plan.unpack_tables.items():
                    unpack_segments(streams, table, self.scales, fmt, bucket.param_data)
                streams.zero_()

    # ------------------------------------------------------------------ the parts

    def _streams(self, bucket, plan: BucketPlan) -> torch.Tensor:
        return bucket.grad_data.view(-1).view(torch.uint8)[: plan.stream_bytes * self.size]

    def _stream(self, bucket, plan: BucketPlan, rank: int) -> torch.Tensor:
        return self._streams(bucket, plan)[rank * plan.stream_bytes : (rank + 1) * plan.stream_bytes]

    @torch.no_grad()
    def _pack(self) -> None:
        """Scales of the group's weights (one amax all-reduce), then this rank's stream of each bucket."""
        amax = self.amax.zero_()
        for bucket, plan in zip(self.group.buckets, self.plans):
            segmented_amax(bucket.param_data, plan.amax_table, amax.numel(), out=amax)
        if amax.numel():
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.process_group)
        self.scales = scale_from_amax_reference(amax, self.fmax)
        inverse = 1.0 / self.scales
        for bucket, plan in zip(self.group.buckets, self.plans):
            stream = self._stream(bucket, plan, self.rank)
            for fmt, table in plan.pack_tables.items():
                pack_segments(bucket.param_data, table, inverse, fmt, stream)

    @torch.no_grad()
    def gather_exact(self) -> None:
        """Finish any FP8 gather in flight, then all-gather the BF16 shards (each rank's exact
        values) into the parameter buffer: what a checkpoint saves."""
        g = self.group
        if g.param_gather_handle is not None:
            g.param_gather_handle.wait()
            g.param_gather_handle = None
        self.post_param_sync()
        for bucket in g.buckets:
            shard = bucket.param_data.numel() // self.size
            dist.all_gather_into_tensor(
                bucket.param_data,
                bucket.param_data[self.rank * shard : (self.rank + 1) * shard],
                group=self.process_group,
            )


class _Handles:
    """The handles of one group's gathers, waited on together (Megatron keeps one per group)."""

    def __init__(self, handles):
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            if h is not None:
                h.wait()
        self.handles = []


def coat_weights(model_chunks) -> dict[torch.nn.Parameter, str]:
    """The weights of the COAT linears in ``model_chunks`` (tagged ``coat_fp8_format`` by the
    layers), each with the FP8 format its layer quantizes it in: the parameters that may cross
    the data-parallel gather as FP8 codes."""
    return {
        p: p.coat_fp8_format
        for chunk in model_chunks
        for p in chunk.parameters()
        if getattr(p, "coat_fp8_format", None) is not None
    }


def install_fp8_param_gather(model_chunks) -> list[Fp8ParamGather]:
    """Replace the parameter all-gather of every bucket group of ``model_chunks`` (Megatron DDP
    with the distributed optimizer) by ``Fp8ParamGather``'s. Returns the installed gathers."""
    weights = coat_weights(model_chunks)
    if not weights:
        raise ValueError(
            "fp8_param_gather sends COAT linears' weights as FP8 codes, and the model has no COAT linear: build it "
            "with the COAT layer spec (CoatConfig(activations=True)), or turn fp8_param_gather off"
        )
    installed = []
    for chunk in model_chunks:
        ddp = chunk.ddp_config
        if not ddp.use_distributed_optimizer:
            raise ValueError(
                "fp8_param_gather replaces the distributed optimizer's gather: set use_distributed_optimizer"
            )
        if getattr(ddp, "num_distributed_optimizer_instances", 1) > 1:
            raise ValueError(
                "fp8_param_gather supports one distributed optimizer instance (num_distributed_optimizer_instances=1)"
            )
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            if getattr(group, "coat_fp8_param_gather", None) is not None:
                installed.append(group.coat_fp8_param_gather)
                continue
            if group.intra_distributed_optimizer_instance_size == 1:
                continue  # nothing to gather
            gather = Fp8ParamGather(group, weights)
            group.start_param_sync = gather.start_param_sync
            group._post_param_sync = gather.post_param_sync
            group.coat_fp8_param_gather = gather
            installed.append(gather)
    return installed


def gather_exact_params(model_chunks) -> None:
    """Give every replica each rank's exact BF16 shard again (after FP8 gathers): before a
    checkpoint saves the model's weights. A collective over each data-parallel group."""
    for chunk in model_chunks:
        for group in getattr(chunk, "bucket_groups", []) + getattr(chunk, "expert_parallel_bucket_groups", []):
            gather = getattr(group, "coat_fp8_param_gather", None)
            if gather is not None:
                gather.gather_exact()
