"""FP8, the rule written once: the two formats, the saturating cast with rounding to nearest even, and the
per-tensor scaling recipes (Transformer Engine's "current" and "delayed" scaling), as a numpy reference, and as
the same arithmetic (held to the reference bit for bit through numpy's table) against a table of elementwise primitives
(`quantize_with(ops, ...)`, the same table harness.rounding's rules use) that an adapter fills for its framework.

The formats (OCP FP8; NVIDIA Hopper and Ada): e4m3 is the "fn" variant, with no infinities: largest finite 448
(1.75 x 2^8), smallest normal 2^-6, smallest subnormal 2^-9; e5m2: largest finite 57344 (1.75 x 2^15), smallest
normal 2^-14, smallest subnormal 2^-16. A value is cast by rounding its magnitude to the nearest point of the grid,
ties to the even point, the grid's gap at |x| in [2^e, 2^(e+1)) being 2^(max(e, emin) - mantissa bits), and
magnitudes beyond the largest finite value saturate to it (training recipes clip rather than overflow: a cast
to e4m3fn would give NaN, to e5m2 infinity). NaN stays NaN, infinities saturate, the sign is kept (-0 too).

The recipes give each tensor a scale s, a power of two: the tensor is multiplied by s, cast, and divided by s
again (dequantized) before its matmul, whose products accumulate in float32. A power of two leaves the scaling
itself exact, so only the cast rounds, and every framework's emulation can agree bit for bit.
- current: s = 2^(floor(log2(max / amax)) - margin), amax this tensor's largest magnitude now;
- delayed:N: the same from the largest amax of the last N training steps' tensors at this place (Transformer
  Engine's delayed scaling; its amax_history_len): the scale is known before the tensor is, as an FP8 kernel
  needs it. A history that holds none yet (its largest is 0: the first step) uses the tensor's own amax; a
  non-finite amax is not recorded; evaluation reads the history without recording.
An amax of 0 (or not finite) gives s = 1. The margin (default 0) trades saturation headroom for underflow.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from harness.errors import HarnessError

DEFAULT_HISTORY = 16  # Transformer Engine's default amax_history_len is 1024; 16 is the (and torchao's)


@dataclass(frozen=True)
class Fp8Format:
    name: str
    max: float  # largest finite value
    min_normal_exp: int  # 2^this is the smallest normal value
    mantissa: int  # explicit mantissa bits

    @property
    def min_subnormal_exp(self) -> int:
        return self.min_normal_exp - self.mantissa

    @property
    def max_exp(self) -> int:
        """floor(log2(max)): the largest finite value's binade."""
        return math.floor(math.log2(self.max))


E4M3 = Fp8Format("e4m3", 448.0, -6, 3)
E5M2 = Fp8Format("e5m2", 57344.0, -14, 2)


@dataclass(frozen=True)
class Recipe:
    """How a tensor's scale is chosen: `current` (history 0) or `delayed` over the last `history` steps."""
    history: int = 0
    margin: int = 0

    @property
    def name(self) -> str:
        return f"delayed:{self.history}" if self.history else "current"

    @classmethod
    def parse(cls, text: str) -> Recipe:
        """"current", "delayed" or "delayed:N" (N steps of amax history, 1 to 1024)."""
        kind, _, n = text.partition(":")
        if kind == "current" and not n:
            return cls(0)
        if kind == "delayed":
            if not n:
                return cls(DEFAULT_HISTORY)
            if n.isdigit() and 1 <= int(n) <= 1024:
                return cls(int(n))
        raise HarnessError(f"fp8 scaling '{text}': current, delayed or delayed:N (N from 1 to 1024)")


@dataclass(frozen=True)
class Fp8Policy:
    """An FP8 training precision's casts (harness.precision): every matmul's input and weights in `forward`, the
    gradient of its output (what its backward matmuls multiply) in `backward`, each scaled by `recipe`. `native`:
    the framework's own FP8 matmuls multiply the cast values (the same casts, the products summed by its kernel;
    Capabilities.no_fp8_native), where emulation multiplies them as float32."""
    forward: Fp8Format
    backward: Fp8Format
    recipe: Recipe = Recipe(0)
    native: bool = False

    def format(self, role: str) -> Fp8Format:
        """The format of a matmul input (ROLES): the backward one for the output's gradient."""
        return self.backward if role == "output_gradient" else self.forward


# ---- the reference (numpy) --------------------------------------------------------------------------------
def quantize(x, fmt: Fp8Format) -> np.ndarray:
    """float32 values cast to `fmt` (nearest, ties to even; saturating) and back to float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    magnitude = np.abs(x).astype(np.float64)
    exponent = np.frexp(np.where(np.isfinite(magnitude), magnitude, 1.0))[1] - 1  # floor(log2 |x|), exactly
    gap = np.exp2(np.maximum(exponent, fmt.min_normal_exp) - fmt.mantissa)
    with np.errstate(invalid="ignore"):
        rounded = np.minimum(np.rint(magnitude / gap) * gap, fmt.max)  # np.rint: half to even
    rounded = np.where(np.isinf(magnitude), fmt.max, rounded)
    return np.where(np.isnan(x), x, np.copysign(rounded, x)).astype(np.float32)


SMALLEST_AMAX = 2.0**-126  # float32's smallest normal: an amax below it (or 0, or not finite) gives a scale of 1
MAX_SCALE_EXP = 126  # the scale's exponent stays in [-126, 126]: a float32 normal, its inverse too


def scale_for(amax: float, fmt: Fp8Format, margin: int = 0) -> float:
    """The recipe's power-of-two scale for a tensor whose largest magnitude is `amax`: 2^(floor(log2(max / amax))
    - margin), found from the exponents (amax = m 2^E with m in [1, 2), max = 1.75 2^Emax: Emax - E, one less where
    m > 1.75), its exponent clamped to [-126, 126]."""
    amax = float(np.float32(amax))
    if not (amax >= SMALLEST_AMAX and math.isfinite(amax)):
        return 1.0
    m, e = math.frexp(amax)  # amax = m 2^e, m in [0.5, 1)
    top = fmt.max / 2.0**fmt.max_exp
    exponent = fmt.max_exp - (e - 1) - (1 if 2 * m > top else 0) - margin
    return 2.0 ** max(-MAX_SCALE_EXP, min(MAX_SCALE_EXP, exponent))


def scaled_quantize(x, fmt: Fp8Format, scale: float) -> np.ndarray:
    """x as its matmul sees it: multiplied by the scale, cast to fmt, divided by the scale (all exact but the cast)."""
    return (quantize(np.asarray(x, np.float32) * np.float32(scale), fmt) / np.float32(scale)).astype(np.float32)


class AmaxHistory:
    """The amaxes one place (a matmul input) saw, for the delayed recipe: scale() before each step's cast,
    then record() its amax."""

    def __init__(self, recipe: Recipe, fmt: Fp8Format):
        self.recipe, self.fmt = recipe, fmt
        self.amaxes: deque[float] = deque(maxlen=max(1, recipe.history))

    def scale(self, amax_now: float) -> float:
        past = max(self.amaxes, default=0.0) if self.recipe.history else 0.0
        return scale_for(past if past > 0 else amax_now, self.fmt, self.recipe.margin)

    def record(self, amax: float) -> None:
        if math.isfinite(amax):
            self.amaxes.append(amax)


def cast_counts(x, fmt: Fp8Format, scale: float) -> dict[str, int]:
    """Of x's non-zero finite values (`values`), how many underflow (become 0), land among the subnormals, and
    saturate (clip to the largest finite value, from above it) when cast at `scale`."""
    x = np.asarray(x, np.float32).ravel()
    x = x[np.isfinite(x) & (x != 0)]
    scaled = np.abs(x.astype(np.float64) * scale)
    q = np.abs(quantize(x * np.float32(scale), fmt))
    return {"values": int(x.size), "underflow": int((q == 0).sum()),
            "subnormal": int(((q > 0) & (q < 2.0 ** fmt.min_normal_exp)).sum()),
            "saturate": int((scaled > fmt.max).sum())}


def cast_shares(x, fmt: Fp8Format, scale: float) -> dict[str, float]:
    """cast_counts as shares of the non-zero finite values (all 0 where there are none)."""
    counts = cast_counts(x, fmt, scale)
    n = counts.pop("values")
    return {k: v / n if n else 0.0 for k, v in counts.items()}


# ---- what a diagnosis says of each FP8 recipe ----------------------------------------------------------------
#: the matmul inputs of a layer, and each FP8 precision's format for them: fp8_e4m3 casts all three to e4m3;
#: fp8_hybrid keeps e4m3 forward and gives the backward matmuls' output gradients e5m2's range
ROLES = ("input", "weight", "output_gradient")
PRECISIONS = {"fp8_e4m3": {"input": E4M3, "weight": E4M3, "output_gradient": E4M3},
              "fp8_hybrid": {"input": E4M3, "weight": E4M3, "output_gradient": E5M2}}
SCALINGS = (Recipe(0), Recipe(DEFAULT_HISTORY))
MAX_UNDERFLOW = 0.01  # a matmul input with more of its values cast to 0 than this loses its signal
MAX_SATURATE = 0.001  # nor more clipped than this


class CastStatistics:
    """Per FP8 precision and scaling recipe, per layer and matmul input (ROLES), the values a diagnosis's
    captured tensors would underflow, put among the subnormals, or saturate: Transformer Engine's FP8 tensor
    statistics, from strict-fp32 training. The delayed recipe's amax history holds the captured steps only (with
    `diagnose --every 1`, every step)."""

    def __init__(self):
        self.histories: dict[tuple, AmaxHistory] = {}
        self.counts: dict[str, dict[str, dict[str, dict[str, int]]]] = {}

    def add(self, layer: str, role: str, values) -> None:
        values = np.asarray(values, np.float32)
        finite = values[np.isfinite(values)]
        amax = float(np.abs(finite).max()) if finite.size else 0.0
        for precision, formats in PRECISIONS.items():
            fmt = formats[role]
            for scaling in SCALINGS:
                key = f"{precision}:{scaling.name}"
                history = self.histories.setdefault((key, layer, role), AmaxHistory(scaling, fmt))
                found = cast_counts(values, fmt, history.scale(amax))
                history.record(amax)
                total = self.counts.setdefault(key, {}).setdefault(layer, {}).setdefault(
                    role, {"format": fmt.name, **dict.fromkeys(found, 0)})
                for k, v in found.items():
                    total[k] += v

    def result(self) -> dict:
        return self.counts


def problems(counts: dict) -> list[tuple[str, str, str, float]]:
    """(layer, matmul input, "underflow" or "saturate", share) past MAX_UNDERFLOW / MAX_SATURATE, worst first."""
    found = []
    for layer, roles in counts.items():
        for role, c in roles.items():
            if not c["values"]:
                continue
            for kind, limit in (("underflow", MAX_UNDERFLOW), ("saturate", MAX_SATURATE)):
                share = c[kind] / c["values"]
                if share > limit:
                    found.append((layer, role, kind, share))
    return sorted(found, key=lambda p: -p[3])


def verdicts(fp8: dict, every: int = 1) -> dict[str, str]:
    """One sentence per FP8 precision and scaling recipe of a diagnosis's cast statistics (CastStatistics), whose
    tensors were captured every `every` steps: a delayed recipe's history then held the captured steps only, which
    its sentence says (a window of N captured steps spans N x every training steps)."""
    out = {}
    for key, counts in fp8.items():
        out[key] = _verdict(key, counts)
        history = Recipe.parse(key.split(":", 1)[1]).history if ":" in key else 0
        if history and every > 1:
            out[key] += (f" (judged with an amax history of the captured steps only, one in {every}: its "
                         f"{history} entries span {history * every} training steps, not the {history} the recipe "
                         f"names; `diagnose --every 1` judges the recipe as named)")
    return out


def _verdict(key: str, counts: dict) -> str:
    found = problems(counts)
    if not found:
        worst = max((c["underflow"] / c["values"] for roles in counts.values() for c in roles.values()
                     if c["values"]), default=0.0)
        return (f"{key}: safe: at the recipe's scales no matmul input casts more than {MAX_UNDERFLOW:.0%} of its "
                f"values to 0 (at most {worst:.2%}) or clips more than {MAX_SATURATE:.1%}")
    listed = "; ".join(f"layer {layer}'s {role.replace('_', ' ')} ({counts[layer][role]['format']}) "
                       f"{'underflows' if kind == 'underflow' else 'saturates'} in {share:.1%}"
                       for layer, role, kind, share in found[:4])
    more = f" (and {len(found) - 4} more)" if len(found) > 4 else ""
    return f"{key}: not safe: {listed}{more}"


# ---- written once against an adapter's primitives (harness.rounding.RoundingOps) ---------------------------
def quantize_with(ops, x, fmt: Fp8Format):
    """quantize() on a framework's float32 tensors through its harness.rounding.RoundingOps table: the gap from
    the float32 exponent field, round-half-even, the saturation; the same values as the reference, bit for bit
    (a core test holds NUMPY_OPS to it). Every step is exact in float32 but the rounding: the gap is a power of
    two, and a float32 subnormal's exponent field (0) lies below every fp8 format's smallest normal."""
    magnitude = ops.abs(x)
    biased = ops.bit_and(ops.shift_right(ops.as_int32(magnitude), 23), 0xFF)
    exponent = ops.maximum(biased - 127, fmt.min_normal_exp)
    gap = ops.as_float32(ops.shift_left(exponent + (127 - fmt.mantissa), 23))
    rounded = ops.copysign(ops.clip(ops.round_half_even(magnitude / gap) * gap, 0.0, fmt.max), x)
    # non-finite: an infinity saturates, NaN stays NaN (a comparison with NaN is false)
    saturated = ops.where(ops.abs(x) > fmt.max, ops.copysign(ops.full_like(x, fmt.max), x), x)
    return ops.where(ops.isfinite(x), rounded, saturated)


def scale_with(ops, amax, fmt: Fp8Format, margin: int = 0):
    """scale_for() of a float32 scalar tensor `amax` through the ops table, in integers: the exponent field, and
    one less where the mantissa field exceeds the largest value's (0.75 x 2^23: both formats' max is 1.75 x 2^k)."""
    bits = ops.as_int32(amax)
    exponent = ops.bit_and(ops.shift_right(bits, 23), 0xFF) - 127
    top = int((fmt.max / 2.0**fmt.max_exp - 1) * 2**23)
    above = 0 - ops.shift_right(top - ops.bit_and(bits, 0x7FFFFF), 31)  # 1 where the mantissa is above top
    e = fmt.max_exp - exponent - above - margin
    e = 0 - ops.maximum(0 - ops.maximum(e, -MAX_SCALE_EXP), -MAX_SCALE_EXP)  # clamped to [-126, 126]
    scale = ops.as_float32(ops.shift_left(e + 127, 23))
    valid = ops.where(ops.isfinite(amax), amax, ops.full_like(amax, 0.0)) >= SMALLEST_AMAX
    return ops.where(valid, scale, ops.full_like(amax, 1.0))


def fake_quantize_with(ops, x, amax, fmt: Fp8Format, margin: int = 0):
    """x as an FP8 matmul sees it, in float32: multiplied by the scale amax gives (a power of two), cast to `fmt`,
    divided by the scale again; `amax` the recipe's (this tensor's largest magnitude for the current one)."""
    scale = scale_with(ops, amax, fmt, margin)
    return quantize_with(ops, x * scale, fmt) / scale


def recipe_amax_with(ops, x, history=None):
    """(the amax a cast of x is scaled by, the history after this training step) through the ops table. The
    current recipe (history None): x's own amax, and no history. The delayed one (`history` a float32 vector of
    the last N steps' amaxes at this place, newest first, zeros where none yet): AmaxHistory's rule, the same
    values bit for bit (a core test holds NUMPY_OPS to it); the caller keeps the new history only in training."""
    now = ops.amax(x)
    if history is None:
        return now, None
    past = ops.amax(history)
    amax = ops.where(past > 0, past, now)
    return amax, ops.where(ops.isfinite(now), ops.shift_in(history, now), history)
