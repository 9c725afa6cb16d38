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


MARKERS = {"fp32": "o", "tf32": "D", "amp_fp16": "s", "amp_bf16": "^", "fp16": "v", "bf16": "P", "fp64": "X"}
PRECISION_ORDER = ("fp64", "fp32", "tf32", "amp_bf16", "amp_fp16", "bf16", "fp16")


def colour(precision: str) -> str:
    """The one colour of a precision in every chart (and the page's legend)."""
    return PALETTE.get(precision, "#999999")


def log_ticks(low: float, high: float) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k, denser for narrow ranges) spanning [low, high] on a log axis, so that
    a range of less than a decade still gets labelled ticks, and none crowd each other."""
    low, high = max(low, 1e-12), max(high, low * 1.0001)
    for mantissas in ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8)):
        ticks = [m * 10.0**e for e in range(int(np.floor(np.log10(low))) - 1, int(np.ceil(np.log10(high))) + 1)
                 for m in mantissas]
        inside = [t for t in ticks if low <= t <= high]
        if len(inside) >= 3:
            return inside[:: max(1, len(inside) // 7 + (len(inside) % 7 > 0))] if len(inside) > 7 else inside
    from matplotlib.ticker import (
        MaxNLocator,  # a narrow range: evenly spaced round numbers
    )

    return [float(t) for t in MaxNLocator(nbins=4).tick_values(low, high) if low <= t <= high] or [low, high]


def _tick_label(value: float) -> str:
    return f"{value:g}" if value >= 1e-3 else f"{value:.0e}"


def _log_axis(axis, low: float, high: float) -> list[float]:
    """A log axis labelled with plain round numbers only (no crowded '3x10^0 4x10^0' minor labels)."""
    from matplotlib.ticker import (
        FixedLocator,
        FuncFormatter,
        NullFormatter,
        NullLocator,
    )

    ticks = log_ticks(low / 1.05, high * 1.05)
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: _tick_label(v)))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())
    return ticks


def step_times(rows: list[dict], title: str) -> str:
    """A dot plot: one line per framework, one marker per precision at its median step time, whiskers from p10 to
    p90; log x axis with plain-number ticks."""
    plt = _pyplot()
    frameworks = list(dict.fromkeys(r["framework"] for r in rows))
    precisions = sorted({r["precision"] for r in rows},
                        key=lambda p: (PRECISION_ORDER.index(p) if p in PRECISION_ORDER else 99, p))
    fig, ax = plt.subplots(figsize=(6.4, 0.55 * len(frameworks) + 1.3))
    step = 0.6 / max(len(precisions), 1)
    for i, precision in enumerate(precisions):
        mine = [r for r in rows if r["precision"] == precision]
        y = [len(frameworks) - 1 - frameworks.index(r["framework"]) - (i - (len(precisions) - 1) / 2) * step
             for r in mine]
        median = np.array([r["median_ms"] for r in mine])
        err = [median - np.array([r["p10_ms"] for r in mine]), np.array([r["p90_ms"] for r in mine]) - median]
        ax.errorbar(median, y, xerr=err, fmt=MARKERS.get(precision, "o"), color=colour(precision), ms=6,
                    elinewidth=1, capsize=2, label=precision)
    ax.set_yticks(range(len(frameworks)), frameworks[::-1])
    ax.set_ylim(-0.6, len(frameworks) - 0.4)
    ax.set_xscale("log")
    low = min(r["p10_ms"] for r in rows)
    high = max(r["p90_ms"] for r in rows)
    ticks = _log_axis(ax.xaxis, low, high)
    ax.set_xlim(min(low, ticks[0]) / 1.08, max(high, ticks[-1]) * 1.08)
    ax.grid(axis="x", color="#e3e6e9", lw=0.6)
    ax.set_xlabel("ms per training step (median, whiskers p10-p90; log scale)")
    ax.legend(fontsize=8, frameon=False, ncol=min(len(precisions), 4), loc="lower center",
              bbox_to_anchor=(0.5, 1.0))
    ax.set_title(title, pad=22)
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
            ax.plot(np.arange(len(values)), values, label=precision, color=colour(precision), lw=1.2)
        ax.set_title(framework)
        ax.set_xlabel("step")
        ax.set_yscale("log")
    values = [v for c in curves.values() for losses in c.values() for v in losses
              if v is not None and np.isfinite(v) and v > 0]
    if values:
        _log_axis(axes[0][0].yaxis, min(values), max(values))  # the panels share their y axis
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
