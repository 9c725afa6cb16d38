"""The report's "Why" section: explanations the records support, each citing the figures that triggered it.

A rule fires only on what a comparison decided (`stats.Ratio.decision`: never on a range of too few repeats nor
on an interval too wide to decide), names the evidence it rests on (the timed cells, the device's measured matmul
peaks per dtype, the CPU's flags, a profile's cast share) and says "likely" where it infers a cause from them.
Each entry also carries its cause in one sentence (`short`), the same for every entry of that cause, so that
`in_short` says each cause once, with the models and frameworks it concerns, for the first screen.
"""
from __future__ import annotations

from harness.records import Device, Env, RunRecord
from harness.report import format as f
from harness.report.data import Why
from harness.report.verdicts import Comparison, PooledRuns
from harness.run import nonfinite
from harness.stats import PRECISE

SMALL_FLOPS = 1e9  # below this many FLOPs per step, fixed per-step costs can outweigh any arithmetic saved
VERY_SLOW = 0.2  # a 16-bit step 5x or more slower than fp32's: more than casts usually cost
DTYPES = (("bf16", ("avx512_bf16", "amx_bf16"), "bfloat16"), ("fp16", ("avx512_fp16", "amx_fp16"), "float16"))


def explain(records: list[RunRecord], cells: dict[tuple, PooledRuns], summary: list[Comparison],
            citations: dict | None = None,
            cast_shares: dict | None = None) -> list[Why]:
    """Explanations the data supports, each citing the figures and facts that triggered it. A rule speaks only
    of the device and the cells it cites, and names the cells that measured the opposite. `citations`: per
    (model, framework, precision, batch size, device), what its profile says made it slower than fp32
    (harness.report.profile), and `cast_shares` the share of its profiled step spent in casts; a cell with one
    is explained by it, not by reasoning from the CPU's flags."""
    citations, cast_shares = citations or {}, cast_shares or {}

    def profile_key(s: Comparison) -> tuple:
        c = s.cell
        return c.model, c.framework, c.precision, c.batch_size, c.records[0].device

    def cited(s: Comparison) -> str | None:
        return citations.get(profile_key(s))

    out = []
    by_device: dict[str, list[Comparison]] = {}
    for s in summary:
        by_device.setdefault(s.cell.device, []).append(s)
    for device, comparisons in sorted(by_device.items()):
        slower = [s for s in comparisons if s.decision == "slower" and cited(s)]
        shares = [cast_shares[profile_key(s)] for s in slower if profile_key(s) in cast_shares]
        short = (f"Profiles of the slower 16-bit cells on {device} name the layers that lost the time"
                 + (f" and put {f.percent_range(min(shares), max(shares))} of the 16-bit step in casts"
                    if shares else ""))
        for framework in sorted({s.cell.framework for s in slower}):  # a paragraph per framework
            out.append(Why(title=f"Where 16-bit loses time in {framework} on {device}, by its profiles",
                        text="; ".join(f"{cited(s)} (timed: {s.precision} {_cell_ms(s)} ms vs fp32 "
                                          f"{_cell_ms(s, fp32=True)} ms per step, {s.ci})"
                                          for s in slower if s.cell.framework == framework) + ".",
                        short=short, about=[framework]))
        c0 = next(s.cell for s in comparisons)
        peaks = _peaks(cells, device)
        if c0.records[0].device == "cpu":
            env = next((r.env for c in cells.values() if c.device == device for r in c.records if r.env), Env())
            out += _cpu_16bit(device, env, peaks, comparisons, {s.key for s in slower})
            very = [s for s in comparisons if s.decision == "slower" and s.hi < VERY_SLOW and not cited(s)]
            if very:
                cases = "; ".join(f"{s.model} {s.framework} {s.precision}: {f.times_slower(s.ratio)} "
                                  f"({s.ci})" for s in very[:6])
                out.append(Why(title=f"Some 16-bit steps are 5x or more slower than fp32 on {device}",
                            text=f"Measured: {cases}. That is more than casts between float32 and 16-bit "
                                    f"usually cost (a cast reads and writes each tensor once), so the likely cause "
                                    f"is a layer without a fast kernel for that dtype on this device; `amp-harness "
                                    f"profile` on these cells would show which layer.",
                            short=f"Slow-downs of 5x or more on {device}, likely from 16-bit layers without a "
                                     f"fast kernel there",
                            about=[f"{s.model} {s.framework} {s.precision}" for s in very]))
        small = [s for s in comparisons if s.decision == "same"
                 and s.cell.flops_per_step and s.cell.flops_per_step < SMALL_FLOPS]
        if small:
            out.append(_too_small(device, small, peaks))
    skipping: dict[tuple, list[RunRecord]] = {}
    diverged: dict[tuple, list[RunRecord]] = {}
    for r in records:
        if r.status == "diverged":
            diverged.setdefault((r.model, r.framework, r.precision), []).append(r)
        elif r.loss_scale and r.loss_scale.skipped_steps:
            skipping.setdefault((r.model, r.framework, r.precision), []).append(r)
    for (model, framework, precision), rs in diverged.items():  # one entry per cell, quoting its first repeat
        r = rs[0]
        located = f" ({nonfinite.describe(r.nonfinite.written)})" if r.nonfinite else ""
        others = f" (repeat {r.repeat}; {len(rs)} repeats diverged)" if len(rs) > 1 else ""
        guess = "" if precision != "fp16" or (r.nonfinite and r.nonfinite.found) else (
            "A likely cause: pure float16 keeps weights and optimizer state in 16 bits with no loss scaling, so "
            "small updates and epsilons can underflow (float16's smallest normal value is 6e-5).")
        out.append(Why(title=f"{precision} diverged in {framework} ({model})",
                       text=f"{r.reason}{others}{located}. {guess}".rstrip(),
                       short=f"{precision} diverged", about=[f"{framework} {model}"]))
    for (model, framework, precision), rs in skipping.items():  # one entry per cell, not per repeat
        skipped = [r.loss_scale.skipped_steps for r in rs]
        ls = rs[0].loss_scale
        runs = f"{len(rs)} repeats" if len(rs) > 1 else f"repeat {rs[0].repeat}"
        out.append(Why(title=f"{framework} {precision} skipped {'/'.join(map(str, skipped))} step"
                             f"{'s' if max(skipped) > 1 or len(rs) > 1 else ''} ({model}, {runs})",
                    text=f"Gradients were not finite at loss scale {f.number(ls.initial, 0)} (first at step "
                            f"{ls.first_overflow_step} in repeat {rs[0].repeat}); the dynamic scaler "
                            f"skipped those updates and ended at scale {f.number(ls.final, 0)}.",
                    short="The dynamic loss scaler skipped the updates whose gradients overflowed",
                    about=[f"{framework} {precision} {model}"]))
    gpus: dict[str | None, Device] = {}
    for r in records:
        if r.env and r.env.device and r.env.device.kind == "gpu":
            gpus.setdefault(r.env.device.description, r.env.device)
    for gpu in gpus.values():
        cc = gpu.compute_capability
        if cc and float(cc) < 7.0:
            title = f"{gpu.description} has no tensor cores"
            out.append(Why(title=title, short=f"{title} (compute capability {cc})",
                        text=f"{gpu.description} has compute capability {cc}: float16 tensor cores arrived "
                                f"with 7.0 (Volta), bfloat16 and TF32 with 8.0 (Ampere)."))
        elif cc and float(cc) < 8.0:
            title = f"No bfloat16 or TF32 tensor cores on {gpu.description}"
            out.append(Why(title=title, short=f"{title} (compute capability {cc})",
                        text=f"{gpu.description} has compute capability {cc}: its tensor cores take float16; "
                                f"bfloat16 and TF32 need 8.0 (Ampere)."))
    return out


def in_short(why: list[Why], most: int = 4) -> list[str]:
    """"Why, in short": one sentence per cause, each said once with the models and frameworks it concerns."""
    causes: dict[str, list[str]] = {}
    for w in why:
        about = causes.setdefault(w.short, [])
        about += [a for a in w.about if a not in about]
    return [short + (f" ({', '.join(about[:most])}{f' and {len(about) - most} more' if len(about) > most else ''})"
               if about else "") + "." for short, about in causes.items()]


def _peaks(cells: dict, device: str) -> dict[str, dict[str, float]]:
    """Per framework, the matrix-multiply peak (GFLOP/s) per dtype its runs measured on this device
    (harness.run.peak): through each framework's own kernels, so frameworks are not pooled."""
    out: dict[str, dict[str, float]] = {}
    for c in cells.values():
        if c.device == device:
            for r in c.records:
                for dtype, gflops in (r.device_peak_gflops or {}).items():
                    if gflops:
                        out.setdefault(c.framework, {}).setdefault(dtype, gflops)
    return out


def _peak_evidence(peaks: dict, name: str, frameworks) -> tuple[float | None, str, str]:
    """(the largest 16-bit / float32 peak ratio, "0.12x", "15 vs 120 GFLOP/s in torch") for the
    given frameworks; (None, "", "") where none measured both dtypes."""
    pairs = [(framework, p[name], p["float32"]) for framework, p in sorted(peaks.items())
             if framework in frameworks and p.get(name) and p.get("float32")]
    if not pairs:
        return None, "", ""
    ratios = [a / b for _, a, b in pairs]
    low, high = f.rough(min(ratios)), f.rough(max(ratios))
    times = f"{low}x" if low == high else f"{low}-{high}x"
    if len(pairs) == 1:
        (framework, a, b), = pairs
        return max(ratios), times, f"{f.gflops(a)} vs {f.gflops(b)} GFLOP/s in {framework}"
    return max(ratios), times, ", ".join(f"{framework} {f.gflops(a)} vs {f.gflops(b)}"
                                         for framework, a, b in pairs) + " GFLOP/s"


def _cpu_16bit(device: str, env: Env, peaks: dict, comparisons: list[Comparison], profiled: set) -> list[Why]:
    """Why a 16-bit dtype ran slower than fp32 on this CPU, said only of the cells decided slower with no profile
    (`profiled` keys) to say it, from the CPU's flags and the measured matmul peaks, and naming those decided
    faster (then the CPU alone cannot be the reason)."""
    out = []
    flags = set(env.cpu_flags or [])
    for dtype, native, name in DTYPES:
        mine = [s for s in comparisons if dtype in s.precision]
        slower = [s for s in mine if s.decision == "slower" and s.key not in profiled]
        if not slower:
            continue
        faster = [s for s in mine if s.decision == "faster"]
        cases = "; ".join(f"{s.model} in {s.framework}: {s.precision} {_cell_ms(s)} ms vs fp32 "
                          f"{_cell_ms(s, fp32=True)} ms per step ({s.ci})" for s in slower[:6])
        have = sorted(flags & set(native))
        frameworks = sorted({s.framework for s in slower})
        peak, times, figures = _peak_evidence(peaks, name, frameworks)
        flag_words = f"it reports {', '.join(have)}" if have else f"no {'/'.join(native)} among its flags"
        all_slower = [s for s in mine if s.decision == "slower"]
        scope = (f"{name} is slower than fp32 for every model here" if len(all_slower) == len(mine) else
                 f"{name} is slower than fp32 in {len(all_slower)} of its {len(mine)} comparisons here "
                 f"({', '.join(sorted({s.framework for s in all_slower}))})")
        if peak is None:
            short = (f"This CPU {'reports ' + ', '.join(have) if have else 'has ' + flag_words} (no {name} matmul "
                     f"peak measured in these records): {scope}")
        elif peak < 1:
            short = (f"{name} matmuls run at {times} float32's speed on this CPU (measured peak {figures}; "
                     f"{flag_words}): {scope}")
        else:
            short = (f"{name} matmuls run at {times} float32's speed on this CPU (measured peak {figures}; "
                     f"{flag_words}), yet {scope}: the cost likely lies outside the matmuls (casts, layers without "
                     f"a fast {name} kernel)")
        measured = f"; its measured {name} matmul peak is {times} float32's ({figures})" if figures else ""
        if not have:
            text = (f"This CPU ({env.cpu or 'unknown'}) has none of {', '.join(native)} among its flags"
                    f"{measured}: {name} math is likely emulated by converting to float32 and back, and in these "
                    f"runs that cost more than it saved. Measured: {cases}.")
        else:
            text = (f"This CPU reports {', '.join(have)}{measured}, yet {name} training ran slower than fp32: "
                    f"{cases}. Mixed precision adds casts between float32 weights and 16-bit activations; it only "
                    f"pays off where the framework's 16-bit kernels for these layers are much faster than its "
                    f"float32 ones, which these measurements show they were not (likely the casts, or layers "
                    f"without a fast {name} kernel: a profile would say which).")
        if faster:
            text += (" On the same CPU, " + "; ".join(f"{s.model} in {s.framework}: {s.precision} was "
                                                     f"{f.faster(s.ratio)} ({s.ci})" for s in faster[:4])
                     + ", so the CPU alone is not the reason: the slow-down likely lies in the slower frameworks' "
                       "kernels.")
            short += f"; faster in {', '.join(sorted({s.framework for s in faster}))} on the same CPU"
        out.append(Why(title=f"{name} ran slower than fp32 in {', '.join(frameworks)} on {device}", text=text,
                    short=short))
    return out


def _too_small(device: str, small: list[Comparison], peaks: dict) -> Why:
    """Models whose step is too small for precision to matter, said only where 16-bit measured within +/-5% of
    fp32 (decided "same": never of a slower 16-bit step), with the step's FLOPs and its share of the peak."""
    cases = []
    for s in small:
        c = s.cell
        fp32_peak = (peaks.get(c.framework) or {}).get("float32")
        share = f", {f.percent(c.gflops / fp32_peak)} of its measured float32 matmul peak" if fp32_peak else ""
        tokens = f"{f.number(c.tokens_per_s, 0)} tokens/s, " if c.tokens_per_s else ""
        cases.append(f"{c.model} ({c.label} {c.precision}): {f.mflop(c.flops_per_step)} MFLOP per step at batch "
                     f"{c.batch_size}, {f.number(c.median_ms)} ms per step ({tokens}{f.number(c.gflops, 1)} GFLOP/s"
                     f"{share}), "
                     f"{f.ratio(s.ratio)} against fp32 ({s.ci})")
    models = sorted({s.model for s in small})
    return Why(title=f"Likely too small for precision to matter on {device}: {', '.join(models)}",
               text=f"Under {f.plain(SMALL_FLOPS / 1e9)} GFLOP per step, and 16-bit measured within "
                    f"{f.percent(PRECISE, 0)} of fp32: {'; '.join(cases)}. Fixed per-step costs (dispatch, the "
                    f"optimizer update, memory traffic) likely dominate such steps, so the arithmetic precision saves "
                    f"little.",
               short=f"Under {f.plain(SMALL_FLOPS / 1e9)} GFLOP per step, 16-bit measured within "
                     f"{f.percent(PRECISE, 0)} of fp32 on {device}: likely too small for precision to matter",
               about=models)


def _cell_ms(s: Comparison, fp32: bool = False) -> str:
    return f.ms((s.fp32 if fp32 else s.cell).median_ms)
