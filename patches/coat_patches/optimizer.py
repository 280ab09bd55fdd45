"""COAT's distributed FP8 optimizer where ``megatron.training`` builds its optimizer.

Two hooks, both inert without ``--coat-fp8`` (or with ``--coat-optimizer off``):

- ``setup_model_and_optimizer`` calls ``get_megatron_optimizer``, imported by name into
  ``megatron.training.training``; that name is replaced by a function that calls
  ``get_coat_optimizer`` (Megatron's optimizer, its inner Adam swapped for ``CoatAdamW`` on each
  data-parallel shard) with the same arguments.
- COAT quantizes states in groups counted from each parameter's first element, so no
  data-parallel shard edge may cut a group (``coat_megatron.optimizer.distributed``).
  ``megatron.training`` lays out DDP's buffers with ``DistributedOptimizer.compute_full_param_layout``
  (in ``get_model`` and in 0.19's model builders alike), so that static method is replaced by
  one that aligns Megatron's layout to the optimizer group size.
"""

from __future__ import annotations

from .model import run_coat_config
from .replacements import Replacements
from .version import require_megatron_core


def install(replacements: Replacements) -> None:
    """Replace ``megatron.training.training.get_megatron_optimizer`` and wrap
    ``DistributedOptimizer.compute_full_param_layout`` (see the module docstring)."""
    require_megatron_core(__name__)
    import megatron.training.training as training
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from coat_megatron.optimizer.distributed import align_full_param_layout, get_coat_optimizer

    get_megatron_optimizer = training.get_megatron_optimizer
    compute_full_param_layout = DistributedOptimizer.compute_full_param_layout

    def get_megatron_or_coat_optimizer(config, model_chunks, *args, **kwargs):
        coat = run_coat_config()
        if coat is None or not coat.optimizer:
            return get_megatron_optimizer(config, model_chunks, *args, **kwargs)
        return get_coat_optimizer(config, model_chunks, coat, *args, **kwargs)

    def megatron_or_coat_param_layout(
        params, bucket_size, data_parallel_world_size, ddp_config, expert_data_parallel_world_size=None
    ):
        layout = compute_full_param_layout(
            params,
            bucket_size,
            data_parallel_world_size,
            ddp_config,
            expert_data_parallel_world_size=expert_data_parallel_world_size,
        )
        coat = run_coat_config()
        if coat is None or not coat.optimizer:
            return layout
        return align_full_param_layout(
            layout,
            data_parallel_world_size,
            ddp_config,
            expert_data_parallel_world_size,
            group_size=coat.optimizer_group_size,
        )

    replacements.replace(training, "get_megatron_optimizer", get_megatron_or_coat_optimizer)
    replacements.replace(DistributedOptimizer, "compute_full_param_layout", staticmethod(megatron_or_coat_param_layout))
