"""The spec's optimizers and losses in MXNet.

The optimizers update the weights' arrays directly, without gluon.Trainer and mx.optimizer's per-parameter
Python bookkeeping (update counts, stale-gradient checks, updater dispatch). They run on MXNet's fused update
operators with arguments chosen so that each computes the spec's math: MXNet's own Adam class folds epsilon into
a bias-corrected learning rate ("epsilon hat"), and its SGD keeps its momentum in learning-rate units.

One operator per parameter, not the multi-tensor ones (multi_sgd_update, multi_adamw_update): on CPU these
are ~2x slower on a large tensor (784x512: 1.7 against 0.8 ms for SGD), and no faster on small ones.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from mxnet import nd

from harness.model.optimizer import scheduled, weight_decay
from harness.model.training import ClipOps, LossOps, clip_factor_with


class SpecOptimizer:
    def __init__(self, weights: list, grads: list, slots: int, clip_norm: float | None):
        self.weights, self.grads, self.clip_norm = weights, grads, clip_norm
        self.states = [[nd.zeros(w.shape, w.context, dtype=w.dtype) for _ in range(slots)] for w in weights]
        # fused operators take their hyper-parameters as float32 attributes (0.9 becomes 0.8999999762): a float64
        # run writes each update out in NDArray operators, whose Python scalars stay float64
        self.float64 = weights[0].dtype == np.float64

    def step(self, rescale_grad: float, learning_rate: float) -> None:
        """One update with gradients `rescale_grad` times the true (unscaled) ones, at the step's rate."""
        if self.clip_norm is not None:
            # the clip folded into the rescale (the fused operators take scalars as attributes): one host sync
            rescale_grad *= clip_factor_with(HOST_CLIP_OPS, self.global_norm() * rescale_grad, self.clip_norm)
        self.update(rescale_grad, learning_rate)  # the subclass's

    def global_norm(self) -> float:
        """sqrt of the sum of squares over every gradient as they are: in float32 (16-bit gradients widened
        first: multi_sum_sq sums float16 in float16), in float64 in float64 runs (multi_sum_sq sums in float32)."""
        if self.float64:
            squares = nd.add_n(*[nd.sum(nd.square(g)) for g in self.grads])
        else:
            wide = [g if g.dtype == np.float32 else g.astype("float32") for g in self.grads]
            squares = nd.sum(nd.multi_sum_sq(*wide, num_arrays=len(wide)))
        return math.sqrt(float(squares.asscalar()))


class SGD(SpecOptimizer):
    def __init__(self, weights, grads, clip_norm, momentum, nesterov, scheduled):
        super().__init__(weights, grads, slots=1 if momentum else 0, clip_norm=clip_norm)
        self.momentum, self.nesterov = momentum, nesterov
        # the operators' momentum is -lr*buf: a rate that changes from step to step would rescale the past steps'
        self.written_out = self.float64 or (scheduled and momentum)

    def update(self, rescale_grad, lr):
        momentum = self.momentum
        if self.written_out:
            for weight, grad, state in zip(self.weights, self.grads, self.states):
                g = grad * rescale_grad
                if momentum:  # state[0]: the momentum buffer
                    state[0][:] = momentum * state[0] + g
                    g = g + momentum * state[0] if self.nesterov else state[0]
                weight[:] -= lr * g
            return
        for weight, grad, state in zip(self.weights, self.grads, self.states):
            if momentum == 0:
                nd.sgd_update(weight, grad, out=weight, lr=lr, rescale_grad=rescale_grad, wd=0.0)
            else:  # v = m*v - lr*g, i.e. v = -lr*buf; w += v, or Nesterov's w += m*v - lr*g: w -= lr*(g + m*buf)
                update = nd.nag_mom_update if self.nesterov else nd.sgd_mom_update
                update(weight, grad, state[0], out=weight, lr=lr, momentum=momentum, rescale_grad=rescale_grad, wd=0.0)


class Adam(SpecOptimizer):
    """Adam, and AdamW where `decays` (per weight, from the core) are not all 0: Adam's operator on the weights
    the core exempts from decay, contrib.adamw_update, whose decay is decoupled, on the others (it rescales the
    gradient in place: harmless, the next backward writes it anew)."""

    def __init__(self, weights, grads, clip_norm, beta_1, beta_2, epsilon, decays):
        super().__init__(weights, grads, slots=2, clip_norm=clip_norm)
        self.beta_1, self.beta_2, self.epsilon, self.decays = beta_1, beta_2, epsilon, decays
        self.t = 0  # applied steps: a step skipped for overflow does not count (as in torch and Keras)

    def update(self, rescale_grad, lr):
        self.t += 1
        b1, b2, t = self.beta_1, self.beta_2, self.t
        if self.float64:
            for weight, grad, (m, v), decay in zip(self.weights, self.grads, self.states, self.decays):
                g = grad * rescale_grad
                m[:] = b1 * m + (1 - b1) * g
                v[:] = b2 * v + (1 - b2) * nd.square(g)
                m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
                if decay:  # the weight before the update on both sides
                    weight[:] -= lr * (m_hat / (nd.sqrt(v_hat) + self.epsilon) + decay * weight)
                else:
                    weight[:] -= lr * m_hat / (nd.sqrt(v_hat) + self.epsilon)
            return
        # lr*m_hat/(sqrt(v_hat)+eps) == lr'*m/(sqrt(v)+eps') with these two; adamw_update multiplies its lr and its
        # decay by eta, which is the step's rate there: w -= eta*(lr''*m/(sqrt(v)+eps') + wd*w), lr'' = lr'/lr
        c2 = math.sqrt(1 - b2**t)
        corrected_lr, epsilon = lr * c2 / (1 - b1**t), self.epsilon * c2
        correction = c2 / (1 - b1**t)
        for weight, grad, (m, v), decay in zip(self.weights, self.grads, self.states, self.decays):
            if decay:
                nd.contrib.adamw_update(weight, grad, m, v, rescale_grad, out=weight, lr=correction, eta=lr,
                                        beta1=b1, beta2=b2, epsilon=epsilon, wd=decay)
            else:
                nd.adam_update(weight, grad, m, v, out=weight, lr=corrected_lr, beta1=b1, beta2=b2, epsilon=epsilon,
                               rescale_grad=rescale_grad, wd=0.0)


class RMSprop(SpecOptimizer):
    def __init__(self, weights, grads, clip_norm, rho, epsilon, eps_inside):
        super().__init__(weights, grads, slots=1, clip_norm=clip_norm)
        self.rho, self.epsilon, self.eps_inside = rho, epsilon, eps_inside

    def update(self, rescale_grad, lr):
        for weight, grad, (v,) in zip(self.weights, self.grads, self.states):
            if self.eps_inside and not self.float64:  # MXNet's operator: w -= lr*g/sqrt(v + eps)
                nd.rmsprop_update(weight, grad, v, out=weight, lr=lr, gamma1=self.rho, epsilon=self.epsilon,
                                  rescale_grad=rescale_grad, wd=0.0)
                continue
            g = grad * rescale_grad
            v[:] = self.rho * v + (1 - self.rho) * nd.square(g)
            denom = nd.sqrt(v + self.epsilon) if self.eps_inside else nd.sqrt(v) + self.epsilon
            weight[:] -= lr * g / denom


def make_optimizer(spec, params: list, names: list[str]) -> SpecOptimizer:
    """The spec's optimizer over these trainable Gluon parameters (on one context), whose canonical weight names
    are `names`: their weight and gradient arrays. Its step takes the rate (the schedule's, or the constant)."""
    weights, grads, clip = [p.data() for p in params], [p.grad() for p in params], spec.clip_norm
    if spec.type == "sgd":
        return SGD(weights, grads, clip, spec.momentum, spec.nesterov, scheduled(spec))
    if spec.type in ("adam", "adamw"):
        return Adam(weights, grads, clip, spec.beta_1, spec.beta_2, spec.epsilon,
                    [weight_decay(spec, name) for name in names])
    return RMSprop(weights, grads, clip, spec.rho, spec.epsilon, spec.epsilon_placement == "inside")


# the clipping factor on the host, in Python floats (the fused operators take it as an attribute); a step the
# scaler skips never reaches it, so it needs no where
HOST_CLIP_OPS = ClipOps(full_like=lambda norm, value: value, maximum=max, where=None, ones_like=None)


@functools.lru_cache(maxsize=None)
def loss_ops(F, cast: bool) -> LossOps:
    """harness.model.training's primitives in F (nd or sym) operators: the loss (loss_with: a batch mean in
    float32 or wider, not Gluon's per-sample losses) runs inside the hybridized training graph. `cast`: the
    outputs are float16 or bfloat16 (amp_cast leaves float32 and float64 alone)."""
    def nll(logp, labels):
        return -F.mean(F.pick(logp, labels, axis=-1))

    return LossOps(
        upcast=lambda x: F.amp_cast(x, dtype="float32") if cast else x,
        softmax_cross_entropy=lambda out, labels: nll(F.log_softmax(out, axis=-1), labels),
        normalized=lambda x: F.broadcast_div(x, F.sum(x, axis=-1, keepdims=True)), nll=nll,
        first_column=lambda x: F.reshape(F.slice_axis(x, axis=1, begin=0, end=1), shape=(-1,)),
        labels_like=lambda labels, out: labels,  # float32, or float64 in float64 runs, as the trainer gives them
        clip=F.clip, log=F.log, log1p=F.log1p, exp=F.exp, abs=F.abs, relu=F.relu, mean=F.mean)
