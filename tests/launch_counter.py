"""What a piece of code would launch on a GPU and allocate from its caching allocator, counted on a CPU.

Eager COAT at tensor parallelism is bound by its host: every kernel launch and every allocation
costs host time. ``LaunchCounter`` counts, while it is active, what the same code run on a GPU
would cost in those two currencies, without a GPU:

* **launches**, by name:
  - ``triton:<kernel>``: each launch of one of COAT's Triton kernels (they all go through
    ``coat_kernels.launch.LeanKernel``; under ``TRITON_INTERPRET=1`` the interpreter runs them);
  - ``gemm`` / ``gemm+accumulate``: each FP8 GEMM (``coat_kernels.gemm.fp8_gemm``,
    ``coat_kernels.gemm_accumulate.fp8_gemm_accumulate``). On a CPU they run their torch
    references; counted here as the GPU runs them: one cuBLASLt call, and for an accumulating
    GEMM that cuBLASLt cannot take (an output height that is no multiple of 16) the FP32 product
    and the add it falls back to;
  - ``nccl.<call>``: each collective call of ``torch.distributed`` (``COLLECTIVES``), or batch of
    point-to-point transfers: NCCL runs one kernel for it (what gloo runs inside is not counted);
    a ``c10d.<op>`` reached by another way is counted as itself;
  - ``aten.<op>``: each other torch op that reads or writes tensor data (a kernel on a GPU), seen
    through a ``TorchDispatchMode``. Views, metadata queries and pure allocations (``empty``,
    ``empty_like``, ``empty_strided``...) are no launch; an op on empty tensors launches none.
* **allocations**: each tensor with fresh storage of at least one byte that an op hands back
  (``torch.empty`` and every other factory, an out-of-place op's result; a view or an in-place op
  makes none), plus each output an FP8 GEMM allocates (none where it writes into ``out=``).
  On a GPU this is the caching allocator's ``allocation.all.allocated`` count, less what
  libraries allocate for themselves (cuBLAS workspaces, reduction scratch).

What runs inside a Triton launch or an FP8 GEMM (the interpreter's or the reference's own torch
ops) is not counted: on a GPU it is one kernel. Host synchronisations (``aten._local_scalar_dense``:
``.item()``, ``bool(tensor)``) are counted among the launches and also on their own (``syncs``).

Regions: ``LaunchCounter(regions={"name": module, ...})`` also counts per module (``by_region``):
what runs inside a module's forward is its, and in backward, what an autograd node runs is the
region's whose forward created the node (by the node's sequence number, which autograd hands out
in creation order; the innermost region wins). What no region holds is ``"other"``.

Usage::

    with LaunchCounter(regions={"fc1": layer.mlp.linear_fc1}) as counted:
        out = layer(x); out.backward(dy)
    counted.total_launches, counted.total_allocations, counted.launches.most_common(), counted.by_region
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that only allocate (no kernel on a GPU)
ALLOCATE_ONLY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# ops that read or change metadata only, without being marked as views in their schema
METADATA = frozenset(
    {
        "_unsafe_view",
        "lift_fresh",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
        "set_",
        "_reshape_alias",
        "record_stream",
        "squeeze_",
        "unsqueeze_",
        "transpose_",
        "t_",
        "as_strided_",
        "detach_",
        "resize_",
        "_assert_tensor_metadata",
    }
)
SYNC = "_local_scalar_dense"
_MARK = torch.zeros(0, requires_grad=True)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class LaunchCounter(TorchDispatchMode):
    """Counts launches and allocations while active (see the module docstring)."""

    def __init__(self, regions: dict[str, torch.nn.Module] | None = None):
        super().__init__()
        self.launches: Counter = Counter()
        self.allocations: Counter = Counter()
        self.syncs = 0
        # region -> {"launches": Counter, "allocations": Counter}
        self.by_region: dict[str, dict[str, Counter]] = {}
        self._regions = regions or {}
        self._open: list[tuple[str, int]] = []  # the forward's regions entered: (name, first sequence number)
        self._spans: list[tuple[int, int, str]] = []  # closed: (first, end, name), end exclusive
        self._quiet = 0
        self._patches: contextlib.ExitStack | None = None

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())

    @property
    def total_allocations(self) -> int:
        return sum(self.allocations.values())

    def summary(self) -> dict:
        """{"launches", "allocations", "syncs", "by_launch", "by_allocation"}: plain data (it pickles)."""
        return dict(
            launches=self.total_launches,
            allocations=self.total_allocations,
            syncs=self.syncs,
            by_launch=dict(self.launches.most_common()),
            by_allocation=dict(self.allocations.most_common()),
            regions=self.region_totals(),
            by_region={
                name: {kind: dict(c.most_common()) for kind, c in counts.items()}
                for name, counts in sorted(self.by_region.items())
            },
        )

    def _count(self, kind: str, name: str, n: int = 1) -> None:
        getattr(self, kind)[name] += n
        region = self.by_region.setdefault(self._region(), {"launches": Counter(), "allocations": Counter()})
        region[kind][name] += n

    def _region(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:  # forward: the innermost region open
            return self._open[-1][0] if self._open else "other"
        seq = node._sequence_nr()
        inner = (
            min((end - first, name) for first, end, name in self._spans if first <= seq < end) if self._spans else None
        )
        return inner[1] if inner else "other"

    def region_totals(self) -> dict[str, dict[str, int]]:
        """{region: {"launches": n, "allocations": n}}."""
        return {
            name: {kind: sum(c.values()) for kind, c in counts.items()}
            for name, counts in sorted(self.by_region.items())
        }

    @contextlib.contextmanager
    def device_work(self, name: str, allocations: int = 0, launches: int = 1):
        """Count ``launches`` of ``name`` (and ``allocations``) for what runs inside, and nothing of
        the torch ops it runs (a kernel's interpreter, a GEMM's CPU reference)."""
        if not self._quiet:
            self._count("launches", name, launches)
            if allocations:
                self._count("allocations", name, allocations)
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def _next_sequence_nr(self) -> int:
        """The sequence number autograd gives the next node it creates (by creating one, uncounted)."""
        self._quiet += 1
        try:
            with torch.enable_grad():
                return _MARK.view(0).grad_fn._sequence_nr() + 1
        finally:
            self._quiet -= 1

    def _enter_region(self, name: str) -> None:
        self._open.append((name, self._next_sequence_nr()))

    def _exit_region(self, name: str) -> None:
        opened, first = self._open.pop()
        assert opened == name, (opened, name)
        self._spans.append((first, self._next_sequence_nr(), name))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._quiet:
            return out
        name = func.overloadpacket.__name__
        namespace = func.namespace
        if namespace == "c10d":
            self._count("launches", f"c10d.{name}")
            return out
        if func.is_view or name in METADATA:
            return out
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        held = {_storage(t) for t in inputs}
        for t in outputs:
            if _storage(t) not in held and t.untyped_storage().nbytes() > 0:
                self._count("allocations", f"{namespace}.{name}")
        if name in ALLOCATE_ONLY:
            return out
        if name == SYNC:
            self.syncs += 1
        if any(t.numel() for t in inputs + outputs):
            self._count("launches", f"{namespace}.{name}")
        return out

    def __enter__(self):
        self._patches = contextlib.ExitStack()
        self._patches.enter_context(_counting_device_calls(self))
        for name, module in self._regions.items():
            pre = module.register_forward_pre_hook(lambda m, args, name=name: self._enter_region(name))
            post = module.register_forward_hook(lambda m, args, out, name=name: self._exit_region(name))
            self._patches.callback(pre.remove)
            self._patches.callback(post.remove)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()


def _replace_everywhere(original, replacement, stack: contextlib.ExitStack) -> None:
    """Replace the function ``original`` by ``replacement`` under every name that any loaded module
    binds it to (``from coat_kernels.gemm import fp8_gemm`` copies it into the importing module;
    Megatron keeps ``torch.distributed.all_gather_into_tensor`` as ``dist_all_gather_func``), and put
    it back when ``stack`` closes."""
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for name, value in list(names.items()):
            if value is original:
                setattr(module, name, replacement)
                stack.callback(setattr, module, name, original)


# torch.distributed's calls that each launch one NCCL kernel (a batch of point-to-point transfers: one group)
COLLECTIVES = (
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_reduce",
    "batch_isend_irecv",
)


@contextlib.contextmanager
def _counting_device_calls(counter: LaunchCounter):
    """Route COAT's Triton launches and FP8 GEMMs through ``counter.device_work``."""
    from coat_kernels import gemm, gemm_accumulate, launch

    with contextlib.ExitStack() as stack:
        getitem = launch.LeanKernel.__getitem__

        def counted_getitem(kernel, grid):
            run = getitem(kernel, grid)
            inner = kernel.kernel
            name = getattr(inner, "__name__", None) or inner.fn.__name__

            def counted(*args, **kwargs):
                with counter.device_work(f"triton:{name}"):
                    return run(*args, **kwargs)

            return counted

        launch.LeanKernel.__getitem__ = counted_getitem
        stack.callback(setattr, launch.LeanKernel, "__getitem__", getitem)

        fp8_gemm, fp8_gemm_accumulate = gemm.fp8_gemm, gemm_accumulate.fp8_gemm_accumulate

        def counted_gemm(a, a_scale, b, b_scale, **kwargs):
            _check_k(a)
            with counter.device_work("gemm", allocations=int(kwargs.get("out") is None)):
                return fp8_gemm(a, a_scale, b, b_scale, **kwargs)

        def counted_gemm_accumulate(a, a_scale, b, b_scale, out, **kwargs):
            _check_k(a)
            by_add = kwargs.get("backend", "auto") == "add" or out.shape[0] % 16
            # cuBLASLt adds in its epilogue; else an FP32 product (allocated) and an add
            launches, allocations = (2, 1) if by_add else (1, 0)
            with counter.device_work("gemm+accumulate", allocations=allocations, launches=launches):
                return fp8_gemm_accumulate(a, a_scale, b, b_scale, out, **kwargs)

        _replace_everywhere(fp8_gemm, counted_gemm, stack)
        _replace_everywhere(fp8_gemm_accumulate, counted_gemm_accumulate, stack)
        for name in COLLECTIVES:
            _replace_everywhere(getattr(torch.distributed, name), _counted_collective(counter, name), stack)
        yield


def _counted_collective(counter: LaunchCounter, name: str):
    """``torch.distributed.<name>``, counted as one launch (``nccl.<name>``) and nothing of what gloo
    runs for it (its reduce-scatter copies the result, which NCCL does not)."""
    collective = getattr(torch.distributed, name)

    def counted(*args, **kwargs):
        with counter.device_work(f"nccl.{name}"):
            return collective(*args, **kwargs)

    return counted


def _check_k(a: torch.Tensor) -> None:
    if a.shape[1] % 16:
        raise ValueError(
            f"an FP8 GEMM with K = {a.shape[1]}: on a GPU it pads K to a multiple of 16 (more launches than "
            "counted here); choose token counts and widths that are multiples of 16"
        )
