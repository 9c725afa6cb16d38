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


def gradient_histogram(series: dict[str, dict], scale_exp: int | None, title: str) -> str:
    """Micikevicius et al.'s Figure 3: the share of values per log2-magnitude bin, one line per tensor group,
    with float16's and bfloat16's representable ranges shaded and the loss scale's shift drawn."""
    from harness.numerics import FORMATS

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    low = min((int(e) for h in series.values() for e in h["bins"]), default=-30)
    high = max((int(e) for h in series.values() for e in h["bins"]), default=10)
    for fmt, colour in (("bfloat16", "#8172b3"), ("float16", "#dd8452")):
        f = FORMATS[fmt]
        ax.axvspan(max(f.min_subnormal_exp, low - 2), min(f.overflow_exp, high + 3), color=colour, alpha=0.12,
                   label=f"{fmt} range (subnormals included)")
        ax.axvline(f.min_normal_exp, color=colour, lw=0.8, ls=":")
    for (label, h), colour in zip(series.items(), ("#4c72b0", "#55a868", "#c44e52", "#937860")):
        total = sum(h["bins"].values()) or 1
        exps = np.arange(low, high + 1)
        ax.step(exps, [h["bins"].get(int(e), h["bins"].get(str(e), 0)) / total for e in exps], where="post",
                label=label, color=colour, lw=1.2)
        if scale_exp:
            ax.step(exps + scale_exp, [h["bins"].get(int(e), h["bins"].get(str(e), 0)) / total for e in exps],
                    where="post", color=colour, lw=0.8, ls="--", label=f"{label} x 2^{scale_exp}")
    ax.set_xlim(low - 2, high + 3 + (scale_exp or 0))
    ax.set_xlabel("log2 |value|")
    ax.set_ylabel("share of non-zero values")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    ax.set_title(title)
    return _svg(fig)


def loss_scale_study(points: list[dict], window: tuple[int, int] | None, title: str) -> str:
    """Final eval accuracy and skipped steps against log2 of the loss scale ('none' at the left, 'dynamic' at
    the right), the diagnosed static window shaded."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    xs = [p["x"] for p in points]
    if window and window[0] is not None and window[0] <= window[1]:
        ax.axvspan(window[0], window[1], color="#55a868", alpha=0.15, label="diagnosed safe window")
    ax.plot(xs, [p["accuracy"] for p in points], "o-", color="#4c72b0", label="eval accuracy")
    if points and points[0].get("fp32_accuracy") is not None:
        ax.axhline(points[0]["fp32_accuracy"], color="#4c72b0", ls=":", lw=1, label="fp32")
    ax.set_ylabel("eval accuracy")
    ax.set_xticks(xs, [p["label"] for p in points], rotation=45, fontsize=7)
    ax.set_xlabel("loss scale")
    twin = ax.twinx()
    twin.bar(xs, [p["skipped"] for p in points], color="#c44e52", alpha=0.35, width=0.8, label="skipped steps")
    twin.set_ylabel("skipped steps")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, frameon=False, loc="lower center")
    ax.set_title(title)
    return _svg(fig)
