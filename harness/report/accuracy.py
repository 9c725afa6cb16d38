"""When an accuracy figure means something, and what a change of accuracy against fp32 may be called.

A run too short to learn anything scores at chance level, and a change of accuracy against such a baseline is
noise, not a precision effect. Otherwise a precision's accuracy is judged against fp32's own seed-to-seed
spread: repeat r of every precision trains from the spec's seed + r (weights, data order, dropout), so repeat r
of amp_bf16 and repeat r of fp32 are a pair. The paired differences give a mean and a 95% t-interval; the fp32
repeats' range over seeds is the noise that interval is held against. Records without a `seed` field come from
runs that reused the spec's seed in every repeat: their repeats are copies, one seed, no spread.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.report import format as f

CHANCE_MARGIN = 0.05  # eval accuracy within 5 points of chance: the run learned nothing (too short, or stalled)
TOO_SHORT = "too short to judge"
ONE_SEED = "one seed: no spread to judge against"
CONFIDENCE = 0.95
RULE = ("against fp32 with the same seeds: the mean paired difference and its 95% t-interval over seeds; "
        "unchanged when the interval lies within fp32's seed-to-seed spread (its range over seeds), or includes 0 "
        "and is no wider than that spread either side; lower (or higher) when it lies beyond the spread; stalls at "
        "chance level where fp32 does not")


def num_classes(records: list[dict]) -> int | None:
    """The class count of one model's records (records before schema 3 do not state it: not judged)."""
    return next((r["num_classes"] for r in records if isinstance(r.get("num_classes"), int)), None)


def chance(classes: int | None) -> float | None:
    return 1.0 / classes if classes else None


def at_chance(accuracy_: float | None, classes: int | None) -> bool:
    """Within CHANCE_MARGIN of guessing: nothing was learned."""
    level = chance(classes)
    return accuracy_ is not None and level is not None and accuracy_ <= level + CHANCE_MARGIN


def too_short(fp32_accuracy: float | None, classes: int | None) -> bool:
    """The fp32 run scored at chance level (within CHANCE_MARGIN): its accuracy, and any change against it,
    says nothing about precision."""
    return at_chance(fp32_accuracy, classes)


def by_seed(records: list[dict]) -> dict:
    """{seed: mean eval accuracy of the records trained from it}; records without `seed` all share the spec's
    (the key None)."""
    found: dict = {}
    for r in records:
        if isinstance(r.get("eval_accuracy"), (int, float)) and math.isfinite(r["eval_accuracy"]):
            found.setdefault(r.get("seed"), []).append(float(r["eval_accuracy"]))
    return {seed: float(np.mean(values)) for seed, values in found.items()}


@dataclass(frozen=True)
class Spread:
    """fp32's accuracy over its seeds: the noise a precision's change is held against."""
    seeds: int
    low: float
    high: float

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def label(self) -> str:
        if self.seeds < 2:
            return f"fp32 one seed: {f.percent(self.low)}"
        return f"fp32 over {self.seeds} seeds: {f.percent_span(self.low, self.high)}"


def spread(fp32_records: list[dict]) -> Spread | None:
    accuracies = list(by_seed(fp32_records).values())
    return Spread(len(accuracies), min(accuracies), max(accuracies)) if accuracies else None


@dataclass(frozen=True)
class Check:
    """One precision's accuracy against fp32. verdict: "unchanged", "lower", "higher", "undecided" (the
    interval reaches past fp32's spread: more seeds needed), "stalls" (at chance level where fp32 is not),
    "one seed" (no spread, no verdict), "too short" (fp32 at chance level) or "none" (nothing to compare)."""
    verdict: str
    delta: float | None = None  # mean paired difference, this precision minus fp32
    low: float | None = None  # its 95% t-interval
    high: float | None = None
    pairs: int = 0  # seeds both ran
    fp32: Spread | None = None
    accuracy: float | None = None  # this precision's mean

    @property
    def acceptable(self) -> bool:
        """Accuracy does not rule this precision out: only a measured loss (lower, or stalled) does."""
        return self.verdict not in ("lower", "stalls")

    @property
    def phrase(self) -> str:
        """The change in words a reader cannot misread, citing the interval and fp32's spread."""
        return f"accuracy {self.change}" + (" (fp32 at chance level)" if self.verdict == "too short" else "")

    @property
    def change(self) -> str:
        """The phrase without its subject, for a column headed "change vs fp32"."""
        if self.verdict == "too short":
            return TOO_SHORT
        if self.verdict == "none":
            return "no accuracy to compare"
        if self.verdict == "stalls":
            return f"stalls at chance level ({f.percent(self.accuracy)}; {self.fp32.label})"
        if self.verdict == "one seed":
            return f"{f.points(self.delta)} vs fp32 ({ONE_SEED})"
        words = {"unchanged": "unchanged", "lower": "lower", "higher": "higher",
                 "undecided": "not clearly unchanged"}[self.verdict]
        low, high = (f.percent_number(bound, signed=True) for bound in (self.low, self.high))
        return (f"{words} ({f.points(self.delta)}, {f.percent(CONFIDENCE, 0)} CI {low} to {high} over {self.pairs} "
                f"seeds; {self.fp32.label})")


def compare(records: list[dict], fp32_records: list[dict], classes: int | None) -> Check:
    """This precision's repeats against fp32's, paired by seed."""
    base = spread(fp32_records)
    mine, theirs = by_seed(records), by_seed(fp32_records)
    if base is None or too_short(float(np.mean(list(theirs.values()))), classes):
        return Check("too short" if base is not None else "none", fp32=base)
    if not mine:
        return Check("none", fp32=base)
    accuracy_ = float(np.mean(list(mine.values())))
    paired = sorted(set(mine) & set(theirs), key=str)
    diffs = np.array([mine[s] - theirs[s] for s in paired])
    # seeds that do not meet: the difference of the means, and no interval
    delta = float(diffs.mean()) if paired else accuracy_ - float(np.mean(list(theirs.values())))
    if at_chance(accuracy_, classes):  # a level, not a noise estimate: one seed says it as well as ten
        return Check("stalls", delta, pairs=len(paired), fp32=base, accuracy=accuracy_)
    if len(paired) < 2 or base.seeds < 2:
        return Check("one seed", delta, pairs=len(paired), fp32=base, accuracy=accuracy_)
    from scipy import stats

    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, len(paired) - 1) * diffs.std(ddof=1) / math.sqrt(len(paired)))
    low, high, noise = delta - half, delta + half, base.width
    if (-noise <= low and high <= noise) or (low <= 0 <= high and half <= noise):
        verdict = "unchanged"
    elif high < -noise:
        verdict = "lower"
    elif low > noise:
        verdict = "higher"
    else:
        verdict = "undecided"
    return Check(verdict, delta, low, high, len(paired), base, accuracy_)
