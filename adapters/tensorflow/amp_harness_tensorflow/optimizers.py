"""The spec's optimizers and losses in Keras 3 ops. All three optimizers are written out: Keras' Adam
folds epsilon into a bias-corrected learning rate ("epsilon hat") and its SGD keeps a velocity in learning-rate
units, so their rounding and, for Adam, their math differ from the spec's."""
from __future__ import annotations

import keras
from keras import ops

from harness.spec import PROB_EPSILON


class SpecOptimizer(keras.optimizers.Optimizer):
    SLOTS: tuple[str, ...] = ()

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.slots = {name: self.add_optimizer_variables(var_list, name) for name in self.SLOTS}

    def slot(self, name, variable):
        return self.slots[name][self._get_variable_index(variable)]


class SGD(SpecOptimizer):
    SLOTS = ("momentum",)

    def __init__(self, learning_rate, momentum, nesterov, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_sgd", **kwargs)
        self.momentum, self.nesterov = momentum, nesterov

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        if self.momentum == 0:
            self.assign_sub(variable, lr * g)
            return
        buf = self.slot("momentum", variable)
        # torch's first step sets buf = g; with buf starting at 0, momentum*0 + g is the same
        self.assign(buf, self.momentum * buf + g)
        step = g + self.momentum * buf if self.nesterov else buf
        self.assign_sub(variable, lr * step)


class Adam(SpecOptimizer):
    SLOTS = ("m", "v")

    def __init__(self, learning_rate, beta_1, beta_2, epsilon, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_adam", **kwargs)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        t = ops.cast(self.iterations + 1, variable.dtype)
        m, v = self.slot("m", variable), self.slot("v", variable)
        self.assign(m, self.beta_1 * m + (1 - self.beta_1) * g)
        self.assign(v, self.beta_2 * v + (1 - self.beta_2) * ops.square(g))
        m_hat = m / (1 - ops.power(ops.cast(self.beta_1, variable.dtype), t))
        v_hat = v / (1 - ops.power(ops.cast(self.beta_2, variable.dtype), t))
        self.assign_sub(variable, lr * m_hat / (ops.sqrt(v_hat) + self.epsilon))


class RMSprop(SpecOptimizer):
    SLOTS = ("square_avg",)

    def __init__(self, learning_rate, rho, epsilon, eps_inside, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_rmsprop", **kwargs)
        self.rho, self.epsilon, self.eps_inside = rho, epsilon, eps_inside

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        v = self.slot("square_avg", variable)
        self.assign(v, self.rho * v + (1 - self.rho) * ops.square(g))
        denom = ops.sqrt(v + self.epsilon) if self.eps_inside else ops.sqrt(v) + self.epsilon
        self.assign_sub(variable, lr * g / denom)


def make_optimizer(spec) -> keras.optimizers.Optimizer:
    if spec.type == "sgd":
        return SGD(spec.learning_rate, spec.momentum, spec.nesterov)
    if spec.type == "adam":
        return Adam(spec.learning_rate, spec.beta_1, spec.beta_2, spec.epsilon)
    return RMSprop(spec.learning_rate, spec.rho, spec.epsilon, spec.epsilon_placement == "inside")


def loss_fn(spec, outputs, labels):
    """Batch-mean loss in float32 (or float64 for float64 outputs), whatever the compute dtype."""
    out = outputs if outputs.dtype == "float64" else ops.cast(outputs, "float32")
    if spec.type == "sparse_categorical_crossentropy":
        if spec.from_logits:
            logp = ops.log_softmax(out, axis=-1)
        else:
            logp = ops.log(ops.clip(out / ops.sum(out, axis=-1, keepdims=True), PROB_EPSILON, 1 - PROB_EPSILON))
        return -ops.mean(ops.take_along_axis(logp, ops.expand_dims(labels, -1), axis=-1))
    z, y = out[:, 0], ops.cast(labels, out.dtype)
    if spec.from_logits:
        return ops.mean(ops.relu(z) - z * y + ops.log1p(ops.exp(-ops.abs(z))))
    p = ops.clip(z, PROB_EPSILON, 1 - PROB_EPSILON)
    return -ops.mean(y * ops.log(p) + (1 - y) * ops.log(1 - p))
