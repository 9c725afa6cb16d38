"""The report's verdicts: a precision's runs pooled (PooledRuns), a comparison against fp32 (Comparison) and the
words for its decision (VERDICTS). Every section that judges speed reads them from here; this module imports no
section, so the sections, the view and the first screen all build on it and none of them on each other.

A PooledRuns is every ok repeat of one (model, framework, setting, precision, loss-scale setting); it knows the
fp32 runs of its setting (`fp32`, found once when they are pooled). A Comparison is a non-fp32 pool against that
fp32 pool: it holds both, so nothing looks the baseline up again. Both keep their figures as numbers; the tables'
rows carry them formatted (harness.report.format), as the page and the Markdown show them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from harness import results, stats
from harness.identity import setting
from harness.records import RunRecord
from harness.report import format as f
from harness.report.accuracy import Check, metric, perplexity

#: a comparison's decision (stats.Ratio.decision) in words
VERDICTS = {"faster": "faster", "same": "no clear difference", "slower": "slower",
            "undecided": "too noisy here to decide", "too few": "not enough repeats for a verdict",
            "none": "no comparison"}
DECIDED = ("faster", "slower", "same")  # the decisions that say something of speed ("too few", "undecided" do not)


def speed_words(r: stats.Ratio) -> str:
    """A speed comparison in words, by its decision: a direction only where one was decided."""
    return f.faster(r.estimate) if r.decision in ("faster", "slower") else VERDICTS[r.decision]


class PooledRuns:
    """All ok repeats of one (model, framework, setting, precision, loss-scale setting)."""

    def __init__(self, key: tuple, records: list[RunRecord], label: str, setting_note: str = "", scale_note: str = ""):
        # label: framework and what differs, for tables; setting_note: what differs besides the device (the
        # first screen has a matrix per device, a column per framework); scale_note: the loss-scale setting
        # where it varies
        self.key, self.records, self.label = key, records, label
        self.setting_note, self.scale_note = setting_note, scale_note
        r0 = records[0]
        self.model, self.framework, self.precision = r0.model, r0.framework, r0.precision
        self.column = self.framework
        self.name = f"{self.framework}{setting_note}"  # how the first screen names this cell's framework
        self.setting = setting(r0.written)
        self.device = self.setting.device or "-"
        self.fp32: PooledRuns | None = None  # the fp32 cell of the same setting (itself for an fp32 cell), set by view
        self.judged = True  # False: fp32 scored at chance level, its judged figures mean nothing (see accuracy.py)
        timed = [r for r in records if r.step_times_ms]
        self.repeats = [r.step_times_ms for r in timed]
        # one figure per process, its repeats' median steps pooled (processes are independent; the steps and the
        # repeats of one process are not: stats.per_process)
        self.process_ms = stats.per_process([float(np.median(t)) for t in self.repeats],
                                            [r.process for r in timed])
        self.median_ms = stats.geometric_mean(self.process_ms)
        # --repeats auto's runs (each with its round): what its sequential test saw, for speed_up to replay
        self.auto_repeats = results.auto_timing([r.written for r in timed]) \
            if all(r.auto_round is not None for r in timed) else None
        pooled = np.concatenate(self.repeats)
        self.p10_ms, self.p90_ms = (float(np.percentile(pooled, q)) for q in (10, 90))
        self.cv = stats.spread(self.process_ms)
        self.unstable = self.cv is not None and self.cv > stats.UNSTABLE_CV
        self.first_step_ms = median(r.first_step_ms for r in records)
        self.samples_per_s = r0.batch_size / (self.median_ms / 1e3)
        # token sequences (schema 5): the T tokens of each sample, so a sequence model's throughput is tokens/s
        self.tokens_per_sample = r0.tokens_per_sample
        self.tokens_per_s = self.samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None
        self.gflops = r0.flops_per_step / (self.median_ms / 1e3) / 1e9 if r0.flops_per_step else None
        self.efficiency = median(r.efficiency for r in records)
        self.peak_mb = median(r.peak_memory_mb for r in records)
        self.memory_kind = r0.memory_kind
        self.state_mb = r0.state_memory_mb
        self.eval_accuracy = mean(r.eval_accuracy for r in records)
        self.eval_loss = mean(r.eval_loss for r in records)
        self.perplexity = perplexity(self.eval_loss)
        self.metric = metric(records)  # what its accuracy comparisons judge: accuracy, or a next-token model's loss
        self.batch_size = r0.batch_size
        self.flops_per_step = r0.flops_per_step

    @property
    def baseline(self) -> PooledRuns | None:
        """The fp32 cell this one is compared with: None for an fp32 cell and where no fp32 ran."""
        return self.fp32 if self.fp32 is not self else None

    @property
    def step(self) -> str:
        """Its step time as the first screen and the prose say it, with tokens/s beside it for a sequence model."""
        tokens = f", {f.number(self.tokens_per_s, 0)} tokens/s" if self.tokens_per_s else ""
        return f"{f.ms(self.median_ms)} ms/step{tokens}"

    @property
    def figure(self) -> float | None:
        """The mean of what its accuracy comparisons judge (accuracy.metric): eval accuracy, or eval loss."""
        return getattr(self, self.metric.field)

    def loss_curve(self) -> list:
        curves = [r.loss for r in self.records if r.loss]
        length = min(len(c) for c in curves)
        arr = np.array([[np.nan if v is None else v for v in c[:length]] for c in curves], dtype=float)
        return [None if np.isnan(v) else float(v) for v in np.nanmean(arr, axis=0)] if arr.size else []


def median(values):
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


@dataclass(frozen=True)
class Comparison:
    """A non-fp32 cell against the fp32 cell of its setting: speed (fp32's step time over this one's), memory
    saved and the accuracy change, paired by seed (accuracy.Check)."""
    cell: PooledRuns
    fp32: PooledRuns
    speed: stats.Ratio  # > 1: faster than fp32
    accuracy_check: Check
    accuracy: str  # the change in words, as the accuracy table shows it
    memory: str  # peak memory saved against fp32, formatted

    @property
    def key(self) -> tuple:
        return self.cell.key

    @property
    def model(self) -> str:
        return self.cell.model

    @property
    def framework(self) -> str:
        return self.cell.label

    @property
    def precision(self) -> str:
        return self.cell.precision

    @property
    def ratio(self) -> float:
        return self.speed.estimate

    @property
    def lo(self) -> float:
        return self.speed.low

    @property
    def hi(self) -> float:
        return self.speed.high

    @property
    def interval(self) -> bool:
        return self.speed.is_interval

    @property
    def ci(self) -> str:
        return self.speed.label

    @property
    def decision(self) -> str:
        return self.speed.decision

    @property
    def unstable(self) -> bool:
        return self.cell.unstable or self.fp32.unstable

    @property
    def flag(self) -> bool:
        return not self.accuracy_check.acceptable

    @property
    def text(self) -> str:
        """The comparison in words, by its decision: a direction only where one was decided."""
        return speed_words(self.speed)

    def among(self, k: int) -> Comparison:
        """This comparison with its interval computed for being chosen among k (Bonferroni, stats.ratio's
        `comparisons`): the best of k must not look surer than one comparison would. A sequential decision
        (speed_up) stays as its run made it: it was adjusted for the precisions compared with its fp32 cell then."""
        if self.speed.look is not None:
            return self
        return replace(self, speed=stats.ratio(self.fp32.process_ms, self.cell.process_ms, comparisons=k))


def speed_up(base: PooledRuns, cell: PooledRuns, comparisons: int = 1) -> stats.Ratio:
    """fp32's figures over the cell's. Where both cells' runs came from `--repeats auto` (each record names its round),
    the sequential test it ran, replayed (stats.sequential): the interval that decided, at its look's level, as the
    run printed it, or its last look; `comparisons`: the precisions compared with the same fp32 cell, as the run
    adjusted for them. Otherwise the 95% interval over every process."""
    if base.auto_repeats and cell.auto_repeats:
        found = stats.sequential(base.auto_repeats, cell.auto_repeats, comparisons=comparisons)
        if found is not None:
            return found
    return stats.ratio(base.process_ms, cell.process_ms)
