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
precision effect ("too short to judge"). Otherwise a precision's figure is paired with fp32's by seed: repeat r of
every precision trains from the spec's seed + r (weights, data order, dropout), so repeat r of amp_bf16 and repeat
r of fp32 are a pair. The paired differences give a mean and a 95% t-interval, read two ways (`compare`):
- against 0: an interval that excludes 0 is a shift the seeds agree on, lower or higher, and is never called
  unchanged, however small;
- against a margin, +/- the larger of fp32's seed-to-seed standard deviation (what choosing another seed alone
  moves the figure by) and a floor per metric (Metric.floor): an interval within the margin is an equivalence
  decision, two one-sided tests each at 2.5% (stricter than the usual 5% each: the one interval the report
  prints, the 95% one, decides both ways). The standard deviation, not fp32's range: the range widens as seeds are added (about 1.7
  standard deviations over 3 seeds, 3.1 over 10), and more seeds must make a verdict sharper, not more lenient.
So: within the margin and including 0, "unchanged"; within it but excluding 0, "slightly lower" (or higher), a
real shift smaller than the margin, which rules nothing out; excluding 0 and reaching past the margin, "lower" (or
higher), which rules the precision out where it is the worse direction; including 0 and reaching past the margin,
"undecided": more seeds needed. Records without a `seed` field come from runs that reused the spec's seed in every
repeat: their repeats are copies, one seed, no spread, no verdict.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.records import Record
from harness.report import format as f

CHANCE_MARGIN = 0.05  # eval accuracy within 5 points of chance: the run learned nothing (too short, or stalled)
LOSS_MARGIN = 0.05  # eval loss not below ln(vocabulary) by 5% of it: the run learned nothing
# The equivalence margin's floors: without one, an fp32 whose seeds happen to agree (a deterministic model, a small
# eval set) would give a margin of 0, and "unchanged" could never be found. Half a point of accuracy: an accuracy
# near 90% measured on 3,600 held-out samples has a binomial standard error of 0.5 pt, so a finer margin would
# judge which samples the eval set holds, not the precision. 0.01 nats of eval loss: perplexity exp(loss) 1% apart.
ACCURACY_FLOOR = 0.005
LOSS_FLOOR = 0.01
TOO_SHORT = "too short to judge"
ONE_SEED = "one seed: no spread to judge against"
CONFIDENCE = 0.95
NEXT_TOKEN = "next_token"
RULE = ("paired by seed against fp32 (repeat r of every precision trains from the spec's seed + r): the mean "
        "difference and its 95% t-interval over seeds, held against a margin of ± the larger of fp32's seed-to-seed "
        f"standard deviation and a floor ({f.plain(100 * ACCURACY_FLOOR)} pt of accuracy, {f.plain(LOSS_FLOOR)} "
        "nats of eval loss); unchanged when the interval lies within the margin and includes 0; slightly lower (or "
        "higher) when it lies within the margin but excludes 0, a real shift smaller than the margin; lower (or "
        "higher) when it excludes 0 and reaches past the margin; not clearly unchanged (undecided: more seeds "
        "needed) when it includes 0 and reaches past the margin; stalls at chance level where fp32 does not; one "
        "seed, or a run too short to learn, gets no verdict")


def perplexity(loss: float | None) -> float | None:
    """exp(loss): the number of tokens a next-token model is as unsure between as a uniform guess would be."""
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 700 else math.inf  # past float64's range: unbounded


class Metric:
    """What a task's runs are judged by, and how its figures read: one subclass per task, each the same methods."""
    field: str  # the record's field (and the report PooledRuns' attribute) judged
    subject: str  # how a phrase names it
    prefix: str  # what a "change vs fp32" cell says before its verdict
    worse: str  # the verdict ("lower" or "higher") that rules a precision out
    worse_words: str  # a precision so ruled out, in words
    floor: float  # the smallest margin an equivalence is judged against (ACCURACY_FLOOR, LOSS_FLOOR)

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

    def margin(self, value: float) -> str:
        """An equivalence margin, +/- `value`."""
        raise NotImplementedError


class Accuracy(Metric):
    """A classifier's eval accuracy: higher is better, changes in percentage points."""
    field = "eval_accuracy"
    subject = "accuracy"
    prefix = ""
    worse = "lower"
    worse_words = "less accurate"
    floor = ACCURACY_FLOOR

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

    @staticmethod
    def margin(value: float) -> str:
        return f"±{f.percent_number(value)} pt"


class TokenLoss(Metric):
    """A next-token model's eval loss (mean cross-entropy per token, nats): lower is better, perplexity beside
    it, changes in nats."""
    field = "eval_loss"
    subject = "eval loss"
    prefix = "loss "
    worse = "higher"
    worse_words = "worse in eval loss"
    floor = LOSS_FLOOR

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

    @staticmethod
    def margin(value: float) -> str:
        return f"±{f.number(value, 4)} nats"


ACCURACY, TOKEN_LOSS = Accuracy(), TokenLoss()


def metric(records: list[Record]) -> Metric:
    """What these records (one model's) are judged by: eval loss for a next-token task, else eval accuracy
    (records before schema 5 state no task: classifiers)."""
    return TOKEN_LOSS if any(r.task == NEXT_TOKEN for r in records) else ACCURACY


def num_classes(records: list[Record]) -> int | None:
    """The class count (a next-token model's: its vocabulary) of one model's records (records before schema 3 do
    not state it: not judged)."""
    return next((r.num_classes for r in records if r.num_classes is not None), None)


def by_seed(records: list[Record], metric_: Metric) -> dict:
    """{seed: mean of the judged figure over the records trained from it}; records without `seed` all share the
    spec's (the key None)."""
    found: dict = {}
    for r in records:
        value = getattr(r, metric_.field)
        if value is not None and math.isfinite(value):
            found.setdefault(r.seed, []).append(float(value))
    return {seed: float(np.mean(values)) for seed, values in found.items()}


def over_seeds(records: list[Record], metric_: Metric) -> tuple[float | None, tuple[float, float] | None]:
    """An arm's judged figure as the sections show it: its mean over seeds (by_seed), and its range over them
    where there are two seeds or more."""
    values = list(by_seed(records, metric_).values())
    if not values:
        return None, None
    return float(np.mean(values)), (min(values), max(values)) if len(values) > 1 else None


@dataclass(frozen=True)
class Spread:
    """fp32's judged figure over its seeds: its range, and its standard deviation, the noise a precision's change
    is held against."""
    seeds: int
    low: float
    high: float
    metric: Metric = ACCURACY
    sd: float = 0.0  # over seeds (0 with one seed)

    @property
    def margin(self) -> float:
        """The equivalence margin: +/- the larger of the standard deviation and the metric's floor."""
        return max(self.sd, self.metric.floor)

    @property
    def label(self) -> str:
        if self.seeds < 2:
            return f"fp32 one seed: {self.metric.show(self.low)}"
        return f"fp32 over {self.seeds} seeds: {self.metric.span(self.low, self.high)}"


def spread(fp32_records: list[Record], metric_: Metric | None = None) -> Spread | None:
    metric_ = metric_ or metric(fp32_records)
    values = list(by_seed(fp32_records, metric_).values())
    if not values:
        return None
    return Spread(len(values), min(values), max(values), metric_, float(np.std(values, ddof=1)) if len(values) > 1
                  else 0.0)


#: verdicts that say nothing yet: no spread or pair to judge by, fp32 at chance level, an interval too wide, nothing
NO_VERDICT = ("undecided", "one seed", "too short", "none")


@dataclass(frozen=True)
class Check:
    """One precision's judged figure (accuracy, or a next-token model's eval loss) against fp32. verdict: the
    figure "unchanged", "slightly lower" or "slightly higher" (within the margin, 0 excluded), "lower" or "higher"
    (0 excluded, past the margin), "undecided" (0 included, past the margin: more seeds needed), "stalls" (at
    chance level where fp32 is not), "one seed" (no spread, no verdict), "too short" (fp32 at chance level) or
    "none" (nothing to compare): the module's docstring says why. `outcome` says which of lower and higher is
    worse."""
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
        """The verdict as a quality: "worse" or "better" for lower or higher by the metric's direction, "slightly
        worse" or "slightly better" within the margin."""
        slightly, _, direction = self.verdict.rpartition(" ")
        if direction in ("lower", "higher"):
            quality = "worse" if direction == self.metric.worse else "better"
            return f"{slightly} {quality}".lstrip()
        return self.verdict

    @property
    def acceptable(self) -> bool:
        """The figure does not rule this precision out: only a measured loss of quality past the margin (worse,
        or stalled) does."""
        return self.outcome not in ("worse", "stalls")

    @property
    def decided(self) -> bool:
        """A verdict was drawn: not undecided, one seed, too short or nothing to compare (NO_VERDICT)."""
        return self.verdict not in NO_VERDICT

    @property
    def phrase(self) -> str:
        """The change in words a reader cannot misread, citing the interval, the margin and fp32's spread."""
        tail = " (fp32 at chance level)" if self.verdict == "too short" else ""
        return f"{self.metric.subject} {self._words}{tail}"

    @property
    def change(self) -> str:
        """The phrase without its subject, for a column headed "change vs fp32"."""
        if self.verdict in ("too short", "none"):
            return self._words
        return self.metric.prefix + self._words

    @property
    def figures(self) -> str:
        """The paired difference, its interval and the margin, as every section cites them: "+0.0107 nats, 95% CI
        +0.0069 to +0.0145 over 3 seeds; margin ±0.0100 nats" (only where there is an interval)."""
        m = self.metric
        return (f"{m.delta(self.delta)}, {f.percent(CONFIDENCE, 0)} CI {m.bound(self.low)} to {m.bound(self.high)} "
                f"over {self.pairs} seeds; margin {m.margin(self.fp32.margin)}")

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
        words = "not clearly unchanged" if self.verdict == "undecided" else self.verdict
        return f"{words} ({self.figures}; {self.fp32.label})"


def compare(records: list[Record], fp32_records: list[Record], classes: int | None,
            metric_: Metric | None = None) -> Check:
    """This precision's repeats against fp32's, paired by seed, on the figure their task is judged by (or on
    `metric_`: a classifier's eval loss is a cross-entropy in nats too, judged as a next-token model's)."""
    base = spread(fp32_records, metric_)
    metric_ = metric_ or metric(fp32_records + records)
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
    low, high = delta - half, delta + half
    within = -base.margin <= low and high <= base.margin  # equivalent: two one-sided tests, each at 2.5%
    if low > 0 or high < 0:  # a shift the seeds agree on is never "unchanged", however small
        verdict = ("slightly " if within else "") + ("higher" if low > 0 else "lower")
    else:
        verdict = "unchanged" if within else "undecided"
    return Check(verdict, delta, low, high, len(paired), base, value, metric_)
