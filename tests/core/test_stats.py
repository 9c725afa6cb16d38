"""The report's intervals mean what they say: a 95% interval covers the true ratio in about 95% of draws."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as scipy_stats

from harness import stats


def coverage(n: int, spread: float, draws: int = 3000, seed: int = 0) -> float:
    """Repeat figures of two cells drawn with a known ratio (2.0): log-normal noise per repeat, plus a machine
    drift shared by the cells' interleaved repeats."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(draws):
        drift = rng.normal(0, spread / 2, n)
        a = 10.0 * np.exp(drift + rng.normal(0, spread, n))
        b = 5.0 * np.exp(drift + rng.normal(0, spread, n))
        r = stats.ratio(list(a), list(b))
        assert r.is_interval
        hits += r.low <= 2.0 <= r.high
    return hits / draws


@pytest.mark.parametrize("n", [3, 10])
@pytest.mark.parametrize("spread", [0.01, 0.1])
def test_the_95_percent_interval_covers_the_true_ratio(n, spread):
    assert 0.93 <= coverage(n, spread) <= 0.99


def test_a_bootstrap_of_two_or_three_medians_would_not_have():
    """What the report used before: a bootstrap over repeats can only return ratios of observed extremes, so
    with 3 repeats its '95% interval' is the min-max range, which covers far less often."""
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(1000):
        a, b = 10 * np.exp(rng.normal(0, 0.1, 3)), 5 * np.exp(rng.normal(0, 0.1, 3))
        hits += a.min() / b.max() <= 2.0 <= a.max() / b.min()
    t_hits = coverage(3, 0.1, draws=1000, seed=1)
    assert hits / 1000 < 0.9 < t_hits


def test_too_few_repeats_give_a_range_never_called_an_interval():
    r = stats.ratio([10.0, 11.0], [5.0, 5.5, 5.2])
    assert not r.is_interval and (r.low, r.high) == pytest.approx((10 / 5.5, 11 / 5.0))
    assert r.label.startswith("range of 2 repeats") and "95%" not in r.label
    single = stats.ratio([10.0], [5.0])
    assert single.label == "range of 1 repeat 2.00-2.00" and single.clear
    assert stats.ratio([10.0, 10.5, 9.8], [10.1, 9.9, 10.2]).label.startswith("95% CI")


def test_spread_flags_unstable_cells():
    assert stats.spread([10.0]) is None
    assert stats.spread([10.0, 10.1, 9.9]) < stats.UNSTABLE_CV < stats.spread([10.0, 14.0, 8.0])


def test_the_best_of_k_is_called_faster_by_chance_only_when_not_adjusted_for_k():
    """Five precisions exactly as fast as fp32 (true ratio 1), the one that measured fastest chosen: its plain 95%
    interval calls it faster far more often than the 2.5% a one-sided error may take; computed for 5 comparisons
    (Bonferroni) it does not, and still covers the true ratio in at least 95% of draws."""
    rng = np.random.default_rng(2)
    plain = adjusted = covered = 0
    draws = 2000
    for _ in range(draws):
        fp32 = list(10 * np.exp(rng.normal(0, 0.05, 3)))
        others = [list(10 * np.exp(rng.normal(0, 0.05, 3))) for _ in range(5)]
        best = max(others, key=lambda b: stats.ratio(fp32, b).estimate)
        plain += stats.ratio(fp32, best).decision == "faster"
        r = stats.ratio(fp32, best, comparisons=5)
        adjusted += r.decision == "faster"
        covered += r.low <= 1.0 <= r.high
    assert plain / draws > 0.035 and adjusted / draws <= 0.025 and covered / draws >= 0.95


def test_an_adjusted_interval_says_so_and_is_wider():
    a, b = [10.0, 10.5, 9.8], [8.0, 8.3, 7.9]
    one, three = stats.ratio(a, b), stats.ratio(a, b, comparisons=3)
    assert three.estimate == one.estimate and three.low < one.low and three.high > one.high
    assert three.label == f"95% CI {three.low:.2f}-{three.high:.2f}, adjusted for 3 comparisons (Bonferroni)"
    assert one.label == f"95% CI {one.low:.2f}-{one.high:.2f}"


def test_the_looks_of_a_sequential_test_spend_its_alpha_in_all_and_its_label_says_which_look():
    """Pocock's level, checked against scipy's own Welch test on fresh normal samples: over MAX_LOOKS looks the chance
    of a false decision is SEQUENTIAL_ALPHA, where the union bound's level (alpha / looks) would leave most unspent."""
    level = stats.look_level()
    assert stats.SEQUENTIAL_ALPHA / stats.MAX_LOOKS < level < stats.SEQUENTIAL_ALPHA
    assert stats.look_level(2) < level / 2  # two comparisons at alpha / 2 each: the looks' minimum is not linear
    rng = np.random.default_rng(12345)
    n = stats.MIN_REPEATS + stats.MAX_LOOKS - 1
    a, b = rng.standard_normal((2, 4000, n))
    p = np.min([scipy_stats.ttest_ind(a[:, :m], b[:, :m], axis=1, equal_var=False).pvalue
                for m in range(stats.MIN_REPEATS, n + 1)], axis=0)
    ci = scipy_stats.binomtest(int((p < level).sum()), p.size).proportion_ci(0.99)
    assert ci.low <= stats.SEQUENTIAL_ALPHA <= ci.high
    r = stats.ratio([10.0, 10.5, 9.8], [5.0, 5.1, 4.9], look=2)
    assert r.confidence == pytest.approx(1 - level) and r.look == 2
    assert r.label.startswith(f"{(1 - level) * 100:.4g}% CI")
    assert r.label.endswith(f"look 2 of a sequential test (4% over its {stats.MAX_LOOKS} looks)")
    with pytest.raises(ValueError):
        stats.ratio([10.0, 10.5, 9.8], [5.0, 5.1, 4.9], look=stats.MAX_LOOKS + 1)
    once = stats.ratio([10.0, 10.5, 9.8], [5.0, 5.1, 4.9])
    assert r.low < once.low and r.high > once.high and once.look is None  # wider than a comparison looked at once
