"""A small Megatron command line that every COAT check accepts (mock data, no tokenizer files), and
Megatron's argument parsing as ``parse_and_validate_args`` runs it, with COAT's patches installed."""

import sys

import megatron.training.arguments as arguments

from coat_patches.install import coat_megatron_patches

MOCK_MODEL = (
    "--num-layers 2 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --train-iters 4 --lr 1e-3 --swiglu --normalization RMSNorm "
    "--disable-bias-linear --bf16 --use-distributed-optimizer --tokenizer-type NullTokenizer --vocab-size 256 --mock-data"
).split()


def parse(monkeypatch, *argv: str):
    """Megatron's parse_args + validate_args (as parse_and_validate_args calls them) on ``argv``."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    with coat_megatron_patches():
        args = arguments.parse_args()
        arguments.validate_args(args, {})
    return args
