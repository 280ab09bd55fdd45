"""``--coat-report PATH``: what a run measured, as JSON, for BF16 and COAT runs alike.

Megatron's log prints loss and timing per log interval, but not the two numbers COAT is about:
the bytes a forward pass keeps for backward, and the bytes of optimizer state. This patch wraps
``megatron.training.training.train_step`` (looked up by name in ``train()``) and, when the run
was started with ``--coat-report``, records per iteration:

- the loss (``lm loss``, averaged over the global batch as Megatron logs it) and the wall time of
  the step (forward, backward and optimizer; CUDA synchronised);
- in the first step, the bytes saved for backward by each micro-batch's forward: the distinct
  storages handed to autograd's ``saved_tensors_hooks`` while the script's ``forward_step`` runs
  (tensors sharing a storage count once, at the storage's size; model parameters are not
  activations and are left out, as in ``tests/fp8/test_memory_contract.py``). TransformerEngine's
  modules keep some of what they save out of autograd's sight, so on a GPU the report also
  holds the CUDA memory a forward leaves allocated (after minus before, minus its output): what
  a micro-batch really holds for backward, whatever keeps it;
- after the first step, the optimizer-state bytes summed over all ranks: ``CoatAdamW.state_bytes``
  (FP8 codes and per-group scale, k, centre) for COAT, ``exp_avg`` + ``exp_avg_sq`` of the inner
  Adam for Megatron's optimizer. FP32 master weights, which both keep, are not counted there;
- after the first step, the bytes per parameter the writing rank holds between steps, by part
  (``coat_megatron.memory.static_parts``: weights, FP8 weight copies, gradient buffers, master
  weights, optimizer states; per parameter of its model shard), and their total.

The last rank writes the file (it is on the last pipeline stage, where the loss is) after every
step, so a report exists even if the run is stopped early. Per-rank numbers (saved bytes, peak
memory) are the last rank's.

``python -m coat_patches.report BF16.json COAT.json`` prints the comparison table of two reports.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import torch
from torch.autograd.graph import saved_tensors_hooks

from .model import run_coat_config
from .replacements import Replacements
from .version import require_megatron_core

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def _storages(t: torch.Tensor):
    """The storages behind a tensor; a wrapper subclass (``Fp8Tensor``) by its inner tensors."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _storages(getattr(t, name))
    else:
        yield t.untyped_storage()


class SavedBytes:
    """Counts the distinct storages saved for backward inside ``with counter:``, parameters excluded.
    ``nbytes`` is None if a saved tensor had no storage to count (a quantized tensor type of TE's)."""

    def __init__(self, parameters) -> None:
        self._params = {s.data_ptr() for p in parameters for s in _storages(p)}
        self._seen: dict[int, int] = {}
        self._uncountable = False
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)
        self.cuda_bytes: int | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            for s in _storages(t):
                if s.data_ptr() not in self._params:
                    self._seen[s.data_ptr()] = s.nbytes()
        except (RuntimeError, NotImplementedError):
            self._uncountable = True
        return t

    @property
    def nbytes(self) -> int | None:
        return None if self._uncountable else sum(self._seen.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of Adam moments held by this rank: COAT's FP8 states, or ``exp_avg`` + ``exp_avg_sq``."""
    from coat_megatron.optimizer import CoatAdamW

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    total = 0
    for opt in parts:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        if isinstance(inner, CoatAdamW):
            total += inner.state_bytes()
        else:
            total += sum(t.nbytes for state in inner.state.values() for key, t in state.items() if key in MOMENT_KEYS)
    return total


def bytes_per_parameter(model_chunks, optimizer) -> dict[str, float]:
    """This rank's bytes between steps per parameter of its model shard, by part, and "total"."""
    from coat_megatron.memory import static_parts

    optimizers = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    params = sum(p.numel() for chunk in model_chunks for p in chunk.parameters())
    out = {key: value / params for key, value in static_parts(list(model_chunks), optimizers).items()}
    out["total"] = sum(out.values())
    return out


def _sum_over_ranks(value: int) -> int:
    if not torch.distributed.is_initialized():
        return value
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )  # NCCL reduces CUDA tensors only
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return int(t.item())


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class RunReport:
    """The JSON document of one run (see the module docstring)."""

    def __init__(self, args, path: str) -> None:
        coat = run_coat_config()
        self.path = path
        self.doc = {
            "mode": "coat" if coat is not None else "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "coat_config": dataclasses.asdict(coat) if coat is not None else None,
            "device": _device_name(),
            "world_size": args.world_size,
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
            "num_layers": args.num_layers,
            "hidden_size": args.hidden_size,
            "ffn_hidden_size": args.ffn_hidden_size,
            "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size,
            "global_batch_size": args.global_batch_size,
            "tokens_per_iteration": args.global_batch_size * args.seq_length,
            "saved_for_backward_bytes_per_micro_batch": None,
            "activation_memory_bytes_per_micro_batch": None,
            "optimizer_state_bytes": None,
            "optimizer": None,
            "peak_memory_bytes": None,
            "bytes_per_parameter": None,
            "iterations": [],
        }
        self.writer = (
            not torch.distributed.is_initialized()
            or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        )

    def write(self) -> None:
        if not self.writer:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1)
        os.replace(tmp, self.path)


def install(replacements: Replacements) -> None:
    """Wrap ``megatron.training.training.train_step`` (inert without ``--coat-report``)."""
    require_megatron_core(__name__)
    import megatron.training.training as training

    train_step = training.train_step
    reports: dict[str, RunReport] = {}

    @functools.wraps(train_step)
    def train_step_with_report(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        from megatron.training import get_args

        run_args = get_args()
        if not run_args.coat_report:
            return train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        report = reports.get(run_args.coat_report)
        first = report is None
        if first:
            report = reports[run_args.coat_report] = RunReport(run_args, run_args.coat_report)
            counters = []

            @functools.wraps(forward_step_func)  # Megatron's schedules inspect its signature
            def forward_step_counting_saved_bytes(*a, **k):
                counter = SavedBytes([p for chunk in model for p in chunk.parameters()])
                counters.append(counter)
                before = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
                with counter:
                    result = forward_step_func(*a, **k)
                if before is not None:
                    counter.cuda_bytes = torch.cuda.memory_allocated() - before - result[0].untyped_storage().nbytes()
                return result

            step_func = forward_step_counting_saved_bytes
        else:
            step_func = forward_step_func
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = train_step(step_func, data_iterator, model, optimizer, *args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        loss = result[0].get("lm loss") if result[0] else None
        report.doc["iterations"].append(
            {"loss": None if loss is None else float(loss), "seconds": seconds, "skipped": bool(result[1])}
        )
        if first:
            counted = [c.nbytes for c in counters]
            report.doc["saved_for_backward_bytes_per_micro_batch"] = (
                None if None in counted else max(counted, default=0)
            )
            if torch.cuda.is_available():
                report.doc["activation_memory_bytes_per_micro_batch"] = max((c.cuda_bytes for c in counters), default=0)
            report.doc["optimizer_state_bytes"] = _sum_over_ranks(optimizer_state_bytes(optimizer))
            report.doc["optimizer"] = type(getattr(optimizer, "chained_optimizers", [optimizer])[0]).__name__
            report.doc["bytes_per_parameter"] = bytes_per_parameter(model, optimizer)
        if torch.cuda.is_available():
            report.doc["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        report.write()
        return result

    replacements.replace(training, "train_step", train_step_with_report)


# ---------------------------------------------------------------------------------- comparing runs


def summarize(doc: dict) -> dict[str, float | None]:
    """The numbers compared between runs, from one report:

    - final loss: the mean training loss of the last tenth of the iterations (each iteration
      draws other data, so one iteration's loss is noisy);
    - tokens/s: tokens per iteration over the median iteration time, the first iteration excluded;
    - saved for backward: bytes one micro-batch's forward hands autograd to keep for backward;
    - activation memory: CUDA memory one micro-batch's forward leaves allocated (None on a CPU);
    - optimizer states: Adam's moments over all ranks;
    - peak memory: CUDA's max allocated on the last rank (None on a CPU).
    """
    its = doc["iterations"]
    losses = [i["loss"] for i in its if i["loss"] is not None]
    seconds = statistics.median(i["seconds"] for i in its[1:]) if len(its) > 1 else its[0]["seconds"]
    return {
        "final loss": statistics.fmean(losses[-max(1, len(losses) // 10) :]),
        "tokens/s": doc["tokens_per_iteration"] / seconds,
        "saved for backward / micro-batch": doc["saved_for_backward_bytes_per_micro_batch"],
        "activation memory / micro-batch": doc.get("activation_memory_bytes_per_micro_batch"),
        "optimizer states": doc["optimizer_state_bytes"],
        "peak memory": doc["peak_memory_bytes"],
        "bytes / parameter between steps": (doc.get("bytes_per_parameter") or {}).get("total"),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


ROW_FORMATS = {
    "final loss": "{:.3f}".format,
    "tokens/s": "{:,.0f}".format,
    "saved for backward / micro-batch": _mib,
    "activation memory / micro-batch": _mib,
    "optimizer states": _mib,
    "peak memory": _mib,
    "bytes / parameter between steps": "{:.2f}".format,
}


def comparison_table(base: dict, coat: dict) -> str:
    """Markdown: BF16, COAT and COAT / BF16 for each number of ``summarize`` both runs have."""
    rows = ["| | BF16 | COAT | COAT / BF16 |", "|---|---:|---:|---:|"]
    for key, fmt in ROW_FORMATS.items():
        if base[key] is not None and coat[key] is not None:
            rows.append(f"| {key} | {fmt(base[key])} | {fmt(coat[key])} | {coat[key] / base[key]:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m coat_patches.report BF16_REPORT.json COAT_REPORT.json")
    docs = [json.loads(open(path).read()) for path in argv]
    print(comparison_table(*(summarize(d) for d in docs)))


if __name__ == "__main__":
    main()
