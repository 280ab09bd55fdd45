"""The fused AdamW step on range-expanded FP8 states, one launch for many tensors.

Per element, in FP32 registers (torch.optim.AdamW's update, decoupled weight decay, bias correction,
eps outside the square root):

    m, v  <- dequantize(codes, scale, k, center)            (coat_kernels.expanded)
    m     <- beta1 m + (1 - beta1) g ;  v <- beta2 v + (1 - beta2) g^2
    p     <- p (1 - lr wd)
    p     <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    codes, scale, k, center of m and v <- quantize(m), quantize(v), with fresh k and centre
    p is written back (FP32 master weights) and, if asked, as BF16/FP16 model weights.

The parameter update uses the FP32 m and v before requantization, so quantization error enters
only through the next step. No FP32 copy of m or v exists outside one program's registers: each
program handles GROUPS whole quantization groups of one tensor (groups are counted from element 0
of each tensor, so a tensor's quantization does not depend on what else is in the launch).

Multi-tensor launch: tensors are addressed as ``base + offset`` where ``base`` is the first tensor
of each kind and ``offset`` the element distance of each tensor from it (a table, one row per
tensor); a second table lists (tensor, first group) per program. The offsets' common power-of-two
divisor is passed as a hint so that loads stay vectorized. Bytes per parameter (expansion on):
read 4 (p) + 4 (g) + 2 (codes) + 24/128 (metadata), write 4 + 2 + 24/128 + 2 (BF16 model copy):
18.4 bytes, against 28 for torch's fused FP32 AdamW plus 6 for Megatron's separate BF16 copy.
With a split master weight (``master_lows``: the BF16 model weight is the FP32 master's high
half, an int16 word its low half, ``coat_kernels.master``) and BF16 gradients: read 2 + 2 + 2 +
2 + 24/128, write 2 + 2 + 2 + 24/128: 14.4 bytes, and the same FP32 arithmetic bit for bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .expanded import (
    DEFAULT_K_MAX,
    DEFAULT_K_MIN,
    K_RESOLUTION,
    ExpandedFp8,
    _check_limits,
    compiled_for_nvidia,
    dequantize_expanded_groups_reference,
    dequantize_expanded_tile,
    k_target,
    quantize_expanded_groups_reference,
    quantize_expanded_tile,
    use_exact_math,
)
from .formats import fp8_format
from .launch import lean
from .log2_exp2 import div_rn_reference, f32, sqrt_rn_reference
from .master import join_master, join_master_tile, split_master, split_master_tile
from .scaling import fp8_bits


@triton.jit
def _load(ptr, mask, other, RAGGED: tl.constexpr):
    if RAGGED:
        return tl.load(ptr, mask=mask, other=other)
    return tl.load(ptr)


@triton.jit
def _load_state(
    q_base,
    q_at,
    s_base,
    s_at,
    k_base,
    k_at,
    c_base,
    c_at,
    idx,
    groups,
    mask,
    gmask,
    E5M2: tl.constexpr,
    EXPAND: tl.constexpr,
    FAST: tl.constexpr,
    PTX: tl.constexpr,
    RAGGED: tl.constexpr,
):
    raw = _load(q_base + q_at + idx, mask, 0, RAGGED)
    if E5M2:
        q = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        q = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale = _load(s_base + s_at + groups, gmask, 1.0, RAGGED)
    if EXPAND:
        k = _load(k_base + k_at + groups, gmask, 1.0, RAGGED)
        center = _load(c_base + c_at + groups, gmask, 1.0, RAGGED)
    else:
        k = scale
        center = scale
    return dequantize_expanded_tile(q, scale, k, center, EXPAND, FAST, PTX)


@triton.jit
def _store_state(
    x,
    q_base,
    q_at,
    s_base,
    s_at,
    k_base,
    k_at,
    c_base,
    c_at,
    idx,
    groups,
    mask,
    gmask,
    FMAX: tl.constexpr,
    E5M2: tl.constexpr,
    EXPAND: tl.constexpr,
    K_TARGET: tl.constexpr,
    K_MIN16: tl.constexpr,
    K_MAX16: tl.constexpr,
    FAST: tl.constexpr,
    PTX: tl.constexpr,
):
    """Requantize x, store codes and metadata; return the number of non-zero values that became code 0."""
    y, scale, k, center = quantize_expanded_tile(x, FMAX, EXPAND, K_TARGET, K_MIN16, K_MAX16, FAST, PTX)
    raw = fp8_bits(y, E5M2, PTX)
    tl.store(q_base + q_at + idx, raw, mask=mask)
    tl.store(s_base + s_at + groups, scale, mask=gmask)
    if EXPAND:
        tl.store(k_base + k_at + groups, k, mask=gmask)
        tl.store(c_base + c_at + groups, center, mask=gmask)
    # code 0 <=> |y| rounds to 0 <=> |y| <= half the smallest subnormal (ties to even); read off y
    # rather than the packed bytes. Padding lanes hold 0.
    if E5M2:
        underflow = (x != 0.0) & (tl.abs(y) <= 0.00000762939453125)  # 2^-17
    else:
        underflow = (x != 0.0) & (tl.abs(y) <= 0.0009765625)  # 2^-10
    return tl.sum(tl.sum(underflow.to(tl.int32), axis=1), axis=0)


@lean
@triton.jit
def _fp8_adamw_kernel(
    work_ptr,
    meta_ptr,
    under_ptr,
    p_base,
    g_base,
    w_base,
    mq_base,
    ms_base,
    mk_base,
    mc_base,
    vq_base,
    vs_base,
    vk_base,
    vc_base,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    decay,
    step_size,
    bias2_sqrt,
    eps,
    M_FMAX: tl.constexpr,
    V_FMAX: tl.constexpr,
    M_E5M2: tl.constexpr,
    V_E5M2: tl.constexpr,
    M_EXPAND: tl.constexpr,
    V_EXPAND: tl.constexpr,
    M_TARGET: tl.constexpr,
    V_TARGET: tl.constexpr,
    K_MIN16: tl.constexpr,
    K_MAX16: tl.constexpr,
    WRITE_MODEL: tl.constexpr,
    SPLIT: tl.constexpr,
    ALIGN: tl.constexpr,
    FAST: tl.constexpr,
    PTX: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    RAGGED: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(work_ptr + 2 * pid).to(tl.int64)
    first_group = tl.load(work_ptr + 2 * pid + 1).to(tl.int64)
    first = first_group * GROUP
    row = meta_ptr + t * 12
    # This program's start in each array: the tensor's element (or group) offset from the base of
    # its column (see _LaunchPlan) plus the program's first element (or group); 64-bit scalars,
    # so that the per-element offsets below stay 32-bit.
    p_at = tl.multiple_of(tl.load(row + 0), ALIGN) + first
    g_at = tl.multiple_of(tl.load(row + 1), ALIGN) + first
    w_at = tl.multiple_of(tl.load(row + 2), ALIGN) + first
    mq_at = tl.multiple_of(tl.load(row + 3), ALIGN) + first
    ms_at = tl.load(row + 4) + first_group
    mk_at = tl.load(row + 5) + first_group
    mc_at = tl.load(row + 6) + first_group
    vq_at = tl.multiple_of(tl.load(row + 7), ALIGN) + first
    vs_at = tl.load(row + 8) + first_group
    vk_at = tl.load(row + 9) + first_group
    vc_at = tl.load(row + 10) + first_group
    groups = tl.arange(0, GROUPS)
    idx = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    if RAGGED:
        remaining = tl.minimum(tl.load(row + 11) - first, GROUPS * GROUP).to(tl.int32)
        mask = idx < remaining
        gmask = groups * GROUP < remaining
    else:
        # every element exists: no masks, so that loads and stores are 16-byte vectors (a mask
        # that may change at any element forces one instruction per element)
        mask = None
        gmask = None

    if SPLIT:  # p: the BF16 high halves (int16 patterns), w: the int16 low words of the FP32 masters
        p = join_master_tile(_load(p_base + p_at + idx, mask, 0, RAGGED), _load(w_base + w_at + idx, mask, 0, RAGGED))
    else:
        p = _load(p_base + p_at + idx, mask, 0.0, RAGGED)
    g = _load(g_base + g_at + idx, mask, 0.0, RAGGED).to(tl.float32)
    m = _load_state(
        mq_base,
        mq_at,
        ms_base,
        ms_at,
        mk_base,
        mk_at,
        mc_base,
        mc_at,
        idx,
        groups,
        mask,
        gmask,
        M_E5M2,
        M_EXPAND,
        FAST,
        PTX,
        RAGGED,
    )
    v = _load_state(
        vq_base,
        vq_at,
        vs_base,
        vs_at,
        vk_base,
        vk_at,
        vc_base,
        vc_at,
        idx,
        groups,
        mask,
        gmask,
        V_E5M2,
        V_EXPAND,
        FAST,
        PTX,
        RAGGED,
    )

    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    p = p * decay
    if FAST:
        p = p - step_size * (m / (tl.sqrt(v) * (1.0 / bias2_sqrt) + eps))
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)

    if SPLIT:
        hi, lo = split_master_tile(p)
        tl.store(p_base + p_at + idx, hi, mask=mask)
        tl.store(w_base + w_at + idx, lo, mask=mask)
    else:
        tl.store(p_base + p_at + idx, p, mask=mask)
        if WRITE_MODEL:
            tl.store(w_base + w_at + idx, p.to(w_base.dtype.element_ty), mask=mask)
    m_under = _store_state(
        m,
        mq_base,
        mq_at,
        ms_base,
        ms_at,
        mk_base,
        mk_at,
        mc_base,
        mc_at,
        idx,
        groups,
        mask,
        gmask,
        M_FMAX,
        M_E5M2,
        M_EXPAND,
        M_TARGET,
        K_MIN16,
        K_MAX16,
        FAST,
        PTX,
    )
    v_under = _store_state(
        v,
        vq_base,
        vq_at,
        vs_base,
        vs_at,
        vk_base,
        vk_at,
        vc_base,
        vc_at,
        idx,
        groups,
        mask,
        gmask,
        V_FMAX,
        V_E5M2,
        V_EXPAND,
        V_TARGET,
        K_MIN16,
        K_MAX16,
        FAST,
        PTX,
    )
    tl.store(under_ptr + 2 * pid, m_under)
    tl.store(under_ptr + 2 * pid + 1, v_under)


def _state_columns(states: list[ExpandedFp8]) -> list[list[torch.Tensor]]:
    """A state's four columns of the launch plan: its codes (as bytes), scales, and the expansion's k
    and center (the scales again where the state is not expanded: the kernel reads none of them)."""
    scales = [s.scale for s in states]
    expanded = states[0].expansion
    return [
        [s.codes.view(torch.uint8) for s in states],
        scales,
        [s.k for s in states] if expanded else scales,
        [s.center for s in states] if expanded else scales,
    ]


def _constants(m0: ExpandedFp8, v0: ExpandedFp8, k_min, k_max, *, write_model, split, fast, align) -> dict:
    """The step kernel's compile-time arguments and launch options, the same for both of its launches."""
    mf, vf = fp8_format(m0.fmt), fp8_format(v0.fmt)
    groups, warps = step_blocks(m0.group_size)
    return dict(
        M_FMAX=mf.max,
        V_FMAX=vf.max,
        M_E5M2=m0.fmt == "e5m2",
        V_E5M2=v0.fmt == "e5m2",
        M_EXPAND=m0.expansion,
        V_EXPAND=v0.expansion,
        M_TARGET=k_target(mf.max),
        V_TARGET=k_target(vf.max),
        K_MIN16=k_min * K_RESOLUTION,
        K_MAX16=k_max * K_RESOLUTION,
        WRITE_MODEL=write_model,
        SPLIT=split,
        ALIGN=align,
        FAST=fast,
        PTX=compiled_for_nvidia(),
        GROUP=m0.group_size,
        GROUPS=groups,
        num_warps=warps,
        enable_fp_fusion=fast,  # exact mode: no FMA contraction (bit-identical to torch)
    )


def adamw_scalars(
    *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> dict[str, float]:
    """The step's scalars, computed in float64 and rounded once to FP32 (what the kernel receives)."""
    if step < 1:
        raise ValueError(f"step={step}: the AdamW step counter starts at 1 (increment it before the update)")
    return {
        "beta1": f32(beta1),
        "one_minus_beta1": f32(1.0 - beta1),
        "beta2": f32(beta2),
        "one_minus_beta2": f32(1.0 - beta2),
        "decay": f32(1.0 - lr * weight_decay),
        "step_size": f32(lr / (1.0 - beta1**step)),
        "bias2_sqrt": f32(math.sqrt(1.0 - beta2**step)),
        "eps": f32(eps),
    }


# Elements per batch of the reference: bounds its FP32 temporaries (a multiple of every group size).
_REFERENCE_CHUNK = 1 << 20


def _reference_batches(numels: list[int], group_size: int):
    """Pieces (tensor, lo, hi) of whole groups, batched into lists of about _REFERENCE_CHUNK elements:
    small tensors share one batch (one pass of torch ops), large ones are split."""
    batch, size = [], 0
    for i, n in enumerate(numels):
        for lo in range(0, n, _REFERENCE_CHUNK):
            hi = min(n, lo + _REFERENCE_CHUNK)
            batch.append((i, lo, hi))
            size += hi - lo
            if size >= _REFERENCE_CHUNK:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _adamw_reference_batch(
    pieces, params, grads, exp_avgs, exp_avg_sqs, model_params, lows, s, k_min, k_max
) -> tuple[int, int]:
    gs = exp_avgs[0].group_size
    spans = [(i, lo, hi, -(-(hi - lo) // gs)) for i, lo, hi in pieces]

    def tile(tensors, piece=lambda t, lo, hi: t.reshape(-1)[lo:hi].float()):
        parts = [
            torch.nn.functional.pad(piece(tensors[i], lo, hi), (0, ng * gs - (hi - lo))) for i, lo, hi, ng in spans
        ]
        return torch.cat(parts).view(-1, gs)

    def meta(states, name):
        if getattr(states[0], name) is None:
            return None
        return torch.cat([getattr(states[i], name)[lo // gs : lo // gs + ng] for i, lo, hi, ng in spans])

    def scatter(flat_rows, tensors, convert=lambda t, dst: t.to(dst.dtype)):
        row = 0
        for i, lo, hi, ng in spans:
            dst = tensors[i]
            dst.view(-1)[lo:hi] = convert(flat_rows[row : row + ng].reshape(-1)[: hi - lo], dst)
            row += ng

    def scatter_meta(values, states, name):
        row = 0
        for i, lo, hi, ng in spans:
            getattr(states[i], name)[lo // gs : lo // gs + ng] = values[row : row + ng]
            row += ng

    def load(states):
        return dequantize_expanded_groups_reference(
            tile([st.codes for st in states]),
            meta(states, "scale"),
            meta(states, "k"),
            meta(states, "center"),
            states[0].expansion,
        )

    def store(states, x):
        fmt = fp8_format(states[0].fmt)
        y, scale, k, center = quantize_expanded_groups_reference(x, fmt.max, states[0].expansion, k_min, k_max)
        codes = y.to(fmt.dtype)
        scatter(codes.view(torch.uint8), [st.codes.view(torch.uint8) for st in states], lambda t, dst: t)
        scatter_meta(scale, states, "scale")
        if states[0].expansion:
            scatter_meta(k, states, "k")
            scatter_meta(center, states, "center")
        return int(((x != 0) & ((codes.view(torch.uint8) & 0x7F) == 0)).sum())

    if lows is not None:
        p = tile(
            list(zip(params, lows)), lambda t, lo, hi: join_master(t[0].reshape(-1)[lo:hi], t[1].reshape(-1)[lo:hi])
        )
    else:
        p = tile(params)
    g = tile(grads)
    m, v = load(exp_avgs), load(exp_avg_sqs)
    m = s["beta1"] * m + s["one_minus_beta1"] * g
    v = s["beta2"] * v + s["one_minus_beta2"] * (g * g)
    p = p * s["decay"]
    denom = div_rn_reference(sqrt_rn_reference(v), s["bias2_sqrt"]) + s["eps"]
    p = p - s["step_size"] * div_rn_reference(m, denom)
    if lows is not None:
        hi, lo = split_master(p)
        scatter(hi, params)
        scatter(lo, lows)
    else:
        scatter(p, params)
    if model_params is not None:
        scatter(p, model_params)
    return store(exp_avgs, m), store(exp_avg_sqs, v)


def _fp8_adamw_reference(
    params, grads, exp_avgs, exp_avg_sqs, model_params, lows, scalars, k_min, k_max
) -> torch.Tensor:
    under = [0, 0]
    if params:
        for pieces in _reference_batches([p.numel() for p in params], exp_avgs[0].group_size):
            um, uv = _adamw_reference_batch(
                pieces, params, grads, exp_avgs, exp_avg_sqs, model_params, lows, scalars, k_min, k_max
            )
            under[0] += um
            under[1] += uv
    device = params[0].device if params else "cpu"
    return torch.tensor(under, dtype=torch.int64, device=device)


def _offsets(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """(base tensor, element offset of each tensor from it)."""
    base = tensors[0]
    size = base.element_size()
    offsets = []
    for t in tensors:
        delta = t.data_ptr() - base.data_ptr()
        if delta % size:
            raise ValueError(
                f"a {t.dtype} tensor is not aligned to its element size; pass contiguous, element-aligned tensors"
            )
        offsets.append(delta // size)
    return base, offsets


def _alignment(offsets: list[int]) -> int:
    """Largest power of two (at most 16) that divides every offset: the kernel's vectorization hint."""
    align = 16
    for o in offsets:
        while o % align:
            align //= 2
    return align


def step_blocks(group_size: int) -> tuple[int, int]:
    """(groups per program, num_warps): 2048 elements per program with 128-element groups, 4 warps
    (16 elements per thread): the fastest tiling of ``optimizer.py --sweep`` (retired: ``git show 94757c2:benchmarks/optimizer.py``) (docs/results.md)."""
    return max(1, 2048 // group_size), 4


class _LaunchPlan:
    """Tables for one multi-tensor launch, kept while no tensor of the launch moves.

    ``meta``: int64 (tensors, 12): the element offset of each tensor from the first tensor of its
    column (p, g, w, m codes, m scale, m k, m centre, v codes, v scale, v k, v centre), then numel.
    ``full``: int32 (programs, 2): the tensor and the first group of each program whose
    GROUPS * GROUP elements all exist (launched without masks); ``tail``: the same for the last,
    partial program of each tensor whose numel is not a multiple of that (launched with masks).
    """

    def __init__(self, columns: list[list[torch.Tensor]], numels: list[int], group_size: int, device):
        groups_per_program = step_blocks(group_size)[0]
        span = groups_per_program * group_size
        self.bases = []
        offsets = []
        for col in columns:
            base, offs = _offsets(col)
            self.bases.append(base)
            offsets.append(offs)
        # element-wise columns (p, g, w, codes) get the vectorization hint; metadata is 1/128 of the traffic
        self.align = _alignment([o for c in (0, 1, 2, 3, 7) for o in offsets[c]])
        meta = torch.tensor([list(row) + [n] for row, n in zip(zip(*offsets), numels)], dtype=torch.int64)
        n = torch.tensor(numels, dtype=torch.int64)
        per_tensor = n // span
        tensor = torch.repeat_interleave(torch.arange(len(numels)), per_tensor)
        starts = torch.cumsum(per_tensor, 0) - per_tensor
        first = (torch.arange(int(per_tensor.sum())) - torch.repeat_interleave(starts, per_tensor)) * groups_per_program
        ragged = (n % span).nonzero().flatten()
        self.meta = meta.to(device)
        self.full = torch.stack([tensor, first], dim=1).to(torch.int32).to(device)
        self.tail = torch.stack([ragged, per_tensor[ragged] * groups_per_program], dim=1).to(torch.int32).to(device)
        self.n_programs = self.full.shape[0] + self.tail.shape[0]


_plans: dict[tuple, _LaunchPlan] = {}


def _plan(key, columns, numels, group_size, device) -> _LaunchPlan:
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 64:
            _plans.clear()
        plan = _plans[key] = _LaunchPlan(columns, numels, group_size, device)
    return plan


def _validate(params, grads, exp_avgs, exp_avg_sqs, model_params, lows):
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n) or any(
        x is not None and len(x) != n for x in (model_params, lows)
    ):
        raise ValueError(
            "params, grads, exp_avgs, exp_avg_sqs (and model_params / master_lows) must be lists of the same length"
        )
    if lows is not None and model_params is not None:
        raise ValueError(
            "with master_lows the params are the BF16 model weights themselves (the masters' high halves): pass no model_params"
        )
    for name, states in (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        kinds = {(s.fmt, s.expansion, s.group_size) for s in states}
        if len(kinds) > 1:
            raise ValueError(f"{name} mix formats/expansion/group sizes {sorted(kinds)}; launch them separately")
    if exp_avgs and exp_avgs[0].group_size != exp_avg_sqs[0].group_size:
        raise ValueError("exp_avg and exp_avg_sq must use the same group size")
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if lows is not None:
            lo = lows[i]
            if (
                p.dtype != torch.bfloat16
                or lo.dtype != torch.int16
                or lo.numel() != p.numel()
                or not lo.is_contiguous()
            ):
                raise TypeError(
                    f"param {i}: a split master weight is a BF16 param (the high half) and a contiguous int16 low word of its "
                    f"{p.numel()} elements, got {p.dtype} and {lo.dtype} with {lo.numel()}"
                )
        elif p.dtype != torch.float32:
            raise TypeError(
                f"param {i} is {p.dtype}: the FP8 AdamW step updates FP32 master weights; keep an FP32 copy (Megatron's distributed "
                f"optimizer does), or pass BF16 params with master_lows (a split master weight, coat_kernels.master)"
            )
        if not (p.is_contiguous() and g.is_contiguous()):
            raise ValueError(f"param {i} or its grad is not contiguous; the step reads them as flat buffers")
        if g.numel() != p.numel() or g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"grad {i} must be FP32/BF16/FP16 with the param's {p.numel()} elements, got {g.dtype} with {g.numel()}"
            )
        for name, s in (("exp_avg", m), ("exp_avg_sq", v)):
            if s.codes.numel() != p.numel() or s.codes.dtype != fp8_format(s.fmt).dtype or not s.codes.is_contiguous():
                raise ValueError(
                    f"{name} {i} must hold {p.numel()} contiguous {s.fmt} codes, got {s.codes.dtype} with {s.codes.numel()}"
                )
        if model_params is not None:
            w = model_params[i]
            if w.numel() != p.numel() or w.dtype not in (torch.bfloat16, torch.float16) or not w.is_contiguous():
                raise ValueError(
                    f"model param {i} must be a contiguous BF16/FP16 tensor of {p.numel()} elements, got {w.dtype} {tuple(w.shape)}"
                )
    if model_params is not None and len({w.dtype for w in model_params}) > 1:
        raise ValueError("model_params mix dtypes; launch BF16 and FP16 model params separately")
    if len({g.dtype for g in grads}) > 1:
        raise ValueError("grads mix dtypes; launch them separately")


def fp8_adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[ExpandedFp8],
    exp_avg_sqs: list[ExpandedFp8],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    model_params: list[torch.Tensor] | None = None,
    master_lows: list[torch.Tensor] | None = None,
    k_min: float = DEFAULT_K_MIN,
    k_max: float = DEFAULT_K_MAX,
    exact_math: bool | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One AdamW step on many tensors, states in range-expanded FP8, updated in place.

    Args:
        params: FP32 master weights, contiguous (any shape; read as flat).
        grads: their gradients (FP32, BF16 or FP16), same numel, contiguous.
        exp_avgs, exp_avg_sqs: ``ExpandedFp8`` states of m (signed) and v, same numel; all m states
            share one format/expansion/group size, all v states another.
        lr, beta1, beta2, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        step: the step number after incrementing (1 on the first step): bias correction.
        model_params: optional BF16/FP16 tensors receiving the updated weights (Megatron's model
            params), written by the same pass.
        k_min, k_max: expansion limits for the requantization.
        exact_math: Triton only: True is bit-identical to the torch reference (IEEE operations, no
            FMA contraction), False uses the hardware's exp2/log2, division and square root per
            element (the CUDA default: the exact path is compute-bound on the GPU); see
            ``coat_kernels.expanded``.
    Returns:
        int64 tensor [m codes, v codes] on the params' device: how many non-zero values became code 0
        (underflow), for telemetry; reading it syncs.
    """
    _check_limits(k_min, k_max)
    _validate(params, grads, exp_avgs, exp_avg_sqs, model_params, master_lows)
    scalars = adamw_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    live = [i for i, p in enumerate(params) if p.numel()]
    if not live or not use_triton(params[live[0]], backend):
        return _fp8_adamw_reference(
            params, grads, exp_avgs, exp_avg_sqs, model_params, master_lows, scalars, k_min, k_max
        )

    pick = lambda seq: [seq[i] for i in live]  # noqa: E731
    ps, gs, ms, vs = pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs)
    if master_lows is not None:  # the kernel reads and writes both halves as int16 bit patterns
        ps, ws = [p.view(torch.int16) for p in ps], pick(master_lows)
    else:
        ws = pick(model_params) if model_params is not None else ps
    columns = [ps, gs, ws, *_state_columns(ms), *_state_columns(vs)]
    numels = [p.numel() for p in ps]
    m0, v0 = ms[0], vs[0]
    key = (
        tuple(t.data_ptr() for col in columns for t in col),
        tuple(numels),
        m0.group_size,
        step_blocks(m0.group_size),
        ps[0].device,
    )
    plan = _plan(key, columns, numels, m0.group_size, ps[0].device)
    under = torch.empty(plan.n_programs, 2, dtype=torch.int32, device=ps[0].device)
    flags = dict(write_model=model_params is not None, split=master_lows is not None, align=plan.align)
    constants = _constants(m0, v0, k_min, k_max, fast=not use_exact_math(ps[0], exact_math), **flags)
    n_full = plan.full.shape[0]
    for work, ragged, out in ((plan.full, False, under[:n_full]), (plan.tail, True, under[n_full:])):
        if work.shape[0]:
            _fp8_adamw_kernel[(work.shape[0],)](
                work, plan.meta, out, *plan.bases, **scalars, **constants, RAGGED=ragged
            )
    return under.sum(dim=0, dtype=torch.int64)
