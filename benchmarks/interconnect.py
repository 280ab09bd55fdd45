"""How fast this host moves the bytes that tensor and data parallelism send: NCCL all-gather,
reduce-scatter and a ring of point-to-point transfers (what COAT's sequence-parallel exchange
uses), at the message sizes a Llama-2-7B layer sends under sequence parallelism.

    torchrun --nproc-per-node 4 benchmarks/interconnect.py [--out DIR]

For each group size (2 and, where there are four ranks, 4) and each per-rank chunk size: the
median time over repeats (CUDA events, after warm-up) and the bus bandwidth, NCCL-tests' measure:
an all-gather or reduce-scatter of n chunks of S bytes moves (n - 1) x S bytes through each rank's
link, so bus bandwidth = (n - 1) x S / time. The ring step sends one chunk to the next rank and
receives one from the previous (``batch_isend_irecv``): S / time. The chunk sizes are one rank's
slice of seq 2048 x micro-batch x hidden 4096 at TP 2: micro-batch 1 in FP8 (4 MiB) and BF16
(8 MiB), micro-batch 4 in FP8 (16 MiB) and BF16 (32 MiB), and a 256 MiB bucket of DP gradients.
Rank 0 prints a markdown table (and writes interconnect.md to --out).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

MIB = 2**20
SIZES_MIB = (4, 8, 16, 32, 256)


def timed(fn, repeats: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` (CUDA events), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(group, size: int) -> dict[str, float]:
    """ms of an all-gather, a reduce-scatter and a ring step with per-rank chunks of ``size`` bytes."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    chunk = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    gathered = torch.empty(n * size, dtype=torch.uint8, device="cuda")
    wide = torch.randn(n * size // 2, dtype=torch.bfloat16, device="cuda")  # n chunks of `size` bytes
    scattered = torch.empty(size // 2, dtype=torch.bfloat16, device="cuda")
    received = torch.empty_like(chunk)
    after, before = ranks[(rank + 1) % n], ranks[(rank - 1) % n]

    def ring():
        ops = [dist.P2POp(dist.isend, chunk, after, group), dist.P2POp(dist.irecv, received, before, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {
        "all_gather": timed(lambda: dist.all_gather_into_tensor(gathered, chunk, group=group)),
        "reduce_scatter": timed(lambda: dist.reduce_scatter_tensor(scattered, wide, group=group)),
        "ring_step": timed(ring),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    lines = [
        f"# Interconnect: {world} x {torch.cuda.get_device_name()}",
        "",
        "| group | chunk per rank MiB | all-gather ms | bus GB/s | reduce-scatter ms | bus GB/s | ring step ms | GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in (2, 4):
        if n > world:
            continue
        # every rank joins every new_group call; the ranks [0, n) measure, the rest wait
        group = dist.new_group(list(range(n)))
        for size_mib in SIZES_MIB:
            size = size_mib * MIB
            if rank < n:
                t = measure(group, size)
                if rank == 0:
                    bus = (n - 1) * size / 1e9
                    lines.append(
                        f"| {n} GPUs | {size_mib} | {t['all_gather']:.3f} | {bus / (t['all_gather'] / 1e3):.0f} | "
                        f"{t['reduce_scatter']:.3f} | {bus / (t['reduce_scatter'] / 1e3):.0f} | "
                        f"{t['ring_step']:.3f} | {size / 1e9 / (t['ring_step'] / 1e3):.0f} |"
                    )
            dist.barrier()
    if rank == 0:
        text = "\n".join(lines) + "\n"
        print(text)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "interconnect.md"), "w") as f:
            f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
