"""Charts for the report: inline SVG strings written by our own plotting layer (harness.report.svg), a few KB
and a few milliseconds each (no matplotlib, no files, no network)."""
from __future__ import annotations

import math

from harness.report.svg import (
    BAR,
    Figure,
    Scale,
    finite,
    legend_height,
    nice_ticks,
    num,
    padded,
    round_ticks,
    text_width,
    wrap,
)

from harness.precision import PRECISIONS

UNKNOWN_STYLE = ("#999999", "o")  # a name the registry does not hold (an edited record)
CYCLE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf")  # lines without a precision of their own (the loss scales), in label order

WIDTH = 640  # px, a single-panel chart
TITLE_SIZE = 13


def style(precision: str) -> tuple[str, str]:
    """(colour, marker) of a precision in every chart, from its registry entry (harness.precision.PRECISIONS);
    "fixed16_sr:12" and "fp16 (loss scale ...)" are drawn as fixed16_sr and fp16."""
    entry = PRECISIONS.get(_base(precision))
    return (entry.colour, entry.marker) if entry else UNKNOWN_STYLE


def _base(precision: str) -> str:
    return precision.partition(":")[0].partition(" ")[0]


def colour(precision: str) -> str:
    return style(precision)[0]


def marker(precision: str) -> str:
    return style(precision)[1]


def log_ticks(low: float, high: float) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k, denser for narrow ranges) spanning [low, high] on a log axis, so that
    a range of less than a decade still gets labelled ticks, and none crowd each other."""
    if not (finite(low) and finite(high)):
        return []
    low, high = max(low, 1e-12), max(high, low * 1.0001)
    for mantissas in ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8)):
        ticks = [m * 10.0**e for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
                 for m in mantissas]
        inside = [t for t in ticks if low <= t <= high]
        if len(inside) >= 3:
            return inside[:: max(1, len(inside) // 7 + (len(inside) % 7 > 0))] if len(inside) > 7 else inside
    # a narrow range: evenly spaced round numbers
    return round_ticks(low, high) or [low, high]


def _tick_label(value: float) -> str:
    return f"{value:g}" if value >= 1e-3 else f"{value:.0e}"


def _log_range(values: list[float]) -> tuple[list[float], float, float]:
    """Plain-number ticks and the view limits of a log axis over the positive finite values (a default decade
    when there are none)."""
    good = [v for v in values if finite(v) and v > 0]
    low, high = (min(good), max(good)) if good else (1.0, 10.0)
    ticks = log_ticks(low / 1.05, min(high * 1.05, 1e308)) or [low, high]
    return ticks, min(low, ticks[0]), max(high, ticks[-1])


def _lin_range(values: list[float], bins: int = 5, integer: bool = False, zero: bool = False
               ) -> tuple[list[float], float, float]:
    """Ticks and view limits of a linear axis over the finite values, 5% margins (from 0 with zero)."""
    good = [v for v in values if finite(v)]
    low, high = (min(good), max(good)) if good else (0.0, 1.0)
    if zero:
        low, high = 0.0, max(high, 0.0) * 1.05 or 1.0
    else:
        low, high = padded(low, high)
    return nice_ticks(low, high, bins=bins, integer=integer), low, high


def _log2_range(values: list[float]) -> tuple[list[float], float, float]:
    """Ticks at powers of two (every k-th exponent, at most 7) and the view limits of a log2 axis."""
    good = [v for v in values if finite(v) and v > 0]
    if not good:
        return [1.0, 2.0], 1.0, 2.0
    lo, hi = math.floor(math.log2(min(good))), math.ceil(math.log2(max(good)))
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    lo, hi = max(lo, -1000), min(hi, 1000)  # powers of two a float holds
    every = next(k for k in (1, 2, 3, 4, 5, 8, 10, 16, 20, 32, 50, 64, 100, 128, 256, 512, 1024, 2048)
                 if (hi - lo) // k + 1 <= 7 or k == 2048)
    ticks = [2.0**e for e in range(lo, hi + 1) if e % every == 0]
    return ticks, 2.0**lo, 2.0**hi


def _exp_label(value: float) -> str:
    return f"2^{round(math.log2(value))}"


def _start(title: str, width: float, entries: list, body: float) -> tuple[Figure, float]:
    """A figure with the title on top and the legend under it, `body` px left below them for the plot and its
    axes; returns the figure and the y where the body starts."""
    legend = legend_height(entries, width - 40) if entries else 0.0
    top = 28 + legend + (6 if legend else 0)
    fig = Figure(width, round(top + body), title)
    size = min(TITLE_SIZE, (width - 20) / max(text_width(title, 1), 1))
    fig.text(width / 2, 18, title, size=round(size, 1), anchor="middle", weight="600")
    if entries:
        fig.legend(entries, width / 2, 27, width - 40)
    return fig, top


def _left_margin(labels: list[str], axis_label: bool = True, size: float = 10) -> float:
    """Room for tick labels (and a rotated axis label beside them) left of a plot, or right of it."""
    widest = max((text_width(t, size) for t in labels), default=0.0)
    return 10 + (22 if axis_label else 0) + widest + 7


def _order(precision: str) -> tuple:
    """The registry's order (harness.precision.PRECISIONS), names it does not hold last."""
    base = _base(precision)
    return (list(PRECISIONS).index(base) if base in PRECISIONS else len(PRECISIONS), precision)


def step_times(rows: list[dict], title: str) -> str:
    """A dot plot: one line per framework, one marker per precision at its median step time, whiskers from p10 to
    p90; log x axis with plain-number ticks."""
    frameworks = list(dict.fromkeys(r["framework"] for r in rows))
    precisions = sorted({r["precision"] for r in rows}, key=_order)
    n = max(len(frameworks), 1)
    entries = [(p, {"marker": marker(p), "colour": colour(p), "whisker": True, "size": 8}) for p in precisions]
    ticks, low, high = _log_range([r.get(k) for r in rows for k in ("p10_ms", "median_ms", "p90_ms")])
    x = Scale(low / 1.08, high * 1.08, 10)
    names = [wrap(str(f), WIDTH * 0.38, 11) for f in frameworks]  # long labels (with their settings) in lines
    left = _left_margin(names, axis_label=False, size=11)
    row_h = max(38, 14 * max((name.count("\n") + 1 for name in names), default=1) + 10)
    fig, top = _start(title, WIDTH, entries, n * row_h + 46)
    ax = fig.axes(left, top, WIDTH - 16, top + n * row_h, x, Scale(-0.6, n - 0.4))
    ax.grid(xticks=ticks)
    step = 0.6 / max(len(precisions), 1)
    for i, precision in enumerate(precisions):
        mine = [r for r in rows if r["precision"] == precision and x.ok(r.get("median_ms"))]
        ys = [len(frameworks) - 1 - frameworks.index(r["framework"]) - (i - (len(precisions) - 1) / 2) * step
              for r in mine]
        # the marker is the geometric mean of repeat medians, the whiskers percentiles of all steps: with very
        # uneven repeats the marker can lie outside them (the whisker then reaches the marker)
        medians = [r["median_ms"] for r in mine]
        lows = [min(r["p10_ms"], m) if x.ok(r.get("p10_ms")) else m for r, m in zip(mine, medians)]
        highs = [max(r["p90_ms"], m) if x.ok(r.get("p90_ms")) else m for r, m in zip(mine, medians)]
        ax.whiskers_x(ys, lows, highs, colour(precision), width=1, cap=3)
        ax.markers(medians, ys, marker(precision), colour(precision), size=8)
    ax.yaxis(range(len(frameworks)), names[::-1], size=11)
    ax.xaxis(ticks, [_tick_label(t) for t in ticks], "ms per training step (median, whiskers p10-p90; log scale)")
    return fig.render()


def _curve(losses) -> list:
    return [None if v is None else v for v in losses]


def loss_curves(curves: dict[str, dict[str, list]], title: str) -> str:
    """One panel per framework; a line per precision (mean over repeats) of the training loss by step."""
    frameworks = sorted(curves)
    panels = max(len(frameworks), 1)
    precisions = sorted({p for c in curves.values() for p in c}, key=_order)
    entries = [(p, {"line": colour(p), "width": 1.5}) for p in precisions]
    values = [v for c in curves.values() for losses in c.values() for v in losses
              if v is not None and finite(v) and v > 0]
    ticks, low, high = _log_range(values)  # the panels share their y axis
    ylo, yhi = padded(low, high, base=10, margin=0.03)
    labels = [_tick_label(t) for t in ticks]
    left = _left_margin(labels)
    gap = 18
    panel_w = 300 if panels <= 3 else max(200, (1100 - left - 16) / panels - gap)
    width = max(480, round(left + panels * panel_w + (panels - 1) * gap + 16))
    panel_w = (width - left - 16 - (panels - 1) * gap) / panels
    plot_h = 190
    fig, top = _start(title, width, entries, 20 + plot_h + 46)
    top += 20  # each panel's title
    axes = []
    for j in range(panels):
        framework = frameworks[j] if frameworks else ""
        steps = max((len(v) for v in curves.get(framework, {}).values()), default=0)
        xticks, xlo, xhi = _lin_range([0, max(steps - 1, 1)], bins=4, integer=True)
        x0 = left + j * (panel_w + gap)
        ax = fig.axes(x0, top, x0 + panel_w, top + plot_h, Scale(xlo, xhi), Scale(ylo, yhi, 10))
        axes.append((framework, ax))
        ax.grid(yticks=ticks)
        fig.text(x0 + panel_w / 2, top - 7, str(framework), anchor="middle")
        ax.yaxis(ticks, labels, "training loss" if j == 0 else "", show_labels=j == 0)
        ax.xaxis(xticks, [f"{t:g}" for t in xticks], "step")
    for precision in precisions:  # a precision's lines in every panel, one after another (one <path>)
        for framework, ax in axes:
            losses = curves.get(framework, {}).get(precision)
            if losses is not None:
                ax.line(range(len(losses)), _curve(losses), colour(precision), width=1.5)
    return fig.render()


def loss_scales(histories: dict[str, list[float]], title: str) -> str:
    """The loss scale by step, one line per framework/precision."""
    items = sorted(histories.items())
    entries = [(str(label), {"line": CYCLE[i % len(CYCLE)], "width": 1.5}) for i, (label, _) in enumerate(items)]
    yticks, ylo, yhi = _log2_range([v for _, h in items for v in h])
    labels = [_exp_label(t) for t in yticks]
    steps = max((len(h) for _, h in items), default=0)
    xticks, xlo, xhi = _lin_range([0, max(steps - 1, 1)], bins=6, integer=True)
    left = _left_margin(labels)
    plot_h = 170
    fig, top = _start(title, WIDTH, entries, plot_h + 46)
    ax = fig.axes(left, top, WIDTH - 16, top + plot_h, Scale(xlo, xhi), Scale(*padded(ylo, yhi, 2, 0.05), 2))
    ax.grid(yticks=yticks)
    for i, (label, history) in enumerate(items):
        ax.step(range(len(history)), list(history), CYCLE[i % len(CYCLE)], width=1.5)
    ax.yaxis(yticks, labels, "loss scale")
    ax.xaxis(xticks, [f"{t:g}" for t in xticks], "step")
    return fig.render()


def _bin_exp(key) -> int | None:
    try:
        return int(key)
    except (TypeError, ValueError, OverflowError):
        return None


def gradient_histogram(series: dict[str, dict], scale_exp: int | None, title: str) -> str:
    """Micikevicius et al.'s Figure 3: the share of values per log2-magnitude bin, one line per tensor group,
    with float16's and bfloat16's representable ranges shaded and the loss scale's shift drawn."""
    from harness.numerics import FORMATS

    exps_seen = [e for h in series.values() for e in map(_bin_exp, h["bins"]) if e is not None]
    low, high = min(exps_seen, default=-30), max(exps_seen, default=10)
    xlo, xhi = low - 2, high + 3 + (scale_exp or 0)
    if xhi <= xlo:
        xhi = xlo + 1
    lines, entries = [], []
    for (label, h), line_colour in zip(series.items(), ("#4c72b0", "#55a868", "#c44e52", "#937860")):
        counts = {e: h["bins"].get(e, h["bins"].get(str(e), 0)) for e in range(low, high + 1)}
        total = sum(v for v in h["bins"].values() if finite(v)) or 1
        shares = [counts[e] / total if finite(counts[e]) else None for e in range(low, high + 1)]
        lines.append((list(range(low, high + 1)), shares, line_colour))
        entries.append((str(label), {"line": line_colour, "width": 1.5}))
        if scale_exp:
            entries.append((f"{label} x 2^{scale_exp}", {"line": line_colour, "width": 1, "dash": "dashed"}))
    spans = (("bfloat16", "#8172b3"), ("float16", "#dd8452"))
    entries += [(f"{fmt} range (subnormals included)", {"patch": c, "opacity": 0.12}) for fmt, c in spans]
    shares = [s for _, ys, _ in lines for s in ys if s is not None]
    yticks, ylo, yhi = _lin_range(shares, bins=5, zero=True)
    labels = [f"{t:g}" for t in yticks]
    left = _left_margin(labels)
    plot_h = 190
    fig, top = _start(title, WIDTH, entries, plot_h + 46)
    ax = fig.axes(left, top, WIDTH - 16, top + plot_h, Scale(xlo, xhi), Scale(ylo, yhi))
    for fmt, span_colour in spans:
        f = FORMATS[fmt]
        ax.vspan(max(f.min_subnormal_exp, low - 2), min(f.overflow_exp, high + 3), span_colour, 0.12)
    for fmt, span_colour in spans:
        ax.vline(FORMATS[fmt].min_normal_exp, span_colour, width=1, dash="dotted")
    for xs, ys, line_colour in lines:
        ax.step(xs, ys, line_colour, width=1.5)
        if scale_exp:
            ax.step([e + scale_exp for e in xs], ys, line_colour, width=1, dash="dashed")
    xticks = nice_ticks(xlo, xhi, bins=10, integer=True)
    ax.yaxis(yticks, labels, "share of non-zero values")
    ax.xaxis(xticks, [f"{t:g}" for t in xticks], "log2 |value|")
    return fig.render()


def loss_scale_study(points: list[dict], window: tuple[int, int] | None, title: str, figure: str = "accuracy",
                     label: str = "eval accuracy") -> str:
    """The final judged figure (points' `figure`, fp32's `fp32_<figure>`: eval accuracy, or a next-token model's
    eval loss) and skipped steps against log2 of the loss scale ('none' at the left, 'dynamic' at the right), the
    diagnosed static window shaded."""
    points = [p for p in points if finite(p.get("x"))]
    xs = [p["x"] for p in points]
    shaded = bool(window and window[0] is not None and window[1] is not None and finite(window[0])
                  and finite(window[1]) and window[0] <= window[1])
    fp32 = points[0].get(f"fp32_{figure}") if points else None
    fp32 = fp32 if finite(fp32) else None
    entries = []
    if shaded:
        entries.append(("diagnosed safe window", {"patch": "#55a868", "opacity": 0.15}))
    entries.append((label, {"line": "#4c72b0", "width": 1.5, "marker": "o", "size": 7}))
    if fp32 is not None:
        entries.append(("fp32", {"line": "#4c72b0", "width": 1, "dash": "dotted"}))
    entries.append(("skipped steps", {"patch": "#c44e52", "opacity": 0.35, "bar": True}))
    span = xs + (list(window) if shaded else [])
    x = Scale(*padded(min(span, default=0) - 0.4, max(span, default=1) + 0.4, margin=0.03))
    accuracies = [p.get(figure) for p in points]
    yticks, ylo, yhi = _lin_range(accuracies + [fp32], bins=5)
    skipped = [p.get("skipped") for p in points]
    sticks, slo, shi = _lin_range([s for s in skipped if finite(s) and s >= 0], bins=5, integer=True, zero=True)
    labels, slabels = [f"{t:g}" for t in yticks], [f"{t:g}" for t in sticks]
    left = _left_margin(labels)
    right = WIDTH - _left_margin(slabels)
    # the settings' names under their x, turned 45 degrees if they would collide
    names = [str(p.get("label", "")) for p in points]
    x.p0, x.p1 = left, right
    pixels = sorted(x(v) for v in xs)
    room = min((b - a for a, b in zip(pixels, pixels[1:])), default=right - left)
    rotate = room < max((text_width(t, 10) for t in names), default=0) + 6
    below = (14 + max((text_width(t, 10) for t in names), default=0) * 0.71) if rotate else 16
    plot_h = 180
    fig, top = _start(title, WIDTH, entries, plot_h + below + 30)
    ax = fig.axes(left, top, right, top + plot_h, x, Scale(ylo, yhi))
    bars = ax.twin(Scale(slo, shi))
    if shaded:
        ax.vspan(window[0], window[1], "#55a868", 0.15)
    ax.grid(yticks=yticks)
    bars.bars(xs, skipped, 0.8, "#c44e52", 0.35)
    if fp32 is not None:
        ax.hline(fp32, "#4c72b0", width=1, dash="dotted")
    ax.line(xs, accuracies, "#4c72b0", width=1.5)
    ax.markers(xs, accuracies, "o", "#4c72b0", size=7)
    ax.yaxis(yticks, labels, label)
    bars.yaxis(sticks, slabels, "skipped steps", right=True)
    ax.xaxis(xs, names, "loss scale", rotate=rotate)
    return fig.render()


GROUP_COLOURS = ("#4c72b0", "#55a868", "#8172b3", "#64b5cd", "#ccb974", "#937860", "#dd8452", "#c44e52", "#da8bc3",
                 "#8c8c8c", "#1b7f79")  # one per name of time_breakdown's order, in that order; "other" is grey
OTHER_COLOUR = "#d0d3d6"


def time_breakdown(bars: list[dict], order: list[str], title: str) -> str:
    """Horizontal stacked bars, one per {"label", "segments": [(name, ms), ...]}, on a linear ms axis; a colour
    per segment name, names in the legend (and colours) in `order`."""
    present = {name for b in bars for name, _ in b["segments"]}
    names = [name for name in order if name in present]
    colours = {name: OTHER_COLOUR if name == "other" else GROUP_COLOURS[i % len(GROUP_COLOURS)]
               for i, name in enumerate(order)}  # by place in `order`: the same colour in every chart
    entries = [(name, {"patch": colours[name], "bar": True}) for name in names]
    total = max((sum(ms for _, ms in b["segments"]) for b in bars), default=1.0) or 1.0
    ticks, low, high = _lin_range([0.0, total], zero=True)
    labels = [b["label"] for b in bars]
    left = _left_margin(labels, axis_label=False, size=11)
    row_h = 24
    fig, top = _start(title, WIDTH, entries, len(bars) * row_h + 46)
    ax = fig.axes(left, top, WIDTH - 16, top + len(bars) * row_h, Scale(low, high), Scale(-0.5, len(bars) - 0.5))
    ax.grid(xticks=ticks)
    for i, b in enumerate(bars):
        y = ax.y(len(bars) - 1 - i)
        start = 0.0
        for name, ms in b["segments"]:
            a, z = ax.x(start), ax.x(start + ms)
            if z - a > 0.05:
                fig.path(BAR, f"M{num(a)} {num(y - 8)}H{num(z)}V{num(y + 8)}H{num(a)}z", f' fill="{colours[name]}"')
            start += ms
    ax.yaxis(range(len(bars)), labels[::-1], size=11)
    ax.xaxis(ticks, [f"{t:g}" for t in ticks], "ms per profiled training step")
    return fig.render()


def _log_log(title: str, entries: list, xs: list, ys: list, y_pad: float):
    """A figure with log-log axes over these values (x padded by 1.3, y by `y_pad`), its grid drawn: (figure,
    axes, x scale, y scale, (x ticks, y ticks, y tick labels))."""
    xticks, xlo, xhi = _log_range(xs)
    yticks, ylo, yhi = _log_range(ys)
    x, y = Scale(xlo / 1.3, xhi * 1.3, 10), Scale(ylo / y_pad, yhi * y_pad, 10)
    labels = [_tick_label(t) for t in yticks]
    plot_h = 220
    fig, top = _start(title, WIDTH, entries, plot_h + 46)
    ax = fig.axes(_left_margin(labels), top, WIDTH - 16, top + plot_h, x, y)
    ax.grid(xticks=xticks, yticks=yticks)
    return fig, ax, x, y, (xticks, yticks, labels)


def speedup_scaling(series: dict[str, list[dict]], title: str) -> str:
    """A scaling study's speed-up over fp32 (y, log scale) against FLOPs per training step (x, log scale): a line
    per precision through its points (`x`, `y`), a vertical bar from `low` to `high` at each (dashed where it is a
    range, not an interval: `interval` False), and the 1.0 line, above which the precision is faster."""
    precisions = sorted(series, key=_order)
    entries = [(p, {"line": colour(p), "width": 1.5, "marker": marker(p), "size": 7}) for p in precisions]
    entries.append(("1.0: as fast as fp32", {"line": "#555555", "width": 1, "dash": "dashed"}))
    points = [pt for p in precisions for pt in series[p]]
    fig, ax, x, y, (xticks, yticks, labels) = _log_log(
        title, entries, [pt.get("x") for pt in points],
        [v for pt in points for v in (pt.get("low"), pt.get("high"), pt.get("y"))] + [1.0], 1.1)
    ax.hline(1.0, "#555555", width=1, dash="dashed")
    for p in precisions:
        pts = sorted((pt for pt in series[p] if x.ok(pt.get("x")) and y.ok(pt.get("y"))), key=lambda pt: pt["x"])
        for pt in pts:  # the interval of each size
            if y.ok(pt.get("low")) and y.ok(pt.get("high")):
                ax.line([pt["x"], pt["x"]], [pt["low"], pt["high"]], colour(p), width=1.2,
                        dash=None if pt.get("interval", True) else "dashed")
        ax.line([pt["x"] for pt in pts], [pt["y"] for pt in pts], colour(p), width=1.5)
        ax.markers([pt["x"] for pt in pts], [pt["y"] for pt in pts], marker(p), colour(p), size=7)
    ax.yaxis(yticks, labels, "speed-up over fp32 (log scale)")
    ax.xaxis(xticks, [_flop_label(t) for t in xticks], "FLOPs per training step (log scale)")
    return fig.render()


def memory_scaling(series: dict[str, list[dict]], title: str, by_batch: bool) -> str:
    """Peak memory saved against fp32 (y, linear, percent: below 0 the precision takes more) at each size (x, log
    scale: the batch size, or FLOPs per training step where not `by_batch`): a line per precision through its
    points (`x`, `y` a share)."""
    precisions = sorted(series, key=_order)
    entries = [(p, {"line": colour(p), "width": 1.5, "marker": marker(p), "size": 7}) for p in precisions]
    entries.append(("0: as much as fp32", {"line": "#555555", "width": 1, "dash": "dashed"}))
    points = [pt for p in precisions for pt in series[p]]
    xticks, xlo, xhi = _log_range([pt["x"] for pt in points])
    yticks, ylo, yhi = _lin_range([pt["y"] * 100 for pt in points] + [0.0])
    plot_h = 180
    labels = [f"{t:g}%" for t in yticks]
    fig, top = _start(title, WIDTH, entries, plot_h + 46)
    ax = fig.axes(_left_margin(labels), top, WIDTH - 16, top + plot_h, Scale(xlo / 1.3, xhi * 1.3, 10),
                  Scale(ylo, yhi))
    ax.grid(xticks=xticks, yticks=yticks)
    ax.hline(0.0, "#555555", width=1, dash="dashed")
    for p in precisions:
        pts = sorted((pt for pt in series[p] if ax.x.ok(pt["x"])), key=lambda pt: pt["x"])
        ax.line([pt["x"] for pt in pts], [pt["y"] * 100 for pt in pts], colour(p), width=1.5)
        ax.markers([pt["x"] for pt in pts], [pt["y"] * 100 for pt in pts], marker(p), colour(p), size=7)
    ax.yaxis(yticks, labels, "peak memory saved vs fp32")
    if by_batch:
        ax.xaxis(xticks, [f"{t:g}" for t in xticks], "batch size (log scale)")
    else:
        ax.xaxis(xticks, [_flop_label(t) for t in xticks], "FLOPs per training step (log scale)")
    return fig.render()


def _flop_label(value: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def matmul_curve(curves: dict[str, dict], steps: dict[str, list[dict]], title: str,
                 shapes: dict[str, dict] | None = None) -> str:
    """The device's matmul curve beside a model's steps, GFLOP/s (y, log scale) against FLOPs (x, log scale): a
    solid line per dtype through its square products' points (`curves[dtype]`: "style", the precision whose colour
    and marker it takes, and "points", each `x` = 2n^3 and `y`), a dashed line per precision through the
    model's training steps (`steps[precision]`: `x` FLOPs per step, `y` its achieved GFLOP/s), and small markers,
    no line, for the rates of the model's own matmul shapes per dtype (`shapes[dtype]`, as `curves`: `x` one
    product's FLOPs)."""
    precisions = sorted(steps, key=_order)
    shapes = shapes or {}
    entries = [(f"{dtype} matmul (n x n)", {"line": colour(c["style"]), "width": 1.5, "marker": marker(c["style"]),
                                            "size": 5}) for dtype, c in curves.items()]
    entries += [(f"{dtype} at the model's shapes", {"marker": marker(c["style"]), "colour": colour(c["style"]),
                                                    "size": 4}) for dtype, c in shapes.items()]
    entries += [(f"{p} step", {"line": colour(p), "width": 1.2, "dash": "dashed", "marker": marker(p), "size": 7})
                for p in precisions]
    points = [pt for c in [*curves.values(), *shapes.values()] for pt in c["points"]] + \
        [pt for p in precisions for pt in steps[p]]
    fig, ax, x, y, (xticks, yticks, labels) = _log_log(title, entries, [pt.get("x") for pt in points],
                                                       [pt.get("y") for pt in points], 1.2)

    def draw(pts, style_of, size, dash=None, width=1.5):
        pts = sorted((pt for pt in pts if x.ok(pt.get("x")) and y.ok(pt.get("y"))), key=lambda pt: pt["x"])
        ax.line([pt["x"] for pt in pts], [pt["y"] for pt in pts], colour(style_of), width=width, dash=dash)
        ax.markers([pt["x"] for pt in pts], [pt["y"] for pt in pts], marker(style_of), colour(style_of), size=size)

    for c in curves.values():
        draw(c["points"], c["style"], 5)
    for c in shapes.values():
        ax.markers([pt["x"] for pt in c["points"]], [pt["y"] for pt in c["points"]], marker(c["style"]),
                   colour(c["style"]), size=4)
    for p in precisions:
        draw(steps[p], p, 7, dash="dashed", width=1.2)
    ax.yaxis(yticks, labels, "GFLOP/s (log scale)")
    ax.xaxis(xticks, [_flop_label(t) for t in xticks], "FLOPs: one product (n x n: 2n^3), or one training step (log)")
    return fig.render()
