"""The spec's optimizers, gradient clipping and losses as pure jax.numpy functions.

The optimizers are written out rather than taken from optax: optax's Adam puts epsilon in the same place but
its RMSprop has epsilon inside the square root only, its adamw decays whatever its mask says rather than the
weights harness.model.optimizer.weight_decay names, and the hyper-parameters here stay Python floats, which
JAX types weakly: they take the weights' dtype, so a float64 run computes them in float64.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from harness.model.optimizer import weight_decay
from harness.model.training import ClipOps, LossOps, clip_factor_with

_map = jax.tree.map


class Optimizer(NamedTuple):
    update: Callable  # (grads, state, params, learning rate) -> (new params, new state)
    state: Any  # the state of the weights it was made for: every slot, created in build (none lazily in a step)


def bind(init: Callable, update: Callable, params) -> Optimizer:
    """An optimizer (`init`: params -> state, `update`) made for `params`: its state created now, on their device."""
    return Optimizer(update, jax.block_until_ready(jax.jit(init)(params)))


def _as(value, dtype):
    """A Python float or a traced scalar in `dtype`: for a Python float, the constant it becomes, weakly typed,
    in an operation with an array of that dtype (a traced float32 rate would otherwise promote 16-bit weights)."""
    return jnp.asarray(value, dtype)


def make_optimizer(spec, params) -> Optimizer:
    """The spec's optimizer over `params` (canonical weight name -> array), with all its state."""
    if spec.type == "sgd":
        m = spec.momentum
        if m == 0:  # plain SGD keeps no state
            return bind(lambda w: {}, lambda g, s, p, lr: (_map(lambda p, g: p - _as(lr, p.dtype) * g, p, g), s),
                        params)

        def sgd(grads, state, params, lr):
            buf = _map(lambda b, g: m * b + g, state["momentum"], grads)
            step = _map(lambda g, b: g + m * b, grads, buf) if spec.nesterov else buf
            return _map(lambda p, d: p - _as(lr, p.dtype) * d, params, step), {"momentum": buf}

        return bind(lambda w: {"momentum": _map(jnp.zeros_like, w)}, sgd, params)
    if spec.type in ("adam", "adamw"):
        b1, b2, eps = spec.beta_1, spec.beta_2, spec.epsilon

        def adam(grads, state, params, lr):
            count = state["count"] + 1
            mu = _map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
            nu = _map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
            # the bias corrections in float32 at least (float64 in a float64 run), whatever the weights' dtype
            t = count.astype(jnp.promote_types(jax.tree.leaves(params)[0].dtype, jnp.float32))
            step_size, root = _as(lr, t.dtype) / (1 - b1**t), jnp.sqrt(1 - b2**t)

            # the spec's lr*m_hat/(sqrt(v_hat) + eps), arranged as PyTorch's Adam computes it; adamw first
            # decays p by lr*decay*p, as PyTorch's AdamW does (the same p on both sides)
            def apply(name, p, m, v):
                decay = weight_decay(spec, name)
                if decay:
                    p = p * _as(1 - lr * decay, p.dtype)
                return p - step_size.astype(p.dtype) * (m / (jnp.sqrt(v) / root.astype(p.dtype) + eps))

            new_params = {name: apply(name, p, mu[name], nu[name]) for name, p in params.items()}
            return new_params, {"count": count, "m": mu, "v": nu}

        return bind(lambda w: {"count": jnp.zeros((), jnp.int32), "m": _map(jnp.zeros_like, w),
                               "v": _map(jnp.zeros_like, w)}, adam, params)
    rho, eps, inside = spec.rho, spec.epsilon, spec.epsilon_placement == "inside"

    def rmsprop(grads, state, params, lr):
        sq = _map(lambda v, g: rho * v + (1 - rho) * g * g, state["square_avg"], grads)
        denom = _map(lambda v: jnp.sqrt(v + eps) if inside else jnp.sqrt(v) + eps, sq)
        return _map(lambda p, g, d: p - _as(lr, p.dtype) * (g / d), params, grads, denom), {"square_avg": sq}

    return bind(lambda w: {"square_avg": _map(jnp.zeros_like, w)}, rmsprop, params)


def clip_by_global_norm(grads, clip_norm: float, finite=None, dtype=None):
    """The gradients times the spec's clipping factor (harness.model.training.clip_factor_with, `finite` the loss
    scaler's verdict), their norm in float32 at least; the clipped gradients in `dtype` (default their own)."""
    leaves = jax.tree.leaves(grads)
    acc = jnp.promote_types(leaves[0].dtype, jnp.float32)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(acc))) for g in leaves))
    factor = clip_factor_with(CLIP_OPS, norm, clip_norm, finite)
    return _map(lambda g: (g.astype(acc) * factor).astype(dtype or g.dtype), grads)


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
