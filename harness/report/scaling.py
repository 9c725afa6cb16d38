"""Where 16-bit starts to pay: the report's section of a scaling study (`amp-harness study scaling`).

A study's runs are ordinary runs of one model at several sizes (batch size, width, a token model's sequence
length), tied by a study id that starts with harness.identity.SCALING_STUDY. Every size of every precision pools
its runs apart (harness.report.verdicts.PooledRuns): the sizes are part of the setting (harness.identity.Setting:
batch, width, seq_len), so runs of two sizes never pool. A series is one (model, framework, setting apart from the
sizes, precision); each of its points is that precision's runs at one size against the fp32 runs of the same size and
setting: the speed-up is stats.ratio of fp32's repeat medians over the precision's, as the rest of the report
pairs them, and its verdict is stats.Ratio.decision, the one rule of the report.

The crossover, defined here once: the size with the least work per step (FLOPs per training step; the sizes
themselves where a record holds none) whose speed-up is decided "faster" (its whole 95% interval above 1) with
every size of more work decided "faster" too. A point estimate above 1 whose interval reaches 1, a size with fewer
than MIN_REPEATS repeats (no interval), a size the precision did not run (unsupported, failed, skipped by the
memory guard) all break the run of faster sizes, so none of them is ever, or lies beyond, the crossover. Without
one the section says "not reached up to" the largest size.

Studies are grouped by what they measured, not by their id: `--resume` gives the runs it adds a new study id, and
they belong to the same curve.

The device's matmul curve (a scaling study's runs hold it: harness.run.peak.matmul_curves, square n x n products
only) is shown beside the model's achieved GFLOP/s, with one computed sentence per entry on how each 16-bit
dtype's matmuls compare with float32's at each n (curve_sentence): a single median per size, no interval, so a
16-bit size counts as faster only at CURVE_PAYS times float32's rate or more, and a dtype below CURVE_EMULATED of
float32's rate at every size is said to be likely emulated.

The step's own matmuls (schema 8's matmul_shapes: harness.model.graph.step_matmuls, each timed alone in the run's
compute dtype) are what the sentences' "why" rests on where the runs hold them: their time summed (MatmulTime) is
what the step would take if it were nothing but its matmuls, so its share of the measured step says whether the
step is its matmuls (BUSY_SHARE or more) or mostly other work (casts, dispatch, elementwise ops, the optimizer
update); and the same shapes' time in 16-bit against float32's says whether 16-bit matmuls are faster at the
sizes this model multiplies, whatever the square curve says. Without them, the fp32 step's share of the device's
float32 peak stands in, and the peak, for why no size pays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from markupsafe import Markup

from harness import stats
from harness.identity import cell_key, scaling_study
from harness.precision import PRECISIONS
from harness.records import MatmulProduct, RunRecord
from harness.report import charts
from harness.report import format as f
from harness.report.verdicts import VERDICTS, PooledRuns

SIZES = ("batch", "width", "seq_len")  # the parts of a Setting a scaling study varies
SIZE_NAMES = {"batch": "batch", "width": "width", "seq_len": "sequence length"}
PEAK_DTYPES = {"fp32": "float32", "amp_bf16": "bfloat16", "bf16": "bfloat16", "amp_fp16": "float16",
               "fp16": "float16", "tf32": "float32"}
CURVE_DTYPES = ("float32", "bfloat16", "float16")
CURVE_PAYS = 1.1  # a 16-bit matmul this many times float32's rate or more is faster (one median: no interval)
# fp32 at this share of the device's float32 matmul peak or more, or its matmuls timed alone filling this share of
# its step or more: the step is its matmuls, not mostly overhead
BUSY_SHARE = 0.5
CURVE_EMULATED = 0.25  # below this share of float32's rate at every size: likely emulated (no native kernel)


@dataclass
class MatmulTime:
    """A step's 2D matmuls timed alone (a record's matmul_shapes): their summed time, the share of the step's FLOPs
    they cover, how many were not timed."""
    dtype: str
    ms: float
    flops_share: float | None
    untimed: int
    products: list[MatmulProduct]

    @classmethod
    def of(cls, cell: PooledRuns | None) -> MatmulTime | None:
        shapes = next((r.matmul_shapes for r in cell.records if r.matmul_shapes), None) if cell else None
        if not shapes or not shapes.products:
            return None
        timed = [p for p in shapes.products if p.gflops]
        flops = sum(2 * p.m * p.k * p.n for p in shapes.products)
        return cls(shapes.dtype, sum(2 * p.m * p.k * p.n / p.gflops / 1e6 for p in timed),
                   flops / cell.flops_per_step if cell.flops_per_step else None,
                   len(shapes.products) - len(timed), shapes.products)

    def share_of(self, step_ms: float) -> float:
        return self.ms / step_ms

    def clause(self, step_ms: float) -> str:
        """"its matmuls, timed alone at the step's own shapes, take 1.2 ms of its 4.0 ms step (30%)"."""
        covered = f" ({f.percent(self.flops_share, 0)} of its FLOPs)" if self.flops_share and \
            self.flops_share < 0.995 else ""
        untimed = f", {self.untimed} of {len(self.products)} products not timed" if self.untimed else ""
        return (f"its matmuls{covered}, timed alone at the step's own shapes in {self.dtype}, take "
                f"{f.ms(self.ms)} ms of its {f.ms(step_ms)} ms step ({f.percent(self.share_of(step_ms), 0)}"
                f"{untimed})")


@dataclass
class Point:
    """One size of one precision: its cell against fp32's cell of that size (either may be missing)."""
    sizes: dict  # batch, width, seq_len as the records hold them (width None: 1)
    flops: float | None  # per training step
    cell: PooledRuns | None
    fp32: PooledRuns | None
    speedup: stats.Ratio | None  # fp32's time over this precision's: > 1 is faster
    note: str = ""  # why there is no comparison: the precision's status and reason

    @property
    def decision(self) -> str:
        return self.speedup.decision if self.speedup else "none"

    @property
    def faster(self) -> bool:
        """What the crossover counts: the one rule's verdict (stats.Ratio.decision), nothing else."""
        return self.decision == "faster"

    @property
    def memory_saved(self) -> float | None:
        a, b = (self.fp32.peak_mb if self.fp32 else None), (self.cell.peak_mb if self.cell else None)
        return 1 - b / a if a and b is not None else None

    @cached_property
    def matmuls(self) -> MatmulTime | None:
        return MatmulTime.of(self.cell)

    @cached_property
    def fp32_matmuls(self) -> MatmulTime | None:
        return MatmulTime.of(self.fp32)

    def matmul_speedup(self) -> float | None:
        """fp32's matmuls' time over this precision's at the step's own shapes (both timed in full)."""
        a, b = self.fp32_matmuls, self.matmuls
        return a.ms / b.ms if a and b and not a.untimed and not b.untimed and b.ms else None

    def order(self) -> tuple:
        return (self.flops if self.flops is not None else math.inf,
                *[self.sizes.get(k) or (1 if k == "width" else 0) for k in SIZES])


@dataclass
class Series:
    precision: str
    points: list[Point]  # by work per step
    crossover: Point | None
    sentence: str = ""


@dataclass
class Row:
    """A row of the section's table: one size of one precision, formatted."""
    precision: str
    size: str
    flops: str
    fp32_ms: str
    ms: str
    speedup: str
    interval: str
    verdict: str
    memory_saved: str
    gflops: str
    fp32_gflops: str
    efficiency: str
    matmul_ms: str  # the step's own matmuls timed alone, and their share of the measured step
    fp32_matmul_ms: str


@dataclass
class ScalingEntry:
    """One (model, framework, setting) of a scaling study: a series per 16-bit precision."""
    model: str
    framework: str
    studies: list[str]
    varies: list[str]  # the sizes that vary, of SIZES
    series: list[Series]
    rows: list[Row]
    peaks: str  # the device's matmul peaks per dtype as the runs measured them
    chart: Markup | None = None
    memory_chart: Markup | None = None
    memory_caption: str = ""
    caption: str = ""
    curve_lines: list[str] = field(default_factory=list)  # the matmul curve against float32's, the model against it
    curve_chart: Markup | None = None
    curve_caption: str = ""

    @property
    def sentences(self) -> list[str]:
        return [s.sentence for s in self.series if s.sentence]


@dataclass
class ScalingSection:
    entries: list[ScalingEntry] = field(default_factory=list)

    @property
    def shown(self) -> bool:
        return bool(self.entries)


def crossover(points: list[Point]) -> Point | None:
    """The smallest size (by work per step) decided faster with every larger size decided faster too; None when
    the largest is not (see the module's docstring)."""
    found = None
    for point in sorted(points, key=Point.order, reverse=True):
        if not point.faster:
            break
        found = point
    return found


def size_name(point: Point, varies: list[str]) -> str:
    """"batch 64", "batch 64, width 2": the sizes that vary in its study."""
    parts = []
    for k in varies or ["batch"]:
        value = point.sizes.get(k)
        value = 1 if k == "width" and value is None else value
        parts.append(f"{SIZE_NAMES[k]} {f.plain(value) if isinstance(value, float) else value}")
    return ", ".join(parts)


def _strip(setting):
    return setting._replace(batch=None, width=None, seq_len=None)


def scaling_section(records: list[RunRecord], cast_shares: dict | None = None) -> ScalingSection:
    """The section from every record of a scaling study (others are ignored). `cast_shares`: per (model,
    framework, precision, batch, device) the share of a profiled step spent in casts (harness.report.profile),
    cited where a profile of the spec's own widths exists at the size below the crossover."""
    runs = [r for r in records if scaling_study(r.written)]
    groups: dict[tuple, list[RunRecord]] = {}
    for r in runs:
        if r.status == "ok" and r.step_times_ms:
            groups.setdefault(cell_key(r.written), []).append(r)
    cells = {k: PooledRuns(k, rs, k[1]) for k, rs in groups.items()}
    by_entry: dict[tuple, list[PooledRuns]] = {}
    for (model, framework, setting_, _, _), c in cells.items():
        by_entry.setdefault((model, framework, _strip(setting_)), []).append(c)
    not_ok = [r for r in runs if r.status != "ok"]
    entries = []
    for (model, framework, base), cs in sorted(by_entry.items(), key=lambda kv: tuple(map(str, kv[0]))):
        entries.append(_entry(model, framework, cs, [r for r in runs if r.model == model
                                                       and r.framework == framework],
                              [r for r in not_ok if r.model == model and r.framework == framework],
                              cast_shares or {}))
    return ScalingSection(entries)


def _entry(model: str, framework: str, cs: list[PooledRuns], runs: list[RunRecord], failed: list[RunRecord],
           cast_shares: dict) -> ScalingEntry:
    sizes_of = {c.setting: {k: getattr(c.setting, k) for k in SIZES} for c in cs}
    varies = [k for k in SIZES if len({str(s[k]) for s in sizes_of.values()}) > 1] or ["batch"]
    fp32 = {c.setting: c for c in cs if c.precision == "fp32"}
    precisions = sorted(({c.precision for c in cs} | {r.precision for r in failed}) - {"fp32", None},
                        key=charts._order)
    series, rows = [], []
    for precision in precisions:
        mine = {c.setting: c for c in cs if c.precision == precision}
        points = []
        for setting_ in sorted(set(fp32) | set(mine), key=lambda s: tuple(str(getattr(s, k)) for k in SIZES)):
            cell, base = mine.get(setting_), fp32.get(setting_)
            flops = (cell or base).flops_per_step
            ratio = stats.ratio(base.process_ms, cell.process_ms) if cell and base else None
            note = "" if ratio else _why_none(precision, setting_, failed, cell, base)
            points.append(Point(sizes_of[setting_], flops, cell, base, ratio, note))
        points.sort(key=Point.order)
        s = Series(precision, points, crossover(points))
        s.sentence = _sentence(model, framework, s, varies, cast_shares)
        series.append(s)
        rows += [_row(precision, p, varies) for p in points]
    peaks = _peaks(runs)
    entry = ScalingEntry(model, framework, sorted({r.study for r in runs if r.study}), varies, series, rows, peaks)
    plotted = {s.precision: [{"x": p.flops, "y": p.speedup.estimate, "low": p.speedup.low,
                              "high": p.speedup.high, "interval": p.speedup.is_interval}
                             for p in s.points if p.speedup and p.flops] for s in series}
    if any(plotted.values()):
        entry.chart = Markup(charts.speedup_scaling(plotted, f"{model} ({framework}): speed-up over fp32 by work "
                                                             f"per step"))
        entry.caption = (f"{model} ({framework}): speed-up over fp32 (fp32's step time over the precision's) at "
                         f"each size against FLOPs per training step (log scales); bars: 95% intervals (dashed: "
                         f"a range, fewer than {stats.MIN_REPEATS} repeats); above the 1.0 line is faster. The "
                         f"crossover is the smallest size whose whole interval lies above 1, with every larger "
                         f"size above 1 too.")
    by_batch = varies == ["batch"]  # against the batch size where only it varies, else against work per step
    saved = {s.precision: [{"x": p.sizes["batch"] if by_batch else p.flops, "y": p.memory_saved}
                           for p in s.points if p.memory_saved is not None] for s in series}
    saved = {p: pts for p, pts in saved.items() if pts}
    if saved:
        kind = next((c.memory_kind for c in cs if c.memory_kind), None)
        entry.memory_chart = Markup(charts.memory_scaling(
            saved, f"{model} ({framework}): peak memory saved against fp32", by_batch))
        ends = "; ".join(
            f"{s.precision} {f.percent(pts[0].memory_saved, 0)} at {size_name(pts[0], varies)}"
            + (f", {f.percent(pts[-1].memory_saved, 0)} at {size_name(pts[-1], varies)}" if len(pts) > 1 else "")
            for s in series for pts in [[p for p in s.points if p.memory_saved is not None]] if pts)
        entry.memory_caption = (f"{model} ({framework}): 1 - the precision's peak memory over fp32's at the same "
                                f"size (medians over repeats{f'; {kind}' if kind else ''}); below 0 it takes more. "
                                f"Saved: {ends}.")
    _add_curve(entry, cs, precisions)
    return entry


def _curves(cs: list[PooledRuns]) -> dict | None:
    """The device's matmul curve per dtype as the study's runs measured it; fp32's runs first (a tf32 run's
    float32 curve is TF32's)."""
    for c in sorted(cs, key=lambda c: c.precision != "fp32"):
        for r in c.records:
            if r.matmul_curve:
                return r.matmul_curve
    return None


def _dtype_style(dtype: str, precisions: list[str]) -> str:
    """The precision whose colour a dtype's curve takes: the study's precision computing in it, else the
    registry's pure one."""
    for p in ["fp32", *precisions]:
        if PEAK_DTYPES.get(p.partition(":")[0]) == dtype:
            return p
    return next((name for name, p in PRECISIONS.items() if p.compute_dtype == dtype == p.param_dtype), "fp32")


def _add_curve(entry: ScalingEntry, cs: list[PooledRuns], precisions: list[str]) -> None:
    curves = _curves(cs)
    if not curves:
        return
    entry.curve_lines = [line for line in (curve_sentence(entry.framework, curves),
                                           steps_sentence(cs, ["fp32", *precisions], curves)) if line]
    shown = {d: curves[d] for d in CURVE_DTYPES if curves.get(d)}
    plotted = {d: {"style": _dtype_style(d, precisions),
                   "points": [{"x": 2.0 * n**3, "y": g} for n, g in zip(c.n, c.gflops)]}
               for d, c in shown.items()}
    steps = {p: [{"x": c.flops_per_step, "y": c.gflops} for c in cs if c.precision == p and c.gflops]
             for p in ["fp32", *precisions]}
    steps = {p: pts for p, pts in steps.items() if pts}
    if not plotted:
        return
    shapes: dict[str, dict] = {}
    for c in cs:
        t = MatmulTime.of(c)
        if t:
            shapes.setdefault(t.dtype, {"style": plotted.get(t.dtype, {}).get("style") or _dtype_style(t.dtype,
                                                                                                       precisions),
                                        "points": []})["points"] += [
                {"x": 2.0 * p.m * p.k * p.n, "y": p.gflops} for p in t.products if p.gflops]
    entry.curve_chart = Markup(charts.matmul_curve(plotted, steps, f"{entry.model} ({entry.framework}): the "
                                                                   f"device's matmul curve and the model's steps",
                                                   shapes))
    stops = [f"{d}'s curve stops at n={c.n[-1]}: {c.stopped}" for d, c in shown.items() if c.stopped]
    entry.curve_caption = (
        f"Solid: this device's matmul rate per dtype ({entry.framework}, square n x n products: n=64 is 524 kFLOP, "
        f"n=512 268 MFLOP, n=4096 137 GFLOP), each the median of a few products; dashed: the model's training "
        f"steps at each size (FLOPs per step, achieved GFLOP/s)"
        + ("; small markers: the model's own matmul shapes (forward and backward, at every size of the study), "
           "each timed alone" if shapes else "")
        + ". Both axes log scales. A step is many smaller matmuls plus elementwise work, so it lies below the curve "
          "at its own FLOPs; where a 16-bit curve lies below float32's at the sizes of the step's matmuls, 16-bit "
          "cannot pay there." + "".join(f" {stop}." for stop in stops))


def _ratios(curve: dict, base: dict) -> list[tuple[int, float]]:
    """(n, the curve's rate over float32's) at every n both measured."""
    rates = dict(zip(base.n, base.gflops))
    return [(n, g / rates[n]) for n, g in zip(curve.n, curve.gflops) if rates.get(n)]


def _compare(dtype: str, curve: dict, base: dict) -> str:
    pairs = _ratios(curve, base)
    if not pairs:
        return f"{dtype}'s curve shares no size with float32's"
    stop = f" (measured up to n={curve.n[-1]}: {curve.stopped})" if curve.stopped else ""
    span = f"n={pairs[0][0]}" + (f" to {pairs[-1][0]}" if len(pairs) > 1 else "")
    last_n, last = pairs[-1]
    from_n = None  # the smallest n from which on every size is faster
    for n, r in reversed(pairs):
        if r < CURVE_PAYS:
            break
        from_n = (n, r)
    top = max(r for _, r in pairs)
    if from_n:
        n0, _ = from_n
        least = min(r for n, r in pairs if n >= n0)
        line = f"{dtype} matmuls reach at least {f.ratio(least)} float32's rate from n={n0} on"
        if last_n != n0:
            line += f" ({f.ratio(last)} at n={last_n})"
        below = [(n, r) for n, r in pairs if n < n0]
        if below:
            line += f", {f.ratio(below[-1][1])} at n={below[-1][0]}"
        return line + stop
    if top < CURVE_EMULATED:
        return (f"{dtype}'s reach at most {f.percent(top, 1)} of float32's rate at any size measured ({span}): "
                f"likely emulated, with no native {dtype} matmul here{stop}")
    if all(r < CURVE_PAYS for _, r in pairs):
        low = min(r for _, r in pairs)
        return (f"{dtype}'s are no faster than float32's at any size measured ({span}: {f.ratio(low)} to "
                f"{f.ratio(top)} its rate): likely no faster {dtype} matmul path here{stop}")
    faster = ", ".join(str(n) for n, r in pairs if r >= CURVE_PAYS)
    return (f"{dtype}'s are faster than float32's only at n={faster} (up to {f.ratio(top)}), not at n={last_n} "
            f"({f.ratio(last)}){stop}")


def curve_sentence(framework: str, curves: dict) -> str:
    """How each 16-bit dtype's matmuls compare with float32's across n on this device, in one sentence."""
    base = curves.get("float32")
    parts = []
    for dtype in CURVE_DTYPES[1:]:
        if dtype not in curves:
            continue
        if curves[dtype] is None:
            parts.append(f"{framework} has no {dtype} matmul kernel here")
        elif base:
            parts.append(_compare(dtype, curves[dtype], base))
    if not parts:
        return ""
    return f"On this device ({framework}'s square n x n matmuls), " + "; ".join(parts) + "."


def _equivalent(rate: float, curve: dict) -> int | None:
    """The smallest n whose matmul reaches `rate` on the curve; None: no size does."""
    return next((n for n, g in zip(curve.n, curve.gflops) if g >= rate), None)


def steps_sentence(cs: list[PooledRuns], precisions: list[str], curves: dict) -> str:
    """The model's achieved GFLOP/s per precision over the study's sizes, read against the curve of its compute
    dtype: the n at which a square matmul reaches the same rate here."""
    parts = []
    for p in precisions:
        rates = sorted(c.gflops for c in cs if c.precision == p and c.gflops)
        dtype = PEAK_DTYPES.get(p.partition(":")[0])
        curve = curves.get(dtype) if dtype else None
        if not rates or not curve:
            continue
        lo, hi = rates[0], rates[-1]
        part = f"{p} at {f.gflops(lo)}" + (f"-{f.gflops(hi)}" if f.gflops(hi) != f.gflops(lo) else "") + " GFLOP/s"
        a, b = _equivalent(lo, curve), _equivalent(hi, curve)
        top = f"at most {f.gflops(max(curve.gflops))} GFLOP/s"
        if a is None:
            part += f", above {dtype}'s whole curve ({top})"
        elif b is None:
            part += f": its slowest size a {dtype} matmul's rate at n={a}, its fastest above the whole curve ({top})"
        else:
            part += f", what {dtype} matmuls reach at n={a}" + (f" to {b}" if b != a else "")
        parts.append(part)
    if not parts:
        return ""
    return "The model's steps against the curve: " + "; ".join(parts) + "."


def _why_none(precision: str, setting_, failed: list[RunRecord], cell: PooledRuns | None,
              base: PooledRuns | None) -> str:
    if base is None and cell is not None:
        return "no fp32 run at this size"
    mine = [r for r in failed if r.precision == precision and r.batch_size == setting_.batch
            and r.width == setting_.width and r.tokens_per_sample == setting_.seq_len]
    if mine:
        return f"{mine[0].status}: {mine[0].reason or '-'}"
    return "not run at this size"


def _row(precision: str, p: Point, varies: list[str]) -> Row:
    r = p.speedup
    c, b = p.cell, p.fp32
    peak = c.efficiency if c else None
    return Row(precision, size_name(p, varies), _flops(p.flops), f.ms(b.median_ms) if b else "-",
               f.ms(c.median_ms) if c else "-", f.ratio(r.estimate) if r else "-", r.label if r else p.note,
               VERDICTS[p.decision], f.percent(p.memory_saved, 0, spaced=True) if p.memory_saved is not None else "-",
               f.gflops(c.gflops) if c and c.gflops else "-", f.gflops(b.gflops) if b and b.gflops else "-",
               f.percent(peak, 1, spaced=True) if peak is not None else "-",
               _matmul_cell(p.matmuls, c), _matmul_cell(p.fp32_matmuls, b))


def _rest(p: Point, lead: str, what: str = "") -> str:
    """What the step takes besides its matmuls timed alone, in the precision and in fp32; where the matmuls alone
    take longer than a whole step, the timings cannot split the step, and it says so instead."""
    own, base = p.matmuls, p.fp32_matmuls
    rest, fp32_rest = p.cell.median_ms - own.ms, p.fp32.median_ms - base.ms
    if rest <= 0 or fp32_rest <= 0:
        over = p.cell if rest <= 0 else p.fp32
        return (f"; but the matmuls timed alone take longer than the {over.precision} step itself "
                f"({f.percent((own if rest <= 0 else base).share_of(over.median_ms), 0)} of it: a framework that "
                f"overlaps or fuses them, or a machine too noisy to split the step this way)")
    return f"{lead} the rest of the step{what} takes {f.ms(rest)} ms against fp32's {f.ms(fp32_rest)} ms"


def _matmul_cell(t: MatmulTime | None, c: PooledRuns | None) -> str:
    """"1.2 (30%)": the step's matmuls timed alone, in ms, and their share of its step; "-" where not measured."""
    if t is None or c is None:
        return "-"
    return f"{f.ms(t.ms)} ({f.percent(t.share_of(c.median_ms), 0)})" + ("*" if t.untimed else "")


def _flops(flops: float | None) -> str:
    return f.flop_count(flops)


def _peaks(runs: list[RunRecord]) -> str:
    """The device's matmul peak per dtype, as the study's runs measured it (harness.run.peak)."""
    found = next((r.device_peak_gflops for r in runs if r.device_peak_gflops), None)
    if not found:
        return ""
    return ", ".join(f"{dtype} {f.gflops(v)}" if v else f"{dtype} no kernel" for dtype, v in found.items())


def _sentence(model: str, framework: str, s: Series, varies: list[str], cast_shares: dict) -> str:
    """One line per series, computed from its points: where it pays, or up to where it does not, and why below."""
    compared = [p for p in s.points if p.speedup]
    if not s.points:
        return ""
    head = f"{model} ({framework}): {s.precision}"
    largest = s.points[-1]
    if s.crossover is None:
        there = (f" (there {f.ratio(largest.speedup.estimate)}, {largest.speedup.label}: "
                 f"{VERDICTS[largest.decision]})" if largest.speedup else f" (there {largest.note})")
        return (f"{head}: crossover not reached up to {size_name(largest, varies)}{there}"
                + _why_not(s, largest) + ".")
    x = s.crossover
    line = (f"{head} pays from {size_name(x, varies)} on ({_flops(x.flops)} a step; {f.ratio(x.speedup.estimate)}, "
            f"{x.speedup.label})")
    if largest is not x:
        line += f", {f.ratio(largest.speedup.estimate)} at {size_name(largest, varies)}"
    below = [p for p in s.points if p.order() < x.order()]
    if not below:
        return line + f": at every size of the study" + ("" if len(compared) > 1 else " (one size)") + "."
    last = below[-1]
    verdict = (f"{VERDICTS[last.decision]} ({f.ratio(last.speedup.estimate)}, {last.speedup.label})"
               if last.speedup else last.note)
    line += f"; below that, at {size_name(last, varies)} it is {verdict}"
    return line + _why_below(s, last, cast_shares) + "."


def _why_below(s: Series, p: Point, cast_shares: dict) -> str:
    """What the records (and a profile, where one exists) say of the step below the crossover: the step's own
    matmuls timed alone first, then a profile's casts, then fp32's share of the device's peak."""
    c, b = p.cell, p.fp32
    own, base = p.matmuls, p.fp32_matmuls
    if b is not None and base is not None:
        line = f": at fp32, {base.clause(b.median_ms)}"
        if base.share_of(b.median_ms) < BUSY_SHARE:
            line += ", so the step is mostly other work (casts, dispatch, elementwise ops, the optimizer update)"
        if c is not None and own is not None:
            line += f"; at {s.precision}, {own.clause(c.median_ms)}"
            if p.matmul_speedup():
                line += f", {f.ratio(p.matmul_speedup())} fp32's matmul time" + _rest(p, ", while")
        return line
    if c is not None and p.sizes.get("width") is None:
        key = (c.model, c.framework, c.precision, c.batch_size, c.records[0].device)
        if key in cast_shares:
            return (f": the step is dominated by fixed costs: its profile at batch {c.batch_size} puts "
                    f"{f.percent(cast_shares[key], 0)} of the {s.precision} step in casts")
    if b is not None and b.gflops:
        eff = f", {f.percent(b.efficiency, 0)} of the device's float32 matmul peak" if b.efficiency else ""
        done = f"fp32 does {_flops(p.flops)} in {f.ms(b.median_ms)} ms there, {f.gflops(b.gflops)} GFLOP/s{eff}"
        if b.efficiency and b.efficiency >= BUSY_SHARE:  # its matmuls keep the device busy: no fixed-cost story
            return f": {done}, so its matmuls, not fixed per-step costs, fill that step"
        return (f": the step is likely dominated by fixed per-step costs (casts, dispatch, the optimizer update) "
                f"rather than matmuls: {done}")
    return ""


def _why_not(s: Series, p: Point) -> str:
    """Why no size pays: at the largest size, the step's own matmuls timed alone in 16-bit against float32 where
    the runs hold them (no faster: a larger step alone will not pay; faster: what else fills the step), else the
    device's matmul peak in the precision's compute dtype."""
    own, base, speedup = p.matmuls, p.fp32_matmuls, p.matmul_speedup()
    if speedup is not None and p.cell is not None and p.fp32 is not None:
        times = (f"; at the step's own matmul shapes, {own.dtype}'s products take {f.ms(own.ms)} ms against "
                 f"float32's {f.ms(base.ms)} ms ({f.ratio(speedup)})")
        if speedup < CURVE_PAYS:
            return times + f": {own.dtype} matmuls are no faster here at these shapes, so a larger step alone " \
                           f"will not pay"
        return times + _rest(p, ", while", " (casts, dispatch, elementwise ops, the optimizer update)")
    c = p.cell
    dtype = PEAK_DTYPES.get(s.precision.partition(":")[0])
    peaks = next((r.device_peak_gflops for r in (c.records if c else []) if r.device_peak_gflops),
                 None) or {}
    low, fp32 = peaks.get(dtype), peaks.get("float32")
    if dtype and dtype != "float32" and low and fp32 and low < fp32:
        return (f"; this device's {dtype} matmul peak ({f.gflops(low)} GFLOP/s) is below float32's "
                f"({f.gflops(fp32)}): {dtype} is likely emulated here, so a larger step alone will not pay")
    return ""
