"""The FP8 optimizer: AdamW whose states are range-expanded FP8 (docs/design.md#the-fp8-optimizer).

``CoatAdamW`` is a torch optimizer usable on any model with FP32 parameters (no Megatron needed);
``get_coat_optimizer`` puts it inside Megatron-Core's distributed optimizer, on each data-parallel
rank's shard (``coat_megatron.optimizer.distributed``, imported on first use).
"""

from .adamw import CoatAdamW, summarize_telemetry

_DISTRIBUTED = (
    "CoatDistributedOptimizer",
    "coat_param_layout",
    "coat_telemetry",
    "compute_coat_full_param_layout",
    "get_coat_optimizer",
)

__all__ = ["CoatAdamW", "summarize_telemetry", *_DISTRIBUTED]


def __getattr__(name: str):
    if name in _DISTRIBUTED:  # imports Megatron-Core only when it is asked for
        from . import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
