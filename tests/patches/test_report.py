"""coat_patches.report: what a run report counts, and how two reports are compared."""

import torch

from coat_patches.report import SavedBytes, comparison_table, summarize


def test_saved_bytes_counts_each_storage_once_and_skips_parameters():
    w = torch.nn.Parameter(torch.randn(16, 32))
    x = torch.randn(8, 16, requires_grad=True)
    with SavedBytes([w]) as counter:
        h = x @ w  # saves x and w
        y = (h[:, :16] * h[:, 16:]).sum()  # saves two views of h's storage
    assert counter.nbytes == x.untyped_storage().nbytes() + h.untyped_storage().nbytes() == (8 * 16 + 8 * 32) * 4
    y.backward()  # the identity pack/unpack leaves autograd working
    assert torch.allclose(w.grad, x.detach().T @ torch.cat([h[:, 16:], h[:, :16]], 1).detach())


def test_saved_bytes_outside_the_context_are_not_counted():
    x = torch.randn(4, 4, requires_grad=True)
    with SavedBytes([]) as counter:
        pass
    (x * x).sum()
    assert counter.nbytes == 0


def _doc(losses, seconds, **extra):
    doc = {
        "tokens_per_iteration": 1000,
        "saved_for_backward_bytes_per_micro_batch": 4 << 20,
        "activation_memory_bytes_per_micro_batch": None,
        "optimizer_state_bytes": 8 << 20,
        "peak_memory_bytes": None,
        "iterations": [{"loss": loss, "seconds": s, "skipped": False} for loss, s in zip(losses, seconds)],
    }
    doc.update(extra)
    return doc


def test_summarize_takes_the_last_tenth_and_the_median_time_after_the_first():
    losses = [5.0] * 18 + [2.0, 3.0]
    seconds = [9.0] + [0.5] * 10 + [0.25] * 9
    s = summarize(_doc(losses, seconds))
    assert s["final loss"] == 2.5
    assert s["tokens/s"] == 1000 / 0.5
    assert s["saved for backward / micro-batch"] == 4 << 20 and s["peak memory"] is None


def test_comparison_table_gives_ratios_and_leaves_out_what_is_missing():
    base = summarize(_doc([3.0, 2.0], [1.0, 0.5]))
    coat = summarize(
        _doc([3.0, 2.2], [1.0, 1.0], optimizer_state_bytes=2 << 20, saved_for_backward_bytes_per_micro_batch=2 << 20)
    )
    table = comparison_table(base, coat).splitlines()
    assert table[0] == "| | BF16 | COAT | COAT / BF16 |"
    assert "| final loss | 2.000 | 2.200 | 1.10 |" in table
    assert "| tokens/s | 2,000 | 1,000 | 0.50 |" in table
    assert "| optimizer states | 8.00 MiB | 2.00 MiB | 0.25 |" in table
    assert not any("peak memory" in row or "activation memory" in row for row in table)
