"""The checkpoint formats of ``CoatAdamW``'s states: what ``state_dict`` writes, and the checks and
conversions of the loaders.

A ``CoatAdamW.state_dict()`` is torch's (``param_groups``, ``state`` by parameter index) with each
parameter's state as the optimizer holds it (the keys below; ``coat_megatron.optimizer.adamw`` says
what each holds) plus a ``"coat"`` record of the state formats (``format_record``) and of how the
masters were kept. Loading goes by each parameter's own saved state, so a checkpoint moves between
FP32 and split master weights. ``fp32_state_dict`` / ``load_fp32_state_dict`` convert to and from
torch.optim.AdamW's format (FP32 moments); ``fp32_moments`` is also the FP32 view that Megatron's
``fully_reshardable`` format saves (``coat_megatron.optimizer.distributed``).

The functions take the optimizer and read or fill its ``state`` and ``param_groups``; ``CoatAdamW``'s
methods of the same names call them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

import torch

from coat_kernels import dequantize_expanded, join_master

from ..config import CoatConfig

if TYPE_CHECKING:
    from .adamw import CoatAdamW

# the keys of a parameter's state: "step", f"{moment}.codes" and f"{moment}.{meta}" (k and center
# absent when that moment's expansion is off), and LOW for a split master
MOMENTS = ("exp_avg", "exp_avg_sq")
META = ("scale", "k", "center")
LOW = "master_low"


def state_keys(state: dict) -> list[str]:
    """The FP8 moment keys of one parameter's ``state`` (codes and metadata), in a fixed order."""
    return [f"{m}.{k}" for m in MOMENTS for k in ("codes",) + META if f"{m}.{k}" in state]


def format_record(config: CoatConfig) -> dict:
    """What a checkpoint must agree on to be read: the states' formats, expansion and group size."""
    return {
        "m_format": config.m_format,
        "v_format": config.v_format,
        "m_expansion": config.m_expansion,
        "v_expansion": config.v_expansion,
        "group_size": config.optimizer_group_size,
    }


def state_dict(opt: CoatAdamW) -> dict:
    """torch's state dict of ``opt`` with the ``"coat"`` record."""
    sd = torch.optim.Optimizer.state_dict(opt)
    # how the masters were kept (a reader's note: loading goes by each parameter's own state)
    sd["coat"] = {**format_record(opt.config), "master_weights": opt.config.master_weights}
    return sd


def load_state_dict(opt: CoatAdamW, state_dict: dict, masters: Mapping[torch.Tensor, torch.Tensor] | None) -> None:
    """``CoatAdamW.load_state_dict`` (see there): every check first, then the load."""
    state_dict = dict(state_dict)
    record = state_dict.pop("coat", None)
    if record is None:
        raise ValueError(
            "this state dict has no 'coat' record: it is not a CoatAdamW state dict. To start from a "
            "torch.optim.AdamW state dict (FP32 exp_avg/exp_avg_sq), use load_fp32_state_dict()"
        )
    record = {key: value for key, value in record.items() if key != "master_weights"}
    if record != format_record(opt.config):
        raise ValueError(
            f"the checkpoint's optimizer states are {record}, this CoatAdamW uses {format_record(opt.config)}: "
            f"use a CoatConfig that matches the checkpoint, or convert through fp32_state_dict()/load_fp32_state_dict()"
        )
    groups = state_dict["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError(
            "the checkpoint has other param groups than this optimizer: build CoatAdamW with the same parameters in the same groups"
        )
    params = [p for group in opt.param_groups for p in group["params"]]
    indices = [i for group in groups for i in group["params"]]
    saved = {p: state_dict["state"].get(i, {}) for p, i in zip(params, indices)}
    masters = {} if masters is None else masters
    for position, (p, s) in enumerate(saved.items()):
        check_saved_state(opt, position, p, s)
    for position, (p, s) in enumerate(saved.items()):
        check_master_source(opt, position, p, s, masters)
    # torch's loader casts floating-point states to their parameter's dtype: the states are put back as saved below
    torch.optim.Optimizer.load_state_dict(opt, state_dict)
    with torch.no_grad():
        for p, s in saved.items():
            state = opt.state[p]
            for key, value in s.items():  # the saved tensors as they are, copied
                state[key] = value.clone() if key == "step" else value.to(p.device, copy=True)
            if opt.has_low_word(p) and LOW not in s and (s or p in masters):  # saved with an FP32 master
                if state:
                    state[LOW] = torch.empty(p.shape, dtype=torch.int16, device=p.device)
                opt.set_master_weight(p, masters[p])  # p = its high half, the low word the rest
            elif LOW in s and not opt.has_low_word(p):  # saved split, loaded into an FP32 parameter
                p.copy_(join_master(p.detach().to(torch.bfloat16), state.pop(LOW).view(p.shape)))


def check_saved_state(opt: CoatAdamW, position: int, p: torch.Tensor, saved: dict) -> None:
    """Raise unless ``saved`` (p's state in a checkpoint; empty if never stepped) has the fields,
    shapes, dtypes and values the step needs: a wrong one would crash the step or, worse, make
    NaN of p's weights (a NaN k, centre or scale decodes every element of its group to NaN)."""
    if not saved:
        return
    what = describe_param(position, p)
    check_saved_layout(opt, what, p, saved)
    check_saved_values(opt.config, what, saved)


def check_saved_layout(opt: CoatAdamW, what: str, p: torch.Tensor, saved: dict) -> None:
    """Raise unless p's ``saved`` state has exactly the fields the step uses, each a tensor of the
    dtype and shape the step expects (a state of another parameter, or truncated, has not)."""
    mismatch = (
        "the checkpoint's states do not belong to these parameters: build CoatAdamW with the parameters it was "
        "saved from, in the same order and groups"
    )
    groups = -(-p.numel() // opt.config.optimizer_group_size)
    expected = {"step": None}
    for moment in MOMENTS:
        expected[f"{moment}.codes"] = (torch.uint8, tuple(p.shape))
        expected[f"{moment}.scale"] = (torch.float32, (groups,))
        if opt.moment_format(moment)[1]:
            expected[f"{moment}.k"] = expected[f"{moment}.center"] = (torch.float32, (groups,))
    missing = [key for key in expected if key not in saved]
    unknown = [key for key in saved if key not in expected and key != LOW]
    if missing or unknown:
        problems = [f"lacks {', '.join(missing)}"] if missing else []
        problems += [f"has unknown {', '.join(unknown)}"] if unknown else []
        raise ValueError(f"{what}: its saved state {' and '.join(problems)}: {mismatch}")
    if LOW in saved:
        expected[LOW] = (torch.int16, tuple(p.shape))
    for key, layout in expected.items():
        value = saved[key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}: its saved {key} is a {type(value).__name__}, not a tensor: {mismatch}")
        if layout is None:
            continue
        dtype, shape = layout
        if value.dtype != dtype or tuple(value.shape) != shape:
            raise ValueError(
                f"{what}: its saved {key} is {dtype_name(value.dtype)} of shape {tuple(value.shape)}, "
                f"expected {dtype_name(dtype)} of shape {shape}: {mismatch}"
            )


def check_saved_values(config: CoatConfig, what: str, saved: dict) -> None:
    """Raise unless the values of a ``saved`` state of the right layout can be stepped: a whole step
    count, finite positive scales and centres, k within the config's limits, no inf/NaN codes
    (nor negative ones of v)."""
    damaged = "the checkpoint is damaged or was not written by CoatAdamW: load an earlier one"
    step = saved["step"]
    whole = step.numel() == 1 and math.isfinite(float(step)) and float(step) >= 0 and float(step).is_integer()
    if not whole:
        raise ValueError(f"{what}: its saved step is {step.tolist()}, not a whole number of steps: {damaged}")
    for moment in MOMENTS:
        fmt = config.m_format if moment == "exp_avg" else config.v_format
        for name in META:
            value = saved.get(f"{moment}.{name}")
            if value is None:
                continue
            if name == "k":
                bad = ~((value >= config.k_min) & (value <= config.k_max))  # NaN included
                if bad.any():
                    raise ValueError(
                        f"{what}: its saved {moment}.k holds {int(bad.sum())} values outside this config's "
                        f"[k_min, k_max] = [{config.k_min}, {config.k_max}] (e.g. {value[bad][0].item()}): if the checkpoint "
                        f"was written with other limits, load it with a CoatConfig whose k_min/k_max include them; "
                        f"otherwise {damaged}"
                    )
            else:
                bad = ~(value.isfinite() & (value > 0))
                if bad.any():
                    raise ValueError(
                        f"{what}: its saved {moment}.{name} holds {int(bad.sum())} values that are not finite and "
                        f"positive (e.g. {value[bad][0].item()}), which would make NaN of its weights: {damaged}"
                    )
        # E4M3 (fn) has NaN codes only (S.1111.111), E5M2 inf and NaN (S.11111.xx); Adam's v is not negative
        codes = saved[f"{moment}.codes"]
        exponent = 0x7F if fmt == "e4m3" else 0x7C
        bad = (codes & exponent) == exponent
        if moment == "exp_avg_sq":
            bad |= codes > 0x80
        if bad.any():
            raise ValueError(
                f"{what}: its saved {moment}.codes hold {int(bad.sum())} FP8 codes that are inf, NaN"
                + (" or negative" if moment == "exp_avg_sq" else "")
                + f" in {fmt}: {damaged}"
            )


def check_master_source(opt: CoatAdamW, position: int, p: torch.Tensor, saved: dict, masters: Mapping) -> None:
    """Raise unless ``load_state_dict`` can set p's master weight exactly from its ``saved``
    state (empty if the checkpoint never stepped p) and ``masters``."""
    what = describe_param(position, p)
    if opt.has_low_word(p) and LOW not in saved and (saved or p in masters):
        master = masters.get(p)
        if master is None:
            raise ValueError(
                f"{what} has a split master weight here, and the checkpoint was saved with FP32 masters, which live in its "
                f"model's FP32 parameters: pass them, load_state_dict(state_dict, masters={{param: saved FP32 parameter}}), "
                f"or load into FP32 parameters"
            )
        if master.dtype != torch.float32 or master.shape != p.shape:
            raise ValueError(
                f"masters gives {what} a {master.dtype} tensor of shape {tuple(master.shape)}: pass the saved FP32 parameter of its shape"
            )
    elif LOW in saved and not opt.has_low_word(p):
        value = p.detach()
        if not torch.equal(value.to(torch.bfloat16).to(value.dtype), value):
            raise ValueError(
                f"{what} is its own FP32 master here, and the checkpoint split its master into the model's BF16 weight and a "
                f"low word: the parameter must hold that BF16 weight to be joined with it, and holds other values. Load the "
                f"model's state dict first, then the optimizer's"
            )


def fp32_state_dict(opt: CoatAdamW) -> dict:
    """This optimizer's state as torch.optim.AdamW would hold it (FP32 exp_avg, exp_avg_sq):
    ``torch.optim.AdamW(...).load_state_dict(opt.fp32_state_dict())`` continues the run."""
    refuse_split_masters(opt, "fp32_state_dict")
    sd = torch.optim.Optimizer.state_dict(opt)
    params = [p for group in opt.param_groups for p in group["params"]]
    state = {}
    for index, s in sd["state"].items():
        p = params[index]
        state[index] = {"step": s["step"].clone(), **fp32_moments(opt, p)}
    sd["state"] = state
    for group in sd["param_groups"]:
        group.update(foreach=None, capturable=False, differentiable=False, fused=None)
    return sd


def load_fp32_state_dict(opt: CoatAdamW, state_dict: dict) -> None:
    """Load a torch.optim.AdamW state dict (FP32 exp_avg / exp_avg_sq), quantizing the moments."""
    refuse_split_masters(opt, "load_fp32_state_dict")
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(groups, opt.param_groups)
    ):
        raise ValueError(
            "the AdamW state dict has other param groups than this optimizer; build CoatAdamW with the same params"
        )
    params = [p for group in opt.param_groups for p in group["params"]]
    index_of = {i: params[j] for j, i in enumerate(i for g in groups for i in g["params"])}
    for mine, theirs in zip(opt.param_groups, groups):
        for key, value in theirs.items():
            if key in ("lr", "betas", "eps", "weight_decay", "initial_lr"):
                mine[key] = value
    for index, s in state_dict["state"].items():
        p = index_of[index]
        for moment in MOMENTS:
            opt.set_moment(p, moment, s[moment])
        opt.state[p]["step"] = torch.tensor(float(s["step"]), dtype=torch.float32)


def fp32_moments(opt: CoatAdamW, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """p's moments dequantized: {"exp_avg": FP32 tensor of p's shape, "exp_avg_sq": the same}."""
    return {
        moment: dequantize_expanded(opt.moment(p, moment), exact_math=opt.exact_math, backend=opt.backend).view(p.shape)
        for moment in MOMENTS
    }


def refuse_split_masters(opt: CoatAdamW, what: str) -> None:
    """Refuse where a master weight is split (a BF16 param with a low word): FP32 params are
    their own masters under either setting."""
    if opt.split_masters and any(p.dtype == torch.bfloat16 for group in opt.param_groups for p in group["params"]):
        raise ValueError(
            f"{what}: torch.optim.AdamW on these BF16 parameters has no FP32 master weights to carry split ones; "
            f"read them with master_weight(p), or train FP32 parameters (their own masters; Megatron: save a fully_reshardable checkpoint)"
        )


def describe_param(position: int, p: torch.Tensor) -> str:
    """How errors name a parameter: its index in the state dict (param groups in order), shape and dtype."""
    return f"parameter {position} ({tuple(p.shape)}, {dtype_name(p.dtype)})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
