"""A parallel layout that cannot split the model ends in one line naming the sizes that can.

megatron-core 0.19 finds some of these itself, each in its own way: a world size that is not a
multiple of TP x PP x CP and layers not divisible by PP are assertions of ``validate_args``
(one line through ``coat_patches.argument_errors``, without the sizes that would work);
attention heads or query groups that TP does not divide are ``ValueError``s of
``TransformerConfig``, raised in the script after Megatron printed its table of arguments (a
traceback); layers that PP x virtual stages does not divide with
``--num-virtual-stages-per-pipeline-rank`` are not checked at all. ``check_parallel_layout`` runs
before ``validate_args`` and names, for each, the values that fit this model and world size.

Megatron's uneven pipeline options (``--decoder-first-pipeline-num-layers``,
``--decoder-last-pipeline-num-layers``, ``--pipeline-model-parallel-layout``,
``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``) and
hybrid models (``--hybrid-layer-pattern``) place layers their own way: the layer checks leave them
to Megatron.
"""

from __future__ import annotations

import argparse
import functools

from .replacements import Replacements
from .version import require_megatron_core

UNEVEN_PIPELINE_OPTIONS = {
    "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
    "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers",
    "pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
    "account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
    "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
}
MAX_LAYOUTS_NAMED = 12


class ParallelLayoutError(ValueError):
    """The parallel sizes cannot split this model over this many processes; the message names the
    sizes that can."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listed(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _query_groups(args) -> int:
    """The key/value heads, as Megatron's TransformerConfig gets them."""
    return args.num_query_groups if args.group_query_attention else args.num_attention_heads


def _tensor_parallel_fits(args, tp: int) -> bool:
    """TP splits the attention heads, and the query groups split or are replicated evenly."""
    heads, groups = args.num_attention_heads, _query_groups(args)
    return heads % tp == 0 and (groups % tp == 0 or tp % groups == 0)


def _checks_layers(args) -> bool:
    uneven = any(getattr(args, attr, None) for attr in UNEVEN_PIPELINE_OPTIONS)
    return not uneven and args.num_layers is not None and getattr(args, "hybrid_layer_pattern", None) is None


def _pipeline_parallel_fits(args, pp: int) -> bool:
    return not _checks_layers(args) or args.num_layers % pp == 0


def _tensor_problem(args) -> str | None:
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads is None or _tensor_parallel_fits(args, tp):
        return None
    heads, groups = args.num_attention_heads, _query_groups(args)
    fits = _listed([t for t in _divisors(heads) if _tensor_parallel_fits(args, t)])
    if heads % tp:
        return (
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}: "
            f"use a --tensor-model-parallel-size among {fits}"
        )
    return (
        f"--num-query-groups {groups} is neither a multiple nor a divisor of --tensor-model-parallel-size {tp}: "
        f"use a --tensor-model-parallel-size among {fits} (it must divide the {heads} heads, and the {groups} query "
        f"groups must split or be replicated evenly)"
    )


def _pipeline_problem(args) -> str | None:
    if not _checks_layers(args):
        return None
    layers, pp = args.num_layers, args.pipeline_model_parallel_size
    uneven = "/".join(list(UNEVEN_PIPELINE_OPTIONS.values())[:2])
    if layers % pp:
        return (
            f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp}: use a "
            f"--pipeline-model-parallel-size among {_listed(_divisors(layers))}, or give the first or last stage "
            f"its own number of layers ({uneven})"
        )
    per_stage = layers // pp
    stages, layers_per_stage = args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage
    if stages is not None and per_stage % stages:
        fits = _listed([v for v in _divisors(per_stage) if v > 1])
        return (
            f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp} x "
            f"--num-virtual-stages-per-pipeline-rank {stages} = {pp * stages}: each pipeline rank holds {per_stage} "
            f"layers; use a --num-virtual-stages-per-pipeline-rank among {fits or 'none (1 layer per rank: drop it)'}"
        )
    if layers_per_stage is not None and per_stage % layers_per_stage:
        fits = _listed([n for n in _divisors(per_stage) if n < per_stage])
        return (
            f"--num-layers-per-virtual-pipeline-stage {layers_per_stage} does not divide the {per_stage} layers of "
            f"each pipeline rank (--num-layers {layers} / --pipeline-model-parallel-size {pp}): use one among "
            f"{fits or 'none (1 layer per rank: drop it)'}"
        )
    return None


def _world_problem(args) -> str | None:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if getattr(args, "tensor_parallel_num_weight_shards", None) not in (None, tp):
        return None  # GTP's weight shards count in Megatron's model size: its own check names them
    world, model = args.world_size, tp * pp * cp
    if world % model == 0:
        return None
    sizes = f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"
    sizes += f" x --context-parallel-size {cp}" if cp > 1 else ""
    keep_cp = cp if world % cp == 0 else 1
    layouts = [
        (t, p)
        for t in _divisors(world // keep_cp)
        for p in _divisors(world // keep_cp // t)
        if (args.num_attention_heads is None or _tensor_parallel_fits(args, t)) and _pipeline_parallel_fits(args, p)
    ]
    named = ", ".join(f"TP {t} x PP {p}" + (f" x CP {keep_cp}" if keep_cp > 1 else "") for t, p in layouts)
    if len(layouts) > MAX_LAYOUTS_NAMED:
        named = ", ".join(named.split(", ")[:MAX_LAYOUTS_NAMED]) + ", ..."
    return (
        f"the world size {world} (processes) is not a multiple of {sizes} = {model}: run a multiple of {model} "
        f"processes ({_listed([model * k for k in range(1, 5)])}, ...), or on {world} use {named} "
        f"(the rest of the world is data parallel)"
    )


def check_parallel_layout(args: argparse.Namespace) -> None:
    """Raise ``ParallelLayoutError`` (one line) for the first of: heads or query groups that TP
    cannot split, layers that PP (x virtual stages) cannot split, a world size that is not a
    multiple of TP x PP x CP. Reads a namespace from Megatron's ``parse_args``, before
    ``validate_args``."""
    for problem in (_tensor_problem, _pipeline_problem, _world_problem):
        if (message := problem(args)) is not None:
            raise ParallelLayoutError(message)


def install(replacements: Replacements) -> None:
    """Run ``check_parallel_layout`` before ``megatron.training.arguments.validate_args``."""
    require_megatron_core(__name__)
    import megatron.training.arguments as arguments

    validate_args = arguments.validate_args

    @functools.wraps(validate_args)
    def check_layout_then_validate(args, defaults={}):  # noqa: B006 - Megatron's signature
        check_parallel_layout(args)
        return validate_args(args, defaults)

    replacements.replace(arguments, "validate_args", check_layout_then_validate)
