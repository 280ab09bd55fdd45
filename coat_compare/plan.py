"""Sizes on paper for layouts no GPU here has run yet (eight GPUs: docs/multi-gpu.md, "Eight GPUs").

Per preset, layout and mode: what each GPU holds between steps (``memory.expected_bytes_per_param``,
sharded as Megatron shards it: weights and gradient buffers over TP x PP, master weights and Adam
states over TP x PP x DP by the distributed optimizer; TE FP8's own FP8 weight copies on top), the
activations one micro-batch keeps (per layer and token, measured on one Llama-2-7B layer, times the
layers a pipeline stage keeps in flight), the output layer's logits, and from those the largest
micro-batch that fits a GPU. These are projections, checked against the eager runs in
``ANCHORS`` (``python -m coat_compare.plan --anchors``), never measurements: a GPU run replaces them.

    python -m coat_compare.plan [--presets llama2-7b,llama2-13b,llama-30b] [--layouts dp8,tp2xdp4,tp2xpp2xdp2]
        [--modes bf16,te-fp8-current,coat] [--gpu-gib 79] [--anchors]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from .flops import matmul_parameters
from .layouts import layout_name, parse_layouts
from .memory import expected_bytes_per_param
from .modes import MODES
from .presets import Preset, get_preset

GIB = 2**30
# Activations one transformer layer keeps for its backward, bytes per token and per unit of hidden
# size: one Llama-2-7B layer at seq 2048 x micro-batch 4 on an H100 (benchmarks/results/
# layer-llama2-7b-1gpu/reports.md, section h100/llama2-7b-layer.md: 965.1, 815.1 and 616.1 MiB
# over 8192 tokens x 4096).
# The Llama shapes keep FFN / hidden at about 2.7, so the figure carries over to 13B and 30B.
ACTIVATION_BYTES = {"bf16": 30.16, "te-fp8-current": 25.47, "coat": 19.25}
# TE FP8's FP8 weight copies, bytes per parameter of a shard (measured: "+2.04 other" in
# benchmarks/results/llama2-7b-tp2dp2-4gpu): held like the weights, split over TP x PP.
EXTRA_BYTES = {"te-fp8-current": 2.04}
LOGIT_BYTES = 10  # per token and vocabulary entry: BF16 logits, and the FP32 softmax of the loss
OTHER_GIB = 2.0  # workspaces, NCCL buffers, the allocator's fragments: kept free beside the sum


@dataclass(frozen=True)
class Anchor:
    """A measured eager peak (allocated) that the projection is checked against."""

    preset: str
    layout: str
    micro_batch: int
    mode: str
    peak_mib: float
    source: str


ANCHORS = (
    Anchor("llama2-7b", "tp2xdp2", 1, "bf16", 43209, "llama2-7b-tp2dp2-4gpu (eager, 4 x H100)"),
    Anchor("llama2-7b", "tp2xdp2", 1, "te-fp8-current", 48785, "llama2-7b-tp2dp2-4gpu (eager, 4 x H100)"),
    Anchor("llama2-7b", "tp2xdp2", 1, "coat", 22401, "llama2-7b-tp2dp2-4gpu (eager, 4 x H100)"),
    Anchor("llama2-7b", "1", 16, "coat", 138356, "llama2-7b-max-batch-1gpu (eager, H200)"),
    Anchor("llama2-13b", "1", 2, "coat", 115.3 * 1024, "llama2-13b-1gpu (eager, H200)"),
)


@dataclass(frozen=True)
class Size:
    """One projection: GiB per GPU, every pipeline stage alike (the embedding and the output layer
    spread over the stages: Megatron puts them on the first and the last, which therefore hold a
    little more; the logits are counted on every stage)."""

    static_gib: float
    activation_gib_per_micro_batch: float

    def at(self, micro_batch: int) -> float:
        return self.static_gib + micro_batch * self.activation_gib_per_micro_batch

    def largest_micro_batch(self, gpu_gib: float, most: int = 64) -> int:
        room = gpu_gib - OTHER_GIB - self.static_gib
        return max(0, min(most, math.floor(room / self.activation_gib_per_micro_batch)))


def size(preset: Preset, mode: str, tp: int, pp: int, dp: int) -> Size:
    """What one GPU of the layout holds, by ``mode`` (a key of ``ACTIVATION_BYTES``)."""
    if mode not in ACTIVATION_BYTES:
        raise ValueError(f"mode {mode!r}: the plan has activation figures for {', '.join(ACTIVATION_BYTES)} only")
    params = matmul_parameters(preset) + preset.vocab * preset.hidden  # with the input embedding
    parts = expected_bytes_per_param(MODES[mode])
    sharded = parts["master_weights"] + parts["states"]
    held = parts["weights"] + parts["fp8_copies"] + parts["grads"] + EXTRA_BYTES.get(mode, 0.0)
    static = params * (held / (tp * pp) + sharded / (tp * pp * dp))
    # 1F1B: the first stage keeps pp micro-batches of its layers / pp layers in flight, as many
    # layer-micro-batches as one GPU without PP; sequence parallelism splits each over TP
    tokens = preset.seq
    layers = preset.layers * ACTIVATION_BYTES[mode] * preset.hidden * tokens / tp
    logits = LOGIT_BYTES * preset.vocab * tokens / tp
    return Size(static / GIB, (layers + logits) / GIB)


def check(preset: Preset, tp: int, pp: int) -> str:
    """Why the layout cannot split the preset, or ''."""
    if preset.heads % tp:
        return f"{preset.heads} heads do not split over TP {tp}"
    if preset.layers % pp:
        return f"{preset.layers} layers do not split over PP {pp}"
    return ""


def table(presets: list[str], layouts: str, modes: list[str], gpu_gib: float) -> list[str]:
    lines = [
        f"Projected per GPU of {gpu_gib:g} GiB ({OTHER_GIB:g} GiB kept free): GiB held between steps, GiB per "
        "micro-batch (activations and logits, seq 2048), and the largest micro-batch that fits (0: none).",
        "",
        "| preset | params | layout | mode | held GiB | GiB per micro-batch | largest micro-batch | GiB at it |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for name in presets:
        preset = get_preset(name)
        params = (matmul_parameters(preset) + preset.vocab * preset.hidden) / 1e9
        for tp, pp, _, dp in parse_layouts(layouts):
            why = check(preset, tp, pp)
            for mode in modes:
                where = layout_name(tp, pp, 1, dp)
                if why:
                    lines.append(f"| {name} | {params:.1f}B | {where} | {mode} | | | {why} | |")
                    continue
                s = size(preset, mode, tp, pp, dp)
                mb = s.largest_micro_batch(gpu_gib)
                at = f"{s.at(mb):.1f}" if mb else ""
                lines.append(
                    f"| {name} | {params:.1f}B | {where} | {mode} | {s.static_gib:.1f} | "
                    f"{s.activation_gib_per_micro_batch:.2f} | {mb} | {at} |"
                )
    return lines


def anchor_table() -> list[str]:
    lines = [
        "The projection against measured eager peaks (allocated):",
        "",
        "| preset | layout | micro-batch | mode | measured MiB | projected MiB | projected / measured | source |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for a in ANCHORS:
        ((tp, pp, _, dp),) = parse_layouts(a.layout)
        projected = size(get_preset(a.preset), a.mode, tp, pp, dp).at(a.micro_batch) * 1024
        lines.append(
            f"| {a.preset} | {a.layout} | {a.micro_batch} | {a.mode} | {a.peak_mib:.0f} | {projected:.0f} | "
            f"{projected / a.peak_mib:.3f} | {a.source} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coat_compare.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--presets", default="llama2-7b,llama2-13b,llama-30b")
    p.add_argument("--layouts", default="dp8,tp2xdp4,tp2xpp2xdp2,tp4xdp2,tp8,tp2xpp4,tp4xpp2")
    p.add_argument("--modes", default="bf16,te-fp8-current,coat")
    p.add_argument("--gpu-gib", type=float, default=79.0, help="the GPU's memory (an 80 GB H100 has 79.1 GiB)")
    p.add_argument("--anchors", action="store_true", help="also the projection against measured eager peaks")
    args = p.parse_args(argv)
    try:
        lines = table(args.presets.split(","), args.layouts, args.modes.split(","), args.gpu_gib)
    except ValueError as e:
        p.exit(2, f"python -m coat_compare.plan: error: {e}\n")
    if args.anchors:
        lines += ["", *anchor_table()]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
