"""The report as data: typed objects for what the page and the Markdown summary show, the View holding every
section. `view.build_view` makes them from records; the templates (harness/report/templates) render them. The
verdicts they carry (PooledRuns, Comparison and their words) are harness.report.verdicts'.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from harness.report.accuracy import Check
from harness.report.answer import Block
from harness.report.fp8 import Fp8Section
from harness.report.profile import ProfileSection
from harness.report.pure16 import Pure16Section
from harness.report.scaling import ScalingSection
from harness.report.verdicts import Comparison


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
class NumericsEntry:
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
class StudyPoint:
    """One loss-scale setting of a study: means over its runs, and fp32's figures it is held against."""
    x: float  # where the chart places it: log2 of a fixed scale; unscaled left of them all, dynamic right
    label: str  # "none", "dynamic" or the fixed scale as a power of two
    accuracy: float  # eval accuracy (nan: no ok run)
    loss: float | None  # eval loss
    eval_loss: str  # formatted, as its table shows them
    perplexity: str
    skipped: float  # steps the scaler skipped
    status: str  # its runs' statuses
    runs: int
    fp32_accuracy: float | None
    fp32_loss: float | None


@dataclass(frozen=True)
class Study:
    """One loss-scale study: a point per loss-scale setting (the chart's input, means over its runs)."""
    study: str
    model: str | None
    framework: str
    precision: str
    rows: list[StudyPoint]
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
    numerics: list[NumericsEntry]
    studies: list[Study]
    sixteen_bit_safe: list[str]
    pure16: Pure16Section
    profile: ProfileSection
    crossover: ScalingSection  # the scaling studies: where 16-bit starts to pay (harness.report.scaling)
    fp8: Fp8Section  # the FP8 precisions beside fp32 and amp_bf16 (harness.report.fp8)
