"""A default training corpus that needs no download: the Python standard library's docstrings.

Real English prose (module, class and function documentation), read from the ``.py`` files of
the interpreter's own standard library with ``ast``, in a fixed order, so every machine with the
same Python builds the same bytes. Tokens are bytes (a 256-symbol vocabulary, or fewer: bytes
at or above ``vocab_size`` map to ``vocab_size - 1``).
"""

from __future__ import annotations

import ast
import os
import sysconfig

import torch


def stdlib_docstrings(max_bytes: int = 4 << 20) -> bytes:
    """Docstrings of the standard library, up to ``max_bytes``, separated by blank lines."""
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 80:
                        text = doc.encode("utf-8") + b"\n\n"
                        parts.append(text)
                        total += len(text)
                        if total >= max_bytes:
                            return b"".join(parts)[:max_bytes]
    return b"".join(parts)


class ByteBatches:
    """Random windows of a byte corpus as next-token-prediction batches.

    Holds out the last ``holdout`` fraction of the bytes for validation. ``batch(generator)``
    returns tokens and labels (the next bytes) of shape (batch_size, seq_length), int64.
    """

    def __init__(self, data: bytes, seq_length: int, batch_size: int, vocab_size: int = 256, holdout: float = 0.05):
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long().clamp_(max=vocab_size - 1)
        split = int(len(tokens) * (1 - holdout))
        self.train, self.valid = tokens[:split], tokens[split:]
        self.seq_length, self.batch_size = seq_length, batch_size

    def batch(self, generator: torch.Generator, split: str = "train") -> dict[str, torch.Tensor]:
        data = self.train if split == "train" else self.valid
        starts = torch.randint(0, len(data) - self.seq_length - 1, (self.batch_size,), generator=generator)
        window = torch.stack([data[s : s + self.seq_length + 1] for s in starts.tolist()])
        return {
            "tokens": window[:, :-1].contiguous(),
            "labels": window[:, 1:].contiguous(),
            "position_ids": torch.arange(self.seq_length).expand(self.batch_size, -1).contiguous(),
        }


class ByteWindows(torch.utils.data.Dataset):
    """Next-byte-prediction samples from a byte corpus, in the form of Megatron's ``GPTDataset``.

    Sample ``i`` is the window of ``seq_length + 1`` bytes at a start drawn from a generator seeded
    by ``seed`` (all starts are drawn up front), as a dict of ``tokens`` and ``labels`` (the next
    bytes), int64 of shape (seq_length,), ``loss_mask`` (FP32 ones) and ``position_ids``. Every rank
    and every run with the same arguments sees the same samples, which is what Megatron's samplers
    expect of a dataset (they pick indices per data-parallel rank).
    """

    def __init__(self, data: bytes, seq_length: int, num_samples: int, *, seed: int = 0, vocab_size: int = 256):
        if len(data) <= seq_length + 1:
            raise ValueError(f"a corpus of {len(data)} bytes has no window of seq_length + 1 = {seq_length + 1} bytes")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long().clamp_(max=vocab_size - 1)
        self.seq_length = seq_length
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.tokens) - seq_length - 1, (num_samples,), generator=g)
        self.position_ids = torch.arange(seq_length)
        self.loss_mask = torch.ones(seq_length, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(self.starts[i])
        window = self.tokens[start : start + self.seq_length + 1]
        return {
            "tokens": window[:-1].clone(),
            "labels": window[1:].clone(),
            "loss_mask": self.loss_mask.clone(),
            "position_ids": self.position_ids.clone(),
        }
