"""The report's charts (harness/report/charts.py on harness/report/svg.py): well-formed SVG with its tick labels,
legends and titles as real text, bad values skipped, empty inputs drawn empty, the same bytes for the same input,
and no matplotlib anywhere in the harness."""
from __future__ import annotations

import ast
import math
import re
import xml.etree.ElementTree as ET

import pytest

from harness.report import charts, svg
from tests.conftest import ROOT

NS = "{http://www.w3.org/2000/svg}"


def parse(chart: str) -> ET.Element:
    assert chart.startswith("<svg") and chart.endswith("</svg>")
    root = ET.fromstring(chart)  # raises on anything not well-formed
    assert root.tag == f"{NS}svg" and float(root.get("width")) >= 300 and root.get("viewBox")
    assert not re.search(r"\b(nan|inf)\b", chart, re.I), "a non-finite number reached the SVG"
    return root


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{NS}text")]


def numeric_labels(chart: str) -> list[float]:
    return [float(v) for v in re.findall(r">([0-9.]+)</text>", chart)]


def subpaths(root: ET.Element, colour: str) -> int:
    """How many separate pieces the lines of one colour are drawn in."""
    return sum(p.get("d").count("M") for p in root.iter(f"{NS}path") if p.get("stroke") == colour
               and p.get("transform"))


def rows(spread: float = 1.0) -> list[dict]:
    out = []
    for framework, base in (("torch", 3.2), ("tensorflow", 4.1), ("mxnet", 5.5), ("jax", 2.4)):
        for precision, factor in (("fp32", 1), ("amp_bf16", 0.7), ("amp_fp16", 0.65)):
            m = base * factor
            out.append({"framework": framework, "precision": precision, "median_ms": m, "p10_ms": m * 0.9 / spread,
                        "p90_ms": m * 1.2 * spread})
    return out


# ---- ticks ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("low, high", [(2.9, 4.6), (6.5, 7.2), (0.5, 200), (1, 10), (3.3, 3.9), (0.7, 0.95),
                                       (16.3, 28.1), (125.4, 125.6), (0.00123, 0.00125), (1e-6, 3e-3)])
def test_log_ticks_are_few_round_numbers_inside_the_range(low, high):
    ticks = charts.log_ticks(low, high)
    assert 3 <= len(ticks) <= 7 and all(low <= t <= high for t in ticks) and ticks == sorted(ticks)
    assert all(len(f"{t:g}") <= 7 for t in ticks)
    if high / low < 1.5:  # a narrow range: evenly spaced
        steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:])}
        assert len(steps) == 1


def test_log_ticks_keep_their_decades_and_survive_bad_input():
    assert charts.log_ticks(1, 1000) == [1, 10, 100, 1000]
    assert charts.log_ticks(1, 10) == [1, 2, 5, 10]
    assert charts.log_ticks(6.5, 7.2) == [6.6, 6.8, 7.0, 7.2]  # no float noise (6.6000000000000005)
    assert charts.log_ticks(5, 5)  # a single value still gets ticks
    assert charts.log_ticks(math.nan, 10) == [] and charts.log_ticks(1, math.inf) == []


def test_nice_ticks_are_evenly_spaced_round_numbers():
    assert svg.nice_ticks(0, 1, bins=5) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert svg.nice_ticks(0, 3, bins=4, integer=True) == [0, 1, 2, 3]
    assert svg.nice_ticks(-42, 13, bins=10, integer=True) == [-40, -30, -20, -10, 0, 10]
    assert svg.nice_ticks(2, 2) == [2] and svg.nice_ticks(math.nan, 1) == []


# ---- the charts -------------------------------------------------------------------------------------
def test_step_times_is_a_dot_plot_with_plain_log_ticks_and_a_legend():
    chart = charts.step_times(rows(), "m: step time")
    root = parse(chart)
    words = texts(root)
    assert "m: step time" in words and root.find(f"{NS}title").text == "m: step time"
    assert {"torch", "tensorflow", "mxnet", "jax", "fp32", "amp_bf16", "amp_fp16"} <= set(words)
    assert any("ms per training step" in w for w in words)
    labels = numeric_labels(chart)
    assert len(labels) >= 3 and labels == sorted(labels)
    assert "10^" not in chart and "times 10" not in chart and "e+" not in chart
    for precision in ("fp32", "amp_bf16", "amp_fp16"):
        assert charts.colour(precision) in chart
    # frameworks top to bottom in their given order
    ys = {t.text: float(t.get("y")) for t in root.iter(f"{NS}text")}
    assert ys["torch"] < ys["tensorflow"] < ys["mxnet"] < ys["jax"]


def test_step_times_skips_bad_values_and_draws_nothing_for_nothing():
    bad = rows()
    bad[0].update(median_ms=math.nan)
    bad[1].update(median_ms=-1.0)
    bad[2].update(p10_ms=0.0, p90_ms=None)
    bad[3].update(median_ms=None, p10_ms=math.inf)
    parse(charts.step_times(bad, "bad"))
    everything_bad = [{**r, "median_ms": math.nan, "p10_ms": -1, "p90_ms": math.inf} for r in rows()]
    parse(charts.step_times(everything_bad, "all bad"))
    root = parse(charts.step_times([], "empty"))
    assert "empty" in texts(root)


def test_step_times_wraps_long_framework_labels_into_lines():
    long = "torch (loss scale dynamic from 65536, growth every 2000)"
    root = parse(charts.step_times([{**r, "framework": long if r["framework"] == "torch" else r["framework"]}
                                    for r in rows()], "t"))
    (label,) = [t for t in root.iter(f"{NS}text") if (t.text or "").startswith("torch")]
    lines = [label.text] + [s.text for s in label.iter(f"{NS}tspan")]
    assert len(lines) == 2 and " ".join(lines) == long


def curves() -> dict:
    def curve(start, rate):
        return [start * math.exp(-rate * s) + 0.01 for s in range(40)]

    return {"torch": {"fp32": curve(2.3, 0.1), "amp_fp16": curve(2.3, 0.08)},
            "jax": {"fp32": curve(2.2, 0.1), "bf16": curve(2.4, 0.05)}}


def test_loss_curves_has_a_panel_per_framework_sharing_a_log_axis():
    chart = charts.loss_curves(curves(), "m: training loss")
    root = parse(chart)
    words = texts(root)
    assert {"jax", "torch", "fp32", "amp_fp16", "bf16", "training loss"} <= set(words)
    assert words.count("step") == 2  # an x label under each panel
    assert len(numeric_labels(chart)) >= 3 + 2 * 3  # the shared y axis once, each panel's steps
    assert subpaths(root, charts.colour("fp32")) == 1 + 2  # the legend's sample, a line in each panel
    jax_x, torch_x = (float(t.get("x")) for t in root.iter(f"{NS}text") if t.text in ("jax", "torch"))
    assert jax_x < torch_x  # panels in sorted order


def test_loss_curves_leave_gaps_for_none_nan_and_non_positive_values():
    data = curves()
    data["torch"]["fp32"][10:13] = [None, math.nan, -1.0]
    data["torch"]["fp32"][30] = 0.0
    data["torch"]["fp32"][35] = math.inf
    root = parse(charts.loss_curves(data, "gaps"))
    assert subpaths(root, charts.colour("fp32")) == 1 + 1 + 4  # legend, jax's line, torch's in four pieces
    parse(charts.loss_curves({"torch": {"fp32": [None, None], "fp16": []}}, "nothing to draw"))
    parse(charts.loss_curves({}, "no panel"))


def test_a_long_noisy_curve_is_thinned_but_keeps_its_spike():
    losses = [1.0 + 0.01 * (s % 7) for s in range(20000)]
    losses[12345] = 50.0
    chart = charts.loss_curves({"torch": {"fp32": losses}}, "long")
    root = parse(chart)
    (line,) = [p for p in root.iter(f"{NS}path") if p.get("stroke") == charts.colour("fp32") and p.get("transform")]
    (run,) = [r for r in line.get("d").split("M") if "l" in r]  # the line (the legend's sample is "x y h44")
    numbers = [int(v) for v in re.findall(r"-?\d+", run)]
    assert len(numbers) < 2000  # a vertex every few pixels, not 20,000
    top_of_plot = min(float(t.get("y")) for t in root.iter(f"{NS}text") if t.text == "torch")
    ys, y = [], numbers[1]  # half pixels: an absolute start, then relative pairs
    for dy in numbers[3::2]:
        y += dy
        ys.append(y / 2)
    assert top_of_plot < min(ys) < top_of_plot + 30  # the spike still reaches the top of the plot
    assert max(ys) > top_of_plot + 150  # and the rest lies low


def test_loss_scales_are_step_lines_on_a_log2_axis():
    histories = {"torch amp_fp16": [65536.0] * 10 + [32768.0] * 30 + [65536.0] * 20,
                 "jax amp_fp16": [32768.0] * 5 + [16384.0] * 55}
    chart = charts.loss_scales(histories, "m: loss scale")
    root = parse(chart)
    words = texts(root)
    assert {"torch amp_fp16", "jax amp_fp16", "loss scale", "step", "2^14", "2^15", "2^16"} <= set(words)
    assert not re.search(r">\d+\.\d+e", chart)
    # a step line: only horizontal and vertical moves (relative l with a zero in each pair)
    for path in root.iter(f"{NS}path"):
        if path.get("transform") and "l" in path.get("d"):
            for run in path.get("d").split("M")[1:]:
                pairs = re.findall(r"(-?\d+) ?(-?\d+)", run.split("l", 1)[1]) if "l" in run else []
                assert all(a == "0" or b == "0" for a, b in pairs)
    parse(charts.loss_scales({"x": [0.0, -1.0, math.nan, None, math.inf]}, "bad"))
    parse(charts.loss_scales({}, "empty"))


def test_gradient_histogram_shades_both_ranges_and_draws_the_shift():
    series = {"weight gradients": {"bins": {str(e): int(1000 * math.exp(-((e + 12) / 5) ** 2)) for e in range(-30, 0)}},
              "activation gradients": {"bins": {e: 500 for e in range(-40, -5)}}}
    chart = charts.gradient_histogram(series, 8, "m (torch): gradients")
    root = parse(chart)
    words = texts(root)
    assert {"weight gradients", "activation gradients", "weight gradients x 2^8", "activation gradients x 2^8",
            "float16 range (subnormals included)", "bfloat16 range (subnormals included)",
            "log2 |value|", "share of non-zero values"} <= set(words)
    shaded = {p.get("fill") for p in root.iter(f"{NS}path") if p.get("fill-opacity")}
    assert {"#8172b3", "#dd8452"} <= shaded  # bfloat16's and float16's ranges
    dotted = [p for p in root.iter(f"{NS}path") if p.get("stroke-dasharray") and not p.get("transform")]
    assert dotted  # float16's smallest normal, 2^-14, lies in view
    dashed = [p for p in root.iter(f"{NS}path") if p.get("stroke-dasharray") and p.get("transform")]
    assert len(dashed) == 2  # the shifted lines
    assert len(numeric_labels(chart)) >= 3
    assert charts.gradient_histogram(series, None, "t").count("x 2^") == 0
    parse(charts.gradient_histogram({"w": {"bins": {"-3": math.nan, "x": 4, "-5": 2}}}, 3, "odd bins"))
    parse(charts.gradient_histogram({}, None, "empty"))


def points() -> list[dict]:
    return [{"x": x, "label": label, "accuracy": acc, "skipped": skipped, "fp32_accuracy": 0.91}
            for x, label, acc, skipped in ((-3, "none", 0.5, 0), (0, "2^0", 0.7, 0), (4, "2^4", 0.9, 0),
                                           (16, "2^16", 0.9, 2), (32, "2^32", 0.1, 20), (35, "dynamic", 0.9, 1))]


def test_loss_scale_study_has_settings_as_ticks_and_two_y_axes():
    chart = charts.loss_scale_study(points(), (3, 16), "m (torch amp_fp16): loss-scale study")
    root = parse(chart)
    words = texts(root)
    assert {"none", "2^0", "2^4", "2^16", "2^32", "dynamic", "eval accuracy", "skipped steps", "loss scale",
            "fp32", "diagnosed safe window"} <= set(words)
    assert words.count("skipped steps") == 2 and words.count("eval accuracy") == 2  # legend and axis label
    assert any(0 <= v <= 1 for v in numeric_labels(chart)) and 20 in numeric_labels(chart)
    bars = [p for p in root.iter(f"{NS}path") if p.get("fill") == "#c44e52"]
    assert bars and bars[0].get("d").count("z") == 1 + 3  # the legend's sample and three bars (others are 0)
    assert "#55a868" in chart and 'stroke-dasharray' in chart  # the window shaded, fp32 dotted


def test_loss_scale_study_survives_missing_pieces():
    odd = points()
    odd[1]["accuracy"] = math.nan
    odd[2]["skipped"] = None
    odd[3]["x"] = math.inf
    for p in odd:
        p["fp32_accuracy"] = None
    root = parse(charts.loss_scale_study(odd, None, "odd"))
    assert "fp32" not in texts(root) and "diagnosed safe window" not in texts(root)
    parse(charts.loss_scale_study(odd, (None, None), "no window"))
    parse(charts.loss_scale_study(odd, (20, 3), "inverted window"))
    parse(charts.loss_scale_study([], None, "empty"))


# ---- every chart ------------------------------------------------------------------------------------
def every_chart(title: str) -> list[str]:
    hist = {"w": {"bins": {"-20": 3, "-10": 5}}}
    return [charts.step_times(rows(), title), charts.loss_curves(curves(), title),
            charts.loss_scales({"a": [2.0**16, 2.0**15]}, title), charts.gradient_histogram(hist, 4, title),
            charts.loss_scale_study(points(), (3, 16), title)]


def test_titles_are_escaped_and_output_is_deterministic():
    title = 'evil <script>alert("x")</script> & model'
    for chart in every_chart(title):
        root = parse(chart)
        assert "<script>" not in chart and title in texts(root) and root.find(f"{NS}title").text == title
    assert every_chart("same") == every_chart("same")
    assert all("id=" not in chart and "<style" not in chart for chart in every_chart("t"))  # safe to inline many


def test_no_matplotlib_in_the_harness():
    for path in sorted((ROOT / "harness").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "matplotlib" for n in names), f"{path} imports matplotlib"


def test_extreme_and_odd_values_never_crash_a_chart():
    odd = [1e308, -1e308, 1e-320, 2**1030, 0.0, -1.0, math.nan, math.inf, None, True, "x", 5]
    for i, v in enumerate(odd):
        w = odd[(i + 3) % len(odd)]
        parse(charts.step_times([{"framework": "a", "precision": "fp32", "median_ms": v, "p10_ms": w,
                                  "p90_ms": 2.0}, {"framework": "b", "precision": "fp32", "median_ms": 3.0,
                                                   "p10_ms": v, "p90_ms": w}], "t"))
        parse(charts.loss_curves({"a": {"fp32": [v, w, 1.0, v]}, "b": {"fp16": [w]}}, "t"))
        parse(charts.loss_scales({"a": [v, w, 2.0, v]}, "t"))
        parse(charts.gradient_histogram({"w": {"bins": {"-3": v, "4": w, "0": 1}}}, 3, "t"))
        parse(charts.loss_scale_study([{"x": v, "label": "a", "accuracy": w, "skipped": v, "fp32_accuracy": w},
                                       {"x": 1, "label": "b", "accuracy": v, "skipped": w, "fp32_accuracy": v}],
                                      (v, w), "t"))


# ---- one style per precision ------------------------------------------------------------------------------
def test_every_precision_of_the_registry_has_its_own_colour_and_marker_in_its_order():
    from harness.precision import PRECISIONS

    styles = [charts.style(p) for p in PRECISIONS]
    assert len({c for c, _ in styles}) == len({m for _, m in styles}) == len(PRECISIONS), \
        "a precision added to harness.precision needs a colour and a marker of its own (its colour= and marker=)"
    assert charts.UNKNOWN_STYLE not in styles
    assert charts.style("fixed16_sr:12") == charts.style("fixed16_sr") == charts.style("fixed16_sr (loss scale x)")
    assert sorted(reversed(PRECISIONS), key=charts._order) == list(PRECISIONS)
    drawn = {svg.marker_path(m, 10, 10, 8, "#000") for _, m in styles}
    assert len(drawn) == len(PRECISIONS)  # every marker is drawn as a shape of its own


def test_the_pure_16_bit_arms_are_drawn_each_in_its_own_colour():
    arms = ("fp32", "bf16", "bf16_sr", "bf16_kahan", "fp16", "fp16_sr", "fixed16_rn", "fixed16_sr:12")
    chart = charts.loss_curves({"torch": {p: [2.0 - 0.1 * i * s for s in range(5)] for i, p in enumerate(arms)}},
                               "pure 16-bit")
    root = parse(chart)
    strokes = {p.get("stroke") for p in root.iter(f"{NS}path") if p.get("transform")}
    assert {charts.colour(p) for p in arms} <= strokes and len({charts.colour(p) for p in arms}) == len(arms)
    legend = [t for t in texts(root) if t in arms]
    assert legend == ["fp32", "fp16", "bf16", "bf16_sr", "fp16_sr", "bf16_kahan", "fixed16_sr:12", "fixed16_rn"]
    markers = parse(charts.step_times([{"framework": "torch", "precision": p, "median_ms": 1.0 + i, "p10_ms": 1.0,
                                        "p90_ms": 9.0} for i, p in enumerate(arms)], "t"))
    fills = {p.get("fill") for p in markers.iter(f"{NS}path")} | {p.get("stroke") for p in markers.iter(f"{NS}path")}
    assert {charts.colour(p) for p in arms} <= fills
