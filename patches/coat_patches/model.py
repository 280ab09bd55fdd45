"""The COAT layer spec for every ``GPTModel`` a ``--coat-fp8`` run builds.

Where the spec is chosen differs between scripts and releases: Megatron-LM's ``gpt_builders.py``
calls ``get_gpt_layer_local_spec`` / ``..._with_transformer_engine_spec`` (imported by name at
import time), and megatron-core 0.19's ``megatron.training.models.gpt.GPTModelBuilder`` (what
0.19's ``pretrain_gpt.py`` uses through ``GPTModelConfig``) picks one in ``default_layer_spec``.
What all of them do in the end is construct ``GPTModel(config=..., transformer_layer_spec=...)``.
So the hook sits on ``GPTModel.__init__`` itself: with ``--coat-fp8`` (and
``--coat-activations`` on) the spec it receives is replaced by ``get_gpt_block_coat_spec`` for
the same config and virtual pipeline stage. Argument validation (``coat_patches.arguments``)
has already refused what the COAT spec cannot build (MoE, MTP, ``--spec``, non-SwiGLU MLPs).

The core attention follows Megatron's own choice: TransformerEngine's when
``--transformer-impl transformer_engine`` and TE imports (and ``--attention-backend`` is not
``local``), else Megatron's ``DotProductAttention``.
"""

from __future__ import annotations

import functools
import inspect

from coat_megatron.config import CoatConfig
from coat_megatron.optional import transformer_engine_available

from .arguments import coat_config_from_args
from .replacements import Replacements
from .version import require_megatron_core


def run_coat_config() -> CoatConfig | None:
    """The CoatConfig of the running ``megatron.training`` job, or None (no ``--coat-fp8``, or no
    Megatron arguments parsed in this process)."""
    from megatron.training import global_vars

    args = global_vars._GLOBAL_ARGS  # get_args() asserts when a model is built outside megatron.training
    return coat_config_from_args(args) if args is not None else None


def coat_core_attention(config):
    """The attention core for the COAT spec under this TransformerConfig (see the module docstring)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    wants_te = (
        getattr(config, "transformer_impl", "local") == "transformer_engine"
        and config.attention_backend != AttnBackend.local
    )
    if wants_te and transformer_engine_available():
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    return DotProductAttention


def install(replacements: Replacements) -> None:
    """Wrap ``GPTModel.__init__`` so that a ``--coat-fp8`` run builds COAT layers."""
    require_megatron_core(__name__)
    from megatron.core.models.gpt.gpt_model import GPTModel

    from coat_megatron.spec import get_gpt_block_coat_spec

    original = GPTModel.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def gpt_model_init(self, *args, **kwargs):
        coat = run_coat_config()
        if coat is not None and coat.activations:
            bound = signature.bind(self, *args, **kwargs)
            config = bound.arguments["config"]
            bound.arguments["transformer_layer_spec"] = get_gpt_block_coat_spec(
                config, coat, vp_stage=bound.arguments.get("vp_stage"), core_attention=coat_core_attention(config)
            )
            args, kwargs = bound.args[1:], bound.kwargs
        original(self, *args, **kwargs)

    replacements.replace(GPTModel, "__init__", gpt_model_init)
