import argparse
import dataclasses

import pytest

from coat_megatron import CoatConfig
from coat_megatron.config import parse_switch
from coat_megatron.optional import nvidia_apex_available, require_transformer_engine, transformer_engine_available


def test_defaults_are_coats_recipe():
    c = CoatConfig()
    assert (c.group_size, c.forward_format, c.backward_format, c.weight_format) == (16, "e4m3", "e5m2", "e4m3")
    assert (c.m_format, c.v_format, c.m_expansion, c.v_expansion) == ("e4m3", "e4m3", True, True)
    assert (c.k_min, c.k_max, c.optimizer_group_size, c.fprop_fast_accumulation, c.recompute_norm_output) == (
        1 / 16,
        16.0,
        128,
        True,
        False,
    )
    assert c.activations and c.optimizer and c.any_enabled and c.master_weights == "split"
    # COAT's memory mode: W^T made per backward, BF16 gradient buffers
    assert not c.cache_weight_transpose and c.grad_buffers == "bf16" and not c.ddp_grad_reduce_in_fp32
    assert not c.tp_comm_overlap  # one collective per sequence-parallel exchange (the ring is an option)


def test_gradient_buffers_default_to_bf16_only_with_coats_optimizer():
    assert CoatConfig(optimizer=False).grad_buffers == "fp32"  # Megatron's own optimizer: its default
    assert CoatConfig(grad_buffers="fp32").ddp_grad_reduce_in_fp32
    assert CoatConfig(optimizer=False, grad_buffers="bf16").grad_buffers == "bf16"  # Megatron reduces in BF16 too
    with pytest.raises(ValueError, match=r"grad_buffers='fp16' is not supported: use one of bf16, fp32"):
        CoatConfig(grad_buffers="fp16")


def test_master_weights_default_to_split_only_where_coats_optimizer_keeps_them():
    assert CoatConfig() == CoatConfig(master_weights="split") != CoatConfig(master_weights="fp32")
    assert CoatConfig(master_weights="fp32").master_weights == "fp32"
    # Megatron's own optimizer keeps FP32 masters: the default resolves to what runs
    assert CoatConfig(optimizer="off").master_weights == "fp32" and CoatConfig(optimizer=False) == CoatConfig(
        optimizer=False, master_weights="fp32"
    )
    with pytest.raises(
        ValueError, match=r"drop master_weights='split' \(or set master_weights='fp32'\), or set optimizer=True"
    ):
        CoatConfig(optimizer=False, master_weights="split")
    with pytest.raises(ValueError, match="drop master_weights='split'"):  # replace passes the resolved "split" on
        dataclasses.replace(CoatConfig(), optimizer=False)
    assert dataclasses.replace(CoatConfig(), optimizer=False, master_weights=None).master_weights == "fp32"


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CoatConfig().group_size = 32


@pytest.mark.parametrize("text,value", [("true", True), ("On", True), ("1", True), ("no", False), ("FALSE", False)])
def test_switches_parse_strictly(text, value):
    assert parse_switch(text, "x") is value
    assert CoatConfig(m_expansion=text).m_expansion is value


@pytest.mark.parametrize("bad", ["expand", "expansion", "", "2", None, 1])
def test_unknown_switch_values_raise(bad):
    # COAT's configs say "expand": it must not silently turn expansion off (or on)
    with pytest.raises(ValueError, match="is not a switch value"):
        CoatConfig(v_expansion=bad)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"group_size": 24}, "group_size=24 is not supported: use one of 16, 32, 64, 128"),
        ({"group_size": True}, "group_size=True is not supported"),
        ({"optimizer_group_size": 100}, "use one of 32, 64, 128, 256"),
        ({"forward_format": "fp8"}, "forward_format='fp8' is not an FP8 format: use 'e4m3' or 'e5m2'"),
        ({"v_format": "e4m3fn"}, "v_format='e4m3fn' is not an FP8 format"),
        ({"k_max": 0.5}, "must satisfy"),
        ({"k_min": 0.0}, "must satisfy"),
        ({"k_max": 100.0}, "must satisfy"),
        ({"k_min": 0.1}, "not a multiple of 1/16; round it, e.g. to 0.125"),
        ({"k_max": float("inf")}, "must be a number"),
        ({"master_weights": "bf16"}, "master_weights='bf16' is not supported: use one of fp32, split"),
        ({"tp_comm_overlap": "ring"}, "tp_comm_overlap='ring' is not a switch value"),
    ],
)
def test_invalid_values_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CoatConfig(**kwargs)


def test_from_args_maps_coat_arguments():
    args = argparse.Namespace(coat_group_size=32, coat_v_format="e5m2", coat_expansion="false", coat_k_max=8.0, lr=1e-4)
    c = CoatConfig.from_args(args)
    assert (c.group_size, c.v_format, c.m_expansion, c.v_expansion, c.k_max) == (32, "e5m2", False, False, 8.0)
    assert CoatConfig.from_args(argparse.Namespace()) == CoatConfig()
    assert CoatConfig.from_args(argparse.Namespace(coat_tp_comm_overlap="off")).tp_comm_overlap is False
    with pytest.raises(ValueError, match="--coat-expansion='expand'"):
        CoatConfig.from_args(argparse.Namespace(coat_expansion="expand"))


def test_optional_packages_are_detected_not_required():
    assert isinstance(nvidia_apex_available(), bool)
    if not transformer_engine_available():
        with pytest.raises(ImportError, match=r"pip install coat-megatron\[te\]"):
            require_transformer_engine("mode te-fp8")


def test_recipes_are_named_configs_with_changes_on_top():
    from coat_megatron import RECIPES

    assert CoatConfig.recipe("memory") == CoatConfig()
    assert CoatConfig.recipe("cached") == CoatConfig(cache_weight_transpose=True)
    assert CoatConfig.recipe("fp32").master_weights == "fp32" and CoatConfig.recipe("fp32").grad_buffers == "fp32"
    assert CoatConfig.recipe("codes", group_size=32) == CoatConfig(cache_weight=True, group_size=32)
    for name, (changes, why) in RECIPES.items():
        config = CoatConfig.recipe(name)
        assert why and all(getattr(config, k) == v for k, v in changes.items()), name
    with pytest.raises(ValueError, match="not a COAT recipe: use one of memory, codes"):
        CoatConfig.recipe("fast")
    args = argparse.Namespace(coat_recipe="fp32-grads", coat_cache_weight_transpose="on")
    assert CoatConfig.from_args(args) == CoatConfig(grad_buffers="fp32", cache_weight_transpose=True)
