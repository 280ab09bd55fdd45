"""COAT's Python cost per layer on a CPU, with the device work stubbed out: a quick loop for host work,
and what tests/kernels/test_host_path.py runs (a process of its own: it stubs Triton for the whole process).

    python tests/kernels/host_path_layer.py [--calls N] [--profile] [--tokens T] [--hidden H] [--ffn F]

Eager COAT is bound by the host (benchmarks/results/host-time-layer-1gpu on a GPU). Its Python -- argument
checks, allocations, views, autograd, the Triton launch path -- can be measured without a GPU: this
runs COAT's ops of one transformer layer (``LayerOps``: what its modules call, no attention and no
Megatron around them) on small CPU tensors with

- ``coat_kernels.backend.use_triton`` answering True (the GPU path's Python runs);
- every Triton launch stubbed out (``JITFunction.run`` and the launcher that ``coat_kernels.launch``
  calls do nothing; counted);
- the GEMMs (on a CPU tensor: their torch references) replaced by stubs that allocate their output.

So the figures are the layer's host time *less* the launches' own cost (measured on the GPU by
``git show 94757c2:benchmarks/host_overhead.py``: about 15 us per Triton launch on an H100 host) on this machine's CPU. They are
for comparing versions of COAT's Python, never a performance figure. ``--profile`` prints cProfile's
table of the functions that take the time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import Counter

import torch

LAUNCHES: Counter = Counter()  # every Triton launch, by kernel
LEAN: Counter = Counter()  # those that took coat_kernels.launch's fast path


def install_stubs() -> None:
    """Make COAT's GPU path run on CPU tensors with no device work (see the module docstring)."""
    import triton.runtime.jit as jit

    import coat_kernels.backend as backend
    import coat_kernels.gemm as gemm
    import coat_kernels.gemm_accumulate as gemm_accumulate
    import coat_kernels.launch as launch

    backend.use_triton.__code__ = (lambda x, backend="auto": True).__code__
    backend.use_triton.__defaults__ = ("auto",)

    class Compiled:  # what a launch returns: the launcher the lean path calls next time
        function = packed_metadata = None

        def __init__(self, name):
            def launch(*args):
                LAUNCHES[name] += 1
                LEAN[name] += 1

            self.run = launch

    compiled = {}

    def run(self, *args, grid, warmup, **kwargs):
        LAUNCHES[self.fn.__name__] += 1
        return compiled.setdefault(self.fn.__name__, Compiled(self.fn.__name__))

    jit.JITFunction.run = run
    launch._current_device = lambda: 0
    launch._current_stream = lambda device: 0

    def scaled_mm(a, b, *, scale_a=None, scale_b=None, bias=None, out_dtype=None, use_fast_accum=False, out=None):
        return out if out is not None else torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)

    torch._scaled_mm = scaled_mm

    def reference(a, a_scale, b, b_scale, *, out_dtype=torch.bfloat16, bias=None):
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)

    def accumulate(a, a_scale, b, b_scale, out, *, use_fast_accum=False):
        return out

    gemm.fp8_gemm_reference.__code__ = reference.__code__
    gemm_accumulate.accumulate_by_add.__code__ = accumulate.__code__


class LayerOps:
    """COAT's part of one transformer layer, as its modules call it (default ``CoatConfig``, wgrad
    into ``main_grad`` as under Megatron's gradient-accumulation fusion): norm -> QKV linear ->
    (attention: a stand-in that saves its output) -> projection (input saved by the attention) ->
    norm -> fc1 (SwiGLU input out) -> SwiGLU -> fc2, forward and backward."""

    def __init__(self, tokens: int, hidden: int, ffn: int):
        from coat_megatron.config import CoatConfig
        from coat_megatron.fp8.weights import weight_cache_for

        self.cfg = CoatConfig()
        g = torch.Generator().manual_seed(1234)

        def param(*shape):
            w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
            w.main_grad = torch.zeros(shape, dtype=torch.float32)
            w.grad_added_to_main_grad = False
            return w

        self.norm1, self.norm2 = (torch.ones(hidden, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        self.qkv, self.proj = param(3 * hidden, hidden), param(hidden, hidden)
        self.fc1, self.fc2 = param(2 * ffn, hidden), param(hidden, ffn)
        self.caches = {name: weight_cache_for(self.cfg) for name in ("qkv", "proj", "fc1", "fc2")}
        self.x = torch.randn(tokens, 1, hidden, generator=g).to(torch.bfloat16).requires_grad_()
        self.dy = torch.randn(tokens, 1, hidden, generator=g).to(torch.bfloat16)
        self.params = [self.norm1, self.norm2, self.qkv, self.proj, self.fc1, self.fc2]

    def step(self) -> None:
        from coat_megatron.fp8 import OutputForm, fp8_linear, rmsnorm_to_fp8, swiglu_fp8

        cfg, c = self.cfg, self.caches
        h = rmsnorm_to_fp8(self.x, self.norm1, 1e-5)
        qkv = fp8_linear(h, self.qkv, config=cfg, weight_cache=c["qkv"], accumulate_into_main_grad=True)
        attn = qkv[..., : self.x.shape[-1]].contiguous()  # attention's output: saved by the attention
        out = fp8_linear(
            attn,
            self.proj,
            config=cfg,
            weight_cache=c["proj"],
            save_original_input=True,
            accumulate_into_main_grad=True,
        )
        res = out + self.x
        h = rmsnorm_to_fp8(res, self.norm2, 1e-5)
        a = fp8_linear(
            h,
            self.fc1,
            config=cfg,
            weight_cache=c["fc1"],
            output_form=OutputForm.SWIGLU_INPUT,
            accumulate_into_main_grad=True,
        )
        a = swiglu_fp8(a, group_size=cfg.group_size, out_fmt=cfg.forward_format, saved_fmt=cfg.forward_format)
        y = fp8_linear(a, self.fc2, config=cfg, weight_cache=c["fc2"], accumulate_into_main_grad=True) + res
        y.backward(self.dy)

    def clear_grads(self) -> None:
        for t in [self.x, *self.params]:
            t.grad = None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5, help="timed loops of --calls; the fastest is reported")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)

    install_stubs()
    run = LayerOps(args.tokens, args.hidden, args.ffn)
    for _ in range(5):
        run.step()
        run.clear_grads()
    LAUNCHES.clear()
    LEAN.clear()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.calls):
            run.step()
            run.clear_grads()
        times.append((time.perf_counter() - start) * 1e6 / args.calls)
    us = min(times)
    launches = sum(LAUNCHES.values()) / (args.calls * args.repeats)
    lean = sum(LEAN.values()) / (args.calls * args.repeats)
    print(
        f"COAT's ops of one layer fwd+bwd, host Python without device work: {us:.0f} us per call (fastest of "
        f"{args.repeats} loops), {launches:.0f} Triton launches, {lean:.0f} through the lean path"
    )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            run.step()
            run.clear_grads()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
