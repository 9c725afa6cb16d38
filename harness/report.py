"""The HTML report: records -> a view model (plain dicts, every figure computed here from raw measurements)
-> one jinja2 render with autoescape on -> a self-contained page, plus the flattened records as CSV."""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from harness import charts
from harness.parity import compare as parity_compare

ACCURACY_MARGIN = 0.02  # an eval-accuracy change beyond 2 points against fp32 is flagged
BOOTSTRAP_SAMPLES = 2000
SIXTEEN_BIT = ("amp_fp16", "amp_bf16", "fp16", "bf16")


# ---- statistics ---------------------------------------------------------------------------------------
def _ratio_ci(base: list[list[float]], other: list[list[float]], seed: int = 0) -> tuple[float, float, float]:
    """Speed-up base/other from per-step times grouped by repeat: the ratio of the medians over repeats of
    each repeat's median, with a 95% bootstrap interval (over repeats when both have 2+, else over steps)."""
    rng = np.random.default_rng(seed)
    if len(base) >= 2 and len(other) >= 2:
        a, b = np.array([np.median(r) for r in base]), np.array([np.median(r) for r in other])
    else:
        a, b = np.concatenate(base), np.concatenate(other)
    point = float(np.median(a) / np.median(b))
    boot = [np.median(rng.choice(a, a.size)) / np.median(rng.choice(b, b.size)) for _ in range(BOOTSTRAP_SAMPLES)]
    return point, float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def _speed_phrase(ratio: float, lo: float, hi: float) -> str:
    if lo <= 1 <= hi:
        return "not clearly faster or slower than"
    if ratio >= 1:
        return f"{ratio:.2f}x faster than"
    return f"{1 / ratio:.2f}x slower than"


def _ms(value) -> str:
    """Milliseconds with three significant digits below 100, whole numbers above."""
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


# ---- the view model -----------------------------------------------------------------------------------
class Cell:
    """All ok repeats of one (model, framework, precision)."""

    def __init__(self, records: list[dict]):
        self.records = records
        r0 = records[0]
        self.model, self.framework, self.precision = r0["model"], r0["framework"], r0["precision"]
        self.repeats = [r["step_times_ms"] for r in records if r.get("step_times_ms")]
        pooled = np.concatenate(self.repeats) if self.repeats else np.array([np.nan])
        # the median over repeats of each repeat's median: the statistic the speed-ups use
        self.median_ms = float(np.median([np.median(r) for r in self.repeats])) if self.repeats else float("nan")
        self.p10_ms, self.p90_ms = (float(np.percentile(pooled, q)) for q in (10, 90))
        self.first_step_ms = _median(r.get("first_step_ms") for r in records)
        self.samples_per_s = r0["batch_size"] / (self.median_ms / 1e3)
        self.gflops = r0["flops_per_step"] / (self.median_ms / 1e3) / 1e9 if r0.get("flops_per_step") else None
        self.peak_mb = _median(r.get("peak_memory_mb") for r in records)
        self.memory_kind = r0.get("memory_kind")
        self.eval_accuracy = _mean(r.get("eval_accuracy") for r in records)
        self.eval_loss = _mean(r.get("eval_loss") for r in records)
        self.batch_size, self.device = r0["batch_size"], r0.get("device")
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


def build_view(records: list[dict], parity_records: list[dict] | None = None) -> dict:
    from harness.results import usable

    records, skipped = usable(records)
    records = _label_models(records)
    ok = [r for r in records if r.get("status") == "ok" and r.get("step_times_ms")]
    not_run = [r for r in records if r.get("status") != "ok"]
    groups: dict[tuple, list[dict]] = {}
    for r in ok:
        groups.setdefault((r["model"], r["framework"], r["precision"]), []).append(r)
    cells = {key: Cell(rs) for key, rs in groups.items()}
    models = sorted({k[0] for k in cells} | {r.get("model") for r in not_run if r.get("model")})
    frameworks = sorted({r["framework"] for r in records if r.get("framework")})

    summary, speed, memory, accuracy, scaling, sections = [], [], [], [], [], []
    for model in models:
        mcells = sorted((c for k, c in cells.items() if k[0] == model), key=lambda c: (c.framework, c.precision))
        if not mcells:
            continue
        section = {"model": model, "speed_chart": charts.step_times([vars(c) for c in mcells], f"{model}: step time"),
                   "loss_chart": None, "scale_chart": None}
        curves: dict[str, dict[str, list]] = {}
        for c in mcells:
            curves.setdefault(c.framework, {})[c.precision] = c.loss_curve()
            base = cells.get((model, c.framework, "fp32"))
            speed.append({"model": model, "framework": c.framework, "precision": c.precision, "batch": c.batch_size,
                          "median": _ms(c.median_ms), "spread": f"{_ms(c.p10_ms)} - {_ms(c.p90_ms)}",
                          "samples": _fmt(c.samples_per_s, 0), "first": _ms(c.first_step_ms),
                          "gflops": _fmt(c.gflops, 1), "repeats": len(c.repeats)})
            memory.append({"model": model, "framework": c.framework, "precision": c.precision,
                           "peak": _fmt(c.peak_mb, 1), "kind": c.memory_kind,
                           "saved": _fmt(100 * (1 - c.peak_mb / base.peak_mb), 0, " %")
                           if base and base is not c and c.peak_mb is not None and base.peak_mb else "-"})
            delta = c.eval_accuracy - base.eval_accuracy if base and c.eval_accuracy is not None \
                and base.eval_accuracy is not None and base is not c else None
            accuracy.append({"model": model, "framework": c.framework, "precision": c.precision,
                             "accuracy": _fmt(c.eval_accuracy and 100 * c.eval_accuracy, 1, " %"),
                             "loss": _fmt(c.eval_loss, 4),
                             "delta": _fmt(delta and 100 * delta, 1, " pt") if delta is not None else "-",
                             "flag": delta is not None and abs(delta) > ACCURACY_MARGIN})
            if base is not None and base is not c:
                ratio, lo, hi = _ratio_ci(base.repeats, c.repeats)
                summary.append({"model": model, "framework": c.framework, "precision": c.precision,
                                "ratio": ratio, "lo": lo, "hi": hi, "text": _speed_phrase(ratio, lo, hi),
                                "ci": f"{lo:.2f}-{hi:.2f}",
                                "memory": memory[-1]["saved"], "accuracy": accuracy[-1]["delta"],
                                "flag": accuracy[-1]["flag"]})
        section["loss_chart"] = charts.loss_curves(curves, f"{model}: training loss (mean over repeats)")
        histories = {}
        for c in mcells:
            for r in c.records:
                ls = r.get("loss_scale") or {}
                if ls.get("history"):
                    histories.setdefault(f"{c.framework} {c.precision}", ls["history"])
                    scaling.append({"model": model, "framework": c.framework, "precision": c.precision,
                                    "repeat": r["repeat"], "mode": (ls.get("settings") or {}).get("mode"),
                                    "initial": _fmt(ls.get("initial"), 0), "final": _fmt(ls.get("final"), 0),
                                    "skipped": ls.get("skipped_steps"),
                                    "first_overflow": "-" if ls.get("first_overflow_step") is None
                                    else ls.get("first_overflow_step")})
        if histories:
            section["scale_chart"] = charts.loss_scales(histories, f"{model}: loss scale")
        sections.append(section)

    fastest = []
    for model in models:
        for precision in sorted({k[2] for k in cells if k[0] == model}):
            contenders = [c for k, c in cells.items() if k[0] == model and k[2] == precision]
            best = min(contenders, key=lambda c: c.median_ms)
            fastest.append({"model": model, "precision": precision, "framework": best.framework,
                            "median": _ms(best.median_ms), "of": len(contenders)})

    return {
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "n_records": len(records), "n_ok": len(ok), "skipped": skipped,
        "models": models, "frameworks": frameworks,
        "headline": _headline(summary),
        "summary": summary, "fastest": fastest, "speed": speed, "memory": memory,
        "memory_note": _memory_note(cells), "accuracy": accuracy, "accuracy_margin": 100 * ACCURACY_MARGIN,
        "scaling": scaling, "sections": sections, "why": explain(records, cells, summary),
        "not_run": [{"model": r.get("model") or "-", "framework": r.get("framework"), "precision": r.get("precision"),
                     "repeat": r.get("repeat"), "status": r.get("status"), "reason": r.get("reason") or "-"}
                    for r in not_run],
        "environment": _environment(records),
        "spec_hashes": _spec_hashes(records),
        "parity": [c.row() for c in parity_compare(parity_records)] if parity_records else None,
    }


def _headline(summary: list[dict]) -> list[str]:
    lines = []
    for s in summary:
        lines.append(f"{s['model']}, {s['framework']}: {s['precision']} is {s['text']} fp32 "
                     f"(x{s['ratio']:.2f}, 95% CI {s['ci']}); memory saved {s['memory']}, "
                     f"accuracy change {s['accuracy']}.")
    return lines


def _memory_note(cells: dict) -> str:
    kinds = sorted({c.memory_kind for c in cells.values() if c.memory_kind})
    if len(kinds) == 1 and kinds[0].startswith("process peak RSS"):
        return ("Every figure is the process's peak resident memory above its level after the model was built: "
                "one kind of figure, comparable across frameworks and precisions (it includes each framework's "
                "own caches and workspaces).")
    return ("Figures of different kinds (see each row) do not compare across frameworks: allocator peaks count "
            "tensors only, device-wide samples count everything on the device.")


# ---- explanations -------------------------------------------------------------------------------------
def explain(records: list[dict], cells: dict, summary: list[dict]) -> list[dict]:
    """Explanations the data supports, each citing the figures and facts that triggered it."""
    out = []
    env = next((r["env"] for r in records if r.get("env")), {}) or {}
    flags = set(env.get("cpu_flags") or [])
    on_cpu = [s for s in summary if (cells[(s["model"], s["framework"], s["precision"])].device or "") == "cpu"]
    for dtype, native, name in (("bf16", ("avx512_bf16", "amx_bf16"), "bfloat16"),
                                ("fp16", ("avx512_fp16", "amx_fp16"), "float16")):
        slower = [s for s in on_cpu if dtype in s["precision"] and s["hi"] < 1]  # slower beyond the 95% CI
        if not slower:
            continue
        cases = "; ".join(f"{s['model']} in {s['framework']}: {s['precision']} {_cell_ms(cells, s)} ms vs fp32 "
                          f"{_cell_ms(cells, s, 'fp32')} ms per step" for s in slower[:6])
        have = sorted(flags & set(native))
        if not have:
            text = (f"This CPU ({env.get('cpu', 'unknown')}) has no native {name} arithmetic (none of "
                    f"{', '.join(native)} among its flags): {name} math is emulated by converting to float32 and "
                    f"back, so 16-bit training is slower than fp32 here. Measured: {cases}.")
        else:
            text = (f"This CPU reports {', '.join(have)}, yet {name} training ran slower than fp32: {cases}. "
                    f"Mixed precision adds casts between float32 weights and 16-bit activations; it only pays "
                    f"off where the framework's 16-bit kernels for these layers are much faster than its float32 "
                    f"ones, which these measurements show they were not.")
        out.append({"title": f"{name} is slower than fp32 on this CPU", "text": text})
    very = [s for s in on_cpu if s["hi"] < 0.2]
    if very:
        cases = "; ".join(f"{s['model']} {s['framework']} {s['precision']}: {1 / s['ratio']:.0f}x slower"
                          for s in very[:6])
        out.append({"title": "Some 16-bit kernels fall back to slow reference code",
                    "text": f"Slow-downs of 5x or more are not conversion overhead but a missing fast kernel for "
                            f"that dtype and layer on this device: {cases}."})
    for r in records:
        ls = r.get("loss_scale") or {}
        if r.get("status") == "diverged":
            out.append({"title": f"{r['precision']} diverged in {r['framework']} ({r['model']})",
                        "text": f"{r.get('reason')}. "
                                + ("Pure float16 keeps weights and optimizer state in 16 bits with no loss "
                                   "scaling: small updates and epsilons underflow (float16's smallest normal "
                                   "value is 6e-5)." if r["precision"] == "fp16" else "")})
        elif ls.get("skipped_steps"):
            out.append({"title": f"{r['framework']} {r['precision']} skipped {ls['skipped_steps']} steps "
                                 f"({r['model']}, repeat {r['repeat']})",
                        "text": f"Gradients overflowed float16 at loss scale {_fmt(ls.get('initial'), 0)} "
                                f"(first at step {ls.get('first_overflow_step')}); the dynamic scaler skipped "
                                f"those updates and ended at scale {_fmt(ls.get('final'), 0)}."})
    for key, c in cells.items():
        base = cells.get((c.model, c.framework, "fp32"))
        if base is None or c is base or not c.flops_per_step or c.flops_per_step >= 1e9:
            continue
        ratio = base.median_ms / c.median_ms
        if 0.85 < ratio < 1.15:
            out.append({"title": f"{c.model} is too small for precision to matter ({c.framework} {c.precision})",
                        "text": f"A step does {c.flops_per_step / 1e6:.0f} MFLOP at batch {c.batch_size}; at "
                                f"{c.median_ms:.2f} ms per step ({c.gflops:.1f} GFLOP/s) fixed per-step costs "
                                f"dominate, so {c.precision} changes the step time by only {abs(1 - ratio) * 100:.0f} %."})
    gpu = next((r["env"]["device"] for r in records if (r.get("env") or {}).get("device", {}).get("kind") == "gpu"),
               None)
    if gpu:
        cc = str((gpu.get("details") or {}).get("compute_capability") or "")
        if cc and float(cc) < 7.0:
            out.append({"title": "This GPU has no tensor cores",
                        "text": f"{gpu['description']} has compute capability {cc}: float16 tensor cores arrived "
                                f"with 7.0 (Volta), bfloat16 and TF32 with 8.0 (Ampere)."})
        elif cc and float(cc) < 8.0:
            out.append({"title": "No bfloat16 or TF32 tensor cores on this GPU",
                        "text": f"{gpu['description']} has compute capability {cc}: its tensor cores take float16; "
                                f"bfloat16 and TF32 need 8.0 (Ampere)."})
    return out


def _cell_ms(cells, s, precision=None) -> str:
    return _ms(cells[(s["model"], s["framework"], precision or s["precision"])].median_ms)


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


# ---- rendering ----------------------------------------------------------------------------------------
def render(view: dict) -> str:
    from jinja2 import Environment, PackageLoader, select_autoescape
    from markupsafe import Markup

    env = Environment(loader=PackageLoader("harness", "templates"), autoescape=select_autoescape(["html", "j2"]))
    for section in view["sections"]:  # matplotlib's SVG escapes its text; mark it safe to inline it
        for key in ("speed_chart", "loss_chart", "scale_chart"):
            if section[key]:
                section[key] = Markup(section[key])
    return env.get_template("report.html.j2").render(**view)


def write_report(records: list[dict], out: Path, parity_records: list[dict] | None = None) -> tuple[Path, Path]:
    from harness.results import to_frame

    view = build_view(records, parity_records)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(view))
    frame = to_frame(records)
    for column in frame.columns:  # lists (per-step times, losses) and option dicts as JSON cells
        frame[column] = frame[column].map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v)
    csv = out.with_suffix(".csv")
    frame.to_csv(csv, index=False)
    return out, csv
