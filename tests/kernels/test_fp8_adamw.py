import copy

import pytest
import torch
from kernel_inputs import as_bytes

from coat_kernels import ExpandedFp8, dequantize_expanded, fp8_adamw_step

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def make_tensors(shapes, m_fmt="e4m3", v_fmt="e4m3", expansion=(True, True), device="cpu", seed=0, group_size=128):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(device) for s in shapes]
    m = [ExpandedFp8.zeros(s, group_size=group_size, fmt=m_fmt, expansion=expansion[0], device=device) for s in shapes]
    v = [
        ExpandedFp8.zeros(s, group_size=group_size, fmt=v_fmt, signed=False, expansion=expansion[1], device=device)
        for s in shapes
    ]
    model = [torch.zeros(s, dtype=torch.bfloat16, device=device) for s in shapes]
    return params, m, v, model


def grads_for(shapes, step, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    # a shared direction plus noise: m and v develop the structure of real training
    return [
        ((torch.randn(s, generator=g) + 0.5) * 1e-2 * torch.exp(torch.randn(s, generator=g))).to(dtype) for s in shapes
    ]


def assert_same(a, b):
    pa, ma, va, wa = a
    pb, mb, vb, wb = b
    for x, y in zip(pa + wa, pb + wb):
        assert torch.equal(x.cpu(), y.cpu()), f"{(x.cpu() != y.cpu()).sum()} of {x.numel()} weights differ"
    for s, r in zip(ma + va, mb + vb):
        assert torch.equal(as_bytes(s.codes), as_bytes(r.codes)), (
            f"{(as_bytes(s.codes) != as_bytes(r.codes)).sum()} codes differ"
        )
        for name in ("scale", "k", "center"):
            x, y = getattr(s, name), getattr(r, name)
            assert (x is None and y is None) or torch.equal(x.cpu(), y.cpu()), name


def to_device(tensors, device):
    params, m, v, model = tensors
    move = lambda t: None if t is None else t.to(device)  # noqa: E731

    def states(ss):
        return [
            ExpandedFp8(
                s.codes.to(device), s.scale.to(device), move(s.k), move(s.center), s.group_size, s.fmt, s.signed
            )
            for s in ss
        ]

    return [p.to(device) for p in params], states(m), states(v), [w.to(device) for w in model]


# ragged sizes, one tensor of a single group, one of a single element, an empty one, and a tensor
# spanning several programs (2048 elements per program)
SHAPES = [(300,), (64, 65), (128,), (1,), (0,), (5000,)]


@pytest.mark.parametrize(
    "m_fmt,v_fmt,expansion",
    [
        ("e4m3", "e4m3", (True, True)),
        ("e4m3", "e5m2", (True, True)),
        ("e4m3", "e4m3", (False, False)),
        ("e5m2", "e4m3", (True, False)),
    ],
)
def test_fused_step_matches_reference_bit_for_bit(device, m_fmt, v_fmt, expansion, seed):
    ref = make_tensors(SHAPES, m_fmt, v_fmt, expansion, seed=seed)
    dut = to_device(copy.deepcopy(ref), device)
    for step in (1, 2, 3):
        grads = grads_for(SHAPES, step, seed)
        u_dut = fp8_adamw_step(
            dut[0],
            [g.to(device) for g in grads],
            dut[1],
            dut[2],
            model_params=dut[3],
            step=step,
            exact_math=True,
            backend="triton",
            **HYPER,
        )
        u_ref = fp8_adamw_step(
            ref[0], grads, ref[1], ref[2], model_params=ref[3], step=step, backend="reference", **HYPER
        )
        assert_same(dut, ref)
        assert torch.equal(u_dut.cpu(), u_ref)
    assert not torch.equal(ref[1][0].codes.view(torch.uint8), torch.zeros(300, dtype=torch.uint8))


def test_bf16_grads_and_no_model_copy(device, seed):
    shapes = [(700,), (129,)]
    ref = make_tensors(shapes, seed=seed)
    dut = to_device(copy.deepcopy(ref), device)
    for step in (1, 2):
        grads = grads_for(shapes, step, seed, torch.bfloat16)
        fp8_adamw_step(
            dut[0], [g.to(device) for g in grads], dut[1], dut[2], step=step, exact_math=True, backend="triton", **HYPER
        )
        fp8_adamw_step(ref[0], grads, ref[1], ref[2], step=step, backend="reference", **HYPER)
    assert_same(dut[:3] + ([],), ref[:3] + ([],))
    assert all((w == 0).all() for w in dut[3])  # no model params given: nothing written


def test_first_step_equals_torch_adamw(seed):
    # At step 1 the update uses the FP32 m and v before quantization, so it is AdamW's up to rounding.
    shapes = [(1000,), (33, 7)]
    params, m, v, model = make_tensors(shapes, seed=seed)
    torch_params = [p.clone().requires_grad_() for p in params]
    grads = grads_for(shapes, 1, seed)
    fp8_adamw_step(params, grads, m, v, model_params=model, step=1, **HYPER)
    opt = torch.optim.AdamW(
        torch_params,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )
    for p, g in zip(torch_params, grads):
        p.grad = g.clone()
    opt.step()
    for p, tp, w in zip(params, torch_params, model):
        assert torch.allclose(p, tp.detach(), rtol=0, atol=4e-7 * p.abs().max().item())
        assert torch.equal(w, p.to(torch.bfloat16))


def test_states_track_fp32_adam_moments_and_expansion_helps(seed):
    """30 steps on grads with a heavy-tailed spread: the dequantized states stay within a few percent
    (relative RMS) of FP32 Adam's, and closer with range expansion than with plain absmax groups.

    Each of 8 tensors of 4096 (32 groups) is judged apart and the median decides: v's relative RMS
    error in one such tensor is set by its few largest groups, so one tensor's expanded/plain ratio
    has a heavy tail. Over 3000 seeds (one tensor each): m's ratio 0.55 (max 0.61), v's 0.66 (99th
    percentile 0.89, 1.5% above 0.85, max 1.51); m's error at most 0.034, v's above 0.035 in 4. The
    median of 8 passes 0.85 only if 4 of 8 do (about 3e-6 a seed)."""
    shapes = [(4096,)] * 8
    m32, v32 = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    runs = {True: make_tensors(shapes, seed=seed), False: make_tensors(shapes, expansion=(False, False), seed=seed)}
    for step in range(1, 31):
        grads = grads_for(shapes, step, seed)
        for params, m, v, _ in runs.values():
            fp8_adamw_step(params, grads, m, v, step=step, **HYPER)
        for m_ref, v_ref, g in zip(m32, v32, grads):
            m_ref.mul_(HYPER["beta1"]).add_(g, alpha=1 - HYPER["beta1"])
            v_ref.mul_(HYPER["beta2"]).addcmul_(g, g, value=1 - HYPER["beta2"])

    def rel(a, b):
        return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()

    def median_errors(run):
        m_err = [rel(dequantize_expanded(q), r) for q, r in zip(run[1], m32)]
        v_err = [rel(dequantize_expanded(q), r) for q, r in zip(run[2], v32)]
        return torch.tensor(m_err), torch.tensor(v_err)

    (m_exp, v_exp), (m_plain, v_plain) = median_errors(runs[True]), median_errors(runs[False])
    assert m_exp.median() < 0.04 and v_exp.median() < 0.035, (m_exp, v_exp)
    m_ratio, v_ratio = (m_exp / m_plain).median(), (v_exp / v_plain).median()
    assert m_ratio < 0.7 and v_ratio < 0.85, (m_ratio, v_ratio)
    assert all(st.k.mean() > 1.5 for st in runs[True][1] + runs[True][2])


def test_arguments_are_checked():
    params, m, v, model = make_tensors([(10,)])
    grads = grads_for([(10,)], 1, 0)
    with pytest.raises(TypeError, match="FP32 master weights"):
        fp8_adamw_step([params[0].bfloat16()], grads, m, v, step=1, **HYPER)
    with pytest.raises(ValueError, match="starts at 1"):
        fp8_adamw_step(params, grads, m, v, step=0, **HYPER)
    with pytest.raises(ValueError, match="same length"):
        fp8_adamw_step(params, grads + grads, m, v, step=1, **HYPER)
    with pytest.raises(ValueError, match="BF16/FP16"):
        fp8_adamw_step(params, grads, m, v, model_params=[torch.zeros(10)], step=1, **HYPER)


@pytest.mark.gpu
def test_large_launch_on_gpu_matches_reference_bit_for_bit_and_allocates_no_fp32_state(seed):
    shapes = [(4096, 4096), (11008 * 3 + 1,), (127,), (4096 * 1024 + 64,)]
    ref = make_tensors(shapes, seed=seed)
    dut = to_device(copy.deepcopy(ref), "cuda")
    numel = sum(p.numel() for p in ref[0])
    for step in (1, 2):
        grads = grads_for(shapes, step, seed)
        g_dut = [g.cuda() for g in grads]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fp8_adamw_step(dut[0], g_dut, dut[1], dut[2], model_params=dut[3], step=step, exact_math=True, **HYPER)
        torch.cuda.synchronize()
        # launch tables and per-program counters only: far below one FP32 copy of m (4 B/param)
        assert torch.cuda.max_memory_allocated() - before < 0.05 * 4 * numel
        fp8_adamw_step(ref[0], grads, ref[1], ref[2], model_params=ref[3], step=step, backend="reference", **HYPER)
        assert_same(dut, ref)


def test_fast_math_step_stays_close_to_the_reference(device, seed):
    """The CUDA default (hardware exp2/log2, division and square root per element): states and weights
    stay within the fast functions' error of the exact reference over several steps. A code that
    flips at a rounding midpoint (about 1 in 10^4) moves its value by one FP8 step, hence the
    bounds: codes one step apart at most and rarely, and weights on average within 1e-4 of one
    update (lr). At worst an element's weight drifts by what one flipped code of m can move: one
    E4M3 step is up to 2^-3 of the value, and the flip lives on in m through the later steps
    (decayed by beta1), so 2^-3 * (1 + beta1 + beta1^2) * lr over three steps. Seen: 0.103 lr
    (seed 1308172787, one element of 30000), at most 0.075 lr over 40 other seeds."""
    from test_expanded import code_steps

    shapes = [(30000,), (129,)]
    ref = make_tensors(shapes, seed=seed)
    dut = to_device(copy.deepcopy(ref), device)
    cat = lambda states, name: torch.cat([getattr(st, name).cpu().reshape(-1) for st in states])  # noqa: E731

    for step in (1, 2, 3):
        grads = grads_for(shapes, step, seed)
        fp8_adamw_step(
            dut[0],
            [g.to(device) for g in grads],
            dut[1],
            dut[2],
            model_params=dut[3],
            step=step,
            exact_math=False,
            backend="triton",
            **HYPER,
        )
        fp8_adamw_step(ref[0], grads, ref[1], ref[2], model_params=ref[3], step=step, backend="reference", **HYPER)
        for moment in (1, 2):  # all tensors' groups together, so that a small tensor weighs little
            k_dut, k_ref = cat(dut[moment], "k"), cat(ref[moment], "k")
            # k (a floor) flips by 1/16 in a group whose ratio is within the fast log2's error of
            # an integer; such a group's codes legitimately differ, and from the next step on so
            # may its dequantized state (by up to one FP8 step): hence "almost all" groups. Such a
            # group's amin (often a small element quantized near the format's bottom) then differs
            # too, so from step 2 on its k may differ by more than one 1/16 step (seen: 1/4)
            same_k = k_dut == k_ref
            assert same_k.float().mean() >= 0.98
            if step == 1:
                assert ((k_dut - k_ref).abs() <= 1 / 16).all()
            # a group's scale comes from its amax and amin. At step 1 (identical inputs) it is the
            # reference's within the fast functions' error wherever k agrees. From step 2 on a group
            # may differ: its state carries an earlier code flip, or its amin is a near-cancellation
            # (beta * m + (1 - beta) * g ~ 0) of a dequantized value that has the fast exp2's error,
            # amplified by k <= 16. Measured over 60 seeds: 0 to 4 of the ~240 groups of m per step
            # (mean 0.8), none of v; the bound (5%) sits far out in that tail.
            s_dut, s_ref = cat(dut[moment], "scale"), cat(ref[moment], "scale")
            close = (s_dut - s_ref).abs() <= 1e-3 * s_ref
            if step == 1:
                assert (close | ~same_k).all(), (~close & same_k).nonzero().flatten()
            assert close.float().mean() >= 0.95, (~close).sum()
            steps = code_steps(cat(dut[moment], "codes"), cat(ref[moment], "codes"))
            if step == 1:  # identical inputs: where k agrees, codes differ only at rounding midpoints
                in_same_k = torch.cat(
                    [
                        (st_d.k.cpu() == st_r.k).repeat_interleave(128)[: st_r.codes.numel()]
                        for st_d, st_r in zip(dut[moment], ref[moment])
                    ]
                )
                steps = steps[in_same_k]
                assert steps.max() <= 1 and (steps > 0).float().mean() <= 2e-3, ((steps > 0).sum(), steps.max())
            else:
                assert (steps > 0).float().mean() <= 0.03, (steps > 0).sum()
    one_flip = 2**-3 * sum(HYPER["beta1"] ** t for t in range(3)) * HYPER["lr"]
    for p_dut, p_ref in zip(dut[0], ref[0]):
        diff = (p_dut.cpu() - p_ref).abs()
        assert diff.max() <= one_flip and diff.mean() <= 1e-4 * HYPER["lr"], (diff.max(), diff.mean())
