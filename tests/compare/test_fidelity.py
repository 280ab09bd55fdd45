"""coat_compare.fidelity: the fake quantizers are COAT's arithmetic, the update is AdamW's, and on the
tiny preset the table orders the configurations as their numerics say (deterministic on a CPU)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from coat_compare import fidelity as F


def test_per_tensor_fake_quantization_is_exact_on_codes_and_saturates_when_delayed():
    x = torch.tensor([0.0, 1.0, -2.0, 448.0, 3.0])
    assert torch.equal(F.fake_quantize(x, "e4m3"), x)  # every value a code at scale 1
    assert torch.equal(F.fake_quantize(torch.zeros(4), "e5m2"), torch.zeros(4))  # amax 0: scale 1, zeros
    small = F.fake_quantize(x, "e4m3", amax=torch.tensor(224.0))  # an older, smaller amax: 448 saturates
    assert small[3] == 224.0 and small[1] == 1.0
    g = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))
    err = (F.fake_quantize(g, "e5m2") - g).norm() / g.norm()
    assert 0.01 < err < 0.1  # E5M2: 2 mantissa bits


def test_group_fake_quantization_is_coats_quantizer():
    from coat_kernels.per_group import dequantize_per_group_reference, quantize_per_group_reference

    x = torch.randn(6, 3, 32, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 3, 32)
    q, s = quantize_per_group_reference(x.reshape(-1, 32), 16, "e4m3")
    expected = dequantize_per_group_reference(q, s, 16, torch.float32).view(x.shape)
    assert torch.equal(F.fake_quantize_groups(x, 16), expected)
    assert torch.equal(F.fake_quantize_groups(torch.zeros(2, 16)), torch.zeros(2, 16))


def test_the_update_direction_is_adamws():
    gen = torch.Generator().manual_seed(7)
    w, g, m, v = (torch.randn(40, generator=gen) for _ in range(4))
    v = v.abs()
    step, eps = 5, 1e-8
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([p], lr=1.0, betas=F.BETAS, eps=eps, weight_decay=0.0)
    p.grad = g.clone()
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    assert torch.allclose(w - p.detach(), F.adam_direction(m, v, g, step, eps), rtol=1e-5, atol=1e-6)


def test_coats_states_round_trip_within_their_format():
    gen = torch.Generator().manual_seed(9)
    m = torch.randn(3, 200, generator=gen) * 1e-3
    v = torch.rand(3, 200, generator=gen) * 1e-6
    from coat_megatron import CoatConfig

    dm, dv = F.coat_states(m, v, CoatConfig())
    assert dm.shape == m.shape and (dv >= 0).all()
    assert 0 < (dm - m).norm() / m.norm() < 0.02 and 0 < (dv - v).norm() / v.norm() < 0.02


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    done = subprocess.run(
        [sys.executable, "-m", "coat_compare.fidelity", "--preset", "tiny", "--warm-steps", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["config"]: r for r in map(json.loads, (out / "fidelity.jsonl").read_text().splitlines())}
    return rows, (out / "fidelity.md").read_text(), done.stdout


def errors(row, key="gradients"):
    return {c: s["rel_error"] for c, s in row[key].items()}


def test_every_configuration_is_a_row_and_te_is_a_skip_without_it(tiny):
    rows, text, stdout = tiny
    assert list(rows) == [c.name for c in F.CONFIGS]
    te = rows["te-fp8-delayed"]
    assert te["status"] == "skipped" and "TransformerEngine" in te["reason"]
    assert text.strip() in stdout
    ok = [r for r in rows.values() if r["status"] == "ok"]
    assert all(set(r["gradients"]) == set(F.CLASSES) and set(r["update"]) == set(F.UPDATE_CLASSES) for r in ok)


def test_the_reference_is_exact_and_bf16_errs_at_bf16s_scale(tiny):
    rows, _, _ = tiny
    states = rows["alone: FP8 Adam states"]  # the reference's own gradients: no error
    assert all(e == 0 for e in errors(states).values())
    bf16 = errors(rows["bf16"])
    assert all(1e-4 < e < 1e-2 for e in bf16.values()), bf16
    assert rows["bf16"]["update_reference_gradient"]["all"]["rel_error"] == 0  # FP32 states: exact
    assert 0 < states["update"]["all"]["rel_error"] == states["update_reference_gradient"]["all"]["rel_error"]


def test_coat_errs_more_than_bf16_and_its_emulated_gemms_account_for_it(tiny):
    rows, _, _ = tiny
    coat, bf16 = errors(rows["coat (the default)"]), errors(rows["bf16"])
    emulated = errors(rows["emulated: FP8 GEMMs, just-in-time scales"])
    for c in F.CLASSES:
        assert coat[c] > 3 * bf16[c], c
        # the per-tensor FP8 GEMMs alone, emulated on the FP32 reference, reproduce the real recipe
        assert 0.8 < emulated[c] / coat[c] < 1.2, (c, emulated[c], coat[c])
    # the storage parts alone err far less than the GEMMs
    for part in ("alone: norm input stored 1x16", "alone: SwiGLU input stored 1x16"):
        assert all(errors(rows[part])[c] < 0.2 * emulated[c] for c in F.CLASSES), part
    # BF16 gradient buffers touch the weight gradients only
    buffers = errors(rows["alone: BF16 gradient buffers"])
    assert all(buffers[c] == 0 for c in F.CLASSES if c.startswith("dX")) and buffers["dW fc1"] > 0


def test_the_cosines_and_the_verdict_lines_follow_the_errors(tiny):
    rows, text, _ = tiny
    for row in (r for r in rows.values() if r["status"] == "ok"):
        for s in row["gradients"].values():
            if s["rel_error"]:
                assert s["cosine"] <= 1 + 1e-12 and s["cosine"] > 1 - s["rel_error"] ** 2
    assert "- dX fc1: largest alone FP8 output gradients (E5M2 dY)" in text
    # each table cell is a JSON figure in percent
    line = next(li for li in text.splitlines() if li.startswith("| coat (the default) |"))
    cells = [c.strip() for c in line.strip("|").split("|")][1:]
    assert float(cells[0]) == pytest.approx(
        100 * rows["coat (the default)"]["gradients"]["dW qkv"]["rel_error"], rel=1e-2
    )
    assert math.isclose(float(cells[-2]), 100 * rows["coat (the default)"]["update"]["all"]["rel_error"], rel_tol=1e-2)
