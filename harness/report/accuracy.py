"""When an accuracy figure means something, and what a change of it against fp32 may be called.

What a run is judged by depends on its task (the record's `task`, schema 5; older records are classifiers):
- a classifier by its eval accuracy (Accuracy): higher is better; chance level is 1 / num_classes, and a run
  within CHANCE_MARGIN (5 points) of it learned nothing.
- a next-token model (TokenLoss) by its eval loss, the mean cross-entropy per token in nats: token accuracy is
  not what people ask of a language model. Lower is better, and perplexity exp(loss) is shown beside it. Its
  chance level is ln(vocabulary), the loss of a uniform guess over the `num_classes` tokens: a run learned
  nothing unless its loss lies below ln(vocabulary) by a clear margin, LOSS_MARGIN (5%) of it, i.e. below
  0.95 ln(vocabulary) (5.27 nats, perplexity 194, for 256 bytes). A relative margin, as the 5 points of
  accuracy are: it scales with the vocabulary as chance level does.

A run too short to learn anything scores at chance level, and a change against such a baseline is noise, not a
precision effect ("too short to judge"). Otherwise a precision's figure is judged against fp32's own
seed-to-seed spread: repeat r of every precision trains from the spec's seed + r (weights, data order,
dropout), so repeat r of amp_bf16 and repeat r of fp32 are a pair. The paired differences give a mean and a
95% t-interval; the fp32 repeats' range over seeds is the noise that interval is held against, the same way
for accuracy and for loss. Records without a `seed` field come from runs that reused the spec's seed in every
repeat: their repeats are copies, one seed, no spread.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.report import format as f

CHANCE_MARGIN = 0.05  # eval accuracy within 5 points of chance: the run learned nothing (too short, or stalled)
LOSS_MARGIN = 0.05  # eval loss not below ln(vocabulary) by 5% of it: the run learned nothing
TOO_SHORT = "too short to judge"
ONE_SEED = "one seed: no spread to judge against"
CONFIDENCE = 0.95
NEXT_TOKEN = "next_token"
RULE = ("against fp32 with the same seeds: the mean paired difference and its 95% t-interval over seeds; "
        "unchanged when the interval lies within fp32's seed-to-seed spread (its range over seeds), or includes 0 "
        "and is no wider than that spread either side; lower (or higher) when it lies beyond the spread; stalls at "
        "chance level where fp32 does not")


def perplexity(loss: float | None) -> float | None:
    """exp(loss): the number of tokens a next-token model is as unsure between as a uniform guess would be."""
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 700 else math.inf  # past float64's range: unbounded


class Metric:
    """What a task's runs are judged by, and how its figures read: one subclass per task, each the same methods."""
    field: str  # the record's field (and the report Cell's attribute) judged
    subject: str  # how a phrase names it
    prefix: str  # what a "change vs fp32" cell says before its verdict
    worse: str  # the verdict ("lower" or "higher") that rules a precision out
    worse_words: str  # a precision so ruled out, in words

    def chance(self, classes: int | None) -> float | None:
        """The figure of a run that learned nothing: guessing among `classes`."""
        raise NotImplementedError

    def at_chance(self, value: float | None, classes: int | None) -> bool:
        raise NotImplementedError

    def show(self, value: float) -> str:
        """One mean, as a sentence cites it."""
        raise NotImplementedError

    def cells(self, value: float | None) -> list[str]:
        """One mean as a table's columns show it (pure16)."""
        raise NotImplementedError

    def span(self, low: float, high: float) -> str:
        raise NotImplementedError

    def delta(self, value: float | None) -> str:
        """A paired difference, this precision minus fp32."""
        raise NotImplementedError

    def bound(self, value: float) -> str:
        """A bound of the difference's interval."""
        raise NotImplementedError


class Accuracy(Metric):
    """A classifier's eval accuracy: higher is better, changes in percentage points."""
    field = "eval_accuracy"
    subject = "accuracy"
    prefix = ""
    worse = "lower"
    worse_words = "less accurate"

    @staticmethod
    def chance(classes: int | None) -> float | None:
        return 1.0 / classes if classes else None

    def at_chance(self, value: float | None, classes: int | None) -> bool:
        """Within CHANCE_MARGIN of guessing: nothing was learned."""
        level = self.chance(classes)
        return value is not None and level is not None and value <= level + CHANCE_MARGIN

    @staticmethod
    def show(value: float) -> str:
        return f.percent(value)

    @staticmethod
    def cells(value: float | None) -> list[str]:
        return [f.percent(value)]

    @staticmethod
    def span(low: float, high: float) -> str:
        return f.percent_span(low, high)

    @staticmethod
    def delta(value: float | None) -> str:
        return f.points(value)

    @staticmethod
    def bound(value: float) -> str:
        return f.percent_number(value, signed=True)


class TokenLoss(Metric):
    """A next-token model's eval loss (mean cross-entropy per token, nats): lower is better, perplexity beside
    it, changes in nats."""
    field = "eval_loss"
    subject = "eval loss"
    prefix = "loss "
    worse = "higher"
    worse_words = "worse in eval loss"

    @staticmethod
    def chance(classes: int | None) -> float | None:
        return math.log(classes) if classes and classes > 1 else None

    def at_chance(self, value: float | None, classes: int | None) -> bool:
        """Not below ln(vocabulary) by LOSS_MARGIN of it: nothing was learned."""
        level = self.chance(classes)
        return value is not None and level is not None and value >= (1 - LOSS_MARGIN) * level

    @staticmethod
    def show(value: float) -> str:
        return f"loss {f.number(value, 4)}, perplexity {f.number(perplexity(value), 2)}"

    @staticmethod
    def cells(value: float | None) -> list[str]:
        return [f.number(value, 4), f.number(perplexity(value), 2)]

    @staticmethod
    def span(low: float, high: float) -> str:
        return (f"loss {f.number_span(low, high, 4)}, perplexity "
                f"{f.number_span(perplexity(low), perplexity(high), 2)}")

    @staticmethod
    def delta(value: float | None) -> str:
        return f.nats(value)

    @staticmethod
    def bound(value: float) -> str:
        return f.signed(value, 4)


ACCURACY, TOKEN_LOSS = Accuracy(), TokenLoss()


def metric(records: list[dict]) -> Metric:
    """What these records (one model's) are judged by: eval loss for a next-token task, else eval accuracy
    (records before schema 5 state no task: classifiers)."""
    return TOKEN_LOSS if any(r.get("task") == NEXT_TOKEN for r in records) else ACCURACY


def num_classes(records: list[dict]) -> int | None:
    """The class count (a next-token model's: its vocabulary) of one model's records (records before schema 3 do
    not state it: not judged)."""
    return next((r["num_classes"] for r in records if isinstance(r.get("num_classes"), int)), None)


def by_seed(records: list[dict], metric_: Metric) -> dict:
    """{seed: mean of the judged figure over the records trained from it}; records without `seed` all share the
    spec's (the key None)."""
    found: dict = {}
    for r in records:
        value = r.get(metric_.field)
        if isinstance(value, (int, float)) and math.isfinite(value):
            found.setdefault(r.get("seed"), []).append(float(value))
    return {seed: float(np.mean(values)) for seed, values in found.items()}


@dataclass(frozen=True)
class Spread:
    """fp32's judged figure over its seeds: the noise a precision's change is held against."""
    seeds: int
    low: float
    high: float
    metric: Metric = ACCURACY

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def label(self) -> str:
        if self.seeds < 2:
            return f"fp32 one seed: {self.metric.show(self.low)}"
        return f"fp32 over {self.seeds} seeds: {self.metric.span(self.low, self.high)}"


def spread(fp32_records: list[dict]) -> Spread | None:
    metric_ = metric(fp32_records)
    values = list(by_seed(fp32_records, metric_).values())
    return Spread(len(values), min(values), max(values), metric_) if values else None


@dataclass(frozen=True)
class Check:
    """One precision's judged figure (accuracy, or a next-token model's eval loss) against fp32. verdict: the
    figure "unchanged", "lower", "higher", "undecided" (the interval reaches past fp32's spread: more seeds
    needed), "stalls" (at chance level where fp32 is not), "one seed" (no spread, no verdict), "too short" (fp32
    at chance level) or "none" (nothing to compare). `outcome` says which of lower and higher is worse."""
    verdict: str
    delta: float | None = None  # mean paired difference, this precision minus fp32
    low: float | None = None  # its 95% t-interval
    high: float | None = None
    pairs: int = 0  # seeds both ran
    fp32: Spread | None = None
    value: float | None = None  # this precision's mean
    metric: Metric = ACCURACY

    @property
    def outcome(self) -> str:
        """The verdict as a quality: "worse" or "better" for lower or higher, by the metric's direction."""
        if self.verdict in ("lower", "higher"):
            return "worse" if self.verdict == self.metric.worse else "better"
        return self.verdict

    @property
    def acceptable(self) -> bool:
        """The figure does not rule this precision out: only a measured loss of quality (worse, or stalled)
        does."""
        return self.outcome not in ("worse", "stalls")

    @property
    def phrase(self) -> str:
        """The change in words a reader cannot misread, citing the interval and fp32's spread."""
        tail = " (fp32 at chance level)" if self.verdict == "too short" else ""
        return f"{self.metric.subject} {self._words}{tail}"

    @property
    def change(self) -> str:
        """The phrase without its subject, for a column headed "change vs fp32"."""
        if self.verdict in ("too short", "none"):
            return self._words
        return self.metric.prefix + self._words

    @property
    def _words(self) -> str:
        m = self.metric
        if self.verdict == "too short":
            return TOO_SHORT
        if self.verdict == "none":
            return f"no {m.subject} to compare"
        if self.verdict == "stalls":
            return f"stalls at chance level ({m.show(self.value)}; {self.fp32.label})"
        if self.verdict == "one seed":
            return f"{m.delta(self.delta)} vs fp32 ({ONE_SEED})"
        words = {"unchanged": "unchanged", "lower": "lower", "higher": "higher",
                 "undecided": "not clearly unchanged"}[self.verdict]
        low, high = (m.bound(bound) for bound in (self.low, self.high))
        return (f"{words} ({m.delta(self.delta)}, {f.percent(CONFIDENCE, 0)} CI {low} to {high} over {self.pairs} "
                f"seeds; {self.fp32.label})")


def compare(records: list[dict], fp32_records: list[dict], classes: int | None) -> Check:
    """This precision's repeats against fp32's, paired by seed, on the figure their task is judged by."""
    metric_ = metric(fp32_records + records)
    base = spread(fp32_records)
    mine, theirs = by_seed(records, metric_), by_seed(fp32_records, metric_)
    if base is None or metric_.at_chance(float(np.mean(list(theirs.values()))), classes):
        return Check("too short" if base is not None else "none", fp32=base, metric=metric_)
    if not mine:
        return Check("none", fp32=base, metric=metric_)
    value = float(np.mean(list(mine.values())))
    paired = sorted(set(mine) & set(theirs), key=str)
    diffs = np.array([mine[s] - theirs[s] for s in paired])
    # seeds that do not meet: the difference of the means, and no interval
    delta = float(diffs.mean()) if paired else value - float(np.mean(list(theirs.values())))
    if metric_.at_chance(value, classes):  # a level, not a noise estimate: one seed says it as well as ten
        return Check("stalls", delta, pairs=len(paired), fp32=base, value=value, metric=metric_)
    if len(paired) < 2 or base.seeds < 2:
        return Check("one seed", delta, pairs=len(paired), fp32=base, value=value, metric=metric_)
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
    return Check(verdict, delta, low, high, len(paired), base, value, metric_)
