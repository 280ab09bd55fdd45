"""Megatron dist checkpoints of a DDP-wrapped model and its distributed optimizer, the way
``megatron.training`` writes and reads them (``torch_dist`` format).

``save_checkpoint`` / ``load_checkpoint`` serve COAT's optimizer and Megatron's own alike; a
checkpoint written at one data-parallel size loads at another (``dp_reshardable``, Megatron's
default: COAT's states move without requantization, docs/design.md#distributed). The optimizer step the
checkpoint was written after travels with it (``step``), so that a resumed run continues the
learning-rate schedule and the data where the saved one was.

A script that saves must guard its entry point with ``if __name__ == "__main__":``: the
checkpoint writer's worker processes re-import ``__main__``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import torch


def model_keys(chunks: list) -> list[str]:
    """The state dict's key of each model chunk, as ``megatron.training`` names them: "model",
    or "model0", "model1", ... with virtual pipeline stages."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def checkpoint_state(chunks: list, optimizer, sharding_type: str, is_loading: bool) -> dict:
    """The sharded state dict of the model chunks (this rank's pipeline stage, DDP-wrapped; or one
    model) and the optimizer, as ``megatron.training`` builds it."""
    chunks = chunks if isinstance(chunks, list) else [chunks]
    from megatron.core import parallel_state

    metadata = dict(
        distrib_optim_sharding_type=sharding_type,
        # fully_reshardable gathers over gloo on the CPU (the default gathers CUDA tensors)
        distrib_optim_fully_reshardable_mem_efficient=True,
        singleton_local_shards=False,
        chained_optim_avoid_prefix=True,
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    state = {key: chunk.module.sharded_state_dict(metadata=metadata) for key, chunk in zip(model_keys(chunks), chunks)}
    state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading, metadata=metadata)
    return state


def save_checkpoint(
    directory, chunks: list, optimizer, *, sharding_type: str = "dp_reshardable", step: int | None = None
) -> None:
    """Save the model chunks (or one DDP-wrapped model) and the optimizer (and ``step``, the number of optimizer steps taken;
    the layout and the format, which ``check_checkpoint`` reads before a run loads it) into
    ``directory``, which must exist and be the same path on every rank."""
    from megatron.core import dist_checkpointing, parallel_state

    chunks = chunks if isinstance(chunks, list) else [chunks]
    state = checkpoint_state(chunks, optimizer, sharding_type, is_loading=False)
    if step is not None:
        state["step"] = step
    state["layout"] = {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "vpp": len(chunks),
        "dp": parallel_state.get_data_parallel_world_size(),
        "format": sharding_type,
    }
    dist_checkpointing.save(state, str(directory))
    torch.distributed.barrier()  # every rank's files written
    if torch.distributed.get_rank() == 0:
        write_checksums(directory)
    torch.distributed.barrier()


CHECKSUMS = "coat-compare.sha256"  # beside the checkpoint's files: "DIGEST  NAME" per file


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(directory: str) -> None:
    """SHA-256 of every file of the checkpoint (``sha256sum -c`` reads the file too)."""
    names = sorted(n for n in os.listdir(directory) if n != CHECKSUMS and os.path.isfile(os.path.join(directory, n)))
    lines = [f"{file_digest(os.path.join(directory, n))}  {n}\n" for n in names]
    with open(os.path.join(directory, CHECKSUMS), "w") as f:
        f.writelines(lines)


def verify_checksums(directory: str) -> None:
    """Raise ValueError naming the first file that is missing or whose bytes changed since
    ``save_checkpoint`` wrote it; a checkpoint without checksums (written before they were kept)
    passes."""
    path = os.path.join(directory, CHECKSUMS)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        for line in f:
            digest, _, name = line.rstrip("\n").partition("  ")
            if not os.path.isfile(os.path.join(directory, name)):
                raise ValueError(f"its file {name} is missing")
            if file_digest(os.path.join(directory, name)) != digest:
                raise ValueError(f"its file {name} does not match the checksum saved with it: changed or damaged since")


def check_checkpoint(directory: str) -> dict:
    """The common state of the checkpoint in ``directory`` (step, layout), after checking that its
    data files are whole (every byte range the checkpoint's metadata names lies inside a file that
    exists) and, where ``save_checkpoint`` kept checksums, unchanged. Raises ValueError saying what
    is wrong; reads no tensor and needs no process group."""
    import warnings

    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    verify_checksums(directory)
    metadata = FileSystemReader(directory).read_metadata()
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ValueError(f"its data file {name} is missing")
        size = os.path.getsize(path)
        if size < end:
            raise ValueError(f"its data file {name} is cut short ({size} of at least {end} bytes)")
    with warnings.catch_warnings():  # torch's note that it reads without a process group, the intent here
        warnings.simplefilter("ignore", UserWarning)
        common = dist_checkpointing.load_common_state_dict(directory)
    if not isinstance(common, dict):
        raise ValueError("its common state is not a dict")
    return common


# TransformerEngine (2.20) stores delayed scaling's amax history as a pickle in each module's extra
# state and refuses to unpickle it unless this is set, since unpickling can run code. The
# checkpoints read here are the ones ``save_checkpoint`` wrote for the same job (``check_checkpoint``
# verifies them first), so the load allows it for its own duration.
TE_PICKLE_SWITCH = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@contextlib.contextmanager
def trusted_extra_state():
    before = os.environ.get(TE_PICKLE_SWITCH)
    os.environ[TE_PICKLE_SWITCH] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[TE_PICKLE_SWITCH]
        else:
            os.environ[TE_PICKLE_SWITCH] = before


def load_checkpoint(directory, chunks: list, optimizer, *, sharding_type: str = "dp_reshardable") -> int | None:
    """Load what ``save_checkpoint`` wrote into the model chunks (or one model) and their distributed optimizer,
    built with the same TP/PP layout (any DP size); returns the saved ``step`` (None if none was
    saved).

    COAT's optimizer needs nothing more. Megatron's own with torch's Adam (no apex or TE, so Adam
    keeps a ``step`` tensor per parameter) has three faults in megatron-core 0.19, worked around here:
    - ``state_dict()`` asserts on a new optimizer, which has no per-parameter states yet;
    - ``load_state_dict`` hands every parameter one shared step tensor, which Adam's foreach step
      then increments once per parameter (measured: step 2 became 17 after one step, 15 params);
    - the ``dp_reshardable`` load then overwrites that step with the one the optimizer had before
      the load.
    The checkpoint's step does arrive in the param groups: each parameter gets its own step tensor
    from there.
    """
    from megatron.core import dist_checkpointing

    from coat_megatron.optimizer import CoatDistributedOptimizer

    chunks = chunks if isinstance(chunks, list) else [chunks]
    distributed = getattr(optimizer, "chained_optimizers", [optimizer])
    megatron_adam = [o for o in distributed if not isinstance(o, CoatDistributedOptimizer)]
    for opt in megatron_adam:
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()  # what Megatron does later in this load
    with trusted_extra_state():  # our own files, checked against their SHA-256 (TE's set_extra_state unpickles)
        state = dist_checkpointing.load(
            checkpoint_state(chunks, optimizer, sharding_type, is_loading=True), str(directory)
        )
        for key, chunk in zip(model_keys(chunks), chunks):
            chunk.module.load_state_dict(state[key])
    # With FP32 params the distributed optimizer's main params are views of the parameters, which
    # its load copies into in place: that needs autograd off.
    with torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])
    for opt in megatron_adam:
        if isinstance(opt.optimizer, torch.optim.Adam):  # torch's Adam and AdamW: a step per parameter
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    opt.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))  # Adam's dtype
    return state.get("step")
