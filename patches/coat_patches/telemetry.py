"""COAT's optimizer-state telemetry in Megatron's training log.

With ``--coat-fp8`` (and COAT's optimizer, i.e. not ``--coat-optimizer off``), after every
iteration that Megatron logs (``--log-interval``) this patch gathers ``coat_telemetry`` over all
ranks (a collective: every rank takes part, at the same iterations) and the last rank, the one
that prints Megatron's log line, prints

    [coat] iteration 100 | m k mean/min/max 2.06/1.00/5.31 | v k 4.12/1.94/16.00 | underflow m 1.2e-05 v 0.0e+00

and writes the same numbers as ``coat/m_k_mean``, ... to Megatron's TensorBoard and W&B writers
when the run has them. k is the range-expansion exponent of each 128-element group (1: plain
absmax, larger: a wider range squeezed into E4M3); underflow is the fraction of non-zero values
that became code 0 in the last step. A collapse of v's k towards 1 or a rising underflow fraction
is the early sign of FP8 states losing the small second moments.

It wraps ``megatron.training.training.train_step`` (looked up by name in ``train()``);
``args.curr_iteration`` (set by ``train()`` before each step) gives the iteration.
"""

from __future__ import annotations

import functools

import torch

from .model import run_coat_config
from .replacements import Replacements
from .version import require_megatron_core


def coat_optimizer_in(optimizer) -> bool:
    from coat_megatron.optimizer.distributed import CoatDistributedOptimizer

    return any(
        isinstance(opt, CoatDistributedOptimizer) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
    )


def format_telemetry(iteration: int, stats: dict[str, float]) -> str:
    k = "{:.2f}/{:.2f}/{:.2f}"
    return (
        f"[coat] iteration {iteration} | m k mean/min/max "
        + k.format(stats["m_k_mean"], stats["m_k_min"], stats["m_k_max"])
        + " | v k "
        + k.format(stats["v_k_mean"], stats["v_k_min"], stats["v_k_max"])
        + f" | underflow m {stats['m_underflow_fraction']:.1e} v {stats['v_underflow_fraction']:.1e}"
    )


def log_telemetry(iteration: int, optimizer) -> dict[str, float]:
    """Gather the telemetry (every rank) and log it (the last rank); returns it."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    from coat_megatron.optimizer import coat_telemetry

    stats = coat_telemetry(optimizer)
    last = (
        not torch.distributed.is_initialized() or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    )
    if last:
        print(format_telemetry(iteration, stats), flush=True)
        writer = get_tensorboard_writer()
        if writer is not None:
            for key, value in stats.items():
                writer.add_scalar(f"coat/{key}", value, iteration)
        wandb = get_wandb_writer()
        if wandb is not None:
            wandb.log({f"coat/{key}": value for key, value in stats.items()}, iteration)
    return stats


def install(replacements: Replacements) -> None:
    """Wrap ``megatron.training.training.train_step`` (inert without COAT's optimizer)."""
    require_megatron_core(__name__)
    import megatron.training.training as training

    train_step = training.train_step

    @functools.wraps(train_step)
    def train_step_with_telemetry(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        from megatron.training import get_args

        result = train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        run_args = get_args()
        iteration = getattr(run_args, "curr_iteration", 0) + 1  # train() increments after the step
        interval = run_args.log_interval or 0
        if (
            interval > 0
            and iteration % interval == 0
            and run_coat_config() is not None
            and coat_optimizer_in(optimizer)
        ):
            log_telemetry(iteration, optimizer)
        return result

    replacements.replace(training, "train_step", train_step_with_telemetry)
