"""CoatConfig: every COAT knob in one frozen dataclass, validated when it is made.

The recipe is plain data (as torchao's Float8LinearConfig and Megatron's TransformerConfig): the
layer spec, the fused ops and the optimizer read it, nothing threads flags through call chains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

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


def knob(default, help: str, choices: tuple | None = None):
    """A ``CoatConfig`` field with its one description (``help``), which the ``--coat-*`` flag's
    help, ``coat-megatron-run --help`` and docs/flags.md print; ``choices``: the values it takes."""
    return field(default=default, metadata={"help": help, "choices": choices})


def knob_help(name: str) -> str:
    """The description of ``CoatConfig`` field ``name``."""
    return CoatConfig.__dataclass_fields__[name].metadata["help"]


def knob_choices(name: str) -> tuple | None:
    """The values ``CoatConfig`` field ``name`` takes, where they are a fixed set."""
    return CoatConfig.__dataclass_fields__[name].metadata["choices"]


@dataclass(frozen=True)
class CoatConfig:
    """The COAT recipe: each field below is one knob, with one description (``knob_help(name)``),
    and the command-line flag ``--coat-<field with dashes>`` (docs/flags.md lists them all with
    their defaults). Switches take True/False or on/off, yes/no, 1/0. The defaults are COAT's
    memory recipe; ``CoatConfig`` checks every combination when it is made and names the fix.
    """

    activations: bool = knob(
        True,
        "FP8 activations: the COAT layer spec (1xG FP8 for what non-linear ops read or save, per-tensor FP8 GEMM "
        "inputs); off keeps BF16 layers (default on)",
    )
    optimizer: bool = knob(
        True,
        "FP8 AdamW states on the distributed optimizer's shards; off keeps Megatron's own optimizer (default on)",
    )
    group_size: int = knob(
        16, "G of the 1xG FP8 groups of what non-linear ops read or save (default 16)", choices=GROUP_SIZES
    )
    forward_format: str = knob("e4m3", "FP8 format of forward activations (default e4m3)", choices=tuple(FP8_FORMATS))
    backward_format: str = knob("e5m2", "FP8 format of activation gradients (default e5m2)", choices=tuple(FP8_FORMATS))
    weight_format: str = knob(
        "e4m3", "FP8 format of the per-tensor weight copies (default e4m3)", choices=tuple(FP8_FORMATS)
    )
    m_format: str = knob("e4m3", "FP8 format of Adam's first moment (default e4m3)", choices=tuple(FP8_FORMATS))
    v_format: str = knob("e4m3", "FP8 format of Adam's second moment (default e4m3)", choices=tuple(FP8_FORMATS))
    m_expansion: bool = knob(True, "dynamic range expansion of m (default on)")
    v_expansion: bool = knob(True, "dynamic range expansion of v (default on)")
    k_min: float = knob(1 / 16, "smallest expansion exponent k, a multiple of 1/16 (default 1/16)")
    k_max: float = knob(16.0, "largest expansion exponent k, a multiple of 1/16, at most 64 (default 16)")
    optimizer_group_size: int = knob(
        128,
        "consecutive elements of a parameter sharing one optimizer-state scale (default 128)",
        choices=OPTIMIZER_GROUP_SIZES,
    )
    fprop_fast_accumulation: bool = knob(
        True,
        "Hopper's fast FP8 accumulation (no periodic promotion to full FP32) in forward GEMMs, as TE's current-scaling "
        "recipe does; dgrad and wgrad always promote (default on)",
    )
    recompute_norm_output: bool = knob(
        False,
        "recompute the norms' per-tensor FP8 outputs for the next linear's wgrad from the norm's saved 1xG input "
        "instead of keeping them (1 byte per element per norm less); the wgrad operand then carries the 1xG rounding "
        "too (default off; costs accuracy: tests/megatron/test_coat_training.py)",
    )
    norm_input_store: str = knob(
        "fp8",
        "what the input norms save of their input for backward (default fp8: the 1xG FP8 copy, about 1.25 bytes per "
        "element); bf16: the input itself (2 bytes), for an exact norm backward in torch arithmetic: an accuracy "
        "ablation (coat_compare.fidelity)",
        choices=INPUT_STORES,
    )
    swiglu_input_store: str = knob(
        "fp8",
        "what SwiGLU saves of its input, fc1's output (default fp8: fc1 writes it as 1xG FP8, about 1.25 bytes per "
        "element); bf16: fc1 writes BF16, which SwiGLU reads exactly and saves (2 bytes, as Megatron's "
        "activation_func_fp8_input_store off), in torch arithmetic: an accuracy ablation",
        choices=INPUT_STORES,
    )
    cache_weight: bool | None = knob(
        None,
        "keep each weight's FP8 codes between micro-batches (on: 1 byte per parameter more, W quantized once per "
        "step). Default off (on with cache_weight_transpose on, which keeps W's codes too; off beside it is an "
        "error): keep only each weight's amax and quantize W in every forward and W^T in every backward from the "
        "weight (bit-identical results, one more pass over each weight per micro-batch)",
    )
    cache_weight_transpose: bool = knob(
        False,
        "keep each weight's transposed FP8 copy between micro-batches (default off: W^T made from the codes in every "
        "backward, bit-identical, one scale serving both layouts; on: the fastest configuration, W's and W^T's "
        "codes kept, 2 bytes per parameter more than the default)",
    )
    master_weights: str | None = knob(
        None,
        "how COAT's optimizer keeps the FP32 master weights: as the BF16 weight plus an int16 low word (split, the "
        "default with COAT's optimizer: the same FP32 master bit for bit in 2 bytes per parameter less; the BF16 "
        "weights round to nearest with ties away from zero) or as an FP32 copy (fp32: what dp_zero_gather_scatter "
        "checkpoints load into; the default with optimizer off, where Megatron's optimizer keeps FP32 masters and "
        "split is an error)",
        choices=MASTER_WEIGHTS,
    )
    grad_buffers: str | None = knob(
        None,
        "dtype of DDP's gradient buffers, where micro-batch gradients are summed and reduced: bf16 (the default with "
        "COAT's optimizer: 2 bytes per parameter; the step accumulates in FP32 from there) or fp32 (4; Megatron's "
        "default, and the default with optimizer off). Sets Megatron's --accumulate-allreduce-grads-in-fp32 / "
        "--grad-reduce-in-bf16",
        choices=GRAD_BUFFERS,
    )
    fuse_wgrad_accumulation: bool = knob(
        True,
        "COAT's linears add each micro-batch's weight gradient into DDP's gradient buffer inside the wgrad GEMM, with "
        "or without apex (--no-gradient-accumulation-fusion governs Megatron's own linears only). Default on; off "
        "leaves the addition to Megatron",
    )
    fuse_residual_backward: bool = knob(
        True,
        "COAT's input norms also return their input as the layer's residual (Megatron's (output, residual) norm "
        "output), so that their backward adds the residual branch's gradient to dx in its own pass, rounded as "
        "autograd would, and finds the sum's amax there for the linear that quantizes it next: the same bits, two "
        "launches fewer per layer (the sum) and no amax pass for linear_proj's and linear_fc2's dY. Default on; off "
        "where Megatron recomputes the norms (recompute_modules layernorm), which needs a norm of one output",
    )
    tp_comm_overlap: bool = knob(
        False,
        "with sequence parallelism, pass the sequence chunks between tensor-parallel ranks in a ring of "
        "point-to-point transfers, each behind the GEMM of the chunk in hand (coat_megatron.layers.chunk_exchange); "
        "off (the default): the same arithmetic with one all-gather or reduce-scatter per exchange, which ran "
        "faster on an NVLink host (docs/multi-gpu.md). Either way each chunk keeps its producer's per-tensor scale",
    )
    wgrad_accumulate: str = knob(
        "auto",
        "how COAT's linears add a weight gradient into a gradient buffer that already holds a sum, in later "
        "micro-batches and in every micro-batch under per-layer CUDA graphs (default auto: inside the GEMM where "
        "cuBLASLt can, else through an FP32 temporary and an add); cublaslt: always inside the GEMM; add: always the "
        "temporary and the add, for comparisons. The CPU always adds",
        choices=ACCUMULATE_BACKENDS,
    )
    scratch_buffers: bool | None = knob(
        None,
        "eager COAT layers take the buffers they write and read within one call (gathered codes, partial sums, W's "
        "and W^T's codes in the memory recipe, transposed operands, amax tiles) from reused scratch buffers, one per "
        "call site, instead of the caching allocator (coat_kernels.workspace): 51 fewer allocations per layer and "
        "micro-batch at TP 2, the same values bit for bit, the buffers held between uses. Default auto: on where the "
        "layers run eagerly at tensor parallelism (one Llama-2-7B layer at TP 2 + SP ran 1.17x as fast with them on "
        "two H200s), off on one GPU (not shown to pay there) and with CUDA graphs, whose capture allocates once "
        "(docs/multi-gpu.md)",
    )
    fp8_param_gather: bool = knob(
        False,
        "the distributed optimizer's parameter all-gather sends COAT linears' weights as FP8 codes with one scale per "
        "weight (1 byte per element instead of 2; other parameters stay BF16), received in the idle gradient buffer "
        "(no memory added; coat_megatron.optimizer.param_gather). Needs COAT's optimizer and layers. Default off",
    )

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
            "fuse_residual_backward",
            "tp_comm_overlap",
            "fp8_param_gather",
        ):
            object.__setattr__(self, name, parse_switch(getattr(self, name), name))
        if self.scratch_buffers is not None:  # None: auto, decided per model by for_layers
            object.__setattr__(self, "scratch_buffers", parse_switch(self.scratch_buffers, "scratch_buffers"))
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
    def recipe(cls, name: str, **changes) -> "CoatConfig":
        """The named recipe (``RECIPES``: memory, the default; codes; cached; fp32-grads; fp32;
        recompute), with ``changes`` to any field on top."""
        if name not in RECIPES:
            raise ValueError(f"recipe={name!r} is not a COAT recipe: use one of {', '.join(RECIPES)}")
        return cls(**{**RECIPES[name][0], **changes})

    def for_layers(self, config) -> "CoatConfig":
        """This recipe as the layers of a model of Megatron ``TransformerConfig`` ``config`` run it, each
        choice left to the layout made: ``scratch_buffers`` None (auto) is on where the layers run eagerly at
        tensor parallelism, where the host pays for every allocation, and off elsewhere (one GPU; CUDA
        graphs, whose capture allocates once, where scratch buffers would only hold memory)."""
        if self.scratch_buffers is not None:
            return self
        tensor_parallel = (getattr(config, "tensor_model_parallel_size", 1) or 1) > 1
        graphs = getattr(config, "cuda_graph_impl", "none") not in (None, "none") or any(
            getattr(config, name, False) for name in ("enable_cuda_graph", "external_cuda_graph")
        )
        return replace(self, scratch_buffers=tensor_parallel and not graphs)

    @classmethod
    def from_args(cls, args) -> "CoatConfig":
        """Build from parsed ``--coat-*`` arguments (an argparse namespace): ``--coat-recipe``'s
        recipe (memory when absent), each ``--coat-<field>`` given on top of it."""
        values = {}
        for f in fields(cls):
            attr = f"coat_{f.name}"
            if getattr(args, attr, None) is not None:
                values[f.name] = getattr(args, attr)
        if getattr(args, "coat_expansion", None) is not None:
            both = parse_switch(args.coat_expansion, "--coat-expansion")
            values.setdefault("m_expansion", both)
            values.setdefault("v_expansion", both)
        return cls.recipe(getattr(args, "coat_recipe", None) or DEFAULT_RECIPE, **values)


# The named recipes: name -> (the fields that differ from CoatConfig(), what it is for). Each is one
# --coat-recipe NAME (coat-megatron-run), CoatConfig.recipe(NAME) (Python) and the comparison tool's
# mode coat-NAME (coat for memory); bytes per parameter are between steps, as --coat-report counts them.
DEFAULT_RECIPE = "memory"
RECIPES: dict[str, tuple[dict, str]] = {
    "memory": (
        {},
        "the default: split master weights (the BF16 weight + an int16 low word), BF16 gradient buffers, no FP8 "
        "weight codes kept between micro-batches (8.19 bytes per parameter on gpt-1b)",
    ),
    "codes": (
        {"cache_weight": True},
        "memory, keeping each weight's FP8 codes between micro-batches: +1 byte per linear weight",
    ),
    "cached": (
        {"cache_weight_transpose": True},
        "memory, keeping W's and W^T's FP8 codes between micro-batches: +2 bytes per linear weight, the fastest",
    ),
    "fp32-grads": ({"grad_buffers": "fp32"}, "memory with FP32 gradient buffers: +2 bytes"),
    "fp32": (
        {"master_weights": "fp32", "grad_buffers": "fp32", "cache_weight_transpose": True},
        "every byte back: an FP32 master copy and FP32 gradient buffers (+4 bytes), W's and W^T's codes cached (+2 per linear weight)",
    ),
    "recompute": (
        {"recompute_norm_output": True},
        "memory, recomputing the norms' FP8 outputs in backward instead of keeping them: less activation memory, "
        "less accuracy",
    ),
}


def _check_choice(name: str, value, choices, why: str) -> None:
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name}={value!r} is not supported: use one of {', '.join(map(str, choices))} ({why})")
