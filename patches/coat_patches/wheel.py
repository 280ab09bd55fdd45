"""``megatron.training`` as shipped in the megatron-core wheel: its dataset helpers come prebuilt.

``initialize_megatron`` compiles Megatron's C++ dataset helpers at start-up by running ``make`` in
``megatron/core/datasets`` (``_compile_dependencies`` -> ``compile_helpers``). The megatron-core
wheel ships the compiled extension (``helpers_cpp.*.so``) but not the Makefile, so ``make`` fails
and Megatron calls ``sys.exit(1)``: every ``pretrain()`` on a wheel-only install stops there, GPU
or not. The patch skips the build when the extension already imports, and runs Megatron's build
otherwise (a source checkout of Megatron-LM).
"""

from __future__ import annotations

import importlib

from .replacements import Replacements
from .version import require_megatron_core


def helpers_importable() -> bool:
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


def install(replacements: Replacements) -> None:
    """Replace ``megatron.core.datasets.utils.compile_helpers`` (imported at call time by
    ``megatron.training.initialize._compile_dependencies``)."""
    require_megatron_core(__name__)
    import megatron.core.datasets.utils as dataset_utils

    compile_helpers = dataset_utils.compile_helpers

    def compile_helpers_unless_prebuilt():
        if not helpers_importable():
            compile_helpers()

    replacements.replace(dataset_utils, "compile_helpers", compile_helpers_unless_prebuilt)
