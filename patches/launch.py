"""``coat-megatron-run``: run a Megatron pretrain script with ``--coat-fp8`` available.

    coat-megatron-run [--cpu] SCRIPT.py [Megatron arguments] [--coat-fp8 ...]
    torchrun --nproc-per-node 8 $(which coat-megatron-run) SCRIPT.py ...
    python -m coat_patches.launch SCRIPT.py ...

The script runs unmodified, as ``__main__`` (``runpy``), with ``sys.argv`` set to
``[SCRIPT.py, arguments...]`` and the script's directory first on ``sys.path`` (as ``python
SCRIPT.py`` would; Megatron-LM's ``pretrain_gpt.py`` imports ``gpt_builders`` from there), inside
``coat_megatron_patches()``. Without a GPU, or with ``--cpu``, Megatron's training loop runs on
the CPU with gloo. A single process started without torchrun gets torchrun's environment for a
world of one (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, a free ``MASTER_PORT``), so
``coat-megatron-run pretrain_gpt.py ...`` works on its own.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys

USAGE = "usage: coat-megatron-run [--cpu] SCRIPT.py [Megatron arguments ...] [--coat-fp8 --coat-* ...]"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_environment() -> None:
    """torchrun's variables for a world of one, where the launcher was not started by torchrun."""
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def run_script(script: str, script_args: list[str], *, cpu: bool | None = None) -> None:
    """Run ``script`` as ``__main__`` with ``script_args`` inside ``coat_megatron_patches(cpu)``."""
    from .arguments import CoatArgumentError
    from .install import coat_megatron_patches

    script = os.path.abspath(script)
    if not os.path.isfile(script):
        raise FileNotFoundError(f"no pretrain script at {script}")
    single_process_environment()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        with coat_megatron_patches(cpu=cpu):
            runpy.run_path(script, run_name="__main__")
        _close_process_groups()
    except CoatArgumentError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"coat-megatron-run: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _close_process_groups() -> None:
    """Tear down torch.distributed after the script returns, as torchrun-launched programs should:
    Megatron's ``pretrain()`` leaves its process groups open, and a process that exits with gloo's
    threads still running can abort in their destructors ("terminate called without an active
    exception", seen once in CI after training had finished, exit code -6)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cpu = None
    if argv and argv[0] == "--cpu":
        cpu = True
        argv.pop(0)
    if not argv or argv[0] in ("-h", "--help") or not argv[0].endswith(".py"):
        print(USAGE, file=sys.stderr)
        print(__doc__, file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch looks for a GPU
    run_script(argv[0], argv[1:], cpu=cpu)


if __name__ == "__main__":
    main()
