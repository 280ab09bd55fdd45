"""Real Megatron-Core on gloo: TP, TP + SP, PP (1F1B) and TP x PP reproduce the TP=1 run.

Every layout builds the tiny GPT from the same seed (the same full weights), runs the same four
micro-batches through Megatron's schedule with DDP + ``finalize_model_grads``, and must give the
TP=1 loss and, after reassembling the shards, the TP=1 gradient of every parameter.
"""

import functools
import math

import pytest
import torch
from distributed import run_distributed
from megatron.core import parallel_state
from tiny_gpt import (
    VOCAB,
    Shard,
    assemble,
    assemble_all,
    forward_backward,
    local_shards,
    synthetic_batches,
    tiny_config,
    tiny_ddp,
    tiny_gpt,
)

MICROBATCHES = 4  # enough for 1F1B at PP=2 to have warm-up, steady state and cool-down


def _loss_grads_logits(sequence_parallel: bool) -> dict:
    batches = synthetic_batches(MICROBATCHES)
    model = tiny_ddp(tiny_gpt(tiny_config(sequence_parallel=sequence_parallel)), distributed_optimizer=False)
    out = dict(loss=forward_backward(model, batches), grads=local_shards(model, "main_grad"), logits=None)
    if model.config.pipeline_model_parallel_size == 1:
        with torch.no_grad():
            logits = model(batches[0]["tokens"], batches[0]["position_ids"], None)  # (b, s, vocab / TP)
        tp = model.config.tensor_model_parallel_size
        out["logits"] = Shard(
            logits.float(), 2 if tp > 1 else None, 1, parallel_state.get_tensor_model_parallel_rank(), tp
        )
    return out


def _tp1_against_plain_autograd() -> dict:
    """The TP=1 run, and the same model's loss and gradients from plain autograd (no schedule,
    no DDP): the mean over all tokens of the micro-batches."""
    out = _loss_grads_logits(sequence_parallel=False)
    plain = tiny_gpt(tiny_config())
    per_token = torch.cat(
        [
            plain(b["tokens"], b["position_ids"], None, labels=b["labels"]).flatten()
            for b in synthetic_batches(MICROBATCHES)
        ]
    )
    per_token.mean().backward()
    out.update(plain_loss=per_token.mean().item(), plain_grads=local_shards(plain, "grad"))
    return out


@functools.cache
def tp1_reference() -> dict:
    return run_distributed(_tp1_against_plain_autograd, 1, tensor_parallel=1)[0]


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    """Same names; each tensor within ``rel`` of its largest element (fp32, reduction order)."""
    assert sorted(got) == sorted(want)
    for name in want:
        scale = want[name].abs().max().item()
        assert scale > 0, f"{name}: the reference gradient is zero, which tests nothing"
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=rel * scale, msg=lambda m: f"{name}: {m}")


def test_tp1_schedule_matches_plain_autograd():
    ref = tp1_reference()
    # Weights of std 0.02 give near-uniform predictions.
    assert abs(ref["loss"] - math.log(VOCAB)) < 0.1
    assert ref["loss"] == pytest.approx(ref["plain_loss"], rel=1e-6)
    assert len(ref["grads"]) == 15  # embedding, 2 x (2 norms, qkv, proj, fc1, fc2), final norm, output
    assert_same_tensors(assemble_all([ref["grads"]]), assemble_all([ref["plain_grads"]]))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_matches_tp1(sequence_parallel):
    ref = tp1_reference()
    ranks = run_distributed(_loss_grads_logits, 2, args=(sequence_parallel,), tensor_parallel=2)
    for r in ranks:
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    logits = assemble([r["logits"] for r in ranks])
    torch.testing.assert_close(logits, ref["logits"].tensor, rtol=0, atol=1e-5)
    # Replicated gradients (norms) must agree across TP ranks; under SP they are partial sums
    # until finalize_model_grads all-reduces them.
    assert_same_tensors(assemble_all([r["grads"] for r in ranks], atol=1e-6), assemble_all([ref["grads"]]))


@pytest.mark.parametrize(
    "world_size, tp, pp, sequence_parallel",
    [(2, 1, 2, False), (4, 2, 2, True)],
    ids=["pp2", "tp2-pp2-sp"],
)
def test_pipeline_parallel_matches_tp1(world_size, tp, pp, sequence_parallel):
    ref = tp1_reference()
    ranks = run_distributed(
        _loss_grads_logits, world_size, args=(sequence_parallel,), tensor_parallel=tp, pipeline_parallel=pp
    )
    for r in ranks:  # forward_backward shares the last stage's loss with every stage
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    # Each stage holds its own layers; together they hold every parameter once.
    stage_names = [set(r["grads"]) for r in ranks]
    assert set().union(*stage_names) == set(ref["grads"])
    assert_same_tensors(assemble_all([r["grads"] for r in ranks], atol=1e-6), assemble_all([ref["grads"]]))
