"""A tiny GPT trained on real English text (the standard library's docstrings, as bytes) with the
COAT layer spec reaches the local BF16 spec's loss within 2%: same weights, data and seed."""

import torch
from distributed import run_distributed
from test_coat_spec import coat_gpt
from tiny_gpt import local_layer_spec, tiny_config, tiny_gpt, train_on_text

STEPS, BATCH, TAIL = 300, 16, 30


def _train(spec: str) -> list[float]:
    torch.manual_seed(0)
    config = tiny_config()
    model = coat_gpt(config) if spec == "coat" else tiny_gpt(config, local_layer_spec())
    return train_on_text(model, STEPS, BATCH, lr=3e-3, weight_decay=0.0)


def test_tiny_gpt_on_real_text_matches_the_local_spec():
    local = run_distributed(_train, 1, args=("local",), tensor_parallel=1, timeout=600)[0]
    coat = run_distributed(_train, 1, args=("coat",), tensor_parallel=1, timeout=600)[0]
    local_end, coat_end = sum(local[-TAIL:]) / TAIL, sum(coat[-TAIL:]) / TAIL
    print(f"mean loss of the last {TAIL} steps: local {local_end:.4f}, COAT {coat_end:.4f}")
    assert local_end < 0.75 * local[0]  # it learned something: from ln(128) = 4.85 towards English
    assert abs(coat_end - local_end) <= 0.02 * local_end, (coat_end, local_end)
