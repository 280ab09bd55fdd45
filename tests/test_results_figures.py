"""Figures that recompute, docs/results.md's rows (issue 50, deliverable 6): each figure a row's "figure" cell
quotes is recomputed from the rows of its evidence folder (benchmarks/results/<claim>/rows.jsonl, restored from
git as tests/test_readme_figures.py's are: each source's lines verbatim after a {"kind": "source"} line naming
the commit and path) with the rounding the row uses, and must appear in that cell. A row whose figures no folder
keeps rows for is listed in NO_ROWS with the reason, and its cell says "no rows: rerun or retire"; a row (or the
figures of a row) not recomputed yet is listed in NOT_YET with the reason: its rows are in git history but not in
the folder, or in a report only. So every row of the index is checked or listed. Where a run wrote no rows at all
(Megatron's pretrain(), a report that did not come back), its own log or printout kept in the folder is read
instead. (Five figures quoted a report's rounded figure rounded again, 6018 for 6017.495 say; their text now
quotes what the rows give.)"""

import ast
import gzip
import math
import re
import statistics

import pytest
from load_file import load_file
from test_readme_figures import (
    H200_MODES,
    RESULTS,
    check_index,
    gpt_1b_gaps,
    gpt_1b_runs,
    held,
    highest_after_step_10,
    max_batch_runs,
    one,
    pct,
    pretrain_tokens_per_s,
    results_index_row,
    results_index_rows,
    rows,
    x,
)
from test_readme_figures import INDEX_CHECKED as README_INDEX_CHECKED

MARK = "no rows: rerun or retire"


def sci(value: float) -> str:
    """2.4e-3, as the rows of the layout checks are quoted."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def ablations():
    runs = {r["mode"]: r for _, r in rows("accuracy-gpt-1b-ablations-1gpu") if r["kind"] == "train"}
    assert {(r["seed"], r["steps"], r["global_batch"]) for r in runs.values()} == {(2, 460, 32)}
    gap = {m: r["valid_loss"] / runs["bf16"]["valid_loss"] - 1 for m, r in runs.items()}
    # the parts, each alone: COAT's layers, the optimizer's FP8 states, BF16 gradient buffers; 2% is the bound
    # declared before the runs (commands.txt); COAT's optimizer as a whole (coat-opt) is those parts together
    assert max(gap[m] for m in ("coat-act", "coat-opt-states", "bf16-grads")) < 0.02
    return [
        f"COAT {pct(gap['coat'])}; its layers with Megatron's Adam {pct(gap['coat-act'])}; "
        f"BF16 layers with its optimizer {pct(gap['coat-opt'])}, of which the FP8 states alone "
        f"{pct(gap['coat-opt-states'])}, BF16 gradient buffers alone {pct(gap['bf16-grads'])}; "
        f"TE FP8 delayed {pct(gap['te-fp8-delayed'])}: no part passes 2% alone",
    ]


def full_step_graphs():
    found = [(s, r) for s, r in rows("full-step-graphs-1gpu") if r["kind"] == "train"]
    tiny = {(r["mode"], r["graphs"]): r for s, r in found if "tiny-graphs" in s}
    for mode in ("bf16", "coat"):
        assert tiny[mode, "none"]["status"] == tiny[mode, "local"]["status"] == "ok"
        full = tiny[mode, "full"]
        assert full["status"] == "failed" and "illegal memory access" in full["reason"]
        assert "seq 64 " in full["shape"]
    gpt = {r["mode"]: r for s, r in found if "gpt-1b-bf16-coat" in s and r["graphs"] == "full"}
    assert all(r["status"] == "ok" for r in gpt.values())
    return [
        "dies with an illegal memory access on the tiny preset (seq 64) in BF16 and COAT alike",
        f"gpt-1b trains with it (FP32-master COAT {gpt['coat']['tokens_per_s']:.0f}, "
        f"BF16 {gpt['bf16']['tokens_per_s']:.0f} tokens/s)",
    ]


def gpt_1b_eager():
    found = rows("gpt-1b-eager-1gpu")

    def vs_bf16(source, micro_batches):
        runs = {r["mode"]: r for s, r in found if source in s and r["kind"] == "train"}
        assert {(r["graphs"], r["micro_batches"]) for r in runs.values()} == {("none", micro_batches)}
        return (x(runs[m]["tokens_per_s"] / runs["bf16"]["tokens_per_s"]) for m in ("coat", "coat-cached"))

    one_step, one_cached = vs_bf16("eager-gb4", 1)
    eight, eight_cached = vs_bf16("eager-gb32", 8)
    busy = {r["mode"]: r["gpu_busy_fraction"] for s, r in found if "step_profile" in s}
    return [
        f"the default {one_step} BF16's tokens/s at one micro-batch per step, {eight} at eight "
        f"(`coat-cached` {one_cached}, {eight_cached})",
        f"GPU busy {busy['coat']:.0%} of a step against BF16's {busy['bf16']:.0%}",
    ]


def grad_accumulation():
    by_count = {r["micro_batches"]: r for _, r in rows("grad-accumulation-bf16-cpu")}

    def error(n):
        return f"{100 * by_count[n]['rounding_error']:.2f}%"

    return [
        f"{error(1)} off the FP32 sum at 1 micro-batch, {error(4)} at 4, {error(16)} at 16, {error(64)} at 64",
        "sampling noise " + ", ".join(f"{by_count[n]['sampling_noise']:.0%}" for n in (4, 16, 64)),
    ]


def host_layers():
    """Host us to issue one layer's fwd+bwd at 256 tokens, per mode, on each host."""
    found = rows("host-time-layer-1gpu")

    def layer(source):
        return {r["name"]: r["host_us"] for s, r in found if source in s and r.get("section") == "layer 256 tokens"}

    return layer("lean-h200/host23/"), layer("lean-h200/host23-b/"), layer("lean-h100/host23/")


def host_time():
    found = rows("host-time-layer-1gpu")
    h200, _, h100 = host_layers()
    plans, torch_mm = (one(found, f"gemm-{g}", kind="train", mode="coat") for g in ("auto", "torch"))
    assert plans["graphs"] == torch_mm["graphs"] == "local"
    return [
        f"COAT {h200['coat']:.0f} us against TE FP8 current's {h200['te-fp8-current']:.0f} and",
        f"{h100['coat']:.0f} against {h100['te-fp8-current']:.0f} on an H100 host",
        f"(gpt-1b {plans['tokens_per_s']:.0f} against {torch_mm['tokens_per_s']:.0f} tokens/s)",
    ]


def host_time_second_host():
    _, second, _ = host_layers()
    return [f"{second['coat']:.0f} against {second['te-fp8-current']:.0f} on two H200 hosts"]


def kernel_launches():
    layer = {r["name"]: r for _, r in rows("kernel-launches-layer-1gpu") if r.get("section") == "layer 256 tokens"}
    coat, te = layer["coat"], layer["te-fp8-current"]
    assert all(sum(r["launches_by_kernel"].values()) == r["launches"] for r in (coat, te))
    # the claim's own run (the lean-path GPU test, another shape: other GEMM kernels) printed its counts, not
    # rows: they must be the rows' counts
    printed = (RESULTS / "kernel-launches-layer-1gpu" / "lean-path.log").read_text().splitlines()
    assert printed[0] == f"kernel launches per fwd+bwd: coat {coat['launches']}, te-fp8-current {te['launches']}"
    by_kernel = ast.literal_eval(printed[1].removeprefix("coat: "))
    quantize = "_quantize_per_tensor_kernel"
    assert (sum(by_kernel.values()), by_kernel[quantize]) == (coat["launches"], coat["launches_by_kernel"][quantize])
    return [
        f"the default {coat['launches']} ({coat['launches_by_kernel']['_quantize_per_tensor_kernel']} "
        f"per-tensor quantizations), TE FP8 current {te['launches']}",
    ]


def kernel_bandwidth():
    copy = {
        r["kernel"]: r["of_copy"] for s, r in rows("kernel-bandwidth-1gpu") if "quantize.jsonl" in s and "note" in r
    }
    return [
        f"`quantize_per_group` {copy['quantize_per_group G=16 e4m3']:.2f}",
        f"per-tensor with transpose {copy['quantize_per_tensor e4m3 + transpose, amax from producer']:.2f} "
        "(amax from the producer)",
        f"the byte transpose of W's codes {copy['transpose_codes (tiled byte transpose)']:.2f} "
        f"(torch's strided copy {copy['torch q.view(uint8).t().contiguous()']:.2f})",
    ]


def swiglu_best_tiles():
    """SwiGLU's three kernels, each at its best tile, at both shapes the tile sweep measured."""
    found = [(s, r) for s, r in rows("kernel-bandwidth-1gpu") if "ops" in s and "kernel" in r]
    kernels = ("quantize_swiglu_input ", "swiglu_to_fp8, amax from fc1's pass", "swiglu_backward")
    best = [
        max(r["of_copy"] for s, r in found if s == source and r["kernel"].startswith(k))
        for source in {s for s, _ in found}
        for k in kernels
    ]
    assert len(best) == 6
    # the two shapes the sweep measured: Llama-2-7B's FFN (ops.py's default) and gpt-1b's (sweep23/1b), on an H100
    assert {r["gpu"] for _, r in found} == {"NVIDIA H100 80GB HBM3"}
    shapes = sorted(s.split("/", 3)[-1] for s in {s for s, _ in found})
    assert shapes == ["h100/ops-llama2-7b.jsonl", "sweep23/1b/ops.jsonl"], shapes
    return [f"SwiGLU's kernels {min(best):.2f}-{max(best):.2f} at their best tiles (H100, 8192 tokens"]


def layouts():
    found = rows("layouts-gpt-1b-4gpu")

    def runs(source):
        return {(r["mode"], r["layout"]): r for s, r in found if source in s and r["kind"] == "layout"}

    first, det, tp2xdp2 = runs("tp2-pp2-dp2"), runs("layouts-det"), runs("tp2xdp2")
    bf16, coat = ([first[m, layout] for layout in ("tp2", "pp2", "dp2")] for m in ("bf16", "coat"))
    assert all(r["agrees"] for r in bf16) and not any(r["agrees"] for r in coat)
    assert len(det["coat", "1"]["losses"]) == 30 and det["coat", "pp2"]["losses"] == det["coat", "1"]["losses"]
    te, coat_tp2xdp2, bf16_tp2xdp2 = (tp2xdp2[m, "tp2xdp2"]["drift"] for m in ("te-fp8-current", "coat", "bf16"))
    return [
        f"BF16 at TP 2, PP 2, DP 2 agrees (at most {max(r['drift'] for r in bf16):.3f})",
        f"COAT misses ({min(r['drift'] for r in coat):.2f}-{max(r['drift'] for r in coat):.2f} apart",
        f"TP 2's first step {sci(first['coat', 'tp2']['first_step_relative'])})",
        f"COAT at PP 2 equals one GPU bit for bit over 30 steps, DP 2 {det['coat', 'dp2']['drift']:.3f} apart",
        f"TE misses by as much as COAT ({te:.3f} against {coat_tp2xdp2:.3f}; BF16 {bf16_tp2xdp2:.3f})",
    ]


def resume():
    run = one(rows("layouts-gpt-1b-4gpu"), "resume-tp2dp2", kind="resume", mode="coat")
    assert (run["saved_at"], run["checkpoint_format"]) == ("tp2xdp2", "fully_reshardable")
    diff = {at: sci(run[f"max_abs_diff_resumed_{at}"]) for at in ("dp4", "1", "tp2xdp2")}
    return [
        f"at DP 4 at most {diff['dp4']} from the uninterrupted losses, on one GPU {diff['1']}, "
        f"at TP 2 x DP 2 {diff['tp2xdp2']} (fully_reshardable",
    ]


def mlp_block():
    block = {r["mode"]: r for _, r in rows("mlp-block-llama2-7b-1gpu") if "mode" in r}
    coat, bf16, te = (block[m] for m in ("COAT", "BF16 (torch ops)", "TE LayerNormMLP FP8 current"))
    assert (
        round(block["TE LayerNormMLP FP8 delayed"]["saved_MiB"]) == round(te["saved_MiB"]) == round(bf16["saved_MiB"])
    )
    recomputed = block["COAT, norm output recomputed for wgrad"]["saved_MiB"]
    return [
        f"{coat['saved_MiB']:.0f} MiB kept for backward against {bf16['saved_MiB']:.0f} for BF16 and TE's FP8 "
        f"`LayerNormMLP` ({x(coat['saved_MiB'] / te['saved_MiB'])}), {x(coat['ms'] / te['ms'])} TE FP8 current's "
        f"time; {recomputed:.0f} MiB with the norm output recomputed",
    ]


def state_drift():
    found = [r for _, r in rows("optimizer-state-drift-cpu")]
    last = {r["candidate"]: r for r in found if r["step"] == 400}
    default = last["COAT default: 1x128 E4M3 + expansion, nearest"]
    drift, one_shot = default["rel_l2_error_u"], default["one_shot_coat"]
    per_tensor = [r["rel_l2_error_u"] for r in found if r["candidate"].startswith("per-tensor E4M3")]
    return [
        f"update-direction error {drift:.3f} at step 400 ({drift / one_shot:.1f}x the one-shot {one_shot:.3f})",
        f"stochastic rounding {last['COAT, stochastic rounding of m and v']['rel_l2_error_u']:.3f}",
        f"per-tensor E4M3 {min(per_tensor):.2f}-{max(per_tensor):.1f}",
    ]


def optimizer_states():
    last = {r["format"]: r for _, r in rows("optimizer-states-accuracy-cpu") if r.get("step") == 400}
    coat = last["COAT E4M3+expand / E4M3+expand, k in [1/16, 16] (default)"]
    per_tensor = last["per-tensor E4M3 / E4M3 (Megatron precision-aware FP8, baseline)"]
    return [
        f"update-direction error {coat['rel_l2_error_u']:.3f} (COAT) against {per_tensor['rel_l2_error_u']:.1f} "
        "(per-tensor E4M3)",
        f"v underflow {coat['v_underflow_fraction']:.0%} against {100 * per_tensor['v_underflow_fraction']:.2f}%",
    ]


def outlier_stress():
    found = [r for _, r in rows("outlier-stress-gpt-125m-1gpu")]
    modes = ("bf16", "coat", "te-fp8-current")
    steps = {m: [r for r in found if r["kind"] == "step" and r["mode"] == m] for m in modes}
    assert all(len(s) == 400 and all(r["finite"] for r in s) for s in steps.values())
    last_10 = {m: statistics.mean(r["loss"] for r in s[-10:]) for m, s in steps.items()}
    return [
        "no non-finite loss in any mode",
        f"last-10-step loss BF16 {last_10['bf16']:.3f}, COAT (split masters, FP32 gradient buffers, W^T cached) "
        f"{last_10['coat']:.3f}, TE FP8 current {last_10['te-fp8-current']:.3f}",
    ]


def te_fp8_pa():
    # the GPU runs went through Megatron's pretrain(), which writes no rows: losses.md holds every iteration's
    # logged loss of the five runs (the log excerpts: git show 08a345a:benchmarks/results/pa-repro-h100/)
    lines = (RESULTS / "te-fp8-pa-divergence-1gpu" / "losses.md").read_text().splitlines()
    runs = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    loss = {}
    for line in lines[2:]:
        iteration, *values = (c.strip() for c in line.strip("|").split("|"))
        loss |= {(run, int(iteration)): float(v) for run, v in zip(runs, values)}
    fp8_v = {f"{loss[run, 8]:.1f}" for run in ("pa-fp8", "pa-bf16-v-fp8")}
    bf16_v = {f"{loss[run, 8]:.2f}" for run in ("pa-fp8-v-bf16", "no-pa")}  # FP8 m with BF16 v, and FP32 states
    assert len(fp8_v) == len(bf16_v) == 1
    # the CPU emulation: a loss above step 1's is the report's mark of divergence
    emulated = {}
    for _, r in rows("te-fp8-pa-divergence-1gpu"):
        emulated.setdefault(r["format"], []).append(r["loss"])
    diverged = {f: max(losses[1:]) > losses[0] for f, losses in emulated.items()}
    assert diverged == {"fp32": False, "te-fp8": True, "te-fp8-m/bf16-v": False, "te-bf16-m/fp8-v": True, "coat": False}
    return [
        f"FP8 v: loss {fp8_v.pop()} at iteration 8; BF16 v with FP8 m: {bf16_v.pop()}, like FP32 states",
        "the CPU emulation agrees, with COAT's states training like FP32",
    ]


def warmup_spike_llama2_7b() -> dict[int, float]:
    """The highest training loss after step 10 of the default's Llama-2-7B runs, by warm-up steps."""
    runs = [r for _, r in rows("warmup-spike-1gpu") if r["kind"] == "train" and r["preset"] == "llama2-7b"]
    highest = {r["lr_warmup_steps"]: highest_after_step_10(r)[0] for r in runs}
    # the 20-step warm-up: the default's run of accuracy-llama2-7b-1gpu (its rows are there)
    acc = one(rows("accuracy-llama2-7b-1gpu"), "llama2-7b-acc-coat", kind="train", mode="coat")
    assert acc["lr_warmup_steps"] == 20 and all(r["mode"] == "coat" for r in runs)
    return highest | {20: highest_after_step_10(acc)[0]}


def warmup_spike():
    found = rows("warmup-spike-1gpu")
    runs = [r for _, r in found if r["kind"] == "train"]
    vocab = math.log(32000)
    gpt = [r for r in runs if r["preset"] == "gpt-1b"]
    assert {r["lr_warmup_steps"] for r in gpt} == {5, 20} and all(highest_after_step_10(r)[0] < vocab for r in gpt)
    llama = warmup_spike_llama2_7b()
    # the 13B run's batches: the loss against the batch's surprisal, steps 11-40, per run
    steps = [r for _, r in found if r["kind"] == "step" and 11 <= r["step"] <= 40]
    correlation = []
    for r in (r for _, r in found if r["kind"] == "correlation"):
        recomputed = statistics.correlation([s["surprisal"] for s in steps], [s["losses"][r["run"]] for s in steps])
        assert math.isclose(recomputed, r["with_surprisal"], rel_tol=1e-9)
        correlation.append(f"{recomputed:.2f}")
    return [
        f"gpt-1b below ln(32000) = {vocab:.2f} with 5 or 20 warm-up steps",
        f"Llama-2-7B {llama[20]:.2f} (20 steps), {llama[50]:.2f} (50), ",
        f"(loss against surprisal: {', '.join(correlation)})",
    ]


def weight_pass_ms(preset: str, key: str) -> list[str]:
    """The default's, coat-codes' and coat-cached's weight passes (per_micro_batch_ms or per_step_ms)."""
    recipe = {(r["preset"], r["recipe"]): r for _, r in rows("weight-passes-1gpu") if r["kind"] == "recipe"}
    found = (recipe[preset, r][key] for r in ("coat (default)", "coat-codes", "coat-cached"))
    return ["0" if v == 0 else f"{v:.1f}" for v in found]


def weight_passes():
    default, codes, cached = weight_pass_ms("llama2-7b", "per_micro_batch_ms")
    step_default, step_codes, _ = weight_pass_ms("llama2-7b", "per_step_ms")
    return [
        f"Llama-2-7B {default} ms against `coat-codes`' {codes} and `coat-cached`'s {cached}",
        f"per optimizer step {step_default} against {step_codes} and ",
        "gpt-1b " + " / ".join(weight_pass_ms("gpt-1b", "per_micro_batch_ms")) + " per micro-batch",
    ]


def weight_passes_per_step_cached():
    return ["per optimizer step {} against {} and {};".format(*weight_pass_ms("llama2-7b", "per_step_ms"))]


def warmup_spike_100_steps():
    return [f"{warmup_spike_llama2_7b()[100]:.2f} (100);"]


def wgrad_accumulate():
    found = [r for _, r in rows("wgrad-accumulate-gemm-1gpu")]

    def per_layer(preset, key):  # the four linears of one layer
        layer = [r[key] for r in found if r["preset"] == preset]
        assert len(layer) == 4
        return f"{sum(layer):.3f}"

    return [
        f"per layer gpt-1b {per_layer('gpt-1b', 'cublaslt_ms')} against {per_layer('gpt-1b', 'add_ms')} ms for an "
        f"FP32 temporary and an add, Llama-2-7B {per_layer('llama2-7b', 'cublaslt_ms')} against "
        f"{per_layer('llama2-7b', 'add_ms')}",
    ]


def pipeline_graphs():
    # Megatron's own loop writes no rows: its start-up, graph and iteration lines of the two runs are kept
    log = (RESULTS / "pretrain-pipeline-4gpu" / "pretrain-pp2-graphs.log").read_text()
    runs = log.split("=== ")[1:]
    assert [r.split("\n", 1)[0] for r in runs] == ["pretrain-pp2-bf16-graphs.log", "pretrain-pp2-coat-graphs.log"]
    for run in runs:
        assert "> built 64 cuda graph(s)" in run and "iteration        1/      20" in run
        assert "iteration        2/" not in run and "got signal: 15" in run
    # TE-based graphs (--coat-fp8's choice under PP) against eager COAT: the four runs' rows
    found = {(r["layout"], r["mode"]): r["losses"] for _, r in rows("pretrain-pipeline-4gpu", "rows.jsonl")}

    def gap(layout):  # the largest logged-loss difference, graphed against eager, in one layout
        graphed, eager = found[layout, "coat-auto"], found[layout, "coat"]
        return max(abs(graphed[i] - eager[i]) for i in eager)

    # PP 2 + VPP 2's figures: tests/compare/test_pipeline_graphs.py, by coat_compare.layouts' rule itself
    return [
        "PP 2 builds its graphs and finishes the first iteration, then hangs in the first replay, BF16 and COAT alike",
        f"logged losses within {gap('pp2'):.4f} of eager's (one GPU's local graphs against eager: {gap('one'):.3f})",
    ]


def fidelity():
    # coat_compare.fidelity's rows on the H200: the 7B layer, and gpt-1b at its three checkpoints
    found = [r for _, r in rows("gradient-fidelity-1gpu", "fidelity.jsonl") if r["device"] != "CPU"]
    dw = ("dW qkv", "dW proj", "dW fc1", "dW fc2")

    def of(preset, key):
        got = [r for r in found if r["preset"] == preset and r["key"] == key]
        assert got and all(r["status"] == "ok" for r in got), (preset, key)
        return got

    def dw_span(preset, key):
        errors = [100 * r["gradients"][c]["rel_error"] for r in of(preset, key) for c in dw]
        return f"{min(errors):.1f}-{max(errors):.1f}%"

    def update(preset, key):
        return [100 * r["update"]["all"]["rel_error"] for r in of(preset, key)]

    def update_span(preset, key):
        got = update(preset, key)
        return f"{min(got):.1f}-{max(got):.1f}%"

    above = [c - t for c, t in zip(update("gpt-1b-accuracy", "coat"), update("gpt-1b-accuracy", "te-fp8-current"))]
    assert len(above) == 3
    seven = "llama2-7b"
    return [
        f"(7B layer: dW {dw_span(seven, 'coat')} against {dw_span(seven, 'te-fp8-delayed')}, update "
        f"{update(seven, 'coat')[0]:.1f}% against {update(seven, 'te-fp8-delayed')[0]:.1f}%)",
        f"FP8 Adam states {update(seven, 'alone-states')[0]:.2f}% of the update",
        f"gpt-1b at all three checkpoints: dW {dw_span('gpt-1b-accuracy', 'coat')} against TE delayed's "
        f"{dw_span('gpt-1b-accuracy', 'te-fp8-delayed')}, update {update_span('gpt-1b-accuracy', 'coat')} "
        f"against {update_span('gpt-1b-accuracy', 'te-fp8-delayed')}, and the update {min(above):.2f}-{max(above):.2f} "
        "point above TE current's",
    ]


def scratch_counts(text: str, recipe: str) -> tuple[int, int]:
    """(launches, allocations) of layer_launches_gpu.py's rank lines for ``recipe``, the larger rank's."""
    found = re.findall(rf"^rank \d: {re.escape(recipe)} launches (\d+) allocations (\d+)", text, re.M)
    assert found, recipe
    return max(int(n) for n, _ in found), max(int(a) for _, a in found)


def layer_tp2():
    # coat-compare's rows of the four modes (the 11.42 / 15.19 ms pair is layer-tp2-overlap.md's: no rows)
    everything = rows("layer-llama2-7b-tp2-2gpu", "llama2-7b-layer-tp2-mb4.jsonl")
    found = {r["mode"]: r for s, r in everything if r["kind"] == "layer" and s.endswith(".jsonl")}  # the first run's
    bf16, te, coat = found["bf16"], found["te-fp8-current"], found["coat"]
    mib = 1 << 20
    # the lean path's counts: the 2-GPU test's xfail lines in the appended session-5 log, then session 9's
    log = (RESULTS / "layer-llama2-7b-tp2-2gpu" / "gpu-tests.log").read_text().split("session 5")[1]
    session5, _, later = log.partition("## session 9")
    session9, _, session12 = later.partition("## session 12")
    session12, _, scratch12 = session12.partition("## session 12, second machine")

    def counts(text):
        pattern = r"test_launches_on_two_gpus\[(\w+)\] - \w+: \((\d+), (\d+)\) on two GPUs"
        return {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(pattern, text)}

    recipes = ("memory", "codes", "cached")
    before, after, again = counts(session5), counts(session9), counts(session12)
    runs = [
        {r["mode"]: r["ms"] for s, r in everything if f"session 9, 2 x h200 39f01f0{tag}" in s and r["kind"] == "layer"}
        for tag in (": coat-compare", ": the same modes in reverse")
    ]

    def both(mode):
        return " and ".join(f"{run[mode]:.2f}" for run in runs)

    def joined(counted, i):
        return ", ".join(str(counted[r][i]) for r in recipes)

    # the memory recipe with scratch buffers: layer_launches_gpu.py by hand, its rank lines quoted in commands.txt
    commands = (RESULTS / "layer-llama2-7b-tp2-2gpu" / "commands.txt").read_text()
    scratch = re.search(r"memory\+scratch launches (\d+) allocations (\d+)", commands).groups()
    te_over_scratch = sum(run["te-fp8-current"] for run in runs) / sum(run["coat-scratch"] for run in runs)
    assert all("372 passed" in t and not re.search(r"\d+ failed", t) for t in (session9, session12))
    return [
        f"COAT {both('coat')} ms, with scratch buffers {both('coat-scratch')} ({x(te_over_scratch)} TE's speed "
        f"over the two), with autograd's residual sum {both('coat-unfused-residual')}, TE FP8 current "
        f"{both('te-fp8-current')}, BF16 {both('bf16')}",
        f"launches {joined(after, 0)} (allocations {joined(after, 1)}; with scratch buffers {scratch[0]} and {scratch[1]})",
        f"again (0e6d8fd) {joined(again, 0)} (allocations {joined(again, 1)})",
        "with scratch buffers the cached recipe {} and {} (within the goal), the default {} and {}".format(
            *scratch_counts(scratch12, "cached+scratch"), *scratch_counts(scratch12, "memory+scratch")
        ),
        f"the ring alone {coat['ms']:.2f} against TE FP8 current {te['ms']:.2f} and BF16 {bf16['ms']:.2f}",
        f"activations {coat['activation_MiB'] / bf16['activation_MiB']:.2f}x BF16, "
        f"{coat['activation_MiB'] / te['activation_MiB']:.2f}x TE",
        f"SP gathers {coat['sp_all_gather_fp8_bytes'] // mib} MiB all FP8 against {bf16['sp_all_gather_bytes'] // mib}",
        f"the lean path's launches per layer and micro-batch {joined(before, 0)} (memory, codes, cached recipes; "
        f"allocations {joined(before, 1)}; goal 60 and 40)",
    ]


def default_vs_cached_gpt_1b():
    found = rows("gpt-1b-default-vs-cached-1gpu")
    # that run's names (commands.txt): coat-min is today's default, coat today's coat-codes
    graphed = {r["mode"]: r for s, r in found if "quick/gpt-1b" in s and r.get("graphs") == "local"}
    eager = {r["mode"]: r for s, r in found if "quick/gpt-1b" in s and r.get("graphs") == "none"}
    default, cached, bf16 = (graphed[m]["tokens_per_s"] for m in ("coat-min", "coat-cached", "bf16"))
    codes = eager["coat"]
    return [
        f"{x(default / cached)} `coat-cached`'s tokens/s with graphs ({default:.0f} against {cached:.0f}), "
        f"{x(default / bf16)} BF16 ({bf16:.0f})",
        f"bytes per parameter between steps {held(eager['coat-min']):.2f} (`coat-codes` {held(codes):.2f}, "
        f"`coat-cached` {held(eager['coat-cached']):.2f}, BF16 {held(eager['bf16']):.2f})",
        f"eager peak {x(eager['coat-min']['peak_MiB'] / eager['bf16']['peak_MiB'], 3)} BF16's "
        f"({eager['coat-min']['peak_MiB']:.0f} against {eager['bf16']['peak_MiB']:.0f} MiB)",
    ]


def default_vs_cached_llama2_7b():
    found = rows("llama2-7b-default-vs-cached-1gpu")
    runs = {r["mode"]: r for s, r in found if r["kind"] == "train"}
    assert {(r["graphs"], r["micro_batch"]) for r in runs.values()} == {("local", 1)}
    default, codes, cached = (runs[m] for m in ("coat", "coat-codes", "coat-cached"))
    fastest = max(r["tokens_per_s"] for r in runs.values())
    return [
        f"{x(default['tokens_per_s'] / fastest, 3)} the fastest ({default['tokens_per_s']:.0f} against `coat-codes`' "
        f"{codes['tokens_per_s']:.0f} and `coat-cached`'s {cached['tokens_per_s']:.0f} tokens/s)",
        "peaks " + " / ".join(f"{r['peak_MiB']:.0f}" for r in (default, codes, cached)) + " MiB",
    ]


def memory_by_mode():
    found = rows("gpt-1b-memory-by-mode-1gpu")
    # that run's names (commands.txt): coat is today's coat-fp32, coat-mem today's coat-codes
    eager = {r["mode"]: r for s, r in found if r["kind"] == "train" and r["graphs"] == "none"}
    bf16, te, fp32, codes = (eager[m] for m in ("bf16", "te-fp8-pa", "coat", "coat-mem"))
    return [
        f"BF16 {held(bf16):.2f}; `te-fp8-pa` {held(te):.2f} + {te['bytes_per_param']['other']:.2f} other; "
        f"`coat-fp32` {held(fp32):.2f}; `coat-codes` {held(codes):.2f} (eager peak "
        f"{x(codes['peak_MiB'] / bf16['peak_MiB'])} BF16's, {x(codes['peak_MiB'] / te['peak_MiB'])} `te-fp8-pa`'s)",
    ]


def gpt_1b_speed_index():
    found = rows("gpt-1b-speed-1gpu")
    h100 = {(r["mode"], r["graphs"]): r["tokens_per_s"] for s, r in found if "fastest" in s and r["kind"] == "train"}
    fused, unfused = (
        {r["mode"]: r["tokens_per_s"] for s, r in found if s.endswith(f"/gpt-1b-{run}.jsonl") and r["kind"] == "train"}
        for run in ("fused", "unfused")
    )
    # the default since this run: the weight gradient added by cuBLASLt (commands.txt); the fused run's coat row is
    # the FP32 temporary and an add
    cublaslt = one(found, "fused-cublaslt", kind="train", mode="coat")["tokens_per_s"]
    coat = h100["coat", "local"]
    # the H200's one run of all three at eb50b98, with apex (commands.txt)
    bf16, te, h200 = (one(found, "2026-11-29 h200", kind="train", mode=m)["tokens_per_s"] for m in H200_MODES)

    def gain(new, old):
        return f"{100 * (new / old - 1):+.1f}%"

    return [
        f"graphs: the default {coat:.0f} tokens/s, {x(coat / h100['bf16', 'local'], 3)} BF16, "
        f"{x(coat / h100['te-fp8-delayed', 'local'], 3)} TE FP8 delayed, "
        f"{x(coat / h100['te-fp8-current', 'local'], 3)} TE FP8 current (H100)",
        f"{h200:.0f}, {x(h200 / bf16)} BF16, {x(h200 / te, 3)} TE FP8 delayed in one run with apex (H200, 2026-11-29)",
        f"Eager: {h100['coat', 'none']:.0f}, {x(h100['coat', 'none'] / h100['bf16', 'none'])} BF16 (H100)",
        f"The fusion (H200, 2026-11-26, separate runs): TE {gain(fused['te-fp8-delayed'], unfused['te-fp8-delayed'])} over its unfused run, COAT's "
        f"cuBLASLt add {gain(cublaslt, unfused['coat'])}, an FP32 temporary and an add "
        f"{gain(fused['coat'], unfused['coat'])}",
    ]


def llama2_7b_speed_index():
    found = rows("llama2-7b-speed-1gpu")

    def by_run(source):
        return {(r["mode"], r["graphs"]): r["tokens_per_s"] for s, r in found if source in s and r["kind"] == "train"}

    # runs 1-3 ran at once on one host; run 3's report did not come back: its printout (run3/printout.txt) holds
    # its table rows, as coat-compare printed them (the columns of run 1's report)
    header = next(
        line
        for line in (RESULTS / "llama2-7b-speed-1gpu" / "run1" / "llama2-7b-mb1.md").read_text().splitlines()
        if line.startswith("| mode | CUDA graphs |")
    )
    tokens_column = [c.strip() for c in header.strip("|").split("|")].index("tokens/s")
    printed = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in (RESULTS / "llama2-7b-speed-1gpu" / "run3" / "printout.txt").read_text().splitlines()
        if line.startswith("| ") and line.split("|")[2].strip() in ("none", "local")
    ]
    run3 = {(c[0], c[1]): float(c[tokens_column]) for c in printed[:6]}
    assert len(run3) == 6
    one_host = [by_run("speed7b23-run1"), by_run("speed7b23-run2"), run3]
    others = [by_run("issue23-lean-h200/speed7b23/"), by_run("eager3")]

    def eager(run):
        return run["coat", "none"] / run["bf16", "none"]

    graphed = [run["coat", "local"] / run["te-fp8-current", "local"] for run in one_host]
    every = [eager(run) for run in one_host + others]
    run1 = one_host[0]
    peak = {r["mode"]: r["peak_MiB"] for s, r in found if "speed7b23-run1" in s and r.get("graphs") == "local"}
    return [
        f"graphs: {run1['coat', 'local']:.0f} tokens/s, {x(run1['coat', 'local'] / run1['bf16', 'local'])} BF16, "
        f"{min(graphed):.3f}-{x(max(graphed), 3)} TE FP8 current in three runs",
        f"eager: {x(min(every))} to {x(max(every))} BF16 over five runs "
        f"(median of the three on one host {x(statistics.median(eager(run) for run in one_host), 3)})",
        f"peak {x(peak['coat'] / peak['bf16'])} BF16's",
    ]


def max_batch_index():
    h200, x8, mb14, h100, h100_x8 = max_batch_runs()
    coat, bf16, te = h200["coat"], h200["bf16"], h200["te-fp8-current"]
    return [
        f"the default at micro-batch {coat['largest_micro_batch']}, {coat['tokens_per_s']:.0f} tokens/s, "
        f"{coat['model_tflops_per_gpu']:.0f} model TFLOP/s: {x(coat['tokens_per_s'] / bf16['tokens_per_s'])} BF16 "
        f"(micro-batch {bf16['largest_micro_batch']}), {x(coat['tokens_per_s'] / te['tokens_per_s'])} TE FP8 current "
        f"({te['largest_micro_batch']})",
        f"at 8 per step micro-batch {mb14['micro_batch']}, {mb14['tokens_per_s']:.0f}: "
        f"{x(mb14['tokens_per_s'] / x8['bf16']['tokens_per_s'])} and "
        f"{x(mb14['tokens_per_s'] / x8['te-fp8-current']['tokens_per_s'])} (two machines)",
        "H100: BF16 and TE FP8 current do not fit micro-batch 1",
        f"the default trains at {h100['coat']['largest_micro_batch']}: {h100['coat']['tokens_per_s']:.0f} tokens/s, "
        f"at 8 per step {h100_x8['tokens_per_s']:.0f} and {h100_x8['model_tflops_per_gpu']:.0f} model TFLOP/s",
    ]


def pretrain_index():
    reports = {r["mode"]: r for _, r in rows("pretrain-gpt-1b-1gpu")}
    bf16, coat = reports["bf16"], reports["coat"]
    b, c = pretrain_tokens_per_s(bf16), pretrain_tokens_per_s(coat)
    per_param = (r["bytes_per_parameter"]["total"] for r in (coat, bf16))
    return [
        f"{c:.0f} against BF16's {b:.0f} tokens/s ({x(c / b)}), "
        f"peak {x(coat['peak_memory_bytes'] / bf16['peak_memory_bytes'])}, "
        "{:.2f} against {:.2f} B/param".format(*per_param),
    ]


def optimizer_step_index():
    from coat_kernels.fp8_adamw import step_blocks
    from coat_megatron import CoatConfig

    layer = {
        r["name"]: r
        for _, r in rows("optimizer-step-1gpu")
        if r.get("layout") == "18 tensors, Llama-2-7B layer shapes" and "name" in r
    }
    fused, te = layer["CoatAdamW + BF16 model weights (fused)"], layer["TE FusedAdam, FP8 states"]
    sweep = {n: r["ms_per_billion"] for n, r in layer.items() if n.startswith("sweep: ")}
    groups, warps = map(
        int, re.fullmatch(r"sweep: (\d+) groups/program, (\d+) warps", min(sweep, key=sweep.get)).groups()
    )
    group = CoatConfig().optimizer_group_size
    assert step_blocks(group) == (groups, warps)  # the fastest tiling is the kernel's default
    return [
        f"{fused['ms_per_billion']:.2f} ms per billion parameters on Llama-2-7B layer shapes: "
        f"{x(fused['vs_torch_plus_copy'], 3)} torch's fused FP32 AdamW plus Megatron's copy",
        f"TE FusedAdam with FP8 states {te['ms_per_billion']:.2f} ms",
        f"the sweep's fastest tiling, {groups} groups of {group} per program with {warps} warps, is the default",
    ]


def accuracy_gpt_1b_index():
    assert {(r["steps"], r["global_batch"]) for r in gpt_1b_runs()} == {(460, 32)}
    gaps = gpt_1b_gaps

    def mean_se(values):  # the mean and its standard error, as the report gives them
        return pct(statistics.mean(values)), f"{100 * statistics.stdev(values) / math.sqrt(len(values)):.2f}%"

    constant = gaps("coat", None, (1234, 2, 3, 4))
    te = gaps("te-fp8-delayed", None, (1234, 2, 3))
    cosine = gaps("coat", "cosine", (1234, 2, 3))
    three, four = mean_se(constant[:3]), mean_se(constant)
    # the rule fixed before the runs (commands.txt): the mean gap <= 0.25%
    assert statistics.mean(constant[:3]) > 0.0025 and statistics.mean(cosine) > 0.0025
    return [
        "constant learning rate: {} (seed 1234), {} (2), {} (3), {} (4)".format(*map(pct, constant)),
        f"mean of the three declared seeds {three[0]} (standard error {three[1]}), of four {four[0]} ({four[1]})",
        f"TE FP8 delayed {', '.join(map(pct, te))} ({', '.join(mean_se(te))})",
        f"BF16 against itself {pct(*gaps('bf16', None, (1234,), 2))}.",
        f"Cosine decay: {', '.join(map(pct, cosine))} ({', '.join(mean_se(cosine))})",
        f"TE FP8 delayed {pct(*gaps('te-fp8-delayed', 'cosine', (1234,)))} (seed 1234); "
        f"BF16 against itself {pct(*gaps('bf16', 'cosine', (1234,), 2))}.",
        "Rule (mean <= 0.25%): missed",
    ]


def floor_rule_runs():
    return [r for s, r in rows("accuracy-gpt-1b-1gpu") if "retired-floor-rule-runs" in s]


def rms_of(pairs):
    """BF16 against BF16: each pair's gap, and their root mean square, as the retired floor rule wrote them."""
    gaps = [again["valid_loss"] / first["valid_loss"] - 1 for first, again in pairs]
    rms = math.sqrt(statistics.mean(g * g for g in gaps))
    return rms, f"{100 * rms:.3f}%", ", ".join(f"{100 * g:+.2f}" for g in gaps) + "%"


def floor_rule():
    found = [r for r in floor_rule_runs() if r["preset"] == "gpt-1b-accuracy" and r["mode"] == "bf16"]
    base = {r["seed"]: r for r in found if r["data_seed"] == r["seed"] and "repeat" not in r}
    again = {r["seed"]: r for r in found if r.get("repeat") == 2}
    order = {r["seed"]: r for r in found if r["data_seed"] == 1000 + r["seed"]}
    seeds = (1, 2, 3, 4)
    same, same_text, same_gaps = rms_of([(base[s], again[s]) for s in seeds])
    other, other_text, other_gaps = rms_of([(base[s], order[s]) for s in seeds])
    # the floor rule's bound, fixed before the runs (commands.txt; retired at b3c7c2d)
    assert min(same, other) > 0.0015
    return [
        f"same seed run again {same_text} rms ({same_gaps}), another data order {other_text} ({other_gaps}), "
        "bound 0.15%: missed, no verdict",
    ]


def protocol_screen():
    found = [r for r in floor_rule_runs() if r["preset"] != "gpt-1b-accuracy"]
    assert len(found) == 12 and {r["mode"] for r in found} == {"bf16"}

    def candidate(preset, lr):
        runs = {r["data_seed"]: r for r in found if (r["preset"], r["lr"]) == (preset, lr)}
        return rms_of([(runs[s], runs[1000 + s]) for s in (1, 2)])

    screened = [candidate("gpt-1b-accuracy-pool", 1e-4), candidate("gpt-1b-accuracy-pool", 5e-5)]
    screened.append(candidate("gpt-1b-bytes-accuracy", 1e-4))
    assert {r["vocab"] for r in found if r["preset"] == "gpt-1b-bytes-accuracy"} == {256}
    # the screen's pass, fixed before its runs (commands.txt): rms <= 0.30%
    assert min(rms for rms, _, _ in screened) > 0.003
    (_, lr4, lr4_gaps), (_, lr5, lr5_gaps), (_, rows256, rows256_gaps) = screened
    return [
        f"1e-4: {lr4} rms ({lr4_gaps}); 5e-5: {lr5} ({lr5_gaps}); 256 rows: {rows256} ({rows256_gaps})",
        "pass <= 0.30%: none passes",
    ]


def accuracy_llama2_7b_dp4_index():
    found = [r for _, r in rows("accuracy-llama2-7b-dp4-4gpu", "runs.jsonl") if r["kind"] == "train"]
    # three rows came back: COAT's first half and both second halves; BF16's first half lost its row
    assert sorted((r["mode"], r["first_step"]) for r in found) == [("bf16", 40), ("coat", 0), ("coat", 40)]
    second = {r["mode"]: r for r in found if r["first_step"] == 40}
    coat, bf16 = second["coat"], second["bf16"]
    coat_60, bf16_60 = (dict(r["valid_losses"])[60] for r in (coat, bf16))
    return [
        f"last validation: default {pct(coat['valid_loss'] / bf16['valid_loss'] - 1)} "
        f"({coat['valid_loss']:.4f} against {bf16['valid_loss']:.4f}), {pct(coat_60 / bf16_60 - 1)} at step 60",
        "BF16's validations at steps 20 and 40 lost",
        f"peak {x(coat['peak_MiB'] / bf16['peak_MiB'])} BF16's",
    ]


def tp2dp2_graphed():
    found = rows("llama2-7b-tp2dp2-4gpu")
    source = "c4d2c79:"  # the run after the column-parallel wgrad became one GEMM
    bf16, te, coat = (one(found, source, kind="train", mode=m) for m in ("bf16", "te-fp8-current", "coat"))
    before = {m: one(found, "c4d2c79~1:", kind="train", mode=m) for m in ("te-fp8-current", "coat")}
    assert {(r["tp"], r["dp"], r["micro_batch"], r["global_batch"], r["graphs"]) for r in (bf16, te, coat)} == {
        (2, 2, 1, 16, "local")
    }
    b, t, c = (r["tokens_per_s"] for r in (bf16, te, coat))
    return [
        f"BF16 {b:.0f} tokens/s, TE FP8 current {t:.0f} ({x(t / b)}), COAT {c:.0f} ({x(c / b)} BF16, {x(c / t)} TE;",
        f"peak {x(coat['peak_MiB'] / bf16['peak_MiB'])} BF16's, {x(coat['peak_MiB'] / te['peak_MiB'])} TE's",
        f"{before['coat']['tokens_per_s']:.0f} and "
        f"{x(before['coat']['tokens_per_s'] / before['te-fp8-current']['tokens_per_s'])} before the column-parallel "
        "wgrad became one GEMM",
    ]


def tp2dp2_eager():
    """The H100 ring run's figures (its rows restored from git; the H200 run's, printed only, were retired)."""
    found = rows("llama2-7b-tp2dp2-4gpu")
    ring = {m: one(found, "25b3c7a~1:", kind="train", mode=m) for m in ("bf16", "te-fp8-current", "coat")}
    assert {(r["tp"], r["dp"], r["micro_batch"], r["global_batch"], r["graphs"]) for r in ring.values()} == {
        (2, 2, 1, 16, "none")
    }
    assert {r["device"] for r in ring.values()} == {"NVIDIA H100 80GB HBM3"}
    b, t, c = (ring[m]["tokens_per_s"] for m in ("bf16", "te-fp8-current", "coat"))
    return [f"BF16 {b:.0f} tokens/s, TE FP8 current {t:.0f}, COAT {c:.0f} ({x(c / b)} BF16)"]


def tp2_host_bound():
    found = {
        (r["mode"], r["graphs"]): r
        for _, r in rows("tp2-host-bound-and-graphs-2gpu", "gpt-1b-tp2-speed.jsonl")
        if r["kind"] == "train"
    }
    assert {(r["tp"], r["micro_batch"], r["global_batch"]) for r in found.values()} == {(2, 2, 8)}
    graphed = {m: found[m, "local"]["tokens_per_s"] for m in ("bf16", "te-fp8-current", "coat")}
    slower = [found[m, "local"]["tokens_per_s"] / found[m, "none"]["tokens_per_s"] for m in graphed]
    peak = found["coat", "local"]["peak_MiB"] / found["bf16", "local"]["peak_MiB"]
    # coat-megatron-run's eager runs (pretrain() writes no rows): Megatron's logged iterations, kept in
    # pretrain-tp2.log, read back as scripts/pretrain_summary.py reads a run's log
    ms = pretrain_log_ms(RESULTS / "tp2-host-bound-and-graphs-2gpu" / "pretrain-tp2.log")
    return [
        f"coat-compare: graphed BF16 {graphed['bf16']:.0f} tokens/s, TE FP8 current {graphed['te-fp8-current']:.0f}, "
        f"COAT {graphed['coat']:.0f} ({x(graphed['coat'] / graphed['bf16'])} BF16, "
        f"{x(graphed['coat'] / graphed['te-fp8-current'])} TE), peak {x(peak)} BF16's",
        f"eager every mode {min(slower):.0f}-{max(slower):.0f}x slower",
        f"eager {x(ms['bf16'] / ms['coat'])}",
        *tp2_step_profile(),
        *tp2_graphs_rerun(),
    ]


def tp2_step_profile():
    """The eager step profile's GPU busy fractions and kernels per step (rank 0), from its rows."""
    found = {r["mode"]: r for _, r in rows("tp2-host-bound-and-graphs-2gpu", "step_profile-gpt-1b-tp2-eager.jsonl")}
    modes = ("bf16", "te-fp8-current", "coat")
    assert {(found[m]["tp"], found[m]["graphs"]) for m in modes} == {(2, "none")}
    busy = ", ".join(f"{found[m]['gpu_busy_fraction']:.2f} {n}" for m, n in zip(modes, ("BF16", "TE", "COAT")))
    kernels = ", ".join(f"{found[m]['kernel_launches_per_step']:.0f}" for m in modes)
    return [f"GPU busy {busy}; kernels per step {kernels}"]


def tp2_graphs_rerun():
    """`--coat-fp8` alone against graphed BF16 through pretrain(): the run at 0f50b2a, whose whole logs
    pretrain-tp2-exit-logs.txt.gz keeps, read by scripts/pretrain_summary.py's own reader."""
    summary = load_file("scripts/pretrain_summary.py", "pretrain_summary")
    path = RESULTS / "tp2-host-bound-and-graphs-2gpu" / "pretrain-tp2-exit-logs.txt.gz"
    second = gzip.open(path, "rt").read().split("\n# second call")[1].split("\n# session 5")[0]
    assert "code 0f50b2a" in second.split("\n", 1)[0]
    runs = [summary.parse(*section.split("\n", 1)) for section in second.split("\n### ")[1:]]
    runs = {run["mode"]: run for run in runs}
    bf16, coat = runs["bf16-graphs"], runs["coat-auto"]
    assert bf16["status"] == coat["status"] == "ok" and bf16["gpus"] == coat["gpus"] == "2"
    return [
        f"`--coat-fp8` alone (graphs now on at TP) {coat['tokens_s']:.0f} tokens/s against graphed BF16 "
        f"{bf16['tokens_s']:.0f} ({x(coat['tokens_s'] / bf16['tokens_s'])})"
    ]


def pretrain_log_ms(path) -> dict[str, float]:
    """ms per iteration of each run of a log of pretrain() runs (its "==== LAYOUT-MODE.log" sections), by mode, as
    scripts/pretrain_summary.py reads a run's log: the median logged iteration of the second half."""
    summary = load_file("scripts/pretrain_summary.py", "pretrain_summary")
    out, batches = {}, set()
    for section in path.read_text().split("==== ")[1:]:
        name, text = section.split("\n", 1)
        run = summary.parse(name.split()[0].removeprefix("pretrain-"), text)
        assert run["status"] == "ok", name
        out[run["mode"]] = run["ms_per_iteration"]
        batches |= set(re.findall(r"global batch size:\s+(\d+)", text))
    assert len(batches) == 1  # every run the same tokens per iteration: tokens/s go as 1 / ms
    return out


def apex_wgrad_fusion():
    """With apex's fused wgrad: each call's rows (commands.txt: COAT on in call 1, BF16 and TE on in call 2, all
    three off in call 3), every run ended with its logged losses under 0.5."""
    found = rows("apex-wgrad-fusion-1gpu")
    run = {(s.partition(" ")[2].partition(" ")[0], r["mode"]): r for s, r in found}
    assert all(r["status"] == "ok" and r["losses"]["20"] < 0.5 for _, r in found)
    on = {m: run[call, m] for call, m in (("1", "coat-auto"), ("2", "bf16-graphs"), ("2", "te-fp8-graphs"))}
    off = {m: run["3", m] for m in ("coat-auto", "bf16-graphs", "te-fp8-graphs")}

    def gain(mode):
        return f"{100 * (on[mode]['tokens_s'] / off[mode]['tokens_s'] - 1):+.1f}%"

    coat, bf16, te = (off[m] for m in ("coat-auto", "bf16-graphs", "te-fp8-graphs"))  # call 3: one run
    return [
        f"In one run (fusion off) `--coat-fp8` alone {coat['tokens_s']:.0f} tokens/s, "
        f"{x(coat['tokens_s'] / bf16['tokens_s'])} BF16 and {x(coat['tokens_s'] / te['tokens_s'])} TE FP8 (each "
        f"graphed), peak {x(coat['peak'] / bf16['peak'])} BF16's",
        f"{x(on['coat-auto']['tokens_s'] / on['bf16-graphs']['tokens_s'])} and "
        f"{x(on['coat-auto']['tokens_s'] / on['te-fp8-graphs']['tokens_s'])}",
        f"the fusion gains BF16 {gain('bf16-graphs')}, TE FP8 {gain('te-fp8-graphs')}, COAT {gain('coat-auto')}",
    ]


CHECKED = {
    "layer-llama2-7b-tp2-2gpu": layer_tp2,
    "gradient-fidelity-1gpu": fidelity,
    "accuracy-gpt-1b-ablations-1gpu": ablations,
    "full-step-graphs-1gpu": full_step_graphs,
    "gpt-1b-eager-1gpu": gpt_1b_eager,
    "grad-accumulation-bf16-cpu": grad_accumulation,
    "host-time-layer-1gpu": lambda: host_time() + host_time_second_host(),
    "kernel-launches-layer-1gpu": kernel_launches,
    "kernel-bandwidth-1gpu": lambda: kernel_bandwidth() + swiglu_best_tiles(),
    "layouts-gpt-1b-4gpu: each layout against one GPU": layouts,
    "layouts-gpt-1b-4gpu: a COAT checkpoint": resume,
    "mlp-block-llama2-7b-1gpu": mlp_block,
    "optimizer-state-drift-cpu": state_drift,
    "optimizer-states-accuracy-cpu": optimizer_states,
    "outlier-stress-gpt-125m-1gpu": outlier_stress,
    "te-fp8-pa-divergence-1gpu": te_fp8_pa,
    "warmup-spike-1gpu": lambda: warmup_spike() + warmup_spike_100_steps(),
    "weight-passes-1gpu": lambda: weight_passes() + weight_passes_per_step_cached(),
    "wgrad-accumulate-gemm-1gpu": wgrad_accumulate,
    "pretrain-pipeline-4gpu: per-layer graphs under PP": pipeline_graphs,
    "gpt-1b-default-vs-cached-1gpu": default_vs_cached_gpt_1b,
    "llama2-7b-default-vs-cached-1gpu": default_vs_cached_llama2_7b,
    "gpt-1b-memory-by-mode-1gpu": memory_by_mode,
    "gpt-1b-speed-1gpu": gpt_1b_speed_index,
    "llama2-7b-speed-1gpu": llama2_7b_speed_index,
    "llama2-7b-max-batch-1gpu": max_batch_index,
    "pretrain-gpt-1b-1gpu": pretrain_index,
    "apex-wgrad-fusion-1gpu": apex_wgrad_fusion,
    "optimizer-step-1gpu": optimizer_step_index,
    "accuracy-gpt-1b-1gpu: gpt-1b, 30.1M tokens": accuracy_gpt_1b_index,
    "accuracy-gpt-1b-1gpu: the accuracy protocol `gpt-1b-accuracy`": floor_rule,
    "accuracy-gpt-1b-1gpu: the screen of three candidate protocols": protocol_screen,
    "accuracy-llama2-7b-dp4-4gpu": accuracy_llama2_7b_dp4_index,
    "llama2-7b-tp2dp2-4gpu: Llama-2-7B, TP 2 x DP 2": tp2dp2_graphed,
    "llama2-7b-tp2dp2-4gpu: Llama-2-7B at TP 2 x DP 2": tp2dp2_eager,
    "tp2-host-bound-and-graphs-2gpu": tp2_host_bound,
}

# rows (and figures) no folder keeps rows for; each says "no rows: rerun or retire" in docs/results.md. None since
# issue 50 retired those figures (docs/results.md, "Retired claims"): a run that keeps no rows is rerun or retired
NO_ROWS: dict[str, str] = {}

# rows (or figures of a row) not recomputed yet, each with the reason; a row also in CHECKED has its other figures
# checked there. The figures named here are in git history, not in their folder's rows (restoring them changes
# the rows), or in a report or log only
NOT_YET = {
    "accuracy-gpt-125m-paired-2gpu": "checked by tests/compare/test_accuracy_evidence.py (it runs coat_compare's judge)",
    "accuracy-gpt-1b-check-2gpu": "checked by tests/compare/test_accuracy_evidence.py (it runs coat_compare's judge)",
}


@pytest.mark.parametrize("key", sorted(CHECKED))
def test_the_results_index_figures_recompute_from_the_rows(key):
    check_index(key, CHECKED[key]())


def test_every_row_without_rows_is_listed():
    marked = {c[0] for c in results_index_rows() if MARK in c[1]}
    listed = {results_index_row(k)[0] for k in NO_ROWS}
    assert marked == listed, f"rows saying '{MARK}' that NO_ROWS does not list: {sorted(marked - listed)}"
    # a folder that keeps rows has the figures they hold checked; NO_ROWS names only the rest of its row
    keeping = {p.parent.name for p in RESULTS.glob("*/*.jsonl*")}
    checked_folders = {k.partition(": ")[0] for k in CHECKED}
    unchecked = [k for k in NO_ROWS if k.partition(": ")[0] in keeping - checked_folders]
    assert not unchecked, (
        f"folders that keep rows, listed in NO_ROWS with no check of what their rows hold: {unchecked}"
    )


def test_every_row_of_the_index_is_checked_or_listed():
    handled = [*CHECKED, *NO_ROWS, *NOT_YET, *README_INDEX_CHECKED]
    keys = []
    for cells in results_index_rows():
        folder = cells[-3].split("benchmarks/results/")[1].split("/")[0]
        keys.append((folder, cells[0]))
    unhandled = [
        f"{folder}: {claim}"
        for folder, claim in keys
        if not any(h.partition(": ")[0] == folder and claim.startswith(h.partition(": ")[2]) for h in handled)
    ]
    assert not unhandled, f"docs/results.md rows no test recomputes and no list names: {unhandled}"
    stale = [
        h for h in handled if not any(h.partition(": ")[0] == f and c.startswith(h.partition(": ")[2]) for f, c in keys)
    ]
    assert not stale, f"named here but no docs/results.md row: {stale}"
