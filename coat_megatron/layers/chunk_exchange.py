"""The sequence chunks that tensor-parallel ranks pass each other under sequence parallelism, one at a time.

Under sequence parallelism each of the n ranks of a tensor-parallel group holds one chunk of the
sequence: rows [j * R_c, (j + 1) * R_c) of an (R, N) activation are rank j's (R = n * R_c; the
sequence is the first dimension, so a chunk is a contiguous block of rows). A linear never needs
the whole gathered tensor at once: a GEMM can run on the chunk in hand while the next one travels.
Two exchanges serve COAT's sequence-parallel linears (``sequence_parallel``):

* all-gather (``all_gather_chunks``): every rank receives every rank's chunk of FP8 codes, each
  with the 0-d FP32 scale its producer quantized it with. ``take()`` hands them out one at a
  time, this rank's own first: chunks r, r - 1, r - 2, ... (mod n).
* reduce-scatter (``reduce_scatter_chunks``): every rank computes a partial sum of every chunk;
  rank r ends with chunk r summed over the ranks. ``partial()`` says which chunk to compute next
  and where to write it, in the order r - 1, r - 2, ..., r (mod n); ``reduce()`` passes it on.

With ``overlap`` (``CoatConfig.tp_comm_overlap``; off by default) both are rings of point-to-point
transfers (``torch.distributed.batch_isend_irecv``; rank r sends to r + 1 and receives from
r - 1), n - 1 steps each. A step is posted as soon as its chunk is ready and waited for only when
the next chunk is needed, so the caller's GEMM on the chunk in hand runs while it travels. Over
NCCL the transfers run on NCCL's own stream and a wait makes the current stream wait for them: the
host never waits for the device, and every rank posts the same transfers in the same order, so
the exchanges can be captured in a CUDA graph. Codes travel as uint8 views (gloo rejects float8
dtypes; NCCL takes either).

Without ``overlap`` (the default): one all-gather before the first chunk is handed out, of the
codes with each rank's scale packed behind them in the same message (one collective instead of
two), one reduce-scatter after the last partial is written. COAT's producers of gathered tensors
(the norms under SP, the row-parallel backward's dY) write their codes and scale in that layout in
the first place, so the message goes out without a copy. The chunks are the same and come in the
same order, so the arithmetic is the same; only a reduce-scatter over more than two ranks may add
its partials in another order (a different rounding of the sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coat_kernels import workspace
from coat_kernels.per_tensor import SCALE_ROW_BYTES, packed_message

SCALE_ROW = SCALE_ROW_BYTES // 4  # FP32 words per gathered scale: 16 bytes


def _rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _ring_step(sends: list[torch.Tensor], recvs: list[torch.Tensor], group, rank: int, size: int) -> list:
    """Post one ring step: ``sends`` to rank + 1, ``recvs`` from rank - 1 (group ranks); the works to wait on."""
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % size) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(rank - 1) % size) for t in recvs]
    return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class RingAllGather:
    """The ring all-gather of (R_c, N) FP8 codes with their 0-d FP32 scales (see the module docstring).

    ``scales``: every rank's scale, indexed by rank, when the receiver knows them already (a
    gather made again in backward): then only codes travel. Otherwise each chunk's scale travels
    with it (4 bytes).
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor | None, group, scales=None):
        self.rank, self.size = _rank_and_size(group)
        self.group = group
        self.scales = scales
        self.held = (self.rank, codes, scale if scales is None else scales[self.rank])
        self.taken_scales: list = [None] * self.size
        self.step = 0
        self.pending: list = []
        self.arriving = None
        self._pass_on()  # the first transfer starts now, before the caller's first GEMM

    def __len__(self) -> int:
        return self.size

    def _pass_on(self) -> None:
        """Post the ring step that sends the chunk held to rank + 1 and receives the next from rank - 1."""
        if self.step >= self.size - 1:
            return
        j, codes, scale = self.held
        source = (j - 1) % self.size
        incoming = torch.empty_like(codes)
        sends, recvs = [codes.view(torch.uint8)], [incoming.view(torch.uint8)]
        if self.scales is None:
            incoming_scale = torch.empty(1, dtype=torch.float32, device=codes.device)
            sends.append(scale.reshape(1))
            recvs.append(incoming_scale)
            self.arriving = (source, incoming, incoming_scale.view(()))
        else:
            self.arriving = (source, incoming, self.scales[source])
        self.pending = _ring_step(sends, recvs, self.group, self.rank, self.size)

    def take(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(j, codes of chunk j, its scale), chunks r, r - 1, ... in turn. Each call after the first
        waits for the chunk it returns and posts the transfer that passes it on and brings the next."""
        if self.step >= self.size:
            raise RuntimeError(f"all {self.size} chunks were taken already")
        if self.step > 0:
            _wait(self.pending)
            self.held, self.arriving = self.arriving, None
            self._pass_on()
        self.step += 1
        self.taken_scales[self.held[0]] = self.held[2]
        return self.held

    def scale_vector(self) -> torch.Tensor:
        """(n,) FP32, every chunk's scale by rank (after every chunk was taken), each 16-byte aligned
        (stride ``SCALE_ROW``, as cuBLASLt takes a scale pointer): one small copy."""
        rows = [s.reshape(1, 1).expand(1, SCALE_ROW) for s in self.taken_scales]
        return torch.cat(rows)[:, 0]


class CollectiveAllGather:
    """The same chunks, in the same order, from one blocking all-gather (``overlap`` off). Where the
    scales travel too, each rank sends one message: its codes, then its scale in a 16-byte row (so
    that every gathered chunk and every scale starts at a 16-byte aligned address: cuBLASLt takes
    a scale pointer only there, status 15 otherwise). A producer that wrote its codes and scale
    packed that way (``coat_kernels.per_tensor.packed_message``) has its buffer sent as it is;
    otherwise they are copied into one.

    The scales handed out are views into the gathered message, alive as long as any is; with
    ``keep_scales`` they are copied out instead (one small copy), for a caller that keeps them
    (for its backward) without keeping the gathered codes. ``scratch``: the gathered message in the
    reused buffer of that name (``coat_kernels.workspace``), for a caller done with the chunks (and,
    without ``keep_scales``, the scales) before it returns."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor | None, group, scales=None, keep_scales=False, scratch=None
    ):
        self.rank, self.size = _rank_and_size(group)
        codes = codes.contiguous()
        n = codes.numel()
        message = packed_message(codes, scale) if scales is None else None
        if message is None and scales is None and n % 16 == 0:
            message = torch.empty(n + 4 * SCALE_ROW, dtype=torch.uint8, device=codes.device)
            message[:n].copy_(codes.view(-1).view(torch.uint8))
            message[n : n + 4].view(torch.float32).copy_(scale.reshape(1))
        if message is not None:
            gathered = workspace.empty(self.size * message.numel(), torch.uint8, codes.device, scratch)
            dist.all_gather_into_tensor(gathered, message, group=group)
            gathered = gathered.view(self.size, message.numel())
            self._codes = gathered[:, :n].view(codes.dtype).view(self.size, *codes.shape)
            self.chunks = list(self._codes.unbind())
            scales = gathered[:, n:].view(torch.float32)
            self._scale_rows = scales.clone() if keep_scales else scales
            self.scales = list(self._scale_rows[:, 0].unbind())
            self.step = 0
            return
        gathered = torch.empty((self.size * codes.shape[0], *codes.shape[1:]), dtype=codes.dtype, device=codes.device)
        dist.all_gather_into_tensor(gathered.view(torch.uint8), codes.view(torch.uint8), group=group)
        if scales is None:  # codes of a size that would misalign the packed scales (not a layer's shape)
            gathered_scales = torch.empty((self.size, SCALE_ROW), dtype=torch.float32, device=codes.device)
            dist.all_gather_into_tensor(
                gathered_scales, scale.reshape(1, 1).expand(1, SCALE_ROW).contiguous(), group=group
            )
            scales = [row[0] for row in gathered_scales]
        self._scale_rows = None
        self._codes = gathered.view(self.size, *codes.shape)
        self.chunks, self.scales = list(self._codes.unbind()), scales
        self.step = 0

    def __len__(self) -> int:
        return self.size

    def take(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        if self.step >= self.size:
            raise RuntimeError(f"all {self.size} chunks were taken already")
        j = (self.rank - self.step) % self.size
        self.step += 1
        return j, self.chunks[j], self.scales[j]

    def chunk_codes(self) -> torch.Tensor:
        """(n, R_c, N): every chunk's codes by rank, where they were gathered (a view; between the
        chunks lie their scale rows where the scales travelled with them)."""
        return self._codes

    def scale_vector(self) -> torch.Tensor:
        """(n,) FP32, every chunk's scale by rank, each 16-byte aligned (as cuBLASLt takes a scale
        pointer; a strided vector): a view of the gathered scale rows (with ``keep_scales``, of their
        copy), or where the scales did not travel, a small copy of those given."""
        if self._scale_rows is not None:
            return self._scale_rows[:, 0]
        return torch.cat([s.reshape(1, 1).expand(1, SCALE_ROW) for s in self.scales])[:, 0]


def all_gather_chunks(
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    group,
    *,
    overlap: bool,
    scales=None,
    keep_scales: bool = False,
    scratch: str | None = None,
):
    """Start gathering every rank's (R_c, N) FP8 ``codes`` (contiguous) and 0-d FP32 ``scale`` (or,
    with ``scales`` given, the codes only); ``take()`` hands out the chunks, this rank's first.
    ``keep_scales``: the scales handed out may be kept without keeping the gathered codes alive.
    ``scratch``: without the ring, gathered into the reused buffer of that name (``CollectiveAllGather``)."""
    if overlap:  # each scale travels in a buffer of its own
        return RingAllGather(codes, scale, group, scales=scales)
    return CollectiveAllGather(codes, scale, group, scales=scales, keep_scales=keep_scales, scratch=scratch)


class RingReduceScatter:
    """The ring reduce-scatter of (R_c, N) partial sums (see the module docstring)."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device, group):
        self.rank, self.size = _rank_and_size(group)
        self.group, self.shape, self.dtype, self.device = group, shape, dtype, device
        self.step = 0
        self.pending: list = []
        self.incoming = None
        self.sum = None

    def __len__(self) -> int:
        return self.size

    def all_partials(self) -> None:
        """None: the ring passes each partial sum on as soon as it is written (see ``partial``)."""
        return None

    def partial(self) -> tuple[int, torch.Tensor]:
        """(c, buffer): the chunk whose partial sum this rank computes next, and where to write it."""
        if self.step >= self.size:
            raise RuntimeError(f"all {self.size} partial sums were made already")
        return (self.rank - self.step - 1) % self.size, torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def reduce(self, part: torch.Tensor) -> None:
        """``part`` (the last ``partial()`` buffer) is written: add the partial sums that arrived for its
        chunk and send the total on. Waits only for that arrival."""
        if self.step > 0:
            _wait(self.pending)
            part.add_(self.incoming)
            self.incoming = None
        if self.step < self.size - 1:
            self.incoming = torch.empty_like(part)
            self.pending = _ring_step([part], [self.incoming], self.group, self.rank, self.size)
        self.sum = part
        self.step += 1

    def result(self) -> torch.Tensor:
        """(R_c, N): this rank's chunk summed over the ranks (after the last ``reduce()``)."""
        if self.step != self.size:
            raise RuntimeError(f"{self.step} of {self.size} partial sums were reduced; reduce them all first")
        return self.sum


class CollectiveReduceScatter:
    """The same partial sums, in the same order, into one buffer reduce-scattered at the end (``overlap`` off);
    ``scratch``: that buffer reused from call to call (``coat_kernels.workspace``; the reduce-scatter blocks the
    compute stream until it has read it)."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device, group, scratch: str | None = None):
        self.rank, self.size = _rank_and_size(group)
        self.group = group
        self.shape = shape
        self.partials = workspace.empty((self.size * shape[0], *shape[1:]), dtype, device, scratch)
        self.step = 0

    def __len__(self) -> int:
        return self.size

    def all_partials(self) -> torch.Tensor:
        """The (n * R_c, N) buffer of every chunk's partial sum in chunk order, for a caller that
        writes them all at once (one GEMM over every row), in place of ``partial``/``reduce``."""
        if self.step:
            raise RuntimeError(f"{self.step} partial sums were made one by one already")
        self.step = self.size
        return self.partials

    def partial(self) -> tuple[int, torch.Tensor]:
        if self.step >= self.size:
            raise RuntimeError(f"all {self.size} partial sums were made already")
        c = (self.rank - self.step - 1) % self.size
        return c, self.partials[c * self.shape[0] : (c + 1) * self.shape[0]]

    def reduce(self, part: torch.Tensor) -> None:
        self.step += 1

    def result(self) -> torch.Tensor:
        if self.step != self.size:
            raise RuntimeError(f"{self.step} of {self.size} partial sums were reduced; reduce them all first")
        out = torch.empty(self.shape, dtype=self.partials.dtype, device=self.partials.device)
        dist.reduce_scatter_tensor(out, self.partials, group=self.group)
        return out


def reduce_scatter_chunks(
    shape: tuple[int, int], dtype: torch.dtype, device, group, *, overlap: bool, scratch: str | None = None
):
    """Start a reduce-scatter of ``shape`` = (R_c, N) chunks of ``dtype``: ``partial()`` / ``reduce()``
    once per rank of ``group``, then ``result()``; ``scratch``: without the ring, the partial sums in the
    reused buffer of that name (``CollectiveReduceScatter``)."""
    if overlap:
        return RingReduceScatter(shape, dtype, device, group)
    return CollectiveReduceScatter(shape, dtype, device, group, scratch=scratch)
