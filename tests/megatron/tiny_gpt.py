"""A tiny GPT built with real Megatron-Core, for tests that run it on gloo (see ``distributed.py``).

Call these inside a process where ``torch.distributed`` and Megatron's model-parallel state are
initialised (``run_distributed(..., tensor_parallel=...)`` does both) and ``megatron_on_cpu()`` is
active. Sizes are small enough that fwd+bwd takes milliseconds on one CPU core.

Weights depend only on the seed and each parameter's global name, never on the TP/PP layout:
every parameter is drawn whole from a generator seeded by (seed, name) and each rank keeps its
tensor-parallel shard. Models built at TP=1 and at TP=2 x PP=2 from one seed therefore hold the
same weights, and tests can compare their losses and gradients. ``Shard`` records what a rank
holds and ``assemble`` puts the full tensors back together in the test process.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from layer_config import layer_config
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer
from stdlib_text import stdlib_docstrings

from coat_megatron.optimizer import CoatDistributedOptimizer

VOCAB = 128
SEQ = 32
MICRO_BATCH = 2


def tiny_config(
    *, sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32, **overrides
) -> TransformerConfig:
    """A Llama-shaped 2-layer config: hidden 64, 4 heads, SwiGLU FFN 128, RMSNorm, RoPE, no bias.

    TP and PP sizes come from the initialised model-parallel state. Everything that would need CUDA
    or a fused kernel is off; dropout is 0 so that runs are deterministic. ``params_dtype`` BF16
    turns on Megatron's BF16 mixed precision (FP32 main params and grads in DDP and the optimizer).
    """
    fields = dict(
        num_layers=2,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True,
        cross_entropy_loss_fusion=False,
    )
    return layer_config(64, 128, 4, **(fields | overrides))


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm behind Megatron's norm constructor, usable under sequence parallel (Megatron's
    own torch norm refuses it): each TP rank sees a slice of the sequence, so the weight's gradient is
    partial, and marking it ``sequence_parallel`` makes ``finalize_model_grads`` all-reduce it over TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def local_layer_spec(sequence_parallel_norms: bool = False) -> ModuleSpec:
    """Megatron's local (no TE) GPT layer spec with RMSNorm; its norms replaced by
    ``SequenceParallelRMSNorm`` when asked (needed for sequence parallel)."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if sequence_parallel_norms:
        spec.submodules.input_layernorm = SequenceParallelRMSNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return spec


def tiny_gpt(
    config: TransformerConfig, layer_spec: ModuleSpec | None = None, *, final_norm=None, seed: int = 0
) -> MegatronModule:
    """The GPTModel of this pipeline stage, untied embeddings, RoPE, weights set by ``seed``;
    wrapped in Megatron's ``Float16Module`` (as Megatron's training loop does) when
    ``config.bf16``.

    ``layer_spec`` defaults to ``local_layer_spec(config.sequence_parallel)``. The block's final
    norm is ``final_norm``, by default the layer spec's input norm (Megatron would otherwise pick
    apex's FusedLayerNorm, which needs apex and has no RMSNorm).
    """
    layer_spec = layer_spec or local_layer_spec(config.sequence_parallel)
    block = TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config),
        layer_norm=final_norm or layer_spec.submodules.input_layernorm,
    )
    model_parallel_cuda_manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    set_weights_by_name(model, seed)
    return Float16Module(config, model) if config.bf16 else model


def global_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters by a name that does not depend on the pipeline layout: wrappers' ``module.``
    prefixes are dropped and ``decoder.layers.<i>`` counts layers over all stages."""
    model = unwrap(model)
    renames = {
        f"{name}.": f"decoder.layers.{module.layer_number - 1}."
        for name, module in model.named_modules()
        if isinstance(module, TransformerLayer) and name.startswith("decoder.layers.")
    }
    out = {}
    for name, param in model.named_parameters():
        for local, glob in renames.items():
            if name.startswith(local):
                name = glob + name[len(local) :]
                break
        out[name] = param
    return out


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP and Float16Module wrappers."""
    while isinstance(model, (DistributedDataParallel, Float16Module)):
        model = model.module
    return model


def set_weights_by_name(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter whole from a generator seeded by (seed, global name) and keep this
    rank's TP shard: norm weights 1 + N(0, 0.1), everything else N(0, 0.02)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in global_parameters(model).items():
            shard = Shard.of(param.data, param, tp_rank, tp_size)
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
            full = torch.randn(shard.full_shape(), generator=g)
            full = 1.0 + 0.1 * full if param.dim() == 1 else 0.02 * full
            param.copy_(shard.take(full))


@dataclass
class Shard:
    """What one rank holds of a tensor: ``tensor`` is the whole thing when ``dim`` is None, else
    TP rank ``rank``'s part, split along ``dim`` Megatron's way: in ``stride`` blocks, each cut in
    ``size`` pieces (stride 2 is SwiGLU's fc1, whose rows are [gate; up])."""

    tensor: torch.Tensor
    dim: int | None
    stride: int
    rank: int
    size: int

    @staticmethod
    def of(tensor: torch.Tensor, param: torch.nn.Parameter, rank: int, size: int) -> "Shard":
        """``tensor`` (the parameter, its grad, ...) as split like ``param``."""
        if getattr(param, "tensor_model_parallel", False) and size > 1:
            return Shard(tensor, param.partition_dim, getattr(param, "partition_stride", 1), rank, size)
        return Shard(tensor, None, 1, rank, size)

    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.tensor.shape)
        if self.dim is not None:
            shape[self.dim] *= self.size
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full``."""
        if self.dim is None:
            return full
        pieces = full.chunk(self.stride * self.size, dim=self.dim)
        return torch.cat(pieces[self.rank :: self.size], dim=self.dim)


def assemble(shards: list[Shard], atol: float = 0.0) -> torch.Tensor:
    """The full tensor from the shards of all TP ranks. Replicated copies must agree within
    ``atol``, else this raises."""
    first = shards[0]
    if first.dim is None:
        for s in shards[1:]:
            if not torch.allclose(s.tensor, first.tensor, rtol=0.0, atol=atol):
                raise AssertionError(f"replicas differ by {(s.tensor - first.tensor).abs().max().item():.3g}")
        return first.tensor
    by_rank = {s.rank: s.tensor for s in shards}
    if sorted(by_rank) != list(range(first.size)):
        raise AssertionError(f"have shards of ranks {sorted(by_rank)} of {first.size}")
    blocks = [by_rank[r].chunk(first.stride, dim=first.dim) for r in range(first.size)]
    return torch.cat([blocks[r][i] for i in range(first.stride) for r in range(first.size)], dim=first.dim)


def assemble_all(per_rank: list[dict[str, Shard]], atol: float = 0.0) -> dict[str, torch.Tensor]:
    """``assemble`` for every name found in the ranks' dicts (PP stages hold different names)."""
    names: dict[str, list[Shard]] = {}
    for shards in per_rank:
        for name, shard in shards.items():
            names.setdefault(name, []).append(shard)
    return {name: assemble(shards, atol) for name, shards in names.items()}


def local_shards(model: torch.nn.Module, what: str = "main_grad") -> dict[str, Shard]:
    """This rank's ``param.<what>`` (``data``, ``grad`` or DDP's ``main_grad``) of every parameter,
    as FP32 CPU copies, by global name."""
    rank = parallel_state.get_tensor_model_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    return {
        name: Shard.of(getattr(p, what).detach().float().clone(), p, rank, size)
        for name, p in global_parameters(model).items()
    }


def synthetic_batches(
    count: int, *, seed: int = 0, micro_batch_size: int = MICRO_BATCH
) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of random tokens: ``tokens`` and ``labels`` (the next tokens) of
    shape (micro_batch_size, SEQ), int64, and ``position_ids``; the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        seq = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1), generator=g)
        batches.append(
            dict(
                tokens=seq[:, :-1].contiguous(),
                labels=seq[:, 1:].contiguous(),
                position_ids=torch.arange(SEQ).expand(micro_batch_size, SEQ).contiguous(),
            )
        )
    return batches


def forward_step(data_iterator, model):
    """Megatron's ``forward_step_func`` for these batches: the summed token loss and the token count
    (the schedule divides by it, as for pretrain_gpt's), and both for the report."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss: torch.Tensor):
        loss = per_token_loss.float().sum()
        tokens = torch.full((), per_token_loss.numel(), dtype=torch.int, device=per_token_loss.device)
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

    return output, loss_func


def forward_backward(model: torch.nn.Module, batches: list[dict], *, forward_only: bool = False) -> float:
    """Run ``batches`` as the micro-batches of one global batch through Megatron's schedule
    (``get_forward_backward_func``: 1F1B under PP) and return the mean loss per token, averaged
    over the data-parallel ranks, on every rank. Gradients land in the DDP buffers."""
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=batches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )
    total = torch.zeros(2)
    if parallel_state.is_pipeline_last_stage():
        total = torch.stack([r["lm loss"] for r in losses]).sum(0)
    # The loss exists on the last stage: share it with the others, then average over DP.
    torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1]).item()


def tiny_ddp(model: MegatronModule, *, distributed_optimizer: bool = True, **ddp_overrides) -> DistributedDataParallel:
    """Megatron's DDP around ``model`` (FP32 grad buffers, no overlap), with
    ``finalize_model_grads`` installed so that the schedule reduces gradients over DP and, for
    sequence-parallel norms, over TP."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        **ddp_overrides,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def tiny_optimizer(model: DistributedDataParallel, *, lr: float = 1e-2, **overrides):
    """``get_megatron_optimizer`` for ``model``: Adam, clip 1.0, the distributed optimizer when
    the model's DDP config uses it, BF16 mixed precision when the model has BF16 params."""
    config = model.config
    fields = dict(
        optimizer="adam",
        lr=lr,
        weight_decay=0.01,
        clip_grad=1.0,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=model.ddp_config.use_distributed_optimizer,
    )
    fields.update(overrides)
    return get_megatron_optimizer(OptimizerConfig(**fields), [model])


def train_step(model: DistributedDataParallel, optimizer, batches: list[dict]) -> float:
    """One optimizer step on ``batches`` (one global batch); returns its loss (before the step)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = forward_backward(model, batches)
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("the optimizer skipped the step (non-finite gradients)")
    return loss


def checkpoint_state(model: DistributedDataParallel, optimizer, sharding_type: str, is_loading: bool) -> dict:
    """The sharded state dict of ``model`` (DDP-wrapped) and its optimizer, as megatron.training
    builds it for a dist checkpoint."""
    metadata = dict(
        distrib_optim_sharding_type=sharding_type,
        distrib_optim_fully_reshardable_mem_efficient=True,  # gathers over gloo (the default: CUDA tensors)
        singleton_local_shards=False,
        chained_optim_avoid_prefix=True,
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    state = {"model": model.module.sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading, metadata=metadata)
    return state


def save_checkpoint(directory, model, optimizer, *, sharding_type: str = "dp_reshardable") -> None:
    """A dist checkpoint of ``model`` and its optimizer in ``directory`` (existing, one path for all ranks)."""
    dist_checkpointing.save(checkpoint_state(model, optimizer, sharding_type, is_loading=False), str(directory))


def load_checkpoint(directory, model, optimizer, *, sharding_type: str = "dp_reshardable") -> None:
    """Load what ``save_checkpoint`` wrote into ``model`` and its optimizer (the same TP/PP layout,
    any DP size). COAT's optimizer needs nothing more. Megatron's own with torch's Adam (a ``step``
    tensor per parameter) needs three fixes in megatron-core 0.19: ``state_dict()`` asserts on a new
    optimizer, which has no states yet; ``load_state_dict`` gives every parameter one shared step
    tensor, which Adam's foreach step increments once per parameter; and the ``dp_reshardable`` load
    then overwrites the step with the one from before the load. The saved step does reach the param
    groups: each parameter gets its own step tensor from there."""
    adam = [
        o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if not isinstance(o, CoatDistributedOptimizer)
    ]
    for opt in adam:
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()  # what Megatron does later in this load
    state = dist_checkpointing.load(checkpoint_state(model, optimizer, sharding_type, is_loading=True), str(directory))
    model.module.load_state_dict(state["model"])
    with torch.no_grad():  # FP32 params: the main params are views of them, copied into in place
        optimizer.load_state_dict(state["optimizer"])
    for opt in (o for o in adam if isinstance(o.optimizer, torch.optim.Adam)):  # AdamW too: a step per param
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                opt.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))


def train_on_text(
    model: torch.nn.Module,
    steps: int,
    batch_size: int,
    *,
    lr: float = 3e-3,
    weight_decay: float = 0.0,
    corpus_bytes: int = 256 << 10,
) -> list[float]:
    """Train ``model`` (no DDP) with torch's AdamW on random windows (they may overlap) of the first
    95% of ``corpus_bytes`` of the standard library's docstrings as byte tokens, drawn from a fixed
    generator: the per-step losses."""
    text = torch.frombuffer(bytearray(stdlib_docstrings(corpus_bytes)), dtype=torch.uint8).long().clamp_(max=VOCAB - 1)
    text = text[: int(len(text) * 0.95)]  # the windows these tests were tuned on
    positions = torch.arange(SEQ).expand(batch_size, SEQ).contiguous()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - SEQ - 1, (batch_size,), generator=g)
        windows = torch.stack([text[s : s + SEQ + 1] for s in starts.tolist()])
        tokens, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        loss = model(tokens, positions, None, labels=labels).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
