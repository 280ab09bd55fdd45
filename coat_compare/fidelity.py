"""Where an FP8 recipe's error comes from, without training noise.

From the same weights and the same batch, each configuration's gradients and one AdamW update are
compared with an FP32 reference (Megatron's local spec in FP32, no fusion, no TF32): the relative
error ||x - ref|| / ||ref|| and the cosine of

- dW: the weight gradients of linear_qkv, linear_proj, linear_fc1 and linear_fc2 (DDP's
  ``main_grad``, in whatever buffer the recipe keeps), over every layer;
- dX: the gradient reaching each of those linears' inputs, and the residual stream's gradient
  where it enters each norm (``norm-in``); where TE fuses a norm into the next linear, that linear's
  input is the norm's, so its own dX is not observable ("-");
- the update: Δw = new master - old master of one AdamW step at the preset's learning rate, without
  weight decay (the same term in every configuration), taken by the configuration's own optimizer
  (torch.optim.AdamW where Adam's states are FP32, as Megatron's Adam keeps them; COAT's
  ``CoatAdamW``, with its kernel on a GPU, where they are range-expanded FP8) from the moments the
  reference accumulated over ``warm`` earlier batches at the same weights (a step from fresh states
  is sign(g) and says nothing), loaded into COAT's states through ``CoatAdamW.load_fp32_state_dict``;
  per linear class and over every parameter ("all"); with the configuration's own gradient, and
  with the reference's (which isolates the optimizer's states).

Each class aggregates over the layers: sqrt(sum of squared errors / sum of squared reference
norms), and the cosine of the concatenated vectors; the JSON rows also name the worst layer.

The configurations are real recipes (BF16, the COAT default, COAT with E4M3 gradients, COAT with
its norm's or its SwiGLU's input kept in BF16 (``CoatConfig.norm_input_store`` /
``swiglu_input_store``: that store taken out of the real recipe), COAT's layers with Megatron's Adam,
BF16 layers with COAT's optimizer, TE FP8 delayed and current), and each COAT component alone,
emulated on the FP32 reference so that it is the only error there: the norm's input saved as 1x16
E4M3 for backward, the SwiGLU's input saved so, per-tensor FP8 GEMM inputs (E4M3 activations and
weights, E5M2 output gradients) scaled just in time or from the amax of earlier batches (delayed
scaling, which COAT's layers do not implement), BF16 gradient buffers, and COAT's range-expanded FP8
Adam states. The first row builds the reference again: its errors are the tool's own floor (0 where
the device computes deterministically). Each configuration takes one forward and backward of the
batch (plus the warm batches for delayed scaling) and one optimizer step: seconds on a GPU.

    python -m coat_compare.fidelity --preset gpt-1b-accuracy --load CKPT/step230 --out OUT
    python -m coat_compare.fidelity --preset llama2-7b --layers 1 --micro-batch 2 --out OUT
    python -m coat_compare.fidelity --preset tiny --out OUT          # a CPU, in a minute (TE rows skipped)
    python -m coat_compare.fidelity --preset tiny --configs bf16,coat,coat-norm-bf16 --out OUT
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from coat_megatron import CoatConfig

from .modes import MODES, unavailable_reason
from .presets import PRESETS, Preset, get_preset

LINEARS = ("qkv", "proj", "fc1", "fc2")
CLASSES = (*(f"dW {n}" for n in LINEARS), *(f"dX {n}" for n in LINEARS), "dX norm-in")
UPDATE_CLASSES = (*LINEARS, "all")
BETAS = (0.9, 0.95)
FORMAT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FORMAT_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Config:
    """Attributes:
    name: the table's row.
    key: what ``--configs`` takes.
    mode: the coat-compare mode built for real; None: the FP32 reference with ``emulate``.
    coat: the COAT recipe instead of the mode's (a real variant).
    emulate: COAT components added to the FP32 reference: "norm-store", "swiglu-store", "gemm-fwd"
        (per-tensor E4M3 activations and weights in every linear's forward GEMM, and so in its
        wgrad and dgrad), "gemm-bwd" (per-tensor E5M2 output gradients in dgrad and wgrad),
        "delayed" (their scales from the amax of the warm batches instead of just in time),
        "bf16-grad-buffers".
    states: Adam's moments as the recipe keeps them: "fp32" (torch.optim.AdamW), or "coat"
        (``CoatAdamW``: range-expanded FP8, ``coat``'s settings or the default recipe's).
    """

    name: str
    key: str
    mode: str | None = None
    coat: CoatConfig | None = None
    emulate: tuple[str, ...] = ()
    states: str = "fp32"


CONFIGS = (
    Config("fp32 (the reference, built again)", "fp32"),
    Config("bf16", "bf16", mode="bf16"),
    Config("coat (the default)", "coat", mode="coat", states="coat"),
    Config(
        "coat, E4M3 gradients", "coat-e4m3-grads", mode="coat", coat=CoatConfig(backward_format="e4m3"), states="coat"
    ),
    Config(
        "coat, norm input kept BF16",
        "coat-norm-bf16",
        mode="coat",
        coat=CoatConfig(norm_input_store="bf16"),
        states="coat",
    ),
    Config(
        "coat, SwiGLU input kept BF16",
        "coat-swiglu-bf16",
        mode="coat",
        coat=CoatConfig(swiglu_input_store="bf16"),
        states="coat",
    ),
    Config("coat layers, FP32 Adam (coat-act)", "coat-act", mode="coat-act"),
    Config("BF16 layers, FP8 Adam states (coat-opt-states)", "coat-opt-states", mode="coat-opt-states", states="coat"),
    Config("alone: FP8 Adam states", "alone-states", states="coat"),
    Config("alone: norm input stored 1x16", "alone-norm-store", emulate=("norm-store",)),
    Config("alone: SwiGLU input stored 1x16", "alone-swiglu-store", emulate=("swiglu-store",)),
    Config("emulated: FP8 GEMMs, just-in-time scales", "emulated-gemms", emulate=("gemm-fwd", "gemm-bwd")),
    Config("alone: FP8 GEMM inputs (E4M3 x, W)", "alone-gemm-inputs", emulate=("gemm-fwd",)),
    Config("alone: FP8 output gradients (E5M2 dY)", "alone-output-grads", emulate=("gemm-bwd",)),
    Config(
        "emulated: FP8 GEMMs, delayed scales", "emulated-gemms-delayed", emulate=("gemm-fwd", "gemm-bwd", "delayed")
    ),
    Config("alone: BF16 gradient buffers", "alone-bf16-buffers", emulate=("bf16-grad-buffers",)),
    Config("te-fp8-delayed", "te-fp8-delayed", mode="te-fp8-delayed"),
    Config("te-fp8-current", "te-fp8-current", mode="te-fp8-current"),
)
CONFIG_KEYS = {c.key: c for c in CONFIGS}


# -- fake quantization ------------------------------------------------------------------------------


def fake_quantize(x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """x through per-tensor FP8 and back, with COAT's scaling (``coat_kernels.scaling``: scale =
    amax / max, values clamped to +-max): ``amax`` None takes the tensor's own (just in time),
    else the one given (delayed: larger values saturate)."""
    from coat_kernels.scaling import quantize_with_inverse_reference, scale_from_amax_reference

    fmax = FORMAT_MAX[fmt]
    amax = x.detach().abs().amax().float() if amax is None else amax
    scale = scale_from_amax_reference(amax, fmax)
    q = quantize_with_inverse_reference(x.float(), 1.0 / scale, fmax).to(FORMAT_DTYPE[fmt])
    return (q.float() * scale).to(x.dtype)


def fake_quantize_groups(x: torch.Tensor, group_size: int = 16, fmt: str = "e4m3") -> torch.Tensor:
    """x through 1 x ``group_size`` FP8 along its last dimension and back: COAT's per-group
    quantizer and dequantizer (their torch references)."""
    from coat_kernels.per_group import dequantize_per_group_reference, quantize_per_group_reference

    rows = x.detach().reshape(-1, x.shape[-1])
    q, scales = quantize_per_group_reference(rows.contiguous(), group_size, fmt)
    return dequantize_per_group_reference(q, scales, group_size, x.dtype).view(x.shape)


class _Fp8Matmul(torch.autograd.Function):
    """A linear's three GEMMs with FP8 operands, in FP32 arithmetic: y = q(x) q(W)^T with q per-tensor
    E4M3 (``forward``), dX = q5(dY) q(W) and dW = q5(dY)^T q(x) with q5 per-tensor E5M2 (``backward``);
    an operand whose side is off stays exact."""

    @staticmethod
    def forward(ctx, x, weight, scales, key, forward, backward):
        xq = fake_quantize(x, "e4m3", scales.amax(key + "/x", x)) if forward else x
        wq = fake_quantize(weight, "e4m3", scales.amax(key + "/w", weight)) if forward else weight
        ctx.save_for_backward(xq, wq)
        ctx.scales, ctx.key, ctx.quantize_dy = scales, key, backward
        return torch.matmul(xq, wq.t())

    @staticmethod
    def backward(ctx, dy):
        xq, wq = ctx.saved_tensors
        gq = fake_quantize(dy, "e5m2", ctx.scales.amax(ctx.key + "/dy", dy)) if ctx.quantize_dy else dy
        dx = torch.matmul(gq, wq)
        dw = torch.matmul(gq.reshape(-1, gq.shape[-1]).t(), xq.reshape(-1, xq.shape[-1]))
        return dx, dw, None, None, None, None


class Scales:
    """Per-tensor amax: just in time (None), or recorded over earlier batches and then used (delayed)."""

    def __init__(self, delayed: bool):
        self.delayed, self.recording, self.history = delayed, delayed, {}

    def amax(self, key: str, x: torch.Tensor):
        if not self.delayed:
            return None
        now = x.detach().abs().amax().float()
        if self.recording:
            self.history[key] = torch.maximum(self.history.get(key, now), now)
            return None
        return self.history.get(key, now)


# -- the model, its weights and its gradients --------------------------------------------------------


def layers_of(chunks: list) -> list:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]


def is_module(m) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return m is not None and not isinstance(m, IdentityOp)


def sites(layer) -> dict[str, torch.nn.Module]:
    """Where dX is read in one layer: the module whose input each class's gradient reaches. TE's
    fused norm+linear takes the residual: there it is ``norm-in``, and the linear's own dX is not
    observable."""
    attn, mlp = layer.self_attention, layer.mlp
    out = {"proj": attn.linear_proj, "fc2": mlp.linear_fc2}
    for norm, linear, name in (
        (layer.input_layernorm, attn.linear_qkv, "qkv"),
        (layer.pre_mlp_layernorm, mlp.linear_fc1, "fc1"),
    ):
        if is_module(norm):
            out[name], out[f"norm-in {name}"] = linear, norm
        else:
            out[f"norm-in {name}"] = linear
    return out


def class_of(site: str) -> str:
    return "dX norm-in" if site.startswith("norm-in") else f"dX {site}"


def weight_class(name: str) -> str | None:
    for n in LINEARS:
        if name.endswith(f"linear_{n}.weight"):
            return n
    return None


def layer_of(name: str) -> int | None:
    """The layer index in a parameter's one-GPU name (``decoder.layers.3.``), None outside the layers."""
    match = re.search(r"\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def named_weights(chunks: list) -> dict[str, torch.nn.Parameter]:
    from .build import global_parameter_names

    out = {}
    for chunk in chunks:
        names = global_parameter_names(chunk)
        out.update({names[n]: p for n, p in chunk.named_parameters()})
    return out


@torch.no_grad()
def set_weights(chunks: list, weights: dict[str, torch.Tensor]) -> None:
    for name, p in named_weights(chunks).items():
        p.copy_(weights[name])


def main_grads(chunks: list) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.detach().float().clone() for name, p in named_weights(chunks).items()}


class Emulation:
    """The COAT components of ``emulate`` on an FP32 model: hooks and patched GEMMs, undone by ``close``."""

    def __init__(self, chunks: list, emulate: tuple[str, ...], group_size: int):
        self.handles, self.patched, self.emulate = [], [], emulate
        self.scales = Scales("delayed" in emulate)
        self.bf16_buffers = "bf16-grad-buffers" in emulate
        for i, layer in enumerate(layers_of(chunks)):
            if "norm-store" in emulate:
                for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
                    self._store_inputs(norm, norm, lambda t: fake_quantize_groups(t, group_size))
            if "swiglu-store" in emulate:
                # the tensors saved between fc1's output and fc2's input (the SwiGLU's) that are fc1's
                # output: its gate and up halves, as COAT keeps them
                self._store_inputs(
                    layer.mlp.linear_fc1,
                    layer.mlp.linear_fc2,
                    lambda t: fake_quantize_groups(t, group_size),
                    output=True,
                )
            if "gemm-fwd" in emulate or "gemm-bwd" in emulate:
                for name, linear in (("qkv", layer.self_attention.linear_qkv), ("proj", layer.self_attention.linear_proj),
                                     ("fc1", layer.mlp.linear_fc1), ("fc2", layer.mlp.linear_fc2)):  # fmt: skip
                    self._fp8_gemm(linear, f"{i}/{name}")

    def _store_inputs(self, first, last, quantize, output: bool = False) -> None:
        """Between ``first``'s forward and the end of ``last``'s (the start of it where ``output``),
        every tensor autograd saves that shares storage with ``first``'s input (output) is saved
        quantized."""
        watched = {}

        def pack(t):
            if t.untyped_storage().data_ptr() in watched.values():
                return quantize(t)
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

        def enter(module, args, result=None):
            source = result[0] if output else args[0]
            watched["ptr"] = source.untyped_storage().data_ptr()
            hooks.__enter__()

        def leave(module, args, result=None):
            hooks.__exit__(None, None, None)

        if output:
            self.handles += [first.register_forward_hook(enter), last.register_forward_pre_hook(leave)]
        else:
            self.handles += [first.register_forward_pre_hook(enter), last.register_forward_hook(leave)]

    def _fp8_gemm(self, linear, key: str) -> None:
        scales, forward, backward = self.scales, "gemm-fwd" in self.emulate, "gemm-bwd" in self.emulate

        def forward_impl(input, weight, bias=None, **kwargs):
            out = _Fp8Matmul.apply(input, weight, scales, key, forward, backward)
            return out if bias is None else out + bias

        self.patched.append(linear)
        linear._forward_impl = forward_impl

    def after_micro_batch(self, chunks: list) -> None:
        if self.bf16_buffers:  # each micro-batch's wgrad added into a BF16 buffer: the sum rounded each time
            with torch.no_grad():
                for p in named_weights(chunks).values():
                    p.main_grad.copy_(p.main_grad.to(torch.bfloat16))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for linear in self.patched:
            del linear._forward_impl


class InputGradients:
    """The gradient reaching each site's input, per micro-batch: kept (the reference), or compared
    with the reference's as it arrives (``sums``). An FP8 input (COAT's ``Fp8Tensor``) receives a
    plain BF16 gradient, the one its producer gets."""

    def __init__(self, chunks: list, reference: dict | None):
        self.kept, self.reference, self.micro = {}, reference, 0
        self.sums = ErrorSums()
        self.handles = []
        for i, layer in enumerate(layers_of(chunks)):
            for site, module in sites(layer).items():
                self.handles.append(module.register_forward_pre_hook(self._hook(f"{i}/{site}")))

    def _hook(self, key: str):
        def pre(module, args):
            x = args[0]
            if x.requires_grad:
                micro = self.micro
                x.register_hook(lambda g: self._arrived(key, micro, g))

        return pre

    def _arrived(self, key: str, micro: int, g: torch.Tensor) -> None:
        g = g.detach().float()
        if self.reference is None:
            self.kept[(key, micro)] = g.cpu()
            return
        ref = self.reference.get((key, micro))
        if ref is None:
            return
        layer, site = key.split("/", 1)
        self.sums.add(class_of(site), int(layer), g, ref.to(g.device))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def forward_backward(chunks: list, micro_batches: list[dict], emulation: Emulation | None, dx: InputGradients | None):
    """The batch's mean token loss, forward and backward one micro-batch at a time, into DDP's buffers."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    tokens = sum(b["labels"].numel() for b in micro_batches)
    for i, batch in enumerate(micro_batches):
        if dx is not None:
            dx.micro = i
        loss = chunks[0](batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        (loss.float().sum() / tokens).backward()
        if emulation is not None:
            emulation.after_micro_batch(chunks)


# -- the update --------------------------------------------------------------------------------------


def adamw_update(weight, grad, m, v, step: int, lr: float, eps: float, coat: CoatConfig | None = None):
    """Δw = new master - old master (FP32, ``weight``'s shape) of one AdamW step without weight
    decay from the FP32 master ``weight``, the FP32 moments ``m`` and ``v`` after ``step`` - 1 steps,
    and ``grad``: torch.optim.AdamW's, or with ``coat`` COAT's FP8 AdamW (``CoatAdamW``, its states
    loaded from the FP32 ones through ``load_fp32_state_dict``, i.e. quantized as it stores them)."""
    from coat_megatron.optimizer import CoatAdamW

    master = torch.nn.Parameter(weight.detach().float().clone())
    hyper = dict(lr=lr, betas=BETAS, eps=eps, weight_decay=0.0)
    optimizer = torch.optim.AdamW([master], **hyper)
    states = {"step": torch.tensor(float(step - 1)), "exp_avg": m.float().clone(), "exp_avg_sq": v.float().clone()}
    optimizer.state[master] = states
    if coat is not None:
        fp32_states = optimizer.state_dict()
        optimizer = CoatAdamW([master], config=replace(coat, master_weights="fp32"), **hyper)
        optimizer.load_fp32_state_dict(fp32_states)
    master.grad = grad.detach().float().clone()
    optimizer.step()
    return master.detach() - weight


def compare(x: torch.Tensor, ref: torch.Tensor) -> list[float]:
    x, ref = x.double(), ref.double()
    return [float((x - ref).pow(2).sum()), float(ref.pow(2).sum()), float((x * ref).sum()), float(x.pow(2).sum())]


def summary(sums: list[float]) -> dict:
    err, ref, dot, own = sums
    return {
        "rel_error": math.sqrt(err / ref) if ref > 0 else None,
        "cosine": dot / math.sqrt(ref * own) if ref > 0 and own > 0 else None,
    }


class ErrorSums:
    """|x - ref|^2, |ref|^2, <x, ref> and |x|^2 summed per class and per (class, layer), in float64:
    a class's relative error and cosine over all its layers, and its worst layer."""

    def __init__(self):
        self.total = defaultdict(lambda: [0.0] * 4)
        self.by_layer = defaultdict(lambda: [0.0] * 4)

    def add(self, cls: str, layer: int | None, x: torch.Tensor, ref: torch.Tensor) -> None:
        stats = compare(x, ref)
        for sums in [self.total[cls]] + ([self.by_layer[(cls, layer)]] if layer is not None else []):
            for i, value in enumerate(stats):
                sums[i] += value

    def classes(self) -> dict[str, dict]:
        return {c: summary(s) for c, s in self.total.items()}

    def worst_layers(self) -> dict[str, dict]:
        """Per class, the layer whose own relative error is largest: {"layer", "rel_error"}."""
        worst = {}
        for (cls, layer), sums in sorted(self.by_layer.items()):
            err = summary(sums)["rel_error"]
            if err is not None and err > worst.get(cls, {"rel_error": -1.0})["rel_error"]:
                worst[cls] = {"layer": layer, "rel_error": err}
        return worst


# -- the job -----------------------------------------------------------------------------------------


@dataclass
class Reference:
    """The FP32 reference, per parameter (one-GPU names, FP32, on the device): the weights, the
    measured batch's gradients, Adam's moments after the warm batches and the update from them;
    and the input gradients per (site, micro-batch) (``InputGradients.kept``, on the CPU)."""

    weights: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    m: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    dx: dict
    updates: dict[str, torch.Tensor]


def build(preset: Preset, config: Config | None):
    """(chunks, emulation) of ``config`` (None: the bare FP32 reference); weights set afterwards."""
    from .build import build_gpt

    if config is None or config.mode is None:
        chunks, _ = build_gpt(preset, MODES["bf16-local"], 0, fp32=True)
        return chunks, Emulation(chunks, config.emulate if config else (), CoatConfig().group_size)
    mode = MODES[config.mode] if config.coat is None else replace(MODES[config.mode], coat=config.coat)
    chunks, _ = build_gpt(preset, mode, 0)
    return chunks, None


def batches(preset: Preset, seed: int, count: int, first: int) -> list[list[dict]]:
    """``count`` global batches of the preset's training data (data order ``seed``) from step
    ``first``, as micro-batches on this device."""
    from . import parallel
    from .corpus import training_windows

    data = training_windows(replace(preset, steps=first + count), seed)
    n = preset.global_batch_for(1) // preset.micro_batch
    out = []
    for step in range(first, first + count):
        batch = data.batch(step)
        out.append([{k: v[i * preset.micro_batch : (i + 1) * preset.micro_batch].to(parallel.device())
                     for k, v in batch.items()} for i in range(n)])  # fmt: skip
    return out


def release(chunks: list) -> None:
    del chunks[:]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reference(preset: Preset, weights, data: list[dict], warm: list) -> Reference:
    """The FP32 reference: Adam's moments from the warm batches' gradients at these weights (FP32
    AdamW's, without stepping), then the measured batch's gradients, input gradients and update."""
    chunks, _ = build(preset, None)
    set_weights(chunks, weights)
    (b1, b2), m, v = BETAS, {}, {}
    for batch in warm:
        forward_backward(chunks, batch, None, None)
        for name, g in main_grads(chunks).items():
            m[name] = b1 * m.get(name, torch.zeros_like(g)) + (1 - b1) * g
            v[name] = b2 * v.get(name, torch.zeros_like(g)) + (1 - b2) * g * g
    dx = InputGradients(chunks, None)
    forward_backward(chunks, data, None, dx)
    dx.close()
    grads = main_grads(chunks)
    release(chunks)
    m = {n: m.get(n, torch.zeros_like(g)) for n, g in grads.items()}
    v = {n: v.get(n, torch.zeros_like(g)) for n, g in grads.items()}
    step = len(warm) + 1
    updates = {n: adamw_update(weights[n], grads[n], m[n], v[n], step, preset.lr, preset.adam_eps) for n in grads}
    return Reference(weights, grads, m, v, dx.kept, updates)


def measure(preset: Preset, weights, data: list[dict], warm: list, config: Config, ref: Reference):
    """One configuration's input gradients (compared with the reference's as they arrive) and weight gradients."""
    chunks, emulation = build(preset, config)
    set_weights(chunks, weights)
    delayed = emulation.scales.delayed if emulation is not None else MODES[config.mode].fp8_recipe == "delayed"
    if delayed:
        for batch in warm:  # the amax history delayed scaling takes its scales from (TE's, or the emulation's)
            forward_backward(chunks, batch, emulation, None)
        if emulation is not None:
            emulation.scales.recording = False
    dx = InputGradients(chunks, ref.dx)
    forward_backward(chunks, data, emulation, dx)
    dx.close()
    grads = main_grads(chunks)
    if emulation is not None:
        emulation.close()
    release(chunks)
    return dx, grads


def run(preset: Preset, configs: list[Config], seed: int, warm_steps: int, first: int, load: str | None) -> dict:
    from . import parallel

    weights = source_weights(preset, seed, load)
    *warm, data = batches(preset, seed, warm_steps + 1, first)
    ref = reference(preset, weights, data, warm)
    rows = []
    for config in configs:
        why = skipped(config)
        if why:
            rows.append({"config": config.name, "key": config.key, "status": "skipped", "reason": why})
            continue
        dx, grads = measure(preset, weights, data, warm, config, ref)
        rows.append(config_row(config, dx, grads, ref, warm_steps + 1, preset))
        print(f"fidelity: {config.name}", file=sys.stderr, flush=True)
    return {"preset": preset.name, "layers": preset.layers, "seed": seed, "warm_steps": warm_steps, "first_step": first,
            "load": load, "device": parallel.device_name(), "micro_batches": len(data), "lr": preset.lr,
            "rows": rows}  # fmt: skip


def skipped(config: Config) -> str | None:
    if config.mode is None:
        return None
    return unavailable_reason(MODES[config.mode], "train")


def config_row(config: Config, dx: InputGradients, own: dict, ref: Reference, step: int, preset: Preset) -> dict:
    """One configuration's JSON row: per class its relative error and cosine against the reference
    (``gradients``, ``update``, ``update_reference_gradient``) and its worst layer."""
    fp8_states = (config.coat or CoatConfig()) if config.states == "coat" else None
    grads, update, update_ref = ErrorSums(), ErrorSums(), ErrorSums()
    for name, g in own.items():
        r, cls = ref.grads[name], weight_class(name)
        if cls:
            grads.add(f"dW {cls}", layer_of(name), g, r)
        args = (ref.weights[name], ref.m[name], ref.v[name], step, preset.lr, preset.adam_eps, fp8_states)
        with_ref = ref.updates[name] if fp8_states is None else adamw_update(args[0], r, *args[1:])
        mine = adamw_update(args[0], g, *args[1:])
        for sums, delta in ((update, mine), (update_ref, with_ref)):
            for c in ("all", cls) if cls else ("all",):
                sums.add(c, None, delta, ref.updates[name])
    # a class none of whose sites was observable (TE's fused norm + linear) is None
    classes = {c: summary([0.0] * 4) for c in CLASSES} | grads.classes() | dx.sums.classes()
    return {
        "config": config.name,
        "key": config.key,
        "status": "ok",
        "states": config.states,
        "gradients": {c: classes[c] for c in CLASSES},
        "update": update.classes(),
        "update_reference_gradient": update_ref.classes(),
        "worst_layer": grads.worst_layers() | dx.sums.worst_layers(),
    }


def source_weights(preset: Preset, seed: int, load: str | None) -> dict[str, torch.Tensor]:
    """The weights every configuration starts from, FP32 copies of a BF16 model's: initialised from
    ``seed`` (``build.init_weights_by_name``), or those of the coat-compare checkpoint ``load``."""
    from .build import build_gpt

    chunks, optimizer = build_gpt(preset, MODES["bf16"], seed)
    if load:
        from .checkpoint import load_checkpoint

        load_checkpoint(load, chunks, optimizer)
    weights = {n: p.detach().float().clone() for n, p in named_weights(chunks).items()}
    del optimizer
    release(chunks)
    return weights


# -- the report ----------------------------------------------------------------------------------------


def table(result: dict, cosines: bool = True) -> list[str]:
    """The report: relative errors in %, then cosines (unless ``cosines`` is False), one row per
    configuration (from the JSON rows' numbers), then the verdict lines."""
    head = [*CLASSES, "update", "update, ref. gradient"]
    lines = [
        f"Relative error against the FP32 reference, % (preset {result['preset']}, {result['micro_batches']} "
        f"micro-batch(es), moments from {result['warm_steps']} earlier batches, update: one AdamW step at lr "
        f"{result['lr']:g} without weight decay, {result['device']}):",
    ]
    metrics = (("rel_error", lambda x: f"{100 * x:.3g}"), ("cosine", lambda x: f"{x:.6f}"))
    for metric, form in metrics if cosines else metrics[:1]:
        lines += ["", "| configuration | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
        for row in result["rows"]:
            if row["status"] != "ok":
                lines.append(f"| {row['config']} | " + " | ".join(["-"] * len(head)) + f" |  ({row['reason']})")
                continue
            cells = [row["gradients"][c][metric] for c in CLASSES]
            cells += [row["update"]["all"][metric], row["update_reference_gradient"]["all"][metric]]
            lines.append(f"| {row['config']} | " + " | ".join("-" if x is None else form(x) for x in cells) + " |")
        if metric == "rel_error" and cosines:
            lines += ["", "Cosine similarity with the FP32 reference:"]
    lines += ["", *verdict_lines(result)]
    return lines


def verdict_lines(result: dict) -> list[str]:
    """Per class: the COAT component that errs most alone, and whether the COAT default errs no more
    than TE FP8 delayed."""
    rows = {r["key"]: r for r in result["rows"] if r["status"] == "ok"}
    coat, te = rows.get("coat"), rows.get("te-fp8-delayed")
    alone = {r["config"]: r for r in rows.values() if r["config"].startswith("alone:")}
    lines = []
    for c in (*CLASSES, "update"):

        def err(r, c=c):
            return (r["update"]["all"] if c == "update" else r["gradients"].get(c, {})).get("rel_error")

        worst = max(((err(r), n) for n, r in alone.items() if err(r) is not None), default=None)
        text = f"- {c}: largest alone {worst[1][len('alone: ') :]} ({100 * worst[0]:.3g}%)" if worst else f"- {c}:"
        if coat and te and err(coat) is not None and err(te) is not None:
            text += f"; coat {100 * err(coat):.3g}% {'<=' if err(coat) <= err(te) else '>'} te-fp8-delayed {100 * err(te):.3g}%"
        lines.append(text)
    return lines


DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "accuracy.md")
DOCS_BEGIN, DOCS_END = "<!-- fidelity table: begin -->", "<!-- fidelity table: end -->"


RUN_FIELDS = ("preset", "layers", "seed", "warm_steps", "first_step", "load", "device", "micro_batches", "lr")


def read_results(path: str) -> list[dict]:
    """The measurements a ``fidelity.jsonl`` holds (one, as written, or several appended into one
    evidence file), in file order: each its run's fields and its rows."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no rows")
    results: dict[tuple, dict] = {}
    for row in rows:
        run = tuple(row.get(k) for k in RUN_FIELDS)
        results.setdefault(run, {**dict(zip(RUN_FIELDS, run)), "rows": []})["rows"].append(row)
    return list(results.values())


def measurement_name(result: dict) -> str:
    """How the docs name a measurement: preset (layers where one was asked), weights, device."""
    preset = result["preset"] + (f", {result['layers']} layer(s)" if result.get("layers") == 1 else "")
    weights = (
        f"checkpoint after step {result['first_step']}"
        if result.get("load")
        else f"initial weights of seed {result['seed']}"
    )
    return f"{preset}, {weights}, {result['device']}"


def docs_block(paths: list[str]) -> str:
    """The table docs/accuracy.md shows: per measurement (of the named fidelity.jsonl files), the
    relative errors and the verdict lines; a CPU measurement of a preset also measured on a GPU is
    left out (the GPU's has TE's rows)."""
    lines = [DOCS_BEGIN, f"<!-- generated by: python -m coat_compare.fidelity --docs {' '.join(paths)} -->"]
    measured = [(path, result) for path in paths for result in read_results(path)]
    on_gpu = {r["preset"] for _, r in measured if r["device"] != "CPU"}
    for path, result in measured:
        if result["device"] == "CPU" and result["preset"] in on_gpu:
            continue
        lines += ["", f"{measurement_name(result)} (`{path}`):", "", *table(result, cosines=False)]
    return "\n".join([*lines, DOCS_END])


def write_docs(paths: list[str], check: bool = False) -> int:
    """Put ``docs_block(paths)`` between the markers of docs/accuracy.md (``check``: only say
    whether it is there as generated; 1 if not)."""
    with open(DOCS) as f:
        text = f.read()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{DOCS} has no {DOCS_BEGIN} ... {DOCS_END} block to fill")
    start, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    new = text[:start] + docs_block(paths) + text[end:]
    if check:
        if new != text:
            print(
                f"docs/accuracy.md's fidelity table is stale: run python -m coat_compare.fidelity --docs {' '.join(paths)}"
            )
            return 1
        return 0
    with open(DOCS, "w") as f:
        f.write(new)
    print(f"wrote the fidelity table of docs/accuracy.md from {', '.join(paths)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--docs",
        nargs="+",
        metavar="FIDELITY_JSONL",
        help="measure nothing: write docs/accuracy.md's table from these measurements' fidelity.jsonl",
    )
    p.add_argument("--check", action="store_true", help="with --docs: exit 1 if docs/accuracy.md's table is stale")
    p.add_argument("--preset", default="tiny", choices=[n for n, x in PRESETS.items() if x.kind == "train"])
    p.add_argument("--layers", type=int, help="layers of the model (default: the preset's; 1: one layer of its shape)")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: the preset's)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches in the measured batch (default 2)")
    p.add_argument("--load", help="a coat-compare checkpoint of a BF16 run (--save): its weights; default: --seed's")
    p.add_argument("--seed", type=int, default=1, help="weights (without --load) and the batches")
    p.add_argument("--first-step", type=int, default=0, help="the data step the warm batches start at")
    p.add_argument("--warm-steps", type=int, default=8, help="earlier batches the reference's moments come from")
    p.add_argument("--configs", help=f"comma-separated configurations (default all): {', '.join(CONFIG_KEYS)}")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    if args.docs:
        return write_docs(args.docs, check=args.check)
    preset = get_preset(args.preset)
    overrides = {"layers": args.layers, "micro_batch": args.micro_batch}
    preset = replace(preset, **{k: v for k, v in overrides.items() if v is not None})
    preset = replace(preset, global_batch=preset.micro_batch * args.micro_batches, eval_every=0)
    configs = list(CONFIGS) if not args.configs else [CONFIG_KEYS.get(k.strip()) for k in args.configs.split(",")]
    if None in configs:
        unknown = [k for k in args.configs.split(",") if k.strip() not in CONFIG_KEYS]
        p.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIG_KEYS)}")
    os.makedirs(args.out, exist_ok=True)
    from . import parallel

    precise()
    with contextlib.ExitStack() as stack:
        parallel.initialize(1, 1, stack)
        parallel.seed_everything(args.seed)
        result = run(preset, configs, args.seed, args.warm_steps, args.first_step, args.load)
    lines = table(result)
    with open(os.path.join(args.out, "fidelity.jsonl"), "w") as f:
        f.writelines(
            json.dumps({**{k: v for k, v in result.items() if k != "rows"}, **row}) + "\n" for row in result["rows"]
        )
    with open(os.path.join(args.out, "fidelity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def precise() -> None:
    """FP32 matrix products in FP32 (no TF32) and deterministic kernels where torch has them."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


if __name__ == "__main__":
    sys.exit(main())
