"""A tiny character-level causal language model on real English text, for optimizer tests.

The text is docstrings of the Python standard library: real prose, present wherever Python is.
"""

from __future__ import annotations

import torch
from stdlib_text import stdlib_docstrings
from torch import nn


def text_tokens(max_bytes: int = 64 << 10) -> torch.Tensor:
    """The first ``max_bytes`` of the standard library's docstrings, as byte tokens below 128."""
    data = stdlib_docstrings(max_bytes)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long().clamp_(max=127)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 48, layers: int = 2, heads: int = 4, seq: int = 48):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[i : i + seq] for i in idx])
        y = torch.stack([data[i + 1 : i + seq + 1] for i in idx])
        yield x, y


def train(
    model: nn.Module,
    optimizer,
    data: torch.Tensor,
    steps: int,
    *,
    batch: int = 8,
    seq: int = 48,
    seed: int = 0,
    scheduler=None,
) -> list[float]:
    losses = []
    for x, y in batches(data, steps, batch, seq, seed):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses
