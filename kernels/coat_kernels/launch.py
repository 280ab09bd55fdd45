"""A leaner way to launch the same compiled Triton kernels: less host time per launch in eager mode.

Eager COAT is bound by its host (``host_overhead.py`` (retired: ``git show 94757c2:benchmarks/host_overhead.py``); figures in docs/results.md): a
Triton launch through ``kernel[grid](...)`` spends most of its host time in Python (argument binding,
specialization key, cache lookup, knobs, hooks) rather than in the driver call itself, and a layer
issues dozens.
``lean`` wraps a ``@triton.jit`` kernel so that, once Triton has compiled and launched it for a set
of arguments, later launches with arguments that Triton would specialize the same way go straight
to the compiled kernel's launcher:

    key = (device, per argument: a tensor's dtype and whether its address is 16-byte aligned,
           an int's exact value, a float's type; the keyword arguments (constexprs, num_warps))

That key is at least as fine as Triton's own (which specializes pointers on dtype and 16-byte
alignment and ints on being 1 or a multiple of 16), so an entry is only ever reused for a launch
Triton would have sent to the same binary. The first launch for a key, and any launch the fast path
does not cover (a callable grid, a tensor passed by keyword, Triton's launch hooks set, the
interpreter), goes through Triton's own ``run``. ``COAT_LEAN_LAUNCH=0`` turns the fast path off.

What the fast path skips: Triton's launch hooks (``knobs.runtime.launch_enter_hook``, used by
Proton) are checked per launch and force the slow path when set; the check that a kernel's global
constants have not changed since compilation (COAT's kernels read none that change).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor
from triton.runtime.jit import JITFunction

try:  # where a launch hook would be set (Triton >= 3.3)
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: no hooks to honour
    _knobs = None

# the C functions under torch.cuda.current_device() / current_stream() (a fast-path launch only
# follows a Triton launch on the same device, so CUDA is initialised by then)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
ENABLED = os.environ.get("COAT_LEAN_LAUNCH", "1") not in ("0", "")
MAX_ENTRIES = 4096  # per kernel; past it the table is cleared (shapes that change every call)
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"})


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for Python ints (``triton.cdiv`` is a constexpr function, slow to call from Python)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n for Python ints (0 for 0, as ``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_RUNTIME = getattr(_knobs, "runtime", None)
# Triton >= 3.7 keeps each launch hook as a HookChain (empty list of calls: no hook); older, None
_CHAINS = _RUNTIME is not None and hasattr(_RUNTIME.launch_enter_hook, "calls")


def _hooks_set() -> bool:
    if _RUNTIME is None:
        return False
    if _CHAINS:
        return bool(_RUNTIME.launch_enter_hook.calls or _RUNTIME.launch_exit_hook.calls)
    return _RUNTIME.launch_enter_hook is not None or _RUNTIME.launch_exit_hook is not None


class LeanKernel:
    """A ``triton.jit`` kernel launched as ``kernel[grid](*args, **constexprs_and_options)``,
    with the fast path above (which returns None; Triton's path returns the compiled kernel).
    Every other attribute is the wrapped kernel's."""

    def __init__(self, kernel, *, enabled: bool | None = None):
        self.kernel = kernel
        # the interpreter's kernels (TRITON_INTERPRET=1) are no JITFunction: they always take Triton's path
        jitted = isinstance(kernel, JITFunction) or enabled
        self.enabled = bool(jitted and (ENABLED if enabled is None else enabled))
        params = getattr(kernel, "params", None) or []
        self.names = [p.name for p in params]
        self.constexprs = {p.name for p in params if p.is_constexpr}
        self.entries: dict = {}
        self.misses = 0  # launches that took Triton's path (for tests and benchmarks)
        _ALL.append(self)

    def __getattr__(self, name):
        if name == "kernel":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        if not self.enabled or callable(grid):
            return self.kernel[grid]
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        device = _current_device()
        key = (
            device,
            # per argument, inline (a function call per argument would cost more than the expression):
            # a tensor's dtype and 16-byte alignment, a float's type, anything else itself (an int's
            # exact value; a bool keys as the int of its value, which its launch passes the same)
            *[
                (a.dtype, not a.data_ptr() & 15) if isinstance(a, Tensor) else (float if isinstance(a, float) else a)
                for a in args
            ],
            *kwargs.items(),
        )
        entry = self.entries.get(key)
        if entry is None or _hooks_set():
            return self._slow(key, grid, args, kwargs)
        launcher, function, metadata, tail = entry
        g = len(grid)
        launcher(
            grid[0],
            grid[1] if g > 1 else 1,
            grid[2] if g > 2 else 1,
            _current_stream(device),
            function,
            metadata,
            None,
            None,
            None,
            *args,
            *tail,
        )
        return None

    def _slow(self, key, grid, args, kwargs):
        self.misses += 1
        compiled = self.kernel[grid](*args, **kwargs)
        rest = self.names[len(args) :]
        # only constexprs (and launch options) by keyword, every remaining parameter given: else
        # the arguments cannot be laid out without Triton's binder (defaults), so no entry
        if compiled is None or _hooks_set() or not set(kwargs) - _OPTIONS == set(rest) <= self.constexprs:
            return compiled
        launcher = compiled.run  # a property on some Triton versions: it sets the handles up
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.clear()
        self.entries[key] = (launcher, compiled.function, compiled.packed_metadata, tuple(kwargs[n] for n in rest))
        return compiled


_ALL: list[LeanKernel] = []


def set_enabled(enabled: bool) -> None:
    """Turn the fast path on or off for every kernel that has one (benchmarks compare the two)."""
    for kernel in _ALL:
        if isinstance(kernel.kernel, JITFunction):
            kernel.enabled = enabled


def lean(kernel) -> LeanKernel:
    """Decorator (above ``@triton.jit``) giving a kernel the fast launch path."""
    return LeanKernel(kernel)


__all__ = ["LeanKernel", "cdiv", "lean", "next_power_of_2", "set_enabled"]
