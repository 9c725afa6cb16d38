"""Statistics for step-time comparisons: what a "95% interval" in the report means, and when there is none.

Each run (repeat) of a cell gives one figure, the median of its timed steps: steps within one process are
autocorrelated (caches, clocks, the other tenant of the machine), so they are not independent samples; repeats
in fresh processes are. Repeats that ran one after another in one process (`--repeats auto` runs several in one, so
that the framework's import is paid once) share what that process's start gave them (its memory layout, thread
placement, the machine's state then): they are pooled into one figure first (per_process), and the process is the
unit the interval counts, a two-stage estimate like pyperf's values per process. A speed-up is the ratio of the
geometric means of two cells' per-process figures, and its interval is Welch's t-interval on their logs,
exponentiated: with interleaved processes (the runner runs fp32, amp_bf16, amp_fp16, fp32, ...) machine drift is
spread over every cell instead of confounded with one. Below MIN_REPEATS processes in either cell, there is no honest
interval: the report shows the range.

A comparison chosen as the best of k (the fastest of a cell's k precisions) is not one comparison but the maximum
of k: its interval is computed at 1 - 0.05/k (Bonferroni), so that all k intervals hold together with 95%
confidence and picking the best of them does not make it look surer than it is.

A comparison that looks at its data more than once (`run --repeats auto` adds processes until it decides) spends its
5% over the looks with Pocock's group-sequential design (S. J. Pocock, "Group sequential methods in the design and
analysis of clinical trials", Biometrika 64, 1977): look k comes at k + 2 processes in the larger cell, at most
MAX_LOOKS of them, and every look decides at one nominal level (look_level), chosen so that the chance that any of
the MAX_LOOKS looks gives a false "faster" or "slower" is SEQUENTIAL_ALPHA. Pocock's constants assume a known
variance; here each look is Welch's test on a handful of processes, so the level is found by simulating that test
at these looks on normal data (its p-values do not depend on the noise's size), with a fixed seed. Looks share most
of their data, so the level is far less strict than a union bound over the looks would be (0.05 / 20 each): it
decides more with the same processes. Where the looks end before MAX_LOOKS (a decision, the budget) the error is
lower still. "Same" is an equivalence decision: the interval within +/-PRECISE is two one-sided tests at half the
look's level. The interval printed is the one that decided, at the look's level.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

MIN_REPEATS = 3
DECIDED = ("faster", "slower", "same")  # the decisions (Ratio.decision) that end a sequential comparison
PRECISE = 0.05  # an interval within +/-5% of 1 says "no clear difference" with enough precision to stop
UNSTABLE_CV = 0.10  # pyperf's rule of thumb: a spread over 10% of the mean makes a benchmark unstable
ALPHA = 0.05  # the error a comparison may make, over all its looks
# what the sequential design spends: a point below ALPHA for what its normal model of the log figures misses (the heavy
# tails of timings), so that the measured rate, with its own interval, stays within ALPHA
SEQUENTIAL_ALPHA = 0.04
MAX_LOOKS = 20  # looks of one sequential comparison: at 3 to 22 processes (600 s of 15-s processes, the default budget)


@functools.lru_cache
def look_level(comparisons: int = 1, paths: int = 50_000) -> float:
    """The nominal level every look of a sequential comparison decides at (Pocock): the SEQUENTIAL_ALPHA /
    `comparisons` quantile of the smallest of MAX_LOOKS Welch p-values, simulated on pairs of normal samples that
    grow from MIN_REPEATS values by one at a time."""
    from scipy import stats

    rng = np.random.default_rng(0)
    n = MIN_REPEATS + MAX_LOOKS - 1
    a, b = rng.standard_normal((2, paths, n))
    smallest = np.ones(paths)
    for m in range(MIN_REPEATS, n + 1):
        va, vb = a[:, :m].var(1, ddof=1) / m, b[:, :m].var(1, ddof=1) / m
        t = (a[:, :m].mean(1) - b[:, :m].mean(1)) / np.sqrt(va + vb)
        df = (va + vb) ** 2 / ((va**2 + vb**2) / (m - 1))
        smallest = np.minimum(smallest, 2 * stats.t.sf(np.abs(t), df))
    return float(np.quantile(smallest, SEQUENTIAL_ALPHA / comparisons))


@dataclass(frozen=True)
class Ratio:
    estimate: float  # a / b of the geometric means
    low: float
    high: float
    n: tuple[int, int]  # repeats of a and of b
    is_interval: bool  # True: a 95% t-interval; False: the range over all repeat pairs
    comparisons: int = 1  # the interval is one of this many, adjusted together (Bonferroni)
    confidence: float = 0.95  # of all `comparisons` intervals together
    look: int | None = None  # a sequential comparison's look (look_level); None: a comparison looked at once

    @property
    def label(self) -> str:
        if self.is_interval:
            adjusted = f", adjusted for {self.comparisons} comparisons (Bonferroni)" if self.comparisons > 1 else ""
            looked = f", look {self.look} of a sequential test ({SEQUENTIAL_ALPHA:.0%} over its {MAX_LOOKS} looks)" if self.look else ""
            return f"{self.confidence * 100:.4g}% CI {self.low:.2f}-{self.high:.2f}{adjusted}{looked}"
        return f"range of {min(self.n)} repeat{'s' if min(self.n) != 1 else ''} {self.low:.2f}-{self.high:.2f}"

    @property
    def clear(self) -> bool:
        """The interval (or, without one, the whole range) lies on one side of 1."""
        return self.low > 1 or self.high < 1

    @property
    def decision(self) -> str:
        """What the comparison may say (a speed-up: a/b with a the baseline's times): "too few" (fewer than
        MIN_REPEATS repeats in a cell: no interval, no verdict), "faster" or "slower" (the 95% interval excludes
        1), "same" (it includes 1 and lies within +/-PRECISE), or "undecided" (too noisy here to decide). The
        report's verdicts and `run --repeats auto`'s stopping rule both read it."""
        if not self.is_interval:
            return "too few"
        if self.low > 1 or self.high < 1:
            return "faster" if self.low > 1 else "slower"
        return "same" if self.low >= 1 - PRECISE and self.high <= 1 + PRECISE else "undecided"


def geometric_mean(values) -> float:
    values = list(values)
    return math.exp(math.fsum(math.log(v) for v in values) / len(values))


def per_process(figures: list[float], processes: list[str | None]) -> list[float]:
    """A cell's repeat figures with those that shared a worker process pooled into their geometric mean, one figure
    per process in the order the processes came (a process of None: a repeat alone in its own)."""
    pooled: dict[object, list[float]] = {}
    for i, (figure, process) in enumerate(zip(figures, processes)):
        pooled.setdefault(("alone", i) if process is None else process, []).append(figure)
    return [geometric_mean(values) for values in pooled.values()]


def sequential(a: list[tuple[float, str | None, int]], b: list[tuple[float, str | None, int]],
               comparisons: int = 1) -> Ratio | None:
    """`--repeats auto`'s sequential test of a/b replayed from two cells' repeats, each (figure, process, round it
    ran in): harness.run.runner.UntilDecided looks at every round's end, once per growth of the larger cell's
    processes, and its first decision is final. The ratio of the look that decided, else of the last look; None
    before both cells have MIN_REPEATS processes."""
    last = None
    for end in sorted({r for *_, r in [*a, *b]}):
        xa, xb = (per_process([x for x, _, r in c if r <= end], [p for _, p, r in c if r <= end]) for c in (a, b))
        if min(len(xa), len(xb)) < MIN_REPEATS:
            continue
        look = max(len(xa), len(xb)) - MIN_REPEATS + 1
        if look > MAX_LOOKS:
            break
        if last is None or look > last.look:
            last = ratio(xa, xb, comparisons=comparisons, look=look)
            if last.decision in DECIDED:
                return last
    return last


def ratio(a: list[float], b: list[float], confidence: float = 0.95, comparisons: int = 1,
          look: int | None = None) -> Ratio:
    """a/b for two cells' per-repeat figures (e.g. fp32 and amp_bf16 median step times). `comparisons`: how many
    comparisons this one is chosen from; its interval is then computed at 1 - (1 - confidence) / comparisons.
    `look`: a sequential comparison's look (1 to MAX_LOOKS), whose level (look_level) replaces `confidence`."""
    if look is not None:
        if not 1 <= look <= MAX_LOOKS:
            raise ValueError(f"a sequential comparison looks {MAX_LOOKS} times at most, not at look {look}")
        confidence = 1 - look_level(comparisons) * comparisons
    from scipy import stats

    la, lb = np.log(np.asarray(a, float)), np.log(np.asarray(b, float))
    estimate = math.exp(la.mean() - lb.mean())
    n = (la.size, lb.size)
    if min(n) < MIN_REPEATS:
        ratios = np.exp(la[:, None] - lb[None, :])
        return Ratio(estimate, float(ratios.min()), float(ratios.max()), n, False, comparisons, confidence, look)
    va, vb = la.var(ddof=1) / la.size, lb.var(ddof=1) / lb.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (la.size - 1) + vb**2 / (lb.size - 1)) if se > 0 else la.size + lb.size - 2
    each = 1 - (1 - confidence) / comparisons
    half = stats.t.ppf(0.5 + each / 2, df) * se
    return Ratio(estimate, math.exp(la.mean() - lb.mean() - half), math.exp(la.mean() - lb.mean() + half), n, True,
                 comparisons, confidence, look)


def spread(values: list[float]) -> float | None:
    """Coefficient of variation of a cell's repeat figures (None with one repeat)."""
    if len(values) < 2:
        return None
    v = np.asarray(values, float)
    return float(v.std(ddof=1) / v.mean())
