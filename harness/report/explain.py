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


def explain(records: list[dict], cells: dict, summary: list[dict]) -> list[dict]:
    """Explanations the data supports, each citing the figures and facts that triggered it."""
    out = []
    env = next((r["env"] for r in records if r.get("env")), {}) or {}
    flags = set(env.get("cpu_flags") or [])
    on_cpu = [s for s in summary if (cells[s["key"]].device or "") == "cpu"]
    for dtype, native, name in (("bf16", ("avx512_bf16", "amx_bf16"), "bfloat16"),
                                ("fp16", ("avx512_fp16", "amx_fp16"), "float16")):
        slower = [s for s in on_cpu if dtype in s["precision"] and s["hi"] < 1]  # slower beyond the 95% CI
        if not slower:
            continue
        cases = "; ".join(f"{s['model']} in {s['framework']}: {s['precision']} {_cell_ms(cells, s)} ms vs fp32 "
                          f"{_cell_ms(cells, s, fp32=True)} ms per step" for s in slower[:6])
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
                        "text": f"Gradients overflowed float16 at loss scale {fmt(ls.get('initial'), 0)} "
                                f"(first at step {ls.get('first_overflow_step')}); the dynamic scaler skipped "
                                f"those updates and ended at scale {fmt(ls.get('final'), 0)}."})
    for key, c in cells.items():
        base = _fp32(cells, key)
        if base is None or c is base or not c.flops_per_step or c.flops_per_step >= 1e9:
            continue
        ratio = base.median_ms / c.median_ms
        if 0.85 < ratio < 1.15:
            out.append({"title": f"{c.model} is too small for precision to matter ({c.label} {c.precision})",
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


def _fp32(cells: dict, key: tuple):
    return next((c for k, c in cells.items() if k[:3] == key[:3] and k[3] == "fp32"), None)


def _cell_ms(cells, s, fp32: bool = False) -> str:
    return ms((_fp32(cells, s["key"]) if fp32 else cells[s["key"]]).median_ms)
