"""COAT's FP8 AdamW inside Megatron-Core's distributed optimizer.

Megatron's ``DistributedOptimizer`` gives each data-parallel rank a contiguous 1-D shard of every
bucket of the gradient buffer, and keeps FP32 main parameters for the shard (its "main params").
``get_coat_optimizer`` builds Megatron's optimizer and swaps the inner torch optimizer for
``CoatAdamW`` on those shards, so each rank stores the FP8 states of its shard only (no state is
replicated), and the fused step writes the BF16 model weights straight into DDP's parameter
buffer (Megatron's separate main-to-model copy is skipped).

Quantization groups are counted in each parameter's own flattened index space. A shard edge
inside a group would make the quantization depend on the DP size and the bucket layout, so the
parameter layout must put every shard edge on a group boundary: ``coat_param_layout`` (for
``DistributedDataParallel(..., full_param_layout=...)``) is Megatron's layout with parameter starts
padded to the group size (128, not 64) and buckets padded to a multiple of DP x group size. Then a
parameter's codes and per-group metadata are the same at any DP size, and a checkpoint moves
between DP sizes without requantizing.

Checkpoints (``sharded_state_dict`` / ``dist_checkpointing``), by ``distrib_optim_sharding_type``:

- ``dp_reshardable`` (Megatron's default): COAT's compressed format. Per parameter (keyed by its
  model chunk and name under the model-parallel rank's ``dp_group_idx``): the FP32 main param and
  the codes (uint8) in the parameter's index space, and scale/k/center (FP32) in its group space.
  Loads bit-exactly at the same DP size and, as the shards are group-aligned, at any other DP size.
- ``fully_reshardable``: FP32 Adam states (``param``, ``exp_avg``, ``exp_avg_sq``) in exactly the
  layout stock Megatron writes: export to, and import from, runs with Megatron's own Adam (the
  moments are dequantized on save and quantized on load); also reshards TP/PP.
"""

from __future__ import annotations

import copy
import math
from typing import Iterator

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, param_group_identifier_keys
from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout, bucket_end_divisor
from megatron.core.process_groups_config import ProcessGroupCollection

from ..config import CoatConfig
from .adamw import CoatAdamW, summarize_telemetry
from .checkpoint import MOMENTS, format_record, fp32_moments, state_keys
from .param_gather import Fp8ParamGather, gather_exact_params, install_fp8_param_gather

# ---------------------------------------------------------------------------------- the layout


def align_buffer_layout(
    layout: PerBufferParamLayout, group_size: int, data_parallel_world_size: int, pad_for_high_nccl_busbw: bool
) -> PerBufferParamLayout:
    """Megatron's layout of one buffer with every DP shard edge on a quantization-group boundary.

    Keeps Megatron's order and bucket assignment; pads each parameter start to ``group_size`` and
    each bucket end to a multiple of DP x ``group_size`` (and of Megatron's NCCL padding if set),
    so a shard (bucket size / DP) is a whole number of groups and starts on a group boundary.
    """
    divisor = math.lcm(
        data_parallel_world_size * group_size, bucket_end_divisor(data_parallel_world_size, pad_for_high_nccl_busbw)
    )
    by_bucket: dict[int, list] = {}
    for param, (start, _, bucket) in sorted(layout.param_index_map.items(), key=lambda kv: kv[1][0]):
        by_bucket.setdefault(bucket, []).append(param)
    index_map, buckets, unpadded = {}, [], []
    cursor = 0
    for bucket in sorted(by_bucket):
        bucket_start = cursor
        for param in by_bucket[bucket]:
            start = -(-cursor // group_size) * group_size
            index_map[param] = (start, start + param.data.nelement(), bucket)
            cursor = start + param.data.nelement()
        unpadded.append(cursor - bucket_start)
        cursor = -(-cursor // divisor) * divisor
        buckets.append((bucket_start, cursor))
    return PerBufferParamLayout(
        param_index_map=index_map,
        bucket_indices=buckets,
        per_bucket_numel_unpadded=unpadded,
        param_indices=layout.param_indices,
        num_optimizer_shards=layout.num_optimizer_shards,
    )


def compute_coat_full_param_layout(
    params: list[torch.nn.Parameter],
    bucket_size: int | None,
    data_parallel_world_size: int,
    ddp_config,
    expert_data_parallel_world_size: int | None = None,
    *,
    group_size: int = 128,
) -> FullParamLayout:
    """``DistributedOptimizer.compute_full_param_layout`` (same arguments) aligned to ``group_size``."""
    layout = DistributedOptimizer.compute_full_param_layout(
        params,
        bucket_size,
        data_parallel_world_size,
        ddp_config,
        expert_data_parallel_world_size=expert_data_parallel_world_size,
    )
    return align_full_param_layout(
        layout, data_parallel_world_size, ddp_config, expert_data_parallel_world_size, group_size=group_size
    )


def align_full_param_layout(
    layout: FullParamLayout,
    data_parallel_world_size: int,
    ddp_config,
    expert_data_parallel_world_size: int | None = None,
    *,
    group_size: int = 128,
) -> FullParamLayout:
    """Megatron's layout of every buffer (``align_buffer_layout``) with shard edges on ``group_size`` boundaries."""
    aligned = {}
    for key, per_buffer in layout.layouts.items():
        dp = (
            (expert_data_parallel_world_size or data_parallel_world_size)
            if key.is_expert_parallel
            else data_parallel_world_size
        )
        aligned[key] = align_buffer_layout(per_buffer, group_size, dp, ddp_config.pad_buckets_for_high_nccl_busbw)
    return FullParamLayout(layouts=aligned)


def coat_param_layout(
    module: torch.nn.Module, ddp_config, *, group_size: int = 128, pg_collection=None, disable_bucketing: bool = False
) -> FullParamLayout:
    """The parameter layout to build DDP with for COAT:
    ``DistributedDataParallel(config, ddp_config, module, full_param_layout=coat_param_layout(module, ddp_config))``.

    Sizes buckets and DP shards as DDP itself would (same process groups, same bucket size), with
    every shard edge on a quantization-group boundary.
    """
    groups = ProcessGroupCollection.setup_process_groups_for_ddp(pg_collection, module.config, ddp_config)
    bucket_size = ddp_config.bucket_size
    if bucket_size is None:
        bucket_size = max(40000000, 1000000 * groups["dp_group"].size())
    pp_group = groups["pp_group"][0] if isinstance(groups["pp_group"], list) else groups["pp_group"]
    if not ddp_config.overlap_grad_reduce or disable_bucketing or pp_group.rank() > 0:
        bucket_size = None
    params = [p for p in module.parameters() if p.requires_grad]
    return compute_coat_full_param_layout(
        params,
        bucket_size,
        groups["intra_dp_cp_group"].size(),
        ddp_config,
        expert_data_parallel_world_size=groups["intra_expt_dp_group"].size(),
        group_size=group_size,
    )


# ---------------------------------------------------------------------------------- the optimizer


class CoatDistributedOptimizer(DistributedOptimizer):
    """Megatron's DistributedOptimizer whose inner optimizer is ``CoatAdamW`` on the FP32 main
    shards. Made by ``get_coat_optimizer`` (which converts Megatron's own instance in place)."""

    optimizer: CoatAdamW
    fp8_param_gathers: tuple[Fp8ParamGather, ...] = ()  # CoatConfig.fp8_param_gather: set by get_coat_optimizer

    @staticmethod
    def compute_full_param_layout(
        params, bucket_size, data_parallel_world_size, ddp_config, expert_data_parallel_world_size=None
    ):
        """Megatron's hook (what megatron.training calls to lay out DDP), with COAT's alignment."""
        return compute_coat_full_param_layout(
            params, bucket_size, data_parallel_world_size, ddp_config, expert_data_parallel_world_size
        )

    @classmethod
    def convert(cls, opt: DistributedOptimizer, coat_config: CoatConfig, config: OptimizerConfig) -> None:
        """Turn Megatron's ``opt`` into a CoatDistributedOptimizer in place (its param groups, ranges,
        buffers and grad scaler stay; the inner optimizer becomes CoatAdamW)."""
        opt.__class__ = cls
        opt.coat_config = coat_config
        if opt.is_stub_optimizer:
            return
        opt._check_group_aligned_shards()
        inner = CoatAdamW.adopting(
            opt.optimizer.param_groups,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            config=coat_config,
        )
        # the fused step writes the BF16/FP16 model weights: the shard views of DDP's param buffer
        for model_group, model_shards, main_shards in zip(
            opt.model_float16_groups, opt.shard_float16_groups, opt.shard_fp32_from_float16_groups
        ):
            for model_param, model_shard, main_shard in zip(model_group, model_shards, main_shards):
                if model_shard is None or not model_shard.is_contiguous():
                    raise ValueError(
                        f"model parameter {opt._coat_names()[model_param]} has no contiguous BF16 shard; FP8 param gather is not supported with COAT"
                    )
                inner.model_params[main_shard] = model_shard
        opt.optimizer = inner
        opt.init_state_fn = lambda optimizer, config=None: optimizer.init_states()
        if coat_config.master_weights == "split":
            opt._split_main_params()

    @torch.no_grad()
    def _split_main_params(self) -> None:
        """Replace each FP32 main shard of a BF16 parameter by the parameter's own BF16 shard (the
        master's high half) and an int16 low word in the optimizer's state (``master_weights=
        "split"``): 2 bytes per parameter instead of 4. The optimizer then steps the BF16 shards
        in DDP's parameter buffer directly and reads their gradients from DDP's gradient buffer,
        FP32 or BF16, in place (no copy of the gradients either). Megatron's grad-norm, clipping
        and zeroing take a param's ``.grad`` in the param's dtype; gradients in another dtype go
        where its precision-aware path puts them, ``.decoupled_grad``, and this optimizer's config
        copy says so
        (``use_precision_aware_optimizer_no_fp8_or_ds_fp8``: the flag those paths test; its FP32
        main-param code is overridden here)."""
        inner = self.optimizer
        for model_group, model_shards, main_shards in zip(
            self.model_float16_groups, self.shard_float16_groups, self.shard_fp32_from_float16_groups
        ):
            for j, (model_param, model_shard, main_shard) in enumerate(zip(model_group, model_shards, main_shards)):
                group_index, group_order = self.model_param_group_index_map[model_param]
                params = inner.param_groups[group_index]["params"]
                assert params[group_order] is main_shard
                inner.model_params.pop(main_shard, None)
                inner.state.pop(main_shard, None)
                params[group_order] = model_shard
                inner.set_master_weight(model_shard, main_shard)  # the main shard as it is (BF16-exact at start)
                main_shards[j] = model_shard
                model_param.main_param = None  # drop the last reference to the FP32 shard
        self.config = copy.copy(self.config)
        self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True

    def _split(self) -> bool:
        return self.coat_config.master_weights == "split" and not self.is_stub_optimizer

    def _main_fp32(self, main: torch.Tensor) -> torch.Tensor:
        """The FP32 main param of an optimizer param (joined from its halves when split)."""
        return self.optimizer.master_weight(main) if self._split() and main.dtype == torch.bfloat16 else main

    def _copy_model_grads_to_main_grads(self):
        if not self._split():
            return super()._copy_model_grads_to_main_grads()
        # the shards' grads are views of DDP's gradient buffer (no copy), as .decoupled_grad (see _split_main_params)
        for model_groups, shard_groups in (
            (self.model_float16_groups, self.shard_fp32_from_float16_groups),
            (self.model_fp32_groups, self.shard_fp32_groups),
        ):
            for model_group, shard_group in zip(model_groups, shard_groups):
                for model_param, shard in zip(model_group, shard_group):
                    param_range = self._get_model_param_range_map(model_param)["param"]
                    shard.decoupled_grad = model_param.main_grad.view(-1)[param_range.start : param_range.end]

    def _copy_model_params_to_main_params(self, state_dict=None):
        super()._copy_model_params_to_main_params(state_dict)
        if self._split():  # the masters become the model weights: low words zero
            self.optimizer.reset_master_weights()

    # ------------------------------------------------------------------ layout facts

    def _coat_names(self) -> dict[torch.nn.Parameter, str]:
        """A name per model parameter, the same at any DP size: model chunk index and module path."""
        if not hasattr(self, "_coat_param_names"):
            self._coat_param_names = {
                p: f"{i}.{name}" for i, chunk in enumerate(self.model_chunks) for name, p in chunk.named_parameters()
            }
        return self._coat_param_names

    def _coat_shards(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor, int, int]]:
        """(model param, its FP32 main shard, shard start, shard end in the param's index space),
        in the buffers' order."""
        for gbuf_range_maps in self.gbuf_ranges:
            for gbuf_range_map_for_all_buckets in gbuf_range_maps.values():
                for gbuf_range_map in gbuf_range_map_for_all_buckets:
                    for model_param, ranges in gbuf_range_map["param_map"].items():
                        group_index, group_order = self.model_param_group_index_map[model_param]
                        main = self.optimizer.param_groups[group_index]["params"][group_order]
                        yield model_param, main, ranges["param"].start, ranges["param"].end

    def _check_group_aligned_shards(self) -> None:
        g = self.coat_config.optimizer_group_size
        for model_param, _, start, end in self._coat_shards():
            if start % g or (end % g and end != model_param.numel()):
                raise ValueError(
                    f"the distributed optimizer shards parameter {self._coat_names()[model_param]} "
                    f"({model_param.numel()} elements) at [{start}, {end}), inside {g}-element quantization groups, "
                    f"so its FP8 states would depend on the DP size. Build DDP with COAT's layout: "
                    f"DistributedDataParallel(config, ddp_config, module, full_param_layout=coat_param_layout(module, ddp_config))"
                )

    # ------------------------------------------------------------------ the step

    def _init_optimizer_states_with_dummy_values(self):
        if self.is_stub_optimizer:
            return super()._init_optimizer_states_with_dummy_values()
        # Megatron steps with zero grads to allocate states before a checkpoint load; COAT's states
        # are allocated directly (a dummy step would also decay the weights and count a step).
        self.optimizer.init_states()

    def _copy_main_params_to_model_params(self):
        # The fused step has written the BF16 model weights into DDP's param buffer, and FP32
        # model params are their own main params (views of the buffer): nothing left to copy.
        if self.is_stub_optimizer or self.ddp_config.use_megatron_fsdp:
            return super()._copy_main_params_to_model_params()

    # ------------------------------------------------------------------ FP32 view of the states

    def _get_main_param_and_optimizer_states(self, model_param):
        """FP32 param and dequantized FP32 moments of ``model_param``'s shard (Megatron's
        interface for the ``fully_reshardable`` and ``dp_zero`` formats: FP32 Adam states)."""
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        self.optimizer.init_states()
        return {"param": self._main_fp32(main), **fp32_moments(self.optimizer, main)}

    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        if isinstance(tensors.get("param"), torch.Tensor):
            self.optimizer.set_master_weight(main, tensors["param"])
        for moment in MOMENTS:
            if isinstance(tensors.get(moment), torch.Tensor):
                self.optimizer.set_moment(main, moment, tensors[moment])

    # ------------------------------------------------------------------ common state

    def sharded_state_dict(self, model_sharded_state_dict={}, is_loading=False, sharding_type=None, metadata=None):  # noqa: B006 - Megatron's signature
        if not is_loading:
            self._gather_exact_params()
        return super().sharded_state_dict(model_sharded_state_dict, is_loading, sharding_type, metadata)

    def _gather_exact_params(self) -> None:
        """Under the FP8 parameter gather each replica holds the other ranks' shards as dequantized
        codes; a checkpoint is about to read the model's weights: give them the exact BF16 values."""
        if self.fp8_param_gathers:
            gather_exact_params(self.model_chunks)

    def state_dict(self):
        self._gather_exact_params()
        if self.is_stub_optimizer:
            return super().state_dict()
        inner = self.optimizer
        steps = {float(s["step"]) for s in inner.state.values()} or {0.0}
        if len(steps) != 1:
            raise RuntimeError(
                f"the parameters of this optimizer are at different steps {sorted(steps)}; Megatron checkpoints one step"
            )
        step = steps.pop()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": int(step)} for g in inner.param_groups]
        state = {"optimizer": {"param_groups": groups}, "coat": format_record(inner.config)}
        if self.grad_scaler:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        if self.is_stub_optimizer:
            return super().load_state_dict(state_dict)
        record = state_dict.get("coat")
        sharding_type = state_dict.get("param_state_sharding_type")
        if record is not None and record != format_record(self.optimizer.config):
            raise ValueError(
                f"the checkpoint's optimizer states are {record}, this run uses {format_record(self.optimizer.config)}: use the "
                f"checkpoint's CoatConfig, or save it with distrib_optim_sharding_type='fully_reshardable' (FP32 states) and load that"
            )
        if (
            record is None
            and "param_state" in state_dict
            and sharding_type not in self.checkpoint_fully_reshardable_formats | {"dp_zero_gather_scatter"}
        ):
            raise ValueError(
                f"this checkpoint was written by Megatron's own optimizer in the {sharding_type!r} format (bucket space), which "
                f"COAT cannot read: save it with --dist-ckpt-optim-fully-reshardable (FP32 Adam states) and load that"
            )
        saved = {self._group_identifier(g): g for g in state_dict["optimizer"]["param_groups"]}
        steps = {float(g["step"]) for g in state_dict["optimizer"]["param_groups"] if g.get("step") is not None}
        if len(steps) > 1:
            raise ValueError(f"the checkpoint's param groups are at different steps {sorted(steps)}")
        for group in self.optimizer.param_groups:
            for key, value in saved[self._group_identifier(group)].items():
                if key not in ("params", "step"):
                    group[key] = value
        self.optimizer.init_states()
        step = steps.pop() if steps else 0.0
        for state in self.optimizer.state.values():
            state["step"] = torch.tensor(step, dtype=torch.float32)
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        if "param_state" not in state_dict:
            return
        if sharding_type == "dp_reshardable":
            self.load_parameter_state_from_dp_reshardable(state_dict["param_state"])
        elif sharding_type == "fully_reshardable":
            self.load_parameter_state_from_fully_reshardable(state_dict["param_state"])
        elif sharding_type == "dp_zero_gather_scatter":
            if self._split():
                raise NotImplementedError(
                    "a dp_zero_gather_scatter checkpoint loads into FP32 main params only: load it with --coat-master-weights fp32 "
                    "(CoatConfig(master_weights='fp32')) and save it as dp_reshardable or fully_reshardable, which load into split masters"
                )
            self.load_parameter_state_from_dp_zero(state_dict["param_state"])
        else:
            raise NotImplementedError(
                f"COAT checkpoints support dp_reshardable and fully_reshardable, not {sharding_type!r}"
            )

    @staticmethod
    def _group_identifier(group: dict) -> tuple:
        values = []
        for key in param_group_identifier_keys:
            values.append(group[key] if key in group else group.get(f"pre_{key}"))
        return tuple(values)

    # ------------------------------------------------------------------ compressed checkpoint

    def sharded_param_state_dp_reshardable(
        self, model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None
    ):
        """COAT's compressed checkpoint: per parameter, the main param and codes in its index space
        and the per-group metadata in its group space (see the module docstring)."""
        self.optimizer.init_states()
        g = self.coat_config.optimizer_group_size
        names = self._coat_names()
        prefix = f"optimizer.coat.dp_group_idx_{self.data_parallel_group_idx}"
        replica_id = (self.distributed_optimizer_instance_id, 0, 0)  # each DP rank holds other elements
        state = {}
        for model_param, main, start, end in self._coat_shards():
            numel = model_param.numel()
            s = self.optimizer.state[main]
            pieces = {"param": (self._main_fp32(main).view(-1), numel, start)}
            for key in state_keys(s):
                if key.endswith(".codes"):
                    pieces[key] = (s[key].view(-1), numel, start)
                else:
                    pieces[key] = (s[key], -(-numel // g), start // g)
            state[names[model_param]] = {
                key: ShardedTensor(
                    f"{prefix}.{names[model_param]}.{key}",
                    t,
                    t.dtype,
                    tuple(t.shape),
                    (size,),
                    (offset,),
                    None,
                    replica_id,
                )
                for key, (t, size, offset) in pieces.items()
            }
        return state

    @torch.no_grad()
    def load_parameter_state_from_dp_reshardable(self, state_dict):
        names = self._coat_names()
        for model_param, main, _, _ in self._coat_shards():
            loaded = state_dict[names[model_param]]
            s = self.optimizer.state[main]
            self.optimizer.set_master_weight(main, loaded["param"])
            for key in state_keys(s):
                s[key].copy_(loaded[key].view(s[key].shape))

    # ------------------------------------------------------------------ telemetry

    def telemetry_totals(self):
        return self.optimizer.telemetry_totals()


def get_coat_optimizer(config: OptimizerConfig, model_chunks: list, coat_config: CoatConfig | None = None, **kwargs):
    """The counterpart of ``megatron.core.optimizer.get_megatron_optimizer`` with FP8 Adam states.

    Args:
        config: Megatron's OptimizerConfig; needs ``optimizer="adam"``, ``use_distributed_optimizer``
            and decoupled weight decay (AdamW); lr, betas, eps, weight decay, clipping, loss scaling
            and param-group overrides work as in Megatron.
        model_chunks: the DDP-wrapped model chunks, laid out with ``coat_param_layout``.
        coat_config: state formats, expansion, group size and master weights (``CoatConfig``;
            defaults: E4M3 m and v, expansion on, groups of 128, split master weights).
        kwargs: passed to ``get_megatron_optimizer``.
    Returns:
        What ``get_megatron_optimizer`` returns (a DistributedOptimizer, or a ChainedOptimizer of
        them), each converted to ``CoatDistributedOptimizer``.
    """
    coat_config = coat_config if coat_config is not None else CoatConfig()
    problems = []
    if config.optimizer != "adam":
        problems.append(f"optimizer={config.optimizer!r}: COAT's states are Adam's; use optimizer='adam'")
    if not config.use_distributed_optimizer or not all(
        getattr(c, "ddp_config", None) is not None and c.ddp_config.use_distributed_optimizer for c in model_chunks
    ):
        problems.append(
            "COAT's states live on the distributed optimizer's shards: set use_distributed_optimizer=True (--use-distributed-optimizer) in OptimizerConfig and the DDP config"
        )
    if not config.decoupled_weight_decay:
        problems.append("COAT implements AdamW: set decoupled_weight_decay=True")
    if config.use_precision_aware_optimizer:
        problems.append(
            "use_precision_aware_optimizer selects TransformerEngine's FP8/BF16 states: turn it off, COAT replaces it"
        )
    if config.optimizer_cpu_offload:
        problems.append("optimizer_cpu_offload is not supported with COAT")
    if any(getattr(c.ddp_config, "use_megatron_fsdp", False) for c in model_chunks if hasattr(c, "ddp_config")):
        problems.append("Megatron-FSDP is not supported with COAT: use DDP with the distributed optimizer")
    if any(getattr(c.ddp_config, "fp8_param_gather", False) for c in model_chunks if hasattr(c, "ddp_config")):
        problems.append(
            "the DDP config's fp8_param_gather gathers TransformerEngine's FP8 weights, which COAT does not make: "
            "turn it off and set CoatConfig(fp8_param_gather=True) (--coat-fp8-param-gather on) for COAT's FP8 gather"
        )
    if problems:
        raise ValueError("get_coat_optimizer: " + "; ".join(problems))
    optimizer = get_megatron_optimizer(config, model_chunks, **kwargs)
    for opt in optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]:
        if not isinstance(opt, DistributedOptimizer):
            raise TypeError(
                f"get_megatron_optimizer returned a {type(opt).__name__}; COAT needs its DistributedOptimizer"
            )
        CoatDistributedOptimizer.convert(opt, coat_config, config)
    if isinstance(optimizer, ChainedOptimizer) and optimizer.chained_optimizers:
        optimizer.config = optimizer.chained_optimizers[0].config  # the chain reads its first part's flags
    if coat_config.fp8_param_gather:
        parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
        if len(parts) > 1:
            # Megatron's step gathers every bucket group of the model after the first part's step,
            # and this gather lands in the gradient buffers the later parts have yet to read
            raise ValueError(
                f"fp8_param_gather needs one distributed optimizer over the model, and get_megatron_optimizer made "
                f"{len(parts)} (expert-parallel or separately configured parameters): set fp8_param_gather=False"
            )
        gathers = tuple(install_fp8_param_gather(model_chunks))
        for opt in parts:
            opt.fp8_param_gathers = gathers
    return optimizer


def coat_telemetry(optimizer) -> dict[str, float]:
    """State statistics of a COAT optimizer from ``get_coat_optimizer``, over all ranks: k mean /
    min / max and the fraction of codes that underflowed in the last step, for m and v.

    A collective: call it on every rank (e.g. at the training loop's log interval); every rank gets
    the same dict. Parameters replicated across tensor-parallel ranks count once per replica.
    """
    parts = [o for o in (optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer])]
    sums = mins = maxs = None
    group = None
    for opt in parts:
        if opt.is_stub_optimizer:
            continue
        s, lo, hi = opt.telemetry_totals()
        sums = s if sums is None else sums + s
        mins = lo if mins is None else torch.minimum(mins, lo)
        maxs = hi if maxs is None else torch.maximum(maxs, hi)
        group = group or opt.get_grad_stats_parallel_group()
    if sums is None:
        sums = torch.zeros(7, dtype=torch.float64)
        mins = torch.full((2,), float("inf"), dtype=torch.float64)
        maxs = torch.full((2,), float("-inf"), dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums, group=group)
        torch.distributed.all_reduce(mins, op=torch.distributed.ReduceOp.MIN, group=group)
        torch.distributed.all_reduce(maxs, op=torch.distributed.ReduceOp.MAX, group=group)
    return summarize_telemetry(sums, mins, maxs)
