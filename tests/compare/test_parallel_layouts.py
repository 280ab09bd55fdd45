"""Every parallel layout starts from the one-GPU model and trains it: the comparison tool's
initialisation and training under TP, PP (with virtual stages) and DP, on gloo with real
Megatron-Core, against one process.

- TP 2: each rank's weights are its slice of the TP 1 weights, bit for bit (the full tensor is
  drawn, the rank keeps its slice: ``build.init_weights_by_name``); PP 2: each stage's layers are
  the TP 1 model's layers of the same global index.
- PP 2 with 2 virtual stages each (the interleaved schedule) trains the same losses as one process
  at the same global batch.
"""

import math
from dataclasses import replace

import pytest
import torch
from distributed import run_distributed

from coat_compare.build import GATED_FC1, global_parameter_names
from coat_compare.modes import MODES
from coat_compare.presets import get_preset

SEED = 1234
# tiny, made 4 layers deep so that two stages of two virtual stages each hold a layer apiece
DEEP = replace(get_preset("tiny"), layers=4, steps=4, micro_batch=2, global_batch=8)


def _gpt_weights(mode_name: str, layers: int, vpp: int = 1) -> dict:
    """This rank's GPTModel chunks for ``mode_name``, as the comparison builds them: {one-GPU name:
    (weight, partition dim or None)}."""
    from megatron.core import parallel_state

    from coat_compare.build import stage_models, transformer_config

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    mode, preset = MODES[mode_name], replace(get_preset("tiny"), layers=layers)
    config = transformer_config(preset, mode, tp, pp=pp, vpp=vpp, ddp=False)
    out = {}
    for gpt in stage_models(preset, mode, config, SEED):
        names = global_parameter_names(gpt)
        for local, p in gpt.named_parameters():
            parallel = getattr(p, "tensor_model_parallel", False) and tp > 1
            out[names[local]] = (p.detach().clone(), p.partition_dim if parallel else None)
    return out


def _whole(slices: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The one-GPU tensor from the TP ranks' slices: rank r holds pieces r, r + tp, ... of it."""
    tp = len(slices)
    pieces = [s.chunk(stride, dim=dim) for s in slices]
    return torch.cat([pieces[i % tp][i // tp] for i in range(tp * stride)], dim=dim)


@pytest.mark.parametrize("mode", ["bf16", "coat"])
def test_tp2_weights_are_slices_of_the_tp1_weights_bit_for_bit(mode):
    (one,) = run_distributed(_gpt_weights, 1, args=(mode, 2), tensor_parallel=1)
    two = run_distributed(_gpt_weights, 2, args=(mode, 2), tensor_parallel=2)
    assert set(two[0]) == set(one)
    split = 0
    for name, (reference, _) in one.items():
        rank0, dim = two[0][name]
        if dim is None:  # norms (1-D) and anything TP does not split: the same on both ranks
            assert torch.equal(rank0, reference) and torch.equal(two[1][name][0], reference), name
            continue
        split += 1
        stride = 2 if name.endswith(GATED_FC1) else 1
        whole = _whole([two[0][name][0], two[1][name][0]], dim, stride)
        assert torch.equal(whole, reference), name
    assert split == 2 + 4 * 2  # embedding, output layer, and qkv, proj, fc1, fc2 of each layer


def test_pp2_stages_hold_the_tp1_layers_of_their_global_index():
    (one,) = run_distributed(_gpt_weights, 1, args=("coat", 4), tensor_parallel=1)
    stages = run_distributed(_gpt_weights, 2, args=("coat", 4), tensor_parallel=1, pipeline_parallel=2)
    first, last = stages
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    assert {n for n in first if ".layers." in n} == {n for n in one if ".layers.0." in n or ".layers.1." in n}
    assert {n for n in last if ".layers." in n} == {n for n in one if ".layers.2." in n or ".layers.3." in n}
    for stage in stages:
        for name, (weight, _) in stage.items():
            assert torch.equal(weight, one[name][0]), name


def _train_losses(pp: int, vpp: int, mode: str) -> list[float]:
    from coat_compare import parallel
    from coat_compare.train import train

    parallel.seed_everything(SEED)
    result = train(DEEP, MODES[mode], SEED, pp=pp, vpp=vpp, step_timeout=None)
    return result["losses"], result["peak_MiB_per_stage"]


@pytest.mark.parametrize("mode", ["bf16", "coat"])
def test_interleaved_pipeline_trains_the_one_process_losses(mode):
    """PP 2 x 2 virtual stages against one process at the same global batch (4 micro-batches of 2
    per step): the stages exchange BF16 hidden states, the same the layers hand each other in one
    process, so nothing but the schedule's order changes."""
    ((one, _),) = run_distributed(_train_losses, 1, args=(1, 1, mode), tensor_parallel=1, timeout=300)
    ranks = run_distributed(
        _train_losses,
        2,
        args=(2, 2, mode),
        tensor_parallel=1,
        pipeline_parallel=2,
        model_parallel_kwargs={"virtual_pipeline_model_parallel_size": 2},
        timeout=300,
    )
    (losses, per_stage), (losses_last, _) = ranks
    assert losses == losses_last  # every rank reports the last stage's loss
    assert len(per_stage) == 2
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert losses == pytest.approx(one, rel=1e-5, abs=1e-5)


def test_virtual_stages_hold_the_tp1_layers_of_their_global_index():
    """PP 2 x 2 virtual stages: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3."""
    (one,) = run_distributed(_gpt_weights, 1, args=("coat", 4), tensor_parallel=1)
    stages = run_distributed(
        _gpt_weights,
        2,
        args=("coat", 4, 2),
        tensor_parallel=1,
        pipeline_parallel=2,
        model_parallel_kwargs={"virtual_pipeline_model_parallel_size": 2},
    )
    layers = [sorted({int(n.split(".")[2]) for n in stage if ".layers." in n}) for stage in stages]
    assert layers == [[0, 2], [1, 3]]
    for stage in stages:
        for name, (weight, _) in stage.items():
            assert torch.equal(weight, one[name][0]), name


def test_the_layout_rule_judges_against_the_reference_and_bf16s_own_drift():
    from coat_compare.layouts import judge, layout_name, layout_rows, parse_layouts

    assert parse_layouts("1, tp2xdp2,pp2xvpp2") == [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1)]
    assert [layout_name(*x) for x in parse_layouts("1,dp2xtp2")] == ["1", "tp2xdp2"]
    ref = [5.0, 4.0, 3.0]
    assert judge(ref, [5.005, 4.04, 3.0], None)["agrees"]  # 1e-3 relative, 0.04 drift
    late = judge(ref, [5.005, 4.0, 3.06], None)
    assert late["first_step_ok"] and not late["drift_ok"] and not late["agrees"]
    assert judge(ref, [5.005, 4.0, 3.06], bf16_drift=0.03)["agrees"]  # BF16 drifts 0.03 itself: bound 0.09
    assert not judge(ref, [5.02, 4.0, 3.0], None)["first_step_ok"]  # 4e-3 relative
    runs = {
        ("bf16", "1"): {"status": "ok", "losses": ref},
        ("bf16", "tp2"): {"status": "ok", "losses": [5.0, 4.0, 3.03]},
        ("coat", "1"): {"status": "ok", "losses": ref},
        ("coat", "tp2"): {"status": "failed", "reason": "it died"},
    }
    bf16_ref, bf16_tp2, coat_ref, coat_tp2 = layout_rows(runs, ["1", "tp2"], ["bf16", "coat"])
    assert bf16_tp2["agrees"] and bf16_tp2["bf16_drift"] is None and "agrees" not in bf16_ref
    assert coat_ref["status"] == "ok" and coat_tp2["status"] == "failed" and "it died" in coat_tp2["reason"]
