"""The report's FP8 section: per model, framework and setting (harness.identity) with an FP8 run, fp32, amp_bf16
and each FP8 precision (fp8_e4m3, fp8_hybrid, with a recipe suffix where they had one: fp8_hybrid:delayed:16)
side by side: eval loss and its range over seeds, its change against fp32 paired by seed with its 95% interval,
margin and verdict (harness.report.accuracy.compare, the report's one accuracy rule), eval accuracy and its range
(a next-token model's perplexity instead: its token accuracy means little) with a classifier's accuracy verdict,
the one the Accuracy section gives; how each FP8 precision's matmuls ran, as its records say
(options["fp8"]["matmuls"]; a record without it is older than the option: emulated); and what diagnose says of
each FP8 recipe (harness.fp8.verdicts), which the Numerics section then leaves to this one.

Emulated FP8 casts each matmul's inputs to FP8 and back and multiplies in float32: it costs more than fp32, and its
step times measure the emulation, not FP8. So the section shows a step-time ratio against fp32 (harness.stats.ratio,
as the comparisons' speed-ups) for FP8 precisions whose matmuls ran natively only.

    section = fp8_section(records, diagnoses)   # the records' models (harness.results.typed)
    section.entries, section.diagnoses, section.shown (templates/_fp8.html.j2, _fp8.md.j2)
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.identity import describe, varying
from harness.records import DiagnosisRecord, RunRecord
from harness.report import accuracy
from harness.report import format as f
from harness.report.accuracy import Check
from harness.report.arms import Arm, base_precision, by_setting, is_fp8
from harness.report.verdicts import speed_words

BESIDE = ("fp32", "amp_bf16")  # what FP8 stands beside: the reference, and mixed bf16 (float32 master weights)


def _change(check: Check | None) -> str:
    """A change against fp32 as a column shows it: "+0.0123 nats, 95% CI -0.0010 to +0.0250 over 3 seeds; margin
    ±0.0100 nats (undecided)"; without an interval (too short, stalls, one seed, nothing to compare) the report's
    own words for it."""
    if check is None:
        return "-"
    if check.low is None:
        return check.change
    return f"{check.figures} ({check.verdict})"


def _speed(arm: Arm) -> str:
    r = arm.speed
    if r is None:
        return "emulated: not a speed" if arm.fp8 and not arm.native else "-"
    return f"{f.ratio(r.estimate)} ({r.label}): {speed_words(r)}"


def _span(seeds: tuple[float, float] | None, show) -> str:
    return "one seed" if seeds is None else show(*seeds)


@dataclass(frozen=True)
class Fp8Entry:
    """One model, framework and setting: its arms in table order (fp32, amp_bf16, the FP8 precisions)."""
    model: str
    framework: str
    arms: list[Arm]
    next_token: bool  # judged by eval loss (accuracy.metric): perplexity stands where accuracy would

    @property
    def emulated(self) -> list[str]:
        return [a.precision for a in self.arms if a.fp8 and not a.native]

    @property
    def native(self) -> list[str]:
        return [a.precision for a in self.arms if a.native]

    def _evidence(self, names: list[str]) -> str:
        return "; ".join(sorted({m for a in self.arms if a.precision in names for m in a.matmuls}))

    @property
    def emulated_note(self) -> str:
        if not self.emulated:
            return ""
        return (f"{', '.join(self.emulated)}: FP8 is emulated here (fake-quantized float32 matmuls: each matmul's "
                f"inputs cast to FP8 and back, multiplied in float32), so its step times are not a measure of FP8 "
                f"speed, and this comparison is about loss and accuracy only. The records say: "
                f"{self._evidence(self.emulated)}.")

    @property
    def native_note(self) -> str:
        if not self.native:
            return ""
        return (f"{', '.join(self.native)}: native FP8 matmuls (the records say: {self._evidence(self.native)}); "
                f"the step-time column is fp32's step time over theirs.")

    @property
    def header(self) -> tuple[str, ...]:
        figure = ("perplexity", "over seeds") if self.next_token else \
            ("eval accuracy", "over seeds", "accuracy vs fp32 (paired by seed)")
        return (("precision", "ok runs", "FP8 matmuls", "eval loss", "over seeds", "loss vs fp32 (paired by seed)")
                + figure + (("step time vs fp32",) if self.native else ()))

    @property
    def rows(self) -> list[list[str]]:
        out = []
        for a in self.arms:
            matmul = ("native" if a.native else "emulated") if a.fp8 else "-"  # the notes quote the records
            row = [a.precision, f"{len(a.ok)}/{a.runs}", matmul, f.number(a.loss, 4),
                   _span(a.loss_seeds, lambda lo, hi: f.number_span(lo, hi, 4)), _change(a.loss_check)]
            if self.next_token:
                row += [f.number(accuracy.perplexity(a.loss), 2), _span(a.loss_seeds, lambda lo, hi: f.number_span(
                    accuracy.perplexity(lo), accuracy.perplexity(hi), 2))]
            else:
                row += [f.percent(a.accuracy), _span(a.accuracy_seeds, f.percent_span), _change(a.accuracy_check)]
            out.append(row + ([_speed(a)] if self.native else []))
        return out

    @property
    def failed(self) -> list[str]:
        return [f"{a.precision}: {a.failed[0]}" for a in self.arms if a.failed]


@dataclass(frozen=True)
class Fp8Verdicts:
    """One diagnosis's sentences per FP8 precision and scaling recipe (harness.fp8.verdicts)."""
    model: str | None
    framework: str | None
    verdicts: list[str]


@dataclass(frozen=True)
class Fp8Section:
    """The section as data: an entry per model, framework and setting with an FP8 run, and the diagnoses' FP8
    verdicts. Absent from the page (not `shown`) when no record has an FP8 precision."""
    entries: list[Fp8Entry]
    diagnoses: list[Fp8Verdicts]

    @property
    def shown(self) -> bool:
        return bool(self.entries)


def fp8_entries(records: list[RunRecord]) -> list[Fp8Entry]:
    """Per (model, framework, setting) with an FP8 run: its arms (harness.identity.arms_by_setting: runs under
    different loss-scale settings are arms of their own, a crashed run joins every setting it agrees with)."""
    groups = by_setting(records, lambda r: r.precision in BESIDE or is_fp8(r.precision))
    out = []
    for (model, framework, setting_), named in groups.items():
        if not any(is_fp8(p) for p in named):
            continue
        every = [r for rs in named.values() for r in rs]
        metric_ = accuracy.metric(every)
        classes = accuracy.num_classes(every)
        fp32 = tuple(r for r in named.get("fp32", []) if r.status == "ok")
        ordered = sorted(named, key=lambda p: (BESIDE.index(base_precision(p)) if base_precision(p) in BESIDE
                                               else len(BESIDE), p))
        label = framework + describe(setting_, varying(s for (_, fw, s) in groups if fw == framework))
        out.append(Fp8Entry(model, label, [Arm(p, tuple(named[p]), fp32, classes, metric_) for p in ordered],
                            metric_ is accuracy.TOKEN_LOSS))
    return out


def fp8_section(records: list[RunRecord], diagnoses: list[DiagnosisRecord] | None = None) -> Fp8Section:
    """The section for the report: its entries, and (when it has any) the diagnoses' FP8 verdicts."""
    from harness.fp8 import verdicts

    entries = fp8_entries(records)
    diagnosed = [Fp8Verdicts(d.model, d.framework, list(verdicts(d.diagnosis.fp8, d.diagnosis.every or 1).values()))
                 for d in diagnoses or [] if d.status == "ok" and d.diagnosis and d.diagnosis.fp8]
    return Fp8Section(entries, diagnosed if entries else [])
