"""The report's first screen, its wording and its charts, from constructed records whose outcome is known:
mixed outcomes across frameworks, runs too short to judge accuracy, flat loss scales, two devices."""
from __future__ import annotations

import itertools
import math
import zlib
import re

import numpy as np
import pytest

from harness.report import build_view, render, write_report
from harness.report.charts import log_ticks

_ids = itertools.count()


def record(framework: str, precision: str, ms: float, repeat: int = 0, model: str = "m", device: str = "cpu",
           description: str = "test cpu", accuracy: float = 0.9, classes: int = 10, history=None, skipped: int = 0,
           loss=None, flops: int | None = None, flags=(), peaks: dict | None = None) -> dict:
    # the step-time noise depends on the record's own figures, not on how many records tests made before it
    rng = np.random.default_rng(zlib.crc32(f"{framework} {precision} {ms!r} {repeat} {model}".encode()))
    steps = list(ms * np.exp(rng.normal(0, 0.01, 20)))
    scale = None
    if history is not None:
        scale = {"settings": {"mode": "dynamic", "initial": history[0], "growth_interval": 2000},
                 "initial": history[0], "final": history[-1], "skipped_steps": skipped,
                 "first_overflow_step": 3 if skipped else None, "history": history}
    return {"schema": 3, "run_id": f"r{next(_ids)}", "framework": framework, "framework_version": "1.0",
            "model": model, "spec_hash": "abc123", "num_classes": classes, "precision": precision, "variant": None, "device": device,
            "status": "ok", "reason": None, "batch_size": 32, "steps": 20, "warmup_steps": 2, "repeat": repeat,
            "seed": repeat,
            "step_times_ms": steps, "first_step_ms": 10 * ms, "peak_memory_mb": 100.0, "memory_kind": "rss",
            "loss": loss or [math.log(classes)] + [1.0 / (k + 1) for k in range(1, 20)], "eval_loss": 0.5,
            "eval_accuracy": accuracy, "loss_scale": scale, "flops_per_step": flops, "device_peak_gflops": peaks,
            "env": {"cpu": "test cpu", "cpu_flags": list(flags), "threads": 2,
                    "device": {"name": device, "kind": "gpu" if device == "cuda" else "cpu",
                               "description": description, "details": {}}}}


def cell(framework, precision, ms, repeats=3, spread=0.02, **kw):
    # repeats spread a little (2% by default), so that a 1.2x difference is clear and a 1.01x one is not
    return [record(framework, precision, ms * (1 + spread * (i - (repeats - 1) / 2)), repeat=i, **kw)
            for i in range(repeats)]


def mixed() -> list[dict]:
    """torch: amp_bf16 clearly faster; tensorflow: clearly slower; mxnet: no clear difference (within 5%)."""
    return (cell("torch", "fp32", 12.0) + cell("torch", "amp_bf16", 10.0)
            + cell("tensorflow", "fp32", 8.0) + cell("tensorflow", "amp_bf16", 16.0)
            + cell("mxnet", "fp32", 6.9, spread=0.01) + cell("mxnet", "amp_bf16", 6.9 * 1.003, spread=0.01))


def test_matrix_has_a_row_per_model_a_column_per_framework_and_a_verdict_per_cell():
    """Only a precision decided faster is named (bold, green); the others say "keep fp32" with the closest
    precision's figures and its decision in words, uncoloured."""
    view = build_view(mixed())
    (block,) = view.answer
    assert block.device == "cpu (test cpu)" and block.columns == ["mxnet", "tensorflow", "torch"]
    (row,) = block.rows
    cells = dict(zip(block.columns, row.cells))
    assert {c: (e.verdict, e.decision) for c, e in cells.items()} == {
        "mxnet": ("keep", "same"), "tensorflow": ("keep", "slower"), "torch": ("faster", "faster")}
    page = render(view)
    matrix = page[page.index('id="matrix"'):page.index("</table>", page.index('id="matrix"'))]
    body = matrix[matrix.index("<tbody>"):]
    tds = re.findall(r'<td class="([^"]+)">(.*?)</td>', body, re.S)
    assert [cls for cls, _ in tds] == ["v-none", "v-none", "v-faster"]
    (_, mxnet), (_, tensorflow), (_, torch) = tds
    assert "<strong>amp_bf16</strong>" in torch and '<span class="verdict">faster</span>' in torch
    for text, words in ((mxnet, "no clear difference"), (tensorflow, "2.00x slower")):
        assert text.startswith("keep fp32") and "closest: amp_bf16" in text and words in text
        assert "<strong>" not in text and 'class="verdict"' not in text


def test_recommendation_is_computed_from_the_records():
    records = mixed()
    view = build_view(records)
    (line,) = view.answer[0].recommendations
    (torch,) = [s for s in view.summary if s.framework == "torch"]

    def gm(rs):
        return np.exp(np.mean([np.log(np.median(r["step_times_ms"])) for r in rs]))

    fp32 = [r for r in records if (r["framework"], r["precision"]) == ("torch", "fp32")]
    bf16 = [r for r in records if (r["framework"], r["precision"]) == ("torch", "amp_bf16")]
    assert torch.ratio == pytest.approx(gm(fp32) / gm(bf16)) and torch.interval
    mxnet_fp32 = gm([r for r in records if (r["framework"], r["precision"]) == ("mxnet", "fp32")])
    fastest = min((gm([r for r in records if (r["framework"], r["precision"]) == k]), k)
                  for k in {(r["framework"], r["precision"]) for r in records})
    assert fastest[1] == ("mxnet", "fp32") and fastest[0] == mxnet_fp32
    assert line == (f"m: torch amp_bf16, {torch.ratio:.2f}x faster than torch fp32 (95% CI {torch.lo:.2f}-"
                    f"{torch.hi:.2f}), accuracy unchanged (+0.0 pt, 95% CI +0.0 to +0.0 over 3 seeds; margin ±0.5 pt; "
                    f"fp32 over 3 seeds: 90.0-90.0%); fastest overall, best of 6 cells: mxnet fp32 {mxnet_fp32:.3g} "
                    f"ms/step.")


def test_nothing_clearly_faster_is_said_so():
    records = [r for r in mixed() if r["framework"] != "torch"]
    (line,) = build_view(records).answer[0].recommendations
    assert line.startswith("m: no precision is clearly faster than fp32 in any framework here (closest: mxnet "
                           "amp_bf16 x1.00, 95% CI") and "within 5% of 1" in line and "keep fp32" in line


def test_a_faster_precision_that_loses_accuracy_is_not_recommended():
    records = cell("torch", "fp32", 12.0) + cell("torch", "amp_fp16", 8.0, accuracy=0.8) \
        + cell("torch", "amp_bf16", 10.0)
    (line,) = build_view(records).answer[0].recommendations
    assert line.startswith("m: torch amp_bf16, 1.20x faster") and "(torch amp_fp16 was 1.50x faster but accuracy " \
        "lower (-10.0 pt, 95% CI -10.0 to -10.0 over 3 seeds; margin ±0.5 pt; fp32 over 3 seeds: 90.0-90.0%))" in line


def test_explanations_speak_only_of_the_cells_they_cite():
    """bfloat16 slower in tensorflow, faster in torch, on the same CPU: the rule names tensorflow as slower and
    torch as faster, and never calls bfloat16 slower on this CPU as a whole."""
    view = build_view(mixed())
    (rule,) = [w for w in view.why if "bfloat16" in w.title]
    assert rule.title == "bfloat16 ran slower than fp32 in tensorflow on cpu (test cpu)"
    assert "torch: amp_bf16 was 1.20x faster" in rule.text and "the CPU alone is not the reason" in rule.text
    assert "m in torch: amp_bf16" not in rule.text.split("On the same CPU")[0]
    faster_only = build_view([r for r in mixed() if r["framework"] == "torch"])
    assert not [w for w in faster_only.why if "slower" in w.title]


def test_too_small_to_matter_only_where_16_bit_measured_within_5_percent():
    records = [{**r, "flops_per_step": 10**7} for r in mixed()]
    (rule,) = [w for w in build_view(records).why if "too small" in w.title]
    assert rule.title == "Likely too small for precision to matter on cpu (test cpu): m"
    assert "m (mxnet amp_bf16): 10 MFLOP per step" in rule.text and "tensorflow" not in rule.text
    assert "likely dominate" in rule.text


def test_runs_too_short_show_no_accuracy_figure():
    """fp32 at chance level (the record's 10 classes): accuracy is 'too short to judge',
    in the matrix, the accuracy table and the recommendation; a model trained long enough keeps its numbers."""
    short = cell("torch", "fp32", 12.0, model="short", accuracy=0.11) \
        + cell("torch", "amp_bf16", 10.0, model="short", accuracy=0.13)
    long = cell("torch", "fp32", 12.0, model="long", accuracy=0.11 + 0.06, classes=10) \
        + cell("torch", "amp_bf16", 10.0, model="long", accuracy=0.20)
    view = build_view(short + long)
    rows = {(r.model, r.precision): r for r in view.accuracy}
    assert rows[("short", "fp32")].accuracy == rows[("short", "amp_bf16")].delta == "too short to judge"
    assert rows[("long", "fp32")].accuracy == "17.0 %"
    assert rows[("long", "amp_bf16")].delta == ("higher (+3.0 pt, 95% CI +3.0 to +3.0 over 3 seeds; margin ±0.5 pt; "
                                                   "fp32 over 3 seeds: 17.0-17.0%)")
    lines = dict(zip(["long", "short"], view.answer[0].recommendations))
    assert "accuracy higher (+3.0 pt" in lines["long"]
    # faster, but accuracy too short to judge: not recommended, and what to run instead
    assert lines["short"].startswith("short: nothing to recommend yet: torch amp_bf16 is 1.20x faster than torch fp32")
    assert "but accuracy too short to judge (fp32 at chance level); train for more steps (--steps): fp32 learned " \
        "nothing to judge accuracy by; keep fp32 until then" in lines["short"]
    page = render(view)
    assert "too short to judge" in page and "11.0 %" not in page and "13.0 %" not in page
    # two classes: 0.52 is chance level too
    binary = cell("torch", "fp32", 12.0, accuracy=0.52, classes=2) + cell("torch", "amp_bf16", 10, classes=2)
    assert not build_view(binary).accuracy[0].judged


def test_a_flat_loss_scale_is_a_sentence_and_a_moving_one_a_chart():
    flat = cell("torch", "fp32", 12.0) + cell("torch", "amp_fp16", 10.0, history=[65536.0] * 22)
    view = build_view(flat)
    (section,) = view.sections
    assert section.scale_chart is None
    assert section.scale_notes == [("torch amp_fp16: loss scale stayed at 2^16, no step skipped in 22 steps "
                                       "in each of 3 repeats.")]
    page = render(view)
    assert 'data-chart="scale"' not in page and "stayed at 2^16" in page
    moving = cell("torch", "fp32", 12.0) + cell("torch", "amp_fp16", 10.0, history=[65536.0] * 3 + [32768.0] * 19,
                                                 skipped=1)
    (section,) = build_view(moving).sections
    assert section.scale_chart and not section.scale_notes


def test_loss_curves_only_where_precisions_differ():
    same = build_view(cell("torch", "fp32", 12.0) + cell("torch", "amp_bf16", 10.0)).sections[0]
    assert same.loss_chart is None and "agree step by step" in same.loss_note
    other = [0.5 + 1.0 / k for k in range(1, 21)]
    differ = build_view(cell("torch", "fp32", 12.0) + cell("torch", "amp_bf16", 10.0, loss=other)).sections[0]
    assert differ.loss_chart and differ.loss_note is None


def test_two_devices_are_never_pooled():
    cpu = cell("torch", "fp32", 12.0) + cell("torch", "amp_bf16", 14.0)
    gpu = cell("torch", "fp32", 3.0, device="cuda", description="H200") \
        + cell("torch", "amp_bf16", 1.5, device="cuda", description="H200")
    view = build_view(cpu + gpu)
    assert [b.device for b in view.answer] == ["cpu (test cpu)", "cuda (H200)"]
    verdicts = [b.rows[0].cells[0].decision for b in view.answer]
    assert verdicts == ["slower", "faster"]
    ratios = sorted(round(s.ratio, 1) for s in view.summary)
    assert ratios == [0.9, 2.0]  # each against its own device's fp32
    assert [b.recommendations[0].split(";")[-1] for b in view.answer] == [
        " fastest overall, best of 2 cells: torch fp32 12 ms/step.",
        " fastest overall, best of 2 cells: torch amp_bf16 1.5 ms/step."]
    assert {f.device for f in view.fastest} == {"cpu (test cpu)", "cuda (H200)"}
    page = render(view)
    assert 'id="matrix"' in page and 'id="matrix-2"' in page


def test_markdown_summary_beside_the_page(tmp_path):
    records = mixed() + cell("torch", "fp32", 3.0, device="cuda", description="H200")
    write_report(records, tmp_path / "index.html")
    md = (tmp_path / "index.md").read_text()
    assert "## Which precision to use, on cpu (test cpu)" in md and "## Which precision to use, on cuda (H200)" in md
    assert "| model | mxnet | tensorflow | torch |" in md and "| m | fp32 2.99 ms/step; fp32 only |" in md
    assert all(line in md for block in build_view(records).answer for line in block.recommendations)


def test_step_time_chart_has_readable_log_ticks_and_one_colour_per_precision():
    view = build_view(mixed())
    svg = view.sections[0].speed_chart
    assert "10^" not in svg and "times 10" not in svg and "\\times" not in svg
    labels = re.findall(r">([0-9.]+)</text>", svg) or re.findall(r"<!-- ([0-9.]+) -->", svg)
    assert len(labels) >= 3
    assert "#4c72b0" in svg and "#55a868" in svg  # fp32 and amp_bf16 in their palette colours
    for low, high in ((2.9, 4.6), (6.5, 7.2), (0.5, 200), (1, 10)):
        ticks = log_ticks(low, high)
        assert 3 <= len(ticks) <= 7 and all(low <= t <= high for t in ticks)
        assert all(len(f"{t:g}") <= 5 for t in ticks)
