"""CoatAdamW: torch.optim.AdamW with its two moments stored in range-expanded FP8.

What it stores per parameter p (n = p.numel(), G = config.optimizer_group_size, groups counted from
element 0 of p):

    step                                   FP32 scalar on the CPU (as torch.optim.AdamW)
    exp_avg.codes, exp_avg_sq.codes        uint8, p's shape: the FP8 bytes of m and v
    exp_avg.scale, exp_avg_sq.scale        FP32, (ceil(n / G),)
    exp_avg.k / .center, exp_avg_sq.k / .center
                                           FP32, (ceil(n / G),); absent when that moment's
                                           expansion is off

that is 2 + 6 x 4 / 128 = 2.19 bytes per parameter with G = 128, against 8 for FP32 AdamW. With
``CoatConfig.master_weights="split"`` the parameters are BF16 (the model weights) and each also has

    master_low                             int16, p's shape: the low half of its FP32 master
                                           weight (``coat_kernels.master``), 2 bytes per parameter

Codes are kept as uint8 so that ``load_state_dict`` (which casts floating-point state to the parameter's dtype)
and gloo (which rejects float8) leave them alone.

The update is torch.optim.AdamW's (decoupled weight decay, bias correction, eps outside the square
root) on FP32 parameters, done by one fused multi-tensor kernel per parameter group
(``coat_kernels.fp8_adamw_step``) on CUDA, and by its bit-identical torch reference on the CPU.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

from coat_kernels import ExpandedFp8, dequantize_expanded, fp8_adamw_step, join_master, quantize_expanded, split_master

from ..config import CoatConfig

MOMENTS = ("exp_avg", "exp_avg_sq")
META = ("scale", "k", "center")
LOW = "master_low"


class CoatAdamW(torch.optim.Optimizer):
    """AdamW with FP8 states and per-group dynamic range expansion.

    Args:
        params: FP32 parameters (or param group dicts), as for torch.optim.AdamW; BF16 ones with
            ``config.master_weights="split"`` (their FP32 masters are the BF16 value and an int16
            low word this optimizer keeps: a BF16 model trained with exact FP32 master weights).
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        config: formats, expansion switches, k limits and group size of the states
            (``CoatConfig.m_format`` ... ``optimizer_group_size``); defaults to ``CoatConfig()``:
            E4M3 for m and v, expansion on, k in [1/16, 16], groups of 128.
        exact_math: None (default): the Triton step uses the hardware's exp2/log2 per element on CUDA
            (bandwidth-bound; within about 2^-16 of the reference), True: IEEE-only math, bit-identical to
            the torch reference on any device (compute-bound on H100/H200). See coat_kernels.expanded.
        backend: "auto" (Triton on CUDA, the torch reference on CPU), "triton" or "reference".
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        config: CoatConfig | None = None,
        exact_math: bool | None = None,
        backend: str = "auto",
    ):
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must lie in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"invalid eps {eps}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False)
        super().__init__(params, defaults)
        self.config = config if config is not None else CoatConfig()
        self.backend = backend
        self.exact_math = exact_math
        self.model_params: dict[torch.Tensor, torch.Tensor] = {}
        self._last_underflow: list[torch.Tensor] = []
        self._last_numel = 0

    @classmethod
    def adopting(cls, param_groups: list[dict], **kwargs) -> "CoatAdamW":
        """A CoatAdamW that takes over existing param group dicts in place (Megatron's distributed
        optimizer: its groups hold the FP32 main shards and Megatron's own keys). torch's
        constructor is not used for them because it refuses non-leaf tensors, and Megatron's main
        params of FP32 model params are views of those params (so are their grads)."""
        opt = cls([torch.zeros(0)], **kwargs)
        for group in param_groups:
            for key, value in opt.defaults.items():
                group.setdefault(key, value)
        opt.param_groups = param_groups
        return opt

    # ---------------------------------------------------------------- state layout

    def _fmt(self, moment: str) -> tuple[str, bool]:
        c = self.config
        return (c.m_format, c.m_expansion) if moment == "exp_avg" else (c.v_format, c.v_expansion)

    @property
    def split_masters(self) -> bool:
        return self.config.master_weights == "split"

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        split = self.split_masters and p.dtype == torch.bfloat16
        if p.dtype != torch.float32 and not split:
            raise TypeError(
                f"CoatAdamW updates FP32 parameters, got {p.dtype} of shape {tuple(p.shape)}: keep FP32 master "
                f"weights (Megatron's distributed optimizer does; for a plain model, .float() it and use autocast), "
                f"or use CoatConfig(master_weights='split') for BF16 parameters"
            )
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if split:  # the master starts as the BF16 value itself
            state[LOW] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)
        for moment in MOMENTS:
            fmt, expansion = self._fmt(moment)
            zeros = ExpandedFp8.zeros(
                p.shape, group_size=self.config.optimizer_group_size, fmt=fmt, signed=moment == "exp_avg", expansion=expansion, device=p.device
            )
            state[f"{moment}.codes"] = zeros.codes.view(torch.uint8)
            for name in META:
                if getattr(zeros, name) is not None:
                    state[f"{moment}.{name}"] = getattr(zeros, name)

    def init_states(self) -> None:
        """Allocate the (zero) states of every parameter that has none yet (torch allocates them at
        the first step; Megatron needs them before loading a checkpoint)."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self._init_state(p, self.state[p])

    def moment(self, p: torch.Tensor, moment: str) -> ExpandedFp8:
        """A view of p's state ``moment`` ("exp_avg" or "exp_avg_sq") as ``ExpandedFp8`` (no copy)."""
        state = self.state[p]
        fmt, expansion = self._fmt(moment)
        dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        return ExpandedFp8(
            codes=state[f"{moment}.codes"].view(dtype),
            scale=state[f"{moment}.scale"],
            k=state.get(f"{moment}.k") if expansion else None,
            center=state.get(f"{moment}.center") if expansion else None,
            group_size=self.config.optimizer_group_size,
            fmt=fmt,
            signed=moment == "exp_avg",
        )

    def set_moment(self, p: torch.Tensor, moment: str, value: torch.Tensor) -> None:
        """Quantize an FP32 value of ``moment`` for p into its state (import from FP32 Adam)."""
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        fmt, expansion = self._fmt(moment)
        c = self.config
        q = quantize_expanded(
            value.detach().to(p.device, torch.float32).reshape(p.shape).contiguous(), c.optimizer_group_size, fmt, moment == "exp_avg",
            expansion=expansion, k_min=c.k_min, k_max=c.k_max, exact_math=self.exact_math, backend=self.backend,
        )
        state[f"{moment}.codes"].copy_(q.codes.view(torch.uint8))
        for name in META:
            if getattr(q, name) is not None:
                state[f"{moment}.{name}"].copy_(getattr(q, name))

    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """p's FP32 master weight: p itself (FP32 masters), or a new tensor joined from p and its
        low word (split masters)."""
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        return join_master(p.detach(), state[LOW]) if LOW in state else p

    @torch.no_grad()
    def set_master_weight(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Set p's FP32 master weight (and, split, p = its high half)."""
        value = value.detach().to(p.device, torch.float32).reshape(p.shape)
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        if LOW not in state:
            p.copy_(value)
            return
        hi, lo = split_master(value.contiguous())
        p.copy_(hi)
        state[LOW].copy_(lo)

    @torch.no_grad()
    def reset_master_weights(self) -> None:
        """Make every master weight the model weight itself (split: zero the low words), as after
        loading model weights alone."""
        for state in self.state.values():
            if LOW in state:
                state[LOW].zero_()

    def state_bytes(self) -> int:
        """Bytes of optimizer state held (codes + metadata; the CPU step counters not counted)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for key, t in s.items() if key != "step")

    # ---------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        c = self.config
        self._last_underflow = []
        self._last_numel = 0
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("CoatAdamW supports neither amsgrad nor maximize; set them False")
            launches = defaultdict(list)
            for p in group["params"]:
                grad = _grad(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("CoatAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                target = self.model_params.get(p)
                key = (int(state["step"].item()), grad.dtype, None if target is None else target.dtype, LOW in state)
                launches[key].append(p)
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            for (step, _, model_dtype, split), params in launches.items():
                self._last_underflow.append(
                    fp8_adamw_step(
                        [p.data for p in params],
                        [_grad(p) for p in params],
                        [self.moment(p, "exp_avg") for p in params],
                        [self.moment(p, "exp_avg_sq") for p in params],
                        model_params=None if model_dtype is None else [self.model_params[p] for p in params],
                        master_lows=[self.state[p][LOW] for p in params] if split else None,
                        lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                        k_min=c.k_min, k_max=c.k_max, exact_math=self.exact_math, backend=self.backend,
                    )
                )
                self._last_numel += sum(p.numel() for p in params)
        return loss

    # ---------------------------------------------------------------- telemetry

    def telemetry_totals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reducible totals of the state statistics: (sums, minima, maxima), FP64 tensors.

        sums: [k sum m, groups m, k sum v, groups v, underflowed codes m, underflowed codes v,
        elements updated] (the underflow counts are those of the last step); minima/maxima: [k m, k v].
        Sum them (and min/max them) over ranks holding other shards, then ``summarize_telemetry``.
        """
        device = next((t.device for s in self.state.values() for k, t in s.items() if k != "step"), torch.device("cpu"))
        sums = torch.zeros(7, dtype=torch.float64, device=device)
        mins = torch.full((2,), float("inf"), dtype=torch.float64, device=device)
        maxs = torch.full((2,), float("-inf"), dtype=torch.float64, device=device)
        for i, moment in enumerate(MOMENTS):
            ks = [s[f"{moment}.k"] for s in self.state.values() if f"{moment}.k" in s]
            scales = [s[f"{moment}.scale"] for s in self.state.values() if f"{moment}.scale" in s]
            groups = sum(t.numel() for t in scales)
            if ks:
                k = torch.cat([t.reshape(-1) for t in ks]).double().to(device)
                if k.numel():
                    sums[2 * i] = k.sum()
                    mins[i] = k.min()
                    maxs[i] = k.max()
            elif groups:  # expansion off: k = 1 everywhere
                sums[2 * i] = groups
                mins[i] = maxs[i] = 1.0
            sums[2 * i + 1] = groups
        for under in self._last_underflow:
            sums[4:6] += under.to(device, torch.float64)
        sums[6] = self._last_numel
        return sums, mins, maxs

    def telemetry(self) -> dict[str, float]:
        """Summary of the states after the last step (syncs): k mean/min/max and underflow fraction of m and v."""
        return summarize_telemetry(*self.telemetry_totals())

    # ---------------------------------------------------------------- checkpoints

    def format_record(self) -> dict:
        """What a checkpoint must agree on to be read: the states' formats, expansion and group size."""
        c = self.config
        return {
            "m_format": c.m_format, "v_format": c.v_format, "m_expansion": c.m_expansion, "v_expansion": c.v_expansion,
            "group_size": c.optimizer_group_size,
        }

    def state_dict(self) -> dict:
        sd = super().state_dict()
        # this state dict holds the parameters' low words when the masters are split: record how
        sd["coat"] = {**self.format_record(), "master_weights": self.config.master_weights}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        record = state_dict.pop("coat", None)
        if record is None:
            raise ValueError(
                "this state dict has no 'coat' record: it is not a CoatAdamW state dict. To start from a "
                "torch.optim.AdamW state dict (FP32 exp_avg/exp_avg_sq), use load_fp32_state_dict()"
            )
        record = {"master_weights": "fp32", **record}  # written before split masters existed: FP32
        mine = {**self.format_record(), "master_weights": self.config.master_weights}
        if record != mine:
            raise ValueError(
                f"the checkpoint's optimizer states are {record}, this CoatAdamW uses {mine}: "
                f"use a CoatConfig that matches the checkpoint, or convert through fp32_state_dict()/load_fp32_state_dict()"
            )
        super().load_state_dict(state_dict)
        # torch casts every state tensor of a floating-point param to the param's dtype: codes come back
        # as FP32 numbers 0..255 (exact), restore the bytes
        for state in self.state.values():
            for key, value in state.items():
                if key.endswith(".codes") and value.dtype != torch.uint8:
                    state[key] = value.to(torch.uint8)
                elif key == LOW:
                    state[key] = value.to(torch.int16)
                elif key != "step" and value.dtype != torch.float32:
                    state[key] = value.float()

    def fp32_state_dict(self) -> dict:
        """This optimizer's state as torch.optim.AdamW would hold it (FP32 exp_avg, exp_avg_sq):
        ``torch.optim.AdamW(...).load_state_dict(opt.fp32_state_dict())`` continues the run."""
        self._no_split_masters("fp32_state_dict")
        sd = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        state = {}
        for index, s in sd["state"].items():
            p = params[index]
            state[index] = {"step": s["step"].clone()}
            for moment in MOMENTS:
                state[index][moment] = dequantize_expanded(self.moment(p, moment), exact_math=self.exact_math, backend=self.backend).view(p.shape)
        sd["state"] = state
        for group in sd["param_groups"]:
            group.update(foreach=None, capturable=False, differentiable=False, fused=None)
        return sd

    def load_fp32_state_dict(self, state_dict: dict) -> None:
        """Load a torch.optim.AdamW state dict (FP32 exp_avg / exp_avg_sq), quantizing the moments."""
        self._no_split_masters("load_fp32_state_dict")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("the AdamW state dict has other param groups than this optimizer; build CoatAdamW with the same params")
        params = [p for group in self.param_groups for p in group["params"]]
        index_of = {i: params[j] for j, i in enumerate(i for g in groups for i in g["params"])}
        for mine, theirs in zip(self.param_groups, groups):
            for key, value in theirs.items():
                if key in ("lr", "betas", "eps", "weight_decay", "initial_lr"):
                    mine[key] = value
        for index, s in state_dict["state"].items():
            p = index_of[index]
            for moment in MOMENTS:
                self.set_moment(p, moment, s[moment])
            self.state[p]["step"] = torch.tensor(float(s["step"]), dtype=torch.float32)


    def _no_split_masters(self, what: str) -> None:
        """Refuse where a master weight is split (a BF16 param with a low word): FP32 params are
        their own masters under either setting."""
        if self.split_masters and any(p.dtype == torch.bfloat16 for group in self.param_groups for p in group["params"]):
            raise ValueError(
                f"{what}: torch.optim.AdamW on these BF16 parameters has no FP32 master weights to carry split ones; "
                f"read them with master_weight(p), or use master_weights='fp32' (Megatron: save a fully_reshardable checkpoint)"
            )


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    """p's gradient: ``.grad``, or ``.decoupled_grad`` where Megatron puts gradients of another
    dtype than the parameter's (its precision-aware optimizer's convention)."""
    grad = getattr(p, "decoupled_grad", None)
    return p.grad if grad is None else grad


def summarize_telemetry(sums: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> dict[str, float]:
    """The telemetry dict from reduced totals (see ``CoatAdamW.telemetry_totals``)."""
    s, lo, hi = sums.tolist(), mins.tolist(), maxs.tolist()
    out = {}
    for i, name in enumerate(("m", "v")):
        groups = s[2 * i + 1]
        out[f"{name}_k_mean"] = s[2 * i] / groups if groups else float("nan")
        out[f"{name}_k_min"] = lo[i] if groups else float("nan")
        out[f"{name}_k_max"] = hi[i] if groups else float("nan")
        out[f"{name}_underflow_fraction"] = s[4 + i] / s[6] if s[6] else 0.0
    return out
