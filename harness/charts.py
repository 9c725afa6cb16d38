"""Charts for the report: matplotlib figures rendered to inline SVG strings (no files, no network)."""
from __future__ import annotations

import io

import numpy as np

PALETTE = {"fp32": "#4c72b0", "tf32": "#64b5cd", "amp_fp16": "#dd8452", "amp_bf16": "#55a868",
           "fp16": "#c44e52", "bf16": "#8172b3", "fp64": "#937860"}


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})  # reproducible output
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML prologue and DOCTYPE: the SVG sits inside HTML


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "amp-harness", "font.size": 9,
                                "axes.spines.top": False, "axes.spines.right": False})
    import matplotlib.pyplot as plt

    return plt


def step_times(rows: list[dict], title: str) -> str:
    """Horizontal bars: median step time per framework/precision, whiskers from p10 to p90."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 0.38 * len(rows) + 1.0))
    labels = [f"{r['framework']} {r['precision']}" for r in rows]
    median = np.array([r["median_ms"] for r in rows])
    lo = median - np.array([r["p10_ms"] for r in rows])
    hi = np.array([r["p90_ms"] for r in rows]) - median
    y = np.arange(len(rows))[::-1]
    ax.barh(y, median, xerr=[lo, hi], color=[PALETTE.get(r["precision"], "#999") for r in rows],
            error_kw={"elinewidth": 1, "capsize": 2})
    ax.set_yticks(y, labels)
    ax.set_xlabel("ms per training step (median, whiskers p10-p90; log scale)")
    ax.set_xscale("log")
    ax.set_title(title)
    return _svg(fig)


def loss_curves(curves: dict[str, dict[str, list]], title: str) -> str:
    """One panel per framework; a line per precision (mean over repeats) of the training loss by step."""
    plt = _pyplot()
    frameworks = sorted(curves)
    fig, axes = plt.subplots(1, len(frameworks), figsize=(3.2 * len(frameworks) + 0.6, 2.8), squeeze=False,
                             sharey=True)
    for ax, framework in zip(axes[0], frameworks):
        for precision, losses in sorted(curves[framework].items()):
            values = np.array([np.nan if v is None else v for v in losses], dtype=float)
            ax.plot(np.arange(len(values)), values, label=precision, color=PALETTE.get(precision, "#999"), lw=1.2)
        ax.set_title(framework)
        ax.set_xlabel("step")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("training loss")
    axes[0][-1].legend(fontsize=8, frameon=False)
    fig.suptitle(title)
    return _svg(fig)


def loss_scales(histories: dict[str, list[float]], title: str) -> str:
    """The loss scale by step, one line per framework/precision."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 2.6))
    for label, history in sorted(histories.items()):
        ax.step(np.arange(len(history)), history, where="post", label=label, lw=1.2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title)
    return _svg(fig)
