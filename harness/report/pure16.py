"""The report's pure-16-bit section: the arms that keep no float32 master weights (bf16 and fp16 with nearest
rounding, stochastic rounding, Kahan-compensated updates, the 16-bit fixed-point grid) side by side with fp32 and
the mixed arms (float32 master weights: what the pure arms give up), per model, framework and setting
(harness.identity: device, node, threads, variant, version, batch; and each arm's loss-scale setting): eval
accuracy (a next-token model's eval loss, with its perplexity) judged by the report's one accuracy rule
(harness.report.accuracy.compare: paired by seed, against a stated margin), each arm's range over seeds, a dynamic
scaler's final scales and skipped steps, where a diverged run's first non-finite value came from
(harness.run.nonfinite), the loss curves, the share of updates swamped by rounding (from `amp-harness diagnose`,
per model: the numerics of fp32 training), weight memory, and one computed sentence per entry.

    section = pure16_section(records, diagnoses)   # the records' models (harness.results.typed)
    section.entries, section.sentences, section.shown (templates/_pure16.html.j2, _pure16.md.j2)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from harness.identity import describe, varying
from harness.records import DiagnosisRecord, RunRecord
from harness.report import format as f
from harness.report.accuracy import Check, Metric, metric, num_classes, spread
from harness.report.arms import Arm, base_precision as _base, by_setting

#: the arms in the order the table shows them; fp32 is the reference, the mixed arms (float32 master weights) show
#: what the pure arms give up
ARMS = ("fp32", "amp_bf16", "amp_fp16", "bf16", "bf16_sr", "bf16_kahan", "fp16", "fp16_sr", "fixed16_rn",
        "fixed16_sr")
MIXED = {"amp_bf16": "mixed bf16", "amp_fp16": "mixed fp16"}
PURE = {"bf16", "bf16_sr", "bf16_kahan", "fp16", "fp16_sr", "fixed16_rn", "fixed16_sr"}
REMEDIES = {"bf16_sr": "stochastic rounding", "bf16_kahan": "Kahan-compensated updates",
            "fp16_sr": "stochastic rounding", "fixed16_sr": "stochastic rounding"}
NEAREST = {"bf16": ("bf16", ("bf16_sr", "bf16_kahan")), "fp16": ("fp16", ("fp16_sr",)),
           "fixed16": ("fixed16_rn", ("fixed16_sr",))}
SWAMPED_FORMAT = {"bf16": "bfloat16", "fp16": "float16"}


def swamped_shares(diagnoses: list[DiagnosisRecord]) -> dict[str, dict[str, float]]:
    """Per model, the share of fp32 training's weight updates that nearest rounding would lose in each 16-bit
    format (harness.numerics.update_counts, summed over layers and captured steps), from ok diagnoses."""
    out: dict[str, dict[str, float]] = {}
    for d in diagnoses or []:
        counts = (d.diagnosis.updates if d.diagnosis else None) or {} if d.status == "ok" else {}
        updates = sum(c.updates for c in counts.values())
        if updates:
            out.setdefault(d.model, {fmt: sum(c.lost(fmt) for c in counts.values()) / updates
                                     for fmt in ("bfloat16", "float16")})
    return out


@dataclass(frozen=True)
class Pure16Entry:
    """One model, framework and setting with a pure-16-bit arm beside fp32: its arms in table order, whether fp32
    learned enough to judge them by, the swamped shares of its model's diagnosis and the sentence."""
    model: str
    framework: str
    arms: list[Arm]
    judged: bool  # False: fp32 scored at chance level, too short to judge
    metric: Metric
    swamped: dict[str, float]
    sentence: str


def pure16_view(records: list[RunRecord], diagnoses: list[DiagnosisRecord] | None = None) -> list[Pure16Entry]:
    """Per (model, framework, setting) with a pure-16-bit arm and fp32: the arms, the swamped shares and the
    sentence. A record whose worker never reported its setting (a crash) joins every setting it agrees with."""
    swamped = swamped_shares(diagnoses or [])
    groups = by_setting(records, lambda r: _base(r.precision) in ARMS)
    out = []
    for (model, framework, setting_), named in groups.items():
        if "fp32" not in named or not PURE & {_base(p) for p in named}:
            continue
        every = [r for rs in named.values() for r in rs]
        metric_ = metric(every)
        classes = num_classes(every)
        fp32 = tuple(r for r in named["fp32"] if r.status == "ok")
        rows = {name: Arm(name, tuple(rs), fp32, classes, metric_) for name, rs in named.items()}
        judged = not metric_.at_chance(rows["fp32"].figure, classes)  # fp32 too short to judge
        ordered = sorted(rows.values(), key=lambda a: (ARMS.index(_base(a.precision)), a.precision))
        fields = varying(s for (_, fw, s) in groups if fw == framework)
        label = f"{framework}{describe(setting_, fields)}"
        out.append(Pure16Entry(model, label, ordered, judged, metric_, swamped.get(model, {}),
                               sentence(model, label, rows, judged, swamped.get(model, {}), metric_)))
    return out


#: by the accuracy Check's outcome (its verdict as a quality: worse or better, slightly within the margin): "keeps
#: up" and "recovers" say what "unchanged" says, and only where it does; a shift within the margin is said as one
NEAREST_VERBS = {"stalls": "stalls", "worse": "falls behind", "slightly worse": "falls slightly behind",
                 "unchanged": "keeps up", "slightly better": "does slightly better", "better": "does better",
                 "undecided": "is not clearly level", "one seed": "reaches"}
REMEDY_VERBS = {"unchanged": "recovers", "slightly better": "recovers", "better": "recovers",
                "slightly worse": "nearly recovers", "worse": "reaches only", "stalls": "reaches only",
                "undecided": "reaches", "one seed": "reaches"}
CAVEATS = {"undecided": "not clearly level with fp32", "one seed": "one seed: no spread to judge against"}


def sentence(model: str, framework: str, rows: dict[str, Arm], judged: bool, swamped: dict[str, float],
             metric_: Metric) -> str:
    """One sentence per model and framework, computed from the arms: e.g. "bf16 with nearest rounding falls
    behind (71.2% vs fp32 over 3 seeds: 93.1-93.5%); stochastic rounding recovers 93.0% with half the weight
    memory" (a next-token model's figures: its eval loss and perplexity). The verbs come from each arm's accuracy
    Check against fp32."""
    fp32 = rows["fp32"]
    head = f"{model} ({framework}): "
    if fp32.figure is None:
        return head + f"no fp32 {metric_.subject} to compare against"
    if not judged:
        return head + f"fp32 scores at chance level ({metric_.show(fp32.figure)}): too short to judge"
    parts = []
    mixed = [_mixed_clause(p, a, metric_) for p, a in sorted(rows.items(), key=lambda item: ARMS.index(
        _base(item[0])) if _base(item[0]) in ARMS else len(ARMS)) if _base(p) in MIXED]
    if mixed:
        parts.append("; ".join(mixed))
    for family, (nearest, remedies) in NEAREST.items():
        arms = {p: a for p, a in rows.items() if _base(p) in (nearest, *remedies)}
        if not arms:
            continue
        clauses = []
        for p, near in sorted((p, a) for p, a in arms.items() if _base(p) == nearest):
            label = f"{p} with nearest rounding" if family != "fixed16" else "16-bit fixed point with nearest rounding"
            check: Check = near.check
            if near.figure is None:
                clauses.append(f"{label} did not finish ({near.failed[0] if near.failed else 'no accuracy'})")
                continue
            swamp = swamped.get(SWAMPED_FORMAT.get(family, ""))
            clauses.append(f"{label} {NEAREST_VERBS[check.outcome]} ({metric_.show(near.figure)} vs "
                           f"{check.fp32.label}"
                           + (f"; {f.percent(swamp)} of fp32's updates are swamped in {SWAMPED_FORMAT[family]}"
                              if swamp is not None else "")
                           + (f"; {CAVEATS[check.verdict]}" if check.verdict == "one seed" else "") + ")")
        for p, a in sorted(((p, a) for p, a in arms.items() if _base(p) in remedies),
                           key=lambda item: (remedies.index(_base(item[0])), item[0])):
            remedy = REMEDIES[_base(p)]
            if a.figure is None:
                clauses.append(f"{remedy} ({p}) did not finish")
                continue
            verb = REMEDY_VERBS[a.check.outcome]
            if remedy.endswith("updates"):  # plural subject
                verb = verb.replace("recovers", "recover").replace("reaches", "reach")
            memory = ""
            if a.weights_mb and fp32.weights_mb:
                ratio = a.weights_mb / fp32.weights_mb
                memory = " with half the weight memory" if math.isclose(ratio, 0.5, rel_tol=0.01) else \
                    (f" with {f.rough(ratio)}x the weight memory" if not math.isclose(ratio, 1.0, rel_tol=0.01)
                     else " with fp32's weight memory")
            caveat = f" ({CAVEATS[a.check.verdict]})" if a.check.verdict in CAVEATS else ""
            clauses.append(f"{remedy} ({p}) {verb} {metric_.show(a.figure)}{memory}{caveat}")
        parts.append("; ".join(clauses))
    if not parts:
        return head + "no pure 16-bit arm"
    base = spread(fp32.ok)
    margin = f'. "Keeps up" and "recovers": within {metric_.margin(base.margin)} of fp32, paired by seed' \
        if base is not None and base.seeds > 1 else ""
    return head + ". ".join(parts) + margin


def _mixed_clause(precision: str, arm: Arm, metric_: Metric) -> str:
    """A mixed arm (float32 master weights) against fp32, with its loss scaler's history where it had one: "mixed
    fp16 keeps up (2.105 vs fp32 over 3 seeds: 2.098-2.112; its scaler skipped 0/0/1 steps, ending at 2^16)"."""
    label = MIXED[_base(precision)] + precision[len(_base(precision)):]
    if arm.figure is None:
        return f"{label} did not finish ({arm.failed[0] if arm.failed else 'no ' + metric_.subject})"
    check: Check = arm.check
    scaling = arm.scaler
    scaler = "" if scaling is None else (
        f"; its scaler skipped {'/'.join(map(str, scaling.skipped))} steps, ending at "
        f"{' or '.join(f.scale(v) for v in scaling.final)}")
    caveat = f"; {CAVEATS[check.verdict]}" if check.verdict == "one seed" else ""  # the verb says "undecided"
    return (f"{label} {NEAREST_VERBS[check.outcome]} ({metric_.show(arm.figure)} vs {check.fp32.label}{scaler}"
            f"{caveat})")


def _curves_svg(entry: Pure16Entry) -> str:
    """The arms' mean training-loss curves against fp32 (one panel)."""
    from harness.report import charts

    curves = {a.precision: a.curve for a in entry.arms if a.curve}
    if not curves:
        return ""
    return charts.loss_curves({entry.framework: curves}, f"{entry.model}: training loss, pure 16-bit vs fp32")


@dataclass(frozen=True)
class Pure16Table:
    """An entry as the page shows it (templates/_pure16.*.j2): its figures formatted, its table's header and rows,
    its arms that did not end ok, and its chart drawn."""
    model: str
    framework: str
    sentence: str
    swamped: dict[str, str]  # per 16-bit format, the share of fp32's updates it swamps
    header: tuple[str, ...]
    rows: list[list[str]]
    failed: list[str]
    chart: str  # SVG markup (svg.py escapes its text), "" without curves or charts


@dataclass(frozen=True)
class Pure16Section:
    """The section as data: `entries` (pure16_view), their `sentences`, and `shown`: the entries as the page
    shows them."""
    entries: list[Pure16Entry]
    sentences: list[str]
    shown: list[Pure16Table]


#: an entry's table header: its judged figure's columns (a next-token model's: loss and perplexity) in the middle
HEADER = ("precision", "ok runs", "over seeds", "vs fp32 (paired by seed)", "final train loss",
          "loss scale (end; skipped steps)", "weights (+compensation) MB", "peak MB (measured)")
FIGURE_HEADER = {"eval_accuracy": ("eval accuracy (mean)",), "eval_loss": ("eval loss (mean)", "perplexity")}


def _header(metric_: Metric) -> tuple[str, ...]:
    return HEADER[:2] + FIGURE_HEADER[metric_.field] + HEADER[2:]


def pure16_section(records: list[RunRecord], diagnoses: list[DiagnosisRecord] | None = None,
                   charts: bool = True) -> Pure16Section:
    """The section for the report; empty (no entries, nothing shown) when no model has a pure-16-bit arm beside
    fp32."""
    entries = pure16_view(records, diagnoses)
    return Pure16Section(entries, [e.sentence for e in entries], [_table(e, charts) for e in entries])


def _row_cells(arm: Arm, metric_: Metric) -> list[str]:
    check = arm.check
    change = "-" if check is None or check.delta is None else f"{metric_.delta(check.delta)} ({check.verdict})"
    spread = "-" if arm.seeds is None else metric_.span(*arm.seeds)
    scaling = arm.scaler
    scaler = "-" if scaling is None else \
        f"{' or '.join(f.scale(v) for v in scaling.final)}; {'/'.join(map(str, scaling.skipped))}"
    return [arm.precision, f"{len(arm.ok)}/{arm.runs}", *metric_.cells(arm.figure), spread, change,
            f.significant(arm.final_loss, 4), scaler, f.significant(arm.weights_mb), f.mb(arm.peak_mb)]


def _table(entry: Pure16Entry, charts: bool) -> Pure16Table:
    from markupsafe import Markup

    return Pure16Table(entry.model, str(entry.framework), entry.sentence,
                       {fmt: f.percent(share) for fmt, share in entry.swamped.items()}, _header(entry.metric),
                       [_row_cells(arm, entry.metric) for arm in entry.arms],
                       [f"{a.precision}: {a.failed[0]}" for a in entry.arms if a.failed],
                       Markup(_curves_svg(entry)) if charts else "")  # svg.py escapes the chart's text
