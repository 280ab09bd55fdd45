"""The model and optimizer hooks inside megatron.training's own set-up (setup_model_and_optimizer),
on gloo: --coat-fp8 gives COAT layers, COAT's distributed optimizer and a group-aligned DDP
layout; without it Megatron's own modules and optimizer are built, untouched."""

import sys

import pytest
from distributed import run_distributed
from test_arguments import LLAMA

ARGV = [
    *LLAMA,
    "--transformer-impl",
    "local",
    "--global-batch-size",
    "4",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]


def _setup(argv: list[str], path: str) -> dict:
    """In a rank: parse ``argv`` as a pretrain script would, build the model and optimizer with
    megatron.training (the 0.19 model-config path or a pretrain_gpt-style model_provider), and
    describe what was built."""
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training import get_args
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
    from megatron.training.training import setup_model_and_optimizer

    from coat_patches.install import coat_megatron_patches

    def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        # what Megatron-LM's gpt_builders.py does without TE: the local spec, picked by name
        args = get_args()
        config = core_transformer_config_from_args(args)
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            position_embedding_type="rope",
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )

    sys.argv = ["pretrain_gpt.py", *argv]
    with coat_megatron_patches():
        args = parse_and_validate_args()
        model_parallel_cuda_manual_seed(args.seed)
        groups = ProcessGroupCollection.use_mpu_process_groups()  # what pretrain() passes
        if path == "model_config":
            cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
            model, optimizer, _ = setup_model_and_optimizer(
                ModelType.encoder_or_decoder, cfg_container=cfg, pg_collection=groups
            )
        else:
            cfg = pretrain_cfg_container_from_args(args, None)
            model, optimizer, _ = setup_model_and_optimizer(
                ModelType.encoder_or_decoder, model_provider, cfg_container=cfg, pg_collection=groups
            )
        ddp = model[0]
        layer = next(m for m in ddp.modules() if isinstance(m, TransformerLayer))
        starts = [start for buffer in ddp.buffers for start, _, _ in buffer.param_index_map.values()]
        # one optimizer step, to show the COAT states exist on this rank's shard
        for p in ddp.parameters():
            p.main_grad.normal_()
        ok, _, _ = optimizer.step()
        inner = optimizer.chained_optimizers[0].optimizer
        return {
            "norm": type(layer.input_layernorm).__name__,
            "qkv": type(layer.self_attention.linear_qkv).__name__,
            "proj": type(layer.self_attention.linear_proj).__name__,
            "mlp": type(layer.mlp).__name__,
            "fc1": type(layer.mlp.linear_fc1).__name__,
            "final_norm": type(ddp.module.module.decoder.final_layernorm).__name__,
            "optimizer": type(optimizer.chained_optimizers[0]).__name__,
            "inner": type(inner).__name__,
            "state_keys": sorted({k for s in inner.state.values() for k in s}),
            "stepped": bool(ok),
            "starts_on_groups": all(s % 128 == 0 for s in starts),
            "world": torch.distributed.get_world_size(),
        }


@pytest.mark.parametrize("path", ["model_config", "model_provider"])
def test_coat_fp8_builds_coat_layers_and_optimizer(path):
    ranks = run_distributed(_setup, 2, args=([*ARGV, "--coat-fp8"], path), tensor_parallel=1, timeout=180)
    for built in ranks:
        assert built["world"] == 2
        assert (built["norm"], built["qkv"], built["proj"], built["mlp"], built["fc1"]) == (
            "CoatNorm",
            "CoatColumnParallelLinear",
            "CoatRowParallelLinear",
            "CoatMLP",
            "CoatColumnParallelLinear",
        )
        assert built["final_norm"] == "CoatNorm"
        assert (built["optimizer"], built["inner"]) == ("CoatDistributedOptimizer", "CoatAdamW")
        assert "exp_avg.codes" in built["state_keys"] and "exp_avg_sq.scale" in built["state_keys"]
        assert "master_low" in built["state_keys"]  # split master weights, the default
        assert built["stepped"] and built["starts_on_groups"]


def test_without_coat_fp8_megatron_builds_its_own():
    built = run_distributed(_setup, 1, args=(ARGV, "model_config"), tensor_parallel=1, timeout=180)[0]
    assert (built["qkv"], built["proj"], built["mlp"]) == ("ColumnParallelLinear", "RowParallelLinear", "MLP")
    assert built["norm"] != "CoatNorm" and built["final_norm"] != "CoatNorm"
    # without TE or apex (always so here: the ranks see no GPU) Megatron's inner optimizer is torch's AdamW
    assert (built["optimizer"], built["inner"]) == ("DistributedOptimizer", "AdamW")
    assert {"exp_avg", "exp_avg_sq"} <= set(built["state_keys"]) and not any("codes" in k for k in built["state_keys"])
