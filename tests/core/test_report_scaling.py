"""The scaling study's section (harness.report.scaling) from constructed records whose outcome is known: where
16-bit starts to pay, that an interval reaching 1 never counts as the crossover, and "not reached up to"."""
from __future__ import annotations

import re
import statistics

from harness.report import build_view, render
from harness.report.render import render_markdown
from tests.core.test_report_answer import record

STUDY = "scaling-20261201T000000"
PEAKS = {"float32": 100.0, "bfloat16": 12.0, "float16": None}


def size(batch: int, fp32_ms: float, speedup: float, spread: float = 0.02, precision: str = "amp_bf16",
         width: float | None = None, peaks: dict | None = None) -> list[dict]:
    """fp32 and `precision` at one batch size, 3 repeats each; `precision` is `speedup` times faster, each cell's
    repeats `spread` apart."""
    out = []
    for p, ms, mb in (("fp32", fp32_ms, 10.0 * batch), (precision, fp32_ms / speedup, 6.0 * batch)):
        for i in range(3):
            r = record("torch", p, ms * (1 + spread * (i - 1)), repeat=i, flops=int(2e6 * batch * (width or 1)),
                       peaks=peaks)
            out.append({**r, "schema": 7, "study": STUDY, "batch_size": batch, "width": width,
                        "peak_memory_mb": mb, "spec_hash": f"h{batch}w{width}"})
    return out


def sentence(records: list[dict]) -> str:
    (entry,) = build_view(records).crossover.entries
    (line,) = entry.sentences
    return line


def test_slower_at_small_sizes_faster_at_large_names_the_crossover():
    records = (size(1, 1.0, 0.5) + size(4, 2.0, 0.7) + size(16, 4.0, 0.8) + size(64, 10.0, 1.3)
               + size(256, 40.0, 1.8))
    view = build_view(records)
    (entry,) = view.crossover.entries
    (series,) = entry.series
    assert series.crossover.sizes["batch"] == 64
    line = entry.sentences[0]
    assert line.startswith("m (torch): amp_bf16 pays from batch 64 on (128 MFLOP a step; x1.30, 95% CI 1.2"), line
    assert re.search(r"x1\.[78]\d at batch 256", line), line
    assert re.search(r"below that, at batch 16 it is slower \(x0\.80, 95% CI 0\.7\d-0\.8\d\)", line), line
    assert re.search(r"fp32 does 32 MFLOP in 4(\.0\d)? ms there, 8 GFLOP/s", line), line
    # the study's runs are its own section: not cells of the comparison, not relabelled per spec hash
    assert view.summary == [] and view.models == []
    assert [r.memory_saved for r in entry.rows] == ["40 %"] * 5
    page = render(view)
    assert 'id="crossover"' in page and line.replace("(", "(") in page.replace("&#39;", "'")
    assert page.count("<svg") >= 1 and 'data-chart="crossover"' in page
    assert line in render_markdown(view)


def test_an_interval_that_includes_1_never_counts_as_the_crossover():
    # batch 64: the point estimate is above 1 (x1.10) but its interval reaches below 1: too noisy to decide
    noisy = size(64, 10.0, 1.10, spread=0.15)
    records = size(16, 4.0, 0.8) + noisy + size(256, 40.0, 1.5)
    (entry,) = build_view(records).crossover.entries
    (series,) = entry.series
    (point64,) = [p for p in series.points if p.sizes["batch"] == 64]
    assert point64.speedup.estimate > 1 and point64.speedup.low < 1 < point64.speedup.high
    assert series.crossover.sizes["batch"] == 256
    assert "pays from batch 256 on" in entry.sentences[0]
    assert "below that, at batch 64 it is too noisy here to decide (x1.10" in entry.sentences[0]
    # faster at 16 and 256 but not decided at 64 in between: the crossover is still 256 (every larger size too)
    records = size(16, 4.0, 1.5) + noisy + size(256, 40.0, 1.5)
    assert "pays from batch 256 on" in sentence(records)
    # the largest size's estimate above 1 with an interval reaching 1: not reached at all
    records = size(16, 4.0, 0.8) + size(64, 10.0, 1.3) + size(256, 40.0, 1.10, spread=0.15)
    line = sentence(records)
    assert line.startswith("m (torch): amp_bf16: crossover not reached up to batch 256 (there x1.10, 95% CI 0."), line
    assert "too noisy here to decide" in line


def test_never_faster_says_not_reached_up_to_the_largest_size_and_why_from_the_peaks():
    records = size(16, 4.0, 0.3, peaks=PEAKS) + size(256, 40.0, 0.5, peaks=PEAKS)
    line = sentence(records)
    assert line.startswith("m (torch): amp_bf16: crossover not reached up to batch 256 (there x0.50, 95% CI"), line
    assert ": slower)" in line
    assert "bfloat16 matmul peak (12 GFLOP/s) is below float32's (100): bfloat16 is likely emulated here" in line


def test_fewer_than_3_repeats_give_no_crossover():
    records = [r for r in size(16, 4.0, 1.5) + size(256, 40.0, 2.0) if r["repeat"] < 2]
    line = sentence(records)
    assert "crossover not reached up to batch 256" in line and "not enough repeats for a verdict" in line


def test_widths_and_batches_vary_together_sizes_are_named_by_both():
    records = size(16, 4.0, 0.8, width=None) + size(16, 8.0, 1.3, width=2.0) + size(64, 10.0, 1.4, width=None)
    (entry,) = build_view(records).crossover.entries
    assert entry.varies == ["batch", "width"]
    # by work per step: batch 16 width 1 (32 M), batch 16 width 2 (64 M), batch 64 width 1 (128 M)
    assert "pays from batch 16, width 2 on" in entry.sentences[0]


def test_a_step_that_runs_near_the_matmul_peak_is_not_said_to_be_dominated_by_fixed_costs():
    """Below the crossover the sentence infers fixed per-step costs from fp32's low share of its matmul peak; at
    half the peak or more it says the matmuls fill the step (seen in a TensorFlow study at 114% of the peak)."""
    low, busy = ({"efficiency": e} for e in (0.07, 1.14))
    records = size(16, 4.0, 0.8) + size(64, 10.0, 1.3) + size(256, 40.0, 1.8)
    for r in records:
        r.update(low if r["batch_size"] == 16 else {})
    assert "likely dominated by fixed per-step costs" in sentence(records)
    assert "7% of the device's float32 matmul peak" in sentence(records)
    for r in records:
        r.update(busy if r["batch_size"] == 16 else {})
    line = sentence(records)
    assert "fixed per-step costs" not in line.split("so its")[0] and \
        "114% of the device's float32 matmul peak, so its matmuls, not fixed per-step costs, fill that step" in line


def with_matmuls(records: list[dict], share: dict[str, float]) -> list[dict]:
    """Each record with its step's matmuls timed alone: one product of all its FLOPs, whose rate makes it take
    `share[precision]` of that record's size's step (the geometric mean of its repeats' medians, as a PooledRuns's)."""
    repeats: dict[tuple, list[float]] = {}
    for r in records:
        repeats.setdefault((r["precision"], r["batch_size"]), []).append(statistics.median(r["step_times_ms"]))
    out = []
    for r in records:
        ms = share[r["precision"]] * statistics.geometric_mean(repeats[(r["precision"], r["batch_size"])])
        m, k, n = r["flops_per_step"] // 2, 1, 1
        dtype = "float32" if r["precision"] == "fp32" else "bfloat16"
        out.append({**r, "schema": 8, "matmul_shapes": {"dtype": dtype, "products": [
            {"layer": "0", "type": "dense", "pass": "forward", "m": m, "k": k, "n": n,
             "gflops": 2 * m * k * n / (ms * 1e6)}]}})
    return out


def test_below_the_crossover_the_why_is_the_step_s_own_matmuls_timed_alone():
    records = with_matmuls(size(16, 4.0, 0.8) + size(256, 40.0, 1.8), {"fp32": 0.25, "amp_bf16": 0.1})
    line = sentence(records)
    assert "below that, at batch 16 it is slower" in line, line
    assert re.search(r": at fp32, its matmuls, timed alone at the step's own shapes in float32, take (0\.999|1) ms of "
                     r"its 4 ms step \(25%\), so the step is mostly other work", line), line
    # amp_bf16 at batch 16: a 5 ms step, its matmuls 0.5 ms: twice as fast as fp32's 1 ms
    assert re.search(r"at amp_bf16, its matmuls, timed alone .* in bfloat16, take 0\.5 ms of its 5 ms step "
                     r"\(10%\), x2\.00 fp32's matmul time, while the rest of the step takes 4\.5 ms against fp32's "
                     r"3 ms", line), line
    assert "fixed per-step costs" not in line  # the direct evidence replaces the peak-share guess
    (entry,) = build_view(records).crossover.entries
    assert [r.fp32_matmul_ms for r in entry.rows] == ["0.999 (25%)", "10 (25%)"], entry.rows
    # the matmuls fill most of fp32's step: no "other work"
    line = sentence(with_matmuls(size(16, 4.0, 0.8) + size(256, 40.0, 1.8), {"fp32": 0.8, "amp_bf16": 0.5}))
    assert "(80%)" in line and "mostly other work" not in line, line


def test_no_crossover_says_whether_16_bit_matmuls_at_the_model_s_shapes_are_faster():
    slower = with_matmuls(size(16, 4.0, 0.5) + size(256, 40.0, 0.6), {"fp32": 0.5, "amp_bf16": 0.5})
    line = sentence(slower)  # bf16's matmuls at batch 256: 0.5 x 66.7 ms = 33 ms against fp32's 20 ms
    assert "crossover not reached up to batch 256" in line
    assert re.search(r"at the step's own matmul shapes, bfloat16's products take 33\.\d ms against float32's "
                     r"20(\.0)? ms \(x0\.60\): bfloat16 matmuls are no faster here at these shapes", line), line
    faster = with_matmuls(size(16, 4.0, 0.5) + size(256, 40.0, 0.9), {"fp32": 0.5, "amp_bf16": 0.1})
    line = sentence(faster)  # 4.4 ms against 20: faster, but the rest grows from 20 ms to 40 (44.4 - 4.4)
    assert re.search(r"\(x4\.50\), while the rest of the step \(casts, dispatch, elementwise ops, the optimizer "
                     r"update\) takes 40 ms against fp32's 20 ms", line), line


def test_the_memory_saved_chart_plots_each_size_against_the_batch():
    records = size(16, 4.0, 0.8) + size(256, 40.0, 1.8)
    (entry,) = build_view(records).crossover.entries
    svg = str(entry.memory_chart)
    assert svg.startswith("<svg") and "batch size (log scale)" in svg and "40%" in svg
    assert 'data-chart="memory-scaling"' in render(build_view(records))
    (entry,) = build_view(size(16, 4.0, 0.8, width=1.0) + size(16, 8.0, 1.2, width=2.0)).crossover.entries
    assert "FLOPs per training step (log scale)" in str(entry.memory_chart)
    assert entry.memory_caption.endswith("Saved: amp_bf16 40% at width 1, 40% at width 2."), entry.memory_caption


def test_matmuls_timed_alone_longer_than_the_step_are_not_used_to_split_it():
    line = sentence(with_matmuls(size(16, 4.0, 0.5) + size(256, 40.0, 0.9), {"fp32": 1.2, "amp_bf16": 0.5}))
    assert "but the matmuls timed alone take longer than the fp32 step itself (120% of it" in line, line
    assert "the rest of the step" not in line and "-" not in line.split("(x")[-1], line
