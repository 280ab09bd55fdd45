"""The lean hot path, on the CPU (real Megatron-Core on gloo): FP8 activations pass between COAT's
ops without one call of ``Fp8Tensor.__torch_dispatch__`` (no tensor-subclass dispatch on the hot
path: the ops unpack the codes and scales themselves), at TP 1 and at TP 2 with sequence parallel
(FP8 all-gathers). (On a GPU, COAT's kernel launches against TE's: tests/compare/test_lean_layer.py.)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from distributed import run_distributed
from tiny_gpt import MICRO_BATCH, SEQ, tiny_config

from coat_megatron.config import CoatConfig

WEIGHT_CODES = ["memory", "codes", "cached"]  # the recipes by the FP8 weight codes they keep: none, W, W and W^T


def _layer_step(coat_config: CoatConfig, tp: int):
    """fwd+bwd of one COAT TransformerLayer of the tiny GPT (BF16, sequence parallel at TP > 1) on
    this rank's (SEQ / tp, MICRO_BATCH, hidden) input, with RoPE as in GPTModel."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from coat_megatron.spec import get_gpt_layer_coat_spec

    model_parallel_cuda_manual_seed(1234)
    config = tiny_config(num_layers=1, params_dtype=torch.bfloat16, sequence_parallel=tp > 1)
    layer = build_module(get_gpt_layer_coat_spec(coat_config), config=config, layer_number=1)
    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0)(SEQ)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SEQ // tp, MICRO_BATCH, config.hidden_size, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(x.shape, generator=g).to(torch.bfloat16)

    def step():
        out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
        out.backward(dy)
        for t in [x, *layer.parameters()]:
            t.grad = None

    return step


def _count_dispatch(recipe: str, tp: int) -> dict:
    from coat_megatron.fp8.tensor import Fp8Tensor

    step = _layer_step(CoatConfig.recipe(recipe), tp)
    step()  # the first step builds the FP8 weight copies
    calls: Counter = Counter()
    made = [0]
    saved = {name: Fp8Tensor.__dict__[name] for name in ("__torch_dispatch__", "__new__")}

    def counting_dispatch(cls, func, types, args=(), kwargs=None):
        calls[str(func)] += 1
        return saved["__torch_dispatch__"].__func__(cls, func, types, args, kwargs)

    def counting_new(cls, *args, **kwargs):
        made[0] += 1
        return saved["__new__"].__func__(cls, *args, **kwargs)

    Fp8Tensor.__torch_dispatch__ = classmethod(counting_dispatch)
    Fp8Tensor.__new__ = staticmethod(counting_new)
    try:
        step()
    finally:
        for name, attribute in saved.items():
            setattr(Fp8Tensor, name, attribute)
    return {"dispatch": dict(calls), "made": made[0]}


@pytest.mark.parametrize("recipe", WEIGHT_CODES)
def test_a_coat_layer_step_makes_no_tensor_subclass_dispatch(recipe):
    got = run_distributed(_count_dispatch, 1, args=(recipe, 1), tensor_parallel=1)[0]
    # FP8 activations do travel between the ops (else this test would check nothing) ...
    assert got["made"] >= 2, got
    # ... and none of them ever reaches torch's dispatcher as a subclass
    assert got["dispatch"] == {}, got


def test_a_sequence_parallel_coat_layer_step_makes_no_tensor_subclass_dispatch():
    ranks = run_distributed(_count_dispatch, 2, args=("memory", 2), tensor_parallel=2)
    for got in ranks:
        assert got["made"] >= 3 and got["dispatch"] == {}, got
