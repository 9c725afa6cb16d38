"""The report's view model: records -> the typed objects of harness.report.data, every figure computed here from
raw measurements.

A cell is every ok repeat of one (model, framework, precision) under one setting (harness.identity:
device, node, threads, the adapter's variant, the framework's version, batch size) and loss-scale setting.
Records that differ in any of these are never pooled; they become rows of their own, labelled by what differs.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from datetime import datetime, timezone

import numpy as np

from harness.parity import compare as parity_compare
from harness import stats
from markupsafe import Markup

from harness.report import accuracy, answer, charts
from harness.report import format as f
from harness.report.arms import emulated as fp8_emulated
from harness.report.data import (AccuracyRow, Environment, Fastest, MemoryRow, NotRun, NumericsEntry, ScalingRow,
                                 Section, SpecHash, SpecHashes, SpeedRow, Study, StudyPoint, View)
from harness.report.explain import explain, in_short
from harness.report.fp8 import fp8_section, scaled_verdicts
from harness.report.profile import profile_section
from harness.report.pure16 import pure16_section
from harness.report.scaling import scaling_section
from harness.report.verdicts import Comparison, PooledRuns, mean, speed_up
from harness.identity import cell_key, describe, loss_scale_setting, scaling_study, setting, varying
from harness.records import Device, Diagnosis, DiagnosisRecord, Env, LossScaleSettings, Record, RunRecord
from harness.results import DIAGNOSES_FILE, FINGERPRINTS_FILE, PROFILES_FILE, typed

ATTENTION_SCORES = "attention_score_gradients"  # a diagnosis's histograms of the softmax's input gradients


def written_groups(diagnosis: Diagnosis) -> dict[str, dict[str, dict]]:
    """A diagnosis's histograms per group and layer as written, for harness.numerics, which reads them so."""
    return {group: {layer: h.written for layer, h in layers.items()}
            for group, layers in (diagnosis.groups or {}).items()}


def _label_models(records: list[RunRecord]) -> list[RunRecord]:
    """A model trained under several specs (other batch or input sizes) gets one label per spec hash, so
    that runs of different sizes are never compared."""
    hashes: dict[str, set] = {}
    for r in records:
        if r.spec_hash:
            hashes.setdefault(r.model, set()).add(r.spec_hash)
    out = []
    for r in records:
        if r.spec_hash and len(hashes.get(r.model, ())) > 1:
            r = r.replaced(model=f"{r.model} (batch {r.batch_size}, spec {r.spec_hash[:6]})")
        out.append(r)
    return out


def _labels(groups: dict[tuple, list[dict]]) -> dict[tuple, tuple[str, str, str]]:
    """Per group: the label "framework [what differs between its settings in this report] (loss scale if it
    varies)", the settings note without the device (" [node b, batch 16]") and the loss-scale note."""
    by_framework: dict[str, set] = {}
    scales: dict[tuple, set] = {}
    for model, framework, setting_, precision, scale in groups:
        by_framework.setdefault(framework, set()).add(setting_)
        scales.setdefault((model, framework, setting_, precision), set()).add(scale)
    labels = {}
    for group in groups:
        model, framework, setting_, precision, scale = group
        fields = varying(by_framework[framework])
        note = f" (loss scale {scale})" if len(scales[(model, framework, setting_, precision)]) > 1 else ""
        labels[group] = (framework + describe(setting_, fields) + note,
                         describe(setting_, [f for f in fields if f != "device"]), note)
    return labels


def _usable(records: list[dict] | None, filename: str, skipped: list[str]) -> list[Record]:
    """The records of `filename` the report can read (harness.results.typed, as for results), saying in
    `skipped` which it left out and why."""
    kept, notes = typed(records or [], filename)
    skipped += [f"{filename}: {note}" for note in notes]
    return kept


def build_view(records: list[dict], parity_records: list[dict] | None = None,
               diagnoses: list[dict] | None = None, profiles: list[dict] | None = None) -> View:
    records, skipped = typed(records)
    # the timed amp_fp16 runs' loss scales, by the models' own names (a diagnosis is matched by them)
    scaled = [r for r in records if r.precision == "amp_fp16" and not r.study]
    diagnoses, profiles, parity_records = (
        _usable(found, filename, skipped) if found is not None else None
        for found, filename in ((diagnoses, DIAGNOSES_FILE), (profiles, PROFILES_FILE),
                                (parity_records, FINGERPRINTS_FILE)))
    # a scaling study's runs are its own section: sizes that vary by design are neither cells nor new labels
    sized = [r for r in records if scaling_study(r.written)]
    records = _label_models([r for r in records if not scaling_study(r.written)])
    studies = [r for r in records if r.study]  # shown as studies, not as cells of the comparison
    records = [r for r in records if not r.study]
    ok = [r for r in records if r.status == "ok" and r.step_times_ms]
    not_run = [r for r in records if r.status != "ok"]
    groups: dict[tuple, list[RunRecord]] = {}
    for r in ok:
        groups.setdefault(cell_key(r.written), []).append(r)
    labels = _labels(groups)
    cells = {key: PooledRuns(key, rs, *labels[key]) for key, rs in groups.items()}
    models = sorted({k[0] for k in cells} | {r.model for r in not_run if r.model})
    frameworks = sorted({r.framework for r in records if r.framework})
    by_model: dict[str, list[RunRecord]] = {}
    for r in ok:
        by_model.setdefault(r.model, []).append(r)
    classes = {m: accuracy.num_classes(by_model.get(m, [])) for m in models}

    fp32_cells: dict[tuple, PooledRuns] = {}  # per (model, framework, setting): its first fp32 cell
    for k, c in cells.items():
        if k[3] == "fp32":
            fp32_cells.setdefault(k[:3], c)
    for key, c in cells.items():  # judged against the fp32 baseline's figure, or its own without one
        c.fp32 = fp32_cells.get(key[:3])
        c.judged = not c.metric.at_chance((c.fp32 or c).figure, classes.get(c.model))  # fp32 too short to judge

    summary: list[Comparison] = []
    speed, memory, accuracy_rows, scaling, sections = [], [], [], [], []
    for model in models:
        mcells = sorted((c for k, c in cells.items() if k[0] == model), key=lambda c: (c.label, c.precision))
        if not mcells:
            continue
        section = Section(model, Markup(charts.step_times(
            [{"framework": c.label, "precision": c.precision, "median_ms": c.median_ms, "p10_ms": c.p10_ms,
              "p90_ms": c.p90_ms} for c in mcells], f"{model}: step time")),
            f"{model}: median ms per training step by framework, one marker per precision, whiskers p10-p90 of "
            f"all timed steps (log scale; further left is faster).")
        curves: dict[str, dict[str, list]] = {}
        for c in mcells:
            curves.setdefault(c.label, {})[c.precision] = c.loss_curve()
            base = c.baseline
            row = {"model": model, "framework": c.label, "precision": c.precision}
            speed.append(SpeedRow(**row, batch=c.batch_size, median=f.ms(c.median_ms),
                                  tokens=f.number(c.tokens_per_s, 0), spread=f"{f.ms(c.p10_ms)} - {f.ms(c.p90_ms)}",
                                  samples=f.number(c.samples_per_s, 0),
                                  first=f.ms(c.first_step_ms), gflops=f.number(c.gflops, 1),
                                  efficiency=f.percent(c.efficiency, 1, spaced=True), repeats=len(c.repeats),
                                  cv=f.percent(c.cv, 1, spaced=True), unstable=c.unstable))
            memory.append(MemoryRow(**row, peak=f.mb(c.peak_mb), kind=c.memory_kind,
                                    state=f.mb(c.state_mb.total) if c.state_mb else "-",
                                    optimizer=f.mb(c.state_mb.optimizer_state) if c.state_mb else "-",
                                    saved=f.percent(1 - c.peak_mb / base.peak_mb, 0, spaced=True)
                                    if base and c.peak_mb is not None and base.peak_mb else "-"))
            # paired by seed against fp32's seed-to-seed spread (accuracy.compare); fp32's own row shows that spread
            check = accuracy.compare(c.records, base.records, classes.get(c.model)) if base else None
            spread = accuracy.spread(c.records) if c.precision == "fp32" and c.judged else None
            # a next-token model is judged by its loss and perplexity: its token accuracy is not shown
            next_token = c.metric is accuracy.TOKEN_LOSS
            accuracy_rows.append(AccuracyRow(
                **row, accuracy="-" if next_token else judged_figure(f.percent(c.eval_accuracy, 1, spaced=True), c),
                loss=f.number(c.eval_loss, 4),
                perplexity=judged_figure(f.number(c.perplexity, 2), c) if next_token else "-", judged=c.judged,
                delta=check.change if check else (spread.label if spread else "-"),
                flag=bool(check) and not check.acceptable, check=check))
            if base:
                family = sum(x.baseline is base for x in cells.values())  # as --repeats auto adjusted for them
                summary.append(Comparison(c, base, speed_up(base, c, family), check,
                                          accuracy_rows[-1].delta, memory[-1].saved))
        differing = {label: cs for label, cs in curves.items() if _curves_differ(cs)}
        if differing:
            section.loss_chart = Markup(charts.loss_curves(differing, f"{model}: training loss (mean over repeats)"))
            section.loss_caption = (f"{model}: training loss by step, mean over repeats, one panel per framework "
                                    f"whose precisions' losses differ (log scale).")
        same = sorted(label for label, cs in curves.items() if label not in differing and len(cs) > 1)
        if same:
            section.loss_note = (f"{model}: training losses of every precision agree step by step (relative "
                                 f"difference under {f.plain(LOSS_TOLERANCE)}) in {', '.join(same)}; no chart "
                                 f"needed.")
        histories = {}
        for c in mcells:
            with_history = [r for r in c.records if r.loss_scale and r.loss_scale.history]
            flat = _flat_scale(with_history)
            if flat:
                section.scale_notes.append(f"{c.label} {c.precision}: {flat}")
            for r in with_history:
                ls = r.loss_scale
                if not flat:
                    histories.setdefault(f"{c.label} {c.precision}", ls.history)
                scaling.append(ScalingRow(model, c.label, c.precision, r.repeat,
                                          ls.settings.mode if ls.settings else None, f.number(ls.initial, 0),
                                          f.number(ls.final, 0), ls.skipped_steps,
                                          "-" if ls.first_overflow_step is None else ls.first_overflow_step))
        if histories:
            section.scale_chart = Markup(charts.loss_scales(histories, f"{model}: loss scale"))
            section.scale_caption = (f"{model}: dynamic loss scale by step (first repeat), for the runs whose "
                                     f"scale changed; a drop marks an overflow and a skipped step.")
        sections.append(section)

    profiled = profile_section(profiles or [])
    cast_shares = {(e.model, g.framework, g.precision, g.batch, g.device): g.casts
                   for e in profiled.entries for g in e.growth}
    why = explain(records, cells, summary, profiled.citations, cast_shares)
    contenders: dict[tuple, list[PooledRuns]] = {}  # per device: a GPU and a CPU are never ranked together
    for c in cells.values():
        contenders.setdefault((c.model, c.precision, c.device), []).append(c)
    fastest = [_fastest(model, precision, device, cs, answer.ranked(cs, summary))
               for (model, precision, device), cs in sorted(contenders.items(), key=lambda item: item[0])]

    # the first screen weighs speed: emulated FP8's step times measure the emulation (its own section says so)
    timed = [s for s in summary if not fp8_emulated(s.cell.records)]
    fp8 = fp8_section(records, diagnoses or [])  # where it is shown, it holds the FP8 verdicts of diagnose
    numerics, studies_shown, safe = numerics_view(diagnoses or [], studies, fp32_cells, scaled, fp8.shown)
    return View(
        generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        n_records=len(records) + len(sized), n_ok=len(ok), skipped=skipped, models=models, frameworks=frameworks,
        answer=answer.build({k: c for k, c in cells.items() if not fp8_emulated(c.records)}, timed,
                            not_run),
        headline=_headline(timed), any_range=any(not s.interval for s in summary),
        min_repeats=stats.MIN_REPEATS, unstable_cv=stats.UNSTABLE_CV, precise=stats.PRECISE,
        chance_margin=accuracy.CHANCE_MARGIN,
        summary=summary, fastest=fastest, speed=speed, any_tokens=any(c.tokens_per_s for c in cells.values()),
        memory=memory, memory_note=_memory_note(cells), accuracy=accuracy_rows, accuracy_rule=accuracy.RULE,
        any_too_short=any(not c.judged for c in cells.values() if c.metric is accuracy.ACCURACY),
        any_next_token=any(c.metric is accuracy.TOKEN_LOSS for c in cells.values()), loss_margin=accuracy.LOSS_MARGIN,
        any_too_short_loss=any(not c.judged for c in cells.values() if c.metric is accuracy.TOKEN_LOSS),
        scaling=scaling, sections=sections, why=why, why_short=in_short(why),
        not_run=[NotRun(r.model or "-", r.framework, r.precision, r.repeat, r.status, r.reason or "-")
                 for r in not_run],
        environment=_environment(records), spec_hashes=_spec_hashes(records),
        parity=[c.row() for c in parity_compare([r.written for r in parity_records])] if parity_records else None,
        numerics=numerics, studies=studies_shown, sixteen_bit_safe=safe,
        pure16=pure16_section(records, diagnoses or []), profile=profiled,
        crossover=scaling_section(sized, cast_shares), fp8=fp8)


def _fastest(model: str, precision: str, device: str, cells: list[PooledRuns], ranked: list[PooledRuns]) -> Fastest:
    """The framework with the lowest median among the cells that may be ranked (answer.ranked), or that none may."""
    if not ranked:
        return Fastest(model, precision, device, f"none ranked (fewer than {stats.MIN_REPEATS} repeats, or no speed "
                       "decided against fp32)", "-", "-", len(cells), 0)
    best = min(ranked, key=lambda c: c.median_ms)
    return Fastest(model, precision, device, best.label, f.ms(best.median_ms), f.number(best.tokens_per_s, 0),
                   len(cells), len(ranked))


def judged_figure(figure: str, c: PooledRuns) -> str:
    """A cell's judged figure, or "too short to judge" where its fp32 learned nothing (accuracy.py)."""
    return figure if c.judged else accuracy.TOO_SHORT


FP8_ELSEWHERE = "FP8 and block recipes: see FP8 and block-scaled training above, beside their runs"
LOSS_TOLERANCE = 1e-4  # relative: below this, two precisions' loss curves are the same curve


def _curves_differ(curves: dict[str, list]) -> bool:
    """Whether any precision's mean loss curve departs from another's (a NaN against a number counts)."""
    arrays = [np.array([np.nan if v is None else v for v in c], dtype=float) for c in curves.values() if c]
    if len(arrays) < 2:
        return False
    length = min(a.size for a in arrays)
    ref = arrays[0][:length]
    for a in arrays[1:]:
        a = a[:length]
        if not np.array_equal(np.isnan(a), np.isnan(ref)):
            return True
        both = ~np.isnan(a)
        if np.any(np.abs(a[both] - ref[both]) > LOSS_TOLERANCE * np.maximum(np.abs(ref[both]), 1e-12)):
            return True
    return False


def _flat_scale(records: list[RunRecord]) -> str | None:
    """One sentence for a loss scale that never moved and skipped nothing in any repeat, else None."""
    if not records:
        return None
    values = {v for r in records for v in r.loss_scale.history}
    if len(values) != 1 or any(r.loss_scale.skipped_steps for r in records):
        return None
    (value,) = values
    shown = f.scale(value)
    steps = sorted({len(r.loss_scale.history) for r in records})
    n = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    each = f" in each of {len(records)} repeats" if len(records) > 1 else ""
    return f"loss scale stayed at {shown}, no step skipped in {n} steps{each}."


def numerics_view(diagnoses: list[DiagnosisRecord], studies: list[RunRecord], fp32_cells: dict[tuple, PooledRuns],
                  scaled: list[RunRecord] | None = None,
                  fp8_elsewhere: bool = False) -> tuple[list[NumericsEntry], list[Study], list[str]]:
    """The Numerics section: per diagnosed (model, framework) the gradient histograms and the verdicts, and where
    the `scaled` runs (timed amp_fp16 runs) hold its loss scales, the attention score gradients' headroom at the
    largest of them (score_headroom); per loss-scale study its chart; a "16-bit safe?" line per model. Verdicts
    are judged here from the captured figures (harness.numerics.judge), not read from the record: a diagnosis made
    before a rule existed gets it. With fp8_elsewhere (the FP8 and block-scaled section is shown), the FP8 and block
    recipes' verdicts are that section's, and a line here points to it."""
    from harness.numerics import attention_verdicts, judge, merge

    numerics, safe = [], {}
    for d in diagnoses:
        diagnosis = d.diagnosis
        if d.status != "ok" or not (diagnosis and diagnosis.available):
            numerics.append(NumericsEntry(d.model, d.framework, note=d.reason
                                      or "not available: this adapter cannot capture tensors"))
            continue
        groups = written_groups(diagnosis)
        series = {"weight gradients": merge(list(groups["gradients"].values())),
                  "activation gradients": merge(list(groups["activation_gradients"].values()))}
        series = {k: v for k, v in series.items() if v["bins"]}
        low, high = diagnosis.loss_scale_window or (None, None)
        shift = low if low and high is not None and low <= high else None
        title = (f"{d.model} ({d.framework}): gradients in fp32, {len(diagnosis.captured_steps)} captured "
                 f"steps (0 to {diagnosis.captured_steps[-1]})")
        verdicts = judge(diagnosis.written)
        fp8_lines = scaled_verdicts(d)  # FP8's recipes, then the block recipes
        safe.setdefault(d.model, f"{d.model} ({d.framework} diagnosis): "
                        + "; ".join(f"{p} {outcome}" for p, (outcome, _) in verdicts.items()))
        numerics.append(NumericsEntry(d.model, d.framework,
                                  Markup(charts.gradient_histogram(series, shift, title)),
                                  [sentence for _, sentence in verdicts.values()]
                                  + list(attention_verdicts(diagnosis.written).values())
                                  + ([FP8_ELSEWHERE] if fp8_elsewhere and fp8_lines else fp8_lines),
                                  headroom=score_headroom(d, scaled or [])))
    study_charts = []
    by_study: dict[tuple, list[RunRecord]] = {}
    for r in studies:  # the loss scale is what a study varies; every other part of the setting stays apart
        by_study.setdefault((r.study, r.model, r.framework, setting(r.written), r.precision), []).append(r)
    for (study, model, framework, setting_, precision), rs in sorted(by_study.items(),
                                                                      key=lambda kv: tuple(map(str, kv[0]))):
        window = next((d.diagnosis.loss_scale_window if d.diagnosis else None for d in diagnoses
                       if d.model == model and d.framework == framework), None)
        fp32 = fp32_cells.get((model, framework, setting_))
        framework_ = framework + describe(setting_, varying(k[3] for k in by_study
                                                            if k[:3] == (study, model, framework)))
        points = _study_points(rs, fp32)
        next_token = accuracy.metric(rs) is accuracy.TOKEN_LOSS  # judged by its eval loss
        figure, label = ("loss", "eval loss (nats)") if next_token else ("accuracy", "eval accuracy")
        chart = charts.loss_scale_study([asdict(p) for p in points], window,
                                        f"{model} ({framework_} {precision}): loss-scale study", figure, label)
        study_charts.append(Study(study, model, framework_, precision, points, Markup(chart), next_token))
    return numerics, study_charts, list(safe.values())


def score_headroom(diagnosed: DiagnosisRecord, scaled: list[RunRecord]) -> str | None:
    """How close the attention score gradients (the softmax's input gradients) come to float16's largest value at
    the largest loss scale this diagnosis's (model, framework) reached in its amp_fp16 runs (the most of each
    run's initial scale and scale history; a run that took no step reached none): the diagnosis's fp32 gradients
    multiplied by that scale (harness.numerics.score_gradient_headroom). None without both."""
    from harness.numerics import FORMATS, score_gradient_headroom

    model, framework = diagnosed.model, diagnosed.framework
    runs = [r for r in scaled if r.model == model and r.framework == framework
            and r.loss_scale and r.loss_scale.history]
    scales = [value for r in runs for value in (r.loss_scale.initial, *r.loss_scale.history) if value]
    groups = written_groups(diagnosed.diagnosis) if diagnosed.diagnosis else {}
    top = max(scales, default=0.0)
    found = score_gradient_headroom(groups, top)
    if found is None:
        return None
    layer, reached, spare = found
    layers = len([h for h in diagnosed.diagnosis.groups[ATTENTION_SCORES].values() if h.max_abs > 0])
    fp16 = round(math.log2(FORMATS["float16"].max))  # 65504 = 2^15.99998
    line = (f"at the largest scale {framework}'s amp_fp16 runs reached ({f.scale(top)}), attention {layer}'s score "
            f"gradients reach 2^{f.number(reached, 1)} of float16's {f.power_of_two(fp16)}"
            + (f" (the closest of {layers} attention layers)" if layers > 1 else "")
            + (f": {f.number(spare, 1)} doublings to spare" if spare >= 0 else
               f": they overflow by 2^{f.number(-spare, 1)}: the scaler must back off"))
    batches = sorted({r.batch_size for r in runs if r.batch_size})
    if diagnosed.batch_size and batches and batches != [diagnosed.batch_size]:
        line += (f" (diagnosed at batch {diagnosed.batch_size}, the runs at batch "
                 f"{', '.join(map(str, batches))}: a mean loss's gradients shrink as the batch grows)")
    return line


def _scale_settings(r: RunRecord) -> LossScaleSettings:
    """The loss-scale setting a run asked for; one that states none ran unscaled."""
    return (r.loss_scale.settings if r.loss_scale else None) or LossScaleSettings(mode="none")


def _study_points(rs: list[RunRecord], fp32: PooledRuns | None) -> list[StudyPoint]:
    by_setting: dict[str, list[RunRecord]] = {}
    for r in rs:
        by_setting.setdefault(loss_scale_setting(r.written), []).append(r)
    exps = {}
    for setting_, group in by_setting.items():
        settings = _scale_settings(group[0])
        exps[setting_] = math.log2(settings.initial) if settings.mode == "fixed" else None
    fixed = [e for e in exps.values() if e is not None] or [0.0]
    points = []
    for setting_, group in by_setting.items():
        mode = _scale_settings(group[0]).mode or "none"
        x = exps[setting_] if exps[setting_] is not None else (min(fixed) - 3 if mode == "none" else max(fixed) + 3)
        ok = [r for r in group if r.status == "ok"]
        loss = mean(r.eval_loss for r in ok)
        points.append(StudyPoint(
            x, "none" if mode == "none" else ("dynamic" if mode == "dynamic" else f.power_of_two(exps[setting_])),
            float(np.mean([r.eval_accuracy for r in ok])) if ok else float("nan"), loss, f.number(loss, 4),
            f.number(accuracy.perplexity(loss), 2),
            float(np.mean([(r.loss_scale.skipped_steps if r.loss_scale else None) or 0 for r in group])),
            ", ".join(sorted({r.status for r in group})), len(group), fp32.eval_accuracy if fp32 else None,
            fp32.eval_loss if fp32 else None))
    return sorted(points, key=lambda p: p.x)


def _headline(summary: list[Comparison]) -> list[str]:
    def change(s: Comparison) -> str:  # a next-token model's phrase names its eval loss
        return f"accuracy change {s.accuracy}" if s.accuracy_check.metric is accuracy.ACCURACY \
            else s.accuracy_check.phrase

    return [f"{s.model}, {s.framework}: {s.precision} against fp32: {s.text} ({f.ratio(s.ratio)}, {s.ci})"
            f"{' [unstable timings]' if s.unstable else ''}; memory saved {s.memory}, {change(s)}."
            for s in summary]


def _memory_note(cells: dict) -> str:
    """Peak figures compare only where they are of one kind (`memory_kind`): said per device, and where the
    kinds differ, which framework measured which."""
    by_device: dict[str, dict[str, set]] = {}
    for c in cells.values():
        by_device.setdefault(c.device, {}).setdefault(c.memory_kind or "not measured", set()).add(c.framework)
    notes = []
    for device, kinds in sorted(by_device.items()):
        where = f" on {device}" if len(by_device) > 1 else ""
        if len(kinds) == 1:
            (kind,) = kinds
            notes.append(f"Every peak figure{where} is of one kind, comparable across frameworks and precisions: "
                         f"{kind}.")
        else:
            notes.append(f"Peak figures{where} are of {len(kinds)} kinds, and only figures of one kind compare: "
                         + "; ".join(f"{', '.join(sorted(fs))}: {kind}" for kind, fs in sorted(kinds.items())) + ".")
    return " ".join(notes)


# ---- environment --------------------------------------------------------------------------------------
def _environment(records: list[RunRecord]) -> list[Environment]:
    rows: dict[tuple, dict] = {}
    for r in records:
        if not r.framework_version:
            continue
        env = r.env or Env()
        device = env.device or Device()
        key = (r.framework, r.framework_version, r.device)
        row = rows.setdefault(key, {"framework": r.framework, "version": r.framework_version,
                                    "device": f"{r.device}: {device.description or ''}",
                                    "details": json.dumps(device.details or {}),
                                    "cpu": env.cpu, "flags": ", ".join(env.cpu_flags or []),
                                    "threads": env.threads, "python": env.python,
                                    "os": env.os, "options": set()})
        if r.options:
            row["options"].add(", ".join(f"{k}={v}" for k, v in sorted(r.options.items())))
    return [Environment(**{**row, "options": sorted(row["options"])}) for row in rows.values()]


def _spec_hashes(records: list[RunRecord]) -> list[SpecHashes]:
    by_model: dict[str, dict[str, set]] = {}
    for r in records:
        if r.spec_hash:
            by_model.setdefault(r.model, {}).setdefault(r.spec_hash, set()).add(r.framework)
    return [SpecHashes(m, [SpecHash(h, ", ".join(sorted(fs))) for h, fs in sorted(hs.items())])
            for m, hs in sorted(by_model.items())]
