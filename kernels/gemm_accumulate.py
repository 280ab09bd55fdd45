"""FP8 GEMM that accumulates into its output in the GEMM's epilogue: ``out += (a * a_scale) @ (b * b_scale)``.

Why: a wgrad summed over micro-batches into a gradient buffer (Megatron's gradient-accumulation
fusion). ``torch._scaled_mm`` has no accumulate input, so without this the product goes to an FP32
temporary of the weight's size that a second kernel adds into the buffer: per linear parameter and
micro-batch, 4 bytes written, then 4 + 2 read and 2 written again. cuBLASLt computes
``D = alpha * op(A) op(B) + beta * C`` with ``beta = 1`` and ``C = D = out``: the buffer is read and
written once, in FP32 inside the GEMM, and rounded once to its dtype, as the temporary-and-add does.

Backends:

- cuBLASLt through ctypes (the library torch itself loads), one handle and a 32 MiB workspace per
  device, a matmul plan per (shape, dtypes) cached;
- the FP32 temporary and an add (``accumulate_by_add``), also the CPU's reference and the fallback
  where the library cannot be loaded.

(Torch newer than the GPU image's 2.11 is adding a scaled addmm; this does not rely on it.)

Layouts as ``gemm.fp8_gemm``: ``a`` (M, K) row-major, ``b`` (K, N) column-major, ``out`` (M, N)
row-major, contiguous. cuBLASLt is column-major, so the call computes out^T = b^T a^T: its A is
``b`` (K x N, transposed), its B is ``a`` (K x M), its C and D are ``out`` viewed as N x M: the
"TN" form Hopper's FP8 GEMM requires.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

import torch

from .gemm import _pad_k, check_gpu_layout, check_operands, fp8_gemm, fp8_gemm_reference

# cublasLt.h / library_types.h / cublas_api.h (CUDA 13)
_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F, _CUDA_R_16BF, _CUDA_R_8F_E4M3, _CUDA_R_8F_E5M2 = 0, 14, 28, 29
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_PREF_MAX_WORKSPACE_BYTES = 1
_WORKSPACE_BYTES = 32 * 1024 * 1024
_CUDA_TYPE = {
    torch.float8_e4m3fn: _CUDA_R_8F_E4M3,
    torch.float8_e5m2: _CUDA_R_8F_E5M2,
    torch.bfloat16: _CUDA_R_16BF,
    torch.float32: _CUDA_R_32F,
}


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
    """The few cuBLASLt calls an accumulating FP8 GEMM needs, with its handle, workspace and plans."""

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
        return self.handles[device]

    def _set(self, desc, attribute: int, value) -> None:
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

    def _plan(self, device: int, m: int, n: int, k: int, a_dtype, b_dtype, out_dtype, fast_accum: bool) -> tuple:
        """(descriptor, layouts of cuBLASLt's A, B, C = D, algo) for out (M, N) += a (M, K) @ b (K, N)."""
        key = (device, m, n, k, a_dtype, b_dtype, out_dtype, fast_accum)
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
        plan = (desc, lt_a, lt_b, lt_c, result.algo)
        self.plans[key] = plan
        return plan

    def accumulate(self, a, a_scale, b, b_scale, out, fast_accum: bool) -> None:
        m, k = a.shape
        n = b.shape[1]
        device = out.device.index if out.device.index is not None else torch.cuda.current_device()
        with self.lock:  # one plan's descriptor takes this call's scale pointers, then the call
            self._run(device, m, n, k, a, a_scale, b, b_scale, out, fast_accum)

    def _run(self, device, m, n, k, a, a_scale, b, b_scale, out, fast_accum) -> None:
        desc, lt_a, lt_b, lt_c, algo = self._plan(device, m, n, k, a.dtype, b.dtype, out.dtype, fast_accum)
        # the scale pointers are per call (device tensors: a CUDA graph captures their addresses)
        self._set(desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale.data_ptr()))
        self._set(desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale.data_ptr()))
        one = ctypes.c_float(1.0)
        workspace = self.workspaces[device]
        self._check(
            self.lib.cublasLtMatmul(
                self.handles[device],
                desc,
                ctypes.byref(one),
                ctypes.c_void_p(b.data_ptr()),
                lt_a,
                ctypes.c_void_p(a.data_ptr()),
                lt_b,
                ctypes.byref(one),
                ctypes.c_void_p(out.data_ptr()),
                lt_c,
                ctypes.c_void_p(out.data_ptr()),
                lt_c,
                ctypes.byref(algo),
                ctypes.c_void_p(workspace.data_ptr()),
                _WORKSPACE_BYTES,
                ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream),
            ),
            "cublasLtMatmul",
        )


_LT: _CublasLt | None = None
_LT_ERROR: str | None = None


def _cublaslt() -> _CublasLt | None:
    global _LT, _LT_ERROR
    if _LT is None and _LT_ERROR is None:
        path = _library_path()
        try:
            _LT = _CublasLt(path) if path else None
            _LT_ERROR = None if path else "libcublasLt not found"
        except OSError as e:
            _LT_ERROR = str(e)
    return _LT


def accumulate_by_add(a, a_scale, b, b_scale, out, *, use_fast_accum: bool = False) -> torch.Tensor:
    """The reference (and the fallback): the product in FP32, added into ``out`` (rounded once)."""
    if out.is_cuda:
        product = fp8_gemm(a, a_scale, b, b_scale, out_dtype=torch.float32, use_fast_accum=use_fast_accum)
    else:
        product = fp8_gemm_reference(a, a_scale, b, b_scale, out_dtype=torch.float32)
    return out.add_(product)


def backend_for(out: torch.Tensor) -> str:
    """Which way ``fp8_gemm_accumulate`` goes for ``out``: "cublaslt" on a GPU where torch ships
    cuBLASLt and ``out``'s height is a multiple of 16 (cuBLASLt's FP8 leading-dimension rule), else
    "add"."""
    return "cublaslt" if out.is_cuda and out.shape[0] % 16 == 0 and _cublaslt() is not None else "add"


def fp8_gemm_accumulate(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    use_fast_accum: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """``out += (a * a_scale) @ (b * b_scale)``, the product accumulated in FP32 and added to ``out``
    (BF16 or FP32, (M, N) contiguous) in one rounding. Returns ``out``.

    ``backend``: "auto" (``backend_for``), "cublaslt" or "add" (the FP32 temporary and an add).
    Scales are 0-d (or one-element) FP32 tensors, as the quantizers return them.
    """
    if backend not in ("auto", "cublaslt", "add"):
        raise ValueError(f"backend {backend!r}: use 'auto', 'cublaslt' or 'add'")
    check_operands(a, b, "fp8_gemm_accumulate")
    if out.shape != (a.shape[0], b.shape[1]) or out.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"out must be a BF16 or FP32 tensor of shape {(a.shape[0], b.shape[1])}, got {out.dtype} {tuple(out.shape)}"
        )
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (row-major)")
    chosen = backend_for(out) if backend == "auto" else backend
    if chosen == "add" or not out.is_cuda:
        return accumulate_by_add(a, a_scale, b, b_scale, out, use_fast_accum=use_fast_accum)
    check_gpu_layout(a, b, "fp8_gemm_accumulate")
    if a.shape[0] % 16:  # out's rows are cuBLASLt's columns of D here: its leading dimension
        raise ValueError(f"the output height {a.shape[0]} of an accumulating FP8 GEMM must be a multiple of 16")
    a, b = _pad_k(a, b)
    sa = a_scale if a_scale.dim() == 0 else a_scale.reshape(())
    sb = b_scale if b_scale.dim() == 0 else b_scale.reshape(())
    lt = _cublaslt()
    if lt is None:
        raise CublasLtError(f"cuBLASLt is not available here ({_LT_ERROR}); use backend='add'")
    lt.accumulate(a, sa, b, sb, out, use_fast_accum)
    return out
