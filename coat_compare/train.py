"""A GPT trained end to end with one mode: loss per step, validation loss, step time, tokens/s and memory.

Reads like the training loop it is: build the model and optimizer, then per step take the next
batch of the data order every mode takes (``TrainingWindows`` over the preset's corpus: byte
tokens, each window of text at most once, in an order drawn from the data seed), run Megatron's
forward-backward schedule, step the optimizer; every ``preset.eval_every`` steps and after the
last, the mean per-token loss on the corpus's held-out validation windows (the same ones for
every mode, seed and data order; forward only, ``model.eval()``, outside the step timing). The
first ``preset.warmup_steps`` steps (allocation of optimizer states, FP8 scale start-up,
autotuning) are left out of the timing, activation and communication statistics.

Each step takes a global batch of ``preset.global_batch_for(dp)`` windows (drawn whole by every
rank, so the data does not depend on the DP size): each DP rank takes its contiguous slice and runs
it as ``preset.micro_batches(dp)`` micro-batches through Megatron's schedule, which sums their
gradients into DDP's buffers before the one optimizer step (gradient accumulation). Under
``torchrun`` every rank trains its shard (``tp``); validation batches are sliced likewise. Memory is measured on every rank: the row has rank
0's parts, the fullest GPU's peak and every rank's peak and optimizer bytes. All-gather bytes per
step (``comm``) are rank 0's.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from . import parallel
from .build import WEIGHT_DECAY, build_gpt, cuda_graph_impl, fused_wgrad_linears, unwrap_optimizers
from .checkpoint import load_checkpoint, save_checkpoint
from .comm import AllGatherBytes, all_gather_fields, per_step
from .corpus import TrainingWindows, load_corpus, training_windows, validation_set
from .flops import utilisation
from .memory import MIB, SavedTensors, static_parts
from .modes import Mode
from .presets import Preset

LR_WARMUP_FRACTION = 0.1
# ... but never fewer than the preset's lr_warmup_min_steps, and with no cap at a fraction of a short
# run. Every mode, BF16 included, starts with a loss spike past ln(vocab) when Adam's first,
# sign-like updates come at a high rate after a few steps; the harness's initialisation is Megatron's
# default (N(0, 0.02) embedding and output layer, output projections scaled by 1/sqrt(2 layers)),
# and a longer warm-up lowers the spike without removing it (benchmarks/results/warmup-spike-1gpu).


def lr_warmup_steps(preset: Preset) -> int:
    """``preset.lr_warmup_steps`` where given, else 10% of the steps, at least
    ``preset.lr_warmup_min_steps`` (also where that is more than the run)."""
    if preset.lr_warmup_steps is not None:
        return preset.lr_warmup_steps
    return max(1, int(LR_WARMUP_FRACTION * preset.steps), preset.lr_warmup_min_steps)


LR_DECAYS = ("constant", "cosine", "linear", "wsd")


def learning_rate(preset: Preset, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of a ``preset.steps``-step run: a
    linear warm-up over ``lr_warmup_steps`` steps to ``preset.lr``, then ``preset.lr_decay``:
    constant, or cosine / linear down to ``lr_min_ratio`` x the peak at the last step (Megatron's
    OptimizerParamScheduler, whose decay also starts where the warm-up ends), or "wsd"
    (warm-up, stable, decay): the peak until the last ``lr_cooldown_steps`` steps, then linear down
    to ``lr_min_ratio`` x the peak at the last step. Under "wsd" the rate before the cool-down does
    not depend on ``preset.steps``, so a shorter run loaded from a longer one's checkpoint is a
    cool-down branch of the same trunk."""
    if preset.lr_decay not in LR_DECAYS:
        raise ValueError(f"lr_decay {preset.lr_decay!r}: use one of {', '.join(LR_DECAYS)}")
    warmup = lr_warmup_steps(preset)
    if step + 1 <= warmup or preset.lr_decay == "constant":
        return preset.lr * min(1.0, (step + 1) / warmup)
    floor = preset.lr * preset.lr_min_ratio
    if preset.lr_decay == "wsd":
        cooldown = preset.lr_cooldown_steps
        if cooldown is None or not 0 < cooldown <= preset.steps - warmup:
            raise ValueError(
                f"lr_decay wsd needs a cool-down of 1 to {preset.steps - warmup} steps after the {warmup}-step warm-up "
                f"(--lr-cooldown-steps), not {cooldown}"
            )
        progress = max(0.0, (step + 1 - (preset.steps - cooldown)) / cooldown)
        return preset.lr - (preset.lr - floor) * min(1.0, progress)
    progress = min(1.0, (step + 1 - warmup) / max(1, preset.steps - warmup))
    if preset.lr_decay == "cosine":
        return floor + (preset.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return preset.lr - (preset.lr - floor) * progress


def set_learning_rate(optimizer, preset: Preset, step: int) -> None:
    """``learning_rate(preset, step)`` into every group, and each group's weight decay as
    Megatron's scheduler sets it (``WEIGHT_DECAY`` x the group's ``wd_mult``: 0 for biases and
    norm weights), which the groups do not hold until a scheduler writes it."""
    lr = learning_rate(preset, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["weight_decay"] = WEIGHT_DECAY * group.get("wd_mult", 1.0)


@dataclass(frozen=True)
class TrainOptions:
    """How ``train`` runs (its keyword arguments).

    ``data_seed``: the order of the training windows (default: ``train``'s ``seed``).

    ``graphs``: "none" (eager), "local" (Megatron's per-layer CUDA graphs, captured at the end of
    the first step; under pipeline parallelism its TE-based ones, before the second: ``te_graphs``)
    or "full" (the forward+backward of a whole step in one graph, captured at the second step);
    either way before the timed steps. Validation runs eagerly either way
    (``validation_loss``).

    ``tp``, ``pp`` (with ``vpp`` virtual stages each), ``dp``: the layout, set up by
    ``parallel.initialize``; the loss is the last stage's, reduced to every rank.
    ``gc_mode``: "manual" (a collection every ``parallel.GC_INTERVAL`` steps, none in between)
    or "auto" (Python's). ``overlap_grad_reduce`` / ``overlap_param_gather``: Megatron's DDP
    options (``build.build_gpt``). ``step_timeout``: a step (or validation) that takes longer
    dumps every thread's stack and ends the process (``parallel.step_watchdog``), so that a stalled
    collective fails its run instead of hanging the job.

    ``save``: write a dist checkpoint (``checkpoint_format``) into this directory after ``save_step``
    steps (and go on, unless ``stop_after_save``: then the run ends there, and a later ``load``
    trains the rest of ``preset.steps`` on the same schedule).
    ``save_steps``: instead, a checkpoint into ``save``/stepN after each of these steps (the weights
    of one run at several points, to measure from).
    ``load``: start from the checkpoint in this directory, at the step it was written after: the
    learning rate and the batches continue from there, so a resumed run sees what the
    uninterrupted one saw.
    """

    data_seed: int | None = None
    tp: int = 1
    dp: int = 1
    save: str | None = None
    save_step: int | None = None
    save_steps: tuple[int, ...] = ()
    stop_after_save: bool = False
    load: str | None = None
    graphs: str = "none"
    pp: int = 1
    vpp: int = 1
    gc_mode: str = "manual"
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    step_timeout: float | None = None
    checkpoint_format: str = "dp_reshardable"
    deterministic: bool = False


def train(preset: Preset, mode: Mode, seed: int, *, progress=None, **options) -> dict:
    """Train ``mode`` up to step ``preset.steps``; returns the measurements (see ``coat_compare``).

    ``seed``: the initial weights; ``progress``: a ``Progress`` the loop updates after each step;
    ``options``: ``TrainOptions``' fields (the layout, CUDA graphs, checkpoints, ...).
    """
    o = TrainOptions(**options)
    data_seed = seed if o.data_seed is None else o.data_seed
    micro_batches = preset.micro_batches(o.dp)
    corpus = load_corpus(preset.corpus, preset.corpus_max_bytes)
    data = training_windows(preset, data_seed, o.dp, corpus)
    validation, validation_sha256 = validation_set(preset, corpus, o.dp) if preset.eval_every else (None, None)
    impl, eager_why = cuda_graph_impl(o.graphs, o.pp)
    if eager_why and parallel.is_main_rank():
        print(f"coat-compare: {eager_why}", file=sys.stderr, flush=True)
    chunks, optimizer = build_gpt(preset, mode, seed, o.tp, graphs=o.graphs, pp=o.pp, vpp=o.vpp, deterministic=o.deterministic,
                                  overlap_grad_reduce=o.overlap_grad_reduce, overlap_param_gather=o.overlap_param_gather)  # fmt: skip
    if o.save is not None:
        os.makedirs(o.save, exist_ok=True)
    first = first_step(preset, chunks, optimizer, o)
    log = train_steps(chunks, optimizer, data, validation, preset, first, micro_batches, o, progress)
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    return {
        "micro_batch": preset.micro_batch,
        "global_batch": preset.global_batch_for(o.dp),
        "micro_batches": micro_batches,
        "seq": preset.seq,
        "graphs": o.graphs,
        "cuda_graph_impl": impl,  # Megatron's implementation of them (under PP: TE's, or none: cuda_graph_note)
        **({"cuda_graph_note": eager_why} if eager_why else {}),
        "gc": o.gc_mode,
        "steps": preset.steps,
        "first_step": first,
        "last_step": first + len(log.losses),  # steps trained: below ``steps`` where the run stopped at its --save
        "tp": o.tp,
        "pp": o.pp,
        "vpp": o.vpp,
        "dp": o.dp,
        "overlap_grad_reduce": o.overlap_grad_reduce,
        "overlap_param_gather": o.overlap_param_gather,
        "params": params,  # of this rank's tensor-parallel shard of its pipeline stage
        "linear_params": sum(
            m.weight.numel() for chunk in chunks for m in chunk.modules() if hasattr(m, "weight_cache")
        ),  # those with FP8 copies
        **speed_fields(preset, log, o),
        **memory_fields(chunks, optimizer, log, params, o),
        **all_gather_fields(
            {k: v / len(log.step_ms) for k, v in log.gathered.items()}, graphed_layers=o.graphs != "none"
        ),
        "vocab": preset.vocab,
        "lr": preset.lr,
        "lr_warmup_steps": lr_warmup_steps(preset),
        "lr_decay": preset.lr_decay,
        "lr_min_ratio": preset.lr_min_ratio,
        "lr_cooldown_steps": preset.lr_cooldown_steps,
        "adam_eps": preset.adam_eps,
        "wgrad_fused_linears": [sum(c) for c in zip(*map(fused_wgrad_linears, chunks))],  # [in-GEMM, linears]
        "losses": log.losses,
        "data_seed": data_seed,
        "data_pool": preset.data_pool,
        **corpus.identity(),
        "eval_every": preset.eval_every,
        "eval_windows": len(validation) * preset.micro_batch * o.dp if validation else 0,
        "valid_windows_sha256": validation_sha256,
        "valid_losses": log.valid_losses,  # [step, loss] after that many steps
        "valid_loss": log.valid_losses[-1][1] if log.valid_losses else None,
        "skipped_steps": log.skipped,
        "memory_source": "cuda-allocator" if parallel.device().type == "cuda" else "saved-tensors",
    }


def first_step(preset: Preset, chunks: list, optimizer, o: TrainOptions) -> int:
    """The step training starts at: 0, or the one the checkpoint ``o.load`` was written after
    (loaded into ``chunks`` and ``optimizer``); raises where no step would be left to time."""
    first = 0
    if o.load is not None:
        first = load_checkpoint(o.load, chunks, optimizer, sharding_type=o.checkpoint_format)
        if first is None:
            raise ValueError(f"the checkpoint in {o.load} has no step: write it with coat-compare --save")
    if preset.steps - first <= preset.warmup_steps:
        raise ValueError(
            f"--steps {preset.steps} leaves nothing to measure after step {first} and {preset.warmup_steps} warm-up steps; "
            f"use --steps {first + preset.warmup_steps + 1} or more"
        )
    return first


def speed_fields(preset: Preset, log: StepLog, o: TrainOptions) -> dict:
    """The report's time fields: the median step time of the timed steps, tokens/s (per GPU too),
    model FLOP/s and MFU (``flops.utilisation``)."""
    median_ms = statistics.median(log.step_ms)
    tokens_per_s = preset.global_batch_for(o.dp) * preset.seq / (median_ms / 1e3)
    gpus = o.tp * o.pp * o.dp
    return {
        "step_ms": median_ms,
        "step_ms_per_step": log.step_ms,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / gpus,
        **utilisation(preset, tokens_per_s / gpus, parallel.device_name()),
    }


@dataclass
class StepLog:
    """What ``train_steps`` measured: per step the loss (every step) and time (the timed steps), the
    validation losses, all-gather bytes; and the memory readings the report derives its parts from."""

    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # the steps after the warm-up
    skipped: int = 0  # steps the optimizer skipped (non-finite gradients)
    valid_losses: list[list] = field(default_factory=list)  # [step, loss]
    gathered: Counter = field(default_factory=Counter)  # all-gather bytes over the timed steps
    activations: int | None = None  # CPU: the bytes the first timed step saved for backward
    static: int | None = None  # CUDA: allocated at the start of the first timed step
    warmup_peak: int | None = None  # CUDA: peak allocated over the warm-up steps
    warmup_reserved: int | None = None  # CUDA: peak reserved over the warm-up steps


def train_steps(
    chunks: list,
    optimizer,
    data: TrainingWindows,
    validation: list[dict] | None,
    preset: Preset,
    first: int,
    micro_batches: int,
    o: TrainOptions,
    progress=None,
) -> StepLog:
    """The training loop from step ``first`` to ``preset.steps``: per step this DP rank's
    ``micro_batches`` micro-batches of the next global batch, the checkpoint due (``o.save_step``), Megatron's
    forward-backward schedule and the optimizer step, timed after the warm-up; validation every
    ``preset.eval_every`` steps and after the last."""
    from megatron.core import parallel_state

    params_of_stage = [p for chunk in chunks for p in chunk.parameters()]
    forward_backward = forward_backward_function(o.graphs)
    device = parallel.device()
    rank = parallel_state.get_data_parallel_rank()

    def micro(batch: dict, count: int) -> list[dict]:
        """This DP rank's contiguous slice of a batch, as ``count`` micro-batches, on its device."""
        per_rank = preset.micro_batch * count
        mine = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
        return [
            {k: v[i * preset.micro_batch : (i + 1) * preset.micro_batch].to(device) for k, v in mine.items()}
            for i in range(count)
        ]

    capture_graphs = te_graphs(chunks, optimizer, preset, micro_batches, o)
    cuda = device.type == "cuda"
    log = StepLog()
    collect = o.gc_mode == "manual"
    with AllGatherBytes() as counter, parallel.manual_gc(collect):
        for step in range(first, preset.steps):
            batches = micro(data.batch(step), micro_batches)
            if o.save is not None and o.save_steps:
                if step in o.save_steps:
                    where = os.path.join(o.save, f"step{step}")
                    os.makedirs(where, exist_ok=True)
                    save_checkpoint(where, chunks, optimizer, step=step, sharding_type=o.checkpoint_format)
            elif o.save is not None and step == o.save_step:
                save_checkpoint(o.save, chunks, optimizer, step=step, sharding_type=o.checkpoint_format)
                if o.stop_after_save:
                    break
            if capture_graphs is not None:
                capture_graphs(step - first)
            set_learning_rate(optimizer, preset, step)
            measure = step == first + preset.warmup_steps
            if measure and cuda:
                torch.cuda.synchronize()
                log.static = torch.cuda.memory_allocated()
                log.warmup_peak = torch.cuda.max_memory_allocated()  # the first steps allocate the optimizer states
                log.warmup_reserved = torch.cuda.max_memory_reserved()
                torch.cuda.reset_peak_memory_stats()
            saved = SavedTensors(exclude=[*params_of_stage, *batches[0].values()]) if measure and not cuda else None
            before = counter.snapshot()
            parallel.synchronize()
            start = time.perf_counter()
            if collect and step > first and (step - first) % parallel.GC_INTERVAL == 0:
                gc.collect()  # inside the step's time, as Megatron's manual collection is in its iteration's
            with parallel.step_watchdog(o.step_timeout):
                loss, ok = train_step(chunks, optimizer, batches, preset, saved, forward_backward)
            parallel.synchronize()
            if step >= first + preset.warmup_steps:
                log.step_ms.append((time.perf_counter() - start) * 1e3)
                log.gathered.update(per_step(before, counter.snapshot(), 1))
            if saved is not None:
                log.activations = saved.bytes
            log.skipped += not ok
            log.losses.append(loss)
            done = step + 1
            if validation is not None and (done % preset.eval_every == 0 or done == preset.steps):
                with parallel.step_watchdog(o.step_timeout):
                    valid = validation_loss(chunks, [micro(b, 1)[0] for b in validation], preset, o.graphs)
                log.valid_losses.append([done, valid])
            if progress is not None:
                progress.update(done, loss=loss, **({"valid": log.valid_losses[-1][1]} if log.valid_losses else {}))
    if progress is not None:
        progress.close()
    return log


def te_graphs(chunks: list, optimizer, preset: Preset, micro_batches: int, o: TrainOptions):
    """Megatron's TE-based per-layer CUDA graphs (``build.cuda_graph_impl``), driven as
    megatron.training's ``train()`` drives them (None for any other ``cuda_graph_impl``): the
    function returned, called with the steps done before each step, captures each layer's graph for
    each micro-batch (in the schedule's order) after ``config.cuda_graph_warmup_steps`` eager steps;
    the layers replay them in training mode. ``parallel.free_memory`` releases them."""
    from megatron.core.num_microbatches_calculator import (
        init_num_microbatches_calculator,
        unset_num_microbatches_calculator,
    )
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    if config.cuda_graph_impl != "transformer_engine":
        return None
    helper = TECudaGraphHelper(chunks, config, preset.seq, preset.micro_batch, optimizers=[optimizer])

    def capture(done: int) -> None:
        if helper.capture_finished() or done != config.cuda_graph_warmup_steps:
            return
        # the helper reads the micro-batches of a step where megatron.training keeps them
        global_batch = preset.micro_batch * micro_batches * o.dp
        init_num_microbatches_calculator(parallel.rank(), None, global_batch, preset.micro_batch, o.dp)
        hooks = chunks if o.overlap_param_gather else []  # the parameter all-gather's hooks: not captured
        for chunk in hooks:
            chunk.disable_forward_pre_hook(param_sync=False)
        try:
            helper.create_cudagraphs()
        finally:
            unset_num_microbatches_calculator()
        for chunk in hooks:
            chunk.enable_forward_pre_hook()
        if hooks:
            helper.cuda_graph_set_manual_hooks()

    return capture


def memory_fields(chunks: list, optimizer, log: StepLog, params: int, o: TrainOptions) -> dict:
    """The report's memory fields: peaks (this rank's, every rank's, each stage's fullest GPU), the
    parts rank 0 holds between steps (in MiB and in bytes per parameter of its shard, ``params``),
    and every rank's optimizer bytes. Measured by the CUDA allocator, or on a CPU as the parts plus
    the tensors the first timed step saved for backward. A collective (``parallel.per_rank``)."""
    from megatron.core import parallel_state

    parts = static_parts(chunks, unwrap_optimizers(optimizer))
    activations = log.activations
    if parallel.device().type == "cuda":
        activations = torch.cuda.max_memory_allocated() - log.static
        parts["other"] = max(0, log.static - sum(parts.values()))  # TE's FP8 weights, workspaces, ...
        peak = max(torch.cuda.max_memory_allocated(), log.warmup_peak)
        # what the allocator held from the GPU: also the private pools of CUDA graphs, whose tensors
        # count as freed once captured (a replay allocates nothing) though their memory stays taken
        reserved = max(torch.cuda.max_memory_reserved(), log.warmup_reserved)
    else:
        peak = sum(parts.values()) + activations
        reserved = None
    budget = {k: v / params for k, v in parts.items()}  # bytes per parameter this GPU holds between steps
    parts["optimizer"] = parts["master_weights"] + parts["states"]
    parts["activations"] = activations
    ranks = parallel.per_rank(
        {
            "peak": peak,
            "optimizer": parts["optimizer"],
            "reserved": reserved or 0,
            "stage": parallel_state.get_pipeline_model_parallel_rank(),
        }
    )
    return {
        "peak_MiB": max(r["peak"] for r in ranks) / MIB,  # the fullest GPU's
        "peak_MiB_per_rank": [r["peak"] / MIB for r in ranks],
        "peak_MiB_per_stage": [
            max(r["peak"] for r in ranks if r["stage"] == stage) / MIB for stage in range(o.pp)
        ],  # the fullest GPU of each pipeline stage
        "peak_reserved_MiB": max(r["reserved"] for r in ranks) / MIB if reserved is not None else None,
        **{f"{k}_MiB": v / MIB for k, v in parts.items()},  # rank 0's
        "optimizer_MiB_per_rank": [r["optimizer"] / MIB for r in ranks],
        "optimizer_bytes_per_param": parts["optimizer"] * o.dp / params,
        "bytes_per_param": budget,  # rank 0's parts between steps, per parameter of its model shard
    }


def forward_backward_function(graphs: str = "none"):
    """Megatron's schedule for this layout (no pipelining, 1F1B, or interleaved 1F1B with virtual
    stages: ``get_forward_backward_func``); for ``graphs="full"`` wrapped in Megatron's whole-step
    CUDA graph (eager at the first step, which allocates what the graph will reuse, captured at
    the second, replayed from then on)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    schedule = get_forward_backward_func()
    if graphs != "full":
        return schedule
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    return FullCudaGraphWrapper(schedule, cuda_graph_warmup_steps=1, use_single_mempool=True)


def train_step(
    chunks: list, optimizer, batches: list[dict], preset: Preset, saved: SavedTensors | None, forward_backward=None
) -> tuple[float, bool]:
    """One optimizer step on this DP rank's micro-batches (their gradients summed in DDP's
    buffers): (the loss per token over the global batch, whether the optimizer took the step)."""

    forward_backward = forward_backward or forward_backward_function()
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if saved is not None:
        saved.__enter__()
    try:
        # FP32, summed in the order a larger micro-batch or DP size would sum it: the reported loss
        # of one global batch does not depend on how it is split
        total = token_loss_totals(forward_backward, chunks, batches, preset, forward_only=False, dtype=torch.float32)
    finally:
        if saved is not None:
            saved.__exit__(None, None, None)
    ok, _, _ = optimizer.step()
    return (total[0] / total[1]).item(), bool(ok)


def token_loss_totals(
    schedule, chunks: list, batches: list[dict], preset: Preset, forward_only: bool, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Megatron's forward(-backward) ``schedule`` over ``batches`` (this DP rank's micro-batches;
    every model chunk reads all of them): the summed token loss and token count, reduced over DP,
    in ``dtype``. Only the last pipeline stage computes the loss; the others contribute zeros to a
    sum over the pipeline group, so every rank returns the same totals."""
    from megatron.core import parallel_state

    outputs = schedule(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
        model=chunks,
        num_microbatches=len(batches),
        seq_length=preset.seq,
        micro_batch_size=preset.micro_batch,
        forward_only=forward_only,
    )
    if outputs:
        total = torch.stack([o["lm loss"] for o in outputs]).to(dtype).sum(0)
    else:  # an earlier pipeline stage
        total = torch.zeros(2, dtype=dtype, device=parallel.device())
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total


def validation_loss(chunks: list, batches: list[dict], preset: Preset, graphs: str = "none") -> float:
    """Mean per-token loss of the model on ``batches`` (this DP rank's slices; the sums and token
    counts are reduced over DP and the pipeline): forward only (Megatron's schedule with
    ``forward_only=True``), in eval mode and without autograd, then back to training mode. Nothing
    the next step reads changes (COAT's FP8 weight copies follow the weights; TE's delayed
    scaling, whose amax history a forward updates, is the exception).

    Always eager: with CUDA graphs (``graphs`` other than "none") the forward runs under
    ``torch.inference_mode()``, in which Megatron's per-layer graph managers step aside and call
    the layers themselves (what its inference warm-up does), so no forward-only graph is captured
    beside the training step's; the whole-step graph wraps the training schedule only."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        chunk.eval()
    try:
        with torch.inference_mode() if graphs != "none" else torch.no_grad():
            total = token_loss_totals(get_forward_backward_func(), chunks, batches, preset, forward_only=True)
    finally:
        for chunk in chunks:
            chunk.train()
    return (total[0] / total[1]).item()


def forward_step(data_iterator, model):
    """Megatron's ``forward_step_func`` for a GPTModel on {tokens, position_ids, labels} batches:
    the summed token loss and the token count (Megatron divides), as pretrain_gpt's does."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss: torch.Tensor):
        # (sum, token count, report): Megatron divides by the count, as pretrain_gpt's does
        loss = per_token_loss.float().sum()
        # a fill, not torch.tensor(): a copy from host memory cannot be captured in a CUDA graph
        tokens = torch.full((), per_token_loss.numel(), dtype=torch.int, device=per_token_loss.device)
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

    return output, loss_func
