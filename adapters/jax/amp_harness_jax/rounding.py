"""The core's weight-writing rules (harness.rounding) in JAX: stochastic rounding through bit-casts
(lax.bitcast_convert_type), the fixed-point grid, Kahan-compensated updates, and the optimizer that computes its
update in float32 and writes the new weights by these rules (the precisions with a `rounding`)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from amp_harness_jax.optimizers import Optimizer
from harness.rounding import FLOAT16_MAX, NOISE_RANGE, Rounding

_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "fixed16": jnp.float32}
_FLOAT16_MIN_BIASED_EXPONENT = 127 - 14  # float16's smallest normal exponent, as float32 stores it


def storage_dtype(rounding: Rounding):
    """The dtype that holds the format's values: fixed-point values are float32 numbers on the grid."""
    return _DTYPES[rounding.format]


def draw_bits(key, shape):
    """16 random bits per value from JAX's generator, drawn where the step runs."""
    return jax.random.bits(key, shape, jnp.uint16).astype(jnp.int32)


def round_nearest(x, rounding: Rounding):
    """float32 `x` written to the format with round-to-nearest-even."""
    if rounding.format != "fixed16":
        return x.astype(storage_dtype(rounding))  # XLA's converts round to nearest even
    lo, hi = rounding.fixed_range
    return jnp.clip(jnp.round(x / rounding.fixed_step) * rounding.fixed_step, lo, hi)


def round_stochastic(x, bits, rounding: Rounding):
    """float32 `x` written to the format with stochastic rounding by the core's rule, `bits` int32 0..2^16-1."""
    x = x.astype(jnp.float32)
    if rounding.format == "bfloat16":
        # add the 16 bits to the float32 pattern and clear the 16 that bfloat16 drops: the cast is then exact
        pattern = lax.bitcast_convert_type(x, jnp.int32)
        rounded = lax.bitcast_convert_type((pattern + bits) & -NOISE_RANGE, jnp.float32)
    else:
        magnitude = jnp.abs(x)
        if rounding.format == "float16":  # the gap, a power of two, built from x's exponent field
            exponent = (lax.bitcast_convert_type(x, jnp.int32) >> 23) & 0xFF
            biased = jnp.maximum(exponent, _FLOAT16_MIN_BIASED_EXPONENT) - 10
            gap = lax.bitcast_convert_type(biased << 23, jnp.float32)
        else:
            gap = jnp.full_like(x, rounding.fixed_step)
        m = magnitude / gap  # exact: gap is a power of two
        low = jnp.floor(m)
        away = bits.astype(jnp.float32) + (m - low) * NOISE_RANGE >= NOISE_RANGE
        rounded = jnp.copysign((low + away) * gap, x)
        if rounding.format == "fixed16":
            rounded = jnp.clip(rounded, *rounding.fixed_range)
        else:  # past float16's largest finite value: infinity, as a cast gives
            rounded = jnp.where(jnp.abs(rounded) > FLOAT16_MAX, jnp.copysign(math.inf, x), rounded)
    # non-finite values as nearest rounding writes them: kept in a float format, saturated on the fixed grid
    kept = jnp.clip(x, *rounding.fixed_range) if rounding.format == "fixed16" else x
    return jnp.where(jnp.isfinite(x), rounded, kept).astype(storage_dtype(rounding))


def make_rounded_optimizer(spec, rounding: Rounding, seed: int) -> Optimizer:
    """The spec's optimizer (SGD with or without momentum and Nesterov, Adam, RMSprop, in their spec forms)
    computed in float32 from weights, gradients and state stored in 16 bits; the state is written back with
    nearest rounding, the weights by the precision's rule. `update` takes a fourth argument: the core's bits by
    weight name (fingerprint runs), or None to draw them from the seed and the step count (timed runs)."""
    slots = {"sgd": ("momentum",) if getattr(spec, "momentum", 0) else (), "adam": ("m", "v"),
             "rmsprop": ("square_avg",)}[spec.type] + (("compensation",) if rounding.mode == "kahan" else ())
    key = jax.random.key(seed)
    f32 = jnp.float32

    def init(params):
        return {"count": jnp.zeros((), jnp.int32),
                **{slot: {n: jnp.zeros_like(p) for n, p in params.items()} for slot in slots}}

    def update(grads, state, params, bits=None):
        count = state["count"] + 1
        new_state = {"count": count}
        step_key = jax.random.fold_in(key, count)
        new_params = {}
        for index, (name, p) in enumerate(sorted(params.items())):
            g, w = grads[name].astype(f32), p.astype(f32)
            keep = lambda slot, value: new_state.setdefault(slot, {}).__setitem__(  # noqa: E731
                name, value.astype(state[slot][name].dtype))
            if spec.type == "sgd":
                direction = g
                if spec.momentum:
                    buf = spec.momentum * state["momentum"][name].astype(f32) + g
                    keep("momentum", buf)
                    direction = g + spec.momentum * buf if spec.nesterov else buf
                new = w - spec.learning_rate * direction
            elif spec.type == "adam":
                m = spec.beta_1 * state["m"][name].astype(f32) + (1 - spec.beta_1) * g
                v = spec.beta_2 * state["v"][name].astype(f32) + (1 - spec.beta_2) * g * g
                keep("m", m)
                keep("v", v)
                # the bias corrections in float32: the step count is traced, and without jax_enable_x64 there is
                # no float64 (torch and TensorFlow round them from float64: a float32 ulp apart at most)
                t = count.astype(f32)
                step_size = (spec.learning_rate / (1 - jnp.power(f32(spec.beta_1), t))).astype(f32)
                root = jnp.sqrt(1 - jnp.power(f32(spec.beta_2), t)).astype(f32)
                new = w - step_size * (m / (jnp.sqrt(v) / root + spec.epsilon))
            else:
                v = spec.rho * state["square_avg"][name].astype(f32) + (1 - spec.rho) * g * g
                keep("square_avg", v)
                denom = jnp.sqrt(v + spec.epsilon) if spec.epsilon_placement == "inside" else jnp.sqrt(v) + spec.epsilon
                new = w - spec.learning_rate * (g / denom)
            if rounding.mode == "nearest":
                new_params[name] = round_nearest(new, rounding)
            elif rounding.mode == "kahan":
                y = (new - w) - state["compensation"][name].astype(f32)
                s = (w + y).astype(p.dtype)
                keep("compensation", (s.astype(f32) - w) - y)
                new_params[name] = s
            else:
                given = bits[name] if bits is not None else draw_bits(jax.random.fold_in(step_key, index), p.shape)
                new_params[name] = round_stochastic(new, given, rounding)
        for slot in slots:  # weights without a gradient keep their state (every weight has one here)
            new_state.setdefault(slot, {})
        return new_params, new_state

    return Optimizer(init, update)
