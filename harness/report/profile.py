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

from dataclasses import dataclass, field

from harness.identity import cell_key, describe, varying
from harness.records import Profile, ProfileRecord
from harness.report import charts
from harness.report import format as f
from harness.run.profile import COVERAGE_TOLERANCE

GROUPS = {"conv2d": "convolutions", "dense": "dense layers", "batchnorm": "normalisation",
          "layernorm": "normalisation", "maxpool2d": "pooling", "avgpool2d": "pooling",
          "global_avgpool2d": "pooling", "relu": "activations", "gelu": "activations", "tanh": "activations",
          "sigmoid": "activations", "softmax": "activations"}  # the rest (flatten, dropout, residual adds): "other layers"
PART_NAMES = {"casts": "casts", "loss": "loss", "update": "optimizer update", "loss_scale": "loss scaling",
              "runtime": "runtime dispatch"}
ORDER = [*dict.fromkeys(GROUPS.values()), "other layers", *PART_NAMES.values(), "other"]  # the chart's segments
GROWN = 3  # layers named per (framework, 16-bit precision)


def latest(profiles: list[ProfileRecord]) -> dict[tuple, ProfileRecord]:
    """The last ok profile of each cell key (model, framework, setting, precision, loss-scale setting): a profile
    is one run, rerun to replace it."""
    out = {}
    for r in profiles:
        if r.status == "ok" and r.profile is not None:
            out[cell_key(r.written)] = r
    return out


def names(found: dict[tuple, ProfileRecord]) -> dict[tuple, str]:
    """Per profile key, its framework named with what differs between that framework's settings here (and the
    loss-scale setting where it varies), as the timed cells are named."""
    by_framework: dict[str, set] = {}
    scales: dict[tuple, set] = {}
    for model, framework, setting_, precision, scale in found:
        by_framework.setdefault(framework, set()).add(setting_)
        scales.setdefault((model, framework, setting_, precision), set()).add(scale)
    return {k: k[1] + describe(k[2], varying(by_framework[k[1]]))
            + (f" (loss scale {k[4]})" if len(scales[k[:4]]) > 1 else "") for k in found}


def breakdown(p: Profile) -> list[tuple[str, float]]:
    """(group, ms per step) in the chart's order: layer groups, then the parts, then what no op accounts for."""
    groups: dict[str, float] = {}
    for layer in p.layers:
        group = GROUPS.get(layer.type, "other layers")
        groups[group] = groups.get(group, 0.0) + layer.forward_ms + layer.backward_ms
    out = [(g, groups[g]) for g in ORDER if groups.get(g)]
    out += [(PART_NAMES[name], ms) for name, ms in p.parts.items() if name in PART_NAMES and ms > 0]
    if p.other_ms > 0:
        out.append(("other", p.other_ms))
    return out


@dataclass(frozen=True)
class Grown:
    """A layer's pass (forward or backward) that took longer in a 16-bit profile than in fp32's."""
    label: str
    phase: str
    ms: float
    fp32_ms: float
    added_ms: float
    share: float | None  # of the 16-bit step
    factor: float | None  # its 16-bit time over its fp32 time
    compute: str | None  # the dtype it computed in


def grown(p16: Profile, p32: Profile, most: int = GROWN) -> list[Grown]:
    """The layers (and pass: forward or backward) whose time grew most from fp32, by milliseconds added."""
    base = {layer.path: layer for layer in p32.layers}
    step = p16.step_mean_ms
    rows = []
    for layer in p16.layers:
        before = base.get(layer.path)
        for phase in ("forward", "backward"):
            ms16 = getattr(layer, f"{phase}_ms")
            ms32 = getattr(before, f"{phase}_ms") if before else 0.0
            if ms16 > ms32:
                rows.append(Grown(layer.label, phase, ms16, ms32, ms16 - ms32, ms16 / step if step else None,
                                  ms16 / ms32 if ms32 > 0 else None, layer.compute))
    return sorted(rows, key=lambda row: -row.added_ms)[:most]


def citation(model: str, framework: str, precision: str, p16: Profile, p32: Profile) -> str:
    """One sentence for the Why section: what the profile says made this precision slower than fp32."""
    rows = grown(p16, p32, 1)
    step16, step32 = p16.step_mean_ms, p32.step_mean_ms
    casts = p16.casts_ms / step16 if step16 else 0.0
    head = (f"{framework} {precision} ({model}), profiled: {f.significant(step16)} ms per step against fp32's "
            f"{f.significant(step32)} ms")
    if not rows:
        return f"{head}; no layer took longer than in fp32; casts take {f.percent(casts, 0)} of the step"
    top = rows[0]
    return (f"{head}; layer {top.label} {top.phase} takes {f.percent(top.share, 0)} of the step, "
            f"{f.factor(top.factor)} its fp32 time ({f.significant(top.ms)} vs {f.significant(top.fp32_ms)} "
            f"ms, computing in {top.compute or '-'}); casts take {f.percent(casts, 0)}")


@dataclass(frozen=True)
class CastRow:
    label: str
    cells: list[str]  # per column, the dtype the layer computed in ("-": no op of it ran there)
    differs: bool


@dataclass(frozen=True)
class CastMap:
    """One precision's layers x frameworks: the dtype each layer computed in; `uniform` where it was one."""
    precision: str
    columns: list[str]
    rows: list[CastRow]
    uniform: str | None


def cast_maps(model: str, found: dict[tuple, ProfileRecord], named: dict[tuple, str]) -> list[CastMap]:
    """Per precision profiled for `model`: layers x frameworks (each setting a column of its own), the dtype each
    layer computed in, with the rows where frameworks differ marked."""
    out = []
    precisions = sorted({k[3] for k in found if k[0] == model}, key=charts._order)
    for precision in precisions:
        keys = sorted((k for k in found if k[0] == model and k[3] == precision), key=lambda k: named[k])
        columns = [named[k] for k in keys]
        layers = [{layer.path: layer for layer in found[k].profile.layers} for k in keys]
        paths = list(dict.fromkeys(path for column in layers for path in column))
        rows = []
        for path in paths:
            cells = [column[path].compute if path in column else None for column in layers]
            if not any(cells):
                continue  # a layer no framework ran an op for (a flatten that is a view)
            label = next(column[path].label for column in layers if path in column)
            rows.append(CastRow(label, [c or "-" for c in cells], len({c for c in cells if c}) > 1))
        uniform = {c for row in rows for c in row.cells if c != "-"}
        out.append(CastMap(precision, columns, rows, next(iter(uniform)) if len(uniform) == 1 else None))
    return out


@dataclass(frozen=True)
class Bar:
    """One profile's step, by the chart's segments (breakdown)."""
    label: str
    segments: list[tuple[str, float]]
    overlap: float  # ms by which its ops' sum exceeds the step (they overlapped in time); 0 where they did not


@dataclass(frozen=True)
class Growth:
    """A 16-bit profile against the fp32 profile of its setting: the layers that grew, and the Why line it cites."""
    framework: str
    precision: str
    step_ms: float
    batch: int | None
    device: str | None
    fp32_step_ms: float
    casts: float  # the share of its step in casts
    rows: list[Grown]
    citation: str
    cites: tuple  # (model, framework, precision, batch size, device): the timed comparison it explains


@dataclass(frozen=True)
class ProfileEntry:
    """One model's profiles."""
    model: str
    bars: list[Bar]
    growth: list[Growth]
    cast_maps: list[CastMap]
    steps: int
    batch: str
    tools: list[str]
    notes: list[str]
    coverage: dict[str, float | None]  # per profile, the share of the step its ops account for


def profile_view(profiles: list[ProfileRecord]) -> list[ProfileEntry]:
    found = latest(profiles)
    named = names(found)
    entries = []
    for model in sorted({k[0] for k in found}):
        mine = {k: r for k, r in found.items() if k[0] == model}
        fp32: dict[tuple, ProfileRecord] = {}  # per (framework, setting): its first fp32 profile
        for k, r in mine.items():
            if k[3] == "fp32":
                fp32.setdefault(k[1:3], r)
        bars, growth = [], []
        for k, r in sorted(mine.items(), key=lambda kv: (named[kv[0]], charts._order(kv[0][3]))):
            p, framework, precision = r.profile, k[1], k[3]
            bars.append(Bar(f"{named[k]} {precision}", breakdown(p), -p.other_ms if p.other_ms < 0 else 0.0))
            # the fp32 profile of the same setting: another batch size, device or variant measures another thing
            base = fp32.get(k[1:3])
            if precision != "fp32" and base is not None:
                growth.append(Growth(named[k], precision, p.step_mean_ms, r.batch_size, r.device,
                                     base.profile.step_mean_ms, p.casts_ms / p.step_mean_ms, grown(p, base.profile),
                                     citation(model, framework, precision, p, base.profile),
                                     (model, framework, precision, r.batch_size, r.device)))
        batches = sorted({r.batch_size for r in mine.values()}, key=str)
        entries.append(ProfileEntry(model, bars, growth, cast_maps(model, found, named),
                                    next(iter(mine.values())).profile.steps, ", ".join(map(str, batches)),
                                    sorted({f"{k[1]}: {r.profile.tool}" for k, r in mine.items()}),
                                    sorted({f"{k[1]}: {r.profile.note}" for k, r in mine.items() if r.profile.note}),
                                    {f"{named[k]} {k[3]}": r.profile.coverage for k, r in mine.items()}))
    return entries


@dataclass(frozen=True)
class GrownRow:
    """A Grown layer as the page shows it."""
    label: str
    phase: str
    ms: str  # "its 16-bit ms (its fp32 ms)"
    factor: str
    share: str
    compute: str


@dataclass(frozen=True)
class GrowthRows:
    """A Growth as the page shows it."""
    framework: str
    precision: str
    casts: str
    step: str  # "its step ms (fp32's)"
    citation: str
    rows: list[GrownRow]


@dataclass(frozen=True)
class Differing:
    """A precision's layers that frameworks computed in different dtypes, for the Markdown summary."""
    precision: str
    columns: list[str]
    layers: list[str]


@dataclass(frozen=True)
class ProfileTable:
    """A ProfileEntry as the page shows it (templates/_profile.*.j2): its figures formatted and its chart drawn."""
    model: str
    steps: int
    batch: str
    tools: list[str]
    notes: list[str]
    cast_maps: list[CastMap]
    chart: str  # SVG markup (svg.py escapes its text), "" without charts
    overlaps: list[str]
    growth: list[GrowthRows]
    differing: list[Differing]
    low: list[str] = field(default_factory=list)  # profiles whose ops account for too little or too much of the step


@dataclass(frozen=True)
class ProfileSection:
    """The section as data: `entries` (profile_view), `citations` for the Why section, and `shown`: the
    entries as the page shows them."""
    entries: list[ProfileEntry]
    citations: dict[tuple, str]
    shown: list[ProfileTable]
    coverage_low: str = f.percent(1 - COVERAGE_TOLERANCE, 0)
    coverage_high: str = f.percent(1 + COVERAGE_TOLERANCE, 0)


def profile_section(profiles: list[ProfileRecord], charts_on: bool = True) -> ProfileSection:
    """The section; empty (no entries, nothing shown) without an ok profile."""
    entries = profile_view(profiles or [])
    citations = {g.cites: g.citation for e in entries for g in e.growth}
    return ProfileSection(entries, citations, [_table(e, charts_on) for e in entries])


def _table(entry: ProfileEntry, charts_on: bool) -> ProfileTable:
    from markupsafe import Markup

    chart = charts.time_breakdown([{"label": b.label, "segments": b.segments} for b in entry.bars], ORDER,
                                  entry.model + ": where a training step goes") if charts_on else ""
    return ProfileTable(
        entry.model, entry.steps, entry.batch, entry.tools, entry.notes, entry.cast_maps,
        Markup(chart),  # svg.py escapes the chart's text
        [f"{b.label} ({f.ms(b.overlap)} ms)" for b in entry.bars if b.overlap > 0],
        [GrowthRows(g.framework, g.precision, f.percent(g.casts, 0), f"{f.ms(g.step_ms)} ({f.ms(g.fp32_step_ms)})",
                    g.citation, [GrownRow(row.label, row.phase, f"{f.ms(row.ms)} ({f.ms(row.fp32_ms)})",
                                          f.factor(row.factor), f.percent(row.share, 0), row.compute or "-")
                                 for row in g.rows])
         for g in entry.growth],
        [Differing(cmap.precision, cmap.columns, [row.label for row in cmap.rows if row.differs])
         for cmap in entry.cast_maps if any(row.differs for row in cmap.rows)],
        [f"{name} {f.percent(c, 0)}" for name, c in sorted(entry.coverage.items())
         if isinstance(c, (int, float)) and abs(c - 1) > COVERAGE_TOLERANCE])
