"""The training recipes a comparison runs side by side, as plain data.

=================  ===========================================================================
mode               what it is
=================  ===========================================================================
bf16               BF16 with TransformerEngine's layer spec where TE is installed (Megatron's
                   fastest BF16), else Megatron's local spec
bf16-local         BF16, Megatron's local spec (no TE; unfused attention)
te-fp8-delayed     TE FP8, delayed scaling (amax history)
te-fp8-current     TE FP8, current (per-tensor, just-in-time) scaling; ``te-fp8`` is this one
te-fp8-block       TE FP8, 1x128 / 128x128 block scaling (DeepSeek-V3 style; TE >= 2.3, Hopper)
te-fp8-store       te-fp8-current + Megatron's ``activation_func_fp8_input_store`` (the SwiGLU
                   input saved as FP8)
te-fp8-pa          te-fp8-current + Megatron's precision-aware optimizer with FP8 Adam states
                   (TE FusedAdam, ``exp_avg_dtype = exp_avg_sq_dtype = torch.uint8``, FP32 main
                   params)
coat               COAT's default recipe (``CoatConfig()``): the COAT layer spec and COAT's FP8
                   AdamW (``get_coat_optimizer``) with split master weights (the BF16 weight + an
                   int16 low word), BF16 gradient buffers, and no FP8 weight codes kept between
                   micro-batches (each weight's amax only: W quantized in every forward, W^T in
                   every backward): COAT's memory mode. ``coat-mem`` and ``coat-min`` are this one
coat-codes         coat keeping each weight's FP8 codes between micro-batches (``cache_weight=True``;
                   W^T transposed from them per backward): 1 byte per parameter more (the default
                   before benchmarks/results/gpt-1b-default-vs-cached-1gpu)
coat-cached        coat keeping W's and W^T's FP8 codes between micro-batches
                   (``cache_weight_transpose=True``): the fastest, 2 bytes per parameter more
coat-fp32-grads    coat with FP32 gradient buffers (``grad_buffers="fp32"``): micro-batch
                   gradients summed in FP32, 2 bytes per parameter more
coat-fp32          coat with every byte back: an FP32 copy of the master weights
                   (``master_weights="fp32"``), FP32 gradient buffers and cached W^T
coat-recompute     coat with ``recompute_norm_output=True`` (opt-in: less memory, less accuracy)
coat-tp-ring       coat with ``tp_comm_overlap=True``: under sequence parallelism each chunk exchange
                   is a ring of point-to-point transfers overlapped with the GEMMs instead of one
                   collective (the same arithmetic): what the overlap is worth
coat-fp8-gather    coat with ``fp8_param_gather=True``: the distributed optimizer's parameter all-gather
                   sends COAT linears' weights as FP8 codes (1 byte per element instead of 2); the
                   same training (bit for bit on the CPU), fewer bytes over data parallelism
coat-scratch       coat with ``scratch_buffers=True``: what a call writes and reads before it returns
                   taken from reused buffers instead of the allocator (the same numbers, bit for
                   bit): what the reuse is worth in host time and costs in memory. coat's default
                   (auto) is this where the layers run eagerly at tensor parallelism
coat-no-scratch    coat with ``scratch_buffers=False``: every call allocates, eager TP included
coat-unfused-residual  coat with ``fuse_residual_backward=False``: the norms return one output and
                   autograd sums the residual stream's gradient (the same numbers, bit for bit):
                   what the norms' fused residual backward is worth
coat-act           ablation: the COAT layer spec with Megatron's Adam (FP32 states and masters,
                   FP32 gradient buffers)
coat-opt           ablation: the bf16 mode's layer spec with COAT's FP8 AdamW (its default
                   master weights and gradient buffers)
coat-opt-states    ablation: coat-opt with an FP32 master copy and FP32 gradient buffers: the
                   FP8 Adam states alone
bf16-grads         ablation: bf16 with BF16 gradient buffers (Megatron's Adam, FP32 states and
                   masters): the BF16 sum of micro-batch gradients alone
=================  ===========================================================================

Every mode trains with the same TransformerConfig shape, data, seed, optimizer hyper-parameters
and DDP settings (the distributed optimizer; FP32 gradient buffers unless the mode's CoatConfig
says BF16); only the fields below differ. ``coat-lean`` (the former name of the transposed copy
made per backward, now the default) is refused with the names to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from coat_megatron.config import DEFAULT_RECIPE, RECIPES, CoatConfig
from coat_megatron.optional import transformer_engine_available


@dataclass(frozen=True)
class Mode:
    """Attributes:
    name: what ``--modes`` takes.
    spec: "te" (TE's layer spec), "local" (Megatron's), "coat", or "best-bf16" (te if TE
        imports, else local).
    family: "bf16", "te-fp8" or "coat": what the report's ratios compare.
    fp8_recipe: Megatron's ``TransformerConfig.fp8_recipe`` for TE FP8 ("delayed",
        "tensorwise", "blockwise"), None for no TE FP8.
    fp8_input_store: Megatron's ``activation_func_fp8_input_store``.
    precision_aware: Megatron's precision-aware optimizer with FP8 (uint8) Adam states.
    coat: the COAT recipe of the mode's COAT parts (the layer spec where ``spec`` is "coat";
        COAT's FP8 AdamW where ``coat.optimizer``; DDP's gradient buffers ``coat.grad_buffers``);
        None for a mode without any (Megatron's Adam, FP32 gradient buffers).
    wgrad_fusion: each linear adds its weight gradient into DDP's buffer inside its GEMM (TE's
        ``fuse_wgrad_accumulation``, COAT's ``CoatConfig.fuse_wgrad_accumulation``); False
        (``coat-compare --wgrad-fusion off``) leaves the addition to Megatron in every mode.
    """

    name: str
    spec: str
    family: str
    fp8_recipe: str | None = None
    fp8_input_store: bool = False
    precision_aware: bool = False
    coat: CoatConfig | None = None
    wgrad_fusion: bool = True

    @property
    def coat_optimizer(self) -> bool:
        """COAT's FP8 AdamW instead of Megatron's Adam."""
        return self.coat is not None and self.coat.optimizer

    def coat_config(self) -> CoatConfig:
        """The CoatConfig of this mode's COAT parts (for modes without any: the optimizer off),
        with ``wgrad_fusion`` applied."""
        config = self.coat if self.coat is not None else CoatConfig(optimizer=False)
        return config if self.wgrad_fusion else replace(config, fuse_wgrad_accumulation=False)

    @property
    def grad_fp32(self) -> bool:
        """DDP's ``grad_reduce_in_fp32``: the mode's CoatConfig decides where it has one; every
        other mode keeps Megatron's FP32 gradient buffers."""
        return True if self.coat is None else self.coat.ddp_grad_reduce_in_fp32

    @property
    def needs_transformer_engine(self) -> bool:
        return self.spec == "te" or self.fp8_recipe is not None or self.precision_aware

    def resolved_spec(self) -> str:
        """The layer spec this mode builds here ("best-bf16" resolved by whether TE imports)."""
        if self.spec == "best-bf16":
            return "te" if transformer_engine_available() else "local"
        return self.spec


MODES: dict[str, Mode] = {
    m.name: m
    for m in [
        Mode("bf16", "best-bf16", "bf16"),
        Mode("bf16-local", "local", "bf16"),
        Mode("te-fp8-delayed", "te", "te-fp8", fp8_recipe="delayed"),
        Mode("te-fp8-current", "te", "te-fp8", fp8_recipe="tensorwise"),
        Mode("te-fp8-block", "te", "te-fp8", fp8_recipe="blockwise"),
        Mode("te-fp8-store", "te", "te-fp8", fp8_recipe="tensorwise", fp8_input_store=True),
        Mode("te-fp8-pa", "te", "te-fp8", fp8_recipe="tensorwise", precision_aware=True),
        # the product's named recipes (coat_megatron.config.RECIPES): coat is memory, the default
        *(
            Mode("coat" if name == DEFAULT_RECIPE else f"coat-{name}", "coat", "coat", coat=CoatConfig.recipe(name))
            for name in RECIPES
        ),
        Mode("coat-tp-ring", "coat", "coat", coat=CoatConfig(tp_comm_overlap=True)),
        Mode("coat-fp8-gather", "coat", "coat", coat=CoatConfig(fp8_param_gather=True)),
        Mode("coat-scratch", "coat", "coat", coat=CoatConfig(scratch_buffers=True)),
        Mode("coat-no-scratch", "coat", "coat", coat=CoatConfig(scratch_buffers=False)),
        Mode("coat-unfused-residual", "coat", "coat", coat=CoatConfig(fuse_residual_backward=False)),
        Mode("coat-act", "coat", "coat", coat=CoatConfig(optimizer=False)),
        Mode("coat-opt", "best-bf16", "coat", coat=CoatConfig()),
        Mode("coat-opt-states", "best-bf16", "coat", coat=CoatConfig(master_weights="fp32", grad_buffers="fp32")),
        Mode("bf16-grads", "best-bf16", "coat", coat=CoatConfig(optimizer=False, grad_buffers="bf16")),
    ]
}
ALIASES = {"te-fp8": "te-fp8-current", "coat-mem": "coat", "coat-min": "coat"}
# former mode names whose recipe changed meaning: refused, naming what to use now
RETIRED = {
    "coat-lean": "coat-lean (the weight's transposed FP8 copy made per backward) is part of the default now: use coat "
    "(BF16 gradient buffers) or coat-fp32-grads (the former coat-lean: FP32 gradient buffers)",
}
# What each COAT part costs or saves on its own (ablations of an accuracy gap: coat-compare --modes).
# Not in "all": for one layer coat-act is coat and the others are bf16. coat-opt's parts: its FP8
# states (coat-opt-states), its BF16 gradient sum (bf16-grads) and its split masters (the rest).
ABLATIONS = ("coat-act", "coat-opt", "coat-opt-states", "bf16-grads")
# Not in "all" either: without tensor parallelism coat-tp-ring is coat, run twice, and without data
# parallelism so is coat-fp8-gather.
# Nor coat-scratch and coat-no-scratch, which are coat (the same numbers) taking what it allocates from reused
# buffers or not, nor coat-unfused-residual (the same numbers again, with autograd's sum of the residual gradient).
PARALLEL_VARIANTS = ("coat-tp-ring", "coat-fp8-gather", "coat-scratch", "coat-no-scratch", "coat-unfused-residual")
DEFAULT_MODES = [
    "bf16",
    "te-fp8-delayed",
    "te-fp8-current",
    "te-fp8-block",
    "te-fp8-store",
    "te-fp8-pa",
    "coat",
    "coat-cached",
]


def parse_modes(text: str) -> list[Mode]:
    """``"bf16,te-fp8,coat"`` -> Modes, aliases resolved, duplicates dropped, order kept; ``"all"``
    is every mode but the ablations and the tensor-parallel variants."""
    if text.strip() == "all":
        return [m for m in MODES.values() if m.name not in (*ABLATIONS, *PARALLEL_VARIANTS)]
    names = []
    for raw in text.split(","):
        name = ALIASES.get(raw.strip(), raw.strip())
        if name in RETIRED:
            raise ValueError(RETIRED[name])
        if name not in MODES:
            raise ValueError(
                f"unknown mode {raw.strip()!r}; choose from {', '.join([*MODES, *ALIASES])} (comma-separated) or 'all'"
            )
        if name not in names:
            names.append(name)
    return [MODES[n] for n in names]


def unavailable_reason(mode: Mode, kind: str) -> str | None:
    """Why ``mode`` cannot run here for a preset of ``kind`` ("layer" or "train"), or None."""
    if kind == "layer" and mode.precision_aware:
        return "the precision-aware optimizer changes optimizer states only: measured by the end-to-end presets"
    if kind == "layer" and mode.name in ABLATIONS:
        return (
            f"{mode.name} separates the layers from the optimizer: an end-to-end ablation (one layer has no optimizer)"
        )
    if mode.needs_transformer_engine and not transformer_engine_available():
        return f"{mode.name} needs TransformerEngine (not installed, or it does not import): pip install -e '.[te]'"
    fp8 = mode.fp8_recipe is not None or mode.spec == "coat" or mode.coat_optimizer
    if fp8 and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        return f"{mode.name} needs FP8 tensor cores (compute capability >= 8.9); this GPU is {torch.cuda.get_device_name()}"
    if mode.fp8_recipe is not None and not torch.cuda.is_available():
        return f"{mode.name} runs TransformerEngine's FP8 GEMMs, which need a CUDA GPU"
    if mode.fp8_recipe == "blockwise":
        return _block_scaling_unsupported()
    return None


def why_not_here(preset, mode: Mode) -> str | None:
    """Why ``mode`` cannot run ``preset`` on this machine, or None."""
    reason = unavailable_reason(mode, preset.kind)
    if reason is None and preset.needs_gpu and not torch.cuda.is_available():
        reason = f"preset {preset.name} needs a CUDA GPU; on a CPU run --preset tiny (or tiny-layer)"
    return reason


def _block_scaling_unsupported() -> str | None:
    from megatron.core.utils import is_te_min_version

    if not is_te_min_version("2.3.0.dev0"):
        return "te-fp8-block needs TransformerEngine >= 2.3 (blockwise FP8 recipe)"
    try:  # TE's own check (Hopper only in TE 2.x); its module moved between releases
        from transformer_engine.pytorch import fp8 as te_fp8
    except ImportError:
        return None
    check = getattr(te_fp8, "check_fp8_block_scaling_support", None)
    if check is not None:
        ok, reason = check()
        if not ok:
            return f"te-fp8-block: {reason}"
    return None
