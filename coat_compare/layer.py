"""One transformer layer, fwd+bwd: time and the activation memory it keeps for backward.

On a GPU (what ``benchmarks/layer.py`` reported before this module): the median of CUDA-event
timings of fwd+bwd (``triton.testing.do_bench``) after warm-up, and activation memory = allocated
after the forward minus before, minus the output, measured after warm-up so FP8 weight copies and
workspaces already exist (they are not activations). On a CPU: the median wall time of a few
fwd+bwd, and the bytes of the tensors saved for backward (``memory.SavedTensors``).

Under ``torchrun --tp N`` every rank measures its shard of the layer with sequence parallel on
(input: its seq/N slice), and the all-gather bytes of one fwd+bwd (``comm``) come with the row;
on GPUs the timing then takes a fixed number of repeats on every rank (the collectives must
match), each a CUDA-event pair around one fwd+bwd.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter

import torch

from . import parallel
from .build import build_layer
from .comm import AllGatherBytes, all_gather_fields
from .flops import layer_utilisation
from .memory import MIB, SavedTensors
from .modes import Mode
from .presets import Preset

CPU_REPEATS = 5


class LayerStep:
    """One TransformerLayer of ``mode`` on a (seq / tp, micro_batch, hidden) BF16 input with RoPE,
    as in GPTModel (at ``tp`` > 1 this rank's shard, sequence parallel): ``forward()`` returns the
    output, ``step()`` runs fwd+bwd, ``clear_grads()`` drops the gradients it left."""

    def __init__(self, preset: Preset, mode: Mode, seed: int, tp: int = 1):
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self.layer, config = build_layer(preset, mode, seed, tp)
        device = next(self.layer.parameters()).device
        self.rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0).to(device)(preset.seq)
        g = torch.Generator(device=device).manual_seed(seed)
        self.x = (
            torch.randn(preset.seq // tp, preset.micro_batch, preset.hidden, device=device, generator=g)
            .to(torch.bfloat16)
            .requires_grad_()
        )
        self.dy = torch.randn(self.x.shape, device=device, generator=g).to(torch.bfloat16)
        self.params = list(self.layer.parameters())
        self.fp8_context = contextlib.nullcontext
        if config.fp8:
            from megatron.core.fp8_utils import get_fp8_context

            self.fp8_context = lambda: get_fp8_context(config)  # noqa: E731

    def forward(self) -> torch.Tensor:
        with self.fp8_context():
            out, _ = self.layer(self.x, attention_mask=None, rotary_pos_emb=self.rope)
        return out

    def step(self) -> None:
        self.forward().backward(self.dy)

    def clear_grads(self) -> None:
        for t in [self.x, *self.params]:
            t.grad = None


def kernel_launches(fn) -> Counter:
    """The CUDA kernels (and memsets/copies) one call of ``fn`` launches, by name (torch.profiler),
    after one unprofiled call so that first-call work (compilation, caches) is not counted."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure_layer(preset: Preset, mode: Mode, seed: int, tp: int = 1) -> dict:
    """{"ms", "activation_MiB", "memory_source", all-gather bytes} of one fwd+bwd of ``mode``'s
    layer (``LayerStep``)."""
    run = LayerStep(preset, mode, seed, tp)
    for _ in range(3):
        run.step()
    run.clear_grads()
    with AllGatherBytes() as counter:
        run.step()
    gathered = all_gather_fields(counter.snapshot())
    run.clear_grads()
    if run.x.device.type == "cuda":
        result = _measure_cuda(run.forward, run.step, run.dy, [run.x] + run.params)
    else:
        result = _measure_cpu(run.forward, run.step, run.dy, [run.x, run.rope] + run.params)
    del run
    flops = layer_utilisation(preset, result["ms"], tp, parallel.device_name())
    return {**result, "tp": tp, **gathered, **flops}


def _measure_cuda(forward, step, dy, inputs) -> dict:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    activation = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    out.backward(dy)
    del out
    if parallel.world_size() == 1:
        import triton

        ms = triton.testing.do_bench(step, warmup=5, rep=50, grad_to_none=inputs, return_mode="median")
    else:
        ms = _time_in_step(step, inputs)
    return {"ms": ms, "activation_MiB": activation / MIB, "memory_source": "cuda-allocator"}


def _time_in_step(step, inputs, warmup: int = 5, repeats: int = 20) -> float:
    """The median of ``repeats`` CUDA-event timings of ``step``: a fixed count on every rank, as the
    layer's collectives need (``do_bench`` picks its count from each rank's own first timings)."""
    times = []
    parallel.barrier()
    for i in range(warmup + repeats):
        for t in inputs:
            t.grad = None
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(begin.elapsed_time(end))
    return statistics.median(times)


def _measure_cpu(forward, step, dy, inputs) -> dict:
    with SavedTensors(exclude=inputs) as saved:
        out = forward()
    out.backward(dy)
    del out
    times = []
    for _ in range(CPU_REPEATS):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return {"ms": statistics.median(times), "activation_MiB": saved.bytes / MIB, "memory_source": "saved-tensors"}
