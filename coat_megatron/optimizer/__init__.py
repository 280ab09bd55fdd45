"""The FP8 optimizer: AdamW whose states are range-expanded FP8 (DESIGN section 5).

``CoatAdamW`` is a torch optimizer usable on any model with FP32 parameters; ``get_coat_optimizer``
puts it inside Megatron-Core's distributed optimizer, on each data-parallel rank's shard.
"""

from .adamw import CoatAdamW, summarize_telemetry
from .distributed import CoatDistributedOptimizer, coat_param_layout, coat_telemetry, compute_coat_full_param_layout, get_coat_optimizer

__all__ = [
    "CoatAdamW",
    "CoatDistributedOptimizer",
    "coat_param_layout",
    "coat_telemetry",
    "compute_coat_full_param_layout",
    "get_coat_optimizer",
    "summarize_telemetry",
]
