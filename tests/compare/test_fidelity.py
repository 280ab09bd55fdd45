"""coat_compare.fidelity: the fake quantizers are COAT's arithmetic, the update is each optimizer's
own step from the same FP32 states, and on the tiny preset the table orders the configurations as
their numerics say (deterministic on a CPU)."""

import json
import subprocess
import sys

import pytest
import torch

from coat_compare import fidelity as F
from coat_megatron import CoatConfig


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


def test_the_fp32_update_is_adamws_step_with_its_signs():
    # one element by hand: fresh states, g = +2: m_hat = 2, v_hat = 4, so w moves by -lr * 2 / (2 + eps)
    # (from w = 0, where the FP32 master rounds nothing away)
    lr, eps = 1e-3, 1e-8
    step = F.adamw_update(torch.zeros(1), torch.tensor([2.0]), torch.zeros(1), torch.zeros(1), 1, lr, eps)
    assert step.item() == pytest.approx(-lr * 2 / (2 + eps), rel=1e-6)  # new - old: a positive gradient lowers w
    # from populated moments after 4 steps: AdamW's closed form (bias-corrected, eps outside the root),
    # up to the FP32 master's rounding (half a unit of |w| <= 0.1: 4e-9)
    gen = torch.Generator().manual_seed(7)
    w, g, m = (torch.randn(40, generator=gen) for _ in range(3))
    w = (w * 0.02).clamp(-0.1, 0.1)
    v = torch.rand(40, generator=gen) * 2
    (b1, b2), n = F.BETAS, 5
    m_hat = (b1 * m + (1 - b1) * g) / (1 - b1**n)
    v_hat = (b2 * v + (1 - b2) * g * g) / (1 - b2**n)
    expected = -lr * m_hat / (v_hat.sqrt() + eps)
    assert torch.allclose(F.adamw_update(w, g, m, v, n, lr, eps), expected, rtol=1e-5, atol=4e-9)


def test_the_fp8_update_is_coats_step_from_the_fp32_states_quantized():
    """COAT's optimizer from the FP32 moments: within its state format's error of FP32 AdamW's
    step, and FP32 AdamW's step from the moments its states hold (their dequantized values)."""
    from coat_megatron.optimizer import CoatAdamW

    gen = torch.Generator().manual_seed(9)
    w, g = torch.randn(3, 200, generator=gen) * 0.02, torch.randn(3, 200, generator=gen) * 1e-3
    m, v = torch.randn(3, 200, generator=gen) * 1e-3, torch.rand(3, 200, generator=gen) * 1e-6
    lr, eps, n = 1e-3, 1e-8, 9
    fp32 = F.adamw_update(w, g, m, v, n, lr, eps)
    fp8 = F.adamw_update(w, g, m, v, n, lr, eps, CoatConfig())
    assert 0 < (fp8 - fp32).norm() / fp32.norm() < 0.03
    held = CoatAdamW([torch.nn.Parameter(w.clone())])  # what the states hold, read back as FP32
    for moment, value in (("exp_avg", m), ("exp_avg_sq", v)):
        held.set_moment(held.param_groups[0]["params"][0], moment, value)
    states = held.fp32_state_dict()["state"][0]
    from_held = F.adamw_update(w, g, states["exp_avg"], states["exp_avg_sq"], n, lr, eps)
    assert torch.allclose(fp8, from_held, rtol=1e-5, atol=1e-10)


def test_configs_are_picked_by_key_and_an_unknown_one_names_the_keys(capsys):
    assert len(F.CONFIG_KEYS) == len(F.CONFIGS) and F.CONFIG_KEYS["coat"].name == "coat (the default)"
    with pytest.raises(SystemExit):
        F.main(["--configs", "bf16,coat-fast"])
    err = capsys.readouterr().err
    assert "unknown coat-fast" in err and "coat-norm-bf16" in err


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
    rows = {r["key"]: r for r in map(json.loads, (out / "fidelity.jsonl").read_text().splitlines())}
    return rows, (out / "fidelity.md").read_text(), done.stdout


def errors(row, key="gradients"):
    return {c: s["rel_error"] for c, s in row[key].items()}


def test_every_configuration_and_class_is_there_and_te_is_a_skip_without_it(tiny):
    rows, text, stdout = tiny
    assert list(rows) == [c.key for c in F.CONFIGS]
    for key in ("te-fp8-delayed", "te-fp8-current"):
        assert rows[key]["status"] == "skipped" and "TransformerEngine" in rows[key]["reason"]
    assert text.strip() in stdout
    ok = [r for r in rows.values() if r["status"] == "ok"]
    assert len(ok) == len(F.CONFIGS) - 2
    for r in ok:
        assert list(r["gradients"]) == list(F.CLASSES) and set(r["update"]) == set(F.UPDATE_CLASSES)
        assert all(s["rel_error"] is not None and s["cosine"] is not None for s in r["gradients"].values())
    worst = rows["coat"]["worst_layer"]  # the tiny preset's 2 layers
    assert set(worst) == set(F.CLASSES) and all(w["layer"] in (0, 1) for w in worst.values())
    assert all(w["rel_error"] >= rows["coat"]["gradients"][c]["rel_error"] for c, w in worst.items())


def test_the_reference_against_itself_is_exact_and_bf16_errs_at_bf16s_scale(tiny):
    rows, _, _ = tiny
    again = rows["fp32"]  # the FP32 reference built and measured again
    for key in ("gradients", "update", "update_reference_gradient"):
        assert all(s == {"rel_error": 0.0, "cosine": 1.0} for s in again[key].values()), again[key]
    bf16 = errors(rows["bf16"])
    assert all(1e-4 < e < 1e-2 for e in bf16.values()), bf16
    assert rows["bf16"]["update_reference_gradient"]["all"]["rel_error"] == 0  # FP32 states: the reference's step
    states = rows["alone-states"]  # the reference's gradients, COAT's FP8 states
    assert all(e == 0 for e in errors(states).values())
    assert 0 < states["update"]["all"]["rel_error"] == states["update_reference_gradient"]["all"]["rel_error"] < 0.05
    # BF16 layers with COAT's optimizer: bf16's gradients, the same states' error with the exact gradient
    opt = rows["coat-opt-states"]
    assert opt["gradients"] == rows["bf16"]["gradients"]
    assert opt["update_reference_gradient"] == states["update_reference_gradient"]


def test_coat_errs_more_than_bf16_and_its_emulated_gemms_account_for_it(tiny):
    rows, _, _ = tiny
    coat, bf16 = errors(rows["coat"]), errors(rows["bf16"])
    emulated = errors(rows["emulated-gemms"])
    for c in F.CLASSES:
        assert 3 * bf16[c] < coat[c] < 0.2, c
        # the per-tensor FP8 GEMMs alone, emulated on the FP32 reference, reproduce the real recipe
        assert 0.8 < emulated[c] / coat[c] < 1.2, (c, emulated[c], coat[c])
        # taking a 1x16 store out of the real recipe leaves its error about as it is
        for key in ("coat-norm-bf16", "coat-swiglu-bf16"):
            assert 0.9 < errors(rows[key])[c] / coat[c] < 1.1, (key, c)
        # the storage parts alone err far less than the GEMMs
        for part in ("alone-norm-store", "alone-swiglu-store"):
            assert errors(rows[part])[c] < 0.1 * emulated[c], (part, c)
    # BF16 gradient buffers touch the weight gradients only
    buffers = errors(rows["alone-bf16-buffers"])
    assert all(buffers[c] == 0 for c in F.CLASSES if c.startswith("dX")) and buffers["dW fc1"] > 0


def test_the_tables_are_the_json_numbers_and_the_verdict_follows_them(tiny):
    rows, text, _ = tiny
    for row in (r for r in rows.values() if r["status"] == "ok"):
        for s in row["gradients"].values():
            if s["rel_error"]:
                assert s["cosine"] <= 1 + 1e-12 and s["cosine"] > 1 - s["rel_error"] ** 2
    assert "- dX fc1: largest alone FP8 output gradients (E5M2 dY)" in text
    # every cell of both tables is a JSON figure: the errors in percent, then the cosines
    by_name = {r["config"]: r for r in rows.values()}
    tables = [[], []]
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| configuration"):
            name = line.strip("|").split("|")[0].strip()
            tables[len(tables[0]) >= len(rows)].append((name, line))
    assert [n for n, _ in tables[0]] == [n for n, _ in tables[1]] == list(by_name)
    for (name, line), (_, cos_line), in zip(*tables):  # fmt: skip
        row = by_name[name]
        if row["status"] != "ok":
            continue
        for metric, cells, scale in (("rel_error", line, 100), ("cosine", cos_line, 1)):
            shown = [c.strip() for c in cells.strip().strip("|").split("|")][1:]
            numbers = [row["gradients"][c][metric] for c in F.CLASSES]
            numbers += [row["update"]["all"][metric], row["update_reference_gradient"]["all"][metric]]
            for cell, number in zip(shown, numbers, strict=True):
                assert float(cell) == pytest.approx(scale * number, rel=1e-2, abs=1e-6), (name, metric)


def test_the_table_in_docs_is_the_committed_measurements():
    """docs/accuracy.md's fidelity table is generated from committed fidelity.jsonl files, named in
    its own 'generated by' line: regenerating it changes nothing."""
    import os
    import re
    from pathlib import Path

    from coat_compare import fidelity

    root = Path(fidelity.DOCS).parent.parent
    text = Path(fidelity.DOCS).read_text()
    command = re.search(r"<!-- generated by: python -m coat_compare.fidelity --docs (.+) -->", text)
    paths = command.group(1).split()
    assert paths and all((root / p).is_file() for p in paths)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert fidelity.write_docs(paths, check=True) == 0, "run the command in docs/accuracy.md's fidelity table"
    finally:
        os.chdir(cwd)


def test_one_rows_file_holds_several_measurements_and_the_docs_show_the_gpus(tmp_path):
    """An evidence folder keeps one fidelity.jsonl: measurements appended to it come back apart (by
    their run's fields, in file order), and the docs leave out a CPU reading of a preset a GPU measured."""
    import json

    from coat_compare import fidelity as F

    def rows(preset, device, n):
        base = {"preset": preset, "layers": None, "seed": 1, "warm_steps": 3, "first_step": 0, "load": None,
                "device": device, "micro_batches": 2, "lr": 1e-3}  # fmt: skip
        return [{**base, "config": f"c{i}", "key": f"c{i}", "status": "skipped", "reason": "r"} for i in range(n)]

    path = tmp_path / "fidelity.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows("tiny", "CPU", 2) + rows("tiny", "H200", 3)
                            + rows("llama2-7b", "H200", 1)))  # fmt: skip
    results = F.read_results(str(path))
    assert [(r["preset"], r["device"], len(r["rows"])) for r in results] == [
        ("tiny", "CPU", 2), ("tiny", "H200", 3), ("llama2-7b", "H200", 1)
    ]  # fmt: skip
    block = F.docs_block([str(path)])
    assert "tiny, initial weights of seed 1, H200" in block and "llama2-7b, initial weights of seed 1, H200" in block
    assert ", CPU (" not in block
