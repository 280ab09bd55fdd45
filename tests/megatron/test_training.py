"""Real Megatron-Core on gloo: DDP training at DP=2 (distributed optimizer, and Megatron's BF16
optimizer) that matches DP=1, and a dist checkpoint (``dp_reshardable``) that resumes exactly.

BF16 parameters with FP32 main parameters and gradients: the precision path the COAT optimizer
replaces.
"""

import pytest
import torch
from distributed import run_distributed
from megatron.core import parallel_state
from tiny_gpt import (
    forward_backward,
    load_checkpoint,
    local_shards,
    save_checkpoint,
    synthetic_batches,
    tiny_config,
    tiny_ddp,
    tiny_gpt,
    tiny_optimizer,
    train_step,
)

STEPS = 6


def _my_micro_batches() -> list[dict]:
    """One global batch of two micro-batches, split over the data-parallel ranks."""
    batches = synthetic_batches(2)
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return batches[rank::size]


def _build(seed: int = 0, distributed_optimizer: bool = True):
    model = tiny_ddp(
        tiny_gpt(tiny_config(params_dtype=torch.bfloat16), seed=seed), distributed_optimizer=distributed_optimizer
    )
    return model, tiny_optimizer(model, lr=1e-2)


def _train(distributed_optimizer: bool) -> dict:
    model, optimizer = _build(distributed_optimizer=distributed_optimizer)
    batches = _my_micro_batches()
    losses = [train_step(model, optimizer, batches) for _ in range(STEPS)]
    return dict(losses=losses, params=local_shards(model, "data"))


@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["distributed-optimizer", "bf16-optimizer"])
def test_dp2_trains_like_dp1(distributed_optimizer):
    dp2 = run_distributed(_train, 2, args=(distributed_optimizer,), tensor_parallel=1)
    dp1 = run_distributed(_train, 1, args=(distributed_optimizer,), tensor_parallel=1)[0]
    losses = dp2[0]["losses"]
    # The same global batch every step: the model memorises it.
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.5, losses
    # Both ranks hold the same parameters (all-gathered by the distributed optimizer, or updated
    # from all-reduced gradients) and saw the same averaged loss.
    assert dp2[1]["losses"] == losses
    for name, shard in dp2[0]["params"].items():
        assert torch.equal(shard.tensor, dp2[1]["params"][name].tensor), name
    # Splitting the batch over DP changes nothing but rounding.
    assert losses == pytest.approx(dp1["losses"], abs=5e-3)


def _resume(directory: str) -> dict:
    model, optimizer = _build(seed=0)
    batches = _my_micro_batches()
    for _ in range(2):
        train_step(model, optimizer, batches)
    save_checkpoint(directory, model, optimizer, sharding_type="dp_reshardable")
    expected = [train_step(model, optimizer, batches) for _ in range(2)]

    model, optimizer = _build(seed=1)  # other weights, fresh optimizer states
    before_load = forward_backward(model, batches, forward_only=True)
    load_checkpoint(directory, model, optimizer, sharding_type="dp_reshardable")
    resumed = [train_step(model, optimizer, batches) for _ in range(2)]
    return dict(expected=expected, before_load=before_load, resumed=resumed)


def test_dist_checkpoint_resumes_exactly(tmp_path):
    ranks = run_distributed(_resume, 2, args=(str(tmp_path),), tensor_parallel=1)
    for r in ranks:
        assert r["before_load"] != pytest.approx(r["expected"][0], abs=1e-2)  # the load matters
        # The first step after the load checks the weights, the second the optimizer states
        # (Adam's moments and step): both bit-exact.
        assert r["resumed"] == r["expected"]
    assert (tmp_path / "metadata.json").exists()
