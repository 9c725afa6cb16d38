"""Issue 41's accuracy verdicts on whole reports: "unchanged" is an equivalence found against a stated margin (the
larger of fp32's seed-to-seed standard deviation and a floor), a shift every seed agrees on is never "unchanged",
and a shift past the margin rules a precision out (harness.report.accuracy.compare)."""
from __future__ import annotations

import pytest

from harness.report import build_view, render
from harness.report.render import render_markdown
from tests.core.test_report_answer import record

FP32 = (0.900, 0.910, 0.920)  # standard deviation over seeds 1.0 pt, above the 0.5 pt floor: the margin is 1.0 pt
# 3 seeds: the 95% interval's half-width is t(0.975, 2) = 4.303 times the differences' sd over sqrt(3)


def seeded(precision: str, accuracies, ms: float) -> list[dict]:
    """One record per seed, 3 repeats 2% apart in step time around `ms` (a 1.2x difference is decided)."""
    return [{**record("torch", precision, ms * (1 + 0.02 * (i - 1)), repeat=i, accuracy=a), "seed": 7 + i}
            for i, a in enumerate(accuracies)]


def report(accuracies, fp32=FP32):
    view = build_view(seeded("fp32", fp32, 12.0) + seeded("amp_bf16", accuracies, 10.0))
    (s,) = view.summary
    (e,) = view.answer[0].rows[0].cells
    (line,) = view.answer[0].recommendations
    return view, s.accuracy_check, e, line


def test_worse_at_every_seed_by_a_little_more_than_the_margin_is_lower_and_ruled_out():
    """-1.2, -1.1, -1.3 pt against a 1.0 pt margin: 95% CI -1.45 to -0.95 pt, 0 excluded and past the margin."""
    view, check, e, line = report((0.888, 0.899, 0.907))
    assert (check.verdict, check.acceptable, check.decided) == ("lower", False, True)
    assert check.phrase == ("accuracy lower (-1.2 pt, 95% CI -1.4 to -1.0 over 3 seeds; margin ±1.0 pt; fp32 over 3 "
                            "seeds: 90.0-92.0%)")
    assert e.verdict == "keep" and e.verdict_text == "faster but less accurate" and e.accuracy_flag
    assert "keep fp32" in line and "(torch amp_bf16 was 1.20x faster but accuracy lower (-1.2 pt" in line
    assert "<strong>amp_bf16</strong>" not in render(view)


def test_worse_at_every_seed_by_a_little_less_than_the_margin_is_slightly_lower_not_unchanged():
    """-0.8, -0.7, -0.9 pt: 95% CI -1.05 to -0.55 pt reaches past the margin: lower. -0.7, -0.6, -0.8 pt: CI -0.95 to
    -0.45 pt, within it: a real shift smaller than the margin, said as one, and it rules nothing out."""
    assert report((0.892, 0.903, 0.911))[1].verdict == "lower"
    view, check, e, line = report((0.893, 0.904, 0.912))
    assert (check.verdict, check.acceptable, check.decided) == ("slightly lower", True, True)
    assert e.verdict == "faster" and e.accuracy.startswith("accuracy slightly lower (-0.7 pt, 95% CI -0.9 to -0.5 over "
                                                          "3 seeds; margin ±1.0 pt;")
    assert line.startswith("m: torch amp_bf16, 1.20x faster") and "accuracy slightly lower" in line


def test_a_noisy_shift_much_smaller_than_the_margin_is_unchanged_and_recommended():
    """-0.2, +0.1, -0.1 pt: 95% CI -0.45 to +0.31 pt, 0 inside and within the 1.0 pt margin."""
    view, check, e, line = report((0.898, 0.911, 0.919))
    assert (check.verdict, check.acceptable, check.decided) == ("unchanged", True, True)
    assert e.verdict == "faster" and "<strong>amp_bf16</strong>" in render(view)
    assert line.startswith("m: torch amp_bf16, 1.20x faster than torch fp32") and "accuracy unchanged (-0.1 pt, 95% " \
        "CI -0.4 to +0.3 over 3 seeds; margin ±1.0 pt; fp32 over 3 seeds: 90.0-92.0%)" in line
    assert "margin ±1.0 pt" in render_markdown(view)


@pytest.mark.parametrize("fp32, verdict, margin", [
    ((0.62, 0.66, 0.70), "higher", "±4.0 pt"),  # fp32's sd 4 pt: the interval reaches past it
    ((0.58, 0.66, 0.74), "slightly higher", "±8.0 pt"),  # sd 8 pt: within it, and still not unchanged
])
def test_an_interval_entirely_above_zero_is_never_unchanged(fp32, verdict, margin):
    """torch resnet8 amp_bf16 read "accuracy unchanged (+3.8 pt, 95% CI +1.3 to +6.3 over 3 seeds)": within fp32's
    range. +2.8, +3.8, +4.8 pt by seed: the same interval, now higher (or slightly higher), whatever the margin."""
    _, check, e, _ = report([a + d for a, d in zip(fp32, (0.028, 0.038, 0.048))], fp32)
    assert check.verdict == verdict and check.acceptable
    assert check.phrase.startswith(f"accuracy {verdict} (+3.8 pt, 95% CI +1.3 to +6.3 over 3 seeds; margin {margin};")


@pytest.mark.parametrize("shift, verdict", [
    ((0.012, 0.011, 0.013), "higher"),  # +0.012 nats at every seed, past the 0.01 nats margin: worse
    ((0.004, 0.005, 0.003), "slightly higher"),  # within it
    ((0.003, -0.002, 0.0), "unchanged"),  # noisy, around 0
])
def test_a_next_token_models_eval_loss_is_judged_by_the_same_rule_in_nats(shift, verdict):
    """fp32's eval loss 2.10/2.11/2.12 nats: sd 0.01, the floor too."""
    def lm(precision, losses, ms):
        return [{**r, "task": "next_token", "num_classes": 256, "eval_loss": loss}
                for r, loss in zip(seeded(precision, FP32, ms), losses)]

    fp32 = (2.10, 2.11, 2.12)
    (s,) = build_view(lm("fp32", fp32, 12.0) + lm("amp_bf16", [x + d for x, d in zip(fp32, shift)], 10.0)).summary
    check = s.accuracy_check
    assert check.verdict == verdict and check.acceptable == (verdict != "higher")
    assert "; margin ±0.0100 nats; fp32 over 3 seeds: loss 2.1000-2.1200" in check.phrase
