"""``--coat-fp8`` and the ``--coat-*`` knobs on Megatron's own argument parser, and their validation.

Megatron-LM's ``pretrain_gpt.py`` passes its own ``extra_args_provider`` (and from megatron-core
0.18 ``pretrain()`` takes none), so an unmodified script cannot receive new flags that way. What
every script does call is ``megatron.training.arguments.parse_args``, which looks up
``add_megatron_arguments`` in its module at call time, and ``parse_and_validate_args``, which looks
up ``validate_args`` the same way. ``install`` wraps both: the first adds the COAT argument group,
the second runs COAT's checks after Megatron's own (so that derived values such as
``ffn_hidden_size`` are final) and fails with every problem found and the flag that fixes it.

The knobs are made from ``CoatConfig``'s fields, one flag per field (``--coat-group-size`` ->
``group_size``) with the field's one description as its help; each defaults to None, meaning
"CoatConfig's default". The run's ``CoatConfig`` is built once, by ``check_coat_args`` where
Megatron validates the arguments, and read by everything else through ``coat_config_from_args``.

Two options are the launcher's, not ``CoatConfig``'s: ``--coat-report`` and ``--coat-cuda-graphs``.
With ``--coat-fp8`` on a GPU, Megatron's per-layer CUDA graphs are on by default where they are
known to be safe (``cuda_graphs_by_default``): ``--cuda-graph-impl local``, or under pipeline
parallelism, where megatron-core 0.19's local graphs do not run, its TE-based ones
(``transformer_engine``) where TransformerEngine is installed. Eager COAT issues many small kernels
per layer, and a graph replays them with one launch. To tell a ``--cuda-graph-impl``
the user typed from Megatron's default, the patched parser's default for it is None until
``choose_cuda_graphs`` decides, before Megatron's ``validate_args`` (which derives what graphs need:
the graph-safe RNG tracker, TE's tracker with TE layers, the inference graph scope).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import fields

import torch

from coat_kernels.formats import GROUP_SIZES
from coat_megatron.config import DEFAULT_RECIPE, RECIPES, CoatConfig, parse_switch
from coat_megatron.optional import transformer_engine_available

from .replacements import Replacements
from .run_arguments import check_run_args
from .version import require_megatron_core


class CoatArgumentError(ValueError):
    """Command-line arguments that cannot run with (or without) ``--coat-fp8``; the message names the fix."""


def _switch(value: str) -> bool:
    try:
        return parse_switch(value, "switch")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("switch=")) from None


def _knob_kwargs(field) -> dict:
    """The argparse keywords of a CoatConfig field's flag, from its type and its choices."""
    choices = field.metadata["choices"]
    if field.type in ("bool", "bool | None"):
        return dict(type=_switch, metavar="on|off")
    if choices is not None:
        return dict(choices=choices, **({"type": int} if field.type == "int" else {}))
    return {"int": dict(type=int), "float": dict(type=float)}.get(field.type, {})


# CoatConfig field -> (argparse keywords, help), made from the fields themselves: the flag of a field
# is --coat-<field with dashes>, its help the field's one description (coat_megatron.config.knob).
KNOBS: dict[str, tuple[dict, str]] = {f.name: (_knob_kwargs(f), f.metadata["help"]) for f in fields(CoatConfig)}
RECIPE_HELP = (
    f"a named COAT recipe (default {DEFAULT_RECIPE}); each --coat-<field> given changes that field on top of it: "
    + "; ".join(f"{name}: {why}" for name, (_, why) in RECIPES.items())
)
SWITCH_WORDS = {"True": "on", "False": "off"}  # a switch's Python value -> its command-line word
EXPANSION_HELP = "dynamic range expansion of both m and v (--coat-m-expansion / --coat-v-expansion set one)"
P2P_SYNC_HELP = (
    "Megatron's torch.cuda.synchronize() after every batched pipeline exchange (TransformerConfig.batch_p2p_sync, "
    "no flag of Megatron's; on in megatron-core 0.19, a guard against a race of old PyTorch's batch_isend_irecv, "
    "after the exchange's requests were waited on, which already orders the streams). Default auto: off with "
    "--coat-fp8 (the host runs ahead across exchanges), Megatron's on without it. off or on: so in any mode, BF16 "
    "and TE too. Only the non-interleaved pipeline schedule batches its exchanges (with virtual stages Megatron "
    "overlaps them instead), so it matters only there"
)
CUDA_GRAPHS_CHOICES = ("auto", "off")
CUDA_GRAPHS_HELP = (
    "Megatron's per-layer CUDA graphs with --coat-fp8 (default auto: on a GPU with COAT's layers, --cuda-graph-impl "
    "local at any data- and tensor-parallel size, and transformer_engine (Megatron's TE-based graphs, where "
    "TransformerEngine is installed) under pipeline parallelism, with or without virtual stages; unless the command "
    "line sets --cuda-graph-impl or has an option Megatron refuses with them (recompute, CPU or fine-grained "
    "activation offloading); not with context parallelism (--cuda-graph-impl local turns them on). off: eager)"
)
PIPELINE_GRAPHS = (
    "megatron-core 0.19's local per-layer graphs do not run with pipeline parallelism (BF16 as well): it stops "
    "while it creates them (assert fwd_buffer_reuse_ref_count == 0) or, past that, hangs in the first replay; its "
    "TransformerEngine-based graphs (--cuda-graph-impl transformer_engine) do"
)
# Options with which megatron-core 0.19 refuses per-layer graphs (TransformerConfig, validate_args)
# or allows them only in part (selective recompute), and the flag that names each.
GRAPH_BLOCKERS = {
    "recompute_granularity": "--recompute-granularity",
    "cpu_offloading_num_layers": "--cpu-offloading-num-layers",
    "fine_grained_activation_offloading": "--fine-grained-activation-offloading",
    "hybrid_context_parallel": "--hybrid-context-parallel",
}


def flag(name: str) -> str:
    """The command-line flag of a CoatConfig field or COAT option: ``group_size`` -> ``--coat-group-size``."""
    return "--coat-" + name.replace("_", "-")


def add_coat_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the COAT argument group to a Megatron argument parser (and return it, as Megatron's
    ``_add_*_args`` functions do)."""
    group = parser.add_argument_group(title="COAT FP8 training (coat-megatron)")
    group.add_argument(
        "--coat-fp8",
        action="store_true",
        help="train with COAT: the FP8 layer spec (FP8 activations, 1xG groups for non-linear ops) and the "
        "FP8 AdamW optimizer with range-expanded states. Needs --bf16, --swiglu and --use-distributed-optimizer",
    )
    group.add_argument(
        "--coat-recipe",
        dest="coat_recipe",
        choices=tuple(RECIPES),
        default=None,
        help=RECIPE_HELP,
    )
    for name, (kwargs, help_text) in KNOBS.items():
        group.add_argument(flag(name), dest=f"coat_{name}", default=None, help=help_text, **kwargs)
    group.add_argument(
        "--coat-expansion", dest="coat_expansion", type=_switch, metavar="on|off", default=None, help=EXPANSION_HELP
    )
    group.add_argument(
        "--coat-cuda-graphs",
        dest="coat_cuda_graphs",
        choices=CUDA_GRAPHS_CHOICES,
        default="auto",
        help=CUDA_GRAPHS_HELP,
    )
    group.add_argument(
        "--coat-p2p-sync", dest="coat_p2p_sync", choices=("auto", "on", "off"), default="auto", help=P2P_SYNC_HELP
    )
    group.add_argument(
        "--coat-report",
        dest="coat_report",
        default=None,
        metavar="PATH",
        help="write a JSON report of the run (loss and time per iteration, bytes saved for backward, optimizer-state "
        "bytes) to PATH; works with and without --coat-fp8 (coat_patches.report)",
    )
    return parser


# The run's recipe, built once where Megatron validates its arguments (check_coat_args): the namespace
# it was built from and the CoatConfig (None without --coat-fp8). The layer spec, the optimizer, the
# report and the telemetry read it through coat_config_from_args; none builds its own.
_RUN: tuple[argparse.Namespace | None, CoatConfig | None] = (None, None)


def coat_config_from_args(args: argparse.Namespace) -> CoatConfig | None:
    """The run's CoatConfig, built when Megatron validated ``args``, or None without ``--coat-fp8``."""
    validated, coat = _RUN
    if validated is args:
        return coat
    if not getattr(args, "coat_fp8", False):
        return None
    raise CoatArgumentError(
        "--coat-fp8: these arguments did not pass Megatron's validate_args with coat-megatron's patches installed, so "
        "no COAT recipe was built for them: start the script with coat-megatron-run (or inside "
        "coat_patches.install.coat_megatron_patches())"
    )


def check_coat_args(args: argparse.Namespace) -> None:
    """Raise ``CoatArgumentError`` listing every COAT problem of a parsed and Megatron-validated
    argument namespace, each with the flag that fixes it; else keep the run's CoatConfig, built here
    once (``coat_config_from_args``)."""
    knobs = [name for name in ("recipe", *KNOBS, "expansion") if getattr(args, f"coat_{name}", None) is not None]
    knobs += ["cuda_graphs"] if getattr(args, "coat_cuda_graphs", "auto") != "auto" else []
    global _RUN
    _RUN = (None, None)
    if not getattr(args, "coat_fp8", False):
        if knobs:
            set_flags = ", ".join(flag(n) for n in knobs)
            raise CoatArgumentError(
                f"{set_flags} {'has' if len(knobs) == 1 else 'have'} no effect without --coat-fp8: add --coat-fp8, or drop {set_flags}"
            )
        _RUN = (args, None)
        return
    try:
        coat = CoatConfig.from_args(args)
    except ValueError as e:
        raise CoatArgumentError(f"--coat-fp8: {_in_flag_words(str(e))}") from None
    problems = _precision_problems(args)
    if coat.activations:
        problems += _layer_problems(args, coat)
    if coat.optimizer:
        problems += _optimizer_problems(args)
    if not coat.any_enabled:
        problems.append(
            "--coat-activations off and --coat-optimizer off leave nothing for --coat-fp8 to do: drop --coat-fp8"
        )
    problems += _graph_problems(args)
    if coat.fp8_param_gather:
        problems += _param_gather_problems(args)
    problems += _memory_problems(args, coat)
    if problems:
        raise CoatArgumentError("--coat-fp8 cannot run with these arguments:\n  - " + "\n  - ".join(problems))
    say_scratch_buffers(args, coat)
    _RUN = (args, coat)


def say_scratch_buffers(args: argparse.Namespace, coat: CoatConfig) -> None:
    """One log line where ``CoatConfig.scratch_buffers``'s auto default turns scratch buffers on: COAT's
    layers run eagerly (no ``--cuda-graph-impl``) at tensor parallelism (``CoatConfig.for_layers``)."""
    if coat.scratch_buffers is not None or not coat.activations or getattr(args, "rank", 0) != 0:
        return
    # Megatron's arguments carry the layout and graph fields under the TransformerConfig's names
    if coat.for_layers(args).scratch_buffers:
        print(
            "coat-megatron-run: eager layers at tensor parallelism take scratch buffers (--coat-scratch-buffers off "
            "turns them off)",
            flush=True,
        )


def apply_coat_args(args: argparse.Namespace) -> None:
    """Set the Megatron arguments that a checked COAT recipe decides: the gradient buffers' dtype
    (``CoatConfig.grad_buffers``, read by ``megatron.training`` when it builds DDP)."""
    coat = coat_config_from_args(args)
    if coat is None:
        return
    args.accumulate_allreduce_grads_in_fp32 = coat.ddp_grad_reduce_in_fp32
    args.grad_reduce_in_bf16 = not coat.ddp_grad_reduce_in_fp32


def cuda_graphs_by_default(args: argparse.Namespace, cuda: bool, te: bool) -> tuple[str | None, str | None]:
    """The ``--cuda-graph-impl`` that ``--coat-fp8`` picks for a parsed command line that chose none
    (``CUDA_GRAPHS_HELP`` says where and why; None: eager), on a machine with (``cuda``) or without a
    GPU, with (``te``) or without TransformerEngine; and a line for the log saying what was decided
    and why, where a user may wonder (None where graphs cannot apply: no --coat-fp8, COAT's layers
    off, no GPU, --coat-cuda-graphs off)."""
    if not getattr(args, "coat_fp8", False) or args.coat_activations is False or not cuda:
        return None, None
    if args.coat_cuda_graphs == "off" or args.enable_cuda_graph or args.external_cuda_graph:
        return None, None  # the user's choice (--enable-cuda-graph / --external-cuda-graph: Megatron's older names)
    eager = "--coat-fp8 leaves Megatron's per-layer CUDA graphs off"
    if args.context_parallel_size > 1:
        return None, f"{eager} under context parallelism (not tried with COAT); --cuda-graph-impl local turns them on"
    blockers = [option for attr, option in GRAPH_BLOCKERS.items() if getattr(args, attr, None)]
    if getattr(args, "inference_batch_times_seqlen_threshold", -1) > -1:
        blockers.append("--inference-batch-times-seqlen-threshold")
    if blockers:
        return None, f"{eager}: Megatron refuses them with {', '.join(blockers)}, or allows them only in part"
    off = "--coat-cuda-graphs off keeps the layers eager"
    if args.pipeline_model_parallel_size == 1:
        return "local", f"--coat-fp8 turns on Megatron's per-layer CUDA graphs (--cuda-graph-impl local); {off}"
    impl, why = pipeline_cuda_graphs(te)
    if impl is None:
        return None, f"{eager} under pipeline parallelism: {why}"
    return (
        impl,
        f"--coat-fp8 turns on Megatron's TE-based per-layer CUDA graphs under pipeline parallelism {why}; {off}",
    )


def pipeline_cuda_graphs(te: bool) -> tuple[str | None, str]:
    """Megatron's per-layer CUDA graphs under pipeline parallelism, for every recipe (BF16 and TE's
    too): ``transformer_engine`` (its TE-based graphs; megatron-core 0.19's local ones do not run
    there) where TransformerEngine (``te``) is installed and the allocator's settings let them run,
    else None (eager); and why, in words for a log line."""
    if not te:
        return None, f"{PIPELINE_GRAPHS}, and they need TransformerEngine (pip install 'coat-megatron[te]')"
    if (
        "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        and os.environ.get("NCCL_GRAPH_REGISTER", "") != "0"
    ):
        return None, (
            "Megatron's TE-based graphs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True need "
            "NCCL_GRAPH_REGISTER=0 in the environment"
        )
    return "transformer_engine", "(--cuda-graph-impl transformer_engine: the local ones do not run under PP)"


def choose_cuda_graphs(args: argparse.Namespace) -> None:
    """Give ``args.cuda_graph_impl`` its value where the command line left it unset (None: the
    patched parser's default), before Megatron's ``validate_args``: what ``cuda_graphs_by_default``
    picks, else Megatron's own default ``none``. Refuses
    ``--coat-cuda-graphs off`` beside a ``--cuda-graph-impl`` that asks for graphs."""
    chosen = args.cuda_graph_impl
    if chosen is not None:
        if getattr(args, "coat_fp8", False) and args.coat_cuda_graphs == "off" and chosen != "none":
            raise CoatArgumentError(
                f"--coat-cuda-graphs off keeps the layers eager and --cuda-graph-impl {chosen} asks for graphs: drop one of them"
            )
        return
    impl, line = cuda_graphs_by_default(args, cuda=torch.cuda.is_available(), te=transformer_engine_available())
    args.cuda_graph_impl = impl or "none"
    if line is not None and args.rank == 0:
        print(f"coat-megatron-run: {line}", flush=True)


def _memory_problems(args, coat: CoatConfig) -> list[str]:
    """Memory flags that contradict the recipe's gradient buffers."""
    if coat.grad_buffers == "fp32" and getattr(args, "grad_reduce_in_bf16", False):
        return [
            "--grad-reduce-in-bf16 asks for BF16 gradient buffers and --coat-grad-buffers fp32 for FP32 ones: drop one of them"
        ]
    return []


def _in_flag_words(message: str) -> str:
    """A CoatConfig error in command-line words: ``k_min=0.1`` -> ``--coat-k-min 0.1``,
    ``master_weights='split'`` -> ``--coat-master-weights split``, ``optimizer=False`` -> ``--coat-optimizer off``."""
    names = "|".join(f.name for f in fields(CoatConfig))

    def as_flag(match: re.Match) -> str:
        name, value = match.groups()
        return f"{flag(name)} {SWITCH_WORDS.get(value, value.strip("'"))}"

    return re.sub(rf"\b({names})=('[^']*'|[^\s,;:)]+)", as_flag, message)


def _precision_problems(args) -> list[str]:
    problems = []
    if getattr(args, "fp8", None) is not None:
        problems.append(
            f"--fp8-format {args.fp8} selects TransformerEngine's FP8 recipe, which COAT replaces: drop --fp8-format (and the other --fp8-* flags)"
        )
    if getattr(args, "fp4", None) is not None:
        problems.append("--fp4-format selects TransformerEngine's FP4 recipe: drop it with --coat-fp8")
    if not getattr(args, "bf16", False):
        problems.append(
            "COAT keeps weights, the residual stream and attention in BF16 (FP32 master weights in the optimizer): add --bf16"
            + (" and drop --fp16" if getattr(args, "fp16", False) else "")
        )
    return problems


def _graph_problems(args) -> list[str]:
    if os.environ.get("COAT_PIPELINE_GRAPHS", "0") not in ("", "0"):
        return []  # debugging graphs under PP: with the RoPE copy the first replay hangs (pretrain-pipeline-4gpu)
    if args.pipeline_model_parallel_size > 1 and getattr(args, "cuda_graph_impl", None) == "local":
        return [
            f"--cuda-graph-impl local with --pipeline-model-parallel-size > 1: {PIPELINE_GRAPHS}; use "
            "--cuda-graph-impl transformer_engine (with TransformerEngine installed), or drop --cuda-graph-impl local"
        ]
    return []


def _layer_problems(args, coat: CoatConfig) -> list[str]:
    off = "; or add --coat-activations off to keep Megatron's layers and use only COAT's FP8 optimizer"
    problems = []
    g = coat.group_size
    if not getattr(args, "swiglu", False):
        problems.append(f"COAT's FP8 MLP is SwiGLU: add --swiglu{off}")
    if args.normalization not in ("RMSNorm", "LayerNorm"):
        problems.append(f"COAT's FP8 norms are RMSNorm and LayerNorm, not --normalization {args.normalization}{off}")
    if args.hidden_size % g:
        divisors = [d for d in GROUP_SIZES if args.hidden_size % d == 0]
        fix = (
            f"use --coat-group-size {max(divisors)} or pad the model"
            if divisors
            else "pad the model to a multiple of 16"
        )
        problems.append(f"hidden size {args.hidden_size} is not a multiple of the FP8 group size {g}; {fix}")
    tp = args.tensor_model_parallel_size
    if args.ffn_hidden_size is not None and (args.ffn_hidden_size % tp or (args.ffn_hidden_size // tp) % g):
        local = args.ffn_hidden_size / tp
        problems.append(
            f"the FFN width per tensor-parallel rank, --ffn-hidden-size {args.ffn_hidden_size} / --tensor-model-parallel-size {tp} = "
            f"{local:g}, is not a multiple of the FP8 group size {g}; choose --ffn-hidden-size divisible by {g * tp} or a smaller --coat-group-size"
        )
    unsupported = {
        "num_experts": "--num-experts (mixture-of-experts layers)",
        "qk_layernorm": "--qk-layernorm",
        "multi_latent_attention": "--multi-latent-attention",
        "mtp_num_layers": "--mtp-num-layers (multi-token prediction)",
        "experimental_attention_variant": "--experimental-attention-variant",
        "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path",
        "tp_comm_overlap": "--tp-comm-overlap (TransformerEngine's userbuffers, for TE's linears; COAT's own "
        "sequence-parallel ring is --coat-tp-comm-overlap on)",
    }
    for attr, what in unsupported.items():
        if getattr(args, attr, None):
            problems.append(f"{what} is not supported by the COAT layer spec: drop it{off}")
    if getattr(args, "spec", None):
        problems.append(
            f"--spec {' '.join(args.spec)} names a layer spec, and --coat-fp8 selects COAT's: drop --spec{off}"
        )
    if getattr(args, "transformer_impl", None) == "inference_optimized":
        problems.append(
            "--transformer-impl inference_optimized is for inference: use local or transformer_engine with --coat-fp8"
        )
    return problems


def _optimizer_problems(args) -> list[str]:
    off = "; or add --coat-optimizer off to keep Megatron's optimizer"
    problems = []
    if not args.use_distributed_optimizer:
        problems.append(
            f"COAT's FP8 optimizer states live on the distributed optimizer's shards: add --use-distributed-optimizer{off}"
        )
    if args.optimizer != "adam":
        problems.append(f"COAT's FP8 states are AdamW's: use --optimizer adam, not {args.optimizer}{off}")
    if getattr(args, "use_precision_aware_optimizer", False):
        problems.append(
            "--use-precision-aware-optimizer selects TransformerEngine's FP8/BF16 optimizer states, which COAT replaces: drop it"
        )
    if getattr(args, "optimizer_cpu_offload", False):
        problems.append(f"--optimizer-cpu-offload is not supported with COAT's optimizer: drop it{off}")
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        problems.append(
            f"COAT's optimizer runs on Megatron's DDP with the distributed optimizer: drop --use-megatron-fsdp / --use-torch-fsdp2{off}"
        )
    if getattr(args, "fp8_param_gather", False):
        problems.append(
            "--fp8-param-gather gathers TransformerEngine's FP8 weights (made with --fp8-format, which COAT replaces): "
            "drop it, and add --coat-fp8-param-gather on for COAT's FP8 parameter gather"
        )
    return problems


def _param_gather_problems(args) -> list[str]:
    problems = []
    if getattr(args, "check_weight_hash_across_dp_replicas_interval", None):
        problems.append(
            "--coat-fp8-param-gather on leaves each replica the other ranks' weight shards as dequantized FP8 codes "
            "(the same FP8 weights, not the same BF16 bytes), so --check-weight-hash-across-dp-replicas-interval "
            "would report a mismatch: drop one of them"
        )
    return problems


def apply_p2p_sync(args: argparse.Namespace) -> None:
    """``--coat-p2p-sync``: ``batch_p2p_sync`` on the arguments, which ``core_transformer_config_from_args``
    copies into the model's config (the pipeline schedules read it there). auto is off with ``--coat-fp8``
    and Megatron's default without it; one line says so where a pipeline batches its exchanges."""
    asked = getattr(args, "coat_p2p_sync", "auto")
    if not (asked == "off" or (asked == "auto" and getattr(args, "coat_fp8", False))):
        return
    args.batch_p2p_sync = False
    batched = args.pipeline_model_parallel_size > 1 and not getattr(args, "overlap_p2p_comm", False)
    if batched and os.environ.get("RANK", "0") == "0":
        why = "--coat-p2p-sync off" if asked == "off" else "--coat-fp8's default; --coat-p2p-sync on keeps it"
        print(f"coat-megatron-run: no device synchronization after each pipeline exchange ({why})", flush=True)


def install(replacements: Replacements) -> None:
    """Wrap ``add_megatron_arguments`` and ``validate_args`` of ``megatron.training.arguments``."""
    require_megatron_core(__name__)
    import megatron.training.arguments as arguments

    add_megatron_arguments = arguments.add_megatron_arguments
    validate_args = arguments.validate_args

    def add_megatron_and_coat_arguments(parser):
        parser = add_coat_arguments(add_megatron_arguments(parser))
        parser.set_defaults(cuda_graph_impl=None)  # unset until choose_cuda_graphs: see the module docstring
        return parser

    def validate_megatron_and_coat_args(args, defaults={}):  # noqa: B006 - Megatron's signature
        for line in check_run_args(args):
            if os.environ.get("RANK", "0") == "0":
                print(f"coat-megatron-run: warning: {line}", flush=True)
        choose_cuda_graphs(args)
        result = validate_args(args, defaults)
        check_coat_args(args)
        apply_coat_args(args)
        apply_p2p_sync(args)
        return result

    replacements.replace(arguments, "add_megatron_arguments", add_megatron_and_coat_arguments)
    replacements.replace(arguments, "validate_args", validate_megatron_and_coat_args)
