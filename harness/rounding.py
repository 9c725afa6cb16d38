"""How weights are written back after an update, once for every adapter: stochastic rounding, Kahan-compensated
updates and the 16-bit fixed-point grid of the pure-16-bit precisions (`bf16_sr`, `fp16_sr`, `bf16_kahan`,
`fixed16_sr`, `fixed16_rn`; see harness.precision and docs/stochastic-rounding.md).

With round-to-nearest, a weight update smaller than half the gap between the weight and its neighbour in the
storage format is lost ("swamped", harness.numerics); repeated, training stalls. Stochastic rounding rounds to
one of the two neighbours with probabilities that make the rounded value unbiased: its expectation is the
float32 value (Gupta et al., ICML 2015). Kahan summation keeps what rounding lost in a compensation buffer of
the weights' dtype and adds it back to the next update (Zamirai et al., Revisiting BFloat16 Training, 2020).

The rules, as every adapter implements them with its framework's bit-casts (the numpy functions here are the
reference the conformance kit holds them to, bit for bit):

- The optimizer's update is computed in float32 (its state is read from and written back to the weights' dtype,
  with nearest rounding), giving the new weight `x` in float32; `x` is then written to the weights' format.
- Stochastic rounding takes 16 random bits `r` (an integer 0 <= r < 2^16) per weight and step.
  bfloat16: add `r` to the float32 bit pattern and clear its low 16 bits (the pattern is sign and magnitude,
  so the magnitude rounds away from zero exactly when its 16 discarded bits plus `r` carry).
  Other formats, the same rule in arithmetic: with `g` the gap of the format's grid at |x| (a power of two)
  and `m = |x| / g`, the magnitude rounds away from zero to `(floor(m) + 1) * g` when
  `r + (m - floor(m)) * 2^16 >= 2^16`, else to `floor(m) * g`; the sign is kept. For bfloat16 the two are
  identical (a core test checks it); the probability of rounding away is the distance to the lower neighbour
  over the gap, resolved to 2^-16 of the gap.
- float16's gap at |x| is 2^(max(e, -14) - 10) for |x| in [2^e, 2^(e+1)) (subnormals below 2^-14);
  bfloat16's 2^(max(e, -126) - 7). A float16 value past the largest finite one becomes infinity, as a cast
  does.
- The fixed-point grid (`fixed16_*`): 16-bit two's complement integers times 2^-F (F fractional bits, default
  14): gap 2^-F, range [-2^(15-F), 2^(15-F) - 2^-F]; values outside saturate (Gupta et al. clip too).
  Nearest rounding there is round-half-to-even.
- Kahan (`bf16_kahan`): with the update `u = x - w` in float32 and the compensation `c` (bfloat16, zero at
  the start): `y = u - c`, `s = bf16(w + y)`, `c = bf16((s - w) - y)`, `w = s` (w, s, c read as float32).
- Non-finite values are written with the format's nearest rounding (an infinite update stays infinite).

Written once: the arithmetic of these rules (`round_nearest_with`, `round_stochastic_with`, `kahan_with`) is
written here against a small table of elementwise primitives (`RoundingOps`: bit-casts between int32 and float32,
floor, where, abs, copysign...), which each adapter's rounding.py fills for its framework (as einops' backends
do); `NUMPY_OPS` is numpy's entry, and a core test holds the written-once rules with it to the reference below.

Noise: in timed runs every adapter draws `r` on the device with its framework's generator, so the timing is a
real implementation's. In fingerprint runs the core draws it (`RoundingNoise`: counter-based, from the spec's
seed, the weight and the step), so stochastically rounded runs are the same in every framework and the parity
check covers them.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from harness.errors import HarnessError

NOISE_BITS = 16  # random bits per weight and step
NOISE_RANGE = 1 << NOISE_BITS
DEFAULT_FRAC_BITS = 14  # Gupta et al.'s best setting for 16-bit fixed point
MODES = ("nearest", "stochastic", "kahan")
FORMATS = ("bfloat16", "float16", "fixed16")
_STREAM = 0x5A0D  # keeps rounding-noise keys apart from dropout's and any other use of the spec's seed

# (smallest normal exponent, explicit mantissa bits) of the floating-point formats
_FLOAT_FORMATS = {"bfloat16": (-126, 7), "float16": (-14, 10)}
FLOAT16_MAX = 65504.0
FLOAT16_MIN_BIASED_EXPONENT = 127 - 14  # float16's smallest normal exponent, as float32's exponent field stores it


@dataclass(frozen=True)
class Rounding:
    """How a precision writes updated weights: `mode` nearest / stochastic / kahan onto `format`'s grid."""

    mode: str
    format: str
    frac_bits: int = DEFAULT_FRAC_BITS  # fixed16 only

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.format not in FORMATS:
            raise HarnessError(f"rounding: mode must be one of {MODES}, format one of {FORMATS}")
        if self.format == "fixed16" and not 0 <= self.frac_bits <= 15:
            raise HarnessError(f"fixed16: the fractional bits must be 0..15, got {self.frac_bits}")
        if self.mode == "kahan" and self.format != "bfloat16":
            raise HarnessError("Kahan-compensated updates are defined for bfloat16 weights only")

    @property
    def stochastic(self) -> bool:
        return self.mode == "stochastic"

    @property
    def fixed_step(self) -> float:
        """The fixed-point grid's gap, 2^-F."""
        return 2.0 ** -self.frac_bits

    @property
    def fixed_range(self) -> tuple[float, float]:
        """The fixed-point grid's smallest and largest values: 16-bit two's complement integers times 2^-F."""
        return -(2.0 ** (15 - self.frac_bits)), 2.0 ** (15 - self.frac_bits) - self.fixed_step

    def describe(self) -> str:
        what = {"stochastic": "stochastic rounding", "nearest": "round-to-nearest", "kahan": "Kahan-compensated"}
        grid = f"16-bit fixed point with {self.frac_bits} fractional bits" if self.format == "fixed16" \
            else self.format
        return f"{what[self.mode]} onto {grid}"


# ---- the reference implementation (numpy, float32) ----------------------------------------------------------
def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def gap(x, rounding: Rounding) -> np.ndarray:
    """The spacing of the format's grid at |x| (float32, a power of two), for finite x."""
    x = _f32(x)
    if rounding.format == "fixed16":
        return np.full(x.shape, rounding.fixed_step, np.float32)
    emin, mantissa = _FLOAT_FORMATS[rounding.format]
    exponent = ((x.view(np.uint32) >> 23) & 0xFF).astype(np.int32) - 127  # float32 subnormals: -127
    return np.ldexp(np.float32(1), np.maximum(exponent, emin) - mantissa).astype(np.float32)


def round_nearest(x, rounding: Rounding) -> np.ndarray:
    """x written to the format with round-to-nearest-even, as float32 values."""
    x = _f32(x)
    if rounding.format == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
        return np.where(np.isnan(x), x, rounded)
    if rounding.format == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    lo, hi = rounding.fixed_range
    step = np.float32(rounding.fixed_step)
    return np.clip(np.rint(x / step) * step, lo, hi).astype(np.float32)


def round_stochastic(x, bits, rounding: Rounding) -> np.ndarray:
    """x written to the format with stochastic rounding, using `bits` (integers 0..2^16-1, x's shape)."""
    x = _f32(x)
    r = np.asarray(bits, dtype=np.int64)
    if r.shape != x.shape or (r.size and (r.min() < 0 or r.max() >= NOISE_RANGE)):
        raise HarnessError(f"stochastic rounding needs one integer in [0, 2^16) per value; got {r.shape} for "
                           f"{x.shape}")
    finite = np.isfinite(x)
    if rounding.format == "bfloat16":
        pattern = x.view(np.uint32).astype(np.int64)
        rounded = ((pattern + r) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    else:
        rounded = _stochastic_arithmetic(x, r, rounding)
    return np.where(finite, rounded, round_nearest(x, rounding)).astype(np.float32)


def _stochastic_arithmetic(x: np.ndarray, r: np.ndarray, rounding: Rounding) -> np.ndarray:
    """The arithmetic form of the rule (module docstring): exact in float32, as every adapter computes it."""
    with np.errstate(invalid="ignore", over="ignore"):
        magnitude = np.abs(x)
        g = gap(np.where(np.isfinite(x), x, 0), rounding)
        m = magnitude / g
        low = np.floor(m)
        away = r.astype(np.float32) + (m - low) * np.float32(NOISE_RANGE) >= np.float32(NOISE_RANGE)
        y = np.copysign((low + away) * g, x).astype(np.float32)
    if rounding.format == "fixed16":
        return np.clip(y, *rounding.fixed_range).astype(np.float32)
    if rounding.format == "bfloat16":  # float32 overflows by itself
        return y
    return np.where(np.abs(y) > FLOAT16_MAX, np.copysign(np.float32(np.inf), x), y).astype(np.float32)


def round_stochastic_arithmetic(x, bits, rounding: Rounding) -> np.ndarray:
    """The arithmetic form for any format, bfloat16 included (a test checks it equals the bit-pattern rule)."""
    x = _f32(x)
    return _stochastic_arithmetic(x, np.asarray(bits, dtype=np.int64), rounding)


def kahan_update(w, x, c) -> tuple[np.ndarray, np.ndarray]:
    """(new weight, new compensation) of bfloat16 weights `w` moved to float32 `x` with compensation `c`."""
    bf16 = Rounding("nearest", "bfloat16")
    w, x, c = _f32(w), _f32(x), _f32(c)
    y = (x - w) - c
    s = round_nearest(w + y, bf16)
    return s, round_nearest((s - w) - y, bf16)


def write(x, rounding: Rounding, bits=None) -> np.ndarray:
    """Float32 new weights `x` written by the rounding's mode (nearest or stochastic; Kahan needs kahan_update)."""
    if rounding.mode == "stochastic":
        return round_stochastic(x, bits, rounding)
    if rounding.mode == "nearest":
        return round_nearest(x, rounding)
    raise HarnessError("Kahan-compensated updates keep a compensation buffer: use kahan_update")


def device_seed() -> int:
    """The seed of a timed run's on-device noise: fresh entropy per process, as a real implementation seeds
    its generator, so that repeats sample the rounding noise instead of repeating one draw (fingerprint runs
    take the core's RoundingNoise instead). Adapters record it in the run's options."""
    return int.from_bytes(os.urandom(4), "little")


# ---- the rules written once, against a framework's primitives -------------------------------------------------
@dataclass(frozen=True)
class RoundingOps:
    """One framework's elementwise primitives, which the rules below are written with. Tensors support the
    arithmetic operators (+ - * / with Python numbers, comparisons); `x` is float32, `bits` and patterns int32.
    to_tensor, to_numpy, draw_bits and on_device move values between numpy and the framework for
    Adapter.write_weights (the kit's self-test). The fields from `shape` on, the layout the block-scaled formats
    need, work on any dtype (float32, float64 and int32)."""

    as_int32: Callable  # float32 -> its int32 bit pattern (a bit-cast, no conversion)
    as_float32: Callable  # an int32 bit pattern -> the float32 it encodes
    to_float32: Callable  # a numeric conversion to float32 (of int32 bits, a 16-bit or a float64 tensor: to nearest)
    cast: Callable  # (float32 x, "bfloat16" / "float16" / "float32" / "float64") -> x in that dtype, rounded to
    # nearest even (float64: exact; JAX's only inside `float64`)
    bit_and: Callable  # (int32, Python int) -> bitwise and
    shift_right: Callable  # (int32, n) -> arithmetic shift right
    shift_left: Callable  # (int32, n) -> shift left
    maximum: Callable  # (int32, Python int) -> elementwise maximum
    add_mask: Callable  # (float32 x, boolean mask) -> x + 1 where the mask is true (the mask taken as 0 / 1)
    floor: Callable
    round_half_even: Callable
    abs: Callable
    where: Callable  # (condition, a, b)
    isfinite: Callable
    copysign: Callable  # (magnitude, sign) -> |magnitude| with sign's sign bit (negative zero included)
    clip: Callable  # (x, lo, hi), Python floats
    full_like: Callable  # (x, Python float) -> a float32 tensor of x's shape
    amax: Callable  # x -> its largest magnitude, a float32 scalar tensor (FP8's per-tensor scales)
    shift_in: Callable  # (vector, scalar) -> the scalar, then the vector's values but its last (an amax history)
    to_tensor: Callable  # (numpy array, harness.adapter.Device) -> a tensor on that device
    to_numpy: Callable  # tensor -> numpy array
    draw_bits: Callable  # (shape, seed, Device) -> int32 tensor of 16 random bits per value, drawn on the device
    on_device: Callable  # (function, Device) -> the function as the framework runs it there (compiled, placed)
    # the optimizer's update (update_with, rounded_update)
    sqrt: Callable  # float32 x -> its square root
    # (fn, lr, t) -> fn(lr, t, sqrt)'s values as the update's float32 scalars, computed from the step's learning
    # rate and count as the framework holds them (Python numbers, or tensors of a compiled step) in float64 where
    # the framework can (JAX without x64: float32); fn is written with + - * / ** and the sqrt it is given
    scalars: Callable
    # the block-scaled formats' layout (harness.microscaling.quantize_with, hadamard_transform_with); None where an
    # adapter has none (harness.microscaling.missing_block_ops names them; its formats are then unsupported there)
    shape: Callable | None = None  # x -> its shape, a tuple of Python ints
    reshape: Callable | None = None  # (x, shape tuple) -> x's values in that shape, in order
    transpose: Callable | None = None  # (x, permutation) -> x with its axes in that order (numpy's transpose)
    pad: Callable | None = None  # (x, [(before, after) per axis]) -> x padded with zeros
    crop: Callable | None = None  # (x, shape) -> x[:shape[0], :shape[1], ...]
    max_over: Callable | None = None  # (x, axes tuple) -> the largest value over those axes, kept as axes of 1
    flip: Callable | None = None  # (x, axis) -> x reversed along the axis
    constant: Callable | None = None  # (numpy array, like) -> a tensor of its values and dtype, on like's device
    # (fn) -> fn, run where float64 arithmetic is available (JAX: under jax.enable_x64), for the Hadamard transform
    float64: Callable | None = None


def storage_dtype(rounding: Rounding) -> str:
    """The dtype that holds the format's values: fixed-point values are float32 numbers on the grid."""
    return "float32" if rounding.format == "fixed16" else rounding.format


def round_nearest_with(ops: RoundingOps, x, rounding: Rounding):
    """float32 `x` written to the format with round-to-nearest-even, in the storage dtype."""
    if rounding.format != "fixed16":
        return ops.cast(x, rounding.format)  # the frameworks' casts round to nearest even
    lo, hi = rounding.fixed_range
    return ops.clip(ops.round_half_even(x / rounding.fixed_step) * rounding.fixed_step, lo, hi)


def round_stochastic_with(ops: RoundingOps, x, bits, rounding: Rounding):
    """float32 `x` written to the format with stochastic rounding by the rule, `bits` int32 0..2^16-1, in the
    storage dtype."""
    if rounding.format == "bfloat16":
        # add the 16 bits to the float32 pattern and clear the 16 that bfloat16 drops: the cast is then exact
        rounded = ops.as_float32(ops.bit_and(ops.as_int32(x) + bits, -NOISE_RANGE))
    else:
        magnitude = ops.abs(x)
        if rounding.format == "float16":  # the gap, a power of two, built from x's exponent field
            exponent = ops.bit_and(ops.shift_right(ops.as_int32(x), 23), 0xFF)
            gap = ops.as_float32(ops.shift_left(ops.maximum(exponent, FLOAT16_MIN_BIASED_EXPONENT) - 10, 23))
        else:
            gap = ops.full_like(x, rounding.fixed_step)
        m = magnitude / gap  # exact: gap is a power of two
        low = ops.floor(m)
        away = ops.to_float32(bits) + (m - low) * NOISE_RANGE >= NOISE_RANGE
        rounded = ops.copysign(ops.add_mask(low, away) * gap, x)
        if rounding.format == "fixed16":
            rounded = ops.clip(rounded, *rounding.fixed_range)
        else:  # past float16's largest finite value: infinity, as a cast gives
            rounded = ops.where(ops.abs(rounded) > FLOAT16_MAX, ops.copysign(ops.full_like(x, math.inf), x), rounded)
    # non-finite values as nearest rounding writes them: kept in a float format, saturated on the fixed grid
    kept = ops.clip(x, *rounding.fixed_range) if rounding.format == "fixed16" else x
    return ops.cast(ops.where(ops.isfinite(x), rounded, kept), storage_dtype(rounding))


def kahan_with(ops: RoundingOps, w, x, compensation) -> tuple[Any, Any]:
    """(new weight, new compensation), both bfloat16, of float32 weights `w` moved to float32 `x` with the
    bfloat16 compensation."""
    y = (x - w) - ops.to_float32(compensation)
    s = ops.cast(w + y, "bfloat16")
    return s, ops.cast((ops.to_float32(s) - w) - y, "bfloat16")


def write_with(ops: RoundingOps, rounding: Rounding, w, x, compensation=None, bits=None) -> tuple[Any, Any]:
    """An optimizer's write of float32 new weights `x` (from float32 weights `w`) by the rounding's mode: (the
    weights in the storage dtype, the new compensation: Kahan only, else None). `bits`: stochastic only."""
    if rounding.mode == "nearest":
        return round_nearest_with(ops, x, rounding), None
    if rounding.mode == "kahan":
        return kahan_with(ops, w, x, compensation)
    return round_stochastic_with(ops, x, bits, rounding), None


def rounded_slots(optimizer, rounding: Rounding | None = None) -> tuple[str, ...]:
    """The state update_with (rounded_update with a rounding) keeps per weight, each in the weights' storage dtype
    and zero at the start: SGD's momentum buffer, Adam's (AdamW's) moments m and v, RMSprop's square_avg, and
    Kahan's compensation."""
    kept = {"sgd": ("momentum",) if getattr(optimizer, "momentum", 0) else (), "adam": ("m", "v"), "adamw": ("m", "v"),
            "rmsprop": ("square_avg",)}[optimizer.type]
    return kept + (("compensation",) if rounding is not None and rounding.mode == "kahan" else ())


def update_scalars(ops: RoundingOps, optimizer, lr, t) -> tuple:
    """The scalars of a step of update_with, read through ops.scalars from the step's learning rate and count (1 at
    the first step) as the framework holds them: Adam's (AdamW's) step size and root of its second bias correction,
    the other optimizers' rate."""
    if optimizer.type in ("adam", "adamw"):
        b1, b2 = optimizer.beta_1, optimizer.beta_2
        return ops.scalars(lambda lr, t, sqrt: (lr / (1 - b1 ** t), sqrt(1 - b2 ** t)), lr, t)
    return ops.scalars(lambda lr, t, sqrt: (lr,), lr, t)


def update_with(ops: RoundingOps, optimizer, w, g, slots: dict, lr, t, decay: float, scalars=None) -> tuple[Any, dict]:
    """One weight's step of the spec's optimizer (SGD with or without momentum and Nesterov, Adam, AdamW,
    RMSprop, in their spec forms: harness.model.spec), in the dtype of `w` and `g`, the weight and its (clipped,
    unscaled) gradient; `slots` its state by rounded_slots' names, read through ops.to_float32 into that dtype;
    `lr` and `t` the step's learning rate and count (1 at the first step); `decay` AdamW's decoupled decay of this
    weight (harness.model.optimizer.weight_decay), applied to the weight before the update; `scalars` the step's
    update_scalars where the caller computes them once for every weight (None: here). Of ops it reads to_float32,
    sqrt and scalars only. Returns (the new weight, the new state by slot), not yet written to a storage dtype."""
    kept, f32 = {}, ops.to_float32
    if optimizer.type in ("adam", "adamw"):
        b1, b2 = optimizer.beta_1, optimizer.beta_2
        m = kept["m"] = b1 * f32(slots["m"]) + (1 - b1) * g
        v = kept["v"] = b2 * f32(slots["v"]) + (1 - b2) * g * g
        step_size, root = update_scalars(ops, optimizer, lr, t) if scalars is None else scalars
        # the spec's lr*m_hat/(sqrt(v_hat) + eps), arranged as PyTorch's Adam computes it; adamw first decays w by
        # lr*decay*w, as PyTorch's AdamW does (the same w on both sides)
        start = w * ops.scalars(lambda lr, t, sqrt: (1 - lr * decay,), lr, t)[0] if decay else w
        return start - step_size * (m / (ops.sqrt(v) / root + optimizer.epsilon)), kept
    rate, = update_scalars(ops, optimizer, lr, t) if scalars is None else scalars
    if optimizer.type == "sgd":
        direction = g
        if optimizer.momentum:
            buf = kept["momentum"] = optimizer.momentum * f32(slots["momentum"]) + g
            direction = g + optimizer.momentum * buf if optimizer.nesterov else buf
    else:
        v = kept["square_avg"] = optimizer.rho * f32(slots["square_avg"]) + (1 - optimizer.rho) * g * g
        eps = optimizer.epsilon
        direction = g / (ops.sqrt(v + eps) if optimizer.epsilon_placement == "inside" else ops.sqrt(v) + eps)
    return w - rate * direction, kept


def rounded_update(ops: RoundingOps, optimizer, rounding: Rounding, w, g, slots: dict, lr, t, decay: float,
                   bits=None) -> tuple[Any, dict]:
    """One weight's step of the spec's optimizer (update_with) computed in float32, `w` and `g` float32 and
    `slots` in the storage dtype, the new weight written by the rounding's rule (write_with); `bits` the
    stochastic rounding's. Returns (the new weight in the storage dtype, the new state by slot: float32 values
    the adapter stores with nearest rounding, the compensation already in its dtype)."""
    new, kept = update_with(ops, optimizer, w, g, slots, lr, t, decay)
    weights, compensation = write_with(ops, rounding, w, new, slots.get("compensation"), bits)
    if compensation is not None:
        kept["compensation"] = compensation
    return weights, kept


def _numpy_cast(x, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # numpy has no bfloat16: its values as float32, by the reference's bit rule
        return round_nearest(x, Rounding("nearest", "bfloat16"))
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(dtype)


def _quiet(fn: Callable) -> Callable:
    """A numpy function with overflow and NaN comparisons silent, as the frameworks' are."""
    def run(*args):
        with np.errstate(invalid="ignore", over="ignore"):
            return fn(*args)
    return run


NUMPY_OPS = RoundingOps(
    as_int32=lambda x: np.asarray(x, np.float32).view(np.int32),
    as_float32=lambda p: np.asarray(p, np.int32).view(np.float32),
    to_float32=lambda t: np.asarray(t).astype(np.float32),
    cast=_numpy_cast,
    bit_and=np.bitwise_and, shift_right=np.right_shift, shift_left=np.left_shift,
    maximum=np.maximum, add_mask=lambda x, mask: x + mask.astype(np.float32), floor=np.floor,
    round_half_even=np.rint, abs=np.abs,
    where=np.where, isfinite=np.isfinite, copysign=_quiet(np.copysign),
    clip=lambda x, lo, hi: np.clip(x, np.float32(lo), np.float32(hi)),
    full_like=lambda x, value: np.full(np.shape(x), value, np.float32),
    amax=lambda x: np.float32(np.max(np.abs(x))),
    shift_in=lambda history, value: np.concatenate([np.reshape(value, 1), history[:-1]]).astype(np.float32),
    to_tensor=lambda a, device: np.array(a),
    to_numpy=np.asarray,
    draw_bits=lambda shape, seed, device: np.random.default_rng(seed).integers(0, NOISE_RANGE, shape, np.int32),
    on_device=lambda fn, device: _quiet(fn),
    sqrt=np.sqrt,
    scalars=lambda fn, lr, t: tuple(np.float32(x) for x in fn(lr, t, math.sqrt)),
    shape=np.shape, reshape=np.reshape, transpose=np.transpose, pad=np.pad,
    crop=lambda x, shape: x[tuple(slice(0, n) for n in shape)],
    max_over=lambda x, axes: np.max(x, axis=axes, keepdims=True), flip=np.flip,
    constant=lambda array, like: np.asarray(array), float64=lambda fn: fn,
)


# ---- the core's noise for fingerprint runs --------------------------------------------------------------------
class RoundingNoise:
    """The 16 random bits per trainable weight and step of a fingerprint run, drawn by the core so that every
    framework rounds alike: Philox keyed by the spec's seed and the weight's index in canonical order, the step
    as the counter (any step's bits without replaying the steps before it). int32 arrays (0..2^16-1) in the
    weights' canonical layouts, by canonical name."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int):
        self.shapes = dict(shapes)
        self._keys = {name: np.random.SeedSequence([seed % 2**63, _STREAM, index]).generate_state(2, np.uint64)
                      for index, name in enumerate(self.shapes)}

    def for_step(self, step: int) -> dict[str, np.ndarray]:
        bits = {}
        for name, shape in self.shapes.items():
            key = int(self._keys[name][0]) << 64 | int(self._keys[name][1])
            generator = np.random.Generator(np.random.Philox(key=key, counter=[0, 0, 0, step]))
            bits[name] = generator.integers(0, NOISE_RANGE, size=shape, dtype=np.int32)
        return bits


# ---- what the unbiasedness tests round ---------------------------------------------------------------------
def sample_values(rounding: Rounding) -> np.ndarray:
    """Float32 values spread over the format's whole range, none on its grid: normal values across the
    exponents, subnormals, values just above and just below powers of two, both signs (the statistical tests of
    every adapter's rounding take these)."""
    rng = np.random.default_rng(20150706)
    if rounding.format == "fixed16":
        lo, hi = rounding.fixed_range
        step = rounding.fixed_step
        base = np.concatenate([rng.uniform(lo + step, hi - step, 24), [step * 0.3, -step * 0.7, step * 1.01,
                                                                        1 + step * 0.25, 1 - step * 0.4]])
    else:
        emin, mantissa = _FLOAT_FORMATS[rounding.format]
        emax = 15 if rounding.format == "float16" else 127
        exponents = np.linspace(emin, emax - 1, 16).round()
        normal = np.ldexp(rng.uniform(1, 2, exponents.size), exponents.astype(int))
        subnormal = np.ldexp(rng.uniform(0.05, 1, 6), emin)  # below the smallest normal
        power = np.ldexp(1.0, np.array([emin, 0, 5, emax - 2]))
        ulp = np.ldexp(1.0, np.array([emin, 0, 5, emax - 2]) - mantissa)
        near = np.concatenate([power + 0.3 * ulp, power - 0.2 * ulp])  # just above and just below 2^k
        base = np.concatenate([normal, subnormal, near])
    values = _f32(base * np.where(np.arange(base.size) % 2, -1, 1))
    off_grid = round_nearest(values, Rounding("nearest", rounding.format, rounding.frac_bits)) != values
    return values[off_grid]


def unbiasedness(values: np.ndarray, rounded: np.ndarray, rounding: Rounding, sigmas: float = 3.0) -> list[str]:
    """Checks `rounded` ([draws, values] float32, draws of stochastic rounding of each value) against the rule:
    every draw is one of the value's two neighbours, and the mean is the value within `sigmas` standard errors
    (the standard error of the mean of draws from those two neighbours with the rule's probabilities). Returns
    the failures, one line each."""
    return [message for _, message in biased(values, rounded, rounding, sigmas)]


def biased(values: np.ndarray, rounded: np.ndarray, rounding: Rounding, sigmas: float = 3.0) -> list[tuple[int, str]]:
    """unbiasedness's failures with the index of the value each concerns."""
    values, rounded = _f32(values), np.asarray(rounded, dtype=np.float64)
    draws = rounded.shape[0]
    g = gap(values, rounding).astype(np.float64)
    magnitude = np.abs(values).astype(np.float64)
    low = np.floor(magnitude / g) * g
    p = (magnitude - low) / g
    lower = np.copysign(low, values)
    upper = np.copysign(low + g, values)
    failures = []
    for i, v in enumerate(values.astype(np.float64)):
        column = rounded[:, i]
        if not np.all((column == lower[i]) | (column == upper[i])):
            bad = column[(column != lower[i]) & (column != upper[i])][0]
            failures.append((i, f"{v!r}: rounded to {bad!r}, not one of its neighbours {lower[i]!r}, {upper[i]!r}"))
            continue
        se = g[i] * np.sqrt(p[i] * (1 - p[i]) / draws)
        mean = column.mean()
        if abs(mean - v) > sigmas * se:
            failures.append((i, f"{v!r}: the mean of {draws} roundings is {mean!r}, {abs(mean - v) / se:.1f} standard "
                            f"errors away (P(round away) should be {p[i]:.4f}, was "
                            f"{np.mean(column == upper[i]):.4f})"))
    return failures
