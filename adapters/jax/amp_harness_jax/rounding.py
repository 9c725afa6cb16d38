"""harness.rounding's primitives in JAX (RoundingOps: bit-casts through lax.bitcast_convert_type), and the
optimizer of the precisions with a `rounding`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from amp_harness_jax.optimizers import Optimizer, per_weight
from harness.model.optimizer import weight_decay
from harness.rounding import Rounding, RoundingOps, rounded_slots, rounded_update


def jax_device(device):
    return jax.devices("gpu" if device.kind == "gpu" else "cpu")[0]


def draw_bits(key, shape):
    """16 random bits per value from JAX's generator, drawn where the step runs."""
    return jax.random.bits(key, shape, jnp.uint16).astype(jnp.int32)


def with_float64(fn):
    """fn traced and run with float64 arrays available (jax_enable_x64 is off: float32 is the default dtype)."""
    def run(*args):
        with jax.enable_x64(True):
            return fn(*args)
    return run


OPS = RoundingOps(
    as_int32=lambda x: lax.bitcast_convert_type(x, jnp.int32),
    as_float32=lambda p: lax.bitcast_convert_type(p, jnp.float32),
    to_float32=lambda t: t.astype(jnp.float32),
    cast=lambda x, dtype: x.astype(dtype),  # XLA's converts round to nearest even
    bit_and=jnp.bitwise_and, shift_right=jnp.right_shift, shift_left=jnp.left_shift,
    maximum=jnp.maximum, add_mask=jnp.add, floor=jnp.floor, round_half_even=jnp.round, abs=jnp.abs,
    where=jnp.where, isfinite=jnp.isfinite, copysign=jnp.copysign, clip=jnp.clip,
    full_like=lambda x, value: jnp.full_like(x, value, jnp.float32),
    amax=lambda x: jnp.max(jnp.abs(x)),
    shift_in=lambda history, value: jnp.concatenate([jnp.reshape(value, 1), history[:-1]]),
    to_tensor=lambda a, device: jax.device_put(np.array(a), jax_device(device)),
    to_numpy=np.asarray,
    draw_bits=lambda shape, seed, device: jax.jit(lambda key: draw_bits(key, tuple(shape)))(
        jax.device_put(jax.random.key(seed), jax_device(device))),
    on_device=lambda fn, device: jax.jit(fn),  # as the step runs it: compiled, where its inputs are
    sqrt=jnp.sqrt,
    # float32: the step count is traced, and without jax_enable_x64 there is no float64 (torch and TensorFlow
    # round them from float64: a float32 ulp apart at most); a Python float stays one (weakly typed)
    scalars=lambda fn, lr, t: tuple(x if isinstance(x, float) else jnp.asarray(x, jnp.float32)
                                    for x in fn(lr, t.astype(jnp.float32), jnp.sqrt)),
    shape=lambda x: tuple(x.shape), reshape=jnp.reshape, transpose=jnp.transpose, pad=jnp.pad,
    crop=lambda x, shape: lax.slice(x, (0,) * len(shape), tuple(shape)),
    max_over=lambda x, axes: jnp.max(x, axis=axes, keepdims=True), flip=jnp.flip,
    constant=lambda array, like: jnp.asarray(array), float64=with_float64,
)


def make_rounded_optimizer(spec, params, rounding: Rounding, seed: int) -> Optimizer:
    """The spec's optimizer computed in float32 by the core's rule (harness.rounding.rounded_update) from weights,
    gradients and state stored in 16 bits; `update` also takes the core's bits by weight name (fingerprint runs),
    or None to draw them from the seed and the step count (timed runs)."""
    def for_step(lr, count, bits):
        step_key = jax.random.fold_in(jax.random.key(seed), count)

        def update_weight(index, name, p, g, slots):
            given = None
            if rounding.stochastic:
                given = bits[name] if bits is not None else draw_bits(jax.random.fold_in(step_key, index), p.shape)
            return rounded_update(OPS, spec, rounding, p.astype(jnp.float32), g.astype(jnp.float32), slots, lr, count,
                                  weight_decay(spec, name), given)

        return update_weight

    return per_weight(params, rounded_slots(spec, rounding), for_step)
