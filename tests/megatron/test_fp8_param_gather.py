"""COAT's FP8 parameter all-gather (``CoatConfig.fp8_param_gather``) in Megatron's distributed
optimizer, on gloo: the same training bit for bit as the BF16 gather, at DP 2 (in the step and
overlapped with the forward) and TP 2 x DP 2; the layers' FP8 weights identical to the codes of the
exact values; the bytes on the wire; exact weights for checkpoints; the refusals."""

import pytest
import torch
from distributed import run_distributed
from gather_bytes import all_gather_bytes
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig
from test_coat_spec import coat_gpt
from tiny_gpt import checkpoint_state, synthetic_batches, tiny_config, train_step

from coat_kernels import quantize_per_tensor
from coat_megatron import CoatConfig
from coat_megatron.optimizer import coat_param_layout, get_coat_optimizer

STEPS = 3


def _build(fp8_gather: bool, overlap: bool, sequence_parallel: bool = False):
    config = tiny_config(params_dtype=torch.bfloat16, sequence_parallel=sequence_parallel)
    module = coat_gpt(config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        use_distributed_optimizer=True,
        bucket_size=4096 if overlap else None,  # several buckets: gathers dispatched one after another
    )
    model = DistributedDataParallel(
        config=module.config,
        ddp_config=ddp_config,
        module=module,
        full_param_layout=coat_param_layout(module, ddp_config),
    )
    module.config.finalize_model_grads_func = finalize_model_grads
    if overlap:
        module.config.no_sync_func = model.no_sync
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
    )  # fmt: skip
    optimizer = get_coat_optimizer(opt_config, [model], CoatConfig(fp8_param_gather=fp8_gather))
    return model, optimizer


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _codes(weights: dict[str, torch.Tensor], tagged: set[str]) -> dict[str, torch.Tensor]:
    """The per-tensor FP8 codes and scale a COAT layer makes of each of its weights."""
    out = {}
    for name in tagged:
        q, scale = quantize_per_tensor(weights[name], "e4m3")
        out[name] = (q.view(torch.uint8), scale)
    return out


def _train(fp8_gather: bool, overlap: bool, sequence_parallel: bool = False) -> dict:
    model, optimizer = _build(fp8_gather, overlap, sequence_parallel)
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    batches = synthetic_batches(2 * size)[rank::size]
    tagged = {n for n, p in model.named_parameters() if getattr(p, "coat_fp8_format", None)}
    with all_gather_bytes() as gathered:
        losses = [train_step(model, optimizer, batches) for _ in range(STEPS)]
        if overlap:  # the last step's gathers wait for the next forward: finish them as Megatron does before eval
            model.start_param_sync(force_sync=True)
    out = dict(losses=losses, weights=_weights(model), tagged=tagged, dp_bytes=dict(gathered))
    out["codes"] = _codes(out["weights"], tagged)
    out["numel"] = {n: p.numel() for n, p in model.named_parameters()}
    out["bf16_stream_bytes"] = sum(b.param_data.numel() * 2 // size for g in model.bucket_groups for b in g.buckets)
    if fp8_gather:
        (opt,) = getattr(optimizer, "chained_optimizers", [optimizer])
        out["stream_bytes"] = sum(p.stream_bytes for g in opt.fp8_param_gathers for p in g.plans)
        checkpoint_state(model, optimizer, "dp_reshardable", is_loading=False)  # what a save writes: exact weights
        out["weights_for_checkpoint"] = _weights(model)
    return out


def _check_same_training(fp8: list[dict], bf16: list[dict]) -> None:
    for f, b in zip(fp8, bf16):
        assert f["losses"] == b["losses"]  # bit for bit: the layers computed the same FP8 weights
        assert sorted(f["tagged"]) == sorted(b["tagged"]) and f["tagged"]
        for name in f["tagged"]:
            (qf, sf), (qb, sb) = f["codes"][name], b["codes"][name]
            assert torch.equal(qf, qb) and torch.equal(sf, sb), name
        # what a checkpoint saves is each rank's exact values
        for name, w in b["weights"].items():
            assert torch.equal(f["weights_for_checkpoint"][name], w), name
    # the replicas hold the other ranks' shards of the COAT weights as dequantized codes: not the
    # exact BF16 values, but within FP8's rounding of them; everything else is exact
    differ = 0
    for f, b in zip(fp8, bf16):
        for name, w in b["weights"].items():
            got = f["weights"][name]
            if name in f["tagged"]:
                differ += int((got != w).sum())
                assert torch.allclose(got.float(), w.float(), rtol=2**-3, atol=1e-6), name
            else:
                assert torch.equal(got, w), name
    assert differ > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["in-the-step", "overlapped"])
def test_fp8_param_gather_trains_bit_for_bit_like_the_bf16_gather_at_dp2(overlap):
    fp8 = run_distributed(_train, 2, args=(True, overlap), tensor_parallel=1)
    bf16 = run_distributed(_train, 2, args=(False, overlap), tensor_parallel=1)
    _check_same_training(fp8, bf16)
    assert fp8[0]["losses"][-1] < fp8[0]["losses"][0]
    # the wire: per step, one stream per bucket from each rank, 1 byte per COAT weight element
    tagged = fp8[0]["tagged"]
    weight_elems = sum(n for name, n in fp8[0]["numel"].items() if name in tagged)
    other_elems = sum(n for name, n in fp8[0]["numel"].items() if name not in tagged)
    for f, b in zip(fp8, bf16):
        sent = sum(v for k, v in f["dp_bytes"].items() if k.startswith("dp_"))
        bf16_sent = sum(v for k, v in b["dp_bytes"].items() if k.startswith("dp_"))
        gathers = bf16_sent / b["bf16_stream_bytes"]  # one per step, and the last one finished by hand when overlapped
        assert gathers == STEPS + overlap
        assert sent == gathers * f["stream_bytes"]
        # each rank sends its half: COAT weights at 1 byte per element, the rest at 2, then padding
        assert (weight_elems + 2 * other_elems) / 2 <= f["stream_bytes"] < 0.75 * b["bf16_stream_bytes"]


def test_fp8_param_gather_at_tp2_x_dp2_with_sequence_parallel():
    fp8 = run_distributed(_train, 4, args=(True, False, True), tensor_parallel=2)
    bf16 = run_distributed(_train, 4, args=(False, False, True), tensor_parallel=2)
    _check_same_training(fp8, bf16)


def _refusals() -> dict:
    out = {}
    config = tiny_config(params_dtype=torch.bfloat16)
    from tiny_gpt import tiny_gpt

    module = tiny_gpt(config)  # Megatron's local layers: nothing to send as FP8
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, use_distributed_optimizer=True)
    model = DistributedDataParallel(
        config=config, ddp_config=ddp_config, module=module, full_param_layout=coat_param_layout(module, ddp_config)
    )
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True
    )
    try:
        get_coat_optimizer(opt_config, [model], CoatConfig(fp8_param_gather=True))
    except ValueError as e:
        out["no_coat_layers"] = str(e)
    return out


def test_refusals_name_the_fix():
    (r,) = run_distributed(_refusals, 1, tensor_parallel=1)
    assert "COAT layer spec" in r["no_coat_layers"]
    with pytest.raises(ValueError, match="optimizer=True and activations=True"):
        CoatConfig(fp8_param_gather=True, optimizer=False, master_weights=None)
    with pytest.raises(ValueError, match="optimizer=True and activations=True"):
        CoatConfig(fp8_param_gather=True, activations=False)
