"""The report's "Where the time goes" section, from `amp-harness profile` records (harness.run.profile): per model,
a stacked bar per (framework, precision) by layer group, the layers whose time grew most from fp32 to each 16-bit
precision, the share of the step spent in casts, and the cast map: the dtype each layer computed in, per
framework, as the profiler saw it run.

    section = profile_section(profiles)   # profiles.jsonl records
    section.entries, section.shown (templates/_profile.html.j2, _profile.md.j2),
    section.citations[(model, framework, precision, batch, device)]

A profiled step carries the profiler's overhead and comes from one run of a few steps: the section compares
profiles with profiles only, and the timed comparison stays the measurement of speed. A 16-bit profile is
compared with the fp32 profile of the same setting only (harness.identity: device, node, threads, variant,
version, batch size): profiles under different settings are labelled by what differs, never paired.
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.report import charts
from harness.report import format as f
from harness.identity import cell_key, describe, varying
from harness.records import is_profile
from harness.run.profile import COVERAGE_TOLERANCE

GROUPS = {"conv2d": "convolutions", "dense": "dense layers", "batchnorm": "normalisation",
          "layernorm": "normalisation", "maxpool2d": "pooling", "avgpool2d": "pooling",
          "global_avgpool2d": "pooling", "relu": "activations", "gelu": "activations", "tanh": "activations",
          "sigmoid": "activations", "softmax": "activations"}  # the rest (flatten, dropout, residual adds): "other layers"
PART_NAMES = {"casts": "casts", "loss": "loss", "update": "optimizer update", "loss_scale": "loss scaling",
              "runtime": "runtime dispatch"}
ORDER = [*dict.fromkeys(GROUPS.values()), "other layers", *PART_NAMES.values(), "other"]  # the chart's segments
GROWN = 3  # layers named per (framework, 16-bit precision)


def latest(profiles: list[dict]) -> dict[tuple, dict]:
    """The last ok profile of each cell key (model, framework, setting, precision, loss-scale setting): a profile
    is one run, rerun to replace it."""
    out = {}
    for r in profiles:
        if r.get("status") == "ok" and _well_formed(r.get("profile")):
            out[cell_key(r)] = r
    return out


def names(found: dict[tuple, dict]) -> dict[tuple, str]:
    """Per profile key, its framework named with what differs between that framework's settings here (and the
    loss-scale setting where it varies), as the timed cells are named."""
    by_framework: dict[str, set] = {}
    scales: dict[tuple, set] = {}
    for model, framework, setting_, precision, scale in found:
        by_framework.setdefault(framework, set()).add(setting_)
        scales.setdefault((model, framework, setting_, precision), set()).add(scale)
    return {k: k[1] + describe(k[2], varying(by_framework[k[1]]))
            + (f" (loss scale {k[4]})" if len(scales[k[:4]]) > 1 else "") for k in found}


def _well_formed(p) -> bool:
    """A profile as harness.run.profile writes it (an edited or foreign record is left out, not a traceback)."""
    return p is not None and is_profile(p)


def breakdown(p: dict) -> list[tuple[str, float]]:
    """(group, ms per step) in the chart's order: layer groups, then the parts, then what no op accounts for."""
    groups: dict[str, float] = {}
    for layer in p["layers"]:
        group = GROUPS.get(layer["type"], "other layers")
        groups[group] = groups.get(group, 0.0) + layer["forward_ms"] + layer["backward_ms"]
    out = [(g, groups[g]) for g in ORDER if groups.get(g)]
    out += [(PART_NAMES[name], ms) for name, ms in p["parts"].items() if name in PART_NAMES and ms > 0]
    if p["parts"]["other"] > 0:
        out.append(("other", p["parts"]["other"]))
    return out


def grown(p16: dict, p32: dict, most: int = GROWN) -> list[dict]:
    """The layers (and pass: forward or backward) whose time grew most from fp32, by milliseconds added."""
    base = {layer["path"]: layer for layer in p32["layers"]}
    step = p16["step_mean_ms"]
    rows = []
    for layer in p16["layers"]:
        before = base.get(layer["path"])
        for phase in ("forward", "backward"):
            ms16, ms32 = layer[f"{phase}_ms"], before[f"{phase}_ms"] if before else 0.0
            if ms16 > ms32:
                rows.append({"label": layer["label"], "phase": phase, "ms": ms16, "fp32_ms": ms32,
                             "added_ms": ms16 - ms32, "share": ms16 / step if step else None,
                             "factor": ms16 / ms32 if ms32 > 0 else None, "compute": layer.get("compute")})
    return sorted(rows, key=lambda row: -row["added_ms"])[:most]


def citation(model: str, framework: str, precision: str, p16: dict, p32: dict) -> str:
    """One sentence for the Why section: what the profile says made this precision slower than fp32."""
    rows = grown(p16, p32, 1)
    step16, step32 = p16["step_mean_ms"], p32["step_mean_ms"]
    casts = p16["parts"]["casts"] / step16 if step16 else 0.0
    head = (f"{framework} {precision} ({model}), profiled: {f.significant(step16)} ms per step against fp32's "
            f"{f.significant(step32)} ms")
    if not rows:
        return f"{head}; no layer took longer than in fp32; casts take {f.percent(casts, 0)} of the step"
    top = rows[0]
    return (f"{head}; layer {top['label']} {top['phase']} takes {f.percent(top['share'], 0)} of the step, "
            f"{f.factor(top['factor'])} its fp32 time ({f.significant(top['ms'])} vs {f.significant(top['fp32_ms'])} "
            f"ms, computing in {top['compute'] or '-'}); casts take {f.percent(casts, 0)}")


def cast_maps(model: str, found: dict, named: dict[tuple, str]) -> list[dict]:
    """Per precision profiled for `model`: layers x frameworks (each setting a column of its own), the dtype each
    layer computed in, with the rows where frameworks differ marked."""
    out = []
    precisions = sorted({k[3] for k in found if k[0] == model}, key=charts._order)
    for precision in precisions:
        keys = sorted((k for k in found if k[0] == model and k[3] == precision), key=lambda k: named[k])
        columns = [named[k] for k in keys]
        layers = [{layer["path"]: layer for layer in found[k]["profile"]["layers"]} for k in keys]
        paths = list(dict.fromkeys(path for column in layers for path in column))
        rows = []
        for path in paths:
            cells = [column.get(path, {}).get("compute") for column in layers]
            if not any(cells):
                continue  # a layer no framework ran an op for (a flatten that is a view)
            label = next(column[path]["label"] for column in layers if path in column)
            rows.append({"label": label, "cells": [c or "-" for c in cells],
                         "differs": len({c for c in cells if c}) > 1})
        uniform = {c for row in rows for c in row["cells"] if c != "-"}
        out.append({"precision": precision, "columns": columns, "rows": rows,
                    "uniform": next(iter(uniform)) if len(uniform) == 1 else None})
    return out


def profile_view(profiles: list[dict]) -> list[dict]:
    found = latest(profiles)
    named = names(found)
    entries = []
    for model in sorted({k[0] for k in found}):
        mine = {k: r for k, r in found.items() if k[0] == model}
        fp32: dict[tuple, dict] = {}  # per (framework, setting): its first fp32 profile
        for k, r in mine.items():
            if k[3] == "fp32":
                fp32.setdefault(k[1:3], r)
        bars, growth = [], []
        for k, r in sorted(mine.items(), key=lambda kv: (named[kv[0]], charts._order(kv[0][3]))):
            p, framework, precision = r["profile"], k[1], k[3]
            bars.append({"label": f"{named[k]} {precision}", "segments": breakdown(p),
                         "overlap": -p["parts"]["other"] if p["parts"]["other"] < 0 else 0.0})
            # the fp32 profile of the same setting: another batch size, device or variant measures another thing
            base = fp32.get(k[1:3])
            if precision != "fp32" and base is not None:
                growth.append({"framework": named[k], "precision": precision, "step_ms": p["step_mean_ms"],
                               "batch": r.get("batch_size"), "device": r.get("device"),
                               "fp32_step_ms": base["profile"]["step_mean_ms"],
                               "casts": p["parts"]["casts"] / p["step_mean_ms"],
                               "rows": grown(p, base["profile"]),
                               "citation": citation(model, framework, precision, p, base["profile"]),
                               "cites": (model, framework, precision, r.get("batch_size"), r.get("device"))})
        batches = sorted({r.get("batch_size") for r in mine.values()}, key=str)
        entries.append({"model": model, "bars": bars, "growth": growth, "cast_maps": cast_maps(model, found, named),
                        "steps": next(iter(mine.values()))["profile"].get("steps"),
                        "batch": ", ".join(map(str, batches)),
                        "tools": sorted({f"{k[1]}: {r['profile'].get('tool')}" for k, r in mine.items()}),
                        "notes": sorted({f"{k[1]}: {r['profile']['note']}" for k, r in mine.items()
                                         if r["profile"].get("note")}),
                        "coverage": {f"{named[k]} {k[3]}": r["profile"].get("coverage") for k, r in mine.items()}})
    return entries


@dataclass(frozen=True)
class ProfileSection:
    """The section as data: `entries` (profile_view), `citations` for the Why section, and `shown`: the
    entries with their figures formatted and their charts drawn, as templates/_profile.*.j2 render them."""
    entries: list[dict]
    citations: dict[tuple, str]
    shown: list[dict]
    coverage_low: str = f.percent(1 - COVERAGE_TOLERANCE, 0)
    coverage_high: str = f.percent(1 + COVERAGE_TOLERANCE, 0)


def profile_section(profiles: list[dict], charts_on: bool = True) -> ProfileSection:
    """The section; empty (no entries, nothing shown) without an ok profile."""
    entries = profile_view(profiles or [])
    citations = {g["cites"]: g["citation"] for e in entries for g in e["growth"]}
    return ProfileSection(entries, citations, _shown(entries, charts_on))


def _shown(entries: list[dict], charts_on: bool) -> list[dict]:
    from markupsafe import Markup

    shown = []
    for entry in entries:
        chart = charts.time_breakdown(entry["bars"], ORDER, entry["model"] + ": where a training step goes") \
            if charts_on else ""
        shown.append({
            **entry, "chart": Markup(chart),  # svg.py escapes the chart's text
            "overlaps": [f"{b['label']} ({f.ms(b['overlap'])} ms)" for b in entry["bars"] if b["overlap"] > 0],
            "growth": [{"framework": g["framework"], "precision": g["precision"], "casts": f.percent(g["casts"], 0),
                        "step": f"{f.ms(g['step_ms'])} ({f.ms(g['fp32_step_ms'])})", "citation": g["citation"],
                        "rows": [{"label": row["label"], "phase": row["phase"],
                                  "ms": f"{f.ms(row['ms'])} ({f.ms(row['fp32_ms'])})",
                                  "factor": f.factor(row["factor"]),
                                  "share": f.percent(row["share"], 0), "compute": row["compute"] or "-"}
                                 for row in g["rows"]]}
                       for g in entry["growth"]],
            "differing": [{"precision": cmap["precision"], "columns": cmap["columns"],
                           "layers": [row["label"] for row in cmap["rows"] if row["differs"]]}
                          for cmap in entry["cast_maps"] if any(row["differs"] for row in cmap["rows"])],
            "low": [f"{name} {f.percent(c, 0)}" for name, c in sorted(entry["coverage"].items())
                    if isinstance(c, (int, float)) and abs(c - 1) > COVERAGE_TOLERANCE]})
    return shown
