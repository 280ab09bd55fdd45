"""coat-compare's model TFLOP/s and MFU take Megatron's causal FLOP count (the one Megatron's training
loop prints); the full-attention count stays beside it under its own name (coat_compare.flops)."""

import sys

import pytest

from coat_compare import flops, report
from coat_compare.presets import PRESETS, Preset, get_preset

pytest.importorskip("megatron.training")
pytestmark = pytest.mark.filterwarnings("ignore:.type. is deprecated:DeprecationWarning")  # Megatron's argparse


def megatron_parsed_args(preset: Preset, monkeypatch, num_layers: int | None = None):
    """Megatron's own parse and validation of the command line that trains ``preset``'s model as
    coat-compare builds it (Llama-style: SwiGLU, RMSNorm, RoPE, no biases, untied output layer), and
    the vocabulary padded as Megatron's tokenizer set-up pads it (a multiple of 128 x TP)."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training import arguments

    argv = (
        f"--num-layers {preset.layers if num_layers is None else num_layers} --hidden-size {preset.hidden} "
        f"--ffn-hidden-size {preset.ffn} --num-attention-heads {preset.heads} --seq-length {preset.seq} "
        f"--max-position-embeddings {preset.seq} --vocab-size {preset.vocab} --micro-batch-size {preset.micro_batch} "
        "--train-iters 1 --lr 3e-4 --bf16 --swiglu --disable-bias-linear --normalization RMSNorm "
        "--position-embedding-type rope --untie-embeddings-and-output-weights --mock-data"
    ).split()
    if preset.kv_heads is not None:
        argv += ["--group-query-attention", "--num-query-groups", str(preset.kv_heads)]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    # parse_and_validate_args without setting Megatron's global args (other tests set their own)
    args = arguments.parse_args()
    arguments.validate_args(args, {"tokenizer_type": "NullTokenizer"})
    args.padded_vocab_size = vocab_size_with_padding(preset.vocab, args, logging_enabled=False)
    return args


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_presets_count_is_megatrons_function_on_megatrons_own_args(name, monkeypatch):
    """For every preset, Megatron's num_floating_point_operations on the arguments Megatron's parser
    and validate_args give the same model (a global batch of the preset's micro-batch) equals
    coat-compare's count per token x tokens; for a one-layer preset, a layer's share is the
    difference between the counts of 2 layers and 1. Megatron pads each preset's vocabulary to
    itself (32000 and 256 are multiples of 128), the width coat-compare's output layer has; and the
    arguments coat_compare.flops builds agree with the parsed ones field by field."""
    from megatron.training.training import num_floating_point_operations

    preset = get_preset(name)
    args = megatron_parsed_args(preset, monkeypatch)
    assert args.padded_vocab_size == preset.vocab
    ours = vars(flops.megatron_args(preset))
    for field, value in ours.items():
        if field == "num_query_groups" and not ours["group_query_attention"]:
            continue  # Megatron's parser leaves it 1; its count sets it to the heads, as ours is
        assert getattr(args, field) == value, field
    tokens = preset.micro_batch * preset.seq
    if preset.kind == "train":
        megatron = num_floating_point_operations(args, preset.micro_batch)
        assert flops.flops_per_token(preset) * tokens == pytest.approx(megatron, rel=1e-12)
    else:
        two = num_floating_point_operations(megatron_parsed_args(preset, monkeypatch, 2), preset.micro_batch)
        one = num_floating_point_operations(megatron_parsed_args(preset, monkeypatch, 1), preset.micro_batch)
        assert flops.layer_flops_per_token(preset) * tokens == pytest.approx(two - one, rel=1e-12)


def test_the_causal_count_by_hand_for_one_layer_and_a_gqa_layer():
    """One layer, hidden h = 64, 4 heads (q = kv = h), SwiGLU ffn F = 128, seq s = 64, vocab V = 256,
    per token, forward + backward (x 3: forward, dgrad, wgrad) of 2 FLOPs a multiply-add:

        QKV and output projection  6 x (h x 3h + h x h)         = 24 h^2   =  98304
        SwiGLU (gate, up, down)    6 x 3 x h x F                 = 18 h F   = 147456
        causal attention           6 x (h x s/2 + h x s/2)       =  6 h s   =  24576
          (QK^T and AV: a token's query meets s/2 keys on average, the causal mask's half)
        output layer               6 x h x V                     =  6 h V   =  98304
        total                                                               = 368640

    The full-attention count of the same model: 6 x N + 12 x h x s, N = 4 h^2 + 3 h F + 2 h (the
    layer) + h (final norm) + V h = 57536: 345216 + 49152 = 394368.

    Llama-3-8B's layer (h 4096, 32 heads, 8 KV heads: kv = 1024, F 14336, s 8192):
    6 x (h x (h + 2 kv) + h x h) + 18 h F + 6 h s."""
    one = Preset("one-layer", "train", layers=1, hidden=64, ffn=128, heads=4, seq=64, micro_batch=1, vocab=256)
    assert flops.flops_per_token(one) == 368640
    assert flops.flops_per_token_full_attn(one) == 394368
    h, kv, f, s = 4096, 1024, 14336, 8192
    llama3 = get_preset("llama3-8b-layer")
    assert flops.layer_flops_per_token(llama3) == 6 * (h * (h + 2 * kv) + h * h) + 18 * h * f + 6 * h * s


def test_rows_carry_both_counts_and_mfu_is_megatrons():
    """8192 tokens of Llama-2-7B's layer in 10 ms on one H100: 819200 tokens/s x each count; MFU of
    Megatron's; split over TP 2, half each; on a CPU, nothing."""
    layer = get_preset("llama2-7b-layer")
    u = flops.layer_utilisation(layer, 10.0, 1, "NVIDIA H100 80GB HBM3")
    assert u["model_tflops_per_gpu"] == pytest.approx(819200 * flops.layer_flops_per_token(layer) / 1e12)
    assert u["model_tflops_per_gpu_full_attn"] == pytest.approx(
        819200 * flops.layer_flops_per_token_full_attn(layer) / 1e12
    )
    assert u["model_tflops_per_gpu"] < u["model_tflops_per_gpu_full_attn"]
    assert u["mfu_bf16"] == pytest.approx(u["model_tflops_per_gpu"] / 989.0)
    assert u["mfu_fp8"] == pytest.approx(u["model_tflops_per_gpu"] / 1979.0)
    half = flops.layer_utilisation(layer, 10.0, 2, "NVIDIA H200")
    assert half["model_tflops_per_gpu"] == pytest.approx(u["model_tflops_per_gpu"] / 2)
    assert flops.layer_utilisation(layer, 10.0, 1, "NVIDIA A100")["mfu_bf16"] is None  # no peak known
    assert set(flops.utilisation(get_preset("tiny"), 1e6, "CPU").values()) == {None}
    gpt = get_preset("gpt-1b")
    whole = flops.utilisation(gpt, 1000.0, "NVIDIA H200")
    assert whole["model_tflops_per_gpu"] == pytest.approx(1000.0 * flops.flops_per_token(gpt) / 1e12)
    assert whole["model_tflops_per_gpu_full_attn"] == pytest.approx(
        1000.0 * flops.flops_per_token_full_attn(gpt) / 1e12
    )


def test_a_count_megatron_cannot_make_is_an_error_that_names_what_is_missing(monkeypatch):
    """No silent fallback: an argument Megatron's function reads that coat_compare.flops does not set,
    or a megatron-core without the function, raises and says which."""
    preset = Preset("odd", "train", layers=3, hidden=64, ffn=128, heads=4, seq=32, micro_batch=1, vocab=256)
    whole = flops.megatron_args

    def without_swiglu(*a, **k):
        args = whole(*a, **k)
        del args.swiglu
        return args

    flops.megatron_flops.cache_clear()
    monkeypatch.setattr(flops, "megatron_args", without_swiglu)
    with pytest.raises(
        RuntimeError, match=r"reads args\.swiglu, which coat_compare\.flops\.megatron_args does not set"
    ):
        flops.flops_per_token(preset)
    monkeypatch.setattr(flops, "megatron_args", whole)
    monkeypatch.setitem(sys.modules, "megatron.training.training", None)  # import fails
    with pytest.raises(RuntimeError, match=r"needs megatron\.training\.training\.num_floating_point_operations"):
        flops.utilisation(preset, 1.0, "NVIDIA H100")
    flops.megatron_flops.cache_clear()


def test_the_report_names_each_count():
    """The tables print Megatron's count, the full-attention count in brackets; a row written before
    the change has only the full-attention count (and its MFU), printed as such, MFU "-"."""
    base = dict(kind="layer", preset="p", spec="te", status="ok", ms=10.0, activation_MiB=1.0, tp=1, dp=1)
    new = dict(base, mode="bf16", family="bf16", model_tflops_per_gpu=764.2, model_tflops_per_gpu_full_attn=794.4)
    new.update(mfu_bf16=764.2 / 989.0, mfu_fp8=764.2 / 1979.0)
    old = dict(base, mode="coat", family="coat", model_tflops_per_gpu=794.4, mfu_bf16=0.8, mfu_fp8=0.4)
    lines = report.layer_table([new, old])
    assert f"| {report.TFLOPS_HEAD} | {report.MFU_HEAD} |" in lines[0]
    assert "Megatron's causal count (full-attention count)" in report.TFLOPS_HEAD
    assert "| 764 (794) | 77.3% / 38.6% |" in lines[2]
    assert "| - (794) | - |" in lines[3]
    assert "Megatron's training loop prints" in report.COLUMNS["train"] and flops.FORMULA in report.COLUMNS["layer"]
