"""cuBLASLt's FP8 GEMM through ctypes, with a plan (descriptors and algorithm) cached per shape.

``torch._scaled_mm`` asks cuBLASLt's heuristic for an algorithm on every call, which costs more host
time than the rest of the call (cProfile of ``host_overhead.py`` (retired: ``git show 94757c2:benchmarks/host_overhead.py``), docs/results.md; a COAT
layer runs 12 GEMMs), where eager training is bound by its host. Here the heuristic runs once per
(device, shape, dtypes, fast accumulation, buffer alignment) and a call costs a few ctypes calls
(the descriptor's scale pointers are set only when they change). The same binding computes

    out = (a * a_scale) @ (b * b_scale) + beta * out      (beta 0: a plain GEMM, 1: accumulate)

with ``a`` (M, K) row-major, ``b`` (K, N) column-major and ``out`` (M, N) row-major. cuBLASLt is
column-major, so the call computes out^T = b^T a^T: its A is ``b`` (K x N, transposed), its B is
``a`` (K x M), its C and D are ``out`` viewed as N x M: the "TN" form Hopper's FP8 GEMM requires.

The library is the one torch itself loads (its own pip wheel's); one handle and a 32 MiB workspace
per device. (Torch newer than the GPU image's 2.11 is adding a scaled addmm; this does not rely on it.)
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

import torch

_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (device index) -> cudaStream_t

# cublasLt.h / library_types.h / cublas_api.h (CUDA 13)
_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F, _CUDA_R_16BF, _CUDA_R_8F_E4M3, _CUDA_R_8F_E5M2 = 0, 14, 28, 29
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT_BYTES = (5, 6, 7, 8)  # of A, B, C, D; uint32, default 256
_WORKSPACE_BYTES = 32 * 1024 * 1024
_CUDA_TYPE = {
    torch.float8_e4m3fn: _CUDA_R_8F_E4M3,
    torch.float8_e5m2: _CUDA_R_8F_E5M2,
    torch.bfloat16: _CUDA_R_16BF,
    torch.float32: _CUDA_R_32F,
}


def alignment(*pointers: int) -> int:
    """The largest power of 2 up to 256 that divides every address: what the plan's algorithm may
    assume (cuBLASLt's heuristic assumes 256 unless told less)."""
    bits = 256
    for p in pointers:
        bits |= p
    return bits & -bits


def check_scale_alignment(a_scale: torch.Tensor, b_scale: torch.Tensor, caller: str) -> None:
    """cuBLASLt's FP8 GEMM reads a scale only at a 16-byte aligned address: any other (the second
    element of a plain FP32 vector, say) ends in CUBLAS_STATUS_NOT_SUPPORTED (status 15), through
    ``torch._scaled_mm`` too (measured on an H200, cuBLAS 13.0). Called once a GEMM has failed, so
    that the GEMMs that succeed pay nothing for it: raises the error that names the fix."""
    for name, scale in (("a_scale", a_scale), ("b_scale", b_scale)):
        if scale.is_cuda and scale.data_ptr() % 16:
            raise ValueError(
                f"{caller}: {name} lies at an address that is not a multiple of 16 bytes, which cuBLASLt's FP8 "
                f"GEMM rejects (status 15): pass a scale tensor of its own ({name}.clone()) or views 16 bytes "
                f"apart (the quantizers' scale vectors are, with stride 4 FP32 words)"
            )


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than CUBLAS_STATUS_SUCCESS."""


def _library_path() -> str | None:
    """The libcublasLt torch itself loaded (its own pip wheel's), else one next to it on sys.path."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    for root in sys.path:
        found = sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcublasLt.so*")))
        found += sorted(glob.glob(os.path.join(root, "nvidia", "cublas", "lib", "libcublasLt.so*")))
        if found:
            return found[0]
    return None


class _CublasLt:
    """The few cuBLASLt calls an FP8 GEMM (plain or accumulating) needs, with its handle, workspace and
    plans (one per shape: a training run meets a handful)."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        for name in (
            "cublasLtCreate",
            "cublasLtMatmulDescCreate",
            "cublasLtMatmulDescSetAttribute",
            "cublasLtMatrixLayoutCreate",
            "cublasLtMatmulPreferenceCreate",
            "cublasLtMatmulPreferenceSetAttribute",
            "cublasLtMatmulAlgoGetHeuristic",
            "cublasLtMatmul",
        ):
            getattr(self.lib, name).restype = ctypes.c_int
        # every argument typed: an untyped Python int goes as a 32-bit int, wrong for size_t
        out_ptr, vp, size = ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_size_t
        self.lib.cublasLtCreate.argtypes = [out_ptr]
        self.lib.cublasLtMatmulDescCreate.argtypes = [out_ptr, ctypes.c_int, ctypes.c_int]
        self.lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, size]
        self.lib.cublasLtMatrixLayoutCreate.argtypes = [
            out_ptr,
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int64,
        ]
        self.lib.cublasLtMatmulPreferenceCreate.argtypes = [out_ptr]
        self.lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, size]
        heuristic_out = [ctypes.POINTER(_Heuristic), ctypes.POINTER(ctypes.c_int)]
        # (handle, descriptor, the layouts of A, B, C and D, preference), count, results, returned
        self.lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp] * 7 + [ctypes.c_int] + heuristic_out
        # (handle, descriptor, alpha, A, its layout, B, its layout, beta, C, its layout, D, its layout),
        # algo, workspace, its size, stream
        self.lib.cublasLtMatmul.argtypes = [vp] * 12 + [ctypes.POINTER(_Algo), vp, size, vp]
        self.handles: dict[int, ctypes.c_void_p] = {}
        self.workspaces: dict[int, torch.Tensor] = {}
        self.workspace_ptrs: dict[int, int] = {}
        # alpha = 1 and beta = 0 or 1, host scalars made once (cuBLASLt reads them at the call)
        self._one_value, self._zero_value = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._one = ctypes.cast(ctypes.pointer(self._one_value), ctypes.c_void_p)
        self._zero = ctypes.cast(ctypes.pointer(self._zero_value), ctypes.c_void_p)
        self.plans: dict[tuple, tuple] = {}
        self.lock = threading.Lock()

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            raise CublasLtError(f"{call} returned cuBLAS status {status}")

    def _handle(self, device: int) -> ctypes.c_void_p:
        if device not in self.handles:
            handle = ctypes.c_void_p()
            with torch.cuda.device(device):
                self._check(self.lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            self.handles[device] = handle
            self.workspaces[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
            self.workspace_ptrs[device] = self.workspaces[device].data_ptr()
        return self.handles[device]

    def _set(self, desc, attribute: int, value) -> None:
        self._check(
            self.lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
            "cublasLtMatmulDescSetAttribute",
        )

    def _set_pointer(self, desc, attribute: int, pointer: int) -> None:
        value = ctypes.c_void_p(pointer)
        self._check(
            self.lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
            "cublasLtMatmulDescSetAttribute",
        )

    def _layout(self, dtype: torch.dtype, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(
            self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _CUDA_TYPE[dtype], rows, cols, ld),
            "cublasLtMatrixLayoutCreate",
        )
        return layout

    def _plan(
        self, device: int, m: int, n: int, k: int, a_dtype, b_dtype, out_dtype, fast_accum: bool, align: int = 256
    ) -> list:
        """[descriptor, layouts of cuBLASLt's A, B, C = D, algo, A's and B's scale pointers held] for
        out (M, N) += a (M, K) @ b (K, N), with an algorithm that works for buffers aligned to
        ``align`` bytes."""
        key = (device, m, n, k, a_dtype, b_dtype, out_dtype, fast_accum, align)
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        handle = self._handle(device)
        desc = ctypes.c_void_p()
        self._check(
            self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
            "cublasLtMatmulDescCreate",
        )
        self._set(desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set(desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        self._set(desc, _DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0))
        lt_a = self._layout(b_dtype, k, n, k)  # b: K x N column-major, used transposed (N x K)
        lt_b = self._layout(a_dtype, k, m, k)  # a row-major (M, K) = K x M column-major
        lt_c = self._layout(out_dtype, n, m, n)  # out row-major (M, N) = N x M column-major
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        size = ctypes.c_uint64(_WORKSPACE_BYTES)
        self._check(
            self.lib.cublasLtMatmulPreferenceSetAttribute(
                pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.sizeof(size)
            ),
            "cublasLtMatmulPreferenceSetAttribute",
        )
        min_align = ctypes.c_uint32(align)
        for attribute in _PREF_MIN_ALIGNMENT_BYTES:
            self._check(
                self.lib.cublasLtMatmulPreferenceSetAttribute(
                    pref, attribute, ctypes.byref(min_align), ctypes.sizeof(min_align)
                ),
                "cublasLtMatmulPreferenceSetAttribute",
            )
        result, returned = _Heuristic(), ctypes.c_int(0)
        self._check(
            self.lib.cublasLtMatmulAlgoGetHeuristic(
                handle, desc, lt_a, lt_b, lt_c, lt_c, pref, 1, ctypes.byref(result), ctypes.byref(returned)
            ),
            "cublasLtMatmulAlgoGetHeuristic",
        )
        if returned.value < 1:
            raise CublasLtError(
                f"cuBLASLt has no FP8 GEMM for out {out_dtype} ({m} x {n}, K {k}) += a {a_dtype} @ b {b_dtype}"
            )
        # the last two: the scale pointers the descriptor holds now (set again only when they change)
        plan = [desc, lt_a, lt_b, lt_c, ctypes.byref(result.algo), None, None]
        self.plans[key] = plan
        return plan

    def matmul(self, a, a_scale, b, b_scale, out, beta: float, fast_accum: bool) -> None:
        """out = (a * a_scale) @ (b * b_scale) + beta * out (beta 0 or 1), on the current stream.
        The scales are 0-d FP32 device tensors (a CUDA graph captures their addresses)."""
        m, k = a.shape
        n = b.shape[1]
        device = out.get_device()
        stream = _current_stream(device)
        a_ptr, b_ptr, out_ptr = a.data_ptr(), b.data_ptr(), out.data_ptr()
        align = alignment(a_ptr, b_ptr, out_ptr)
        if align < 16:
            raise CublasLtError(
                f"cuBLASLt's FP8 GEMM needs 16-byte aligned buffers; these are aligned to {align} bytes: pass "
                f"freshly allocated (or .contiguous() copies of) operands and output"
            )
        a_scale_ptr, b_scale_ptr = a_scale.data_ptr(), b_scale.data_ptr()
        with self.lock:  # one plan's descriptor takes this call's scale pointers, then the call
            plan = self.plans.get((device, m, n, k, a.dtype, b.dtype, out.dtype, fast_accum, align))
            if plan is None:
                plan = self._plan(device, m, n, k, a.dtype, b.dtype, out.dtype, fast_accum, align)
            desc, lt_a, lt_b, lt_c, algo, held_a, held_b = plan
            if held_a != b_scale_ptr:  # cuBLASLt's A is our b
                self._set_pointer(desc, _DESC_A_SCALE_POINTER, b_scale_ptr)
                plan[5] = b_scale_ptr
            if held_b != a_scale_ptr:
                self._set_pointer(desc, _DESC_B_SCALE_POINTER, a_scale_ptr)
                plan[6] = a_scale_ptr
            status = self.lib.cublasLtMatmul(
                self.handles[device],
                desc,
                self._one,
                b_ptr,
                lt_a,
                a_ptr,
                lt_b,
                self._one if beta else self._zero,
                out_ptr,
                lt_c,
                out_ptr,
                lt_c,
                algo,
                self.workspace_ptrs[device],
                _WORKSPACE_BYTES,
                stream,
            )
            if status:
                check_scale_alignment(a_scale, b_scale, "cuBLASLt's FP8 GEMM")
                self._check(status, "cublasLtMatmul")

    def accumulate(self, a, a_scale, b, b_scale, out, fast_accum: bool) -> None:
        """out += (a * a_scale) @ (b * b_scale)."""
        self.matmul(a, a_scale, b, b_scale, out, 1.0, fast_accum)


_LT: _CublasLt | None = None
_LT_ERROR: str | None = None


def _cublaslt() -> _CublasLt | None:
    """The binding, loaded once (None where the library cannot be loaded; ``_LT_ERROR`` says why)."""
    global _LT, _LT_ERROR
    if _LT is None and _LT_ERROR is None:
        path = _library_path()
        try:
            _LT = _CublasLt(path) if path else None
            _LT_ERROR = None if path else "libcublasLt not found"
        except OSError as e:
            _LT_ERROR = str(e)
    return _LT
