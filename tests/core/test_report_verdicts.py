"""What the first screen may say, and on what evidence: no verdict from too few repeats, a "too noisy" cell that
says what to do, a best-of-k interval adjusted for k, "keep fp32" where nothing is faster, and "why" lines that
name their evidence and say "likely" where they infer, each cause said once."""
from __future__ import annotations

import re

import numpy as np

from harness import stats
from harness.report import build_view, render
from harness.report.render import render_markdown
from tests.core.test_report_answer import cell
from tests.core.test_report_profile import profile_record

NO_BF16 = {"float32": 120.0, "bfloat16": 15.0, "float16": None}  # GFLOP/s, as harness/run/peak.py records them


def _matrix_body(page: str) -> str:
    start = page.index('id="matrix"')
    table = page[start:page.index("</table>", start)]
    return table[table.index("<tbody>"):]


def _repeat_figures(records, framework, precision):
    return [float(np.median(r["step_times_ms"])) for r in records
            if (r["framework"], r["precision"]) == (framework, precision)]


def test_one_repeat_gives_no_verdict_no_colour_and_no_recommendation():
    """fp32 at 10 ms against amp_bf16 at 9.9 ms, one repeat each: the range excludes 1, and still nothing may
    be called faster."""
    records = cell("torch", "fp32", 10.0, repeats=1) + cell("torch", "amp_bf16", 9.9, repeats=1)
    view = build_view(records)
    (e,) = view.answer[0].rows[0].cells
    assert (e.verdict, e.decision) == ("too few", "too few")
    assert e.verdict_text == "not enough repeats for a verdict" and e.speed == "x1.01 vs fp32"
    assert e.interval.startswith("range of 1 repeat")
    body = _matrix_body(render(view))
    assert "v-faster" not in body and "<strong>" not in body and 'class="verdict"' not in body
    assert "not enough repeats for a verdict" in body
    (line,) = view.answer[0].recommendations
    assert line.startswith("m: not enough repeats for a verdict (fewer than 3 in torch amp_bf16 x1.01")
    assert line.endswith("rerun with --repeats 3 or more, or --repeats auto.") and "fast" not in line
    (s,) = view.summary
    assert s.decision == "too few" and "faster" not in view.headline[0]
    assert "**" not in render_markdown(view).split("| m |")[1].split("\n")[0]  # no bold name in the matrix row
    assert not view.why  # no rule draws a cause from a range


def test_an_interval_too_wide_to_decide_says_so_names_the_spread_and_what_to_do():
    records = cell("torch", "fp32", 11.0, spread=0.15) + cell("torch", "amp_bf16", 10.0, spread=0.15)
    view = build_view(records)
    (e,) = view.answer[0].rows[0].cells
    assert (e.verdict, e.verdict_text) == ("undecided", "too noisy here to decide")
    assert e.interval.startswith("95% CI") and e.speed == "x1.10 vs fp32"
    assert re.fullmatch(r"repeats spread 1[45]% \(fp32\) and 1[45]% \(amp_bf16\): rerun with more repeats "
                        r"\(--repeats auto with a larger --budget\) or on a quieter machine", e.advice)
    body = _matrix_body(render(view))
    assert "v-faster" not in body and "<strong>" not in body and "too noisy here to decide" in body
    assert e.advice in body
    (line,) = view.answer[0].recommendations
    assert line.startswith("m: too noisy here to decide (closest: torch amp_bf16 x1.10, 95% CI")
    assert "quieter machine" in line and "keep fp32" not in line


def test_the_best_of_k_precisions_has_its_interval_adjusted_for_k():
    """amp_bf16 alone is decided faster; chosen as the best of three precisions, its interval is computed at
    1 - 0.05/3 and no longer excludes 1."""
    fp32 = cell("torch", "fp32", 10.0 * np.exp(0.11), spread=0.04)
    bf16 = cell("torch", "amp_bf16", 10.0, spread=0.04)
    alone = build_view(fp32 + bf16)
    (e,) = alone.answer[0].rows[0].cells
    assert e.verdict == "faster" and "adjusted" not in e.interval
    records = fp32 + bf16 + cell("torch", "amp_fp16", 20.0) + cell("torch", "bf16", 25.0)
    view = build_view(records)
    (e,) = view.answer[0].rows[0].cells
    adjusted = stats.ratio(_repeat_figures(records, "torch", "fp32"), _repeat_figures(records, "torch", "amp_bf16"),
                           comparisons=3)
    assert adjusted.low < 1 < adjusted.high and adjusted.decision == "undecided"
    assert e.precision == "amp_bf16" and e.verdict == "undecided"
    assert e.interval == adjusted.label and adjusted.label.endswith(", adjusted for 3 comparisons (Bonferroni)")
    (s,) = [s for s in view.summary if s.precision == "amp_bf16"]
    assert s.decision == "faster" and s.lo > adjusted.low  # the Comparisons table: one comparison, at 95%
    assert "adjusted for 3 comparisons (Bonferroni)" in _matrix_body(render(view))
    assert "adjusted for 3 comparisons (Bonferroni)" in render_markdown(view)


def test_no_precision_faster_keeps_fp32_and_never_names_a_slower_one_the_best():
    records = cell("torch", "fp32", 10.0) + cell("torch", "amp_bf16", 19.0) + cell("torch", "amp_fp16", 25.0)
    view = build_view(records)
    (e,) = view.answer[0].rows[0].cells
    assert (e.verdict, e.decision, e.precision, e.speed) == ("keep", "slower", "amp_bf16", "1.90x slower")
    body = _matrix_body(render(view))
    assert body.count("<td") == 1 and 'class="v-none">keep fp32' in body and "closest: amp_bf16" in body
    assert "<strong>" not in body and "v-faster" not in body and 'class="verdict"' not in body
    md_row = render_markdown(view).split("| m |")[1].split("\n")[0]
    assert md_row.startswith(" keep fp32; closest: amp_bf16 1.90x slower (95% CI") and "**" not in md_row
    (line,) = view.answer[0].recommendations
    assert "keep fp32" in line and "clearly slower" in line


def test_why_names_the_measured_peaks_once_for_every_model_and_framework():
    """bfloat16 slower in two models and two frameworks on a CPU without bf16 arithmetic whose measured bf16
    matmul peak is 0.12x float32's: one sentence in "Why, in short", naming the peaks and the flags."""
    records = []
    for model in ("a", "b"):
        for framework in ("jax", "torch"):
            records += cell(framework, "fp32", 10.0, model=model, peaks=NO_BF16) \
                + cell(framework, "amp_bf16", 20.0, model=model, peaks=NO_BF16)
    view = build_view(records)
    bf16 = [s for s in view.why_short if "bfloat16" in s]
    assert bf16 == ["bfloat16 matmuls run at 0.12x float32's speed on this CPU (measured peak jax 15 vs 120, torch 15 "
                    "vs 120 GFLOP/s; no avx512_bf16/amx_bf16 among its flags): bfloat16 is slower than fp32 for "
                    "every model here."]
    (rule,) = [w for w in view.why if w.title.startswith("bfloat16 ran slower")]
    assert "likely emulated" in rule.text and "peak is 0.12x float32's" in rule.text
    page = render(view)
    short = page[page.index('id="why-short"'):page.index("</span>", page.index('id="why-short"'))]
    assert short.count("bfloat16 matmuls run at") == 1 and "likely" in short
    assert "bfloat16 matmuls run at 0.12x" in render_markdown(view).split("## Why\n")[0]


def test_too_small_for_precision_is_never_said_of_a_clearly_slower_step():
    """A 10 MFLOP model whose bf16 step is twice as slow: the CPU's missing bf16 is the cause, not its size."""
    slow = cell("torch", "fp32", 5.0, model="tiny", flops=10**7, peaks=NO_BF16) \
        + cell("torch", "amp_bf16", 10.0, model="tiny", flops=10**7, peaks=NO_BF16)
    view = build_view(slow)
    assert not [w for w in view.why if "too small" in w.title]
    assert any("bfloat16 matmuls run at 0.12x" in s for s in view.why_short)
    same = cell("torch", "fp32", 5.0, model="tiny", flops=10**7, spread=0.01, peaks=NO_BF16) \
        + cell("torch", "amp_bf16", 5.0, model="tiny", flops=10**7, spread=0.01, peaks=NO_BF16)
    (rule,) = [w for w in build_view(same).why if "too small" in w.title]
    assert rule.title.startswith("Likely too small") and "1.7% of its measured float32 matmul peak" in rule.text


def test_a_very_slow_step_is_likely_a_missing_kernel_not_a_fact():
    records = cell("torch", "fp32", 5.0) + cell("torch", "amp_fp16", 40.0)
    (rule,) = [w for w in build_view(records).why if "5x or more" in w.title]
    assert "m torch amp_fp16: 8x slower" in rule.text and "the likely cause is" in rule.text
    assert "not conversion overhead but" not in rule.text
    few = cell("torch", "fp32", 5.0) + cell("torch", "amp_fp16", 80.0, repeats=2)
    assert not build_view(few).why  # a range of 2 repeats, all of it under 0.2, draws no cause


def test_in_short_says_each_cause_once_with_what_it_concerns():
    """Twelve models, all within 5% in two frameworks, and fp16 diverging in both: two sentences."""
    records = []
    for i in range(12):
        for framework in ("jax", "torch"):
            records += cell(framework, "fp32", 5.0, model=f"m{i:02}", flops=10**7, spread=0.01) \
                + cell(framework, "amp_bf16", 5.0, model=f"m{i:02}", flops=10**7, spread=0.01)
    diverged = [{**r, "status": "diverged", "reason": "loss is nan at step 3", "step_times_ms": None}
                for r in cell("jax", "fp16", 5.0, model="m00", repeats=1) + cell("torch", "fp16", 5.0, model="m00",
                                                                                   repeats=1)]
    view = build_view(records + diverged)
    assert view.why_short == [
        "Under 1 GFLOP per step, 16-bit measured within 5% of fp32 on cpu (test cpu): likely too small for "
        "precision to matter (m00, m01, m02, m03 and 8 more).",
        "fp16 diverged (jax m00, torch m00)."]
    assert "A likely cause: pure float16" in next(w.text for w in view.why if "diverged" in w.title)


def test_in_short_names_the_profiles_cast_share():
    """A cell decided slower with a profile: the short sentence gives the share of the profiled step in casts."""
    model = "pitfall_rmsprop_epsilon"
    records = cell("fake", "fp32", 5.0, model=model) + cell("fake", "amp_fp16", 10.0, model=model)
    profiles = [profile_record("fake", "fp32", (2, 3), "float32", batch=32),
                profile_record("fake", "amp_fp16", (2, 72), "float16", cast_ms=4, batch=32)]
    view = build_view(records, profiles=profiles)
    assert view.why_short == ["Profiles of the slower 16-bit cells on cpu (test cpu) name the layers that lost the "
                                 "time and put 5% of the 16-bit step in casts (fake)."]


def _seeded(framework, precision, ms, accuracies, **kw):
    """A cell of 3 repeats (2% apart in step time), one seed each, with these accuracies by seed."""
    return [{**r, "eval_accuracy": a} for r, a in zip(cell(framework, precision, ms, **kw), accuracies)]


FP32_ACC = (0.900, 0.910, 0.920)  # standard deviation 1.0 pt: the margin
NOISY_ACC = (0.880, 0.925, 0.905)  # -2.0, +1.5, -1.5 pt: 0 inside, the interval far past the margin: undecided


def test_a_faster_precision_whose_accuracy_is_not_decided_is_neither_bolded_nor_recommended():
    records = _seeded("torch", "fp32", 12.0, FP32_ACC) + _seeded("torch", "amp_bf16", 10.0, NOISY_ACC)
    view = build_view(records)
    (s,) = view.summary
    assert (s.decision, s.accuracy_check.verdict) == ("faster", "undecided")
    (e,) = view.answer[0].rows[0].cells
    assert (e.verdict, e.verdict_text) == ("open", "faster, accuracy not yet decided")
    assert e.advice == "rerun with more repeats (each one more seed) to decide accuracy"
    body = _matrix_body(render(view))
    assert "v-faster" not in body and "<strong>" not in body and 'class="verdict"' not in body
    assert "faster, accuracy not yet decided" in body and e.advice in body
    md_row = render_markdown(view).split("| m |")[1].split("\n")[0]
    assert "**" not in md_row and "faster, accuracy not yet decided" in md_row
    (line,) = view.answer[0].recommendations
    assert line.startswith("m: nothing to recommend yet: torch amp_bf16 is 1.20x faster than torch fp32 (95% CI")
    assert "but accuracy not clearly unchanged (" in line and "keep fp32 until then" in line


def test_one_seed_is_not_decided_either_and_says_to_run_more_repeats():
    records = [{k: v for k, v in r.items() if k != "seed"}  # older records: every repeat from the spec's seed
               for r in cell("torch", "fp32", 12.0) + cell("torch", "amp_bf16", 10.0)]
    view = build_view(records)
    (e,) = view.answer[0].rows[0].cells
    assert e.verdict == "open"
    assert e.advice == "rerun with --repeats 3 or more (each repeat trains from a seed of its own) to judge accuracy"
    (line,) = view.answer[0].recommendations
    assert line.startswith("m: nothing to recommend yet") and "<strong>" not in _matrix_body(render(view))


def test_a_decided_precision_is_recommended_over_a_faster_one_whose_accuracy_is_open():
    records = (_seeded("torch", "fp32", 15.0, FP32_ACC) + _seeded("torch", "amp_fp16", 11.0, FP32_ACC)
               + _seeded("torch", "amp_bf16", 10.0, NOISY_ACC))
    view = build_view(records)
    (e,) = view.answer[0].rows[0].cells
    assert (e.verdict, e.precision) == ("faster", "amp_fp16")
    (line,) = view.answer[0].recommendations
    assert line.startswith("m: torch amp_fp16, 1.37x faster") and "accuracy unchanged" in line
    assert "(torch amp_bf16 was 1.50x faster, accuracy not yet decided: rerun with more repeats" in line


def test_fastest_overall_never_names_a_cell_with_too_few_repeats_or_an_undecided_speed():
    """jax amp_bf16 (2 repeats) and mxnet amp_bf16 (too noisy to tell from fp32) have the lowest medians: neither is
    named, in the recommendation or in the fastest-framework table."""
    records = (cell("torch", "fp32", 12.0) + cell("torch", "amp_bf16", 10.0)
               + cell("jax", "fp32", 12.0) + cell("jax", "amp_bf16", 1.0, repeats=2)
               + cell("mxnet", "fp32", 11.0, spread=0.15) + cell("mxnet", "amp_bf16", 9.5, spread=0.15))
    view = build_view(records)
    decisions = {s.framework: s.decision for s in view.summary}
    assert decisions == {"jax": "too few", "mxnet": "undecided", "torch": "faster"}
    (line,) = view.answer[0].recommendations
    assert line.startswith("m: torch amp_bf16, 1.20x faster")
    assert line.endswith("; fastest overall, best of 4 cells with a decided speed (2 more with fewer than 3 repeats "
                         "or no speed decided): torch amp_bf16 10 ms/step.")
    fastest = {f.precision: f for f in view.fastest}
    assert (fastest["amp_bf16"].framework, fastest["amp_bf16"].ranked, fastest["amp_bf16"].of) == ("torch", 1, 3)
    assert (fastest["fp32"].framework, fastest["fp32"].ranked) == ("mxnet", 3)
    assert "<td>1 of 3</td>" in render(view).replace(' class="num"', "")


def test_where_no_cell_may_be_ranked_no_fastest_is_named():
    records = cell("torch", "fp32", 12.0, repeats=2) + cell("jax", "fp32", 10.0, repeats=2) \
        + cell("mxnet", "amp_bf16", 5.0) + cell("mxnet", "amp_fp16", 4.0)
    view = build_view(records)
    (line,) = view.answer[0].recommendations
    assert line == ("m: no framework ran both fp32 and another precision, so no speed-up to compare; no fastest "
                    "overall: none of its 4 cells has 3 repeats and a speed decided against fp32.")
    cells = dict(zip(view.answer[0].columns, view.answer[0].rows[0].cells))
    assert cells["jax"].precision == "fp32" and cells["jax"].verdict_text == "fp32 only"  # one cell: no ranking
    assert (cells["mxnet"].precision, cells["mxnet"].ms) == ("amp_bf16, amp_fp16", "")
    assert cells["mxnet"].verdict_text == ("no fp32 run to compare; none may be named the fastest (fewer than 3 "
                                           "repeats, or no speed decided against fp32)")
    assert "| amp_bf16, amp_fp16; no fp32 run to compare; none may be named" in render_markdown(view)
    assert all(f.framework.startswith("none ranked") and f.ranked == 0 for f in view.fastest)
