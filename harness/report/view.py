"""The report's view model: records -> plain dicts, every figure computed here from raw measurements.

A cell is every ok repeat of one (model, framework, precision) under one setting (harness.report.setting:
device, node, threads, the adapter's variant, the framework's version, batch size) and loss-scale setting.
Records that differ in any of these are never pooled; they become rows of their own, labelled by what differs.
"""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone

import numpy as np

from harness.parity import compare as parity_compare
from harness import stats
from harness.report import accuracy, answer, charts
from harness.report.explain import explain, in_short
from harness.report.explain import fmt as _fmt
from harness.report.explain import ms as _ms
from harness.report.profile import profile_section
from harness.report.pure16 import pure16_section
from harness.identity import cell_key, describe, device_key, loss_scale_setting, setting, varying


class Cell:
    """All ok repeats of one (model, framework, setting, precision, loss-scale setting)."""

    def __init__(self, records: list[dict], label: str, setting_note: str = "", scale_note: str = ""):
        # label: framework and what differs, for tables; setting_note: what differs besides the device (the
        # first screen has a matrix per device, a column per framework); scale_note: the loss-scale setting
        # where it varies
        self.records, self.label, self.setting_note, self.scale_note = records, label, setting_note, scale_note
        r0 = records[0]
        self.model, self.framework, self.precision = r0["model"], r0["framework"], r0["precision"]
        self.column = self.framework
        self.name = f"{self.framework}{setting_note}"  # how the first screen names this cell's framework
        self.setting = setting(r0)
        self.device = self.setting.device or "-"
        self.judged = True  # False: fp32 scored at chance level, accuracy figures mean nothing (see accuracy.py)
        self.repeats = [r["step_times_ms"] for r in records if r.get("step_times_ms")]
        # one figure per repeat (fresh processes are independent; steps of one process are not)
        self.repeat_ms = [float(np.median(t)) for t in self.repeats]
        self.median_ms = stats.geometric_mean(self.repeat_ms)
        pooled = np.concatenate(self.repeats)
        self.p10_ms, self.p90_ms = (float(np.percentile(pooled, q)) for q in (10, 90))
        self.cv = stats.spread(self.repeat_ms)
        self.unstable = self.cv is not None and self.cv > stats.UNSTABLE_CV
        self.first_step_ms = _median(r.get("first_step_ms") for r in records)
        self.samples_per_s = r0["batch_size"] / (self.median_ms / 1e3)
        self.gflops = r0["flops_per_step"] / (self.median_ms / 1e3) / 1e9 if r0.get("flops_per_step") else None
        self.efficiency = _median(r.get("efficiency") for r in records)
        self.peak_mb = _median(r.get("peak_memory_mb") for r in records)
        self.memory_kind = r0.get("memory_kind")
        self.state_mb = r0.get("state_memory_mb") or {}
        self.eval_accuracy = _mean(r.get("eval_accuracy") for r in records)
        self.eval_loss = _mean(r.get("eval_loss") for r in records)
        self.batch_size = r0["batch_size"]
        self.flops_per_step = r0.get("flops_per_step")

    def loss_curve(self) -> list:
        curves = [r["loss"] for r in self.records if r.get("loss")]
        length = min(len(c) for c in curves)
        arr = np.array([[np.nan if v is None else v for v in c[:length]] for c in curves], dtype=float)
        return [None if np.isnan(v) else float(v) for v in np.nanmean(arr, axis=0)] if arr.size else []


def _median(values):
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _label_models(records: list[dict]) -> list[dict]:
    """A model trained under several specs (other batch or input sizes) gets one label per spec hash, so
    that runs of different sizes are never compared."""
    hashes: dict[str, set] = {}
    for r in records:
        if r.get("spec_hash"):
            hashes.setdefault(r["model"], set()).add(r["spec_hash"])
    out = []
    for r in records:
        if r.get("spec_hash") and len(hashes.get(r["model"], ())) > 1:
            r = {**r, "model": f"{r['model']} (batch {r.get('batch_size')}, spec {r['spec_hash'][:6]})"}
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


def _usable(records: list[dict] | None, filename: str, skipped: list[str]) -> list[dict]:
    """The records of `filename` the report can read (harness.results.usable, as for results), saying in
    `skipped` which it left out and why."""
    from harness.results import usable

    kept, notes = usable(records or [], filename)
    skipped += [f"{filename}: {note}" for note in notes]
    return kept


def build_view(records: list[dict], parity_records: list[dict] | None = None,
               diagnoses: list[dict] | None = None, profiles: list[dict] | None = None) -> dict:
    from harness.results import DIAGNOSES_FILE, FINGERPRINTS_FILE, PROFILES_FILE, usable

    records, skipped = usable(records)
    diagnoses, profiles, parity_records = (
        _usable(found, filename, skipped) if found is not None else None
        for found, filename in ((diagnoses, DIAGNOSES_FILE), (profiles, PROFILES_FILE),
                                (parity_records, FINGERPRINTS_FILE)))
    records = _label_models(records)
    studies = [r for r in records if r.get("study")]  # shown as studies, not as cells of the comparison
    records = [r for r in records if not r.get("study")]
    ok = [r for r in records if r.get("status") == "ok" and r.get("step_times_ms")]
    not_run = [r for r in records if r.get("status") != "ok"]
    groups: dict[tuple, list[dict]] = {}
    for r in ok:
        groups.setdefault(cell_key(r), []).append(r)
    labels = _labels(groups)
    cells = {key: Cell(rs, *labels[key]) for key, rs in groups.items()}
    models = sorted({k[0] for k in cells} | {r.get("model") for r in not_run if r.get("model")})
    frameworks = sorted({r["framework"] for r in records if r.get("framework")})
    by_model: dict[str, list[dict]] = {}
    for r in ok:
        by_model.setdefault(r["model"], []).append(r)
    classes = {m: accuracy.num_classes(by_model.get(m, [])) for m in models}

    fp32_cells: dict[tuple, Cell] = {}
    for k, c in cells.items():
        if k[3] == "fp32":
            fp32_cells.setdefault(k[:3], c)

    def fp32_of(key):  # the fp32 cell measured under the same setting
        return fp32_cells.get(key[:3])

    for key, c in cells.items():  # judged against the fp32 baseline's accuracy, or its own without one
        base = fp32_of(key) or c
        c.judged = not accuracy.too_short(base.eval_accuracy, classes.get(c.model))

    summary, speed, memory, accuracy_rows, scaling, sections = [], [], [], [], [], []
    for model in models:
        keys = sorted((k for k in cells if k[0] == model), key=lambda k: (cells[k].label, k[3]))
        if not keys:
            continue
        mcells = [cells[k] for k in keys]
        section = {"model": model, "speed_chart": charts.step_times(
            [{"framework": c.label, "precision": c.precision, "median_ms": c.median_ms, "p10_ms": c.p10_ms,
              "p90_ms": c.p90_ms} for c in mcells], f"{model}: step time"),
            "speed_caption": f"{model}: median ms per training step by framework, one marker per precision, "
                             f"whiskers p10-p90 of all timed steps (log scale; further left is faster).",
            "loss_chart": None, "loss_note": None, "scale_chart": None, "scale_notes": []}
        curves: dict[str, dict[str, list]] = {}
        for key, c in zip(keys, mcells):
            curves.setdefault(c.label, {})[c.precision] = c.loss_curve()
            base = fp32_of(key)
            row = {"model": model, "framework": c.label, "precision": c.precision}
            speed.append({**row, "batch": c.batch_size, "median": _ms(c.median_ms),
                          "spread": f"{_ms(c.p10_ms)} - {_ms(c.p90_ms)}", "samples": _fmt(c.samples_per_s, 0),
                          "first": _ms(c.first_step_ms), "gflops": _fmt(c.gflops, 1),
                          "efficiency": _fmt(c.efficiency and 100 * c.efficiency, 1, " %"),
                          "repeats": len(c.repeats), "cv": _fmt(c.cv and 100 * c.cv, 1, " %"),
                          "unstable": c.unstable})
            memory.append({**row, "peak": _fmt(c.peak_mb, 1), "kind": c.memory_kind,
                           "state": _fmt(sum(c.state_mb.values()), 1) if c.state_mb else "-",
                           "optimizer": _fmt(c.state_mb.get("optimizer_state"), 1) if c.state_mb else "-",
                           "saved": _fmt(100 * (1 - c.peak_mb / base.peak_mb), 0, " %")
                           if base and base is not c and c.peak_mb is not None and base.peak_mb else "-"})
            delta = c.eval_accuracy - base.eval_accuracy if base and c.eval_accuracy is not None \
                and base.eval_accuracy is not None and base is not c else None
            # paired by seed against fp32's seed-to-seed spread (accuracy.compare); fp32's own row shows that spread
            check = accuracy.compare(c.records, base.records, classes.get(c.model)) \
                if base is not None and base is not c else None
            spread = accuracy.spread(c.records) if c.precision == "fp32" and c.judged else None
            accuracy_rows.append({
                **row, "accuracy": _fmt(c.eval_accuracy and 100 * c.eval_accuracy, 1, " %") if c.judged
                else accuracy.TOO_SHORT, "loss": _fmt(c.eval_loss, 4), "judged": c.judged,
                "delta": check.change if check else (spread.label if spread else "-"),
                "flag": bool(check) and not check.acceptable, "check": check})
            if base is not None and base is not c:
                r = stats.ratio(base.repeat_ms, c.repeat_ms)  # > 1: faster than fp32
                summary.append({**row, "key": key, "ratio": r.estimate, "lo": r.low, "hi": r.high,
                                "interval": r.is_interval, "ci": r.label, "decision": r.decision,
                                "text": _speed_phrase(r),
                                "unstable": c.unstable or base.unstable,
                                "memory": memory[-1]["saved"], "accuracy": accuracy_rows[-1]["delta"],
                                "delta_raw": delta, "judged": c.judged, "flag": accuracy_rows[-1]["flag"],
                                "accuracy_check": check})
        differing = {label: cs for label, cs in curves.items() if _curves_differ(cs)}
        if differing:
            section["loss_chart"] = charts.loss_curves(differing, f"{model}: training loss (mean over repeats)")
            section["loss_caption"] = (f"{model}: training loss by step, mean over repeats, one panel per framework "
                                       f"whose precisions' losses differ (log scale).")
        same = sorted(label for label, cs in curves.items() if label not in differing and len(cs) > 1)
        if same:
            section["loss_note"] = (f"{model}: training losses of every precision agree step by step (relative "
                                    f"difference under {LOSS_TOLERANCE:g}) in {', '.join(same)}; no chart needed.")
        histories = {}
        for c in mcells:
            with_history = [r for r in c.records if (r.get("loss_scale") or {}).get("history")]
            flat = _flat_scale(with_history)
            if flat:
                section["scale_notes"].append(f"{c.label} {c.precision}: {flat}")
            for r in with_history:
                ls = r["loss_scale"]
                if not flat:
                    histories.setdefault(f"{c.label} {c.precision}", ls["history"])
                scaling.append({"model": model, "framework": c.label, "precision": c.precision,
                                "repeat": r["repeat"], "mode": (ls.get("settings") or {}).get("mode"),
                                "initial": _fmt(ls.get("initial"), 0), "final": _fmt(ls.get("final"), 0),
                                "skipped": ls.get("skipped_steps"),
                                "first_overflow": "-" if ls.get("first_overflow_step") is None
                                else ls.get("first_overflow_step")})
        if histories:
            section["scale_chart"] = charts.loss_scales(histories, f"{model}: loss scale")
            section["scale_caption"] = (f"{model}: dynamic loss scale by step (first repeat), for the runs whose "
                                        f"scale changed; a drop marks an overflow and a skipped step.")
        sections.append(section)

    profiled = profile_section(profiles or [])
    cast_shares = {(e["model"], g["framework"], g["precision"], g["batch"], g["device"]): g["casts"]
                   for e in profiled["entries"] for g in e["growth"]}
    why = explain(records, cells, summary, profiled["citations"], cast_shares)
    fastest = []  # per device: a GPU and a CPU are never ranked together
    for (model, precision, device) in sorted({(k[0], k[3], c.device) for k, c in cells.items()}):
        contenders = [c for k, c in cells.items() if (k[0], k[3], c.device) == (model, precision, device)]
        best = min(contenders, key=lambda c: c.median_ms)
        fastest.append({"model": model, "precision": precision, "device": device, "framework": best.label,
                        "median": _ms(best.median_ms), "of": len(contenders)})

    return {
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "n_records": len(records), "n_ok": len(ok), "skipped": skipped,
        "models": models, "frameworks": frameworks,
        "answer": answer.build(cells, summary, [{**r, "device_key": device_key(r)} for r in not_run]),
        "headline": _headline(summary), "any_range": any(not s["interval"] for s in summary),
        "min_repeats": stats.MIN_REPEATS, "unstable_cv": 100 * stats.UNSTABLE_CV, "precise": 100 * stats.PRECISE,
        "chance_margin": 100 * accuracy.CHANCE_MARGIN,
        "summary": summary, "fastest": fastest, "speed": speed, "memory": memory,
        "memory_note": _memory_note(cells), "accuracy": accuracy_rows, "accuracy_rule": accuracy.RULE,
        "any_too_short": any(not c.judged for c in cells.values()),
        "scaling": scaling, "sections": sections, "why": why, "why_short": in_short(why),
        "not_run": [{"model": r.get("model") or "-", "framework": r.get("framework"), "precision": r.get("precision"),
                     "repeat": r.get("repeat"), "status": r.get("status"), "reason": r.get("reason") or "-"}
                    for r in not_run],
        "environment": _environment(records),
        "spec_hashes": _spec_hashes(records),
        "parity": [c.row() for c in parity_compare(parity_records)] if parity_records else None,
        **numerics_view(diagnoses or [], studies, cells),
        "pure16": pure16_section(records, diagnoses or []),
        "profile": profiled,
    }


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


def _flat_scale(records: list[dict]) -> str | None:
    """One sentence for a loss scale that never moved and skipped nothing in any repeat, else None."""
    if not records:
        return None
    values = {v for r in records for v in r["loss_scale"]["history"]}
    if len(values) != 1 or any(r["loss_scale"].get("skipped_steps") for r in records):
        return None
    (value,) = values
    exp = math.log2(value) if value > 0 else None
    shown = f"2^{exp:.0f}" if exp is not None and exp == int(exp) else f"{value:g}"
    steps = sorted({len(r["loss_scale"]["history"]) for r in records})
    n = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    each = f" in each of {len(records)} repeats" if len(records) > 1 else ""
    return f"loss scale stayed at {shown}, no step skipped in {n} steps{each}."


def numerics_view(diagnoses: list[dict], studies: list[dict], cells: dict) -> dict:
    """The Numerics section: per diagnosed (model, framework) the gradient histograms and the verdicts; per
    loss-scale study its chart; a "16-bit safe?" line per model. Verdicts are judged here from the captured
    figures (harness.numerics.judge), not read from the record: a diagnosis made before a rule existed gets it."""
    from harness.numerics import judge, merge

    numerics, safe = [], {}
    for d in diagnoses:
        diagnosis = d.get("diagnosis") or {}
        entry = {"model": d.get("model"), "framework": d.get("framework"), "chart": None, "verdicts": [],
                 "note": None}
        if d.get("status") != "ok" or not diagnosis.get("available"):
            entry["note"] = d.get("reason") or "not available: this adapter cannot capture tensors"
            numerics.append(entry)
            continue
        groups = diagnosis["groups"]
        series = {"weight gradients": merge(list(groups["gradients"].values())),
                  "activation gradients": merge(list(groups["activation_gradients"].values()))}
        series = {k: v for k, v in series.items() if v["bins"]}
        low, high = diagnosis.get("loss_scale_window") or (None, None)
        shift = low if low and high is not None and low <= high else None
        entry["chart"] = charts.gradient_histogram(series, shift, f"{d['model']} ({d['framework']}): gradients in fp32, "
                                                                 f"{len(diagnosis['captured_steps'])} captured steps "
                                                                 f"(0 to {diagnosis['captured_steps'][-1]})")
        verdicts = judge(diagnosis)
        entry["verdicts"] = [sentence for _, sentence in verdicts.values()]
        safe.setdefault(d["model"], f"{d['model']} ({d['framework']} diagnosis): "
                        + "; ".join(f"{p} {outcome}" for p, (outcome, _) in verdicts.items()))
        numerics.append(entry)
    study_charts = []
    by_study: dict[tuple, list[dict]] = {}
    for r in studies:  # the loss scale is what a study varies; every other part of the setting stays apart
        by_study.setdefault((r["study"], r.get("model"), r["framework"], setting(r), r["precision"]), []).append(r)
    for (study, model, framework, setting_, precision), rs in sorted(by_study.items(),
                                                                      key=lambda kv: tuple(map(str, kv[0]))):
        window = next(((d.get("diagnosis") or {}).get("loss_scale_window") for d in diagnoses
                       if d.get("model") == model and d.get("framework") == framework), None)
        fp32 = next((c for k, c in cells.items() if k[:3] == (model, framework, setting_) and k[3] == "fp32"), None)
        framework_ = framework + describe(setting_, varying(k[3] for k in by_study
                                                            if k[:3] == (study, model, framework)))
        study_charts.append({"study": study, "model": model, "framework": framework_, "precision": precision,
                             "rows": (points := _study_points(rs, fp32)),
                             "chart": charts.loss_scale_study(points, window, f"{model} ({framework_} {precision}): "
                                                                             f"loss-scale study")})
    return {"numerics": numerics, "studies": study_charts, "sixteen_bit_safe": list(safe.values())}


def _study_points(rs: list[dict], fp32) -> list[dict]:
    by_setting: dict[str, list[dict]] = {}
    for r in rs:
        by_setting.setdefault(loss_scale_setting(r), []).append(r)
    exps = {}
    for setting_, group in by_setting.items():
        settings = (group[0].get("loss_scale") or {}).get("settings") or {}
        exps[setting_] = math.log2(settings["initial"]) if settings.get("mode") == "fixed" else None
    fixed = [e for e in exps.values() if e is not None] or [0.0]
    points = []
    for setting_, group in by_setting.items():
        mode = ((group[0].get("loss_scale") or {}).get("settings") or {}).get("mode", "none")
        x = exps[setting_] if exps[setting_] is not None else (min(fixed) - 3 if mode == "none" else max(fixed) + 3)
        ok = [r for r in group if r.get("status") == "ok"]
        points.append({"x": x, "label": "none" if mode == "none" else ("dynamic" if mode == "dynamic"
                                                                       else f"2^{exps[setting_]:g}"),
                       "accuracy": float(np.mean([r["eval_accuracy"] for r in ok])) if ok else float("nan"),
                       "eval_loss": _fmt(_mean(r.get("eval_loss") for r in ok), 4),
                       "skipped": float(np.mean([(r.get("loss_scale") or {}).get("skipped_steps") or 0 for r in group])),
                       "status": ", ".join(sorted({r["status"] for r in group})), "runs": len(group),
                       "fp32_accuracy": fp32.eval_accuracy if fp32 else None})
    return sorted(points, key=lambda p: p["x"])


def _speed_phrase(r: stats.Ratio) -> str:
    """The comparison in words, by its decision: a direction only where one was decided."""
    if r.decision == "faster":
        return f"{r.estimate:.2f}x faster"
    if r.decision == "slower":
        return f"{1 / r.estimate:.2f}x slower"
    return answer.VERDICTS[r.decision]


def _headline(summary: list[dict]) -> list[str]:
    return [f"{s['model']}, {s['framework']}: {s['precision']} against fp32: {s['text']} (x{s['ratio']:.2f}, "
            f"{s['ci']}){' [unstable timings]' if s['unstable'] else ''}; memory saved {s['memory']}, accuracy change "
            f"{s['accuracy']}." for s in summary]


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
def _environment(records: list[dict]) -> list[dict]:
    rows = {}
    for r in records:
        if not r.get("framework_version"):
            continue
        env = r.get("env") or {}
        device = env.get("device") or {}
        key = (r["framework"], r["framework_version"], r.get("device"))
        row = rows.setdefault(key, {"framework": r["framework"], "version": r["framework_version"],
                                    "device": f"{r.get('device')}: {device.get('description', '')}",
                                    "details": json.dumps(device.get("details") or {}),
                                    "cpu": env.get("cpu"), "flags": ", ".join(env.get("cpu_flags") or []),
                                    "threads": env.get("threads"), "python": env.get("python"),
                                    "os": env.get("os"), "options": set()})
        if r.get("options"):
            row["options"].add(", ".join(f"{k}={v}" for k, v in sorted(r["options"].items())))
    for row in rows.values():
        row["options"] = sorted(row["options"])
    return list(rows.values())


def _spec_hashes(records: list[dict]) -> list[dict]:
    by_model: dict[str, dict[str, set]] = {}
    for r in records:
        if r.get("spec_hash"):
            by_model.setdefault(r["model"], {}).setdefault(r["spec_hash"], set()).add(r["framework"])
    return [{"model": m, "hashes": [{"hash": h, "frameworks": ", ".join(sorted(f))} for h, f in sorted(hs.items())]}
            for m, hs in sorted(by_model.items())]
