"""The spec's optimizers and losses in MXNet.

The optimizers update the weights' arrays directly, without gluon.Trainer and mx.optimizer's per-parameter
Python bookkeeping (update counts, stale-gradient checks, updater dispatch), and create all their state when
built. They run on MXNet's fused update operators with arguments chosen so that each computes the spec's
math: MXNet's own Adam class folds epsilon into a bias-corrected learning rate ("epsilon hat"), and its SGD
keeps a velocity in learning-rate units (equal to the spec's buffer for a constant rate). Gradients arrive
multiplied by the loss scale; `step(rescale_grad)` undoes it (the operators apply it).

One operator per parameter, not the multi-tensor ones (multi_sgd_update, multi_adamw_update): on CPU these
are ~2x slower on a large tensor (784x512: 1.7 against 0.8 ms for SGD), and no faster on small ones.
"""
from __future__ import annotations

import math

import numpy as np
from mxnet import nd

from harness.model.spec import PROB_EPSILON


class SpecOptimizer:
    def __init__(self, weights: list, grads: list, slots: int):
        self.weights, self.grads = weights, grads
        # every piece of state now, not lazily in the first step (the adapter API's rule)
        self.states = [[nd.zeros(w.shape, w.context, dtype=w.dtype) for _ in range(slots)] for w in weights]
        # fused operators take their hyper-parameters as float32 attributes (0.9 becomes 0.8999999762): a float64
        # run writes each update out in NDArray operators, whose Python scalars stay float64
        self.float64 = weights[0].dtype == np.float64

    def step(self, rescale_grad: float) -> None:
        raise NotImplementedError


class SGD(SpecOptimizer):
    def __init__(self, weights, grads, learning_rate, momentum, nesterov):
        super().__init__(weights, grads, slots=1 if momentum else 0)
        self.lr, self.momentum, self.nesterov = learning_rate, momentum, nesterov

    def step(self, rescale_grad):
        lr, momentum = self.lr, self.momentum
        if self.float64:
            for weight, grad, state in zip(self.weights, self.grads, self.states):
                g = grad * rescale_grad
                if momentum == 0:
                    weight[:] -= lr * g
                    continue
                buf = state[0]
                buf[:] = momentum * buf + g
                weight[:] -= lr * (g + momentum * buf if self.nesterov else buf)
            return
        for weight, grad, state in zip(self.weights, self.grads, self.states):
            if momentum == 0:
                nd.sgd_update(weight, grad, out=weight, lr=lr, rescale_grad=rescale_grad, wd=0.0)
            elif self.nesterov:  # buf = m*buf + g; w -= lr*(g + m*buf): the spec's (PyTorch's) Nesterov form
                nd.nag_mom_update(weight, grad, state[0], out=weight, lr=lr, momentum=momentum,
                                  rescale_grad=rescale_grad, wd=0.0)
            else:  # v = m*v - lr*g; w += v, i.e. v = -lr*buf
                nd.sgd_mom_update(weight, grad, state[0], out=weight, lr=lr, momentum=momentum,
                                  rescale_grad=rescale_grad, wd=0.0)


class Adam(SpecOptimizer):
    def __init__(self, weights, grads, learning_rate, beta_1, beta_2, epsilon):
        super().__init__(weights, grads, slots=2)
        self.lr, self.beta_1, self.beta_2, self.epsilon = learning_rate, beta_1, beta_2, epsilon
        self.t = 0  # applied steps: a step skipped for overflow does not count (as in torch and Keras)

    def step(self, rescale_grad):
        self.t += 1
        b1, b2, t = self.beta_1, self.beta_2, self.t
        if self.float64:
            for weight, grad, (m, v) in zip(self.weights, self.grads, self.states):
                g = grad * rescale_grad
                m[:] = b1 * m + (1 - b1) * g
                v[:] = b2 * v + (1 - b2) * nd.square(g)
                m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
                weight[:] -= self.lr * m_hat / (nd.sqrt(v_hat) + self.epsilon)
            return
        # lr*m_hat/(sqrt(v_hat)+eps) == lr'*m/(sqrt(v)+eps') with these two:
        c2 = math.sqrt(1 - b2**t)
        lr, epsilon = self.lr * c2 / (1 - b1**t), self.epsilon * c2
        for weight, grad, (m, v) in zip(self.weights, self.grads, self.states):
            nd.adam_update(weight, grad, m, v, out=weight, lr=lr, beta1=b1, beta2=b2, epsilon=epsilon,
                           rescale_grad=rescale_grad, wd=0.0)


class RMSprop(SpecOptimizer):
    def __init__(self, weights, grads, learning_rate, rho, epsilon, eps_inside):
        super().__init__(weights, grads, slots=1)
        self.lr, self.rho, self.epsilon, self.eps_inside = learning_rate, rho, epsilon, eps_inside

    def step(self, rescale_grad):
        for weight, grad, (v,) in zip(self.weights, self.grads, self.states):
            if self.eps_inside and not self.float64:  # MXNet's operator: w -= lr*g/sqrt(v + eps)
                nd.rmsprop_update(weight, grad, v, out=weight, lr=self.lr, gamma1=self.rho, epsilon=self.epsilon,
                                  rescale_grad=rescale_grad, wd=0.0)
                continue
            g = grad * rescale_grad
            v[:] = self.rho * v + (1 - self.rho) * nd.square(g)
            denom = nd.sqrt(v + self.epsilon) if self.eps_inside else nd.sqrt(v) + self.epsilon
            weight[:] -= self.lr * g / denom


def make_optimizer(spec, params: list) -> SpecOptimizer:
    """The spec's optimizer over these trainable Gluon parameters (on one context): their weight and gradient
    arrays."""
    weights, grads = [p.data() for p in params], [p.grad() for p in params]
    if spec.type == "sgd":
        return SGD(weights, grads, spec.learning_rate, spec.momentum, spec.nesterov)
    if spec.type == "adam":
        return Adam(weights, grads, spec.learning_rate, spec.beta_1, spec.beta_2, spec.epsilon)
    return RMSprop(weights, grads, spec.learning_rate, spec.rho, spec.epsilon, spec.epsilon_placement == "inside")


def loss_fn(F, spec, outputs, labels, cast: bool):
    """Batch-mean loss of `outputs` against `labels` (float32, or float64 in float64 runs), in float32 or wider
    (not Gluon's per-sample losses). In F (nd or sym) operators: it runs inside the hybridized training graph.
    `cast`: the outputs are float16 or bfloat16 (amp_cast leaves float32 and float64 alone)."""
    out = F.amp_cast(outputs, dtype="float32") if cast else outputs
    if spec.type == "sparse_categorical_crossentropy":
        if spec.from_logits:
            logp = F.log_softmax(out, axis=-1)
        else:
            logp = F.log(F.clip(F.broadcast_div(out, F.sum(out, axis=-1, keepdims=True)), PROB_EPSILON,
                                1 - PROB_EPSILON))
        return -F.mean(F.pick(logp, labels, axis=-1))
    z = F.reshape(F.slice_axis(out, axis=1, begin=0, end=1), shape=(-1,))
    if spec.from_logits:
        return F.mean(F.relu(z) - z * labels + F.log1p(F.exp(-F.abs(z))))
    p = F.clip(z, PROB_EPSILON, 1 - PROB_EPSILON)
    return -F.mean(labels * F.log(p) + (1 - labels) * F.log(1 - p))
