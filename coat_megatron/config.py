"""CoatConfig: every COAT knob in one frozen dataclass, validated when it is made.

The recipe is plain data (as torchao's Float8LinearConfig and Megatron's TransformerConfig): the
layer spec, the fused ops and the optimizer read it, nothing threads flags through call chains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from coat_kernels.expanded import K_RESOLUTION
from coat_kernels.formats import FP8_FORMATS, GROUP_SIZES
from coat_kernels.gemm_accumulate import ACCUMULATE_BACKENDS

SWITCH_VALUES = {
    "true": True,
    "on": True,
    "yes": True,
    "1": True,
    "false": False,
    "off": False,
    "no": False,
    "0": False,
}
K_LIMITS = (1 / K_RESOLUTION, 64.0)
OPTIMIZER_GROUP_SIZES = (32, 64, 128, 256)
MASTER_WEIGHTS = ("fp32", "split")
GRAD_BUFFERS = ("bf16", "fp32")
INPUT_STORES = ("fp8", "bf16")


def parse_switch(value: bool | str, name: str) -> bool:
    """A bool, or one of the strings true/false, on/off, yes/no, 1/0 (any case); anything else raises.

    Strict on purpose: COAT's released configs say ``expand`` where its code accepts only
    ``true``/``expansion``, so its published runs silently trained without expansion.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in SWITCH_VALUES:
        return SWITCH_VALUES[value.strip().lower()]
    raise ValueError(f"{name}={value!r} is not a switch value: use one of {', '.join(SWITCH_VALUES)}")


@dataclass(frozen=True)
class CoatConfig:
    """The COAT recipe.

    Attributes:
        activations: FP8 activation flow in the COAT layer spec (1xG FP8 for what non-linear ops
            read or save, per-tensor FP8 GEMM inputs). False gives BF16 layers.
        optimizer: FP8 AdamW states. False keeps Megatron's own optimizer.
        group_size: G of the 1xG activation groups (16, 32, 64 or 128).
        forward_format: FP8 format of forward activations ("e4m3" or "e5m2").
        backward_format: FP8 format of activation gradients.
        weight_format: FP8 format of the per-tensor weight copies.
        m_format, v_format: FP8 formats of Adam's first and second moments.
        m_expansion, v_expansion: dynamic range expansion of m and v.
        k_min, k_max: limits of the expansion exponent k (multiples of 1/16).
        optimizer_group_size: consecutive elements of a parameter sharing one optimizer-state scale.
        fprop_fast_accumulation: Hopper's fast FP8 accumulation (no periodic promotion to full
            FP32) in the forward GEMMs, as TE's current-scaling recipe does; dgrad and wgrad
            always promote.
        recompute_norm_output: do not keep a norm's per-tensor FP8 output for the next linear's
            wgrad (its transposed copy, 1 byte per element per norm); recompute it in backward
            from the norm's saved 1xG input copy. The forward stays exact, but the wgrad operand
            then carries the 1xG rounding of the norm input as well, which costs accuracy
            (tests/megatron/test_coat_training.py measures it), so it is off by default.
        norm_input_store: what the input norms (input_layernorm, pre_mlp_layernorm) save of their
            input for backward: "fp8" (the default: the 1xG copy in ``forward_format`` with its
            scales, about 1.25 bytes per element) or "bf16" (the input itself, 2 bytes per element;
            the backward, and a recomputed norm output, then come from the exact input). "bf16" is
            an accuracy ablation, what the 1xG copy costs in gradient error
            (``coat_compare.fidelity``); its backward runs in torch arithmetic, not a fused kernel.
        swiglu_input_store: what SwiGLU saves of its input (fc1's output) for backward: "fp8" (the
            default: fc1 writes its output as 1xG FP8, which SwiGLU reads and saves, about 1.25
            bytes per element) or "bf16" (fc1 writes BF16, SwiGLU computes from it exactly and saves
            it: 2 bytes per element, as Megatron's ``activation_func_fp8_input_store`` off). An
            accuracy ablation like ``norm_input_store``; its forward and backward run in torch
            arithmetic.
        cache_weight: keep each weight's FP8 codes between micro-batches (1 byte per linear
            parameter), made once per optimizer step. False (the default, part of COAT's memory
            mode) keeps each weight's amax only and quantizes W in every forward and W^T in every
            backward from the weight with it: bit-identical results, 1 byte per parameter less,
            one more pass over each weight per micro-batch's forward and backward (its cost in
            speed: docs/results.md). Left unset (None) it
            resolves at construction: True with ``cache_weight_transpose`` on (W^T's codes are
            kept, so W's are), else False; False with ``cache_weight_transpose`` on is an error.
        cache_weight_transpose: keep each weight's transposed FP8 copy (for the dgrad GEMM) beside
            its FP8 copy between micro-batches: 2 bytes per parameter. False (the default, part of
            COAT's memory mode) keeps 1 and transposes the codes in every backward (bit-identical
            gradients: one per-tensor scale serves both layouts), a byte-transpose of each weight
            per micro-batch. True is the faster configuration where memory allows; it keeps W's
            codes too (``cache_weight`` resolves to True).
        master_weights: how COAT's optimizer keeps the FP32 master weights. "split" (the default
            with ``optimizer`` on): the BF16 model weight is the master's high half and the
            optimizer keeps an int16 low word beside it (``coat_kernels.master``): the same FP32
            master bit for bit, 2 bytes per parameter instead of 4, at the FP32 masters' speed
            (docs/results.md). The BF16 weights are
            then rounded to nearest with ties away from zero (not to even: they differ from the
            FP32 path's at exact ties, 1 in 65536 values, by one BF16 unit). Under Megatron it
            steps the BF16 shards in DDP's parameter buffer and reads DDP's gradient buffer in
            place, FP32 or BF16; with BF16 buffers (``grad_reduce_in_fp32=False``,
            ``--grad-reduce-in-bf16``) those halve too (COAT's memory mode). "fp32": an FP32 copy
            (Megatron's main params, 4 bytes per parameter): what a dp_zero_gather_scatter
            checkpoint loads into, and coat-compare's ``coat-fp32`` mode.
            Left unset (None) it resolves at construction: "split" with ``optimizer`` on, "fp32"
            with it off (Megatron's own optimizer keeps FP32 masters); an explicit "split" with
            ``optimizer`` off is an error (so ``dataclasses.replace(c, optimizer=False)`` needs
            ``master_weights=None`` too).
        grad_buffers: the dtype of Megatron DDP's gradient buffers, into which every micro-batch's
            weight gradient is summed and which the data-parallel reduction reads: "bf16" (2 bytes
            per parameter; Megatron's ``grad_reduce_in_fp32=False``) or "fp32" (4). Left unset
            (None) it resolves to "bf16" with ``optimizer`` on (COAT's memory mode: the step reads
            the BF16 buffer in place and accumulates in FP32 from there) and "fp32" with it off
            (Megatron's own default for BF16 training). A setting for whoever builds the DDP
            wrapper (``ddp_grad_reduce_in_fp32``): the COAT modules and optimizer read either.
        fuse_wgrad_accumulation: COAT's linears add each micro-batch's weight gradient into the
            weight's ``main_grad`` (Megatron DDP's gradient buffer) themselves, in the wgrad GEMM's
            output, whenever DDP gave the weight one: no BF16 wgrad tensor for Megatron to add
            afterwards. Megatron ties its own ``gradient_accumulation_fusion`` to apex's fused wgrad
            kernel; COAT's linears need no apex, so they fuse with that flag on or off. False
            leaves the addition to Megatron (the flag's behaviour).
        tp_comm_overlap: under sequence parallelism, exchange the sequence chunks of the
            column-parallel inputs, the row-parallel outputs and their gradients in a ring of
            point-to-point transfers, each overlapped with the GEMM of the chunk already in hand
            (``coat_megatron.layers.chunk_exchange``). False (the default) does the same
            arithmetic with one all-gather or reduce-scatter per exchange, which NCCL runs faster
            than its point-to-point ring on an NVLink host (docs/multi-gpu.md). Either way each
            chunk keeps its producer's per-tensor scale, so no amax is all-reduced over the
            tensor-parallel group.
        wgrad_accumulate: how a wgrad is added into a ``main_grad`` that already holds a sum (later
            micro-batches, and every micro-batch under per-layer CUDA graphs): "auto" (the GEMM
            adds it itself where cuBLASLt can, beta = 1 with no temporary; else "add"), "cublaslt"
            (always in the GEMM; an error where cuBLASLt cannot take the shape) or "add" (the
            product in an FP32 temporary, then an add: the path before the fused one, kept for
            comparisons). The CPU always adds.
        fp8_param_gather: the distributed optimizer's parameter all-gather moves each COAT
            linear's weight as FP8 codes with one per-tensor scale (1 byte per element instead of
            BF16's 2; the other parameters stay BF16), received in the idle gradient buffer, so
            no memory is added (``coat_megatron.optimizer.param_gather``). Each replica then holds
            the other ranks' shards as dequantized codes, from which the layers make the same FP8
            weight as from the exact values. Off by default (on a one-host NVLink link the BF16
            gather is cheap; docs/multi-gpu.md has the measurement). Needs COAT's optimizer and
            layers.
    """

    activations: bool = True
    optimizer: bool = True
    group_size: int = 16
    forward_format: str = "e4m3"
    backward_format: str = "e5m2"
    weight_format: str = "e4m3"
    m_format: str = "e4m3"
    v_format: str = "e4m3"
    m_expansion: bool = True
    v_expansion: bool = True
    k_min: float = 1 / 16
    k_max: float = 16.0
    optimizer_group_size: int = 128
    fprop_fast_accumulation: bool = True
    recompute_norm_output: bool = False
    norm_input_store: Literal["fp8", "bf16"] = "fp8"
    swiglu_input_store: Literal["fp8", "bf16"] = "fp8"
    cache_weight: bool | None = None
    cache_weight_transpose: bool = False
    master_weights: str | None = None
    grad_buffers: str | None = None
    fuse_wgrad_accumulation: bool = True
    tp_comm_overlap: bool = False
    wgrad_accumulate: str = "auto"
    fp8_param_gather: bool = False

    def __post_init__(self) -> None:
        for name in (
            "activations",
            "optimizer",
            "m_expansion",
            "v_expansion",
            "fprop_fast_accumulation",
            "recompute_norm_output",
            "cache_weight_transpose",
            "fuse_wgrad_accumulation",
            "tp_comm_overlap",
            "fp8_param_gather",
        ):
            object.__setattr__(self, name, parse_switch(getattr(self, name), name))
        # unset: W's codes are kept exactly where W^T's are (the cached configuration)
        cache_weight = self.cache_weight_transpose if self.cache_weight is None else self.cache_weight
        object.__setattr__(self, "cache_weight", parse_switch(cache_weight, "cache_weight"))
        if self.cache_weight_transpose and not self.cache_weight:
            raise ValueError(
                "cache_weight_transpose=True keeps W^T's FP8 codes between micro-batches, and cache_weight=False keeps "
                "no codes of the weight: set cache_weight_transpose=False with cache_weight=False "
                "(--coat-cache-weight-transpose off --coat-cache-weight off), or cache_weight=True or None (None follows "
                "cache_weight_transpose: dataclasses.replace(config, cache_weight=None, cache_weight_transpose=True))"
            )
        for name in ("forward_format", "backward_format", "weight_format", "m_format", "v_format"):
            value = getattr(self, name)
            if value not in FP8_FORMATS:
                raise ValueError(f"{name}={value!r} is not an FP8 format: use 'e4m3' or 'e5m2'")
        self._resolve_master_weights()
        self._resolve_grad_buffers()
        if self.fp8_param_gather and not (self.optimizer and self.activations):
            raise ValueError(
                "fp8_param_gather replaces the parameter gather of COAT's distributed optimizer and sends COAT linears' "
                "weights as FP8: it needs optimizer=True and activations=True (or set fp8_param_gather=False)"
            )
        _check_choice(
            "wgrad_accumulate", self.wgrad_accumulate, ACCUMULATE_BACKENDS, "'auto' adds in the GEMM where cuBLASLt can"
        )
        _check_choice("group_size", self.group_size, GROUP_SIZES, "the hidden and FFN sizes must be multiples of it")
        for name in ("norm_input_store", "swiglu_input_store"):
            _check_choice(name, getattr(self, name), INPUT_STORES, "'fp8' is COAT's 1xG copy, 'bf16' the exact input")
        _check_choice("optimizer_group_size", self.optimizer_group_size, OPTIMIZER_GROUP_SIZES, "128 is COAT's")
        for name in ("k_min", "k_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a number")
            if value * K_RESOLUTION != round(value * K_RESOLUTION):
                raise ValueError(
                    f"{name}={value} is not a multiple of 1/{K_RESOLUTION}; round it, e.g. to {round(value * K_RESOLUTION) / K_RESOLUTION}"
                )
            object.__setattr__(self, name, float(value))
        lo, hi = K_LIMITS
        if not lo <= self.k_min <= 1.0 <= self.k_max <= hi:
            raise ValueError(
                f"expansion limits k_min={self.k_min}, k_max={self.k_max} must satisfy "
                f"{lo} <= k_min <= 1 <= k_max <= {hi} (k = 1 is plain absmax scaling; defaults 1/16 and 16)"
            )

    @property
    def ddp_grad_reduce_in_fp32(self) -> bool:
        """Megatron's ``DistributedDataParallelConfig.grad_reduce_in_fp32`` for this recipe."""
        return self.grad_buffers == "fp32"

    def _resolve_grad_buffers(self) -> None:
        if self.grad_buffers is None:
            object.__setattr__(self, "grad_buffers", "bf16" if self.optimizer else "fp32")
            return
        _check_choice(
            "grad_buffers", self.grad_buffers, GRAD_BUFFERS, "'bf16' keeps 2 bytes per parameter instead of 4"
        )

    def _resolve_master_weights(self) -> None:
        if self.master_weights is None:  # the default: split where COAT's optimizer keeps the masters
            object.__setattr__(self, "master_weights", "split" if self.optimizer else "fp32")
            return
        _check_choice(
            "master_weights", self.master_weights, MASTER_WEIGHTS, "'split' keeps 2 bytes per parameter instead of 4"
        )
        if self.master_weights == "split" and not self.optimizer:
            raise ValueError(
                "master_weights='split' keeps the masters' low words in COAT's optimizer, and optimizer=False uses "
                "Megatron's, whose masters are FP32: drop master_weights='split' (or set master_weights='fp32'), or set optimizer=True"
            )

    @property
    def any_enabled(self) -> bool:
        return self.activations or self.optimizer

    @classmethod
    def from_args(cls, args) -> "CoatConfig":
        """Build from parsed ``--coat-*`` arguments (an argparse namespace); absent ones keep their defaults."""
        values = {}
        for f in fields(cls):
            attr = f"coat_{f.name}"
            if getattr(args, attr, None) is not None:
                values[f.name] = getattr(args, attr)
        if getattr(args, "coat_expansion", None) is not None:
            both = parse_switch(args.coat_expansion, "--coat-expansion")
            values.setdefault("m_expansion", both)
            values.setdefault("v_expansion", both)
        return cls(**values)


def _check_choice(name: str, value, choices, why: str) -> None:
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name}={value!r} is not supported: use one of {', '.join(map(str, choices))} ({why})")
