"""Is 16-bit safe for this model? Reductions of captured fp32 tensors and what they say about each 16-bit format.

A diagnose run (harness.run.worker, mode "diagnose") captures, after selected steps, the weights, their
gradients, the updates applied and, on a fixed batch, each layer's output and the loss gradient with respect
to it. Each tensor group is reduced here to a histogram of floor(log2|x|) with exact zeros and non-finite
values counted apart: bin e holds 2^e <= |x| < 2^(e+1), so the share of values below any power of two, before
or after a loss scale of 2^k, is exact. Only weight updates need the raw tensors (whether w + u rounds back
to w in a format); they are counted at capture time.

Besides range, what a format's significand does, per layer: the share of weight updates each pure 16-bit
precision's rule for writing weights loses (update_counts: nearest rounding, stochastic rounding, Kahan
summation), each matmul's error with its inputs rounded to the format (matmul_error, from the captured layer
inputs) and the spacing of attention scores at their largest (score_spacing). The thresholds and their reasons:
docs/diagnose.md.

The reference for what to look at is Micikevicius et al., Mixed Precision Training (ICLR 2018), Figure 3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.rounding import Rounding, gap

# inside each attention layer (harness.model.reference.attention_numerics): q, k, the scaled scores the softmax
# takes and their gradients
ATTENTION_KINDS = ("attention_q", "attention_k", "attention_scores", "attention_score_gradients")
KINDS = ("weights", "gradients", "updates", "activations", "activation_gradients", *ATTENTION_KINDS)
MAX_FLUSHED = 0.01  # the static loss-scale window's lower end: at most this share of gradients flushed
STALL_SWAMPED = 0.10  # more of all updates than this lost to rounding: pure 16-bit training stalls
STALL_LAYER = 0.5  # more of one layer's updates than this lost: most of its weights never move, that layer stalls
# a 16-bit matmul whose output is off by more than this share of the fp32 product's (relative Frobenius norm):
# 16 times bfloat16's unit roundoff 2^-9, where a well-conditioned product stays within about 2 of them
MATMUL_ERROR = 2.0**-5
# attention scores as far apart as this at their largest: rounding alone moves a score by half of it, and its
# softmax weight by a factor e^(spacing / 2) against the others (1.65 at 1)
SCORE_SPACING = 1.0


def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, rounded)


@dataclass(frozen=True)
class Format:
    name: str
    max: float  # largest finite value
    min_normal_exp: int  # 2^this is the smallest normal value
    min_subnormal_exp: int  # 2^this is the smallest subnormal value

    def round(self, x: np.ndarray) -> np.ndarray:
        if self.name == "float16":
            with np.errstate(over="ignore"):
                return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
        return round_bfloat16(x)

    @property
    def flush_exp(self) -> int:
        """Values in bins below this flush to zero (|x| < half the smallest subnormal, ties to even)."""
        return self.min_subnormal_exp - 1

    @property
    def overflow_exp(self) -> int:
        """Values in bins from this one up overflow (a finite bin just below holds the largest values)."""
        return math.floor(math.log2(self.max)) + 1


FORMATS = {"float16": Format("float16", 65504.0, -14, -24), "bfloat16": Format("bfloat16", 3.3895314e38, -126, -133)}


# ---- reductions ---------------------------------------------------------------------------------------
def histogram(x: np.ndarray) -> dict:
    """{"bins": {exponent: count}, "zeros", "nonfinite", "count", "max_abs"} of one tensor (or a group)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    finite = np.isfinite(x)
    nonzero = x[finite & (x != 0)]
    exponents, counts = np.unique(np.floor(np.log2(np.abs(nonzero))).astype(np.int64), return_counts=True)
    return {"bins": {int(e): int(c) for e, c in zip(exponents, counts)}, "zeros": int((x[finite] == 0).sum()),
            "nonfinite": int((~finite).sum()), "count": int(x.size),
            "max_abs": float(np.abs(nonzero).max()) if nonzero.size else 0.0}


def merge(histograms: list[dict]) -> dict:
    out = {"bins": {}, "zeros": 0, "nonfinite": 0, "count": 0, "max_abs": 0.0}
    for h in histograms:
        for e, c in h["bins"].items():
            out["bins"][int(e)] = out["bins"].get(int(e), 0) + c
        for key in ("zeros", "nonfinite", "count"):
            out[key] += h[key]
        out["max_abs"] = max(out["max_abs"], h["max_abs"])
    return out


def update_counts(weights: np.ndarray, updates: np.ndarray, gradients: np.ndarray) -> dict:
    """Per format, counted on the raw tensors: the non-zero updates each way of writing weights in it loses
    (UPDATE_RULES' keys), and the non-zero gradients whose square flushes to zero (Adam's and RMSprop's second
    moment, kept in the weights' dtype in pure 16-bit, whatever the rule)."""
    w, u = np.asarray(weights, np.float32).ravel(), np.asarray(updates, np.float32).ravel()
    g = np.asarray(gradients, np.float32).ravel()
    moved, g = u != 0, g[g != 0]
    w, u = w[moved], u[moved]
    size = np.abs(u.astype(np.float64))
    out = {"updates": int(moved.sum()), "gradients": int(g.size), "magnitude": float(size.sum())}
    for name, fmt in FORMATS.items():
        stored = fmt.round(w)
        with np.errstate(over="ignore", invalid="ignore"):  # (a float16 overflow is judged as a range problem)
            # nearest rounding: round(w16 + u) is w16, the update is below half an ulp of its weight
            out[name] = int((fmt.round(stored + u) == stored).sum())
            # stochastic rounding writes the float32 sum w16 + u, unbiased: the update survives in expectation
            # unless the float32 sum itself is w16 (below half a float32 ulp; its 16 random bits resolve one)
            out[f"{name}_sr"] = float(size[stored + u == stored].sum())
        out[f"{name}_squares"] = int((fmt.round(g * g) == 0).sum())
    out["bfloat16_kahan"] = float((size * kahan_lost(FORMATS["bfloat16"].round(w), u)).sum())
    return out


def kahan_lost(stored: np.ndarray, updates: np.ndarray) -> np.ndarray:
    """Per update (non-zero), the probability that Kahan summation onto bfloat16 weights `stored` loses it
    (harness.rounding.kahan_update). Its bfloat16 compensation buffer holds the running remainder of the updates
    not yet in the weight, within half the weight's ulp g/2 either side (past it the weight moves by g); an update
    u is lost where u is below half the buffer's own ulp, i.e. where |buffer| >= 2^(floor(log2|u|) + 9). The
    buffer is taken as spread evenly over [-g/2, g/2], as a remainder that wraps each time the weight moves is in
    its steady state, so u is lost with probability max(0, 1 - 2^(floor(log2|u|) + 9) / (g/2)): 0 from
    |u| >= g/2^10 up, all but 2^-k of the time at |u| ~ g/2^(10+k). (A steady drift whose remainder swamps before
    it reaches g/2 is lost for good; this counts it lost all but that share of the time.)"""
    half = np.asarray(gap(stored, Rounding("nearest", "bfloat16")), np.float64) / 2
    floor = np.ldexp(1.0, np.floor(np.log2(np.abs(np.asarray(updates, np.float64)))).astype(np.int64) + 9)
    return np.clip(1 - floor / half, 0, None)


# ---- what the histograms say --------------------------------------------------------------------------
def _nonzero(h: dict) -> int:
    return sum(h["bins"].values())


def shares(h: dict, fmt: Format, scale_exp: int = 0) -> dict[str, float]:
    """Shares of a group's non-zero finite values that flush to zero, land in the subnormal range, or overflow
    when cast to `fmt` after multiplying by 2^scale_exp."""
    n = _nonzero(h)
    if not n:
        return {"flushed": 0.0, "subnormal": 0.0, "overflow": 0.0}
    flushed = subnormal = overflow = 0
    for e, c in h["bins"].items():
        scaled = int(e) + scale_exp
        if scaled < fmt.flush_exp:
            flushed += c
        elif scaled < fmt.min_normal_exp:
            subnormal += c
        elif scaled >= fmt.overflow_exp:
            overflow += c
    return {"flushed": flushed / n, "subnormal": subnormal / n, "overflow": overflow / n}


def loss_scale_window(h: dict, max_flushed: float = MAX_FLUSHED) -> tuple[int | None, int | None]:
    """(lowest, highest) power-of-two exponent of a static float16 loss scale for these gradients: the
    highest keeps every scaled value finite, the lowest flushes at most `max_flushed` of the non-zero ones.
    (None, None) without gradients; lowest > highest means no static scale is safe."""
    if not _nonzero(h):
        return None, None
    fp16 = FORMATS["float16"]
    high = math.floor(math.log2(fp16.max / h["max_abs"])) if h["max_abs"] else 64
    low = next((k for k in range(0, 129) if shares(h, fp16, k)["flushed"] <= max_flushed), 129)
    return low, high


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x < 0.995 or x == 1 else f"{100 * x:.2f}%"


def verdicts(diagnosis: dict) -> dict[str, str]:
    """One sentence per precision, citing its figures. `diagnosis` holds "groups" ({kind: {layer: histogram}}),
    "updates" ({layer: update_counts}) and "optimizer" (the spec's optimizer type), as a diagnose record does."""
    return {precision: sentence for precision, (_, sentence) in judge(diagnosis).items()}


def outcomes(diagnosis: dict) -> dict[str, str]:
    """The verdicts in a few words each, for the report's summary line."""
    return {precision: outcome for precision, (outcome, _) in judge(diagnosis).items()}


def overflowing(layers: dict[str, dict], fmt: Format) -> list[tuple[str, float]]:
    """(layer, largest |value|) of the layers holding values beyond `fmt`'s largest finite one, largest first:
    cast to `fmt` they become inf."""
    found = [(layer, h["max_abs"]) for layer, h in layers.items() if h.get("max_abs", 0.0) > fmt.max]
    return sorted(found, key=lambda item: -item[1])


OVERFLOW_WORDS = {"activations": "outputs", "weights": "weights", "gradients": "weight gradients",
                  "attention_scores": "attention scores"}


def all_gradients(groups: dict) -> dict:
    """Every captured gradient in one histogram: the weights', the layer outputs' and the attention scores' (the
    loss scale multiplies all of them)."""
    return merge([h for kind in ("gradients", "activation_gradients", "attention_score_gradients")
                  for h in groups.get(kind, {}).values()])


def _exp(value: float) -> str:
    return f"2^{math.log2(value):.1f}" if value > 0 else "0"


def _spacing_words(top: float, fmt: Format) -> str:
    """How far apart `fmt` holds scores as large as `top`, and whether softmax can bear it (SCORE_SPACING)."""
    spacing = score_spacing(top, fmt) if top else 0.0
    if spacing >= SCORE_SPACING:
        return (f" but {_spacing(spacing)} apart at their largest, so rounding alone moves a score by up to "
                f"{spacing / 2:g}: unsafe")
    return f" ({_spacing(spacing)} apart at their largest)" if spacing else ""


def attention_verdicts(diagnosis: dict) -> dict[str, str]:
    """Per attention layer, a sentence on what its scores and their gradients need of float16 and bfloat16, and
    for a causal one whose adapter declared its masks (the diagnosis's "attention_masks"), what they leave in the
    masked scores in each 16-bit precision (mask_clause)."""
    groups = diagnosis["groups"]
    masks = diagnosis.get("attention_masks") or {}
    fp16, bf16 = FORMATS["float16"], FORMATS["bfloat16"]
    out = {}
    for layer, scores in sorted(groups.get("attention_scores", {}).items()):
        q, k = (groups.get(f"attention_{part}", {}).get(layer, {}).get("max_abs", 0.0) for part in ("q", "k"))
        grads = groups.get("attention_score_gradients", {}).get(layer, {}).get("max_abs", 0.0)
        top = scores["max_abs"]
        words = [f"attention {layer}: scores reach {_exp(top)} (q {_exp(q)}, k {_exp(k)})"]
        words.append(f"float16 overflows in the forward pass ({fp16.max:g} is its largest value)" if top > fp16.max
                     else "float16 holds them" + _spacing_words(top, fp16))
        if grads:
            first = math.floor(math.log2(fp16.max / grads)) + 1  # the smallest power-of-two scale that overflows
            words.append(f"their gradients reach {_exp(grads)} and overflow float16 at a loss scale of 2^{first} "
                         f"or more")
        if max(top, q, k, grads) > bf16.max:
            words.append("bfloat16 overflows too")
        else:
            spaced = _spacing_words(top, bf16)
            words.append(("bfloat16 holds them" if spaced.startswith(" but") else "bfloat16 is safe") + spaced)
        if masks.get(layer):
            words.append(mask_clause(masks[layer]))
        out[layer] = "; ".join(words)
    return out


# ---- what a causal mask leaves in the masked scores -----------------------------------------------------
# Each adapter's network declares, per attention layer, precision and kind of device, what its causal mask puts in
# the scores it masks (j > i) and where the softmax runs (its attention_mask(info, precision, device_kind) ->
# AttentionMask, or None where it does not know; the trainer holds the table, Trainer.declare_attention_masks); the
# rule for what a fully masked row then gives is here, once, computed in numpy.
MASK_PRECISIONS = ("amp_fp16", "fp16", "amp_bf16", "bf16")  # the 16-bit compute dtypes a diagnosis speaks for
SOFTMAX_RULES = {"plain": "exp(x - max) / sum: a row of -inf gives NaN",
                 "safe": "a row whose every score is -inf gives zero weights (torch's _safe_softmax and SDPA kernels)"}


@dataclass(frozen=True)
class AttentionMask:
    """What a causal attention's mask leaves in the scores it masks, in one precision: the value, the dtype the
    masked scores are held in, the dtype the softmax runs in, and the softmax's rule (SOFTMAX_RULES)."""
    value: float
    dtype: str
    softmax: str
    rule: str = "plain"

    def __post_init__(self) -> None:
        if self.rule not in SOFTMAX_RULES:
            raise ValueError(f"softmax rule {self.rule!r}: one of {', '.join(SOFTMAX_RULES)}")

    def to_record(self) -> dict[str, str]:
        """As a diagnosis records it: strings (a record's JSON holds no -inf)."""
        return {"value": repr(float(self.value)), "dtype": self.dtype, "softmax": self.softmax, "rule": self.rule}

    @classmethod
    def from_record(cls, found: dict) -> AttentionMask:
        return cls(float(found["value"]), found["dtype"], found["softmax"], found.get("rule", "plain"))


def in_dtype(x, dtype: str) -> np.ndarray:
    """x rounded to `dtype` ("float16", "bfloat16", "float32", "float64"; a value past its range becomes inf), as
    a numpy array of that dtype (bfloat16: float32 holding bfloat16 values)."""
    with np.errstate(over="ignore"):
        if dtype == "bfloat16":
            return round_bfloat16(np.asarray(x, np.float32))
        return np.asarray(x).astype(np.dtype(dtype))


def fully_masked_row(mask: AttentionMask, length: int = 4) -> np.ndarray:
    """The softmax weights of a row of `length` scores that the mask holds every one of, computed as the declared
    softmax does: the value in the scores' dtype, then in the softmax's, x - max(x), exp, over their sum, each
    step rounded to the softmax's dtype."""
    def to(x):
        return in_dtype(x, mask.softmax)

    row = to(in_dtype(np.full(length, mask.value), mask.dtype))
    top = row.max()
    if mask.rule == "safe" and np.isneginf(top):
        return np.zeros(length)
    with np.errstate(invalid="ignore", over="ignore"):
        e = to(np.exp(to(row - top)))
        return np.asarray(to(e / to(e.sum())), np.float64)


def masked_row_outcome(mask: AttentionMask) -> str:
    """What a fully masked row gives (fully_masked_row), in words."""
    weights = fully_masked_row(mask)
    if np.isnan(weights).all():
        return "NaN"
    if (weights == 0).all():
        return "zero weights (an output of 0)"
    if np.isfinite(weights).all() and (weights == weights[0]).all():
        return "uniform weights (the mean of the values)"
    return f"weights {', '.join(f'{w:g}' for w in weights)}"


def _value(value: float) -> str:
    return f"{value:.6g}"


def mask_clause(masks: dict[str, dict]) -> str:
    """One clause on a causal attention layer's masked scores, from its declared masks ({precision: AttentionMask
    record}): per group of precisions that mask alike, the value as the scores' dtype holds it, the softmax's dtype
    and what a fully masked row would give."""
    alike: dict[AttentionMask, list[str]] = {}
    for precision, found in masks.items():
        alike.setdefault(AttentionMask.from_record(found), []).append(precision)
    parts = []
    for mask, precisions in alike.items():
        held = float(in_dtype(np.array([mask.value]), mask.dtype)[0])
        value = _value(held) + (f" (from {_value(mask.value)})" if held != mask.value else "")
        rule = ", all -inf rows give 0" if mask.rule == "safe" else ""
        parts.append(f"{', '.join(precisions)}: {value} in {mask.dtype}, softmax in {mask.softmax}{rule}, so a fully "
                     f"masked row would give {masked_row_outcome(mask)}")
    return "masked scores: " + "; ".join(parts) + " (causal attention never masks a whole row)"


def mask_table(graph, declare, device_kind: str = "cpu") -> dict[str, dict[str, dict[str, str]]]:
    """Per causal attention layer of `graph`, per 16-bit precision (MASK_PRECISIONS), what `declare(info, precision,
    device_kind)` (an adapter network's attention_mask) says its mask leaves, as a diagnosis records it; a
    precision it returns None for (not known on this kind of device) is left out, and a layer with none."""
    from harness.precision import PRECISIONS

    table = {info.path: {name: declare(info, PRECISIONS[name], device_kind) for name in MASK_PRECISIONS}
             for info in graph.layers if info.type == "attention" and info.spec.causal}
    return {path: {name: mask.to_record() for name, mask in masks.items() if mask is not None}
            for path, masks in table.items() if any(mask is not None for mask in masks.values())}


# ---- the score gradients' headroom at a run's loss scale ------------------------------------------------
def score_gradient_headroom(groups: dict, scale: float) -> tuple[str, float, float] | None:
    """(the attention layer whose score gradients come closest to float16's largest value once multiplied by
    the loss scale `scale`, log2 of its largest scaled gradient, the doublings left below float16's largest value:
    negative where they overflow), or None without captured score gradients."""
    found = [(layer, h["max_abs"]) for layer, h in groups.get("attention_score_gradients", {}).items()
             if h.get("max_abs", 0.0) > 0]
    if not found or not scale > 0:
        return None
    layer, top = max(found, key=lambda item: (item[1], item[0]))
    reached = math.log2(top) + math.log2(scale)
    return layer, reached, math.log2(FORMATS["float16"].max) - reached


def _more(count: int) -> str:
    return f" (and {count} more layer{'s' if count > 1 else ''})" if count else ""


def _range_problems(groups: dict, fmt: Format, kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """(outcome, clause) per captured group of `kinds` whose values overflow `fmt`, naming its worst layer."""
    out = []
    for kind in kinds:
        found = overflowing(groups.get(kind, {}), fmt)
        if found:
            (layer, value), more = found[0], len(found) - 1
            what = f"layer {layer}'s {OVERFLOW_WORDS[kind]}"
            out.append((f"unsafe: {what} overflow {fmt.name}",
                        f"{what} reach {value:.3g}, above {fmt.name}'s largest value {fmt.max:.6g}{_more(more)}, so "
                        f"they become inf in {fmt.name}"))
    return out


# ---- what the significand does: updates that vanish, matmul errors, attention scores' spacing -----------------
#: per pure 16-bit precision: the format its weights are stored in, update_counts' key for what its way of writing
#: them loses, and what that is a share of. Nearest rounding drops the same small updates every step, so their
#: weights never move: counted per update. Stochastic rounding and Kahan summation keep an update in expectation,
#: or drop it only part of the time, and the weight moves with the rest: what they lose is a share of the updates'
#: magnitude (the sum of |u|)
UPDATE_RULES = {"fp16": ("float16", "float16", "updates"), "fp16_sr": ("float16", "float16_sr", "magnitude"),
                "bf16": ("bfloat16", "bfloat16", "updates"), "bf16_sr": ("bfloat16", "bfloat16_sr", "magnitude"),
                "bf16_kahan": ("bfloat16", "bfloat16_kahan", "magnitude")}
RULE_WORDS = {"": "of weight updates are below half an ulp of their weights in {fmt}, so nearest rounding drops them",
              "_sr": "of the weight updates' magnitude is below half a float32 ulp of the weights, so even the float32 "
                     "sum that stochastic rounding writes drops it (every larger update it keeps in expectation)",
              "_kahan": "of the weight updates' magnitude is lost in expectation, where updates fall below half an "
                        "ulp of the bfloat16 buffer in which Kahan summation carries what rounding the weights left"}
MECHANISMS = {"": "of weight updates lost to nearest rounding",
              "_sr": "of the weight updates' magnitude lost to stochastic rounding, in expectation",
              "_kahan": "of the weight updates' magnitude lost to Kahan summation, in expectation"}
MIXED = {"amp_fp16": "float16", "amp_bf16": "bfloat16"}  # the mixed precisions' compute dtypes
#: what the harness runs that keeps what a pure precision's nearest rounding drops, in words
FIXES = {"fp16": {"fp16_sr": "stochastic rounding"},
         "bf16": {"bf16_sr": "stochastic rounding", "bf16_kahan": "Kahan summation"}}


def layer_name(diagnosis: dict, layer: str) -> str:
    """"layer 3 (rmsnorm)" where the diagnosis records its layers' types, else "layer 3"."""
    kind = (diagnosis.get("layer_types") or {}).get(layer)
    return f"layer {layer} ({kind})" if kind else f"layer {layer}"


def stagnation(counts: dict[str, dict], key: str, of: str = "updates") -> tuple[float, list[tuple[str, float]]] | None:
    """(the share of all non-zero weight updates (`of` "updates") or of their magnitude ("magnitude") that
    update_counts' `key` loses, [(layer, the share of its own)] largest first), over every captured step; None
    where the counts predate that key."""
    if any(key not in c or of not in c for c in counts.values()):
        return None
    total = sum(c[of] for c in counts.values())
    layers = sorted(((layer, c[key] / c[of]) for layer, c in counts.items() if c[of]),
                    key=lambda item: (-item[1], item[0]))
    return (sum(c[key] for c in counts.values()) / total if total else 0.0), layers


def stalls(found: tuple[float, list[tuple[str, float]]] | None) -> bool:
    """Training stalls where more than STALL_SWAMPED of all updates vanish, or more than STALL_LAYER of one
    layer's (a norm's few scales can all vanish while the network's share stays small)."""
    return found is not None and (found[0] > STALL_SWAMPED or any(share > STALL_LAYER for _, share in found[1]))


def matmul_error(lhs: np.ndarray, rhs: np.ndarray, fmt: Format) -> float | None:
    """||round(lhs) @ round(rhs) - lhs @ rhs||_F / ||lhs @ rhs||_F: a matmul with its inputs rounded to `fmt` and
    their products summed in float32, as 16-bit matmul units do (a product of two 16-bit values is exact in
    float32), against the exact product of the float32 inputs (in float64). None where that product is 0 or a
    rounded input overflows (a range problem, judged apart)."""
    exact = np.asarray(lhs, np.float64) @ np.asarray(rhs, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        error = float(np.linalg.norm(fmt.round(lhs) @ fmt.round(rhs) - exact))
    norm = float(np.linalg.norm(exact))
    return error / norm if norm > 0 and math.isfinite(error) else None


def score_spacing(value: float, fmt: Format) -> float:
    """The gap between `fmt`'s neighbouring values at |value| (a power of two; harness.rounding.gap)."""
    return float(gap(np.array([min(abs(value), fmt.max)], np.float32), Rounding("nearest", fmt.name))[0])


def _spacing(value: float) -> str:
    return f"{value:g}" if value >= 1 else f"2^{round(math.log2(value))}"


def _error(value: float) -> str:
    return f"{100 * value:.2g}%"


def _precision_problems(diagnosis: dict, fmt: Format) -> list[tuple[str, str]]:
    """(outcome, clause) where `fmt`'s 8 (bfloat16) or 11 (float16) significant bits fail, naming the worst layer:
    matmuls off by more than MATMUL_ERROR with their inputs rounded to it, attention scores SCORE_SPACING or more
    apart at their largest (scores past its range are a range problem)."""
    out = []
    errors = sorted(((layer, e[fmt.name]) for layer, e in (diagnosis.get("matmul_error") or {}).items()
                     if (e.get(fmt.name) or 0.0) > MATMUL_ERROR), key=lambda item: (-item[1], item[0]))
    if errors:
        (layer, error), more = errors[0], len(errors) - 1
        name = layer_name(diagnosis, layer)
        out.append((f"unsafe: {name}'s matmul is off by {_error(error)} in {fmt.name}",
                    f"{name}'s matmul with its inputs rounded to {fmt.name} is off by {_error(error)} of its fp32 "
                    f"product (above {_error(MATMUL_ERROR)}){_more(more)}"))
    spaced = sorted(((layer, h["max_abs"], score_spacing(h["max_abs"], fmt))
                     for layer, h in diagnosis["groups"].get("attention_scores", {}).items()
                     if h.get("max_abs", 0.0) <= fmt.max), key=lambda item: (-item[1], item[0]))
    spaced = [found for found in spaced if found[2] >= SCORE_SPACING]
    if spaced:
        (layer, top, spacing), more = spaced[0], len(spaced) - 1
        out.append((f"unsafe: attention {layer}'s scores are {_spacing(spacing)} apart in {fmt.name}",
                    f"attention {layer}'s scores reach {_exp(top)}, where {fmt.name}'s values are {_spacing(spacing)} "
                    f"apart: rounding alone moves a score by up to {spacing / 2:g}, its softmax weight by up to a "
                    f"factor e^{spacing / 2:g}{_more(more)}"))
    return out


def _checked(outcome: str, sentence: str, diagnosis: dict, fmt: Format) -> tuple[str, str]:
    """A mixed precision's verdict with what it rests on beyond the gradients (the layer outputs' range, the
    matmuls' error and the attention scores' spacing), or what was not captured to check."""
    safe = outcome.startswith("safe")
    groups = diagnosis["groups"]
    if not groups.get("activations"):
        return (outcome + " (layer outputs not checked)" if safe else outcome,
                sentence + "; layer outputs were not captured, so not checked")
    sentence += "; every layer's outputs fit its range"
    errors = diagnosis.get("matmul_error")
    if errors is None:
        return (outcome + " (matmuls not checked)" if safe else outcome,
                sentence + "; matmul errors were not measured (a diagnosis made before they were)")
    worst = max(((e[fmt.name], layer) for layer, e in errors.items() if e.get(fmt.name) is not None), default=None)
    if worst:
        error, layer = worst
        sentence += f"; its matmuls are off by at most {_error(error)} of fp32's (in {layer_name(diagnosis, layer)})"
    scores = [h["max_abs"] for h in groups.get("attention_scores", {}).values()]
    if scores:
        spacing = _spacing(score_spacing(max(scores), fmt))
        sentence += f"; the scores of its attention layers are at most {spacing} apart"
    return outcome, sentence


def _pure(precision: str, diagnosis: dict, gradients: dict) -> tuple[str, str] | None:
    """A pure 16-bit precision's verdict from its weights' updates (update_counts, by its rule: UPDATE_RULES), its
    optimizer's second moment and its gradients; None where the diagnosis predates the counts of its rule."""
    fmt_name, key, of = UPDATE_RULES[precision]
    fmt, rule = FORMATS[fmt_name], key[len(fmt_name):]
    counts = diagnosis.get("updates") or {}
    found = stagnation(counts, key, of)
    if found is None:
        return None
    lost, layers = found
    base = precision.split("_")[0]
    optimizer = diagnosis.get("optimizer")
    nonzero = sum(c["gradients"] for c in counts.values())
    squares = sum(c[f"{fmt_name}_squares"] for c in counts.values()) / nonzero if nonzero else 0.0
    flush = shares(gradients, fmt)["flushed"]
    what = "updates vanish" if of == "updates" else "update magnitude vanishes"
    if stalls(found):
        (layer, share), = [item for item in layers if item[1] > STALL_LAYER][:1] or layers[:1]
        kept = {fix: stagnation(counts, *UPDATE_RULES[fix][1:]) for fix in FIXES.get(precision, {})}
        # a fix it can name: one whose own verdict is safe (it shares this format's range, gradients and optimizer
        # state), or one this diagnosis predates the counts of, which nothing rules out
        fixes = [fix for fix in kept if (_pure(fix, diagnosis, gradients) or ("safe",))[0] == "safe"]
        remedy = f"keep fp32 master weights (amp_{base})" + (", or write the updates with " + " or ".join(
            f"{FIXES[precision][fix]} ({fix}" + (f": {_pct(kept[fix][0])} of their magnitude lost)" if kept[fix]
                                                  else ")") for fix in fixes) if fixes else "")
        by_layer = ", ".join(f"{layer_name(diagnosis, name)} {_pct(its)}" for name, its in layers[:3])
        return (f"stalls: {_pct(share)} of {layer_name(diagnosis, layer)}'s {what} in {fmt.name} "
                f"(fix: {' or '.join(fixes) or f'amp_{base}'})",
                f"{precision}: {_pct(lost)} {RULE_WORDS[rule].format(fmt=fmt.name)} (by layer, the most: {by_layer}): "
                f"training stalls; {remedy}")
    if optimizer in ("adam", "adamw", "rmsprop") and squares > MAX_FLUSHED:
        return "the optimizer's second moment underflows", (
            f"{precision}: {_pct(squares)} of squared gradients flush to zero in {fmt.name}, so {optimizer}'s "
            f"second moment underflows and its update lr*m/(sqrt(v)+eps) blows up; keep optimizer state in "
            f"float32 (amp_{base})")
    most = f", at most {_pct(layers[0][1])} in {layer_name(diagnosis, layers[0][0])}" if layers else ""
    if flush > MAX_FLUSHED:
        return "gradients flush without loss scaling", (
            f"{precision}: {_pct(flush)} of non-zero gradients flush to zero in {fmt.name} without loss scaling; "
            f"{_pct(lost)} {MECHANISMS[rule]}{most}")
    return "safe", (f"{precision}: {_pct(lost)} {MECHANISMS[rule]}{most}; {_pct(flush)} of gradients flushed in "
                    f"{fmt.name}: safe here")


def judge(diagnosis: dict) -> dict[str, tuple[str, str]]:
    """{precision: (outcome in a few words, a sentence citing the figures)}, every one computed from the
    captured figures: values beyond the compute dtype's range (activations, and in pure 16-bit the weights
    and gradients too) and what its significand does to the matmuls and the attention scores make a precision
    unsafe, naming the layer; then gradients flushed to zero, the float16 loss-scale window, and, where the
    weights are 16-bit, the updates each way of writing them loses, per layer."""
    groups = diagnosis["groups"]
    weight_grads = groups.get("gradients", {})
    gradients = all_gradients(groups)
    fp16, bf16 = FORMATS["float16"], FORMATS["bfloat16"]
    out = {}
    worst_layer, worst = max(((layer, shares(h, fp16)["flushed"]) for layer, h in weight_grads.items()),
                             key=lambda item: item[1], default=(None, 0.0))
    flushed_at_1 = shares(gradients, fp16)["flushed"]
    low, high = loss_scale_window(gradients)
    if low is None:
        out["amp_fp16"] = "no gradients captured", "amp_fp16: no gradients were captured"
    elif low > high:
        out["amp_fp16"] = "dynamic loss scaling needed", (
            f"amp_fp16: no static loss scale is safe: keeping gradients finite needs at most 2^{high}, flushing at "
            f"most {_pct(MAX_FLUSHED)} needs at least 2^{low}; use dynamic scaling")
    elif low == 0:
        out["amp_fp16"] = "safe without loss scaling", (
            f"amp_fp16: safe without loss scaling: {_pct(flushed_at_1)} of non-zero gradients flush to zero in "
            f"float16 and none overflow (any static scale up to 2^{high} keeps them finite)")
    else:
        out["amp_fp16"] = f"safe with a loss scale in 2^{low}..2^{high}", (
            f"amp_fp16: safe with a loss scale in 2^{low}..2^{high}; without scaling {_pct(flushed_at_1)} of non-zero "
            f"gradients flush to zero" + (f", {_pct(worst)} of layer {worst_layer}'s weight gradients" if worst_layer
                                          else ""))
    for precision in UPDATE_RULES:
        found = _pure(precision, diagnosis, gradients)
        if found:  # (a diagnosis made before stochastic rounding's and Kahan's counts has no verdict for them)
            out[precision] = found
    bf16_shares = shares(gradients, bf16)
    if bf16_shares["flushed"] > MAX_FLUSHED:
        out["amp_bf16"] = "gradients flush", (
            f"amp_bf16: {_pct(bf16_shares['flushed'])} of non-zero gradients flush to zero in bfloat16 (below "
            f"2^{bf16.min_subnormal_exp}); scale the loss or keep those layers in float32")
    else:
        out["amp_bf16"] = "safe", (f"amp_bf16: safe: {_pct(bf16_shares['flushed'])} of non-zero gradients flush and "
                                   f"{_pct(bf16_shares['overflow'])} overflow in bfloat16")
    # whatever the figures above say, a precision is unsafe where its compute dtype cannot hold the values
    # (mixed precision: the activations; pure 16-bit: the weights and their gradients too; attention scores: every
    # framework's mixed precision computes q k^T in the 16-bit dtype) or its significand fails the matmuls or the
    # attention scores
    for precision, (outcome, sentence) in out.items():
        mixed = precision in MIXED
        fmt = FORMATS[MIXED[precision] if mixed else UPDATE_RULES[precision][0]]
        in_range = _range_problems(groups, fmt, ("activations", "attention_scores")
                                   + (() if mixed else ("weights", "gradients")))
        problems = in_range + _precision_problems(diagnosis, fmt)
        if problems:
            remedy = "keep those layers in float32" + (" or use amp_bf16" if fmt is fp16 and in_range == problems
                                                       else "")
            out[precision] = problems[0][0], (
                f"{precision}: unsafe: {'; '.join(clause for _, clause in problems)}; {remedy} (apart from that: "
                f"{sentence.split(': ', 1)[1]})")
        elif mixed:
            out[precision] = _checked(outcome, sentence, diagnosis, fmt)
    return out
