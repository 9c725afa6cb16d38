"""The core's weight-writing rules (harness.rounding) in TensorFlow: stochastic rounding through bit-casts
(tf.bitcast), the fixed-point grid, Kahan-compensated updates, and the optimizer that computes its update in
float32 and writes the new weights by these rules (the precisions with a `rounding`)."""
from __future__ import annotations

import math

import tensorflow as tf

from amp_harness_tensorflow.optimizers import SpecOptimizer
from harness.errors import HarnessError
from harness.rounding import FLOAT16_MAX, NOISE_RANGE, Rounding

_DTYPES = {"bfloat16": tf.bfloat16, "float16": tf.float16, "fixed16": tf.float32}
_FLOAT16_MIN_BIASED_EXPONENT = 127 - 14  # float16's smallest normal exponent, as float32 stores it


def storage_dtype(rounding: Rounding):
    """The dtype that holds the format's values: fixed-point values are float32 numbers on the grid."""
    return _DTYPES[rounding.format]


def draw_bits(shape, generator: tf.random.Generator):
    """16 random bits per value from the framework's generator, on the device the step runs on."""
    return generator.uniform(shape, minval=0, maxval=NOISE_RANGE, dtype=tf.int32)


def round_nearest(x, rounding: Rounding):
    """float32 `x` written to the format with round-to-nearest-even."""
    if rounding.format != "fixed16":
        return tf.cast(x, storage_dtype(rounding))  # TensorFlow's casts round to nearest even
    lo, hi = rounding.fixed_range
    return tf.clip_by_value(tf.round(x / rounding.fixed_step) * rounding.fixed_step, lo, hi)


def round_stochastic(x, bits, rounding: Rounding):
    """float32 `x` written to the format with stochastic rounding by the core's rule, `bits` int32 0..2^16-1."""
    if rounding.format == "bfloat16":
        # add the 16 bits to the float32 pattern and clear the 16 that bfloat16 drops: the cast is then exact
        rounded = tf.bitcast(tf.bitwise.bitwise_and(tf.bitcast(x, tf.int32) + bits, -NOISE_RANGE), tf.float32)
    else:
        magnitude = tf.abs(x)
        if rounding.format == "float16":  # the gap, a power of two, built from x's exponent field
            exponent = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.bitcast(x, tf.int32), 23), 0xFF)
            biased = tf.maximum(exponent, _FLOAT16_MIN_BIASED_EXPONENT) - 10
            gap = tf.bitcast(tf.bitwise.left_shift(biased, 23), tf.float32)
        else:
            gap = tf.fill(tf.shape(x), tf.constant(rounding.fixed_step, tf.float32))
        m = magnitude / gap  # exact: gap is a power of two
        low = tf.floor(m)
        away = tf.cast(bits, tf.float32) + (m - low) * NOISE_RANGE >= NOISE_RANGE
        rounded = _copysign((low + tf.cast(away, tf.float32)) * gap, x)
        if rounding.format == "fixed16":
            rounded = tf.clip_by_value(rounded, *rounding.fixed_range)
        else:  # past float16's largest finite value: infinity, as a cast gives
            rounded = tf.where(tf.abs(rounded) > FLOAT16_MAX, _copysign(tf.fill(tf.shape(x), math.inf), x), rounded)
    # non-finite values as nearest rounding writes them: kept in a float format, saturated on the fixed grid
    kept = tf.clip_by_value(x, *rounding.fixed_range) if rounding.format == "fixed16" else x
    return tf.cast(tf.where(tf.math.is_finite(x), rounded, kept), storage_dtype(rounding))


def _copysign(magnitude, sign):
    """|magnitude| with the sign bit of `sign` (negative zero included), as torch.copysign."""
    return tf.where(tf.bitcast(sign, tf.int32) < 0, -tf.abs(magnitude), tf.abs(magnitude))


class RoundedOptimizer(SpecOptimizer):
    """The spec's optimizer (SGD with or without momentum and Nesterov, Adam, RMSprop, in their spec forms)
    computed in float32 from weights, gradients and state stored in 16 bits; the state is written back with
    nearest rounding, the weights by the precision's rule (harness.rounding). Every slot is created in build."""

    def __init__(self, spec, rounding: Rounding, seed: int, **kwargs):
        super().__init__(learning_rate=spec.learning_rate, name="spec_rounded", **kwargs)
        self.spec, self.rounding = spec, rounding
        self.SLOTS = {"sgd": ("momentum",) if getattr(spec, "momentum", 0) else (), "adam": ("m", "v"),
                      "rmsprop": ("square_avg",)}[spec.type] + (("compensation",) if rounding.mode == "kahan" else ())
        self.generator = tf.random.Generator.from_seed(seed)
        self.given_bits = False  # fingerprint runs: round with the core's bits (set_bits) instead of drawing
        self.traced_drawing = False

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        # the core's bits of the next step, per variable (fingerprint runs only; tiny otherwise)
        self.bits = [tf.Variable(tf.zeros(v.shape, tf.int32), trainable=False) for v in var_list]

    def set_bits(self, variable, value) -> None:
        if self.traced_drawing:
            raise HarnessError("the step was traced to draw its own rounding bits; the core's cannot be given now")
        self.given_bits = True
        self.bits[self._get_variable_index(variable)].assign(value)

    def update_step(self, gradient, variable, learning_rate):
        spec, f32 = self.spec, tf.float32
        g, w = tf.cast(gradient, f32), tf.cast(variable, f32)
        if spec.type == "sgd":
            direction = g
            if spec.momentum:
                buf = spec.momentum * tf.cast(self.slot("momentum", variable), f32) + g
                self._keep("momentum", variable, buf)
                direction = g + spec.momentum * buf if spec.nesterov else buf
            new = w - spec.learning_rate * direction
        elif spec.type == "adam":
            m = spec.beta_1 * tf.cast(self.slot("m", variable), f32) + (1 - spec.beta_1) * g
            v = spec.beta_2 * tf.cast(self.slot("v", variable), f32) + (1 - spec.beta_2) * g * g
            self._keep("m", variable, m)
            self._keep("v", variable, v)
            # the bias corrections in float64, then float32, as the torch adapter's Python floats give them
            t = tf.cast(self.iterations + 1, tf.float64)
            step_size = tf.cast(spec.learning_rate / (1 - tf.pow(tf.constant(spec.beta_1, tf.float64), t)), f32)
            root = tf.cast(tf.sqrt(1 - tf.pow(tf.constant(spec.beta_2, tf.float64), t)), f32)
            new = w - step_size * (m / (tf.sqrt(v) / root + spec.epsilon))
        else:
            v = spec.rho * tf.cast(self.slot("square_avg", variable), f32) + (1 - spec.rho) * g * g
            self._keep("square_avg", variable, v)
            denom = tf.sqrt(v + spec.epsilon) if spec.epsilon_placement == "inside" else tf.sqrt(v) + spec.epsilon
            new = w - spec.learning_rate * (g / denom)
        variable.assign(self._write(variable, w, new))

    def _keep(self, slot, variable, value) -> None:
        state = self.slot(slot, variable)
        state.assign(tf.cast(value, state.dtype))

    def _write(self, variable, w, new):
        rounding = self.rounding
        if rounding.mode == "nearest":
            return round_nearest(new, rounding)
        if rounding.mode == "kahan":
            compensation = self.slot("compensation", variable)
            y = (new - w) - tf.cast(compensation, tf.float32)
            s = tf.cast(w + y, variable.dtype)
            compensation.assign(tf.cast((tf.cast(s, tf.float32) - w) - y, variable.dtype))
            return s
        if self.given_bits:
            bits = self.bits[self._get_variable_index(variable)]
        else:
            self.traced_drawing = True
            bits = draw_bits(variable.shape, self.generator)
        return round_stochastic(new, bits, rounding)
