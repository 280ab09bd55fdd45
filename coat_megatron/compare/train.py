"""A GPT trained end to end with one mode: loss per step, step time, tokens/s and memory.

Reads like the training loop it is: build the model and optimizer, then per step draw the same
batch every mode draws (the built-in docstring corpus, byte tokens, one generator seeded by the
job's seed), run Megatron's forward-backward schedule, step the optimizer. The first
``preset.warmup_steps`` steps (allocation of optimizer states, FP8 scale start-up, autotuning) are
left out of the timing and activation statistics.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from ..corpus import ByteBatches, stdlib_docstrings
from . import parallel
from .build import build_gpt, set_learning_rate, unwrap_optimizers
from .memory import MIB, SavedTensors, gradient_bytes, optimizer_bytes, weights_bytes
from .modes import Mode
from .presets import Preset

CORPUS_BYTES = 4 << 20


@functools.cache
def corpus() -> bytes:
    return stdlib_docstrings(CORPUS_BYTES)


def train(preset: Preset, mode: Mode, seed: int, *, tp: int = 1, dp: int = 1, progress=None) -> dict:
    """Train ``preset.steps`` steps of ``mode``; returns the measurements (see ``coat_megatron.compare``)."""
    from megatron.core import parallel_state

    if preset.steps <= preset.warmup_steps:
        raise ValueError(f"--steps {preset.steps} leaves nothing to measure after {preset.warmup_steps} warm-up steps; use --steps {preset.warmup_steps + 5} or more")
    model, optimizer = build_gpt(preset, mode, seed, tp)
    device = parallel.device()
    data = ByteBatches(corpus(), preset.seq, preset.micro_batch * dp, vocab_size=preset.vocab)
    rank = parallel_state.get_data_parallel_rank()
    generator = torch.Generator().manual_seed(seed)
    cuda = device.type == "cuda"

    losses, step_ms, skipped = [], [], 0
    activations = static = warmup_peak = None
    for step in range(preset.steps):
        batch = {k: v[rank * preset.micro_batch : (rank + 1) * preset.micro_batch].to(device) for k, v in data.batch(generator).items()}
        set_learning_rate(optimizer, preset, step)
        measure = step == preset.warmup_steps
        if measure and cuda:
            torch.cuda.synchronize()
            static = torch.cuda.memory_allocated()
            warmup_peak = torch.cuda.max_memory_allocated()  # the first steps allocate the optimizer states
            torch.cuda.reset_peak_memory_stats()
        saved = SavedTensors(exclude=[*model.parameters(), *batch.values()]) if measure and not cuda else None
        parallel.synchronize()
        start = time.perf_counter()
        loss, ok = train_step(model, optimizer, batch, preset, saved)
        parallel.synchronize()
        if step >= preset.warmup_steps:
            step_ms.append((time.perf_counter() - start) * 1e3)
        if saved is not None:
            activations = saved.bytes
        skipped += not ok
        losses.append(loss)
        if progress is not None:
            progress.update(step + 1, loss=loss)
    if progress is not None:
        progress.close()

    parts = {
        "weights": weights_bytes(model),
        "grads": gradient_bytes(model),
        "optimizer": optimizer_bytes(unwrap_optimizers(optimizer)),
    }
    params = sum(p.numel() for p in model.parameters())
    if cuda:
        activations = torch.cuda.max_memory_allocated() - static
        parts["other"] = max(0, static - sum(parts.values()))  # FP8 weight copies, workspaces, ...
        peak, source = max(torch.cuda.max_memory_allocated(), warmup_peak), "cuda-allocator"
    else:
        peak, source = sum(parts.values()) + activations, "saved-tensors"
    parts["activations"] = activations
    median_ms = statistics.median(step_ms)
    result = {
        "micro_batch": preset.micro_batch,
        "seq": preset.seq,
        "steps": preset.steps,
        "tp": tp,
        "dp": dp,
        "params": params,  # of this rank's tensor-parallel shard
        "step_ms": median_ms,
        "step_ms_per_step": step_ms,
        "tokens_per_s": preset.micro_batch * dp * preset.seq / (median_ms / 1e3),
        "peak_MiB": peak / MIB,
        **{f"{k}_MiB": v / MIB for k, v in parts.items()},
        "optimizer_bytes_per_param": parts["optimizer"] * dp / params,
        "losses": losses,
        "skipped_steps": skipped,
        "memory_source": source,
    }
    del model, optimizer
    return result


def train_step(model, optimizer, batch: dict, preset: Preset, saved: SavedTensors | None) -> tuple[float, bool]:
    """One optimizer step on one micro-batch per DP rank: (loss averaged over DP, whether the
    optimizer took the step)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    if saved is not None:
        saved.__enter__()
    try:
        outputs = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=preset.seq,
            micro_batch_size=preset.micro_batch,
            forward_only=False,
        )
    finally:
        if saved is not None:
            saved.__exit__(None, None, None)
    ok, _, _ = optimizer.step()
    total = torch.stack([o["lm loss"] for o in outputs]).sum(0).float()
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1]).item(), bool(ok)


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss: torch.Tensor):
        # (sum, token count, report): Megatron divides by the count, as pretrain_gpt's does
        loss = per_token_loss.float().sum()
        tokens = torch.tensor(per_token_loss.numel(), dtype=torch.int, device=per_token_loss.device)
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

    return output, loss_func
