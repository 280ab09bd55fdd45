"""CoatAdamW never silently corrupts: an unusable gradient skips (or refuses) the whole step, and
``load_state_dict`` refuses a state the step could not use, naming the parameter and the field."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from coat_megatron import CoatConfig
from coat_megatron.optimizer import CoatAdamW

HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# parameter 0 FP32 (its own master), 1 BF16 with an FP32 .decoupled_grad (as under Megatron), 2 BF16
# with a BF16 .grad; 1 and 2 have split masters. Ragged last groups of 128.
SHAPES = [(300,), (64, 130), (200,)]
WHERE = [(5,), (3, 7), (150,)]  # the element made unusable in each


def make(seed: int, config: CoatConfig | None = None, **kwargs) -> tuple[list[nn.Parameter], CoatAdamW]:
    g = torch.Generator().manual_seed(seed)
    fp32_masters = config is not None and config.master_weights == "fp32"
    dtypes = [torch.float32] * 3 if fp32_masters else [torch.float32, torch.bfloat16, torch.bfloat16]
    params = [nn.Parameter((torch.randn(shape, generator=g) * 0.1).to(dtype)) for shape, dtype in zip(SHAPES, dtypes)]
    return params, CoatAdamW(params, **HYPER, config=config, **kwargs)


def gradients(seed: int, steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    return [[torch.randn(shape, generator=g) * 1e-2 for shape in SHAPES] for _ in range(steps)]


def set_grads(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    params[0].grad = grads[0].clone()
    if params[1].dtype == torch.bfloat16:
        params[1].decoupled_grad = grads[1].clone()
    else:
        params[1].grad = grads[1].clone()
    params[2].grad = grads[2].to(params[2].dtype)


def with_bad(grads: list[torch.Tensor], where: int, value: float) -> list[torch.Tensor]:
    grads = [g.clone() for g in grads]
    grads[where][WHERE[where]] = value
    return grads


def snapshot(opt: CoatAdamW, params: list[nn.Parameter]) -> dict:
    """Weights and every state tensor, copied."""
    return {
        "weights": [p.detach().clone() for p in params],
        "states": [{k: t.clone() for k, t in opt.state[p].items()} if p in opt.state else None for p in params],
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_layout = a.dtype == b.dtype and a.shape == b.shape
    return same_layout and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same(a: dict, b: dict) -> None:
    assert all(same_bits(x, y) for x, y in zip(a["weights"], b["weights"]))
    for sa, sb in zip(a["states"], b["states"]):
        assert (sa is None) == (sb is None)
        if sa is not None:
            assert sa.keys() == sb.keys()
            assert all(same_bits(sa[k], sb[k]) for k in sa), [k for k in sa if not same_bits(sa[k], sb[k])]


# ---------------------------------------------------------------------------------- gradients


BAD = [
    (1, math.nan, r"parameter 1 \(\(64, 130\), bfloat16\) holds inf or NaN"),
    (2, math.inf, r"parameter 2 \(\(200,\), bfloat16\) holds inf or NaN"),
    (0, -math.inf, r"parameter 0 \(\(300,\), float32\) holds inf or NaN"),
    # finite, but its square overflows v in FP32: the same NaN group one step later if let in
    (1, 1e20, r"parameter 1 \(\(64, 130\), bfloat16\) holds 1e\+20 \(2\^63 or more"),
]


@pytest.mark.parametrize("stepped_before", [0, 2])
@pytest.mark.parametrize("where, bad, named", BAD)
def test_unusable_gradient_skips_the_whole_step_as_if_it_never_came(seed, stepped_before, where, bad, named):
    params, opt = make(seed)
    twin_params, twin = make(seed)  # never sees the bad steps
    clean = gradients(seed, stepped_before + 1)
    for grads in clean[:stepped_before]:
        for ps, o in ((params, opt), (twin_params, twin)):
            set_grads(ps, grads)
            o.step()
    before = snapshot(opt, params)
    set_grads(params, with_bad(clean[stepped_before], where, bad))
    with pytest.warns(RuntimeWarning, match=named + r".*no parameter was updated.*nonfinite_grads='raise'"):
        opt.step()
    assert_same(snapshot(opt, params), before)  # weights, m, v, metadata, low words and step counts
    assert len(opt.state) == (3 if stepped_before else 0)  # no state allocated by a skipped first step
    assert opt.skipped_steps == 1 and opt.telemetry()["skipped_steps"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per optimizer: a second skip is counted, not warned
        opt.step()
    assert opt.skipped_steps == 2 and opt.telemetry()["skipped_steps"] == 2
    assert_same(snapshot(opt, params), before)

    set_grads(params, clean[stepped_before])
    opt.step()
    set_grads(twin_params, clean[stepped_before])
    twin.step()
    assert_same(snapshot(opt, params), snapshot(twin, twin_params))
    assert all(p.isfinite().all() for p in params)
    assert all(int(opt.state[p]["step"]) == stepped_before + 1 for p in params)
    t, t_twin = opt.telemetry(), twin.telemetry()
    assert t.pop("skipped_steps") == 2 and t_twin.pop("skipped_steps") == 0
    assert t == t_twin


def test_raise_mode_raises_names_the_first_bad_gradient_and_changes_nothing(seed):
    params, opt = make(seed, nonfinite_grads="raise")
    twin_params, twin = make(seed)
    clean = gradients(seed, 3)
    for grads in clean[:2]:
        for ps, o in ((params, opt), (twin_params, twin)):
            set_grads(ps, grads)
            o.step()
    before = snapshot(opt, params)
    set_grads(params, with_bad(with_bad(clean[2], 2, math.inf), 1, math.nan))  # parameter 1 comes first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(
            FloatingPointError,
            match=r"parameter 1 \(\(64, 130\), bfloat16\) holds inf or NaN: "
            r"CoatAdamW.step\(\) updated nothing .*nonfinite_grads='skip'",
        ):
            opt.step()
    assert_same(snapshot(opt, params), before)
    assert opt.skipped_steps == 0 and opt.telemetry()["skipped_steps"] == 0
    for ps, o in ((params, opt), (twin_params, twin)):
        set_grads(ps, clean[2])
        o.step()
    assert_same(snapshot(opt, params), snapshot(twin, twin_params))


def test_large_finite_gradients_are_stepped():
    # 5e18 squared is finite, but the L2 norm of 8320 of them overflows: the check must not use it
    params, opt = make(0)
    grads = gradients(0, 1)[0]
    grads[1] = torch.full(SHAPES[1], 5e18)
    set_grads(params, grads)
    before = [p.detach().clone() for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert opt.skipped_steps == 0 and opt.telemetry()["skipped_steps"] == 0
    assert all(not torch.equal(a, p) and p.isfinite().all() for a, p in zip(before, params))
    assert all(opt.state[p]["exp_avg_sq.scale"].isfinite().all() for p in params)


def test_the_nonfinite_grads_option_is_validated():
    with pytest.raises(ValueError, match=r"nonfinite_grads='ignore': use one of 'skip', 'raise'"):
        make(0, nonfinite_grads="ignore")


def test_megatrons_adopted_optimizer_leaves_the_decision_to_megatron():
    # Megatron skips on its found-inf reduced over all ranks; a rank skipping alone would desync
    p = torch.randn(256)
    p.grad = torch.randn(256)
    p.grad[3] = math.nan
    opt = CoatAdamW.adopting([{"params": [p]}], **HYPER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert opt.skipped_steps == 0 and int(opt.state[p]["step"]) == 1


def test_skipping_works_with_the_triton_step(seed):
    params, opt = make(seed, backend="triton")
    twin_params, twin = make(seed, backend="triton")
    clean = gradients(seed, 2)
    for ps, o in ((params, opt), (twin_params, twin)):
        set_grads(ps, clean[0])
        o.step()
    before = snapshot(opt, params)
    set_grads(params, with_bad(clean[1], 1, math.nan))
    with pytest.warns(RuntimeWarning, match=r"parameter 1 \(\(64, 130\), bfloat16\) holds inf or NaN"):
        opt.step()
    assert_same(snapshot(opt, params), before)
    for ps, o in ((params, opt), (twin_params, twin)):
        set_grads(ps, clean[1])
        o.step()
    assert_same(snapshot(opt, params), snapshot(twin, twin_params))


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [math.nan, -math.inf, 1e20])
def test_skipping_on_gpu_with_the_fused_step(seed, bad):
    # the CUDA default (fused Triton step, fast math, a BF16 model copy); the bad element sits at the
    # end of 3M elements, so the check's reduction must carry NaN across the blocks of one tensor
    def build():
        g = torch.Generator().manual_seed(seed)
        params = [
            nn.Parameter(torch.randn(2048, 1536, generator=g).cuda() * 0.1),
            nn.Parameter((torch.randn(1000, generator=g) * 0.1).bfloat16().cuda()),
        ]
        opt = CoatAdamW(params, **HYPER)
        opt.model_params = {params[0]: torch.empty(params[0].shape, dtype=torch.bfloat16, device="cuda")}
        return params, opt

    def grads(step):
        g = torch.Generator().manual_seed(seed + step)
        fp32, bf16 = torch.randn(2048, 1536, generator=g) * 1e-2, torch.randn(1000, generator=g) * 1e-2
        return [fp32.cuda(), bf16.bfloat16().cuda()]

    def step(params, opt, gs):
        for p, grad in zip(params, gs):
            p.grad = grad.clone()
        opt.step()

    (params, opt), (twin_params, twin) = build(), build()
    for ps, o in ((params, opt), (twin_params, twin)):
        step(ps, o, grads(1))
    before = snapshot(opt, params)
    model_copy = opt.model_params[params[0]].clone()
    bad_grads = grads(2)
    bad_grads[0][-1, -3] = bad
    with pytest.warns(RuntimeWarning, match=r"parameter 0 \(\(2048, 1536\), float32\) holds"):
        step(params, opt, bad_grads)
    assert_same(snapshot(opt, params), before)
    assert same_bits(opt.model_params[params[0]], model_copy)
    for ps, o in ((params, opt), (twin_params, twin)):
        step(ps, o, grads(2))
    assert_same(snapshot(opt, params), snapshot(twin, twin_params))
    assert opt.skipped_steps == 1 and all(p.isfinite().all() for p in params)


# ---------------------------------------------------------------------------------- checkpoints


def saved_state(seed: int, config: CoatConfig | None = None) -> tuple[dict, list[nn.Parameter], CoatAdamW]:
    params, opt = make(seed, config)
    for grads in gradients(seed, 2):
        set_grads(params, grads)
        opt.step()
    return copy.deepcopy(opt.state_dict()), params, opt


def _set(index, key, value):
    def edit(state):
        state[index][key] = value(state[index][key])

    return edit


def _poke(index, key, at, value):
    def edit(state):
        state[index][key].view(-1)[at] = value

    return edit


def _swap(state):
    state[0], state[2] = state[2], state[0]


def _drop(state):
    del state[0]["exp_avg.center"]


P0 = r"parameter 0 \(\(300,\), float32\): its saved "
P1 = r"parameter 1 \(\(64, 130\), bfloat16\): its saved "
P2 = r"parameter 2 \(\(200,\), bfloat16\): its saved "
NOT_FINITE = r" holds 1 values that are not finite and positive"
BAD_STATES = {
    "truncated codes": (
        _set(1, "exp_avg.codes", lambda t: t.reshape(-1)[:-5]),
        P1 + r"exp_avg.codes is uint8 of shape \(8315,\), expected uint8 of shape \(64, 130\)",
    ),
    "float32 codes": (
        _set(0, "exp_avg_sq.codes", lambda t: t.float()),
        P0 + r"exp_avg_sq.codes is float32 of shape \(300,\), expected uint8 of shape \(300,\)",
    ),
    "truncated scale": (
        _set(1, "exp_avg.scale", lambda t: t[:-1]),
        P1 + r"exp_avg.scale is float32 of shape \(64,\), expected float32 of shape \(65,\)",
    ),
    "int32 low word": (
        _set(2, "master_low", lambda t: t.int()),
        P2 + r"master_low is int32 of shape \(200,\), expected int16 of shape \(200,\)",
    ),
    "swapped parameters": (_swap, P0 + r"exp_avg.codes is uint8 of shape \(200,\), expected uint8 of shape \(300,\)"),
    "missing field": (_drop, P0 + r"state lacks exp_avg.center: the checkpoint's states do not belong"),
    "NaN k": (
        _poke(0, "exp_avg.k", 1, math.nan),
        P0 + r"exp_avg.k holds 1 values outside this config's \[k_min, k_max\] = \[0.0625, 16.0\] \(e.g. nan\)",
    ),
    "k above k_max": (
        _poke(1, "exp_avg_sq.k", 0, 32.0),
        P1 + r"exp_avg_sq.k holds 1 values outside this config's \[k_min, k_max\] = \[0.0625, 16.0\] "
        r"\(e.g. 32.0\): if the checkpoint was written with other limits",
    ),
    "NaN center": (_poke(2, "exp_avg_sq.center", 0, math.nan), P2 + "exp_avg_sq.center" + NOT_FINITE),
    "NaN scale": (_poke(1, "exp_avg.scale", 3, math.nan), P1 + "exp_avg.scale" + NOT_FINITE),
    "inf scale": (_poke(0, "exp_avg_sq.scale", 2, math.inf), P0 + "exp_avg_sq.scale" + NOT_FINITE),
    "zero center": (_poke(0, "exp_avg.center", 0, 0.0), P0 + "exp_avg.center" + NOT_FINITE),
    "NaN code": (_poke(0, "exp_avg.codes", 7, 0x7F), P0 + r"exp_avg.codes hold 1 FP8 codes that are inf, NaN in e4m3"),
    "negative v": (
        _poke(1, "exp_avg_sq.codes", 9, 0x85),
        P1 + "exp_avg_sq.codes hold 1 FP8 codes that are inf, NaN or negative in e4m3",
    ),
    "NaN step": (_set(0, "step", lambda t: torch.tensor(math.nan)), P0 + r"step is nan, not a whole number of steps"),
}


@pytest.mark.parametrize("variant", list(BAD_STATES))
def test_a_state_the_step_cannot_use_is_refused_at_load_naming_parameter_and_field(variant):
    edit, message = BAD_STATES[variant]
    saved, _, _ = saved_state(0)
    edit(saved["state"])
    params, opt = make(1)
    weights = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved)
    assert len(opt.state) == 0 and all(same_bits(a, p.detach()) for a, p in zip(weights, params))  # nothing loaded


def test_the_nan_k_refused_at_load_would_have_made_nan_weights():
    # why k, centre and scale are checked: a NaN one decodes its whole group to NaN at the next step
    _, params, opt = saved_state(0)
    opt.state[params[0]]["exp_avg.k"][1] = math.nan
    set_grads(params, gradients(0, 3)[2])
    opt.step()
    assert params[0][128:256].isnan().all() and params[0][:128].isfinite().all()


CONFIGS = {
    "default": None,
    "fp32 masters": CoatConfig(master_weights="fp32"),
    "expansion off": CoatConfig(m_expansion=False, v_expansion=False),
    "e5m2 v": CoatConfig(v_format="e5m2"),
    "k in [1, 4]": CoatConfig(k_min=1.0, k_max=4.0),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_valid_states_still_load_and_continue_bit_exactly(config):
    config = CONFIGS[config]
    saved, params, opt = saved_state(0, config)
    loaded_params, loaded = make(1, config)
    with torch.no_grad():  # the model's state dict first
        for mine, theirs in zip(loaded_params, params):
            mine.copy_(theirs)
    loaded.load_state_dict(saved)
    assert_same(snapshot(loaded, loaded_params), snapshot(opt, params))
    for ps, o in ((params, opt), (loaded_params, loaded)):
        set_grads(ps, gradients(0, 3)[2])
        o.step()
    assert_same(snapshot(loaded, loaded_params), snapshot(opt, params))


def test_never_stepped_states_still_load():
    params, opt = make(0)
    opt.init_states()  # step 0, zero codes (as Megatron allocates them before loading)
    params[2].grad = gradients(0, 1)[0][2].bfloat16()
    opt.step()  # parameters 0 and 1 at step 0, parameter 2 at step 1
    saved = copy.deepcopy(opt.state_dict())
    loaded_params, loaded = make(0)
    loaded.load_state_dict(saved)
    with torch.no_grad():
        loaded_params[2].copy_(params[2])
    assert_same(snapshot(loaded, loaded_params), snapshot(opt, params))
    no_state, fresh = make(0)
    del saved["state"][1]  # a parameter the checkpoint never stepped has no state at all
    fresh.load_state_dict(saved)
    assert not fresh.state[no_state[1]] and int(fresh.state[no_state[0]]["step"]) == 0
