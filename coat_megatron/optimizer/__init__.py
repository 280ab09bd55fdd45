"""The FP8 optimizer: AdamW whose states are range-expanded FP8 (DESIGN section 5).

``CoatAdamW`` is a torch optimizer usable on any model with FP32 parameters.
"""

from .adamw import CoatAdamW, summarize_telemetry

__all__ = ["CoatAdamW", "summarize_telemetry"]
