"""The report's FP8 and block-scaled section: per model, framework and setting (harness.identity) with an FP8 or
block-scaled run, fp32, amp_bf16, each FP8 precision (fp8_e4m3, fp8_hybrid, with a recipe suffix where they had
one: fp8_hybrid:delayed:16) and each block-scaled one (mxfp8, mxfp6, mxfp4, nvfp4, nvfp4:rht, fp8_block:
harness.precision's Precision.blocks) side by side: eval loss and its range over seeds, its change against fp32
paired by seed with its 95% interval, margin and verdict (harness.report.accuracy.compare, the report's one accuracy rule), eval accuracy and its range
(a next-token model's perplexity instead: its token accuracy means little) with a classifier's accuracy verdict,
the one the Accuracy section gives; how each FP8 precision's matmuls ran, as its records say
(options["fp8"]["matmuls"], options["blocks"]["matmuls"]; a record without it: emulated); what the model's matmul
weights (the dense, attention and convolution kernels) take in each arm's format, from their sizes with the block scales (the
records' matmul_weights: harness.microscaling.matmul_weights), not from the emulated runs, which keep them in
float32; and what diagnose says of each FP8 recipe (harness.fp8.verdicts) and each block recipe
(harness.microscaling.block_verdicts), which the Numerics section then leaves to this one.

Emulated FP8 casts each matmul's inputs to FP8 and back and multiplies in float32 (the block formats likewise
quantize in blocks and dequantize): it costs more than fp32, and its step times measure the emulation, not the
format. So the section shows a step-time ratio against fp32 (harness.stats.ratio, as the comparisons' speed-ups)
for precisions whose matmuls ran natively only.

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
from harness.microscaling import PLAIN_WEIGHT_BITS
from harness.precision import PRECISIONS
from harness.report.arms import Arm, base_precision, by_setting, is_blocks, is_fp8, is_scaled
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
        return "emulated: not a speed" if (arm.fp8 or arm.blocks) and not arm.native else "-"
    return f"{f.ratio(r.estimate)} ({r.label}): {speed_words(r)}"


def _span(seeds: tuple[float, float] | None, show) -> str:
    return "one seed" if seeds is None else show(*seeds)


def weight_bits(arm: Arm) -> tuple[int, int] | None:
    """(the bits the model's matmul weights take in the arm's format, their count), from its records'
    matmul_weights: fp32 32 bits a value, amp_bf16 16 (the copy its matmuls read), FP8 8 (its per-tensor scales
    left out), a block recipe's weight format with its scales; None where no record states them or the model has
    none."""
    found = next((r.matmul_weights for r in arm.records if r.matmul_weights is not None), None)
    if found is None or not found.count:
        return None
    base = base_precision(arm.precision)
    if arm.blocks:
        bits = found.bits.get(PRECISIONS[base].blocks.name.partition(":")[0])
        return None if bits is None else (bits, found.count)
    plain = "fp8" if arm.fp8 else "bf16" if base == "amp_bf16" else "fp32" if base == "fp32" else None
    return None if plain is None else (PLAIN_WEIGHT_BITS[plain] * found.count, found.count)


@dataclass(frozen=True)
class Fp8Entry:
    """One model, framework and setting: its arms in table order (fp32, amp_bf16, the FP8 and block-scaled
    precisions)."""
    model: str
    framework: str
    arms: list[Arm]
    next_token: bool  # judged by eval loss (accuracy.metric): perplexity stands where accuracy would

    @property
    def emulated(self) -> list[str]:
        return [a.precision for a in self.arms if a.fp8 and not a.native]

    @property
    def blocks_emulated(self) -> list[str]:
        return [a.precision for a in self.arms if a.blocks and not a.native]

    @property
    def has_blocks(self) -> bool:
        return any(a.blocks for a in self.arms)

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
    def blocks_note(self) -> str:
        if not self.blocks_emulated:
            return ""
        return (f"{', '.join(self.blocks_emulated)}: the block-scaled formats are emulated here (each dense, "
                f"attention and convolution matmul's operands quantized in blocks along the axis it sums over and dequantized, "
                f"multiplied in float32), so their step times are not a measure of their speed, and this comparison "
                f"is about loss and accuracy only. The records say: {self._evidence(self.blocks_emulated)}.")

    @property
    def weights_note(self) -> str:
        """What the weights column holds, with the model's count of matmul weights."""
        counts = {w[1] for w in (weight_bits(a) for a in self.arms) if w is not None}
        if not counts:
            return ""
        return (f"Matmul weights stored: the {', '.join(f.count(c) for c in sorted(counts))} matmul "
                f"kernel values in each arm's format, from their sizes, block scales included (fp32 32 bits a value, "
                f"amp_bf16's matmul copy 16, FP8 8), against fp32's; the emulated runs keep them in float32.")

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
        matmuls = "FP8 / block matmuls" if self.has_blocks else "FP8 matmuls"
        return (("precision", "ok runs", matmuls, "eval loss", "over seeds", "loss vs fp32 (paired by seed)")
                + figure + ("matmul weights stored",) + (("step time vs fp32",) if self.native else ()))

    @property
    def rows(self) -> list[list[str]]:
        out = []
        for a in self.arms:
            matmul = ("native" if a.native else "emulated") if a.fp8 or a.blocks else "-"  # the notes quote them
            row = [a.precision, f"{len(a.ok)}/{a.runs}", matmul, f.number(a.loss, 4),
                   _span(a.loss_seeds, lambda lo, hi: f.number_span(lo, hi, 4)), _change(a.loss_check)]
            if self.next_token:
                row += [f.number(accuracy.perplexity(a.loss), 2), _span(a.loss_seeds, lambda lo, hi: f.number_span(
                    accuracy.perplexity(lo), accuracy.perplexity(hi), 2))]
            else:
                row += [f.percent(a.accuracy), _span(a.accuracy_seeds, f.percent_span), _change(a.accuracy_check)]
            out.append(row + [self._weights(a)] + ([_speed(a)] if self.native else []))
        return out

    def _weights(self, arm: Arm) -> str:
        found, fp32 = weight_bits(arm), next((weight_bits(a) for a in self.arms if a.precision == "fp32"), None)
        if found is None:
            return "-"
        base = fp32[0] if fp32 is not None else 32 * found[1]
        stored = f.kib_of_bits(found[0])
        return stored if found[0] == base else f"{stored} ({f.rough(found[0] / base)}x fp32)"

    @property
    def failed(self) -> list[str]:
        return [f"{a.precision}: {a.failed[0]}" for a in self.arms if a.failed]


@dataclass(frozen=True)
class Fp8Verdicts:
    """One diagnosis's sentences per FP8 precision and scaling recipe (harness.fp8.verdicts), then per block recipe
    (harness.microscaling.block_verdicts)."""
    model: str | None
    framework: str | None
    verdicts: list[str]


@dataclass(frozen=True)
class Fp8Section:
    """The section as data: an entry per model, framework and setting with an FP8 or block-scaled run, and the
    diagnoses' FP8 and block verdicts. Absent from the page (not `shown`) when no record has such a precision."""
    entries: list[Fp8Entry]
    diagnoses: list[Fp8Verdicts]

    @property
    def shown(self) -> bool:
        return bool(self.entries)


def fp8_entries(records: list[RunRecord]) -> list[Fp8Entry]:
    """Per (model, framework, setting) with an FP8 or block-scaled run: its arms (harness.identity.arms_by_setting:
    runs under different loss-scale settings are arms of their own, a crashed run joins every setting it agrees
    with), fp32 and amp_bf16 first, then the FP8 precisions, then the block-scaled ones."""
    groups = by_setting(records, lambda r: r.precision in BESIDE or is_scaled(r.precision))
    out = []
    for (model, framework, setting_), named in groups.items():
        if not any(is_scaled(p) for p in named):
            continue
        every = [r for rs in named.values() for r in rs]
        metric_ = accuracy.metric(every)
        classes = accuracy.num_classes(every)
        fp32 = tuple(r for r in named.get("fp32", []) if r.status == "ok")
        ordered = sorted(named, key=lambda p: (BESIDE.index(base_precision(p)) if base_precision(p) in BESIDE
                                               else len(BESIDE) + is_blocks(p), p))
        label = framework + describe(setting_, varying(s for (_, fw, s) in groups if fw == framework))
        out.append(Fp8Entry(model, label, [Arm(p, tuple(named[p]), fp32, classes, metric_) for p in ordered],
                            metric_ is accuracy.TOKEN_LOSS))
    return out


def fp8_section(records: list[RunRecord], diagnoses: list[DiagnosisRecord] | None = None) -> Fp8Section:
    """The section for the report: its entries, and (when it has any) the diagnoses' FP8 and block verdicts."""
    entries = fp8_entries(records)
    diagnosed = [Fp8Verdicts(d.model, d.framework, scaled_verdicts(d)) for d in diagnoses or []
                 if d.status == "ok" and d.diagnosis and (d.diagnosis.fp8 or d.diagnosis.blocks)]
    return Fp8Section(entries, diagnosed if entries else [])


def scaled_verdicts(d: DiagnosisRecord) -> list[str]:
    """A diagnosis's sentences per FP8 recipe (harness.fp8.verdicts), then per block recipe
    (harness.microscaling.block_verdicts, judged from the record as written: its counts and errors)."""
    from harness.fp8 import verdicts
    from harness.microscaling import block_verdicts

    diagnosis = d.diagnosis
    blocks = (diagnosis.written.get("blocks") or {}) if diagnosis.blocks else {}
    return (list(verdicts(diagnosis.fp8, diagnosis.every or 1).values()) if diagnosis.fp8 else []) + \
        list(block_verdicts(blocks, diagnosis.layer_types).values())
