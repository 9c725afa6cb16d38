"""harness.rounding's primitives in JAX (RoundingOps: bit-casts through lax.bitcast_convert_type), and the
optimizer that computes its update in float32 and writes the new weights by the core's rules (the precisions
with a `rounding`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from amp_harness_jax.optimizers import Optimizer, bind
from harness.model.optimizer import weight_decay
from harness.rounding import Rounding, RoundingOps, write_with


def jax_device(device):
    """JAX's device of a harness.adapter.Device."""
    return jax.devices("gpu" if device.kind == "gpu" else "cpu")[0]


def draw_bits(key, shape):
    """16 random bits per value from JAX's generator, drawn where the step runs."""
    return jax.random.bits(key, shape, jnp.uint16).astype(jnp.int32)


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
)


def make_rounded_optimizer(spec, params, rounding: Rounding, seed: int) -> Optimizer:
    """The spec's optimizer (SGD with or without momentum and Nesterov, Adam, AdamW, RMSprop, in their spec
    forms) computed in float32 from weights, gradients and state stored in 16 bits; the state is written back with
    nearest rounding, the weights by the precision's rule. `update` takes the step's learning rate (a Python
    float or a traced float32 scalar) and a fifth argument: the core's bits by weight name (fingerprint runs), or
    None to draw them from the seed and the step count (timed runs)."""
    slots = {"sgd": ("momentum",) if getattr(spec, "momentum", 0) else (), "adam": ("m", "v"), "adamw": ("m", "v"),
             "rmsprop": ("square_avg",)}[spec.type] + (("compensation",) if rounding.mode == "kahan" else ())
    key = jax.random.key(seed)
    f32 = jnp.float32

    def init(params):
        return {"count": jnp.zeros((), jnp.int32),
                **{slot: {n: jnp.zeros_like(p) for n, p in params.items()} for slot in slots}}

    def update(grads, state, params, lr, bits=None):
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
                new = w - lr * direction
            elif spec.type in ("adam", "adamw"):
                m = spec.beta_1 * state["m"][name].astype(f32) + (1 - spec.beta_1) * g
                v = spec.beta_2 * state["v"][name].astype(f32) + (1 - spec.beta_2) * g * g
                keep("m", m)
                keep("v", v)
                # the bias corrections in float32: the step count is traced, and without jax_enable_x64 there is
                # no float64 (torch and TensorFlow round them from float64: a float32 ulp apart at most)
                t = count.astype(f32)
                step_size = (lr / (1 - jnp.power(f32(spec.beta_1), t))).astype(f32)
                root = jnp.sqrt(1 - jnp.power(f32(spec.beta_2), t)).astype(f32)
                decay = weight_decay(spec, name)  # adamw's, on w before the update, as optimizers.py does it
                decayed = w * (1 - lr * decay) if decay else w
                new = decayed - step_size * (m / (jnp.sqrt(v) / root + spec.epsilon))
            else:
                v = spec.rho * state["square_avg"][name].astype(f32) + (1 - spec.rho) * g * g
                keep("square_avg", v)
                denom = jnp.sqrt(v + spec.epsilon) if spec.epsilon_placement == "inside" else jnp.sqrt(v) + spec.epsilon
                new = w - lr * (g / denom)
            given = None
            if rounding.stochastic:
                given = bits[name] if bits is not None else draw_bits(jax.random.fold_in(step_key, index), p.shape)
            compensation = state["compensation"][name] if rounding.mode == "kahan" else None
            new_params[name], new_compensation = write_with(OPS, rounding, w, new, compensation, given)
            if new_compensation is not None:
                keep("compensation", new_compensation)
        for slot in slots:  # weights without a gradient keep their state (every weight has one here)
            new_state.setdefault(slot, {})
        return new_params, new_state

    return bind(init, update, params)
