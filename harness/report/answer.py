"""The report's first screen: per device, a matrix of models x frameworks, each cell the best precision there
against that framework's fp32, and one recommendation line per model.

Every figure comes from the comparisons `view` computed (`stats.ratio` of repeat medians, accuracy changes
judged by `accuracy`); this module only chooses among them and words the choice. Devices are never pooled: a
GPU's speed-up says nothing about a CPU's.
"""
from __future__ import annotations

from harness.report import accuracy
from harness.report.explain import ms

VERDICTS = {"faster": "faster", "same": "no clear difference", "slower": "slower", "none": "no comparison"}


def verdict(s: dict) -> str:
    """faster / same / slower: where the interval (or, with few repeats, the range) lies against 1."""
    return "faster" if s["lo"] > 1 else ("slower" if s["hi"] < 1 else "same")


def acceptable(s: dict) -> bool:
    """Accuracy does not rule this precision out: unjudged (too short), or not worse than fp32 by the margin."""
    return not (s["judged"] and s["delta_raw"] is not None and s["delta_raw"] < -accuracy.ACCURACY_MARGIN)


def _rank(s: dict) -> tuple:
    return acceptable(s), verdict(s) == "faster", s["ratio"]


def _speed(s: dict) -> str:
    if verdict(s) == "same":  # no direction claimed where the interval includes 1
        return f"x{s['ratio']:.2f} vs fp32"
    if s["ratio"] >= 1:
        return f"{s['ratio']:.2f}x faster"
    return f"{1 / s['ratio']:.2f}x slower"


def _entry(s: dict, cell) -> dict:
    v = verdict(s)
    return {"precision": s["precision"] + cell.scale_note, "setting": cell.setting_note.strip(" []"),
            "verdict": v, "verdict_text": VERDICTS[v],
            "speed": _speed(s), "interval": s["ci"], "accuracy": accuracy.change_phrase(s["delta_raw"], s["judged"]),
            "accuracy_flag": not acceptable(s), "ms": f"{ms(cell.median_ms)} ms/step", "unstable": s["unstable"]}


def _plain_entry(cells: list, why: str) -> dict:
    fastest = min(cells, key=lambda c: c.median_ms)
    return {"precision": fastest.precision + fastest.scale_note, "setting": fastest.setting_note.strip(" []"),
            "verdict": "none", "verdict_text": why,
            "speed": None, "interval": None, "accuracy": None, "accuracy_flag": False,
            "ms": f"{ms(fastest.median_ms)} ms/step", "unstable": False}


def build(cells: dict, summary: list[dict], not_run: list[dict]) -> list[dict]:
    """One block per device: columns (frameworks), rows (models), recommendations."""
    blocks = []
    for device in sorted({c.device for c in cells.values()}):
        dcells = {k: c for k, c in cells.items() if c.device == device}
        columns = sorted({c.column for c in dcells.values()})
        models = sorted({c.model for c in dcells.values()})
        comparisons = [s for s in summary if s["key"] in dcells]
        rows, recommendations = [], []
        for model in models:
            row = []
            for column in columns:
                mine = [c for c in dcells.values() if c.model == model and c.column == column]
                candidates = [s for s in comparisons if dcells[s["key"]].model == model
                              and dcells[s["key"]].column == column]
                if candidates:
                    best = max(candidates, key=_rank)
                    row.append(_entry(best, dcells[best["key"]]))
                elif mine:
                    fp32 = all(c.precision == "fp32" for c in mine)
                    row.append(_plain_entry(mine, "fp32 only" if fp32 else "no fp32 run to compare"))
                else:
                    row.append(None)
                framework = next(c.framework for c in dcells.values() if c.column == column)
                failed = sorted({f"{r['precision']} {r['status']}" for r in not_run if r.get("model") == model
                                 and r.get("framework") == framework and r.get("device_key") in (device, None)})
                if row[-1] is not None and failed:
                    row[-1]["not_run"] = ", ".join(failed)
            rows.append({"model": model, "cells": row})
            recommendations.append(recommend(model, [s for s in comparisons if dcells[s["key"]].model == model],
                                             [c for c in dcells.values() if c.model == model], dcells))
        blocks.append({"device": device, "columns": columns, "rows": rows, "recommendations": recommendations})
    return blocks


def recommend(model: str, comparisons: list[dict], mcells: list, cells: dict) -> str:
    """One line: the precision and framework to use for this model on this device, and the fastest cell."""
    fastest = min(mcells, key=lambda c: c.median_ms)
    tail = f"fastest overall: {fastest.name} {fastest.precision}{fastest.scale_note} {ms(fastest.median_ms)} ms/step"
    if not comparisons:
        return f"{model}: no framework ran both fp32 and another precision, so no speed-up to compare; {tail}."
    good = [s for s in comparisons if verdict(s) == "faster" and acceptable(s)]
    ruled_out = [s for s in comparisons if verdict(s) == "faster" and not acceptable(s)]
    caveat = "".join(f" ({cells[s['key']].name} {s['precision']} was {s['ratio']:.2f}x faster but "
                     f"{accuracy.change_phrase(s['delta_raw'], True)})" for s in ruled_out[:2])
    if good:
        s = max(good, key=lambda s: s["ratio"])
        c = cells[s["key"]]
        unstable = " [unstable timings]" if s["unstable"] else ""
        return (f"{model}: {c.name} {s['precision']}{c.scale_note}, {s['ratio']:.2f}x faster than {c.name} fp32 "
                f"({s['ci']}){unstable}, {accuracy.change_phrase(s['delta_raw'], s['judged'])}{caveat}; {tail}.")
    closest = max(comparisons, key=lambda s: s["ratio"])
    c = cells[closest["key"]]
    where = "which includes 1" if verdict(closest) == "same" else "clearly slower"
    return (f"{model}: no precision is clearly faster than fp32 in any framework here (closest: {c.name} "
            f"{closest['precision']}{c.scale_note} x{closest['ratio']:.2f}, {closest['ci']}, {where}){caveat}; "
            f"keep fp32; {tail}.")
