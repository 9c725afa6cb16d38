"""The report's pure-16-bit section: the arms that keep no float32 master weights (bf16 and fp16 with nearest
rounding, stochastic rounding, Kahan-compensated updates, the 16-bit fixed-point grid) side by side with fp32 and
the mixed arms (float32 master weights: what the pure arms give up), per model, framework and setting
(harness.identity: device, node, threads, variant, version, batch; and each arm's loss-scale setting): eval
accuracy (a next-token model's eval loss, with its perplexity) judged by the report's one accuracy rule
(harness.report.accuracy.compare: paired by seed, against a stated margin), each arm's range over seeds, a dynamic
scaler's final scales and skipped steps, where a diverged run's first non-finite value came from
(harness.run.nonfinite), the loss curves, the share of updates swamped by rounding (from `amp-harness diagnose`,
per model: the numerics of fp32 training), weight memory, and one computed sentence per entry.

    section = pure16_section(records, diagnoses)   # records as harness.report.view gets them
    section.entries, section.sentences, section.shown (templates/_pure16.html.j2, _pure16.md.j2)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from harness.report import format as f
from harness.report.accuracy import Check, Metric, compare, metric, num_classes, over_seeds, spread
from harness.identity import arms_by_setting, describe, varying
from harness.run import nonfinite

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


def _base(precision: str) -> str:
    return precision.partition(":")[0].partition(" ")[0]  # fixed16_sr:12 is a fixed16_sr arm; so is "fp16 (loss..."


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _failure(r: dict) -> str:
    """A run that did not end ok, and where its first non-finite value came from when the record says."""
    located = f"; {nonfinite.describe(r['nonfinite'])}" if r.get("nonfinite") else ""
    return f"{r['status']}: {r.get('reason')}{located}"


def _scaling(records: list[dict]) -> dict | None:
    """A dynamically scaled arm's loss scale over its runs: the scales they ended at, the steps they skipped."""
    scales = [r["loss_scale"] for r in records if (r.get("loss_scale") or {}).get("final") is not None]
    if not scales:
        return None
    return {"final": sorted({ls["final"] for ls in scales}), "skipped": [ls.get("skipped_steps", 0) for ls in scales]}


def _arm(records: list[dict], name: str, metric_: Metric) -> dict:
    ok = [r for r in records if r.get("status") == "ok"]
    curves = [r["loss"] for r in ok if r.get("loss")]
    length = min((len(c) for c in curves), default=0)
    curve = [_mean([c[i] for c in curves]) for i in range(length)]
    state = (ok or records)[0].get("state_memory_mb") or {}
    figure, seeds = over_seeds(ok, metric_)  # what it is judged by (accuracy, or eval loss), as fp8's arms show it
    return {"precision": name, "runs": len(records), "ok": len(ok), "records": ok, "check": None,
            "failed": [_failure(r) for r in records if r.get("status") != "ok"],
            "spread": seeds, "scaling": _scaling(records), "figure": figure,
            "final_loss": _mean([r.get("final_train_loss") for r in ok]),
            # what keeps the weights: Kahan's compensation buffer counts with them
            "weights_mb": None if state.get("weights") is None else state["weights"] + state.get("compensation", 0.0),
            "peak_mb": _mean([r.get("peak_memory_mb") for r in ok]),
            "curve": curve}


def swamped_shares(diagnoses: list[dict]) -> dict[str, dict[str, float]]:
    """Per model, the share of fp32 training's weight updates that nearest rounding would lose in each 16-bit
    format (harness.numerics.update_counts, summed over layers and captured steps), from ok diagnoses."""
    out: dict[str, dict[str, float]] = {}
    for d in diagnoses or []:
        counts = ((d.get("diagnosis") or {}).get("updates") or {}) if d.get("status") == "ok" else {}
        updates = sum(c.get("updates", 0) for c in counts.values())
        if updates:
            out.setdefault(d["model"], {fmt: sum(c.get(fmt, 0) for c in counts.values()) / updates
                                        for fmt in ("bfloat16", "float16")})
    return out


def pure16_view(records: list[dict], diagnoses: list[dict] | None = None) -> list[dict]:
    """Per (model, framework, setting) with a pure-16-bit arm and fp32: the arms, the swamped shares and the
    sentence. A record whose worker never reported its setting (a crash) joins every setting it agrees with."""
    swamped = swamped_shares(diagnoses or [])
    groups = arms_by_setting(records, lambda r: _base(r.get("precision", "")) in ARMS)
    out = []
    for (model, framework, setting_), rows in groups.items():
        if "fp32" not in rows or not PURE & {_base(p) for p in rows}:
            continue
        every = [r for rs in rows.values() for r in rs]
        metric_ = metric(every)
        rows = {name: _arm(rs, name, metric_) for name, rs in rows.items()}
        classes = num_classes(every)
        judged = not metric_.at_chance(rows["fp32"]["figure"], classes)  # fp32 too short to judge
        for name, arm in rows.items():
            if name != "fp32":
                arm["check"] = compare(arm["records"], rows["fp32"]["records"], classes)
        ordered = sorted(rows.values(), key=lambda a: (ARMS.index(_base(a["precision"])), a["precision"]))
        fields = varying(s for (_, fw, s) in groups if fw == framework)
        label = f"{framework}{describe(setting_, fields)}"
        out.append({"model": model, "framework": label, "arms": ordered, "judged": judged, "metric": metric_,
                    "swamped": swamped.get(model, {}),
                    "sentence": sentence(model, label, rows, judged, swamped.get(model, {}), metric_)})
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


def sentence(model: str, framework: str, rows: dict[str, dict], judged: bool, swamped: dict[str, float],
             metric_: Metric) -> str:
    """One sentence per model and framework, computed from the arms: e.g. "bf16 with nearest rounding falls
    behind (71.2% vs fp32 over 3 seeds: 93.1-93.5%); stochastic rounding recovers 93.0% with half the weight
    memory" (a next-token model's figures: its eval loss and perplexity). The verbs come from each arm's accuracy
    Check against fp32."""
    fp32 = rows["fp32"]
    head = f"{model} ({framework}): "
    if fp32["figure"] is None:
        return head + f"no fp32 {metric_.subject} to compare against"
    if not judged:
        return head + f"fp32 scores at chance level ({metric_.show(fp32['figure'])}): too short to judge"
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
            check: Check = near["check"]
            if near["figure"] is None:
                clauses.append(f"{label} did not finish ({near['failed'][0] if near['failed'] else 'no accuracy'})")
                continue
            swamp = swamped.get(SWAMPED_FORMAT.get(family, ""))
            clauses.append(f"{label} {NEAREST_VERBS[check.outcome]} ({metric_.show(near['figure'])} vs "
                           f"{check.fp32.label}"
                           + (f"; {f.percent(swamp)} of fp32's updates are swamped in {SWAMPED_FORMAT[family]}"
                              if swamp is not None else "")
                           + (f"; {CAVEATS[check.verdict]}" if check.verdict == "one seed" else "") + ")")
        for p, a in sorted(((p, a) for p, a in arms.items() if _base(p) in remedies),
                           key=lambda item: (remedies.index(_base(item[0])), item[0])):
            remedy = REMEDIES[_base(p)]
            if a["figure"] is None:
                clauses.append(f"{remedy} ({p}) did not finish")
                continue
            verb = REMEDY_VERBS[a["check"].outcome]
            if remedy.endswith("updates"):  # plural subject
                verb = verb.replace("recovers", "recover").replace("reaches", "reach")
            memory = ""
            if a.get("weights_mb") and fp32.get("weights_mb"):
                ratio = a["weights_mb"] / fp32["weights_mb"]
                memory = " with half the weight memory" if math.isclose(ratio, 0.5, rel_tol=0.01) else \
                    (f" with {f.rough(ratio)}x the weight memory" if not math.isclose(ratio, 1.0, rel_tol=0.01)
                     else " with fp32's weight memory")
            caveat = f" ({CAVEATS[a['check'].verdict]})" if a["check"].verdict in CAVEATS else ""
            clauses.append(f"{remedy} ({p}) {verb} {metric_.show(a['figure'])}{memory}{caveat}")
        parts.append("; ".join(clauses))
    if not parts:
        return head + "no pure 16-bit arm"
    base = spread(fp32["records"])
    margin = f'. "Keeps up" and "recovers": within {metric_.margin(base.margin)} of fp32, paired by seed' \
        if base is not None and base.seeds > 1 else ""
    return head + ". ".join(parts) + margin


def _mixed_clause(precision: str, arm: dict, metric_: Metric) -> str:
    """A mixed arm (float32 master weights) against fp32, with its loss scaler's history where it had one: "mixed
    fp16 keeps up (2.105 vs fp32 over 3 seeds: 2.098-2.112; its scaler skipped 0/0/1 steps, ending at 2^16)"."""
    label = MIXED[_base(precision)] + precision[len(_base(precision)):]
    if arm["figure"] is None:
        return f"{label} did not finish ({arm['failed'][0] if arm['failed'] else 'no ' + metric_.subject})"
    check: Check = arm["check"]
    scaling = arm["scaling"]
    scaler = "" if scaling is None else (
        f"; its scaler skipped {'/'.join(map(str, scaling['skipped']))} steps, ending at "
        f"{' or '.join(f.scale(v) for v in scaling['final'])}")
    caveat = f"; {CAVEATS[check.verdict]}" if check.verdict == "one seed" else ""  # the verb says "undecided"
    return (f"{label} {NEAREST_VERBS[check.outcome]} ({metric_.show(arm['figure'])} vs {check.fp32.label}{scaler}"
            f"{caveat})")


def _curves_svg(entry: dict) -> str:
    """The arms' mean training-loss curves against fp32 (one panel)."""
    from harness.report import charts

    curves = {a["precision"]: a["curve"] for a in entry["arms"] if a["curve"]}
    if not curves:
        return ""
    return charts.loss_curves({entry["framework"]: curves}, f"{entry['model']}: training loss, pure 16-bit vs fp32")


@dataclass(frozen=True)
class Pure16Section:
    """The section as data: `entries` (pure16_view), their `sentences`, and `shown`: the entries with their
    figures formatted, their table's header and their charts drawn, as templates/_pure16.*.j2 render them."""
    entries: list[dict]
    sentences: list[str]
    shown: list[dict]


#: an entry's table header: its judged figure's columns (a next-token model's: loss and perplexity) in the middle
HEADER = ("precision", "ok runs", "over seeds", "vs fp32 (paired by seed)", "final train loss",
          "loss scale (end; skipped steps)", "weights (+compensation) MB", "peak MB (measured)")
FIGURE_HEADER = {"eval_accuracy": ("eval accuracy (mean)",), "eval_loss": ("eval loss (mean)", "perplexity")}


def _header(metric_: Metric) -> tuple[str, ...]:
    return HEADER[:2] + FIGURE_HEADER[metric_.field] + HEADER[2:]


def pure16_section(records: list[dict], diagnoses: list[dict] | None = None, charts: bool = True) -> Pure16Section:
    """The section for the report; empty (no entries, nothing shown) when no model has a pure-16-bit arm beside
    fp32."""
    entries = pure16_view(records, diagnoses)
    return Pure16Section(entries, [e["sentence"] for e in entries], _shown(entries, charts))


def _row_cells(arm: dict, metric_: Metric) -> list[str]:
    check = arm["check"]
    change = "-" if check is None or check.delta is None else f"{metric_.delta(check.delta)} ({check.verdict})"
    spread = "-" if arm["spread"] is None else metric_.span(*arm["spread"])
    scaling = arm["scaling"]
    scaler = "-" if scaling is None else \
        f"{' or '.join(f.scale(v) for v in scaling['final'])}; {'/'.join(map(str, scaling['skipped']))}"
    return [arm["precision"], f"{arm['ok']}/{arm['runs']}", *metric_.cells(arm["figure"]), spread, change,
            f.significant(arm["final_loss"], 4), scaler, f.significant(arm["weights_mb"]), f.mb(arm["peak_mb"])]


def _shown(entries: list[dict], charts: bool) -> list[dict]:
    from markupsafe import Markup

    return [{"model": entry["model"], "framework": str(entry["framework"]), "sentence": entry["sentence"],
             "swamped": {fmt: f.percent(share) for fmt, share in entry["swamped"].items()},
             "header": _header(entry["metric"]), "rows": [_row_cells(arm, entry["metric"]) for arm in entry["arms"]],
             "failed": [f"{a['precision']}: {a['failed'][0]}" for a in entry["arms"] if a["failed"]],
             "chart": Markup(_curves_svg(entry)) if charts else ""}  # svg.py escapes the chart's text
            for entry in entries]
