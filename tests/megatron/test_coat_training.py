"""A tiny GPT trained on real English text (the standard library's docstrings, as bytes) with the
COAT layer spec reaches the local BF16 spec's loss within 2%: same weights, data and seed."""

import torch
from distributed import run_distributed
from tiny_gpt import SEQ, VOCAB, local_layer_spec, tiny_config, tiny_gpt
from test_coat_spec import coat_gpt

from coat_megatron.corpus import ByteBatches, stdlib_docstrings

STEPS, BATCH, TAIL = 300, 16, 30


def _train(spec: str) -> list[float]:
    torch.manual_seed(0)
    data = ByteBatches(stdlib_docstrings(256 << 10), SEQ, BATCH, vocab_size=VOCAB)
    config = tiny_config()
    model = coat_gpt(config) if spec == "coat" else tiny_gpt(config, local_layer_spec())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        b = data.batch(g)
        loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_tiny_gpt_on_real_text_matches_the_local_spec():
    local = run_distributed(_train, 1, args=("local",), tensor_parallel=1, timeout=600)[0]
    coat = run_distributed(_train, 1, args=("coat",), tensor_parallel=1, timeout=600)[0]
    local_end, coat_end = sum(local[-TAIL:]) / TAIL, sum(coat[-TAIL:]) / TAIL
    print(f"mean loss of the last {TAIL} steps: local {local_end:.4f}, COAT {coat_end:.4f}")
    assert local_end < 0.75 * local[0]  # it learned something: from ln(128) = 4.85 towards English
    assert abs(coat_end - local_end) <= 0.02 * local_end, (coat_end, local_end)
