"""PNG plots of a report, when matplotlib is installed (the ``report`` extra).

End to end: loss per step (one line per mode, validation losses as markers), memory per mode as
stacked bars (weights, grads, optimizer, activations, other), and the time of every measured step.
Per layer: fwd+bwd time and activation memory per mode. Without matplotlib nothing is drawn and ``draw`` says how to get it.
"""

from __future__ import annotations

import os

PARTS = ["weights", "grads", "optimizer", "activations", "other"]
INSTALL = "pip install -e '.[report]' (matplotlib)"


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw(out: str, name: str, rows: list[dict]) -> tuple[list[str], str]:
    """Write ``{out}/{name}-*.png``; returns (paths written, a note for the report)."""
    if not matplotlib_available():
        return [], f"Plots skipped: matplotlib is not installed; {INSTALL} and run again."
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    ok = {kind: [r for r in rows if r.get("kind") == kind and r.get("status") == "ok"] for kind in ("train", "layer")}
    paths = []

    def save(fig, suffix):
        path = os.path.join(out, f"{name}-{suffix}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    train = ok["train"]
    if train:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in train:
            (line,) = ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["mode"], linewidth=1)
            if r.get("valid_losses"):  # held-out loss: markers in the colour of the training curve
                steps, valid = zip(*r["valid_losses"])
                ax.plot(steps, valid, "o--", color=line.get_color(), markersize=4, label=f"{r['mode']} validation")
        ax.set(xlabel="step", ylabel="loss", title=f"{name}: training loss per step, validation loss (markers)")
        ax.legend()
        save(fig, "loss")

        fig, ax = plt.subplots(figsize=(7, 4))
        gib = max(r["peak_MiB"] for r in train) >= 1024
        bottoms = [0.0] * len(train)
        for part in PARTS:
            values = [(r.get(f"{part}_MiB") or 0.0) / (1024 if gib else 1) for r in train]
            if any(values):
                ax.bar([r["mode"] for r in train], values, bottom=bottoms, label=part)
                bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.set(ylabel="GiB" if gib else "MiB", title=f"{name}: memory by part (top of the bar: peak in a step)")
        ax.legend()
        ax.tick_params(axis="x", rotation=30)
        save(fig, "memory")

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in train:
            ax.plot(
                range(1, len(r["step_ms_per_step"]) + 1),
                r["step_ms_per_step"],
                label=f"{r['mode']} (median {r['step_ms']:.1f})",
            )
        ax.set(xlabel="measured step", ylabel="ms", title=f"{name}: step time")
        ax.legend()
        save(fig, "step-time")

    layer = ok["layer"]
    if layer:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        modes = [r["mode"] for r in layer]
        left.bar(modes, [r["ms"] for r in layer])
        left.set(ylabel="ms", title="fwd+bwd time")
        right.bar(modes, [r["activation_MiB"] for r in layer])
        right.set(ylabel="MiB", title="activation memory")
        for ax in (left, right):
            ax.tick_params(axis="x", rotation=30)
        fig.suptitle(name)
        save(fig, "layer")
    return paths, "Plots: " + ", ".join(os.path.basename(p) for p in paths) if paths else ""
