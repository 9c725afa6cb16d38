"""Is 16-bit safe for this model? Reductions of captured fp32 tensors and what they say about each 16-bit format.

A diagnose run (harness.run.worker, mode "diagnose") captures, after selected steps, the weights, their
gradients, the updates applied and, on a fixed batch, each layer's output and the loss gradient with respect
to it. Each tensor group is reduced here to a histogram of floor(log2|x|) with exact zeros and non-finite
values counted apart: bin e holds 2^e <= |x| < 2^(e+1), so the share of values below any power of two, before
or after a loss scale of 2^k, is exact. Only weight updates need the raw tensors (whether w + u rounds back
to w in a format); they are counted at capture time.

The reference for what to look at is Micikevicius et al., Mixed Precision Training (ICLR 2018), Figure 3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# inside each attention layer (harness.model.reference.attention_numerics): q, k, the scaled scores the softmax
# takes and their gradients
ATTENTION_KINDS = ("attention_q", "attention_k", "attention_scores", "attention_score_gradients")
KINDS = ("weights", "gradients", "updates", "activations", "activation_gradients", *ATTENTION_KINDS)
MAX_FLUSHED = 0.01  # the static loss-scale window's lower end: at most this share of gradients flushed
STALL_SWAMPED = 0.10  # more updates than this lost to rounding: pure 16-bit training stalls


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
    """Per format, counted on the raw tensors: non-zero updates lost when the weights are stored in it
    (round(w16 + u) equals w16: the update is below half an ulp of its weight), and non-zero gradients whose
    square flushes to zero (Adam's and RMSprop's second moment, kept in the weights' dtype in pure 16-bit)."""
    w, u = np.asarray(weights, np.float32).ravel(), np.asarray(updates, np.float32).ravel()
    g = np.asarray(gradients, np.float32).ravel()
    moved, g = u != 0, g[g != 0]
    w, u = w[moved], u[moved]
    out = {"updates": int(moved.sum()), "gradients": int(g.size)}
    for name, fmt in FORMATS.items():
        stored = fmt.round(w)
        out[name] = int((fmt.round(stored + u) == stored).sum())
        out[f"{name}_squares"] = int((fmt.round(g * g) == 0).sum())
    return out


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
                     else "float16 holds them")
        if grads:
            first = math.floor(math.log2(fp16.max / grads)) + 1  # the smallest power-of-two scale that overflows
            words.append(f"their gradients reach {_exp(grads)} and overflow float16 at a loss scale of 2^{first} "
                         f"or more")
        words.append("bfloat16 is safe" if max(top, q, k, grads) <= bf16.max else "bfloat16 overflows too")
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


def _range_problems(groups: dict, fmt: Format, kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """(outcome, clause) per captured group of `kinds` whose values overflow `fmt`, naming its worst layer."""
    out = []
    for kind in kinds:
        found = overflowing(groups.get(kind, {}), fmt)
        if found:
            (layer, value), more = found[0], len(found) - 1
            what = f"layer {layer}'s {OVERFLOW_WORDS[kind]}"
            out.append((f"unsafe: {what} overflow {fmt.name}",
                        f"{what} reach {value:.3g}, above {fmt.name}'s largest value {fmt.max:.6g}"
                        + (f" (and {more} more layer{'s' if more > 1 else ''})" if more else "")))
    return out


def judge(diagnosis: dict) -> dict[str, tuple[str, str]]:
    """{precision: (outcome in a few words, a sentence citing the figures)}, every one computed from the
    captured figures: values beyond the compute dtype's range (activations, and in pure 16-bit the weights
    and gradients too) make a precision unsafe, naming the layer; then gradients flushed to zero, the float16
    loss-scale window, and updates swamped where the weights are 16-bit."""
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
    counts = diagnosis.get("updates") or {}
    updates = sum(c["updates"] for c in counts.values())
    nonzero_gradients = sum(c["gradients"] for c in counts.values())
    optimizer = diagnosis.get("optimizer")
    for precision, fmt in (("fp16", fp16), ("bf16", bf16)):
        lost = sum(c[fmt.name] for c in counts.values()) / updates if updates else 0.0
        squares = sum(c[f"{fmt.name}_squares"] for c in counts.values()) / nonzero_gradients \
            if nonzero_gradients else 0.0
        flush = shares(gradients, fmt)["flushed"]
        if lost > STALL_SWAMPED:
            out[precision] = "stalls: updates lost to rounding", (
                f"{precision}: {_pct(lost)} of weight updates are below half an ulp of their weights in {fmt.name}: "
                f"they are lost and training stalls; keep fp32 master weights (amp_{precision}) or write the "
                f"updates with stochastic rounding ({precision}_sr{', ' + precision + '_kahan' if precision == 'bf16' else ''};"
                f" harness.rounding)")
        elif optimizer in ("adam", "adamw", "rmsprop") and squares > MAX_FLUSHED:
            out[precision] = "the optimizer's second moment underflows", (
                f"{precision}: {_pct(squares)} of squared gradients flush to zero in {fmt.name}, so {optimizer}'s "
                f"second moment underflows and its update lr*m/(sqrt(v)+eps) blows up; keep optimizer state in "
                f"float32 (amp_{precision})")
        elif flush > MAX_FLUSHED:
            out[precision] = "gradients flush without loss scaling", (
                f"{precision}: {_pct(flush)} of non-zero gradients flush to zero in {fmt.name} without loss scaling "
                f"({_pct(lost)} of updates lost to rounding)")
        else:
            out[precision] = "safe", (
                f"{precision}: {_pct(lost)} of weight updates lost to rounding and {_pct(flush)} of gradients flushed "
                f"in {fmt.name}: safe here")
    bf16_shares = shares(gradients, bf16)
    if bf16_shares["flushed"] > MAX_FLUSHED:
        out["amp_bf16"] = "gradients flush", (
            f"amp_bf16: {_pct(bf16_shares['flushed'])} of non-zero gradients flush to zero in bfloat16 (below "
            f"2^{bf16.min_subnormal_exp}); scale the loss or keep those layers in float32")
    else:
        out["amp_bf16"] = "safe", (f"amp_bf16: safe: {_pct(bf16_shares['flushed'])} of non-zero gradients flush and "
                                   f"{_pct(bf16_shares['overflow'])} overflow in bfloat16")
    activations = groups.get("activations") or {}
    for precision in ("amp_fp16", "amp_bf16"):  # what the verdicts above could not see
        outcome, sentence = out[precision]
        if activations:
            out[precision] = outcome, sentence + "; every layer's outputs fit its range"
        else:
            out[precision] = (outcome + " (layer outputs not checked)" if outcome.startswith("safe") else outcome,
                              sentence + "; layer outputs were not captured, so not checked")
    # values beyond the compute dtype's range become inf (mixed precision: the activations; pure 16-bit: the
    # weights and their gradients too), whatever the figures above say
    # (attention scores: every framework's mixed precision computes q k^T in the 16-bit dtype)
    for precision, fmt, kinds in (("amp_fp16", fp16, ("activations", "attention_scores")),
                                  ("amp_bf16", bf16, ("activations", "attention_scores")),
                                  ("fp16", fp16, ("activations", "attention_scores", "weights", "gradients")),
                                  ("bf16", bf16, ("activations", "attention_scores", "weights", "gradients"))):
        problems = _range_problems(groups, fmt, kinds)
        if problems:
            remedy = "keep those layers in float32" + (" or use amp_bf16" if fmt is fp16 else "")
            rest = out[precision][1].split(": ", 1)[1].replace("; every layer's outputs fit its range", "")
            out[precision] = problems[0][0], (
                f"{precision}: unsafe: {'; '.join(clause for _, clause in problems)}, so they become inf in "
                f"{fmt.name}; {remedy} (apart from that: {rest})")
    return out
