"""The spec's optimizers and losses in MXNet, on MXNet's fused update operators with arguments chosen so
that each computes the spec's math: MXNet's own Adam class folds epsilon into a bias-corrected learning rate
("epsilon hat"), and its SGD keeps a velocity in learning-rate units (equal to the spec's buffer for a
constant rate). Gradients arrive multiplied by `rescale_grad` (1/loss-scale under AMP); the operators apply it.
"""
from __future__ import annotations

import math

import mxnet as mx
import numpy as np
from mxnet import nd
from mxnet.contrib.amp.amp import bfloat16

from harness.model.spec import PROB_EPSILON


class SpecOptimizer(mx.optimizer.Optimizer):
    SLOTS = 0

    def create_state(self, index, weight):
        return tuple(nd.zeros(weight.shape, weight.context, dtype=weight.dtype) for _ in range(self.SLOTS))


def _float64(weight) -> bool:
    """Fused update operators take their hyper-parameters as float32 attributes (0.9 becomes 0.8999999762):
    a float64 run writes each update out in NDArray operators, whose Python scalars stay float64."""
    return weight.dtype == np.float64


class SGD(SpecOptimizer):
    SLOTS = 1

    def __init__(self, learning_rate, momentum, nesterov):
        super().__init__(learning_rate=learning_rate)
        self.momentum, self.nesterov = momentum, nesterov

    def update(self, index, weight, grad, state):
        if _float64(weight):
            g = grad * self.rescale_grad
            if self.momentum == 0:
                weight[:] -= self.learning_rate * g
                return
            buf = state[0]
            buf[:] = self.momentum * buf + g
            weight[:] -= self.learning_rate * (g + self.momentum * buf if self.nesterov else buf)
            return
        kw = {"lr": self.learning_rate, "rescale_grad": self.rescale_grad, "wd": 0.0, "out": weight}
        if self.momentum == 0:
            nd.sgd_update(weight, grad, **kw)
        elif self.nesterov:  # buf = m*buf + g; w -= lr*(g + m*buf): the spec's (PyTorch's) Nesterov form
            nd.nag_mom_update(weight, grad, state[0], momentum=self.momentum, **kw)
        else:  # v = m*v - lr*g; w += v, i.e. v = -lr*buf
            nd.sgd_mom_update(weight, grad, state[0], momentum=self.momentum, **kw)


class Adam(SpecOptimizer):
    SLOTS = 2

    def __init__(self, learning_rate, beta_1, beta_2, epsilon):
        super().__init__(learning_rate=learning_rate)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def update(self, index, weight, grad, state):
        self._update_count(index)
        t = self._index_update_count[index]
        if _float64(weight):
            g, (m, v) = grad * self.rescale_grad, state
            m[:] = self.beta_1 * m + (1 - self.beta_1) * g
            v[:] = self.beta_2 * v + (1 - self.beta_2) * nd.square(g)
            m_hat, v_hat = m / (1 - self.beta_1**t), v / (1 - self.beta_2**t)
            weight[:] -= self.learning_rate * m_hat / (nd.sqrt(v_hat) + self.epsilon)
            return
        # lr*m_hat/(sqrt(v_hat)+eps) == lr'*m/(sqrt(v)+eps') with these two:
        c2 = math.sqrt(1 - self.beta_2**t)
        nd.adam_update(weight, grad, state[0], state[1], out=weight, lr=self.learning_rate * c2 / (1 - self.beta_1**t),
                       beta1=self.beta_1, beta2=self.beta_2, epsilon=self.epsilon * c2,
                       rescale_grad=self.rescale_grad, wd=0.0)


class RMSprop(SpecOptimizer):
    SLOTS = 1

    def __init__(self, learning_rate, rho, epsilon, eps_inside):
        super().__init__(learning_rate=learning_rate)
        self.rho, self.epsilon, self.eps_inside = rho, epsilon, eps_inside

    def update(self, index, weight, grad, state):
        (v,) = state
        if self.eps_inside and not _float64(weight):  # MXNet's operator: w -= lr*g/sqrt(v + eps)
            nd.rmsprop_update(weight, grad, v, out=weight, lr=self.learning_rate, gamma1=self.rho,
                              epsilon=self.epsilon, rescale_grad=self.rescale_grad, wd=0.0)
            return
        g = grad * self.rescale_grad
        v[:] = self.rho * v + (1 - self.rho) * nd.square(g)
        denom = nd.sqrt(v + self.epsilon) if self.eps_inside else nd.sqrt(v) + self.epsilon
        weight[:] -= self.learning_rate * g / denom


def make_optimizer(spec) -> mx.optimizer.Optimizer:
    if spec.type == "sgd":
        return SGD(spec.learning_rate, spec.momentum, spec.nesterov)
    if spec.type == "adam":
        return Adam(spec.learning_rate, spec.beta_1, spec.beta_2, spec.epsilon)
    return RMSprop(spec.learning_rate, spec.rho, spec.epsilon, spec.epsilon_placement == "inside")


def loss_fn(spec, outputs, labels):
    """Batch-mean loss in float32 or wider (not Gluon's per-sample losses: the trainer steps with batch 1)."""
    out = outputs.astype("float32") if outputs.dtype in (np.float16, bfloat16) else outputs
    labels = labels.astype(out.dtype)
    if spec.type == "sparse_categorical_crossentropy":
        if spec.from_logits:  # one fused operator: the summed cross-entropy of the batch
            return nd.softmax_cross_entropy(out, labels) / out.shape[0]
        logp = nd.log(nd.clip(out / out.sum(axis=-1, keepdims=True), PROB_EPSILON, 1 - PROB_EPSILON))
        return -nd.pick(logp, labels, axis=-1).mean()
    z = out[:, 0]
    if spec.from_logits:
        return (nd.relu(z) - z * labels + nd.log1p(nd.exp(-nd.abs(z)))).mean()
    p = nd.clip(z, PROB_EPSILON, 1 - PROB_EPSILON)
    return -(labels * nd.log(p) + (1 - labels) * nd.log(1 - p)).mean()
