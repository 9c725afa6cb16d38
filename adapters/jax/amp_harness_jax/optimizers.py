"""The spec's optimizers, gradient clipping and losses as pure jax.numpy functions.

The optimizers run the core's update (harness.rounding.update_with) rather than optax's: optax's Adam puts
epsilon in the same place but its RMSprop has epsilon inside the square root only, its adamw decays whatever its
mask says rather than the weights harness.model.optimizer.weight_decay names, and the hyper-parameters here stay
Python floats, which JAX types weakly: they take the weights' dtype, so a float64 run computes them in float64.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from harness.model.optimizer import weight_decay
from harness.model.training import ClipOps, LossOps, clip_factor_with
from harness.rounding import rounded_slots, update_scalars, update_with


class Optimizer(NamedTuple):
    update: Callable  # (grads, state, params, learning rate, rounding bits or None) -> (new params, new state)
    state: Any  # the state of the weights it was made for: every slot, created in build (none lazily in a step)


def per_weight(params, slots: tuple[str, ...], for_step: Callable) -> Optimizer:
    """An optimizer over `params` (canonical weight name -> array) whose state, created now on their device, is the
    step count and, per slot, a zero array per weight. Its update asks `for_step(lr, count, bits)` for the step's
    update of one weight, `(index, name, weight, gradient, its slots) -> (new weight, new slots)`, runs it on each
    weight in canonical order, and keeps the slots in the dtype they were created in."""
    def update(grads, state, params, lr, bits=None):
        count = state["count"] + 1
        update_weight = for_step(lr, count, bits)
        new_params, new_state = {}, {"count": count, **{slot: {} for slot in slots}}
        for index, (name, p) in enumerate(sorted(params.items())):
            new_params[name], kept = update_weight(index, name, p, grads[name], {s: state[s][name] for s in slots})
            for slot, value in kept.items():
                new_state[slot][name] = value.astype(state[slot][name].dtype)
        return new_params, new_state

    state = {"count": jnp.zeros((), jnp.int32), **{slot: jax.tree.map(jnp.zeros_like, params) for slot in slots}}
    # committed to the weights' device, as the step returns the state: uncommitted arrays would make the second step
    # compile again (a different placement is a different executable)
    return Optimizer(update, jax.block_until_ready(jax.device_put(state, jax.tree.leaves(params)[0].sharding)))


def make_optimizer(spec, params) -> Optimizer:
    """The spec's optimizer over `params` (canonical weight name -> array), with all its state, computing in the
    weights' own dtype (the slots are read as stored)."""
    dtype = jax.tree.leaves(params)[0].dtype

    def computed(fn, lr, t):  # the rate and Adam's bias corrections in float32 at least, float64 in a float64 run
        return fn(lr, t.astype(jnp.promote_types(dtype, jnp.float32)), jnp.sqrt)

    def in_dtype(scalars):  # a Python float straight to the weights' dtype (a traced float32 one would promote them)
        return tuple(jnp.asarray(x, dtype) for x in scalars)

    ops = SimpleNamespace(to_float32=lambda x: x, sqrt=jnp.sqrt, scalars=lambda *args: in_dtype(computed(*args)))

    def for_step(lr, t, bits):
        # the step's scalars computed once and cast per weight: XLA rewrites x / sqrt(s) as x * rsqrt(s) where
        # sqrt(s) has one user, so where they are computed and cast decides the results' last bit
        scalars = update_scalars(SimpleNamespace(scalars=computed), spec, lr, t)
        return lambda index, name, p, g, slots: update_with(ops, spec, p, g, slots, lr, t, weight_decay(spec, name),
                                                            in_dtype(scalars))

    return per_weight(params, rounded_slots(spec), for_step)


def clip_by_global_norm(grads, clip_norm: float, finite=None, dtype=None):
    """The gradients times the spec's clipping factor (harness.model.training.clip_factor_with, `finite` the loss
    scaler's verdict), their norm in float32 at least; the clipped gradients in `dtype` (default their own)."""
    leaves = jax.tree.leaves(grads)
    acc = jnp.promote_types(leaves[0].dtype, jnp.float32)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(acc))) for g in leaves))
    factor = clip_factor_with(CLIP_OPS, norm, clip_norm, finite)
    return jax.tree.map(lambda g: (g.astype(acc) * factor).astype(dtype or g.dtype), grads)


def _nll(logp, labels):
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


LOSS_OPS = LossOps(
    upcast=lambda x: x if x.dtype == jnp.float64 else x.astype(jnp.float32),
    softmax_cross_entropy=lambda out, labels: _nll(jax.nn.log_softmax(out, axis=-1), labels),
    normalized=lambda x: x / x.sum(axis=-1, keepdims=True), nll=_nll,
    first_column=lambda x: x[:, 0], labels_like=lambda labels, out: labels.astype(out.dtype),
    clip=jnp.clip, log=jnp.log, log1p=jnp.log1p, exp=jnp.exp, abs=jnp.abs, relu=jax.nn.relu, mean=jnp.mean,
)
CLIP_OPS = ClipOps(full_like=jnp.full_like, maximum=jnp.maximum, where=jnp.where, ones_like=jnp.ones_like)
