"""Host (CPU) time per FP8 op and per transformer layer: where COAT's Python time goes.

    python benchmarks/host_overhead.py [--out DIR] [--profile-layers N]

A step is bound by the host when the GPU finishes each kernel before the host has issued the
next. This measures the host side alone: each op runs on tiny tensors (256 tokens), so its GPU
work takes microseconds and the time to *issue* it (Python, autograd, dispatch, allocations,
kernel launches) is what the clock sees. Sections:

1. primitives: one bare Triton launch, torch.empty, torch._scaled_mm, a BF16 mm, ...: the floor
   under any op built from them; COAT's quantizers and GEMM with the host path of now (the lean
   launch of ``coat_kernels.launch``, the cached plans of ``coat_kernels.cublaslt``) and of before;
2. COAT's ops (quantize, norm, linear, SwiGLU; forward and forward+backward) and one whole
   transformer layer per mode (COAT, also with the host path of before; TE BF16, TE FP8 current
   scaling, Megatron local BF16):
   host microseconds per call, and kernel launches per call (torch.profiler);
3. the same layer at the gpt-1b shape (2048 x 4 tokens, hidden 2048): host time to issue one
   fwd+bwd against the GPU time it takes, i.e. whether that layer is host-bound;
4. cProfile of COAT's layer fwd+bwd: the Python functions that take the host time.

Writes host_overhead.md / host_overhead.jsonl to --out and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import time

import torch
import triton
import triton.language as tl

from coat_compare.layer import kernel_launches


@triton.jit
def _noop_kernel(x_ptr):
    pass


@triton.jit
def _ten_args_kernel(a, b, c, d, e, n_rows, n_cols, stride, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    pass


def host_us(fn, calls: int = 200) -> tuple[float, float]:
    """(host microseconds to issue one call, wall microseconds per call incl. the GPU)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    end = time.perf_counter()
    return (issued - start) * 1e6 / calls, (end - start) * 1e6 / calls


def _one_buffer(dev):
    buf = torch.empty(2 * 256 * 512 + 16, dtype=torch.uint8, device=dev)
    return (
        buf[: 256 * 512].view(256, 512),
        buf[256 * 512 : 2 * 256 * 512].view(512, 256),
        buf[-16:-12].view(torch.float32),
    )


def primitives(rows: list) -> None:
    from coat_kernels import quantize_per_tensor, tensor_amax
    from coat_kernels.gemm import fp8_gemm

    dev = torch.device("cuda")
    x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    a8 = torch.randn(256, 512, device=dev).to(torch.float8_e4m3fn)
    b8 = torch.randn(512, 512, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    w = torch.randn(512, 512, device=dev, dtype=torch.bfloat16)
    cases = {
        "triton launch, 1 argument": lambda: _noop_kernel[(1,)](x),
        "triton launch, 10 arguments": lambda: _ten_args_kernel[(4, 2)](
            x, x, x, x, x, 256, 512, 512, FMAX=448.0, BLOCK=64
        ),
        "torch.empty": lambda: torch.empty(256, 512, device=dev),
        "torch.zeros (1 element)": lambda: torch.zeros(1, device=dev),
        "torch.ones (0-d)": lambda: torch.ones((), device=dev),
        "Tensor.amax of 64 floats": lambda: one.expand(64).amax(),
        "torch.mm BF16 256x512x512": lambda: torch.mm(x, w),
        "torch._scaled_mm 256x512x512": lambda: torch._scaled_mm(
            a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16
        ),
        "tensor_amax": lambda: tensor_amax(x),
        "quantize_per_tensor (own amax)": lambda: quantize_per_tensor(x, check_finite=False),
        "quantize_per_tensor + transpose": lambda: quantize_per_tensor(x, transpose=True, check_finite=False),
        "fp8_gemm": lambda: fp8_gemm(a8, one, b8, one),
        "torch.empty x3 (one quantizer's q, q_t, scale)": lambda: (
            torch.empty(256, 512, dtype=torch.uint8, device=dev),
            torch.empty(512, 256, dtype=torch.uint8, device=dev),
            torch.empty((), device=dev),
        ),
        "torch.empty, then 2 slices and a view (one buffer for the three)": lambda: _one_buffer(dev),
    }
    for name, fn in cases.items():
        host, wall = host_us(fn)
        rows.append({"section": "primitive", "name": name, "host_us": host, "wall_us": wall})
    with host_path_of_before():
        for name in ("tensor_amax", "quantize_per_tensor (own amax)", "quantize_per_tensor + transpose", "fp8_gemm"):
            host, wall = host_us(cases[name])
            rows.append({"section": "primitive", "name": f"{name}, before", "host_us": host, "wall_us": wall})


@contextlib.contextmanager
def host_path_of_before():
    """COAT's kernels launched through Triton's own path (``coat_kernels.launch`` off) and its GEMMs
    through ``torch._scaled_mm`` (``COAT_FP8_GEMM=torch``): the host path before the cached cuBLASLt plans and the lean launches."""
    from coat_kernels import gemm, launch

    launch.set_enabled(False)
    gemm.GEMM = "torch"
    try:
        yield
    finally:
        launch.set_enabled(launch.ENABLED)
        gemm.GEMM = "auto"


def coat_ops(rows: list) -> None:
    from coat_megatron.config import CoatConfig
    from coat_megatron.fp8 import Fp8WeightCache, OutputForm, fp8_linear, rmsnorm_to_fp8, swiglu_fp8

    dev = torch.device("cuda")
    cfg = CoatConfig()
    tokens, hidden, ffn = 256, 512, 1408
    x = torch.randn(tokens, 1, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    nw = torch.ones(hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(2 * ffn, hidden, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(hidden, ffn, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    c1, c2 = Fp8WeightCache(), Fp8WeightCache()
    dy = torch.randn(tokens, 1, hidden, device=dev, dtype=torch.bfloat16)

    def norm():
        return rmsnorm_to_fp8(x, nw, 1e-5)

    def fc1():
        return fp8_linear(norm(), w1, config=cfg, weight_cache=c1, output_form=OutputForm.SWIGLU_INPUT)

    def mlp():
        return fp8_linear(swiglu_fp8(fc1()), w2, config=cfg, weight_cache=c2)

    cases = {
        "rmsnorm_to_fp8 fwd": (lambda: norm(), None),
        "rmsnorm_to_fp8 + fp8_linear(fc1, swiglu out) fwd": (lambda: fc1(), None),
        "MLP block fwd (norm, fc1, swiglu, fc2)": (lambda: mlp(), None),
        "MLP block fwd+bwd": (lambda: mlp().backward(dy), [x, nw, w1, w2]),
    }
    for name, (fn, grads) in cases.items():

        def call(fn=fn, grads=grads):
            fn()
            for g in grads or []:
                g.grad = None

        host, wall = host_us(call)
        n = sum(kernel_launches(call).values())
        rows.append({"section": "coat op", "name": name, "host_us": host, "wall_us": wall, "launches": n})


def layer_modes():
    from coat_compare.modes import MODES, unavailable_reason

    return [
        MODES[m]
        for m in ("coat", "bf16", "te-fp8-current", "bf16-local")
        if unavailable_reason(MODES[m], "layer") is None
    ]


def build_layer_step(preset, mode, seed: int = 1234):
    """(step, layer): fwd+bwd of one TransformerLayer of ``mode`` (as coat-compare builds it), the
    gradients dropped after each step."""
    from coat_compare.layer import LayerStep

    run = LayerStep(preset, mode, seed)

    def step():
        run.step()
        run.clear_grads()

    return step, run


def layers(rows: list, profile_calls: int) -> str:
    from coat_compare.presets import Preset, get_preset

    small = Preset("host-layer", "layer", layers=1, hidden=512, ffn=1408, heads=8, seq=256, micro_batch=1)
    big = get_preset("gpt-1b")
    big = Preset(
        "gpt-1b-layer",
        "layer",
        layers=1,
        hidden=big.hidden,
        ffn=big.ffn,
        heads=big.heads,
        seq=big.seq,
        micro_batch=big.micro_batch,
    )
    cprofile_text = ""
    for mode in layer_modes():
        step, layer = build_layer_step(small, mode)
        host, wall = host_us(step, calls=100)
        kinds = kernel_launches(step)
        rows.append(
            {
                "section": "layer 256 tokens",
                "name": mode.name,
                "host_us": host,
                "wall_us": wall,
                "launches": sum(kinds.values()),
                "launches_by_kernel": dict(kinds.most_common()),
            }
        )
        if mode.name == "coat":
            with host_path_of_before():
                host_off, wall_off = host_us(step, calls=100)
            rows.append(
                {
                    "section": "layer 256 tokens",
                    "name": "coat, before (Triton's launch path, torch._scaled_mm)",
                    "host_us": host_off,
                    "wall_us": wall_off,
                }
            )
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(profile_calls):
                step()
            prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
            cprofile_text = buf.getvalue()
        del layer, step
        torch.cuda.empty_cache()
        step, layer = build_layer_step(big, mode)
        host, wall = host_us(step, calls=20)
        rows.append({"section": "layer gpt-1b shape", "name": mode.name, "host_us": host, "wall_us": wall})
        del layer, step
        torch.cuda.empty_cache()
    return cprofile_text


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--profile-layers", type=int, default=50, help="COAT layer fwd+bwd calls under cProfile")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/host_overhead.py measures the host side of GPU launches: run it on a CUDA machine")
    from coat_compare import parallel

    rows: list = []
    with contextlib.ExitStack() as stack:
        parallel.initialize(1, 1, stack)
        parallel.seed_everything(1234)
        # no automatic garbage collection inside the timed loops, as coat-compare trains by default (--gc manual)
        stack.enter_context(parallel.manual_gc(True))
        primitives(rows)
        coat_ops(rows)
        cprofile_text = layers(rows, args.profile_layers)
    gpu = torch.cuda.get_device_name()
    lines = [
        f"# Host time per op and per layer ({gpu}, torch {torch.__version__}, triton {triton.__version__})",
        "",
        "`python benchmarks/host_overhead.py`",
        "",
        "host us: time to issue one call; wall us: per call including the GPU (wall >> host: GPU-bound).",
        "",
    ]
    section = None
    order = list(dict.fromkeys(r["section"] for r in rows))
    for r in sorted(rows, key=lambda r: order.index(r["section"])):
        if r["section"] != section:
            section = r["section"]
            lines += ["", f"## {section}", "", "| name | host us | wall us | launches |", "|---|---|---|---|"]
        lines.append(f"| {r['name']} | {r['host_us']:.1f} | {r['wall_us']:.1f} | {r.get('launches', '')} |")
    for r in rows:
        if "launches_by_kernel" in r:
            lines += ["", f"### kernels launched by one fwd+bwd of the {r['name']} layer (256 tokens)", "", "```"]
            lines += [f"{n:4d}  {k[:110]}" for k, n in r["launches_by_kernel"].items()]
            lines += ["```"]
    lines += ["", "## cProfile of the COAT layer fwd+bwd (256 tokens), by own time", "", "```", cprofile_text, "```"]
    text = "\n".join(lines) + "\n"
    from coat_compare.report import write_markdown_and_rows

    write_markdown_and_rows(args.out, "host_overhead", text, rows)


if __name__ == "__main__":
    main()
