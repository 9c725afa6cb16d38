"""Accuracy against fp32, paired by seed, its interval held against 0 and against the margin (the larger of fp32's
seed-to-seed standard deviation and the metric's floor: harness.report.accuracy), and the report's accuracy lines
that cite them."""
from __future__ import annotations

import html

import pytest

from harness.report import build_view, render
from harness.report.render import render_markdown
from harness.report.accuracy import compare, spread
from tests.core.read_as import read_as
from tests.core.test_report_answer import record


def runs(*accuracies, seeded=True, precision="amp_bf16"):
    """One record per seed 7, 8, ... (or, unseeded, repeats of one seed as records before `seed` were)."""
    return read_as([{"eval_accuracy": a, "precision": precision, **({"seed": 7 + i} if seeded else {})}
                    for i, a in enumerate(accuracies)])


FP32 = runs(0.912, 0.920, 0.916, precision="fp32")  # range 0.8 pt, standard deviation 0.4: the 0.5 pt floor rules
# 3 seeds: the 95% interval's half-width is t(0.975, 2) = 4.303 times the differences' sd over sqrt(3)


@pytest.mark.parametrize("accuracies, verdict", [
    ((0.913, 0.919, 0.916), "unchanged"),  # +0.1/-0.1/0: -0.25 to +0.25 pt, within the 0.5 pt margin, 0 inside
    ((0.911, 0.919, 0.915), "slightly lower"),  # -0.1 pt at every seed: within the margin, but every seed agrees
    ((0.915, 0.923, 0.918), "slightly higher"),  # +0.3/+0.3/+0.2: +0.12 to +0.41 pt
    ((0.906, 0.914, 0.911), "lower"),  # -0.6/-0.6/-0.5: -0.71 to -0.42 pt, 0 excluded, past the margin
    ((0.905, 0.912, 0.907), "lower"),  # -0.7/-0.8/-0.9: -1.05 to -0.55 pt
    ((0.880, 0.890, 0.885), "lower"),  # -3 pt at every seed
    ((0.940, 0.950, 0.946), "higher"),
    ((0.913, 0.924, 0.923), "undecided"),  # +0.1/+0.4/+0.7: -0.35 to +1.15 pt, 0 inside, past the margin
    ((0.890, 0.935, 0.916), "undecided"),  # -2.2, +1.5, 0: the interval reaches far past the margin
    ((0.105, 0.11, 0.10), "stalls"),  # chance level (10 classes) where fp32 is not
])
def test_verdicts_come_from_the_paired_interval_against_0_and_the_margin(accuracies, verdict):
    check = compare(runs(*accuracies), FP32, classes=10)
    assert check.verdict == verdict and check.acceptable == (verdict not in ("lower", "stalls"))
    assert check.decided == (verdict != "undecided") and check.fp32.margin == pytest.approx(0.005)  # the floor


def test_the_margin_is_fp32s_standard_deviation_where_it_exceeds_the_floor_never_its_range():
    """fp32 over 90/92/94%: range 4 pt, standard deviation 2 pt. -3 pt at every seed lay within the range (the old
    margin, which grows with every seed added); against the 2 pt standard deviation it is lower."""
    wide = runs(0.90, 0.92, 0.94, precision="fp32")
    assert spread(wide).margin == pytest.approx(0.02)
    assert compare(runs(0.87, 0.89, 0.91), wide, classes=10).verdict == "lower"
    assert compare(runs(0.89, 0.91, 0.93), wide, classes=10).verdict == "slightly lower"  # -1 pt: within 2


def test_the_phrase_cites_the_interval_the_margin_and_fp32s_spread():
    check = compare(runs(0.911, 0.919, 0.915), FP32, classes=10)
    assert check.pairs == 3 and check.delta == pytest.approx(-0.001)
    assert check.low == pytest.approx(-0.001) and check.high == pytest.approx(-0.001)  # the same at every seed
    assert check.phrase == ("accuracy slightly lower (-0.1 pt, 95% CI -0.1 to -0.1 over 3 seeds; margin ±0.5 pt; "
                            "fp32 over 3 seeds: 91.2-92.0%)")
    assert spread(FP32).label == "fp32 over 3 seeds: 91.2-92.0%"


def test_one_seed_gives_no_spread_and_no_verdict():
    # records without `seed` reused the spec's seed: three repeats are one seed
    unseeded = compare(runs(0.80, 0.80, 0.80, seeded=False), runs(0.92, 0.92, 0.92, seeded=False, precision="fp32"),
                       classes=10)
    assert unseeded.verdict == "one seed" and unseeded.acceptable and not unseeded.decided
    assert unseeded.phrase == "accuracy -12.0 pt vs fp32 (one seed: no spread to judge against)"
    assert compare(runs(0.9), FP32[:1], classes=10).verdict == "one seed"  # one pair
    # a stall at chance level needs no spread: it is a level, not a noise estimate
    assert compare(runs(0.1, seeded=False), FP32[:1], classes=10).verdict == "stalls"


def test_too_short_and_nothing_to_compare():
    short = compare(runs(0.12, 0.13), runs(0.11, 0.12, precision="fp32"), classes=10)
    assert short.verdict == "too short" and short.acceptable and not short.decided
    assert compare(read_as([{"eval_accuracy": None, "precision": "amp_bf16"}]), FP32, classes=10).verdict == "none"
    assert compare(runs(0.9), [], classes=10).verdict == "none"


def seeded(framework, precision, accuracies, **kw):
    return [{**record(framework, precision, 10.0, repeat=i, accuracy=a, **kw), "seed": 7 + i}
            for i, a in enumerate(accuracies)]


def test_report_accuracy_rows_cite_fp32s_spread_and_flag_a_loss():
    view = build_view(seeded("torch", "fp32", (0.912, 0.920, 0.916)) + seeded("torch", "amp_fp16", (0.88, 0.89, 0.885))
                      + seeded("torch", "amp_bf16", (0.913, 0.919, 0.916)))
    rows = {r.precision: r for r in view.accuracy}
    assert rows["fp32"].delta == "fp32 over 3 seeds: 91.2-92.0%"
    assert rows["amp_bf16"].delta.startswith("unchanged (+0.0 pt, 95% CI -0.2 to +0.2 over 3 seeds; margin ±0.5 pt")
    assert not rows["amp_bf16"].flag
    assert rows["amp_fp16"].delta.startswith("lower (-3.1 pt, 95% CI -3.3 to -2.9 over 3 seeds; margin ±0.5 pt")
    assert rows["amp_fp16"].flag
    check = {s.precision: s.accuracy_check for s in view.summary}
    assert check["amp_fp16"].verdict == "lower" and check["amp_bf16"].verdict == "unchanged"
    rule = "margin of ± the larger of fp32's seed-to-seed standard deviation and a floor (0.5 pt of accuracy"
    assert rule in html.unescape(render(view)) and rule in render_markdown(view)
