"""Kernel launches and allocations of one COAT layer's fwd+bwd at TP 2 + SP on two GPUs, measured.

Run by ``test_layer_launches.py::test_launches_on_two_gpus`` (or by hand:
``torchrun --standalone --nproc-per-node 2 tests/megatron/layer_launches_gpu.py [RECIPE]``, RECIPE
memory (default), codes or cached, each with "+scratch" after it for CoatConfig.scratch_buffers). Each rank:

1. builds the layer of ``layer_launches.build_layer`` on its GPU (the spec's own core attention:
   TE's flash attention where TE is installed), runs ``WARM_UP`` micro-batches;
2. profiles one micro-batch's fwd+bwd with ``torch.profiler`` (CUDA activity: every kernel, memcpy
   and memset on the device) and reads ``torch.cuda.memory_stats()["allocation.all.allocated"]``
   before and after it (every block the caching allocator handed out);
3. does the same for the core attention alone, on the inputs the layer gave it, and for RoPE
   alone; the layer's figures less those are COAT's (and Megatron's glue around the attention);
4. counts the same micro-batch with ``launch_counter.LaunchCounter`` too (by op and by region:
   what the CPU test counts), so that a GPU figure above the CPU's can be told apart by name;
5. prints ``rank R: RECIPE launches L allocations A (layer ..., attention ..., rope ...)`` and fails
   (exit status 1) where L > ``LAUNCH_BOUND`` or A > ``ALLOCATION_BOUND``.

Without CUDA (gloo, the Triton interpreter) steps 1, 3 and 4 run with the CPU counter in place of
the profiler and the allocator, so that the script itself can be tried on any machine.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # the Triton interpreter, set up before any kernel module is imported (as tests/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_interpreter import install

    install()

from launch_counter import LaunchCounter  # noqa: E402
from layer_launches import WARM_UP, MicroBatch, regions, with_excluded_attention  # noqa: E402

LAUNCH_BOUND, ALLOCATION_BOUND = 60, 40  # per layer and micro-batch, attention excluded
# seq, micro-batch, hidden, FFN, heads: every GEMM dimension a multiple of 16 (small on a CPU: the interpreter)
SIZES = (256, 2, 256, 768, 4) if DEVICE == "cuda" else (32, 2, 64, 128, 4)


class DeviceCount:
    """Kernels launched (torch.profiler) and blocks allocated (the caching allocator) by what runs
    inside; on a CPU, ``LaunchCounter``'s figures."""

    def __enter__(self):
        if DEVICE == "cpu":
            self.counter = LaunchCounter()
            self.counter.__enter__()
            return self
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self.before = torch.cuda.memory_stats()["allocation.all.allocated"]
        self.profile = profile(activities=[ProfilerActivity.CUDA])
        self.profile.__enter__()
        return self

    def __exit__(self, *exc):
        if DEVICE == "cpu":
            self.counter.__exit__(*exc)
            self.kernels = Counter(self.counter.launches)
            self.allocations = self.counter.total_allocations
            return False
        torch.cuda.synchronize()
        self.profile.__exit__(*exc)
        self.allocations = torch.cuda.memory_stats()["allocation.all.allocated"] - self.before
        self.kernels = Counter(e.name for e in self.profile.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        return False

    @property
    def launches(self) -> int:
        return sum(self.kernels.values())


def _attention_inputs(step: MicroBatch) -> dict:
    """What the layer hands its core attention and RoPE in one forward (the next one after this call)."""
    import megatron.core.transformer.attention as attention

    seen = {}
    core = step.layer.self_attention.core_attention
    hook = core.register_forward_hook(lambda m, a, kw, out: seen.update(args=a, kwargs=kw), with_kwargs=True)
    rope = attention.apply_rotary_pos_emb
    calls = seen.setdefault("rope", [])

    def recording_rope(*args, **kwargs):
        calls.append((args, kwargs))
        return rope(*args, **kwargs)

    attention.apply_rotary_pos_emb = recording_rope
    try:
        step()
    finally:
        hook.remove()
        attention.apply_rotary_pos_emb = rope
    return seen


def _alone(fn, inputs: list[torch.Tensor], args: tuple, kwargs: dict) -> DeviceCount:
    """Count fn(*leaves, *args, **kwargs) fwd+bwd on leaf copies of ``inputs`` (after one warm-up)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, *args, **kwargs)
    grad = torch.randn_like(out)
    out.backward(grad)
    for t in leaves:
        t.grad = None
    with DeviceCount() as counted:
        out = fn(*leaves, *args, **kwargs)
        out.backward(grad)
    return counted


def measure(recipe: str) -> tuple[int, int, str]:
    step = MicroBatch("coat", recipe, DEVICE, SIZES)
    for _ in range(WARM_UP):
        step()
    seen = _attention_inputs(step)
    with DeviceCount() as layer:
        step()
    core = step.layer.self_attention.core_attention
    attention = _alone(core, list(seen["args"][:3]), seen["args"][3:], seen["kwargs"])
    ropes = [_alone(_rope, [args[0]], args[1:], kwargs) for args, kwargs in seen["rope"]]  # query and key
    counter = LaunchCounter(regions=regions(step.layer))
    step(counter)
    by_counter = with_excluded_attention(counter.summary())
    not_coats = [attention, *ropes]
    launches = layer.launches - sum(c.launches for c in not_coats)
    allocations = layer.allocations - sum(c.allocations for c in not_coats)
    detail = (
        f"layer {layer.launches}/{layer.allocations}, attention {attention.launches}/{attention.allocations}, "
        f"rope {[c.launches for c in ropes]}/{[c.allocations for c in ropes]}; the counter's "
        f"{by_counter['excluding_attention']}\n  kernels: {dict(layer.kernels.most_common())}\n"
        f"  counter by region: {by_counter['regions']}"
    )
    return launches, allocations, detail


def _rope(*args, **kwargs):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    return apply_rotary_pos_emb(*args, **kwargs)


def main() -> int:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    recipe = sys.argv[1] if len(sys.argv) > 1 else "memory"
    with contextlib.ExitStack() as stack:
        if DEVICE == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl")
        else:
            import coat_kernels.backend as backend
            from coat_patches.cpu import megatron_on_cpu

            backend._OVERRIDE = "triton"
            stack.enter_context(megatron_on_cpu())
            dist.init_process_group("gloo")
        stack.callback(dist.destroy_process_group)
        parallel_state.initialize_model_parallel(dist.get_world_size(), 1)
        stack.callback(parallel_state.destroy_model_parallel)
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        launches, allocations, detail = measure(recipe)
    rank = int(os.environ.get("RANK", 0))
    print(f"rank {rank}: {recipe} launches {launches} allocations {allocations} ({detail})", flush=True)
    if launches > LAUNCH_BOUND or allocations > ALLOCATION_BOUND:
        print(f"rank {rank}: above the bound of {LAUNCH_BOUND} launches and {ALLOCATION_BOUND} allocations", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
