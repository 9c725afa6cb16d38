"""The report's "Why" section: explanations the records support, each citing the figures that triggered it."""
from __future__ import annotations

import math


def ms(value) -> str:
    """Milliseconds with three significant digits below 100, whole numbers above."""
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def explain(records: list[dict], cells: dict, summary: list[dict], citations: dict | None = None) -> list[dict]:
    """Explanations the data supports, each citing the figures and facts that triggered it. A rule speaks only
    of the device and the cells it cites, and names the cells that measured the opposite. `citations`: per
    (model, framework, precision, batch size, device), what its profile says made it slower than fp32
    (harness.report.profile); a cell with one is explained by it, not by reasoning from the CPU's flags."""
    citations = citations or {}

    def cited(s: dict) -> str | None:
        c = cells[s["key"]]
        return citations.get((c.model, c.framework, c.precision, c.batch_size, c.records[0].get("device")))

    out = []
    by_device: dict[str, list[dict]] = {}
    for s in summary:
        by_device.setdefault(cells[s["key"]].device, []).append(s)
    for device, comparisons in sorted(by_device.items()):
        slower = [s for s in comparisons if s["hi"] < 1 and cited(s)]
        for framework in sorted({cells[s["key"]].framework for s in slower}):  # a paragraph per framework
            out.append({"title": f"Where 16-bit loses time in {framework} on {device}, by its profiles",
                        "text": "; ".join(f"{cited(s)} (timed: {s['precision']} {_cell_ms(cells, s)} ms vs fp32 "
                                          f"{_cell_ms(cells, s, fp32=True)} ms per step, {s['ci']})"
                                          for s in slower if cells[s["key"]].framework == framework) + "."})
        c0 = next(cells[s["key"]] for s in comparisons)
        if c0.records[0].get("device") != "cpu":
            continue
        env = next((r["env"] for c in cells.values() if c.device == device for r in c.records if r.get("env")),
                   {}) or {}
        out += _cpu_16bit(device, env, comparisons, cells, {s["key"] for s in slower})
        very = [s for s in comparisons if s["hi"] < 0.2 and not cited(s)]
        if very:
            cases = "; ".join(f"{s['model']} {s['framework']} {s['precision']}: {1 / s['ratio']:.0f}x slower "
                              f"({s['ci']})" for s in very[:6])
            out.append({"title": f"Some 16-bit kernels fall back to slow reference code on {device}",
                        "text": f"Slow-downs of 5x or more are not conversion overhead but a missing fast kernel "
                                f"for that dtype and layer on this device: {cases}."})
    skipping: dict[tuple, list[dict]] = {}
    for r in records:
        ls = r.get("loss_scale") or {}
        if r.get("status") == "diverged":
            out.append({"title": f"{r['precision']} diverged in {r['framework']} ({r['model']})",
                        "text": f"{r.get('reason')}. "
                                + ("A common cause: pure float16 keeps weights and optimizer state in 16 bits "
                                   "with no loss scaling, so small updates and epsilons can underflow (float16's "
                                   "smallest normal value is 6e-5)." if r["precision"] == "fp16" else "")})
        elif ls.get("skipped_steps"):
            skipping.setdefault((r["model"], r["framework"], r["precision"]), []).append(r)
    for (model, framework, precision), rs in skipping.items():  # one entry per cell, not per repeat
        skipped = [r["loss_scale"]["skipped_steps"] for r in rs]
        ls = rs[0]["loss_scale"]
        runs = f"{len(rs)} repeats" if len(rs) > 1 else f"repeat {rs[0].get('repeat')}"
        out.append({"title": f"{framework} {precision} skipped {'/'.join(map(str, skipped))} step"
                             f"{'s' if max(skipped) > 1 or len(rs) > 1 else ''} ({model}, {runs})",
                    "text": f"Gradients were not finite at loss scale {fmt(ls.get('initial'), 0)} (first at step "
                            f"{ls.get('first_overflow_step')} in repeat {rs[0].get('repeat')}); the dynamic scaler "
                            f"skipped those updates and ended at scale {fmt(ls.get('final'), 0)}."})
    for s in summary:
        c = cells[s["key"]]
        if not c.flops_per_step or c.flops_per_step >= 1e9 or s["lo"] > 1 or s["hi"] < 1:
            continue  # only where the measured interval includes "no difference"
        out.append({"title": f"{c.model} is too small for precision to matter ({c.label} {c.precision})",
                    "text": f"A step does {c.flops_per_step / 1e6:.0f} MFLOP at batch {c.batch_size}; at "
                            f"{c.median_ms:.2f} ms per step ({c.gflops:.1f} GFLOP/s) fixed per-step costs "
                            f"dominate: {c.precision} against fp32 measured x{s['ratio']:.2f} ({s['ci']}), no "
                            f"clear difference."})
    gpus = {}
    for r in records:
        device = (r.get("env") or {}).get("device") or {}
        if device.get("kind") == "gpu":
            gpus.setdefault(device.get("description"), device)
    for gpu in gpus.values():
        cc = str((gpu.get("details") or {}).get("compute_capability") or "")
        if cc and float(cc) < 7.0:
            out.append({"title": f"{gpu['description']} has no tensor cores",
                        "text": f"{gpu['description']} has compute capability {cc}: float16 tensor cores arrived "
                                f"with 7.0 (Volta), bfloat16 and TF32 with 8.0 (Ampere)."})
        elif cc and float(cc) < 8.0:
            out.append({"title": f"No bfloat16 or TF32 tensor cores on {gpu['description']}",
                        "text": f"{gpu['description']} has compute capability {cc}: its tensor cores take float16; "
                                f"bfloat16 and TF32 need 8.0 (Ampere)."})
    return out


def _cpu_16bit(device: str, env: dict, comparisons: list[dict], cells: dict, profiled: set) -> list[dict]:
    """Why a 16-bit dtype ran slower than fp32 on this CPU, said only of the cells that did and have no profile
    (`profiled` keys) to say it, and naming those that ran faster (then the CPU alone cannot be the reason)."""
    out = []
    flags = set(env.get("cpu_flags") or [])
    for dtype, native, name in (("bf16", ("avx512_bf16", "amx_bf16"), "bfloat16"),
                                ("fp16", ("avx512_fp16", "amx_fp16"), "float16")):
        mine = [s for s in comparisons if dtype in s["precision"]]
        slower = [s for s in mine if s["hi"] < 1 and s["key"] not in profiled]  # beyond the interval (or range)
        if not slower:
            continue
        faster = [s for s in mine if s["lo"] > 1]
        cases = "; ".join(f"{s['model']} in {s['framework']}: {s['precision']} {_cell_ms(cells, s)} ms vs fp32 "
                          f"{_cell_ms(cells, s, fp32=True)} ms per step ({s['ci']})" for s in slower[:6])
        have = sorted(flags & set(native))
        where = ", ".join(sorted({s["framework"] for s in slower}))
        if not have:
            text = (f"This CPU ({env.get('cpu', 'unknown')}) has no native {name} arithmetic (none of "
                    f"{', '.join(native)} among its flags): {name} math is emulated by converting to float32 and "
                    f"back, and in these runs that cost more than it saved. Measured: {cases}.")
        else:
            text = (f"This CPU reports {', '.join(have)}, yet {name} training ran slower than fp32: {cases}. "
                    f"Mixed precision adds casts between float32 weights and 16-bit activations; it only pays "
                    f"off where the framework's 16-bit kernels for these layers are much faster than its float32 "
                    f"ones, which these measurements show they were not.")
        if faster:
            text += (" On the same CPU, " + "; ".join(f"{s['model']} in {s['framework']}: {s['precision']} was "
                                                     f"{s['ratio']:.2f}x faster ({s['ci']})" for s in faster[:4])
                     + ", so the slow-down belongs to those frameworks' kernels, not to the CPU alone.")
        out.append({"title": f"{name} ran slower than fp32 in {where} on {device}", "text": text})
    return out


def _fp32(cells: dict, key: tuple):
    return next((c for k, c in cells.items() if k[:3] == key[:3] and k[3] == "fp32"), None)


def _cell_ms(cells, s, fp32: bool = False) -> str:
    return ms((_fp32(cells, s["key"]) if fp32 else cells[s["key"]]).median_ms)
