"""Every figure the report prints, formatted once: milliseconds, plain numbers, percents and percentage points,
speed-up ratios, factors, MB, GFLOP/s, loss scales. The HTML page, the Markdown summary and the prose rules
(explain, answer, pure16, profile, accuracy) all take their figures from here, so a figure reads the same
wherever it appears. A missing figure (None, NaN) is "-".

Speed-up intervals are worded by harness.stats.Ratio.label, beside the statistics that define them.
"""
from __future__ import annotations

import math

MISSING = "-"


def missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def ms(value) -> str:
    """Milliseconds with three significant digits below 100, whole numbers (with thousands separators) above."""
    if missing(value):
        return MISSING
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def number(value, digits: int = 2, suffix: str = "") -> str:
    """A fixed number of decimals, thousands separated: 12,345.68."""
    if missing(value):
        return MISSING
    return f"{value:,.{digits}f}{suffix}"


def signed(value, digits: int = 4) -> str:
    """A signed number with a fixed number of decimals: "+0.0123" (a bound of an interval of loss changes)."""
    return MISSING if missing(value) else f"{value:+,.{digits}f}"


def nats(delta, digits: int = 4) -> str:
    """A change of loss (cross-entropy, natural log) in signed nats: "+0.0123 nats"."""
    return MISSING if missing(delta) else f"{signed(delta, digits)} nats"


def number_span(low, high, digits: int = 2) -> str:
    """Two numbers as one span: "2.1040-2.1210"; one number where they read the same."""
    a, b = number(low, digits), number(high, digits)
    return a if a == b else f"{a}-{b}"


def significant(value, digits: int = 3) -> str:
    """`digits` significant digits: 0.0123, 4.57, 1.23e+03."""
    return MISSING if missing(value) else f"{value:.{digits}g}"


def mb(value, digits: int = 1) -> str:
    """Megabytes with `digits` decimals."""
    return number(value, digits)


def percent(share, digits: int = 1, spaced: bool = False) -> str:
    """A share (0.123) as a percent: "12.3%", or "12.3 %" spaced (the tables' columns)."""
    if missing(share):
        return MISSING
    return f"{100 * share:,.{digits}f} %" if spaced else f"{share:.{digits}%}"


def percent_range(low: float, high: float, digits: int = 0) -> str:
    """Two shares as one percent ("12%") where they read the same, else a range ("12%-15%")."""
    a, b = percent(low, digits), percent(high, digits)
    return a if a == b else f"{a}-{b}"


def percent_span(low: float, high: float, digits: int = 1) -> str:
    """Two shares as one span of percents: "91.2-92.0%"."""
    return f"{100 * low:.{digits}f}-{percent(high, digits)}"


def points(delta, digits: int = 1) -> str:
    """An accuracy change (a difference of shares) in signed percentage points: "+1.2 pt"."""
    return MISSING if missing(delta) else f"{100 * delta:+.{digits}f} pt"


def percent_number(share, digits: int = 1, signed: bool = False) -> str:
    """A share's percent figure without its unit: "5", or "+1.2" signed (a bound of an interval of points)."""
    return f"{100 * share:+.{digits}f}" if signed else f"{100 * share:.{digits}f}"


def ratio(value) -> str:
    """A speed-up against fp32 with no direction claimed: "x1.23"."""
    return f"x{value:.2f}"


def faster(value) -> str:
    """A decided speed-up in words: "1.23x faster" (value >= 1) or "1.23x slower"."""
    return f"{value:.2f}x faster" if value >= 1 else f"{1 / value:.2f}x slower"


def times_slower(value) -> str:
    """A large slow-down, whole: value 0.05 -> "20x slower"."""
    return f"{1 / value:.0f}x slower"


def factor(value) -> str:
    """A growth factor: "1.5x", "12x" (one decimal below 10)."""
    if missing(value):
        return MISSING
    return f"{value:.1f}x" if value < 10 else f"{value:.0f}x"


def rough(value) -> str:
    """Two significant digits: a ratio of peaks, a memory ratio (0.12, 1.5)."""
    return f"{value:.2g}"


def gflops(value) -> str:
    """GFLOP/s: whole above 10, two significant digits below."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def mflop(flops) -> str:
    """FLOPs as whole MFLOP."""
    return f"{flops / 1e6:.0f}"


def flop_count(flops) -> str:
    """Work per step: "39 MFLOP", "2.5 GFLOP" (three significant digits)."""
    if missing(flops):
        return MISSING
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= size:
            return f"{flops / size:.3g} {unit}"
    return f"{flops:.0f} FLOP"


def plain(value) -> str:
    """The shortest form of a number: 1e-04, 0.5, 65536."""
    return f"{value:g}"


def power_of_two(exponent) -> str:
    """A loss scale given by its exponent: "2^16"."""
    return f"2^{exponent:g}"


def scale(value) -> str:
    """A loss scale: "2^16" where it is a power of two, else its shortest form."""
    exp = math.log2(value) if value > 0 else None
    return f"2^{exp:.0f}" if exp is not None and exp == int(exp) else plain(value)


def kib_of_bits(bits) -> str:
    """A size given in bits, in KiB with one decimal: "33.0 KiB"."""
    return MISSING if missing(bits) else f"{bits / 8 / 1024:,.1f} KiB"


def count(value) -> str:
    """A whole count with thousands separators: "8,448"."""
    return MISSING if missing(value) else f"{value:,}"
