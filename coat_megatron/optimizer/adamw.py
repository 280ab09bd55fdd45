"""CoatAdamW: torch.optim.AdamW with its two moments stored in range-expanded FP8.

What it stores per parameter p (n = p.numel(), G = config.optimizer_group_size, groups counted from
element 0 of p):

    step                                   FP32 scalar on the CPU (as torch.optim.AdamW)
    exp_avg.codes, exp_avg_sq.codes        uint8, p's shape: the FP8 bytes of m and v
    exp_avg.scale, exp_avg_sq.scale        FP32, (ceil(n / G),)
    exp_avg.k / .center, exp_avg_sq.k / .center
                                           FP32, (ceil(n / G),); absent when that moment's
                                           expansion is off

that is 2 + 6 x 4 / 128 = 2.19 bytes per parameter with G = 128, against 8 for FP32 AdamW. FP32
parameters are their own master weights. BF16 parameters (the model weights) are the high halves of
theirs under ``CoatConfig.master_weights="split"`` (the default), and each also has

    master_low                             int16, p's shape: the low half of its FP32 master
                                           weight (``coat_kernels.master``), 2 bytes per parameter

``load_state_dict`` moves a checkpoint between the two: see there. The checkpoint formats (what
``state_dict`` writes, the loaders' checks, the conversions to and from torch.optim.AdamW's FP32
states) live in ``coat_megatron.optimizer.checkpoint``.

Codes are kept as uint8 so that gloo (which rejects float8) leaves them alone; ``load_state_dict`` keeps
every state tensor's dtype (torch's would cast them all to a floating-point parameter's dtype).

The update is torch.optim.AdamW's (decoupled weight decay, bias correction, eps outside the square
root) on FP32 parameters, done by one fused multi-tensor kernel per parameter group
(``coat_kernels.fp8_adamw_step``) on CUDA, and by its bit-identical torch reference on the CPU.

Nothing non-finite gets in. One inf or NaN gradient element (or one of magnitude 2^63 or more,
whose square overflows v) would make its quantization group's scale infinite and the group's m and
v decode to NaN, and so the weights of that whole group, one step later. So ``step()`` first checks
every gradient it is given (one fused reduction, one host sync) and, if any is unusable, updates
nothing at all, as Megatron skips a step on found-inf: it counts the step in ``skipped_steps``
(also in ``telemetry()``) and warns once, or raises with ``nonfinite_grads="raise"``. Inside
Megatron's distributed optimizer (``adopting``) Megatron decides whether to step. ``load_state_dict``
refuses, before loading anything, states the step could not use, naming the parameter and the
field: wrong dtypes or shapes (truncated, or another parameter's), non-finite or non-positive
scale or centre, k outside the config's [k_min, k_max], inf/NaN codes (or negative ones of v).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Iterable, Mapping

import torch

from coat_kernels import ExpandedFp8, fp8_adamw_step, join_master, quantize_expanded, split_master

from ..config import CoatConfig
from . import checkpoint
from .checkpoint import LOW, META, MOMENTS, describe_param

NONFINITE_GRADS = ("skip", "raise")
# Gradients at or above this magnitude count as non-finite: g^2 overflows FP32 near 2^64, and an inf
# in v gives its whole quantization group an infinite scale (torch's AdamW only freezes the element)
GRAD_LIMIT = 2.0**63


class CoatAdamW(torch.optim.Optimizer):
    """AdamW with FP8 states and per-group dynamic range expansion.

    Args:
        params: FP32 parameters (or param group dicts), as for torch.optim.AdamW, or BF16 ones
            with ``config.master_weights="split"`` (the default: their FP32 masters are the BF16
            value and an int16 low word this optimizer keeps, a BF16 model trained with exact FP32
            master weights).
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        config: formats, expansion switches, k limits and group size of the states
            (``CoatConfig.m_format`` ... ``optimizer_group_size``) and ``master_weights``; defaults
            to ``CoatConfig()``: E4M3 for m and v, expansion on, k in [1/16, 16], groups of 128,
            split masters.
        exact_math: None (default): the Triton step uses the hardware's exp2/log2 per element on CUDA
            (bandwidth-bound; within about 2^-16 of the reference), True: IEEE-only math, bit-identical to
            the torch reference on any device (compute-bound on H100/H200). See coat_kernels.expanded.
        backend: "auto" (Triton on CUDA, the torch reference on CPU), "triton" or "reference".
        nonfinite_grads: what ``step()`` does when any gradient it is given holds inf or NaN (or a
            value of magnitude 2^63 or more): "skip" (default) updates no parameter, state or step
            count, counts the step in ``skipped_steps`` and ``telemetry()["skipped_steps"]`` and
            warns once per instance; "raise" raises ``FloatingPointError``, having updated nothing.

    Attributes:
        skipped_steps: steps skipped for non-finite gradients by this instance (not checkpointed).
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
        nonfinite_grads: str = "skip",
    ):
        if nonfinite_grads not in NONFINITE_GRADS:
            raise ValueError(f"nonfinite_grads={nonfinite_grads!r}: use one of {', '.join(map(repr, NONFINITE_GRADS))}")
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
        self.nonfinite_grads = nonfinite_grads
        self.skipped_steps = 0
        self._checks_grads = True
        self._warned_nonfinite = False

    @classmethod
    def adopting(cls, param_groups: list[dict], **kwargs) -> "CoatAdamW":
        """A CoatAdamW that takes over existing param group dicts in place (Megatron's distributed
        optimizer: its groups hold the FP32 main shards and Megatron's own keys). torch's
        constructor is not used for them because it refuses non-leaf tensors, and Megatron's main
        params of FP32 model params are views of those params (so are their grads).

        ``step()`` does not check the gradients for inf/NaN here: Megatron decides whether to step
        from its own found-inf reduction over all ranks, and a rank that skipped on its own would
        leave its shards a step behind the other ranks' (no extra sync per step either)."""
        opt = cls([torch.zeros(0)], **kwargs)
        opt._checks_grads = False
        for group in param_groups:
            for key, value in opt.defaults.items():
                group.setdefault(key, value)
        opt.param_groups = param_groups
        return opt

    # ---------------------------------------------------------------- state layout

    def moment_format(self, moment: str) -> tuple[str, bool]:
        """The FP8 format ("e4m3" or "e5m2") of ``moment`` ("exp_avg" or "exp_avg_sq") and whether it is range-expanded."""
        c = self.config
        return (c.m_format, c.m_expansion) if moment == "exp_avg" else (c.v_format, c.v_expansion)

    @property
    def split_masters(self) -> bool:
        return self.config.master_weights == "split"

    def has_low_word(self, p: torch.Tensor) -> bool:
        """Whether p's FP32 master is split (p BF16, its low word in the state) rather than p itself;
        raises for a parameter this optimizer cannot step."""
        if p.dtype == torch.float32:
            return False
        if p.dtype == torch.bfloat16 and self.split_masters:
            return True
        split = "BF16 parameters with CoatConfig(master_weights='split') (the default)"
        raise TypeError(
            f"CoatAdamW updates FP32 parameters, or {split}; got {p.dtype} of shape {tuple(p.shape)}: "
            + (
                "leave master_weights at its default"
                if p.dtype == torch.bfloat16
                else "convert the model with .float() or .bfloat16()"
            )
        )

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        split = self.has_low_word(p)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if split:  # the master starts as the BF16 value itself
            state[LOW] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)
        for moment in MOMENTS:
            fmt, expansion = self.moment_format(moment)
            zeros = ExpandedFp8.zeros(
                p.shape,
                group_size=self.config.optimizer_group_size,
                fmt=fmt,
                signed=moment == "exp_avg",
                expansion=expansion,
                device=p.device,
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
        fmt, expansion = self.moment_format(moment)
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
        fmt, expansion = self.moment_format(moment)
        c = self.config
        q = quantize_expanded(
            value.detach().to(p.device, torch.float32).reshape(p.shape).contiguous(),
            c.optimizer_group_size,
            fmt,
            moment == "exp_avg",
            expansion=expansion,
            k_min=c.k_min,
            k_max=c.k_max,
            exact_math=self.exact_math,
            backend=self.backend,
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
        """Bytes of Adam states held: m and v's codes and metadata (2.19 per parameter with groups
        of 128). Neither the CPU step counters nor the split masters' low words (``master_bytes``)."""
        return sum(
            t.numel() * t.element_size()
            for s in self.state.values()
            for key, t in s.items()
            if key not in ("step", LOW)
        )

    def master_bytes(self) -> int:
        """Bytes of master weights this optimizer holds beyond the parameters: the split masters'
        int16 low words (2 per BF16 parameter; 0 with FP32 parameters, their own masters)."""
        return sum(s[LOW].numel() * s[LOW].element_size() for s in self.state.values() if LOW in s)

    # ---------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        c = self.config
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("CoatAdamW supports neither amsgrad nor maximize; set them False")
            if any(_grad(p) is not None and _grad(p).is_sparse for p in group["params"]):
                raise RuntimeError("CoatAdamW does not support sparse gradients")
        if self._checks_grads and self._skip_nonfinite_step():
            return loss
        self._last_underflow = []
        self._last_numel = 0
        for group in self.param_groups:
            launches = defaultdict(list)
            for p in group["params"]:
                grad = _grad(p)
                if grad is None:
                    continue
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
                        lr=lr,
                        beta1=beta1,
                        beta2=beta2,
                        eps=group["eps"],
                        weight_decay=group["weight_decay"],
                        step=step,
                        k_min=c.k_min,
                        k_max=c.k_max,
                        exact_math=self.exact_math,
                        backend=self.backend,
                    )
                )
                self._last_numel += sum(p.numel() for p in params)
        return loss

    def _skip_nonfinite_step(self) -> bool:
        """Whether this step must be skipped because a gradient holds inf or NaN, or a value of
        magnitude ``GRAD_LIMIT`` or more (raises instead with ``nonfinite_grads="raise"``). Checked
        before anything is touched: one such gradient element would give its group an infinite
        scale, and m, v and the group's weights NaN."""
        params = [p for group in self.param_groups for p in group["params"]]
        grads, positions = [], []
        for position, p in enumerate(params):
            grad = _grad(p)
            if grad is not None and grad.numel():
                grads.append(grad)
                positions.append(position)
        if not grads:
            return False
        by_device = defaultdict(list)
        for i, grad in enumerate(grads):
            by_device[grad.device].append(i)
        amax = torch.zeros(len(grads), dtype=torch.float32)
        for indices in by_device.values():
            # the largest magnitude of each gradient (NaN if it holds one); an L2 norm would overflow
            # on large finite values. One copy to the host per device.
            amax[indices] = torch.stack(torch._foreach_norm([grads[i] for i in indices], math.inf)).float().cpu()
        usable = amax < GRAD_LIMIT
        if bool(usable.all()):
            return False
        first = int((~usable).nonzero()[0])
        found = describe_param(positions[first], params[positions[first]])
        if amax[first].isfinite():
            found += f" holds {amax[first].item():.3g} (2^63 or more: its square would overflow Adam's FP32 v)"
        else:
            found += " holds inf or NaN"
        if self.nonfinite_grads == "raise":
            raise FloatingPointError(
                f"the gradient of {found}: CoatAdamW.step() updated nothing (no weight, state "
                f"or step count). Find where the non-finite value comes from (e.g. with "
                f"torch.autograd.set_detect_anomaly), or build CoatAdamW(..., nonfinite_grads='skip') to skip "
                f"such steps"
            )
        self.skipped_steps += 1
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"CoatAdamW skipped a step: the gradient of {found}, so no parameter was updated "
                f"(weights, states and step counts are as before). Skipped steps are counted in skipped_steps and "
                f"telemetry()['skipped_steps']; this warning is shown once per optimizer. Build "
                f"CoatAdamW(..., nonfinite_grads='raise') to raise instead",
                RuntimeWarning,
                stacklevel=2,
            )
        return True

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
        """Summary of the states after the last step (syncs): k mean/min/max and underflow fraction of m and v,
        and ``skipped_steps``, the steps this instance skipped for non-finite gradients."""
        return {**summarize_telemetry(*self.telemetry_totals()), "skipped_steps": float(self.skipped_steps)}

    # ---------------------------------------------------------------- checkpoints

    def format_record(self) -> dict:
        """What a checkpoint must agree on to be read: the states' formats, expansion and group size."""
        return checkpoint.format_record(self.config)

    def state_dict(self) -> dict:
        """torch's state dict, each state tensor as held, with a ``"coat"`` record of the formats."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict, masters: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Load a ``state_dict()`` of a CoatAdamW with the same state formats (``format_record``),
        keeping every state tensor's dtype (torch would cast them to a BF16 parameter's), and carry
        each master weight between FP32 and split masters:

        - saved with an FP32 master (an FP32 parameter: no low word), loaded into a BF16 parameter
          with split masters: ``masters`` gives that parameter's FP32 master, the FP32 parameter
          the checkpoint's model saved (``{p: saved_model[name] for name, p in
          model.named_parameters()}``); the parameter becomes its high half and the low word the
          rest, bit for bit. Load the model's state dict before this, not after (it would round
          the parameters to BF16 again).
        - saved with a split master, loaded into an FP32 parameter: the parameter must hold the
          saved BF16 weight (load the model's state dict first); it becomes the FP32 master
          joined from that weight and the saved low word.

        ``masters`` also sets the split master of a parameter the checkpoint has no state for (never
        stepped). Either way the loaded optimizer continues bit for bit as the one that saved
        would. Everything is checked before anything is loaded, each parameter's state included:
        codes uint8 of the parameter's shape, scale/k/center FP32 of ceil(numel / group size)
        elements, finite and positive, k within the config's [k_min, k_max], master_low int16 of the
        parameter's shape; an error names the parameter (its index and shape) and the field.
        """
        checkpoint.load_state_dict(self, state_dict, masters)

    def fp32_state_dict(self) -> dict:
        """This optimizer's state as torch.optim.AdamW would hold it (FP32 exp_avg, exp_avg_sq):
        ``torch.optim.AdamW(...).load_state_dict(opt.fp32_state_dict())`` continues the run."""
        return checkpoint.fp32_state_dict(self)

    def load_fp32_state_dict(self, state_dict: dict) -> None:
        """Load a torch.optim.AdamW state dict (FP32 exp_avg / exp_avg_sq), quantizing the moments."""
        checkpoint.load_fp32_state_dict(self, state_dict)


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
