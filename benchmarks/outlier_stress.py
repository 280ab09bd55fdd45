"""Outlier stress: BF16, TE FP8 (current scaling) and COAT trained while a few channels grow without bound.

    python benchmarks/outlier_stress.py [--preset gpt-125m] [--steps 400] [--growth 1.03] [--target swiglu]
                                        [--channels 4] [--inject-layers middle] [--modes bf16,te-fp8-current,coat]
                                        [--blowup 1.5] [--seed 1] [--out DIR]
    bash scripts/gpu_evidence.sh outlier-stress   # the GPU run: gpt-125m, 400 steps, the three modes (~4 min on an H100)

Fishman et al. ("Scaling FP8 training to trillion-token LLMs") traced the divergence of long FP8 runs
to SwiGLU: gate and up weights of a few FFN channels align and grow, so those channels' outputs grow
quadratically and dominate every per-tensor FP8 scale they enter. Here the growth is injected: after
every optimizer step a few channels of one weight per injected layer are multiplied by ``--growth``,
the same channels, factor and step in every mode, so their activations grow geometrically (x1.03 per
step: x1.4e5 over 400 steps) through E4M3's range (448) and E5M2's (57344) and past them. Each mode
trains the same model from the same initial weights on the same batches
(``coat_compare``'s ``build_gpt``, ``training_windows``, ``set_learning_rate`` and
``train_step``: Megatron's schedule and distributed optimizer, or COAT's), each in its own process.

``--target`` picks the weight (its rows are output channels):

    swiglu    linear_fc1's gate and up rows of the same FFN channels: SwiGLU's output there grows as
              the square (the case Fishman et al. describe)
    gate, up  one half only: SwiGLU's output grows linearly
    residual  linear_fc2's rows: channels of the residual stream (what the next norms read)

The scaling is applied to the optimizer's FP32 master weights (FP32 main params, or COAT's split
masters: the BF16 weight and its low word), otherwise the next step would write the old values back,
and to the BF16 model weight. Measured each step: the loss; max |output| of the injected channels
of the injected linear (a forward hook; COAT's FP8 output dequantized: what the mode computes with)
and of its other channels; for the SwiGLU targets also SwiGLU's output (fc2's input) in those
channels and the others; and max |weight| of the injected rows and of the others as the forward read
them (the injection's own check: the rows grow by ``--growth`` per step, the optimizer does not undo
it). A mode stops after ``--patience`` non-finite losses in a row.

Writes ``{out}/outlier_stress.jsonl`` (a row per mode per step, ``kind: step``, and a summary row
per mode, ``kind: summary``) and ``{out}/outlier_stress.md`` (the summary table: first step with a
non-finite loss, first step with the loss above ``--blowup`` x the first step's, the steps at which
the injected activations passed 448 and 57344; and the losses and activations every few steps).
Each mode's own rows and log stay in ``{out}/outlier_stress-{mode}.*``. A mode that cannot run here
(TE modes without TransformerEngine, or on a CPU) is a ``skipped`` row with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time

import torch

from coat_compare.corpus import SOURCES
from coat_compare.modes import Mode, parse_modes, unavailable_reason
from coat_compare.presets import Preset, get_preset

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
TARGETS = ("swiglu", "gate", "up", "residual")
NAME = "outlier_stress"


# ----------------------------------------------------------------------------------- the injection


class OutlierInjection:
    """The rows of one weight per injected layer that grow, and the hooks that measure their channels.

    ``channels``: FFN channels (swiglu/gate/up: rows c and/or F + c of linear_fc1's (2F, H) weight,
    Megatron's [gate | up] order) or hidden channels (residual: rows c of linear_fc2's (H, F) weight).
    ``read()`` returns the maxima measured since the last call (max over the injected layers);
    ``grow(factor)`` multiplies the rows, in the masters and the model weights.
    """

    def __init__(self, model: torch.nn.Module, optimizers: list, target: str, layers: list[int], channels: list[int]):
        from coat_compare.build import parameter_name

        self.optimizers, self.target = optimizers, target
        fc = "linear_fc2" if target == "residual" else "linear_fc1"
        modules = {}
        for name, module in model.named_modules():
            m = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.(linear_fc[12])", parameter_name(name))
            if m:
                modules[(int(m.group(1)), m.group(2))] = module
        missing = [i for i in layers if (i, fc) not in modules]
        if missing:
            raise ValueError(
                f"no layer {missing} in this model (layers 0..{max(i for i, _ in modules)}); choose --inject-layers among them"
            )
        self.modules = [modules[(i, fc)] for i in layers]
        weight = self.modules[0].weight
        ffn = weight.shape[0] // 2 if fc == "linear_fc1" else weight.shape[1]
        width = weight.shape[0]  # output channels of the injected linear
        c = torch.tensor(channels, dtype=torch.long)
        if (c < 0).any() or (c >= (width if target == "residual" else ffn)).any():
            raise ValueError(f"channels {channels} out of range for --target {target}")
        self.rows = {"swiglu": torch.cat([c, c + ffn]), "gate": c, "up": c + ffn, "residual": c}[target].to(
            weight.device
        )
        self.out_mask = torch.zeros(width, dtype=torch.bool, device=weight.device)
        self.out_mask[self.rows] = True
        self.swiglu_mask = None
        self._out, self._swiglu = [], []
        for module in self.modules:
            module.register_forward_hook(self._measure_output)
        if target != "residual":  # SwiGLU's output: fc2's input, channels c
            self.swiglu_mask = torch.zeros(ffn, dtype=torch.bool, device=weight.device)
            self.swiglu_mask[c.to(weight.device)] = True
            for i in layers:
                modules[(i, "linear_fc2")].register_forward_pre_hook(self._measure_swiglu)

    @staticmethod
    def _channel_amax(t: torch.Tensor) -> torch.Tensor:
        """max |t| per channel (last dim), FP32; an FP8 activation is dequantized first."""
        from coat_megatron.fp8 import Fp8Tensor

        t = t.dequantize(torch.float32) if isinstance(t, Fp8Tensor) else t.detach().float()
        return t.abs().reshape(-1, t.shape[-1]).amax(dim=0)

    @torch.no_grad()
    def _measure_output(self, module, args, output):
        amax = self._channel_amax(output[0] if isinstance(output, tuple) else output)
        # the weight as this forward used it: its injected rows should have grown by growth^step
        w = module.weight.detach().abs().amax(dim=1).float()
        self._out.append(
            torch.stack(
                [amax[self.out_mask].max(), amax[~self.out_mask].max(), w[self.out_mask].max(), w[~self.out_mask].max()]
            )
        )

    @torch.no_grad()
    def _measure_swiglu(self, module, args):
        amax = self._channel_amax(args[0])
        self._swiglu.append(torch.stack([amax[self.swiglu_mask].max(), amax[~self.swiglu_mask].max()]))

    def read(self) -> dict[str, float]:
        """The maxima of the forward passes since the last call (one device sync)."""
        out = {}
        for keys, measured in ((("out", "weight"), self._out), (("swiglu",), self._swiglu)):
            if measured:
                values = torch.stack(measured).amax(dim=0).tolist()
                for i, key in enumerate(keys):
                    out.update({f"{key}_injected_amax": values[2 * i], f"{key}_other_amax": values[2 * i + 1]})
        self._out, self._swiglu = [], []
        return out

    @torch.no_grad()
    def grow(self, factor: float) -> None:
        for module in self.modules:
            scale_weight_rows(module.weight, self.rows, factor, self.optimizers)
        # COAT's FP8 weight copies follow optimizer steps by themselves; this is a change outside one
        from coat_megatron.fp8.weights import invalidate_weight_caches

        invalidate_weight_caches()


@torch.no_grad()
def scale_weight_rows(param: torch.nn.Parameter, rows: torch.Tensor, factor: float, optimizers: list) -> None:
    """Multiply ``rows`` of the 2-D model weight ``param`` by ``factor`` in the master weights of the
    (Megatron distributed, or COAT) optimizer that steps it, and in ``param`` itself (its BF16 value:
    the master's, as the optimizer writes it)."""
    n_cols = param.shape[1]
    index = (rows[:, None] * n_cols + torch.arange(n_cols, device=rows.device)).reshape(
        -1
    )  # in param's flat index space
    owners = 0
    for opt in optimizers:
        group_of = getattr(opt, "model_param_group_index_map", {})
        if param not in group_of:
            continue
        owners += 1
        span = opt._get_model_param_range_map(param)["param"]  # the slice of param this (DP) rank's shard holds
        local = index[(index >= span.start) & (index < span.end)] - span.start
        group_index, group_order = group_of[param]
        main = opt.optimizer.param_groups[group_index]["params"][group_order]
        if hasattr(opt.optimizer, "set_master_weight"):  # COAT's AdamW: FP32 masters, or split ones
            master = opt.optimizer.master_weight(main).clone()
            master.view(-1)[local] *= factor
            opt.optimizer.set_master_weight(main, master)  # split: also writes the BF16 high half, the model weight
        elif main.dtype == torch.float32:  # Megatron's FP32 main params
            master = main
            master.view(-1)[local] *= factor
        else:
            raise ValueError(
                f"the optimizer steps a {main.dtype} copy of the weight with no FP32 master: not a mode this benchmark injects into"
            )
        if main.dtype == torch.float32:
            param.data.view(-1)[local + span.start] = master.view(-1)[local].to(param.dtype)
    if owners == 0:
        raise ValueError(
            "no optimizer steps the injected weight (is the model wrapped in Megatron's DDP with its distributed optimizer?)"
        )


def pick_channels(count: int, width: int, seed: int) -> list[int]:
    """``count`` distinct channels of ``width``, drawn from ``seed`` (the same in every mode)."""
    if not 1 <= count <= width:
        raise ValueError(f"--channels {count}: choose 1 to {width}")
    return sorted(torch.randperm(width, generator=torch.Generator().manual_seed(seed))[:count].tolist())


def parse_layers(text: str, num_layers: int) -> list[int]:
    if text == "middle":
        return [num_layers // 2]
    if text == "all":
        return list(range(num_layers))
    return [int(i) for i in text.split(",")]


# ------------------------------------------------------------------------------------- one mode


def train_mode(preset: Preset, mode: Mode, args) -> list[dict]:
    """Train ``mode`` with the injection (in this process): one row per step."""
    from coat_compare import parallel
    from coat_compare.build import build_gpt, set_learning_rate, unwrap_optimizers
    from coat_compare.progress import Progress
    from coat_compare.train import forward_backward_function, train_step, training_windows

    rows = []
    with contextlib.ExitStack() as stack:
        parallel.initialize(1, 1, stack)
        parallel.seed_everything(args.seed)
        data = training_windows(preset, args.seed)
        (model,), optimizer = build_gpt(preset, mode, args.seed)  # one pipeline stage
        forward_backward = forward_backward_function()
        width = preset.hidden if args.target == "residual" else preset.ffn
        injection = OutlierInjection(
            model,
            unwrap_optimizers(optimizer),
            args.target,
            parse_layers(args.inject_layers, preset.layers),
            pick_channels(args.channels, width, args.seed),
        )
        device = parallel.device()
        progress = Progress(preset.steps, f"{NAME} {mode.name}")
        bad_in_a_row = 0
        for step in range(preset.steps):
            batch = {k: v.to(device) for k, v in data.batch(step).items()}
            set_learning_rate(optimizer, preset, step)
            loss, ok = train_step([model], optimizer, [batch], preset, None, forward_backward)
            rows.append(
                {
                    "kind": "step",
                    "mode": mode.name,
                    "step": step,
                    "factor": args.growth**step,
                    "loss": loss,
                    "finite": math.isfinite(loss),
                    "optimizer_stepped": ok,
                    **injection.read(),
                }
            )
            injection.grow(args.growth)
            progress.update(step + 1, loss=loss, act=rows[-1].get("out_injected_amax", float("nan")))
            bad_in_a_row = 0 if math.isfinite(loss) else bad_in_a_row + 1
            if bad_in_a_row >= args.patience:
                break
        progress.close()
    return rows


def summarize(mode: str, steps: list[dict], args) -> dict:
    """A mode's summary row from its step rows."""
    losses = [r["loss"] for r in steps]
    first = losses[0]

    def first_step(predicate):
        return next((r["step"] for r in steps if predicate(r)), None)

    tail = losses[-10:]
    row = {
        "steps_run": len(steps),
        "initial_loss": first,
        "final_loss": sum(tail) / len(tail),  # NaN when the run ended non-finite
        "min_loss": min((x for x in losses if math.isfinite(x)), default=None),
        "first_nonfinite_step": first_step(lambda r: not r["finite"]),
        "first_blowup_step": first_step(lambda r: not r["finite"] or r["loss"] > args.blowup * first),
        "skipped_optimizer_steps": sum(not r["optimizer_stepped"] for r in steps),
    }
    for key in ("out", "swiglu", "weight"):
        if f"{key}_injected_amax" in steps[0]:
            row[f"{key}_injected_amax_first"] = steps[0][f"{key}_injected_amax"]
            row[f"{key}_injected_amax_last"] = steps[-1][f"{key}_injected_amax"]
            row[f"{key}_other_amax_last"] = steps[-1][f"{key}_other_amax"]
            if key != "weight":
                for fmt, fmax in (("e4m3", E4M3_MAX), ("e5m2", E5M2_MAX)):
                    row[f"{key}_past_{fmt}_step"] = first_step(lambda r, k=key, m=fmax: r[f"{k}_injected_amax"] > m)
    return {"kind": "summary", "mode": mode, "status": "ok", **row}


# ------------------------------------------------------------------------------------- the job


def settings(preset: Preset, args) -> dict:
    return {
        "preset": preset.name,
        "layers": preset.layers,
        "hidden": preset.hidden,
        "ffn": preset.ffn,
        "seq": preset.seq,
        "micro_batch": preset.micro_batch,
        "steps": preset.steps,
        "lr": preset.lr,
        "target": args.target,
        "channels": args.channels,
        "inject_layers": parse_layers(args.inject_layers, preset.layers),
        "growth": args.growth,
        "blowup": args.blowup,
        "seed": args.seed,
    }


def run_worker(preset: Preset, mode: Mode, args) -> int:
    """``--worker``: one mode in this process; its rows go to {out}/outlier_stress-{mode}.jsonl."""
    start = time.perf_counter()
    steps = train_mode(preset, mode, args)
    summary = {
        **summarize(mode.name, steps, args),
        **settings(preset, args),
        "seconds": round(time.perf_counter() - start, 1),
    }
    with open(os.path.join(args.out, f"{NAME}-{mode.name}.jsonl"), "w") as f:
        for row in [*steps, summary]:
            f.write(json.dumps(row) + "\n")
    return 0


def option_args(args) -> list[str]:
    """The options that define a run (all but --modes), as command-line arguments."""
    given = []
    for name in (
        "preset",
        "steps",
        "micro_batch",
        "seq",
        "layers",
        "lr",
        "corpus",
        "corpus_bytes",
        "target",
        "channels",
        "inject_layers",
        "growth",
        "blowup",
        "patience",
        "seed",
    ):
        value = getattr(args, name)
        if value is not None:
            given += [f"--{name.replace('_', '-')}", str(value)]
    return given


def worker_command(mode: Mode, args) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--modes",
        mode.name,
        *option_args(args),
        "--out",
        args.out,
    ]


def run_mode(preset: Preset, mode: Mode, args) -> list[dict]:
    """A mode's rows: trained in a fresh process (so no mode inherits another's allocator, TE or
    Megatron state), or a skipped / failed summary row with the reason."""
    base = {"kind": "summary", "mode": mode.name, **settings(preset, args)}
    reason = unavailable_reason(mode, "train")
    if reason is None and preset.needs_gpu and not torch.cuda.is_available():
        reason = f"preset {preset.name} needs a GPU (on a CPU use --preset tiny)"
    if reason is not None:
        print(f"{mode.name}: skipped: {reason}", file=sys.stderr)
        return [{**base, "status": "skipped", "reason": reason}]
    rows_path = os.path.join(args.out, f"{NAME}-{mode.name}.jsonl")
    log_path = os.path.join(args.out, f"{NAME}-{mode.name}.log")
    if os.path.exists(rows_path):
        os.remove(rows_path)
    print(f"{mode.name}: training (log: {log_path})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(
                worker_command(mode, args), stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.mode_timeout
            )
        failure = None if proc.returncode == 0 and os.path.exists(rows_path) else f"exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        failure = f"stopped after {args.mode_timeout} s (--mode-timeout)"
    if failure is not None:
        from coat_compare.probe import why_it_died

        with open(log_path) as f:
            reason = f"{failure}: {why_it_died(f.read())}"[:400]
        print(f"{mode.name}: failed: {reason}", file=sys.stderr)
        return [{**base, "status": "failed", "reason": reason, "seconds": round(time.perf_counter() - start, 1)}]
    with open(rows_path) as f:
        rows = [json.loads(line) for line in f]
    s = rows[-1]
    print(
        f"{mode.name}: {s['steps_run']} steps in {s['seconds']} s, loss {s['initial_loss']:.3f} -> {s['final_loss']:.3f}, "
        f"first non-finite step {s['first_nonfinite_step']}",
        file=sys.stderr,
        flush=True,
    )
    return rows


def fmt_number(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, float) and (abs(x) >= 1e5 or 0 < abs(x) < 1e-2):
        return f"{x:.2e}"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def report(preset: Preset, args, rows: list[dict]) -> str:
    summaries = [r for r in rows if r["kind"] == "summary"]
    steps = {}
    for r in rows:
        if r["kind"] == "step":
            steps.setdefault(r["mode"], {})[r["step"]] = r
    swiglu = args.target != "residual"
    layer_list = ", ".join(map(str, parse_layers(args.inject_layers, preset.layers)))
    what = {
        "swiglu": "linear_fc1's gate and up rows",
        "gate": "linear_fc1's gate rows",
        "up": "linear_fc1's up rows",
        "residual": "linear_fc2's rows (residual channels)",
    }[args.target]
    command = " ".join(["python benchmarks/outlier_stress.py", "--modes", args.modes, *option_args(args)])
    versions = f"torch {torch.__version__}, megatron-core {package_version('megatron-core')}"
    te = package_version("transformer-engine") or package_version("transformer_engine")
    if te:
        versions += f", TransformerEngine {te}"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"a CPU ({os.cpu_count()} cores)"
    lines = [
        f"# Outlier stress: {', '.join(s['mode'] for s in summaries)}",
        "",
        f"`{command}`",
        "",
        f"On {device}; {versions}.",
        "",
        f"{preset.name}: {preset.layers} layers, hidden {preset.hidden}, FFN {preset.ffn}, seq {preset.seq} x micro-batch "
        f"{preset.micro_batch}, peak LR {preset.lr:g}, {preset.steps} steps, seed {args.seed} (same initial weights and batches "
        f"in every mode). Injected: {args.channels} channels of {what} in layer(s) {layer_list}, x{args.growth:g} after every "
        f"optimizer step (x{args.growth ** (preset.steps - 1):.3g} by the last step), in the masters and the model weights.",
        "",
        "| mode | status | steps | loss first -> last 10 | min loss | step: first non-finite loss | step: first loss > "
        f"{args.blowup:g}x first | injected max abs act first -> last | others last | step: act > 448 | step: act > 57344"
        + (" | SwiGLU out injected last | step: SwiGLU out > 448" if swiglu else "")
        + " | injected weight rows max abs first -> last | seconds |",
        "|" + "---|" * (13 + 2 * swiglu),
    ]
    for s in summaries:
        if s["status"] != "ok":
            lines.append(f"| {s['mode']} | {s['status']}: {s['reason']} |" + " |" * (11 + 2 * swiglu))
            continue
        cells = [
            s["mode"],
            "ok",
            s["steps_run"],
            f"{fmt_number(s['initial_loss'])} -> {fmt_number(s['final_loss'])}",
            fmt_number(s["min_loss"]),
            fmt_number(s["first_nonfinite_step"]),
            fmt_number(s["first_blowup_step"]),
            f"{fmt_number(s['out_injected_amax_first'])} -> {fmt_number(s['out_injected_amax_last'])}",
            fmt_number(s["out_other_amax_last"]),
            fmt_number(s["out_past_e4m3_step"]),
            fmt_number(s["out_past_e5m2_step"]),
        ]
        if swiglu:
            cells += [fmt_number(s["swiglu_injected_amax_last"]), fmt_number(s["swiglu_past_e4m3_step"])]
        cells += [
            f"{fmt_number(s['weight_injected_amax_first'])} -> {fmt_number(s['weight_injected_amax_last'])}",
            s["seconds"],
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += [
        "",
        "injected max abs act: max |output| over the injected channels of the injected linear (linear_fc1's output for "
        "the SwiGLU targets, linear_fc2's for residual) as the mode computes it (COAT's FP8 output dequantized); others: "
        "its other channels. SwiGLU out: linear_fc2's input in the injected FFN channels. Injected weight rows: as the "
        "forward read them (they grow by the factor unless the optimizer pushes back). Each mode stops after "
        f"{args.patience} non-finite losses in a row.",
    ]
    trained = [m for m in steps]
    if trained:
        every = max(1, preset.steps // 20)
        shown = sorted({i for m in trained for i in steps[m] if i % every == 0 or i == max(steps[m])})
        header = "| step | growth |" + "".join(
            f" {m} loss | {m} act |" + (f" {m} SwiGLU |" if swiglu else "") for m in trained
        )
        lines += ["", "## Per step", "", header, "|" + "---|" * (2 + len(trained) * (2 + swiglu))]
        for i in shown:
            cells = [str(i), fmt_number(args.growth**i, 3)]
            for m in trained:
                r = steps[m].get(i)
                cells += [fmt_number(r["loss"]) if r else "", fmt_number(r.get("out_injected_amax")) if r else ""]
                if swiglu:
                    cells.append(fmt_number(r.get("swiglu_injected_amax")) if r else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-125m")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--micro-batch", type=int, help="default: the preset's")
    p.add_argument("--seq", type=int, help="default: the preset's")
    p.add_argument("--layers", type=int, help="number of transformer layers (default: the preset's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    p.add_argument("--corpus", choices=list(SOURCES), help="default: the preset's")
    p.add_argument("--corpus-bytes", type=int, help="default: the preset's")
    p.add_argument("--modes", default="bf16,te-fp8-current,coat")
    p.add_argument("--target", choices=TARGETS, default="swiglu", help="which weight's rows grow (see above)")
    p.add_argument("--channels", type=int, default=4, help="how many channels grow")
    p.add_argument(
        "--inject-layers", default="middle", help="'middle' (layer L // 2), 'all', or 0-based layer numbers: 0,3"
    )
    p.add_argument(
        "--growth", type=float, default=1.03, help="factor applied to the injected rows after every optimizer step"
    )
    p.add_argument(
        "--blowup",
        type=float,
        default=1.5,
        help="report the first step whose loss exceeds this multiple of the first step's",
    )
    p.add_argument("--patience", type=int, default=3, help="stop a mode after this many non-finite losses in a row")
    p.add_argument("--seed", type=int, default=1, help="initial weights, data order and the injected channels")
    p.add_argument(
        "--mode-timeout", type=float, default=1800, help="seconds per mode before it is stopped (a failed row)"
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one mode, in this process
    args = p.parse_args(argv)
    if args.growth <= 0 or args.blowup <= 0 or args.patience < 1 or args.steps < 1:
        p.error("--growth and --blowup must be positive, --patience and --steps at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    preset = get_preset(args.preset)
    if preset.kind != "train":
        raise SystemExit(
            f"--preset {preset.name} is a one-layer preset; choose an end-to-end one (tiny, gpt-125m, ...)"
        )
    preset = preset.with_overrides(
        steps=args.steps,
        micro_batch=args.micro_batch,
        seq=args.seq,
        layers=args.layers,
        lr=args.lr,
        corpus=args.corpus,
        corpus_bytes=args.corpus_bytes,
    )
    modes = parse_modes(args.modes)
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        return run_worker(preset, modes[0], args)
    rows = [row for mode in modes for row in run_mode(preset, mode, args)]
    with open(os.path.join(args.out, f"{NAME}.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    text = report(preset, args, rows)
    with open(os.path.join(args.out, f"{NAME}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
