"""Optional packages: NVIDIA apex and TransformerEngine are detected, never required.

Megatron uses apex's fused norms and Adam when apex is present. The PyPI package named ``apex`` is
an unrelated project, so "apex is importable" is not enough: NVIDIA apex has ``apex.normalization``.
TransformerEngine is the comparison baseline only; the COAT path never imports it.
"""

from __future__ import annotations

import importlib
import importlib.util


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def nvidia_apex_available() -> bool:
    return _importable("apex") and _importable("apex.normalization")


def transformer_engine_available() -> bool:
    if not _importable("transformer_engine"):
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # a TE build that does not match torch/CUDA fails in many ways on import
        return False
    return True


def require_transformer_engine(what: str) -> None:
    """Raise a clear error for a comparison mode that needs TE when TE cannot be imported."""
    if not transformer_engine_available():
        raise ImportError(
            f"{what} needs TransformerEngine, which is not installed or does not import here; "
            f"install it with `pip install coat-megatron[te]` (the COAT path itself does not need it)"
        )
