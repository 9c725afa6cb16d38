"""harness.rounding's primitives in TensorFlow (RoundingOps: bit-casts through tf.bitcast), and the optimizer of the
precisions with a `rounding`."""
from __future__ import annotations

import tensorflow as tf

from amp_harness_tensorflow.optimizers import SpecOptimizer
from harness.errors import HarnessError
from harness.rounding import NOISE_RANGE, Rounding, RoundingOps, rounded_slots, rounded_update


def draw_bits(shape, generator: tf.random.Generator):
    """16 random bits per value from the framework's generator, on the device the step runs on."""
    return generator.uniform(shape, minval=0, maxval=NOISE_RANGE, dtype=tf.int32)


def _copysign(magnitude, sign):
    """|magnitude| with the sign bit of `sign` (negative zero included), as torch.copysign."""
    return tf.where(tf.bitcast(sign, tf.int32) < 0, -tf.abs(magnitude), tf.abs(magnitude))


def _placed(fn, device):
    def run(*args):
        with tf.device("/GPU:0" if device.kind == "gpu" else "/CPU:0"):
            return fn(*args)
    return run


OPS = RoundingOps(
    as_int32=lambda x: tf.bitcast(x, tf.int32),
    as_float32=lambda p: tf.bitcast(p, tf.float32),
    to_float32=lambda t: tf.cast(t, tf.float32),
    cast=tf.cast,  # TensorFlow's casts round to nearest even
    bit_and=tf.bitwise.bitwise_and, shift_right=tf.bitwise.right_shift, shift_left=tf.bitwise.left_shift,
    maximum=tf.maximum, add_mask=lambda x, mask: x + tf.cast(mask, tf.float32), floor=tf.floor,
    round_half_even=tf.round, abs=tf.abs, where=tf.where, isfinite=tf.math.is_finite, copysign=_copysign,
    clip=tf.clip_by_value, full_like=lambda x, value: tf.fill(tf.shape(x), tf.constant(value, tf.float32)),
    amax=lambda x: tf.reduce_max(tf.abs(x)),
    shift_in=lambda history, value: tf.concat([tf.reshape(value, [1]), history[:-1]], 0),
    to_tensor=lambda a, device: _placed(tf.constant, device)(a),
    to_numpy=lambda t: t.numpy(),
    draw_bits=lambda shape, seed, device: _placed(
        lambda: draw_bits(shape, tf.random.Generator.from_seed(seed)), device)(),
    on_device=_placed,
    sqrt=tf.sqrt,
    # float64, then float32: as the torch adapter's Python floats give them
    scalars=lambda fn, lr, t: tuple(tf.cast(x, tf.float32) for x in fn(tf.cast(lr, tf.float64), tf.cast(t, tf.float64),
                                                                       tf.sqrt)),
    shape=lambda x: tuple(x.shape), reshape=tf.reshape, transpose=tf.transpose, pad=tf.pad,
    crop=lambda x, shape: tf.slice(x, [0] * len(shape), shape),
    max_over=lambda x, axes: tf.reduce_max(x, axis=list(axes), keepdims=True),
    flip=lambda x, axis: tf.reverse(x, [axis]), constant=lambda array, like: tf.constant(array),
    float64=lambda fn: fn,
)


class RoundedOptimizer(SpecOptimizer):
    """The spec's optimizer computed in float32 by the core's rule (harness.rounding.rounded_update) from weights,
    gradients and state stored in 16 bits; every slot is created in build."""

    def __init__(self, spec, weight_names, rounding: Rounding, seed: int, kinds=None):
        super().__init__(spec, weight_names, kinds, name="spec_rounded")
        self.rounding = rounding
        self.SLOTS = rounded_slots(spec, rounding)
        self.generator = tf.random.Generator.from_seed(seed)
        self.given_bits = False  # fingerprint runs: round with the core's bits (set_bits) instead of drawing
        self.traced_drawing = False

    def build(self, var_list):
        if not self.built:  # the core's bits of the next step, per variable (fingerprint runs only)
            self.bits = [tf.Variable(tf.zeros(v.shape, tf.int32), trainable=False) for v in var_list]
        super().build(var_list)

    def set_bits(self, variable, value) -> None:
        if self.traced_drawing:
            raise HarnessError("the step was traced to draw its own rounding bits; the core's cannot be given now")
        self.given_bits = True
        self.bits[self._get_variable_index(variable)].assign(value)

    def update_step(self, gradient, variable, learning_rate):
        bits = None
        if self.rounding.stochastic:  # the core's bits (fingerprint runs), else drawn on the device
            self.traced_drawing = not self.given_bits  # set_bits refuses once a trace has drawn
            bits = (self.bits[self._get_variable_index(variable)] if self.given_bits
                    else draw_bits(variable.shape, self.generator))
        slots = {slot: self.slot(slot, variable) for slot in self.SLOTS}
        weights, kept = rounded_update(OPS, self.spec, self.rounding, tf.cast(variable, tf.float32),
                                       tf.cast(gradient, tf.float32), slots, self.rate(tf.float64),
                                       self.iterations + 1, self.decay_of(variable), bits)
        for slot, value in kept.items():
            slots[slot].assign(tf.cast(value, slots[slot].dtype))
        variable.assign(weights)
