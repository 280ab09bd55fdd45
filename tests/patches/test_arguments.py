"""--coat-fp8 and the --coat-* knobs through Megatron's real parse_args and validate_args."""

import argparse
import sys
from dataclasses import fields

import megatron.core.package_info
import megatron.training.arguments as arguments
import pytest
import torch
from megatron_argv import MOCK_MODEL as LLAMA
from megatron_argv import parse

from coat_megatron import CoatConfig
from coat_patches.arguments import KNOBS, CoatArgumentError, coat_config_from_args, flag
from coat_patches.install import coat_megatron_patches


def problems(monkeypatch, *argv: str) -> str:
    with pytest.raises(CoatArgumentError) as e:
        parse(monkeypatch, *argv)
    return str(e.value)


def without(argv: list[str], *drop: str) -> list[str]:
    return [a for a in argv if a not in drop]


def test_knobs_map_onto_coat_config(monkeypatch):
    args = parse(
        monkeypatch,
        *LLAMA,
        "--coat-fp8",
        "--coat-group-size",
        "32",
        "--coat-v-format",
        "e5m2",
        "--coat-expansion",
        "off",
        "--coat-v-expansion",
        "on",
        "--coat-k-max",
        "8",
        "--coat-optimizer-group-size",
        "64",
    )
    assert coat_config_from_args(args) == CoatConfig(
        group_size=32, v_format="e5m2", m_expansion=False, v_expansion=True, k_max=8.0, optimizer_group_size=64
    )


def test_defaults_are_coat_configs_and_no_flag_means_no_coat(monkeypatch):
    assert coat_config_from_args(parse(monkeypatch, *LLAMA, "--coat-fp8")) == CoatConfig()
    args = parse(monkeypatch, *LLAMA)
    assert args.coat_fp8 is False and coat_config_from_args(args) is None


def test_every_coat_config_field_has_a_flag():
    assert [f.name for f in fields(CoatConfig)] == list(KNOBS)


def test_memory_switches_reach_the_config(monkeypatch):
    args = parse(
        monkeypatch, *LLAMA, "--coat-fp8", "--coat-cache-weight-transpose", "on", "--coat-recompute-norm-output", "on"
    )
    assert coat_config_from_args(args) == CoatConfig(cache_weight_transpose=True, recompute_norm_output=True)
    args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-cache-weight", "off")
    assert coat_config_from_args(args) == CoatConfig()  # the default: no FP8 weight codes kept
    assert not CoatConfig().cache_weight and CoatConfig(cache_weight_transpose=True).cache_weight
    args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-cache-weight", "on")
    assert coat_config_from_args(args) == CoatConfig(cache_weight=True)  # coat-codes: W's codes kept per step


def test_the_tensor_parallel_ring_is_one_flag_away(monkeypatch):
    assert not coat_config_from_args(parse(monkeypatch, *LLAMA, "--coat-fp8")).tp_comm_overlap
    args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-tp-comm-overlap", "on")
    assert coat_config_from_args(args) == CoatConfig(tp_comm_overlap=True)


def test_keeping_w_transpose_without_w_is_refused_with_the_fix(monkeypatch):
    text = problems(
        monkeypatch, *LLAMA, "--coat-fp8", "--coat-cache-weight", "off", "--coat-cache-weight-transpose", "on"
    )
    assert "--coat-cache-weight-transpose off --coat-cache-weight off" in text


def test_coat_fp8_alone_selects_bf16_gradient_buffers_and_fp32_is_one_flag_away(monkeypatch):
    args = parse(monkeypatch, *LLAMA, "--coat-fp8")
    assert coat_config_from_args(args).grad_buffers == "bf16"
    assert (
        not args.accumulate_allreduce_grads_in_fp32 and args.grad_reduce_in_bf16
    )  # what megatron.training builds DDP with
    args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-grad-buffers", "fp32")
    assert args.accumulate_allreduce_grads_in_fp32 and not args.grad_reduce_in_bf16
    args = parse(
        monkeypatch, *LLAMA, "--coat-fp8", "--coat-optimizer", "off"
    )  # Megatron's optimizer: Megatron's default
    assert args.accumulate_allreduce_grads_in_fp32
    args = parse(monkeypatch, *LLAMA)  # without --coat-fp8 nothing changes
    assert args.accumulate_allreduce_grads_in_fp32 and not args.grad_reduce_in_bf16


def test_contradictory_gradient_buffer_flags_name_both(monkeypatch):
    with pytest.raises(
        CoatArgumentError, match="--grad-reduce-in-bf16 asks for BF16 gradient buffers and --coat-grad-buffers fp32"
    ):
        parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-grad-buffers", "fp32", "--grad-reduce-in-bf16")


def test_split_master_weights_are_the_default_with_either_gradient_reduction(monkeypatch):
    for explicit in ([], ["--coat-master-weights", "split"]):
        args = parse(monkeypatch, *LLAMA, "--coat-fp8", *explicit, "--grad-reduce-in-bf16")
        assert coat_config_from_args(args).master_weights == "split" and not args.accumulate_allreduce_grads_in_fp32
        args = parse(monkeypatch, *LLAMA, "--coat-fp8", *explicit, "--coat-grad-buffers", "fp32")
        assert coat_config_from_args(args).master_weights == "split" and args.accumulate_allreduce_grads_in_fp32
    args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-master-weights", "fp32")
    assert coat_config_from_args(args) == CoatConfig(master_weights="fp32")


def test_optimizer_off_ignores_the_split_default_and_refuses_an_explicit_split(monkeypatch):
    # Megatron's optimizer keeps FP32 masters: the run's config says so, whether or not fp32 is named
    for explicit in ([], ["--coat-master-weights", "fp32"]):
        args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-optimizer", "off", *explicit)
        assert (
            coat_config_from_args(args) == CoatConfig(optimizer=False)
            and coat_config_from_args(args).master_weights == "fp32"
        )
    text = problems(
        monkeypatch,
        *LLAMA,
        "--coat-fp8",
        "--coat-master-weights",
        "split",
        "--grad-reduce-in-bf16",
        "--coat-optimizer",
        "off",
    )
    assert text == (
        "--coat-fp8: --coat-master-weights split keeps the masters' low words in COAT's optimizer, and --coat-optimizer off uses "
        "Megatron's, whose masters are FP32: drop --coat-master-weights split (or set --coat-master-weights fp32), or set --coat-optimizer on"
    )


def test_transformer_engine_fp8_is_refused(monkeypatch):
    text = problems(monkeypatch, *LLAMA, "--coat-fp8", "--fp8-format", "hybrid")
    assert "--fp8-format hybrid selects TransformerEngine's FP8 recipe, which COAT replaces: drop --fp8-format" in text


def test_needs_the_distributed_optimizer_unless_the_optimizer_is_off(monkeypatch):
    llama = without(LLAMA, "--use-distributed-optimizer")
    text = problems(monkeypatch, *llama, "--coat-fp8")
    assert "add --use-distributed-optimizer; or add --coat-optimizer off" in text
    args = parse(monkeypatch, *llama, "--coat-fp8", "--coat-optimizer", "off")
    assert coat_config_from_args(args) == CoatConfig(optimizer=False)


def test_needs_bf16(monkeypatch):
    assert "add --bf16" in problems(monkeypatch, *without(LLAMA, "--bf16"), "--coat-fp8")


def test_needs_swiglu_unless_activations_are_off(monkeypatch):
    llama = without(LLAMA, "--swiglu")
    assert "COAT's FP8 MLP is SwiGLU: add --swiglu; or add --coat-activations off" in problems(
        monkeypatch, *llama, "--coat-fp8"
    )
    assert (
        coat_config_from_args(parse(monkeypatch, *llama, "--coat-fp8", "--coat-activations", "off")).activations
        is False
    )


def test_hidden_size_not_a_multiple_of_the_group_size(monkeypatch):
    llama = LLAMA[:]
    llama[llama.index("--hidden-size") + 1] = "96"
    text = problems(monkeypatch, *llama, "--coat-fp8", "--coat-group-size", "64")
    assert (
        "hidden size 96 is not a multiple of the FP8 group size 64; use --coat-group-size 32 or pad the model" in text
    )


def test_ffn_width_per_tensor_parallel_rank(monkeypatch):
    llama = LLAMA[:]
    llama[llama.index("--ffn-hidden-size") + 1] = "344"  # 172 per rank at TP=2
    monkeypatch.setenv("WORLD_SIZE", "2")
    text = problems(monkeypatch, *llama, "--tensor-model-parallel-size", "2", "--coat-fp8")
    assert (
        "--ffn-hidden-size 344 / --tensor-model-parallel-size 2 = 172, is not a multiple of the FP8 group size 16"
        in text
    )
    assert "choose --ffn-hidden-size divisible by 32" in text


def test_all_problems_are_reported_at_once(monkeypatch):
    text = problems(
        monkeypatch, *without(LLAMA, "--bf16", "--use-distributed-optimizer"), "--coat-fp8", "--spec", "my.spec"
    )
    assert text.count("\n  - ") == 3
    assert "add --bf16" in text and "add --use-distributed-optimizer" in text and "drop --spec" in text


def test_knobs_without_coat_fp8_are_refused(monkeypatch):
    text = problems(monkeypatch, *LLAMA, "--coat-group-size", "32", "--coat-m-format", "e5m2")
    assert (
        text
        == "--coat-group-size, --coat-m-format have no effect without --coat-fp8: add --coat-fp8, or drop --coat-group-size, --coat-m-format"
    )


def test_coat_config_errors_name_the_flag(monkeypatch):
    text = problems(monkeypatch, *LLAMA, "--coat-fp8", "--coat-k-min", "0.1")
    assert text.startswith("--coat-fp8: --coat-k-min 0.1 is not a multiple of 1/16")


def test_switches_are_parsed_strictly(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-expansion", "expand")
    assert (
        "--coat-expansion: 'expand' is not a switch value: use one of true, on, yes, 1, false, off, no, 0"
        in capsys.readouterr().err
    )


def test_flags_are_named_after_the_fields():
    assert flag("optimizer_group_size") == "--coat-optimizer-group-size"


def test_patches_are_removed_on_exit_and_refuse_other_versions(monkeypatch):
    originals = (arguments.add_megatron_arguments, arguments.validate_args)
    with coat_megatron_patches():
        assert arguments.add_megatron_arguments is not originals[0]
    assert (arguments.add_megatron_arguments, arguments.validate_args) == originals
    monkeypatch.setattr(megatron.core.package_info, "MINOR", 20)
    with pytest.raises(
        RuntimeError,
        match=r"coat_patches\.\w+ was written for megatron-core 0\.19\.x, but megatron-core 0\.20\.\d+ is installed",
    ):
        with coat_megatron_patches():
            pass
    assert (arguments.add_megatron_arguments, arguments.validate_args) == originals


# Megatron's per-layer CUDA graphs: on by default with --coat-fp8 where they are safe


def parse_on_gpu(monkeypatch, *argv: str):
    """Megatron's parse_args + validate_args as on a GPU machine, as far as --coat-fp8's default
    for graphs can tell: the patches are installed for this machine (the CPU's), then
    ``torch.cuda.is_available`` answers True while the arguments are parsed and validated."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    with coat_megatron_patches(), monkeypatch.context() as gpu:
        gpu.setattr(torch.cuda, "is_available", lambda: True)
        args = arguments.parse_args()
        arguments.validate_args(args, {})
    return args


GRAPHS_ON = "--coat-fp8 turns on Megatron's per-layer CUDA graphs (--cuda-graph-impl local)"


@pytest.mark.parametrize(
    "argv, world, impl, line",
    [
        (["--coat-fp8"], 1, "local", GRAPHS_ON),
        (["--coat-fp8", "--overlap-grad-reduce", "--overlap-param-gather"], 2, "local", GRAPHS_ON),  # DP 2
        (["--coat-fp8", "--coat-cuda-graphs", "off"], 1, "none", None),
        ([], 1, "none", None),  # without --coat-fp8: Megatron's default
        (["--coat-fp8", "--cuda-graph-impl", "none"], 1, "none", None),  # the user's choice stays
        (
            ["--coat-fp8", "--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"],
            1,
            "full_iteration",
            None,
        ),
        (["--coat-fp8", "--enable-cuda-graph"], 1, "local", None),  # Megatron's older name for local
        (["--coat-fp8", "--coat-activations", "off"], 1, "none", None),  # Megatron's layers: not COAT's to decide
        (["--coat-fp8", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, "local", GRAPHS_ON),
        (["--coat-fp8", "--pipeline-model-parallel-size", "2"], 2, "none", "off under pipeline parallelism"),
        (
            ["--coat-fp8", "--recompute-granularity", "selective"],
            1,
            "none",
            "refuses them with --recompute-granularity",
        ),
    ],
    ids=[
        "default",
        "data-parallel",
        "coat-off",
        "no-coat",
        "user-none",
        "user-full",
        "user-enable",
        "activations-off",
        "tp2",
        "pp2",
        "recompute",
    ],
)
def test_coat_fp8_turns_on_per_layer_graphs_on_a_gpu_where_safe(monkeypatch, capsys, argv, world, impl, line):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = parse_on_gpu(monkeypatch, *LLAMA, *argv)
    assert args.cuda_graph_impl == impl
    out = capsys.readouterr().out
    said = [text for text in out.splitlines() if "CUDA graphs" in text and text.startswith("coat-megatron-run:")]
    assert len(said) == (line is not None) and all(line in text for text in said), said
    if impl == "local":  # Megatron's validate_args derived what per-layer graphs need
        assert args.cuda_graph_warmup_steps == 3 and args.inference_cuda_graph_scope.name == "layer"


@pytest.mark.parametrize(
    "argv, scratch",
    [
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--coat-cuda-graphs", "off"], True),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], False),  # graphed: they allocate once
        (["--tensor-model-parallel-size", "2", "--coat-cuda-graphs", "off", "--coat-scratch-buffers", "off"], False),
        (["--coat-cuda-graphs", "off"], False),  # one GPU: not shown to pay there
    ],
    ids=["eager-tp2", "graphed-tp2", "user-off", "eager-one-gpu"],
)
def test_eager_tensor_parallel_layers_take_scratch_buffers_unless_told_otherwise(monkeypatch, capsys, argv, scratch):
    from megatron.training.arguments import core_transformer_config_from_args

    from coat_patches.arguments import coat_config_from_args

    monkeypatch.setenv("WORLD_SIZE", "2" if "2" in argv else "1")
    args = parse_on_gpu(monkeypatch, *LLAMA, "--coat-fp8", *argv)
    coat = coat_config_from_args(args)
    assert coat.scratch_buffers == (False if "--coat-scratch-buffers" in argv else None)  # None: auto
    # what the layers do with it: Megatron's TransformerConfig carries the layout and the graphs
    config = core_transformer_config_from_args(args)
    assert coat.for_layers(config).scratch_buffers == scratch
    said = [line for line in capsys.readouterr().out.splitlines() if "scratch buffers" in line]
    assert len(said) == scratch, said


def test_no_graphs_without_a_gpu(monkeypatch, capsys):
    args = parse(monkeypatch, *LLAMA, "--coat-fp8")
    assert args.cuda_graph_impl == "none" and "CUDA graphs" not in capsys.readouterr().out


def test_graph_switch_without_coat_fp8_or_against_cuda_graph_impl_is_refused(monkeypatch):
    text = problems(monkeypatch, *LLAMA, "--coat-cuda-graphs", "off")
    assert text == "--coat-cuda-graphs has no effect without --coat-fp8: add --coat-fp8, or drop --coat-cuda-graphs"
    text = problems(monkeypatch, *LLAMA, "--coat-fp8", "--coat-cuda-graphs", "off", "--cuda-graph-impl", "local")
    assert text == (
        "--coat-cuda-graphs off keeps the layers eager and --cuda-graph-impl local asks for graphs: drop one of them"
    )


def test_transformer_engines_tensor_parallel_overlap_and_fp8_weights_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    text = problems(
        monkeypatch,
        *LLAMA,
        "--coat-fp8",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--tp-comm-overlap",
    )
    assert (
        "--tp-comm-overlap (TransformerEngine's userbuffers, for TE's linears; COAT's own sequence-parallel ring is "
        "--coat-tp-comm-overlap on) is not supported by the COAT layer spec" in text
    )
    monkeypatch.setenv("WORLD_SIZE", "1")
    text = problems(monkeypatch, *LLAMA, "--coat-fp8", "--fp8-param-gather")
    assert (
        "--fp8-param-gather gathers TransformerEngine's FP8 weights (made with --fp8-format, which COAT replaces): "
        "drop it, and add --coat-fp8-param-gather on for COAT's FP8 parameter gather" in text
    )


def test_coat_fp8_param_gather_is_one_flag_away_and_refuses_the_replica_hash_check(monkeypatch):
    assert not coat_config_from_args(parse(monkeypatch, *LLAMA, "--coat-fp8")).fp8_param_gather
    args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-fp8-param-gather", "on")
    assert coat_config_from_args(args) == CoatConfig(fp8_param_gather=True)
    text = problems(
        monkeypatch,
        *LLAMA,
        "--coat-fp8",
        "--coat-fp8-param-gather",
        "on",
        "--check-weight-hash-across-dp-replicas-interval",
        "10",
    )
    assert "--check-weight-hash-across-dp-replicas-interval would report a mismatch: drop one of them" in text
    text = problems(monkeypatch, *LLAMA, "--coat-fp8", "--coat-fp8-param-gather", "on", "--coat-optimizer", "off")
    assert "it needs --coat-optimizer on and --coat-activations on (or set --coat-fp8-param-gather off)" in text


@pytest.mark.parametrize(
    "pp, te, env, impl, said",
    [
        (1, False, {}, "local", "(--cuda-graph-impl local)"),
        (2, True, {}, "transformer_engine", "TE-based per-layer CUDA graphs under pipeline parallelism"),
        (2, False, {}, None, "they need TransformerEngine (pip install 'coat-megatron[te]')"),
        (
            2,
            True,
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            None,
            "need NCCL_GRAPH_REGISTER=0 in the environment",
        ),
        (
            2,
            True,
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_GRAPH_REGISTER": "0"},
            "transformer_engine",
            "",
        ),
    ],
    ids=["local", "pp-te", "pp-no-te", "pp-expandable", "pp-expandable-unregistered"],
)
def test_under_pipeline_parallelism_coat_fp8_picks_te_graphs_where_they_run(monkeypatch, pp, te, env, impl, said):
    from coat_patches.arguments import cuda_graphs_by_default

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = argparse.Namespace(
        coat_fp8=True,
        coat_activations=None,
        coat_cuda_graphs="auto",
        enable_cuda_graph=False,
        external_cuda_graph=False,
        context_parallel_size=1,
        pipeline_model_parallel_size=pp,
        inference_batch_times_seqlen_threshold=-1,
    )
    picked, line = cuda_graphs_by_default(args, cuda=True, te=te)
    assert picked == impl and said in line
    assert cuda_graphs_by_default(args, cuda=False, te=te) == (None, None)
    args.recompute_granularity = "full"  # Megatron refuses either kind of per-layer graph with it
    assert cuda_graphs_by_default(args, cuda=True, te=te)[0] is None


def test_graphs_under_pipeline_parallelism_are_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    text = problems(
        monkeypatch, *LLAMA, "--coat-fp8", "--pipeline-model-parallel-size", "2", "--cuda-graph-impl", "local"
    )
    assert (
        "--cuda-graph-impl local with --pipeline-model-parallel-size > 1: megatron-core 0.19's local per-layer graphs "
        "do not run with pipeline parallelism" in text
    )
    assert "hangs in the first replay" in text
    assert "use --cuda-graph-impl transformer_engine (with TransformerEngine installed), or drop" in text


def test_the_pipeline_graph_refusal_can_be_lifted_to_try_the_rope_copy(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("COAT_PIPELINE_GRAPHS", "1")
    args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--pipeline-model-parallel-size", "2", "--cuda-graph-impl", "local")
    assert args.cuda_graph_impl == "local" and args.pipeline_model_parallel_size == 2


def test_the_run_config_is_built_once_when_megatron_validates(monkeypatch):
    args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-group-size", "32")
    built = coat_config_from_args(args)

    def rebuilt(*_):
        raise AssertionError("CoatConfig built again after validation")

    monkeypatch.setattr(CoatConfig, "from_args", classmethod(rebuilt))
    assert coat_config_from_args(args) is built and built.group_size == 32
    # a namespace Megatron never validated with the patches has no recipe: one line naming the launcher
    unvalidated = argparse.Namespace(**{**vars(args)})
    with pytest.raises(CoatArgumentError, match="coat-megatron-run"):
        coat_config_from_args(unvalidated)
    assert coat_config_from_args(argparse.Namespace(coat_fp8=False)) is None


def test_each_flag_is_its_fields_description_and_values():
    for f in fields(CoatConfig):
        kwargs, help_text = KNOBS[f.name]
        assert help_text == f.metadata["help"] and help_text.strip(), f.name
        if f.metadata["choices"] is not None:
            assert kwargs["choices"] == f.metadata["choices"], f.name


def test_a_recipe_by_name_with_knobs_on_top(monkeypatch):
    args = parse(monkeypatch, *LLAMA, "--coat-fp8", "--coat-recipe", "cached", "--coat-group-size", "32")
    assert coat_config_from_args(args) == CoatConfig.recipe("cached", group_size=32)
    assert "--coat-recipe has no effect without --coat-fp8" in problems(monkeypatch, *LLAMA, "--coat-recipe", "codes")


# --coat-p2p-sync: Megatron's device synchronization after each batched pipeline exchange


@pytest.mark.parametrize("coat", [[], ["--coat-fp8"]])
def test_p2p_sync_on_and_off_reach_the_models_config_in_any_mode(monkeypatch, coat, capsys):
    from megatron.training.arguments import core_transformer_config_from_args

    on = parse(monkeypatch, *LLAMA, *coat, "--coat-p2p-sync", "on")
    assert core_transformer_config_from_args(on).batch_p2p_sync is True  # megatron-core 0.19's default
    off = parse(monkeypatch, *LLAMA, *coat, "--coat-p2p-sync", "off")
    assert off.batch_p2p_sync is False and core_transformer_config_from_args(off).batch_p2p_sync is False
    assert "pipeline exchange" not in capsys.readouterr().out  # no pipeline here: nothing to say


@pytest.mark.parametrize("coat", [[], ["--coat-fp8"]])
def test_p2p_sync_auto_is_off_with_coat_fp8_and_megatrons_default_without(monkeypatch, coat):
    from megatron.training.arguments import core_transformer_config_from_args

    args = parse(monkeypatch, *LLAMA, *coat)
    assert args.coat_p2p_sync == "auto"
    assert core_transformer_config_from_args(args).batch_p2p_sync is not bool(coat)


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--coat-p2p-sync", "off"], "(--coat-p2p-sync off)"),
        (["--coat-fp8"], "(--coat-fp8's default; --coat-p2p-sync on keeps it)"),
    ],
)
def test_p2p_sync_off_says_so_once_where_a_pipeline_batches_its_exchanges(monkeypatch, capsys, flags, why):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse(monkeypatch, *LLAMA, "--pipeline-model-parallel-size", "2", *flags)
    assert args.batch_p2p_sync is False
    out = capsys.readouterr().out
    assert out.count(f"no device synchronization after each pipeline exchange {why}") == 1
