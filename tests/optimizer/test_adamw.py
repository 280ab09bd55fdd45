import copy
import io

import pytest
import torch
from tiny_lm import TinyGPT, text_tokens, train
from torch import nn

from coat_kernels import dequantize_expanded
from coat_megatron import CoatConfig
from coat_megatron.optimizer import CoatAdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# The regression problem at 3e-3 sits at the edge of stability once learned: torch's own AdamW spikes
# near step 140 on some seeds (2 of 81 sampled), where the two curves' spikes differ in time and the
# pointwise gap passed 1%. At 2e-3 it is learned as well (81 of 81) without the late spikes: worst
# gap 0.13% of the initial loss over those seeds.
REGRESSION_HYPER = dict(HYPER, lr=2e-3)


def regression_problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=g)
    w = torch.randn(64, 1, generator=g)
    y = torch.tanh(x @ w / 8) + 0.01 * torch.randn(512, 1, generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 1))
    return model, x, y


def fit(model, optimizer, x, y, steps, scheduler=None, start=0):
    losses = []
    for i in range(start, start + steps):
        batch = slice((i * 64) % 512, (i * 64) % 512 + 64)
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def states_equal(a: CoatAdamW, b: CoatAdamW) -> bool:
    for pa, pb in zip(
        [p for g in a.param_groups for p in g["params"]], [p for g in b.param_groups for p in g["params"]]
    ):
        sa, sb = a.state[pa], b.state[pb]
        if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
            return False
    return True


def test_regression_loss_curve_matches_torch_adamw(seed):
    model, x, y = regression_problem(seed)
    reference = copy.deepcopy(model)
    coat = fit(model, CoatAdamW(model.parameters(), **REGRESSION_HYPER), x, y, 150)
    fp32 = fit(reference, torch.optim.AdamW(reference.parameters(), **REGRESSION_HYPER), x, y, 150)
    assert fp32[-1] < 0.05 * fp32[0] and coat[-1] < 0.05 * coat[0]  # the problem is learned
    gap = [abs(a - b) / fp32[0] for a, b in zip(coat, fp32)]  # in units of the initial loss
    assert max(gap) < 0.01 and sum(gap[-20:]) / 20 < 0.004, (max(gap), sum(gap[-20:]) / 20)


def test_tiny_gpt_loss_curve_matches_torch_adamw(seed):
    data = text_tokens()
    torch.manual_seed(seed)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    coat = train(model, CoatAdamW(model.parameters(), **HYPER), data, 80, seed=seed)
    fp32 = train(reference, torch.optim.AdamW(reference.parameters(), **HYPER), data, 80, seed=seed)
    assert fp32[-1] < 0.65 * fp32[0]  # from ln(128) = 4.85 towards character statistics
    gap = [abs(a - b) for a, b in zip(coat, fp32)]
    assert max(gap) < 0.05 and sum(gap[-20:]) / 20 < 0.02, (max(gap), sum(gap[-20:]) / 20)


def test_state_dict_resume_is_bit_exact(seed):
    model, x, y = regression_problem(seed)
    straight = copy.deepcopy(model)
    opt_straight = CoatAdamW(straight.parameters(), **HYPER)
    fit(straight, opt_straight, x, y, 10)

    opt = CoatAdamW(model.parameters(), **HYPER)
    fit(model, opt, x, y, 6)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed, _, _ = regression_problem(seed + 1)  # other weights: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt_resumed = CoatAdamW(resumed.parameters(), **HYPER)
    opt_resumed.load_state_dict(saved["opt"])
    assert all(t.dtype == torch.uint8 for s in opt_resumed.state.values() for k, t in s.items() if k.endswith(".codes"))
    fit(resumed, opt_resumed, x, y, 4, start=6)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert states_equal(opt_straight, opt_resumed)


SHAPES = [(300,), (64, 130)]  # ragged last groups of 128


def masters_optimizer(kind: str, masters: list[torch.Tensor]) -> tuple[list[nn.Parameter], CoatAdamW]:
    """FP32 parameters that are their own masters ("fp32"), or BF16 ones with split masters
    ("split"), starting from the FP32 ``masters``."""
    if kind == "fp32":
        params = [nn.Parameter(m.clone()) for m in masters]
        return params, CoatAdamW(params, config=CoatConfig(master_weights="fp32"), **HYPER)
    params = [nn.Parameter(torch.zeros(m.shape, dtype=torch.bfloat16)) for m in masters]
    opt = CoatAdamW(params, **HYPER)  # split masters: the default
    for p, m in zip(params, masters):
        opt.set_master_weight(p, m)
    return params, opt


def step_with(opt: CoatAdamW, params: list[nn.Parameter], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One step with FP32 ``grads`` (a BF16 parameter takes its FP32 gradient as ``decoupled_grad``,
    as under Megatron); returns the FP32 master weights after it."""
    for p, g in zip(params, grads):
        if p.dtype == torch.bfloat16:
            p.decoupled_grad = g.clone()
        else:
            p.grad = g.clone()
    opt.step()
    return [opt.master_weight(p).clone() for p in params]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


def adam_states(opt: CoatAdamW, params: list[nn.Parameter]) -> list[dict]:
    return [{k: t for k, t in opt.state[p].items() if k != "master_low"} for p in params]


@pytest.mark.parametrize("saved_as", ["fp32", "split"])
def test_checkpoints_move_between_fp32_and_split_masters_and_step_on_bit_exactly(seed, saved_as):
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(shape, generator=g) * 0.1 for shape in SHAPES]
    grads = [[torch.randn(shape, generator=g) * 1e-2 for shape in SHAPES] for _ in range(4)]
    params, opt = masters_optimizer(saved_as, start)
    for step_grads in grads[:3]:
        step_with(opt, params, step_grads)
    buffer = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buffer)
    assert any((m != m.bfloat16().float()).any() for m in [opt.master_weight(p) for p in params])  # rounding would show
    expected = step_with(opt, params, grads[3])

    for load_as in ("fp32", "split"):
        buffer.seek(0)
        saved = torch.load(buffer)
        loaded, opt_loaded = masters_optimizer(load_as, [torch.randn(shape, generator=g) for shape in SHAPES])
        if load_as != saved_as:  # the checkpoint lacks what this optimizer needs: refused, nothing loaded
            needs = "masters=" if load_as == "split" else "Load the model's state dict first"
            with pytest.raises(ValueError, match=needs):
                opt_loaded.load_state_dict(saved["opt"])
        with torch.no_grad():  # the model's state dict first (a BF16 model rounds FP32 weights to nearest even)
            for p, w in zip(loaded, saved["model"]):
                p.copy_(w)
        masters = dict(zip(loaded, saved["model"])) if saved_as == "fp32" else None
        opt_loaded.load_state_dict(saved["opt"], masters=masters)
        assert [p.dtype for p in loaded] == [torch.float32 if load_as == "fp32" else torch.bfloat16] * len(SHAPES)
        assert ("master_low" in opt_loaded.state[loaded[0]]) == (load_as == "split")
        # the state tensors keep their dtypes and bytes (torch's load would cast them to BF16)
        for mine, theirs in zip(adam_states(opt_loaded, loaded), saved["opt"]["state"].values()):
            assert all(torch.equal(mine[k], theirs[k]) and mine[k].dtype == theirs[k].dtype for k in mine)
        assert same_bits(step_with(opt_loaded, loaded, grads[3]), expected), (saved_as, load_as)
        assert all(
            all(torch.equal(a[k], b[k]) for k in a)
            for a, b in zip(adam_states(opt_loaded, loaded), adam_states(opt, params))
        )


def test_loading_fp32_masters_into_split_ones_checks_the_masters_given():
    fp32_params, fp32_opt = masters_optimizer("fp32", [torch.randn(shape) for shape in SHAPES])
    step_with(fp32_opt, fp32_params, [torch.randn(shape) for shape in SHAPES])
    params, opt = masters_optimizer("split", [torch.zeros(shape) for shape in SHAPES])
    with pytest.raises(ValueError, match=r"parameter 1 \(\(64, 130\), bfloat16\) has a split master weight here"):
        opt.load_state_dict(fp32_opt.state_dict(), masters={params[0]: fp32_params[0].detach()})
    with pytest.raises(ValueError, match="pass the saved FP32 parameter of its shape"):
        opt.load_state_dict(
            fp32_opt.state_dict(), masters={p: w.detach().bfloat16() for p, w in zip(params, fp32_params)}
        )
    assert all(not opt.state[p]["master_low"].any() for p in params)  # refused before anything was loaded


def test_param_groups_and_lr_schedule_follow_torch_adamw(seed):
    model, x, y = regression_problem(seed)
    reference = copy.deepcopy(model)

    def groups(m):
        return [
            {"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
            {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0, "lr": 1e-2},
        ]

    coat = CoatAdamW(groups(model), lr=3e-3, betas=(0.9, 0.95))
    fp32 = torch.optim.AdamW(groups(reference), lr=3e-3, betas=(0.9, 0.95))
    warmup = lambda step: min(1.0, (step + 1) / 20)  # noqa: E731
    fit(model, coat, x, y, 60, torch.optim.lr_scheduler.LambdaLR(coat, warmup))
    fit(reference, fp32, x, y, 60, torch.optim.lr_scheduler.LambdaLR(fp32, warmup))
    assert coat.param_groups[1]["lr"] == fp32.param_groups[1]["lr"] == 1e-2
    # each parameter within 15% of FP32 AdamW's, plus a quarter of one step of its group's lr: the
    # output layer's 1-element bias can end near 0, where its own norm is no yardstick (measured
    # over 80 seeds: the weights within 6%, that bias within 0.10 lr, median 0.026 lr)
    for group, ref_group in zip(coat.param_groups, fp32.param_groups):
        for a, b in zip(group["params"], ref_group["params"]):
            assert (a - b).norm() < 0.15 * b.norm() + 0.25 * group["lr"], ((a - b).norm(), b.norm(), group["lr"])
    # lr 0 leaves parameters untouched (decay 1, step size 0), and still advances the states
    before = [p.clone() for p in model.parameters()]
    for group in coat.param_groups:
        group["lr"] = 0.0
    fit(model, coat, x, y, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fp32_export_and_import_move_runs_between_coat_and_torch_adamw(seed):
    model, x, y = regression_problem(seed)
    coat_model = copy.deepcopy(model)
    coat = CoatAdamW(coat_model.parameters(), **HYPER)
    fit(coat_model, coat, x, y, 8)
    exported = coat.fp32_state_dict()
    for p, s in zip(coat_model.parameters(), exported["state"].values()):
        assert s["exp_avg"].dtype == torch.float32 and s["exp_avg"].shape == p.shape
        assert torch.equal(s["exp_avg_sq"].view(-1), dequantize_expanded(coat.moment(p, "exp_avg_sq")).view(-1))
    torch_model = copy.deepcopy(coat_model)
    adamw = torch.optim.AdamW(torch_model.parameters(), **HYPER)
    adamw.load_state_dict(exported)
    assert adamw.state_dict()["state"][0]["step"] == 8
    torch_losses = fit(torch_model, adamw, x, y, 8)
    coat_losses = fit(coat_model, coat, x, y, 8)
    assert max(abs(a - b) / b for a, b in zip(coat_losses, torch_losses)) < 0.05

    # and back: AdamW's FP32 moments, quantized
    back = CoatAdamW(copy.deepcopy(torch_model).parameters(), **HYPER)
    back.load_fp32_state_dict(adamw.state_dict())
    for p_torch, p in zip(torch_model.parameters(), [p for g in back.param_groups for p in g["params"]]):
        s = adamw.state[p_torch]
        m = dequantize_expanded(back.moment(p, "exp_avg")).view(p.shape)
        v = dequantize_expanded(back.moment(p, "exp_avg_sq")).view(p.shape)
        assert ((m - s["exp_avg"]).norm() / s["exp_avg"].norm()) < 0.03
        assert ((v - s["exp_avg_sq"]).norm() / s["exp_avg_sq"].norm()) < 0.03
        assert back.state[p]["step"] == 16


def test_state_bytes_telemetry_and_model_copy():
    params = [nn.Parameter(torch.randn(256, 128)), nn.Parameter(torch.randn(128 * 5))]
    opt = CoatAdamW(params, **HYPER)
    opt.model_params = {p: torch.zeros(p.shape, dtype=torch.bfloat16) for p in params}
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3 * (1 + torch.rand_like(p))
        opt.step()
    numel = sum(p.numel() for p in params)
    assert opt.state_bytes() / numel == 2 + 6 * 4 / 128  # 2.1875 bytes per parameter
    for p, w in opt.model_params.items():
        assert torch.equal(w, p.detach().to(torch.bfloat16))
    t = opt.telemetry()
    assert set(t) == {f"{m}_{s}" for m in "mv" for s in ("k_mean", "k_min", "k_max", "underflow_fraction")} | {
        "skipped_steps"
    }
    assert t["skipped_steps"] == 0
    assert 1 / 16 <= t["m_k_min"] <= t["m_k_mean"] <= t["m_k_max"] <= 16 and t["v_k_mean"] >= 1
    assert 0 <= t["m_underflow_fraction"] < 0.01 and 0 <= t["v_underflow_fraction"] < 0.01
    plain = CoatAdamW([nn.Parameter(torch.randn(1280))], config=CoatConfig(m_expansion=False, v_expansion=False))
    plain.param_groups[0]["params"][0].grad = torch.randn(1280)
    plain.step()
    assert plain.state_bytes() / 1280 == 2 + 2 * 4 / 128
    assert plain.telemetry()["m_k_mean"] == 1.0


def test_triton_kernel_and_reference_give_the_same_run(seed):
    model, x, y = regression_problem(seed)  # 8.5k parameters: a handful of kernel programs per step
    twin = copy.deepcopy(model)
    opt_k = CoatAdamW(model.parameters(), **HYPER, backend="triton")
    opt_r = CoatAdamW(twin.parameters(), **HYPER, backend="reference")
    assert fit(model, opt_k, x, y, 3) == fit(twin, opt_r, x, y, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert states_equal(opt_k, opt_r)


def test_non_finite_grads_are_skipped_by_the_grad_scaler(seed):
    model, x, y = regression_problem(seed)
    opt = CoatAdamW(model.parameters(), **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    fit(model, opt, x, y, 3)
    before = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.mse_loss(model(x[:64]), y[:64])
    opt.zero_grad()
    scaler.scale(loss).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    after = opt.state_dict()
    assert all(
        torch.equal(before["state"][i][k], after["state"][i][k]) for i in before["state"] for k in before["state"][i]
    )


def test_errors_name_the_fix():
    with pytest.raises(TypeError, match="leave master_weights at its default"):
        p = nn.Parameter(torch.randn(10, dtype=torch.bfloat16))
        p.grad = torch.randn_like(p)
        CoatAdamW([p], config=CoatConfig(master_weights="fp32")).step()
    with pytest.raises(
        TypeError, match=r"got torch.float16 of shape \(10,\): convert the model with .float\(\) or .bfloat16\(\)"
    ):
        p = nn.Parameter(torch.randn(10, dtype=torch.float16))
        p.grad = torch.randn_like(p)
        CoatAdamW([p]).step()
    p = nn.Parameter(torch.randn(10))
    p.grad = torch.randn_like(p)
    opt = CoatAdamW([p])
    opt.step()
    other = CoatAdamW([nn.Parameter(torch.randn(10))], config=CoatConfig(v_format="e5m2"))
    with pytest.raises(ValueError, match="matches the checkpoint"):
        other.load_state_dict(opt.state_dict())
    adamw = torch.optim.AdamW([p])
    adamw.step()
    with pytest.raises(ValueError, match="load_fp32_state_dict"):
        opt.load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="amsgrad"):
        CoatAdamW([{"params": [p], "amsgrad": True}]).step()
    # split masters: FP32 params are their own masters and export as ever; BF16 ones cannot
    fp32_split = CoatAdamW([p], config=CoatConfig(master_weights="split"))
    fp32_split.step()
    assert set(fp32_split.fp32_state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    b = nn.Parameter(torch.randn(10, dtype=torch.bfloat16))
    b.grad = torch.randn_like(b)
    bf16_split = CoatAdamW([b], config=CoatConfig(master_weights="split"))
    bf16_split.step()
    with pytest.raises(ValueError, match="master_weight"):
        bf16_split.fp32_state_dict()


@pytest.mark.gpu
def test_tiny_gpt_on_gpu_tracks_torch_fused_adamw(seed):
    # the CUDA default: the fused Triton step with the hardware's exp2/log2, writing BF16 weights
    data = text_tokens().cuda()
    torch.manual_seed(seed)
    model = TinyGPT().cuda()
    reference = copy.deepcopy(model)
    opt = CoatAdamW(model.parameters(), **HYPER)
    opt.model_params = {p: torch.empty(p.shape, dtype=torch.bfloat16, device="cuda") for p in model.parameters()}
    coat = train(model, opt, data, 150, seed=seed)
    fp32 = train(reference, torch.optim.AdamW(reference.parameters(), **HYPER, fused=True), data, 150, seed=seed)
    gap = [abs(a - b) for a, b in zip(coat, fp32)]
    assert fp32[-1] < 0.6 * fp32[0]
    assert max(gap) < 0.08 and sum(gap[-30:]) / 30 < 0.03, (max(gap), sum(gap[-30:]) / 30)
    assert all(torch.equal(w, p.detach().to(torch.bfloat16)) for p, w in opt.model_params.items())
    assert opt.state_bytes() <= 2.2 * sum(p.numel() for p in model.parameters())
    t = opt.telemetry()
    assert 1 <= t["v_k_mean"] <= 16 and t["m_underflow_fraction"] < 0.01
