"""A minimal plotting layer: charts written directly as small, self-contained SVG strings.

Pixel geometry, no dependencies. A Figure holds the elements in drawing order; an Axes maps data to a pixel box
through a linear or log Scale and draws lines, step lines, markers, whiskers, spans, bars and its axes; the
Figure adds titles and a legend. Everything a reader sees is a real <text>; nothing carries an id (hundreds of
these sit inline in one page) and no style leaks out (no <style>, no classes). Same input, same bytes.
"""
from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence

FONT = "system-ui,sans-serif"
TEXT_COLOUR = "#1d2329"
AXIS_COLOUR = "#6b7680"
GRID_COLOUR = "#e3e6e9"
FONT_SIZE = 11  # px; tick labels and legends a little smaller, titles larger
CHAR_WIDTH = 0.58  # of the font size: an average sans-serif character, for layout only


def esc(text) -> str:
    return html.escape(str(text), quote=True)


def num(value: float) -> str:
    """A pixel coordinate with one decimal, '.0' dropped (short, deterministic)."""
    s = f"{value:.1f}"
    if s.endswith(".0"):
        s = s[:-2]
    return "0" if s == "-0" else s


def text_width(text: str, size: float = FONT_SIZE) -> float:
    """Estimated rendered width in px (for margins and legend layout; errs on the wide side); of the widest
    line of a text of several."""
    return max(len(line) for line in text.split("\n")) * size * CHAR_WIDTH


def wrap(text: str, width: float, size: float = FONT_SIZE, most: int = 3) -> str:
    """The text in lines ("\n") of at most `width` px, broken at spaces (a longer word cut), `most` lines at
    most (the last cut short with an ellipsis)."""
    chars = max(int(width / (size * CHAR_WIDTH)), 4)
    lines: list[str] = []
    for word in text.split():
        while len(word) > chars:
            lines.append(word[:chars])
            word = word[chars:]
        if lines and len(lines[-1]) + 1 + len(word) <= chars:
            lines[-1] += " " + word
        else:
            lines.append(word)
    if len(lines) > most:
        lines = lines[:most]
        lines[-1] = lines[-1][:chars - 1] + "\u2026"
    return "\n".join(lines) or text


def finite(value) -> bool:
    """A real, finite number (a bool, a string or None is not)."""
    try:
        return value.__class__ is not bool and math.isfinite(value)
    except (TypeError, OverflowError):
        return False


# ---- ticks ------------------------------------------------------------------------------------------
_NICE = (1.0, 2.0, 2.5, 5.0, 10.0)


def _clean(value: float) -> float:
    """Drop float noise from a multiple of a round step (0.30000000000000004 -> 0.3)."""
    return float(f"{value:.12g}") + 0.0  # + 0.0: no -0.0


def nice_ticks(low: float, high: float, bins: int = 4, integer: bool = False) -> list[float]:
    """Evenly spaced round numbers (1, 2, 2.5, 5 x 10^k apart) inside [low, high], at most bins + 1 of them;
    with integer, steps of at least 1."""
    if not (finite(low) and finite(high)):
        return []
    if high < low:
        low, high = high, low
    if high == low:
        return [_clean(low)]
    raw = (high - low) / max(bins, 1)
    if not finite(raw):
        return [_clean(low), _clean(high)]
    exponent = math.floor(math.log10(raw))
    for e in (exponent, exponent + 1):
        for m in _NICE:
            step = m * 10.0**e
            if integer and step < 1:
                continue
            first, last = math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9)
            if math.ceil(high / step - 1e-9) - math.floor(low / step + 1e-9) <= bins:
                return [_clean(k * step) for k in range(first, last + 1)]
    return [_clean(low), _clean(high)]


def round_ticks(low: float, high: float) -> list[float]:
    """3 to 5 (at worst 7) evenly spaced round numbers inside a narrow [low, high]: the simplest step of 1, 5, 2
    or 2.5 x 10^k that gives 3 to 5 of them, nearest 4 (else the fewest of 3 or more)."""
    if not (finite(low) and finite(high)) or high <= low:
        return []
    exponent = math.floor(math.log10((high - low) / 4))
    found = []
    for e in range(exponent - 1, exponent + 2):
        for rank, m in enumerate((1.0, 5.0, 2.0, 2.5)):
            step = m * 10.0**e
            ticks = [_clean(k * step) for k in range(math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9) + 1)]
            ticks = [t for t in ticks if low <= t <= high]
            if len(ticks) >= 3:
                found.append((not 3 <= len(ticks) <= 5, abs(len(ticks) - 4) if len(ticks) <= 5 else len(ticks),
                              rank, ticks))
    return min(found)[3] if found else []


# ---- scales ------------------------------------------------------------------------------------------
class Scale:
    """Data -> pixels along one axis: linear, or log to a base (10 or 2). Invalid values (None, NaN, inf, and
    non-positive on a log scale) are not ok() and must be skipped by the caller."""

    def __init__(self, low: float, high: float, base: float | None = None):
        self.base = base
        t0, t1 = self.t(low), self.t(high)
        if not (finite(t0) and finite(t1)):
            t0, t1 = 0.0, 1.0
        t0, t1 = min(max(t0, -1e300), 1e300), min(max(t1, -1e300), 1e300)  # a span a float holds
        if t0 == t1:
            width = max(abs(t0) * 1e-6, 0.5)
            t0, t1 = t0 - width, t1 + width
        self.t0, self.t1 = t0, t1
        self.p0, self.p1 = 0.0, 1.0

    def t(self, value: float) -> float:
        if self.base:
            return math.log(value, self.base) if finite(value) and value > 0 else math.nan
        return float(value) if finite(value) else math.nan

    def ok(self, value) -> bool:
        return finite(value) and (not self.base or value > 0)

    def __call__(self, value: float) -> float:
        return self.p0 + (self.t(value) - self.t0) / (self.t1 - self.t0) * (self.p1 - self.p0)

    def px(self, value) -> float | None:
        """The pixel of a value, None where it is not ok() or lands absurdly far off the axis."""
        if not self.ok(value):
            return None
        px = self(value)
        return px if -1e9 < px < 1e9 else None

    def inside(self, value) -> bool:
        if self.px(value) is None:
            return False
        t = self.t(value)
        lo, hi = min(self.t0, self.t1), max(self.t0, self.t1)
        span = (hi - lo) * 1e-9
        return lo - span <= t <= hi + span

    def mapper(self):
        """A fast value -> px function for many values: None where the value is not ok()."""
        p0, t0, k, isfinite = self.p0, self.t0, (self.p1 - self.p0) / (self.t1 - self.t0), math.isfinite
        if self.base:
            log, scale = math.log, 1 / math.log(self.base)

            def to_px(value):
                try:
                    if value.__class__ is bool or not (isfinite(value) and value > 0):
                        return None
                except (TypeError, OverflowError):
                    return None
                px = p0 + (log(value) * scale - t0) * k
                return px if -1e9 < px < 1e9 else None
        else:
            def to_px(value):
                try:
                    if value.__class__ is bool or not isfinite(value):
                        return None
                except (TypeError, OverflowError):
                    return None
                px = p0 + (value - t0) * k
                return px if -1e9 < px < 1e9 else None
        return to_px


def padded(low: float, high: float, base: float | None = None, margin: float = 0.05) -> tuple[float, float]:
    """[low, high] widened by `margin` of its span on each side (in log space on a log scale); a single value
    gets a span of its own."""
    if base:
        t0, t1 = math.log(low, base), math.log(high, base)
        if t0 == t1:
            t0, t1 = t0 - 0.5, t1 + 0.5
        pad, limit = (t1 - t0) * margin, math.log(1e300, base)
        return base ** min(max(t0 - pad, -limit), limit), base ** min(max(t1 + pad, -limit), limit)
    if low == high:
        width = abs(low) * 0.1 or 1.0
        low, high = low - width, high + width
    pad = (high - low) * margin
    return (low - pad, high + pad) if finite(low - pad) and finite(high + pad) else (low, high)


# ---- geometry helpers ---------------------------------------------------------------------------------------
Point = tuple[float, float]


def _clip(a: Point, b: Point, box: tuple[float, float, float, float]) -> tuple[Point, Point] | None:
    """Liang-Barsky: the part of segment a-b inside box (x0, y0, x1, y1), or None."""
    x0, y0, x1, y1 = box
    dx, dy = b[0] - a[0], b[1] - a[1]
    u0, u1 = 0.0, 1.0
    for p, q in ((-dx, a[0] - x0), (dx, x1 - a[0]), (-dy, a[1] - y0), (dy, y1 - a[1])):
        if p == 0:
            if q < 0:
                return None
            continue
        u = q / p
        if p < 0:
            if u > u1:
                return None
            u0 = max(u0, u)
        else:
            if u < u0:
                return None
            u1 = min(u1, u)
    return (a[0] + u0 * dx, a[1] + u0 * dy), (a[0] + u1 * dx, a[1] + u1 * dy)


def lttb(points: list[Point], n: int) -> list[Point]:
    """Largest-triangle-three-buckets: n of the points (the first, the last and one per bucket between) that
    keep a dense line's look, its spikes included."""
    if n >= len(points) or n < 3:
        return points
    out = [points[0]]
    every = (len(points) - 2) / (n - 2)
    a = points[0]
    for i in range(n - 2):
        start, end = int(i * every) + 1, int((i + 1) * every) + 1
        following = points[end:min(int((i + 2) * every) + 1, len(points))] or points[-1:]
        cx = sum(p[0] for p in following) / len(following)
        cy = sum(p[1] for p in following) / len(following)
        best = max(points[start:end], key=lambda p: abs((a[0] - cx) * (p[1] - a[1]) - (a[0] - p[0]) * (cy - a[1])))
        out.append(best)
        a = best
    out.append(points[-1])
    return out


HALF = ' transform="scale(.5)"'  # data lines: path data in whole half-pixels (short integers), drawn at half size


def _pairs(values: list[int]) -> str:
    """Integers for path data, a space only where a minus sign does not already separate them."""
    out = []
    for v in values:
        if out and v >= 0:
            out.append(" ")
        out.append(str(v))
    return "".join(out)


def _simplify(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Repeated points dropped, and the middle of straight horizontal or vertical runs."""
    out: list[tuple[int, int]] = []
    for p in points:
        if out and p == out[-1]:
            continue
        if len(out) >= 2:
            (ax, ay), (bx, by) = out[-2], out[-1]
            if (ay == by == p[1] and (bx - ax) * (p[0] - bx) >= 0) or (ax == bx == p[0] and (by - ay) * (p[1] - by) >= 0):
                out[-1] = p  # extend the run
                continue
        out.append(p)
    return out


def _path(runs: Iterable[list[Point]], box, most: int | None = None) -> str:
    """Compact SVG path data for polylines (each run unbroken), clipped to box, in half pixels (for a path
    drawn with HALF): an absolute move, then relative lines. With `most`, a run of more points than that is
    thinned (lttb) to it."""
    d: list[str] = []
    for run in runs:
        if most and len(run) > most:
            run = lttb(run, most)
        pieces: list[list[Point]] = []
        for a, b in zip(run, run[1:]):
            clipped = _clip(a, b, box)
            if clipped is None:
                continue
            p, q = clipped
            if pieces and pieces[-1][-1] == p:
                pieces[-1].append(q)
            else:
                pieces.append([p, q])
        for piece in pieces:
            points = _simplify([(round(x * 2), round(y * 2)) for x, y in piece])
            if len(points) < 2:
                continue
            deltas = []
            for (ax, ay), (bx, by) in zip(points, points[1:]):
                deltas += (bx - ax, by - ay)
            d.append("M" + _pairs(list(points[0])) + "l" + _pairs(deltas))
    return "".join(d)


def _dash(dash: str | None, width: float) -> str:
    if not dash:
        return ""
    pattern = {"dashed": (3.7, 1.6), "dotted": (1, 1.65), "dashdot": (6.4, 1.6, 1, 1.6)}.get(dash)
    if pattern is None:
        return f' stroke-dasharray="{dash}"'
    return ' stroke-dasharray="' + " ".join(num(max(p * width, 1.0)) for p in pattern) + '"'


def marker_path(shape: str, x: float, y: float, size: float, colour: str) -> tuple[str, str]:
    """Path data and attributes of one filled marker (matplotlib's letters: o s D d ^ v < > P X + x p h H 8 * 1 2,
    anything else a circle; "+" and "x" are thin crosses, "1" and "2" three-pointed stars, down and up) centred at
    x, y, `size` px wide. A circle or a square is a zero-length stroke with a round or a square cap (a few bytes);
    the others are outlines."""
    r = size / 2
    if shape in ("o", "s") or shape not in ("D", "d", "^", "v", "<", ">", "P", "X", "+", "x", "p", "h", "H", "8",
                                            "*", "1", "2"):
        cap, width = ("square", size * 0.9) if shape == "s" else ("round", size)
        return (f"M{num(x)} {num(y)}h0",
                f' fill="none" stroke="{colour}" stroke-width="{num(width)}" stroke-linecap="{cap}"')
    fill = f' fill="{colour}"'
    if shape in ("D", "d"):  # a diamond; "d" a thin one
        s, w = r * 0.95, r * (0.95 if shape == "D" else 0.6)
        return f"M{num(x)} {num(y - s)}l{num(w)} {num(s)} {num(-w)} {num(s)} {num(-w)} {num(-s)}z", fill
    if shape in ("^", "v"):
        s, h = r * 1.05, r * 1.05 * (1 if shape == "^" else -1)
        return f"M{num(x)} {num(y - h)}l{num(s * 0.87)} {num(h * 1.5)}h{num(-s * 1.74)}z", fill
    if shape in ("<", ">"):
        s, h = r * 1.05, r * 1.05 * (1 if shape == "<" else -1)
        return f"M{num(x - h)} {num(y)}l{num(h * 1.5)} {num(s * 0.87)}v{num(-s * 1.74)}z", fill
    if shape in ("p", "h", "H", "8", "*", "1", "2"):  # regular pentagon (a corner up), hexagons (a corner at the
        # side, "H" at the top), octagon; five- and three-pointed stars
        n = {"p": 5, "h": 6, "H": 6, "8": 8, "*": 10, "1": 6, "2": 6}[shape]
        turn = {"p": -math.pi / 2, "*": -math.pi / 2, "H": -math.pi / 2, "8": math.pi / n, "1": math.pi / 2,
                "2": -math.pi / 2}.get(shape, 0.0)
        radii = [r * 1.1, r * 0.45] if shape == "*" else [r * 1.15, r * 0.35] if shape in ("1", "2") else [r]
        corners = [(x + radii[k % len(radii)] * math.cos(turn + 2 * math.pi * k / n),
                    y + radii[k % len(radii)] * math.sin(turn + 2 * math.pi * k / n)) for k in range(n)]
        return "M" + "L".join(f"{num(u)} {num(v)}" for u, v in corners) + "z", fill
    a, b = r, r / (3 if shape in ("P", "X") else 6)  # a plus of arm half-length a and half-width b ("+" thin; an
    # X: the same, turned 45 degrees)
    outline = [(b, a), (b, b), (a, b), (a, -b), (b, -b), (b, -a), (-b, -a), (-b, -b), (-a, -b), (-a, b), (-b, b),
               (-b, a)]
    if shape in ("X", "x"):
        c = math.sqrt(0.5)
        outline = [((u - v) * c, (u + v) * c) for u, v in outline]
    return "M" + "L".join(f"{num(x + u)} {num(y + v)}" for u, v in outline) + "z", fill


# ---- figure, axes, legend -------------------------------------------------------------------------------
# Layers, drawn bottom to top whatever the order of the calls; within one, in call order (grid, axis and text
# items sorted by their attributes, so that neighbours of one style merge into one <path> or one <g>).
SPAN, GRID, BAR, LINE, MARK, AXIS, TEXT = range(7)
_SORTED = (GRID, AXIS, TEXT)


def _attr(name: str, value) -> str:
    return "" if value is None else f' {name}="{value}"'


class Figure:
    """An SVG canvas of width x height px."""

    def __init__(self, width: float, height: float, title: str = ""):
        self.width, self.height, self.title = width, height, title
        self.items: list[tuple[int, str, str, str, bool]] = []  # (layer, "path" or "g", attributes, body, floats)

    def path(self, layer: int, d: str, attrs: str, floats: bool = False) -> None:
        """Path data in a layer; consecutive paths of the same attributes become one <path>. A floating one
        (a legend's swatch, which overlaps nothing) joins the first later path of its layer and attributes."""
        if d:
            self.items.append((layer, "path", attrs, d, floats))

    def element(self, layer: int, element: str, attrs: str = "") -> None:
        """An element in a layer; consecutive ones of the same attributes share one <g> carrying them."""
        self.items.append((layer, "g", attrs, element, False))

    def stroke(self, layer: int, d: str, colour: str, width: float = 1, dash: str | None = None,
               floats: bool = False, half: bool = False) -> None:
        """A stroked path; with half, its data is in half pixels (see _path)."""
        if half:
            width *= 2
        self.path(layer, d, f' fill="none" stroke="{colour}"{_width(width)}{_dash(dash, width)}'
                  + (HALF if half else ""), floats)

    def text(self, x: float, y: float, text: str, size: float | None = None, anchor: str = "start",
             colour: str | None = None, rotate: float | None = None, weight: str | None = None,
             middle: bool = False) -> None:
        """A text at x, y (the baseline; with middle, the vertical centre); "\n" breaks it into lines."""
        if not (finite(x) and finite(y)):
            return
        size = None if size == FONT_SIZE else size
        lines = str(text).split("\n")
        if middle:
            y += 0.35 * (size or FONT_SIZE) - (len(lines) - 1) * 0.6 * (size or FONT_SIZE)
        x, y = num(round(x)), num(round(y))
        turn = f' transform="rotate({num(rotate)} {x} {y})"' if rotate else ""
        attrs = (_attr("font-size", size and num(size)) + _attr("text-anchor", None if anchor == "start" else anchor)
                 + _attr("fill", colour) + _attr("font-weight", weight))
        body = esc(lines[0]) + "".join(f'<tspan x="{x}" dy="1.2em">{esc(line)}</tspan>' for line in lines[1:])
        self.element(TEXT, f'<text x="{x}" y="{y}"{turn}>{body}</text>', attrs)

    def axes(self, left: float, top: float, right: float, bottom: float, x: Scale, y: Scale) -> Axes:
        return Axes(self, (left, top, right, bottom), x, y)

    def legend(self, entries: Sequence[tuple[str, dict]], centre: float, top: float, width: float,
               size: float = 10) -> float:
        """Legend entries (label, style) in rows centred on `centre`, wrapped at `width`; returns the height
        used. Style: {"line": colour, "width", "dash", "marker", "colour", "whisker", "patch": colour,
        "opacity"}."""
        rows = legend_rows(entries, width, size)
        line = size * 1.6
        for i, row in enumerate(rows):
            x = centre - sum(w for _, w in row) / 2
            y = top + i * line + line / 2
            for (label, style), w in row:
                self._swatch(x, y, style)
                self.text(x + 26, y, label, size=size, middle=True)
                x += w
        return len(rows) * line

    def _swatch(self, x: float, y: float, style: dict) -> None:
        """A legend's sample: drawn with the same attributes as what it stands for, so that it joins it."""
        if style.get("patch"):
            self.path(BAR if style.get("bar") else SPAN, f"M{num(x)} {num(y - 5)}h22v10h-22z",
                      _attr("fill", style["patch"]) + _attr("fill-opacity", style.get("opacity")), floats=True)
        colour = style.get("line") or style.get("colour") or TEXT_COLOUR
        if style.get("whisker"):  # like Axes.whiskers_x
            self.stroke(LINE, f"M{num(x)} {num(y - 3)}v6m0-3h22m0-3v6", colour, style.get("width", 1), floats=True)
        elif style.get("line"):  # like Axes.line and Axes.step
            self.stroke(LINE, f"M{round(x * 2)} {round(y * 2)}h44", colour, style.get("width", 1), style.get("dash"),
                        floats=True, half=True)
        if style.get("marker"):
            self.path(MARK, *marker_path(style["marker"], x + 11, y, style.get("size", 7), colour), floats=True)

    def render(self) -> str:
        w, h = num(self.width), num(self.height)
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
               f'role="img" font-family="{FONT}" font-size="{FONT_SIZE}" fill="{TEXT_COLOUR}" stroke-linejoin="round">']
        if self.title:
            out.append(f"<title>{esc(self.title)}</title>")
        items = sorted(self.items, key=lambda i: (i[0], i[2] if i[0] in _SORTED else ""))
        bodies = [item[3] for item in items]
        first = {}
        for i, (layer, kind, attrs, body, floats) in enumerate(items):
            if not floats:
                first.setdefault((layer, kind, attrs), i)
        for i, (layer, kind, attrs, body, floats) in enumerate(items):
            target = first.get((layer, kind, attrs))
            if floats and target is not None and target > i:
                bodies[target] = body + bodies[target]
                bodies[i] = ""
        merged: list[list] = []
        for (layer, kind, attrs, _, _), body in zip(items, bodies):
            if not body:
                continue
            if merged and merged[-1][0] == kind and merged[-1][1] == attrs:
                merged[-1][2].append(body)
            else:
                merged.append([kind, attrs, [body]])
        for kind, attrs, bodies in merged:
            if kind == "path":
                out.append(f'<path d="{"".join(bodies)}"{attrs}/>')
            elif len(bodies) == 1 and attrs:  # one element: its group's attributes on itself
                tag_end = bodies[0].index(" ")
                out.append(bodies[0][:tag_end] + attrs + bodies[0][tag_end:])
            else:
                out.append(f"<g{attrs}>" + "".join(bodies) + "</g>" if attrs else "".join(bodies))
        out.append("</svg>")
        return "".join(out)


def _width(width: float) -> str:
    return "" if width == 1 else f' stroke-width="{num(width)}"'


def legend_rows(entries: Sequence[tuple[str, dict]], width: float, size: float = 10) -> list[list]:
    rows: list[list] = []
    used = width + 1
    for label, style in entries:
        w = 26 + text_width(label, size) + 14
        if used + w > width and (not rows or rows[-1]):
            rows.append([])
            used = 0.0
        rows[-1].append(((label, style), w))
        used += w
    return rows


def legend_height(entries: Sequence[tuple[str, dict]], width: float, size: float = 10) -> float:
    return len(legend_rows(entries, width, size)) * size * 1.6


class Axes:
    """A plot box (left, top, right, bottom in px) with an x and a y Scale mapped onto it."""

    def __init__(self, fig: Figure, box: tuple[float, float, float, float], x: Scale, y: Scale):
        self.fig, self.box, self.x, self.y = fig, box, x, y
        left, top, right, bottom = box
        x.p0, x.p1 = left, right
        y.p0, y.p1 = bottom, top

    def twin(self, y: Scale) -> Axes:
        """The same box and x scale with another y scale (for a second y axis on the right)."""
        return Axes(self.fig, self.box, self.x, y)

    def _points(self, xs: Sequence, ys: Sequence) -> list[list[Point]]:
        """Runs of consecutive valid points, in px; an invalid x or y breaks the line."""
        fx, fy = self.x.mapper(), self.y.mapper()
        runs: list[list[Point]] = [[]]
        for x, y in zip(xs, ys):
            px, py = fx(x), fy(y)
            if px is not None and py is not None:
                runs[-1].append((px, py))
            elif runs[-1]:
                runs.append([])
        return [r for r in runs if r]

    def _clip_box(self, width: float = 0) -> tuple[float, float, float, float]:
        left, top, right, bottom = self.box
        return left, top - width, right, bottom + width

    def line(self, xs: Sequence, ys: Sequence, colour: str, width: float = 1.2, dash: str | None = None) -> None:
        """A polyline through (x, y); None, NaN, inf (and <= 0 on a log scale) leave a gap (a lone point between
        gaps draws nothing); a dense line is thinned to a vertex every 3 px or so."""
        most = max(int(abs(self.box[2] - self.box[0]) / 3), 16)
        self.fig.stroke(LINE, _path(self._points(xs, ys), self._clip_box(width), most), colour, width, dash,
                        half=True)

    def step(self, xs: Sequence, ys: Sequence, colour: str, width: float = 1.2, dash: str | None = None) -> None:
        """A step line, 'post': y[i] holds from x[i] to x[i+1]; an invalid y leaves a gap from its x."""
        fx, fy = self.x.mapper(), self.y.mapper()
        runs: list[list[Point]] = [[]]
        prev = None
        for x, y in zip(xs, ys):
            px = fx(x)
            if px is None:
                prev = None
                if runs[-1]:
                    runs.append([])
                continue
            if prev is not None:
                runs[-1].append((px, prev))
            py = fy(y)
            if py is not None:
                prev = py
                runs[-1].append((px, prev))
            else:
                prev = None
                if runs[-1]:
                    runs.append([])
        self.fig.stroke(LINE, _path([r for r in runs if r], self._clip_box(width)), colour, width, dash, half=True)

    def markers(self, xs: Sequence, ys: Sequence, shape: str, colour: str, size: float = 7) -> None:
        for x, y in zip(xs, ys):
            if self.x.inside(x) and self.y.inside(y):
                self.fig.path(MARK, *marker_path(shape, self.x(x), self.y(y), size, colour))

    def whiskers_x(self, ys: Sequence, lows: Sequence, highs: Sequence, colour: str, width: float = 1,
                   cap: float = 3) -> None:
        """Horizontal error bars at each y from low to high, with end caps (skipped where an end is invalid)."""
        left, top, right, bottom = self.box
        d = []
        for y, lo, hi in zip(ys, lows, highs):
            if not (self.y.inside(y) and self.x.ok(lo) and self.x.ok(hi)):
                continue
            a, b = sorted((self.x(lo), self.x(hi)))
            py = self.y(y)
            caps = (left <= a, b <= right)
            a, b = max(a, left), min(b, right)
            if a > b:
                continue
            d.append(f"M{num(a)} {num(py - cap if caps[0] else py)}" + (f"v{num(2 * cap)}m0{num(-cap)}" if caps[0] else "")
                     + f"H{num(b)}" + (f"m0{num(-cap)}v{num(2 * cap)}" if caps[1] else ""))
        self.fig.stroke(LINE, "".join(d), colour, width)

    def vspan(self, x0: float, x1: float, colour: str, opacity: float) -> None:
        """A shaded band across the plot between x0 and x1 (clipped to the box)."""
        if not (self.x.ok(x0) and self.x.ok(x1)):
            return
        left, top, right, bottom = self.box
        a, b = sorted((self.x(x0), self.x(x1)))
        a, b = max(a, left), min(b, right)
        if b > a:
            self.fig.path(SPAN, f"M{num(a)} {num(top)}H{num(b)}V{num(bottom)}H{num(a)}z",
                          _attr("fill", colour) + _attr("fill-opacity", opacity))

    def vline(self, x: float, colour: str, width: float = 1, dash: str | None = None) -> None:
        if self.x.inside(x):
            self.fig.stroke(LINE, f"M{num(self.x(x))} {num(self.box[1])}V{num(self.box[3])}", colour, width, dash)

    def hline(self, y: float, colour: str, width: float = 1, dash: str | None = None) -> None:
        if self.y.inside(y):
            self.fig.stroke(LINE, f"M{num(self.box[0])} {num(self.y(y))}H{num(self.box[2])}", colour, width, dash)

    def bars(self, xs: Sequence, heights: Sequence, width: float, colour: str, opacity: float | None = None) -> None:
        """Vertical bars of data width `width` centred on xs, from 0 (or the axis' bottom) up to each height."""
        left, top, right, bottom = self.box
        base = min(max(self.y(0), top), bottom) if self.y.ok(0) else bottom
        for x, h in zip(xs, heights):
            if not (self.x.ok(x) and self.y.ok(h) and self.x.ok(x - width / 2) and self.x.ok(x + width / 2)):
                continue
            a, b = sorted((self.x(x - width / 2), self.x(x + width / 2)))
            a, b = max(a, left), min(b, right)
            y0, y1 = sorted((min(max(self.y(h), top), bottom), base))
            if b > a and y1 > y0:
                self.fig.path(BAR, f"M{num(a)} {num(y0)}H{num(b)}V{num(y1)}H{num(a)}z",
                              _attr("fill", colour) + _attr("fill-opacity", opacity))

    def grid(self, xticks: Sequence[float] = (), yticks: Sequence[float] = (), colour: str = GRID_COLOUR) -> None:
        left, top, right, bottom = self.box
        d = [f"M{num(self.x(t))} {num(top)}V{num(bottom)}" for t in xticks if self.x.inside(t)]
        d += [f"M{num(left)} {num(self.y(t))}H{num(right)}" for t in yticks if self.y.inside(t)]
        self.fig.stroke(GRID, "".join(d), colour, 0.8)

    def xaxis(self, ticks: Sequence[float], labels: Sequence[str] | None = None, label: str = "",
              rotate: bool = False, size: float = 10) -> None:
        """The bottom spine, tick marks and labels (at each tick, skipped outside the range) and an axis label
        under them; rotate turns the tick labels 45 degrees."""
        left, top, right, bottom = self.box
        labels = labels if labels is not None else [f"{t:g}" for t in ticks]
        marks, deepest = [], 0.0
        for t, text in zip(ticks, labels):
            if not self.x.inside(t):
                continue
            px = self.x(t)
            marks.append(f"M{num(px)} {num(bottom)}v4")
            if rotate:
                self.fig.text(px + 3, bottom + 12, text, size=size, anchor="end", rotate=-45)
                deepest = max(deepest, 8 + text_width(text, size) * 0.71 + size * 0.7)
            else:
                self.fig.text(px, bottom + 6 + size, text, size=size, anchor="middle")
                deepest = max(deepest, 6 + size)
        self.fig.stroke(AXIS, f"M{num(left)} {num(bottom)}H{num(right)}" + "".join(marks), AXIS_COLOUR)
        if label:  # centred under the plot, or as near as the figure's edges allow
            half = text_width(label) / 2 + 4
            centre = min(max((left + right) / 2, half), self.fig.width - half)
            self.fig.text(centre, bottom + deepest + FONT_SIZE + 6, label, anchor="middle")

    def yaxis(self, ticks: Sequence[float], labels: Sequence[str] | None = None, label: str = "",
              right: bool = False, show_labels: bool = True, size: float = 10) -> None:
        """The left (or right) spine, tick marks and labels, and a rotated axis label beside them."""
        left, top, right_edge, bottom = self.box
        edge = right_edge if right else left
        sign = 1 if right else -1
        labels = labels if labels is not None else [f"{t:g}" for t in ticks]
        marks, widest = [], 0.0
        for t, text in zip(ticks, labels):
            if not self.y.inside(t):
                continue
            py = self.y(t)
            marks.append(f"M{num(edge)} {num(py)}h{sign * 4}")
            if show_labels:
                self.fig.text(edge + sign * 7, py, text, size=size, anchor="start" if right else "end", middle=True)
                widest = max(widest, text_width(text, size))
        self.fig.stroke(AXIS, f"M{num(edge)} {num(top)}V{num(bottom)}" + "".join(marks), AXIS_COLOUR)
        if label:
            x = edge + sign * (7 + widest + 8 + (FONT_SIZE if right else 0))
            self.fig.text(x, (top + bottom) / 2, label, anchor="middle", rotate=-90)  # reads upwards, both sides
