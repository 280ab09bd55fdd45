"""coat-compare's te-fp8-pa mode asks Megatron for exactly what megatron.training's flags ask for."""

import sys

import pytest


def test_coat_compare_asks_megatron_for_what_megatron_trainings_flags_ask_for(monkeypatch):
    """te-fp8-pa's optimizer fields equal megatron.training's parse of --use-precision-aware-optimizer
    --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 --fp8-recipe tensorwise (training.py
    get_megatron_optimizer_config copies every OptimizerConfig field from these args)."""
    pytest.importorskip("megatron.training")
    from megatron.training import arguments

    from coat_compare.build import PRECISION_AWARE_FP8_FIELDS
    from coat_compare.modes import MODES

    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--vocab-size 256 --micro-batch-size 1 --train-iters 1 --lr 3e-4 --bf16 --use-distributed-optimizer "
        "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise --mock-data "
        "--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"
    ).split()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    # parse_and_validate_args without setting Megatron's global args (other tests set their own)
    args = arguments.parse_args()
    arguments.validate_args(args, {"tokenizer_type": "NullTokenizer"})
    for field, value in PRECISION_AWARE_FP8_FIELDS.items():
        assert getattr(args, field) == value, field
    assert args.fp8_recipe == MODES["te-fp8-pa"].fp8_recipe
    assert args.accumulate_allreduce_grads_in_fp32 == MODES["te-fp8-pa"].grad_fp32
