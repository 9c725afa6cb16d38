"""The report as data: typed objects for what the page and the Markdown summary show. `view.build_view` makes
them from records; the templates (harness/report/templates) render them; `answer` and `explain` read them.

A Cell is every ok repeat of one (model, framework, setting, precision, loss-scale setting); it knows the fp32
cell of its setting (`fp32`, found once when the cells are made). A Comparison is a non-fp32 cell against that
fp32 cell: it holds both, so nothing looks the baseline up again. Cells and comparisons keep their figures as
numbers; the tables' rows carry them formatted (harness.report.format), as the page and the Markdown show them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from harness import results, stats
from harness.report import format as f
from harness.report.accuracy import Check, metric, perplexity
from harness.identity import setting

if TYPE_CHECKING:  # they build on the objects here
    from harness.report.answer import Block
    from harness.report.fp8 import Fp8Section
    from harness.report.profile import ProfileSection
    from harness.report.pure16 import Pure16Section
    from harness.report.scaling import ScalingSection

#: a comparison's decision (stats.Ratio.decision) in words
VERDICTS = {"faster": "faster", "same": "no clear difference", "slower": "slower",
            "undecided": "too noisy here to decide", "too few": "not enough repeats for a verdict",
            "none": "no comparison"}
DECIDED = ("faster", "slower", "same")  # the decisions that say something of speed ("too few", "undecided" do not)


def speed_words(r: stats.Ratio) -> str:
    """A speed comparison in words, by its decision: a direction only where one was decided."""
    return f.faster(r.estimate) if r.decision in ("faster", "slower") else VERDICTS[r.decision]


class Cell:
    """All ok repeats of one (model, framework, setting, precision, loss-scale setting)."""

    def __init__(self, key: tuple, records: list[dict], label: str, setting_note: str = "", scale_note: str = ""):
        # label: framework and what differs, for tables; setting_note: what differs besides the device (the
        # first screen has a matrix per device, a column per framework); scale_note: the loss-scale setting
        # where it varies
        self.key, self.records, self.label = key, records, label
        self.setting_note, self.scale_note = setting_note, scale_note
        r0 = records[0]
        self.model, self.framework, self.precision = r0["model"], r0["framework"], r0["precision"]
        self.column = self.framework
        self.name = f"{self.framework}{setting_note}"  # how the first screen names this cell's framework
        self.setting = setting(r0)
        self.device = self.setting.device or "-"
        self.fp32: Cell | None = None  # the fp32 cell of the same setting (itself for an fp32 cell), set by view
        self.judged = True  # False: fp32 scored at chance level, its judged figures mean nothing (see accuracy.py)
        timed = [r for r in records if r.get("step_times_ms")]
        self.repeats = [r["step_times_ms"] for r in timed]
        # one figure per process, its repeats' median steps pooled (processes are independent; the steps and the
        # repeats of one process are not: stats.per_process)
        self.process_ms = stats.per_process([float(np.median(t)) for t in self.repeats],
                                            [r.get("process") for r in timed])
        self.median_ms = stats.geometric_mean(self.process_ms)
        # --repeats auto's runs (each with its round): what its sequential test saw, for speed_up to replay
        self.auto_repeats = results.auto_timing(timed) if all(r.get("auto_round") is not None for r in timed) \
            else None
        pooled = np.concatenate(self.repeats)
        self.p10_ms, self.p90_ms = (float(np.percentile(pooled, q)) for q in (10, 90))
        self.cv = stats.spread(self.process_ms)
        self.unstable = self.cv is not None and self.cv > stats.UNSTABLE_CV
        self.first_step_ms = median(r.get("first_step_ms") for r in records)
        self.samples_per_s = r0["batch_size"] / (self.median_ms / 1e3)
        # token sequences (schema 5): the T tokens of each sample, so a sequence model's throughput is tokens/s
        self.tokens_per_sample = r0.get("tokens_per_sample")
        self.tokens_per_s = self.samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None
        self.gflops = r0["flops_per_step"] / (self.median_ms / 1e3) / 1e9 if r0.get("flops_per_step") else None
        self.efficiency = median(r.get("efficiency") for r in records)
        self.peak_mb = median(r.get("peak_memory_mb") for r in records)
        self.memory_kind = r0.get("memory_kind")
        self.state_mb = r0.get("state_memory_mb") or {}
        self.eval_accuracy = mean(r.get("eval_accuracy") for r in records)
        self.eval_loss = mean(r.get("eval_loss") for r in records)
        self.perplexity = perplexity(self.eval_loss)
        self.metric = metric(records)  # what its accuracy comparisons judge: accuracy, or a next-token model's loss
        self.batch_size = r0["batch_size"]
        self.flops_per_step = r0.get("flops_per_step")

    @property
    def baseline(self) -> Cell | None:
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
        curves = [r["loss"] for r in self.records if r.get("loss")]
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
    cell: Cell
    fp32: Cell
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


def speed_up(base: Cell, cell: Cell, comparisons: int = 1) -> stats.Ratio:
    """fp32's figures over the cell's. Where both cells' runs came from `--repeats auto` (each record names its round),
    the sequential test it ran, replayed (stats.sequential): the interval that decided, at its look's level, as the
    run printed it, or its last look; `comparisons`: the precisions compared with the same fp32 cell, as the run
    adjusted for them. Otherwise the 95% interval over every process."""
    if base.auto_repeats and cell.auto_repeats:
        found = stats.sequential(base.auto_repeats, cell.auto_repeats, comparisons=comparisons)
        if found is not None:
            return found
    return stats.ratio(base.process_ms, cell.process_ms)


@dataclass
class Section:
    """Per model: its step-time chart, its loss chart (or the sentence that stands in for it) and its loss-scale
    chart and notes. Charts are SVG markup (harness.report.svg escapes its text)."""
    model: str
    speed_chart: str
    speed_caption: str
    loss_chart: str | None = None
    loss_caption: str | None = None
    loss_note: str | None = None
    scale_chart: str | None = None
    scale_caption: str | None = None
    scale_notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SpeedRow:
    model: str
    framework: str
    precision: str
    batch: int
    median: str
    tokens: str  # tokens/s, for a sequence model ("-" otherwise)
    spread: str
    samples: str
    first: str
    gflops: str
    efficiency: str
    repeats: int
    cv: str
    unstable: bool


@dataclass(frozen=True)
class MemoryRow:
    model: str
    framework: str
    precision: str
    peak: str
    kind: str | None
    state: str
    optimizer: str
    saved: str


@dataclass(frozen=True)
class AccuracyRow:
    model: str
    framework: str
    precision: str
    accuracy: str  # a next-token model's is "-": it is judged by loss and perplexity
    loss: str
    perplexity: str  # exp(eval loss), for a next-token model ("-" otherwise)
    judged: bool
    delta: str  # the change against fp32 in words; fp32's own row: its seed-to-seed spread
    flag: bool
    check: Check | None


@dataclass(frozen=True)
class ScalingRow:
    model: str
    framework: str
    precision: str
    repeat: int
    mode: str | None
    initial: str
    final: str
    skipped: int | None
    first_overflow: int | str


@dataclass(frozen=True)
class Fastest:
    """Per model, precision and device, the framework with the lowest median step time among those whose cell may
    be ranked (answer.ranked: MIN_REPEATS repeats, and a decided speed against fp32); `framework` says so where
    none may."""
    model: str
    precision: str
    device: str
    framework: str
    median: str
    tokens: str  # tokens/s, for a sequence model ("-" otherwise)
    of: int  # frameworks that ran it
    ranked: int  # of them, those it is the best of


@dataclass(frozen=True)
class NotRun:
    model: str
    framework: str | None
    precision: str | None
    repeat: int | None
    status: str | None
    reason: str


@dataclass(frozen=True)
class Diagnosis:
    """One diagnosed (model, framework) of the Numerics section: its gradient histogram and verdicts, or a note
    saying why there are none."""
    model: str | None
    framework: str | None
    chart: str | None = None
    verdicts: list[str] = field(default_factory=list)
    note: str | None = None
    #: the attention score gradients' headroom at the largest loss scale its amp_fp16 runs reached (view.score_headroom)
    headroom: str | None = None


@dataclass(frozen=True)
class Study:
    """One loss-scale study: a point per loss-scale setting (the chart's input, means over its runs)."""
    study: str
    model: str | None
    framework: str
    precision: str
    rows: list[dict]
    chart: str
    next_token: bool = False  # judged by eval loss: its rows show perplexity, not accuracy (accuracy.TokenLoss)


@dataclass(frozen=True)
class Environment:
    """One (framework, version, device) the runs used: what ran them, and the framework options they set."""
    framework: str
    version: str
    device: str
    details: str  # the device's details as JSON
    cpu: str | None
    flags: str
    threads: int | None
    python: str | None
    os: str | None
    options: list[str]


@dataclass(frozen=True)
class SpecHash:
    hash: str
    frameworks: str


@dataclass(frozen=True)
class SpecHashes:
    """A model's spec hashes: one means every framework trained the same spec, seed and overrides."""
    model: str
    hashes: list[SpecHash]


@dataclass(frozen=True)
class Why:
    """An explanation the records support (harness.report.explain): `short` says its cause in one sentence, the
    same for every entry of that cause; `about` names the models and frameworks it concerns."""
    title: str
    text: str
    short: str
    about: tuple[str, ...] = ()


@dataclass
class View:
    """Everything the report shows, made by view.build_view and rendered by render (HTML) and markdown."""
    generated: str
    n_records: int
    n_ok: int
    skipped: list[str]
    models: list[str]
    frameworks: list[str]
    answer: list[Block]  # per device
    headline: list[str]
    any_range: bool
    min_repeats: int
    unstable_cv: float
    precise: float
    chance_margin: float
    summary: list[Comparison]
    fastest: list[Fastest]
    speed: list[SpeedRow]
    any_tokens: bool  # some model reads token sequences: the tables get a tokens/s column
    memory: list[MemoryRow]
    memory_note: str
    accuracy: list[AccuracyRow]
    accuracy_rule: str
    any_too_short: bool  # a classifier's fp32 scored at chance level
    any_next_token: bool  # some model is judged by eval loss and perplexity (accuracy.TokenLoss)
    loss_margin: float
    any_too_short_loss: bool  # a next-token model's fp32 eval loss is not clearly below ln(vocabulary)
    scaling: list[ScalingRow]
    sections: list[Section]
    why: list[Why]
    why_short: list[str]
    not_run: list[NotRun]
    environment: list[Environment]
    spec_hashes: list[SpecHashes]
    parity: list | None
    numerics: list[Diagnosis]
    studies: list[Study]
    sixteen_bit_safe: list[str]
    pure16: Pure16Section
    profile: ProfileSection
    crossover: ScalingSection  # the scaling studies: where 16-bit starts to pay (harness.report.scaling)
    fp8: Fp8Section  # the FP8 precisions beside fp32 and amp_bf16 (harness.report.fp8)
