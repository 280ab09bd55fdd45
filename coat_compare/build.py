"""Build what a mode measures with Megatron-Core: one TransformerLayer, or a GPTModel wrapped in
Megatron's DDP with its distributed optimizer (or COAT's).

The same preset gives every mode the same TransformerConfig shape and fusions; a mode changes only
the layer spec (TE / local / COAT), the TE FP8 fields and the optimizer. Weights are drawn per
parameter from a generator seeded by (seed, name), with TE's fused-norm names mapped onto the
local spec's, so every mode starts from the same weights.
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.nn.functional as F

from .modes import Mode
from .presets import Preset

# TE's layer spec fuses each norm into the next linear; its weights are the local spec's norms.
TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


# --cuda-graphs value -> Megatron's TransformerConfig.cuda_graph_impl (under pipeline parallelism: cuda_graph_impl)
CUDA_GRAPHS = {"none": "none", "local": "local", "full": "full_iteration"}
# eager steps before TE-based graphs are captured: inside the timing's warm-up (2 steps for tiny)
TE_GRAPH_WARMUP_STEPS = 1


def cuda_graph_impl(graphs: str, pp: int) -> tuple[str, str | None]:
    """Megatron's ``cuda_graph_impl`` for ``--cuda-graphs graphs`` at ``pp`` pipeline stages, and
    where per-layer graphs run eagerly, why (one line). Under pipeline parallelism, for every mode,
    what ``coat-megatron-run --coat-fp8`` picks there (``coat_patches.arguments.pipeline_cuda_graphs``):
    Megatron's TE-based graphs (``train.te_graphs``) where TransformerEngine is installed, else none."""
    from coat_megatron.optional import transformer_engine_available
    from coat_patches.arguments import pipeline_cuda_graphs

    if graphs != "local" or pp == 1:
        return CUDA_GRAPHS[graphs], None
    impl, why = pipeline_cuda_graphs(transformer_engine_available())
    return (impl, None) if impl else ("none", f"--cuda-graphs local under pipeline parallelism runs eagerly: {why}")


# te-fp8-pa's OptimizerConfig fields: what megatron.training makes of --use-precision-aware-optimizer
# --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 (arguments.py maps 'fp8' to torch.uint8, TE FusedAdam's
# name for E4M3 with one scale per tensor; main params and grads keep their FP32 defaults).
# tests/compare/test_precision_aware_mode.py checks them against megatron.training's own parsing.
PRECISION_AWARE_FP8_FIELDS = dict(
    use_precision_aware_optimizer=True,
    exp_avg_dtype=torch.uint8,
    exp_avg_sq_dtype=torch.uint8,
    main_params_dtype=torch.float32,
    main_grads_dtype=torch.float32,
)


def transformer_config(
    preset: Preset,
    mode: Mode,
    tp: int = 1,
    *,
    pp: int = 1,
    vpp: int = 1,
    ddp: bool = True,
    graphs: str = "none",
    deterministic: bool = False,
    fp32: bool = False,
):
    """Megatron's TransformerConfig: BF16 parameters (``fp32``: FP32 parameters and arithmetic and
    no fusion, the reference ``coat_compare.fidelity`` measures against), Llama shape, dropout 0. On a GPU the fusions
    the layer benchmark used (bias-SwiGLU, masked softmax), RoPE fused (TE's kernel, where TE is
    installed: the same for every mode, like the attention kernel) and, under DDP (``ddp``:
    parameters have a ``main_grad``), weight-gradient accumulation into main_grad where apex
    provides it (the local output layer needs apex's kernel for it); on a CPU every fusion off
    (they need CUDA). ``graphs``: Megatron's CUDA graphs (``cuda_graph_impl``). ``pp`` pipeline
    stages, each of ``vpp`` virtual stages (interleaved schedule) where ``vpp`` > 1; the stages
    exchange BF16 hidden states.

    Sequence parallel is on whenever ``tp`` > 1. Megatron-Core 0.19 does not require it (not even
    for TE FP8), but without it each TP rank keeps the whole sequence's norm and residual
    activations and the linears all-reduce BF16; with it they gather their inputs, which TE's FP8
    recipes and COAT gather in FP8: the communication this job measures (``comm``)."""
    from megatron.core.tensor_parallel import layers as tp_layers
    from megatron.core.transformer import TransformerConfig

    from coat_megatron.optional import transformer_engine_available

    cuda = torch.cuda.is_available()
    fields = dict(
        num_layers=preset.layers,
        hidden_size=preset.hidden,
        ffn_hidden_size=preset.ffn,
        num_attention_heads=preset.heads,
        num_query_groups=preset.kv_heads,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        # the interleaved schedule sends activations and gradients between the same two ranks at
        # once (at PP 2 a stage's next and previous stage are one rank): batched into one call they
        # were matched to each other's buffers (gloo, measured), so overlap them as separate calls,
        # as megatron.training does (its --overlap-p2p-communication default; batch_p2p_comm off)
        overlap_p2p_comm=vpp > 1,
        batch_p2p_comm=vpp == 1,
        # every mode without megatron-core's device synchronization after a batched exchange, as --coat-fp8
        # runs (a guard for old PyTorch; each mode gained from its absence at PP 2: pipeline-sync-pp2-2gpu)
        batch_p2p_sync=False,
        sequence_parallel=tp > 1,
        perform_initialization=False,  # init_weights_by_name sets every weight
        use_cpu_initialization=not cuda,
        gradient_accumulation_fusion=cuda and ddp and tp_layers._grad_accum_fusion_available,
        bias_activation_fusion=cuda,
        apply_rope_fusion=cuda and transformer_engine_available(),
        cross_entropy_loss_fusion=False,
        cuda_graph_impl=cuda_graph_impl(graphs, pp)[0],
        deterministic_mode=deterministic,
    )
    if fields["cuda_graph_impl"] == "transformer_engine":
        fields.update(cuda_graph_warmup_steps=TE_GRAPH_WARMUP_STEPS)
    if not cuda:
        fields.update(bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False)
    if fp32:
        fields.update(bf16=False, params_dtype=torch.float32, pipeline_dtype=torch.float32)
        fields.update(bias_activation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False)
        fields.update(masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    if mode.fp8_recipe is not None:
        fields.update(fp8="hybrid", fp8_recipe=mode.fp8_recipe, activation_func_fp8_input_store=mode.fp8_input_store)
    return TransformerConfig(**fields)


def fuse_te_wgrad_accumulation(model: torch.nn.Module) -> None:
    """Turn on TE's in-GEMM wgrad accumulation in every TE module of ``model`` (read by each forward),
    which Megatron's TE spec sets from ``gradient_accumulation_fusion`` and so leaves off without apex.
    Call before DDP wraps the model: DDP gives every weight the ``main_grad`` it writes."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    for module in model.modules():
        if isinstance(module, TransformerEngineBaseModule) and hasattr(module, "fuse_wgrad_accumulation"):
            module.fuse_wgrad_accumulation = True


def fused_wgrad_linears(model: torch.nn.Module) -> tuple[int, int]:
    """(linears that add their wgrad into main_grad inside the GEMM, linears): a row's record."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    fused = total = 0
    for module in model.modules():
        coat = getattr(module, "coat", None)
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            total += 1
            fused += bool(module.gradient_accumulation_fusion or (coat is not None and coat.fuse_wgrad_accumulation))
        elif hasattr(module, "fuse_wgrad_accumulation") and hasattr(module, "weight"):
            total += 1
            fused += bool(module.fuse_wgrad_accumulation)
    return fused, total


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm behind Megatron's norm constructor, usable under sequence parallelism: the
    local spec's norm when sequence parallel is on.

    Megatron's own torch norm (what the local spec uses without apex) refuses sequence parallel.
    Under SP each TP rank sees a slice of the sequence, so the weight's gradient is partial:
    marking it ``sequence_parallel`` makes ``finalize_model_grads`` all-reduce it over TP.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def layer_spec(mode: Mode, config):
    """The ModuleSpec of one TransformerLayer for ``mode`` (``config``: sequence parallel or not)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from coat_megatron.spec import get_gpt_layer_coat_spec

    spec = mode.resolved_spec()
    if spec == "te":
        return get_gpt_layer_with_transformer_engine_spec()
    if spec == "coat":
        return get_gpt_layer_coat_spec(mode.coat_config())
    local = get_gpt_layer_local_spec(normalization="RMSNorm")
    if config.sequence_parallel:
        local.submodules.input_layernorm = local.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return local


def block_spec(mode: Mode, config, vp_stage: int | None = None):
    """The GPT block of this pipeline stage (and virtual stage ``vp_stage``): the TE spec's own
    (with TE's final norm); the local spec with its own norm class as the final norm (Megatron
    would otherwise want apex); COAT's block."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from coat_megatron.spec import get_gpt_block_coat_spec

    spec = mode.resolved_spec()
    if spec == "coat":
        return get_gpt_block_coat_spec(config, mode.coat_config(), vp_stage=vp_stage)
    layer = layer_spec(mode, config)
    if spec == "te":
        return layer
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=layer.submodules.input_layernorm,
    )


def parameter_name(name: str) -> str:
    """A parameter's name without wrapper prefixes, TE's fused-norm names mapped to the local spec's."""
    while name.startswith("module."):
        name = name[len("module.") :]
    for te, local in TE_NAMES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


# The gated fc1 of a SwiGLU MLP holds [gate; up] (2 x FFN rows at TP 1); each TP rank keeps its slice
# of both, [gate_r; up_r]: a split with stride 2, as Megatron's checkpoints store it. TE's fc1 carries
# stride 1 in its attributes but stores the same layout, so the name decides.
GATED_FC1 = "mlp.linear_fc1.weight"


def tensor_parallel_slice(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim`` for a TP group of ``size``, as Megatron's CPU
    initialisation cuts it (``_initialize_affine_weight_cpu``): ``full`` in ``size x stride``
    equal pieces along ``dim``, the rank keeping pieces rank, rank + size, ... concatenated."""
    pieces = torch.split(full, full.shape[dim] // (size * stride), dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


def global_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's name -> its name in the whole, one-GPU model: wrapper prefixes dropped, TE's
    fused-norm names mapped to the local spec's, and a pipeline stage's local layer index
    (``decoder.layers.0`` of the second of two stages) replaced by the layer's global index
    (``TransformerLayer.layer_number`` - 1)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    renames = {}
    for prefix, module in model.named_modules():
        head, _, index = prefix.rpartition(".")
        if isinstance(module, TransformerLayer) and index.isdigit() and head.endswith("layers"):
            renames[prefix + "."] = f"{head}.{module.layer_number - 1}."
    names = {}
    for name, _ in model.named_parameters():
        whole = next((g + name[len(local) :] for local, g in renames.items() if name.startswith(local)), name)
        names[name] = parameter_name(whole)
    return names


@torch.no_grad()
def init_weights_by_name(model: torch.nn.Module, seed: int, num_layers: int) -> None:
    """Norm weights 1; output projections (linear_proj, linear_fc2) N(0, 0.02 / sqrt(2 layers)),
    Megatron's scaled init; every other weight N(0, 0.02). Each weight is drawn whole (its
    one-GPU shape) from a generator seeded by (seed, its one-GPU name) on the parameter's device,
    and a tensor-parallel rank keeps its slice (``tensor_parallel_slice``), so that any spec, TP
    size and pipeline stage starts from the weights of the same model on one GPU."""
    from megatron.core import parallel_state

    split = parallel_state.model_parallel_is_initialized()
    tp_size = parallel_state.get_tensor_model_parallel_world_size() if split else 1
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if split else 0
    names = global_parameter_names(model)
    for local, param in model.named_parameters():
        name = names[local]
        if param.dim() == 1:
            param.fill_(1.0)
            continue
        std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0.02
        g = torch.Generator(device=param.device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
        parallel = tp_size > 1 and getattr(param, "tensor_model_parallel", False)
        shape = list(param.shape)
        if parallel:
            dim = param.partition_dim
            stride = 2 if name.endswith(GATED_FC1) else param.partition_stride
            shape[dim] *= tp_size
        full = torch.randn(shape, generator=g, device=param.device, dtype=torch.float32).mul_(std)
        param.copy_(tensor_parallel_slice(full, dim, stride, tp_rank, tp_size) if parallel else full)


def build_layer(preset: Preset, mode: Mode, seed: int, tp: int = 1):
    """One TransformerLayer (layer number 1) on this device, this rank's TP shard, and its config."""
    from megatron.core.transformer.spec_utils import build_module

    config = transformer_config(preset, mode, tp, ddp=False)
    layer = build_module(layer_spec(mode, config), config=config, layer_number=1)
    layer = layer.to(torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    init_weights_by_name(layer, seed, num_layers=1)
    return layer, config


def stage_models(preset: Preset, mode: Mode, config, seed: int) -> list:
    """This rank's GPTModels: one per virtual pipeline stage (``config``'s), each holding its stage's
    layers, the embedding on the first stage, the final norm and output layer on the last; on this
    device, initialised by name (``init_weights_by_name``). Untied embeddings, RoPE."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    vpp = config.virtual_pipeline_model_parallel_size or 1
    models = []
    for index in range(vpp):
        vp_stage = index if vpp > 1 else None
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(mode, config, vp_stage),
            vocab_size=preset.vocab,
            max_sequence_length=preset.seq,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=vp_stage,
        )
        if torch.cuda.is_available():
            gpt = gpt.cuda()
        init_weights_by_name(gpt, seed, preset.layers)
        models.append(gpt)
    return models


def build_gpt(
    preset: Preset,
    mode: Mode,
    seed: int,
    tp: int = 1,
    graphs: str = "none",
    *,
    pp: int = 1,
    vpp: int = 1,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    deterministic: bool = False,
    fp32: bool = False,
):
    """(model chunks, optimizer) for ``mode`` (``fp32``: FP32 parameters, gradients and optimizer,
    no Float16Module: the reference of ``coat_compare.fidelity``): this rank's pipeline stage as ``vpp`` DDP-wrapped
    GPTModel chunks (one without virtual stages), and Megatron's distributed optimizer over them
    with Adam (TE FusedAdam or apex where installed, torch's otherwise), its precision-aware variant
    with FP8 states for te-fp8-pa, or COAT's FP8 AdamW. Untied embeddings, RoPE, the mode's
    gradient buffers (``Mode.grad_fp32``).
    ``graphs``: Megatron's CUDA graphs: "local" (per layer, captured by its schedule after the
    first step; under pipeline parallelism TE's, captured by ``train.te_graphs``: ``cuda_graph_impl``)
    or "full" (the whole forward+backward of a step: ``train`` wraps the schedule).
    ``overlap_grad_reduce`` / ``overlap_param_gather``: Megatron's DDP options (the gradient
    reduce-scatter in buckets during backward; the parameter all-gather during the next forward),
    with the schedule hooks megatron.training installs for them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from coat_megatron.optimizer import coat_param_layout, get_coat_optimizer

    config = transformer_config(preset, mode, tp, pp=pp, vpp=vpp, graphs=graphs, deterministic=deterministic, fp32=fp32)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=mode.grad_fp32 or fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=True,
    )
    chunks = []
    for index, gpt in enumerate(stage_models(preset, mode, config, seed)):
        if torch.cuda.is_available() and mode.resolved_spec() == "te" and mode.wgrad_fusion:
            fuse_te_wgrad_accumulation(gpt)
        module = gpt if fp32 else Float16Module(config, gpt)  # as megatron.training wraps a BF16 model
        layout = coat_param_layout(module, ddp_config) if mode.coat_optimizer else None
        with _ddp_stream(graphs):
            chunks.append(
                DistributedDataParallel(
                    config=config,
                    ddp_config=ddp_config,
                    module=module,
                    full_param_layout=layout,
                    disable_bucketing=index > 0,  # megatron.training's choice for later chunks
                )
            )
    config.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:  # what megatron.training installs: the schedule defers each chunk's reduction
        config.no_sync_func = [m.no_sync for m in chunks] if vpp > 1 else chunks[0].no_sync
    fields = dict(
        optimizer="adam",
        lr=preset.lr,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=preset.adam_eps,
        clip_grad=1.0,
        bf16=not fp32,
        params_dtype=torch.float32 if fp32 else torch.bfloat16,
        use_distributed_optimizer=True,
        fp8_recipe=mode.fp8_recipe,
    )
    if mode.precision_aware:
        fields.update(PRECISION_AWARE_FP8_FIELDS)
    opt_config = OptimizerConfig(**fields)
    if mode.coat_optimizer:
        optimizer = get_coat_optimizer(opt_config, chunks, mode.coat_config())
    else:
        optimizer = get_megatron_optimizer(opt_config, chunks)
    config.grad_scale_func = optimizer.scale_loss
    return chunks, optimizer


@contextlib.contextmanager
def _ddp_stream(graphs: str):
    """Where DDP is built: for a whole-step graph, on the stream that captures it (as
    megatron.training does: DDP's gradient-accumulation nodes keep the stream they were made on)."""
    if graphs != "full":
        yield
        return
    from megatron.core.full_cuda_graph import get_shared_capture_stream

    stream = get_shared_capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


WEIGHT_DECAY = 0.1


def unwrap_optimizers(optimizer) -> list:
    """The DistributedOptimizers inside what get_megatron_optimizer / get_coat_optimizer returned."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))
