"""The spec's optimizers and losses in Keras 3 ops. All three optimizers are written out: Keras' Adam
folds epsilon into a bias-corrected learning rate ("epsilon hat") and its SGD keeps a velocity in learning-rate
units, so their rounding and, for Adam, their math differ from the spec's. Hyper-parameters are used as
Python floats converted to the variable's dtype (not Keras' float learning-rate variable): exact in float64."""
from __future__ import annotations

import keras
from keras import ops

from harness.model.spec import PROB_EPSILON


class SpecOptimizer(keras.optimizers.Optimizer):
    SLOTS: tuple[str, ...] = ()

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.slots = {name: self.add_optimizer_variables(var_list, name) for name in self.SLOTS}

    def slot(self, name, variable):
        return self.slots[name][self._get_variable_index(variable)]


def _const(value: float, like):
    """A Python hyper-parameter as a tensor of `like`'s dtype, converted directly: `ops.cast(0.9, "float64")`
    would go through float32 first (0.8999999761...), which an fp64 run must not."""
    return ops.convert_to_tensor(value, dtype=like.dtype)


class SGD(SpecOptimizer):
    SLOTS = ("momentum",)

    def __init__(self, learning_rate, momentum, nesterov, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_sgd", **kwargs)
        self.lr, self.momentum, self.nesterov = learning_rate, momentum, nesterov

    def update_step(self, gradient, variable, learning_rate):
        lr, g = _const(self.lr, variable), ops.cast(gradient, variable.dtype)
        if self.momentum == 0:
            self.assign_sub(variable, lr * g)
            return
        momentum, buf = _const(self.momentum, variable), self.slot("momentum", variable)
        # torch's first step sets buf = g; with buf starting at 0, momentum*0 + g is the same
        self.assign(buf, momentum * buf + g)
        step = g + momentum * buf if self.nesterov else buf
        self.assign_sub(variable, lr * step)


class Adam(SpecOptimizer):
    SLOTS = ("m", "v")

    def __init__(self, learning_rate, beta_1, beta_2, epsilon, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_adam", **kwargs)
        self.lr, self.beta_1, self.beta_2, self.epsilon = learning_rate, beta_1, beta_2, epsilon

    def update_step(self, gradient, variable, learning_rate):
        c = lambda value: _const(value, variable)  # noqa: E731
        g = ops.cast(gradient, variable.dtype)
        t = ops.cast(self.iterations + 1, variable.dtype)
        m, v = self.slot("m", variable), self.slot("v", variable)
        self.assign(m, c(self.beta_1) * m + c(1 - self.beta_1) * g)
        self.assign(v, c(self.beta_2) * v + c(1 - self.beta_2) * ops.square(g))
        m_hat = m / (c(1.0) - ops.power(c(self.beta_1), t))
        v_hat = v / (c(1.0) - ops.power(c(self.beta_2), t))
        self.assign_sub(variable, c(self.lr) * m_hat / (ops.sqrt(v_hat) + c(self.epsilon)))


class RMSprop(SpecOptimizer):
    SLOTS = ("square_avg",)

    def __init__(self, learning_rate, rho, epsilon, eps_inside, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_rmsprop", **kwargs)
        self.lr, self.rho, self.epsilon, self.eps_inside = learning_rate, rho, epsilon, eps_inside

    def update_step(self, gradient, variable, learning_rate):
        c = lambda value: _const(value, variable)  # noqa: E731
        g = ops.cast(gradient, variable.dtype)
        v = self.slot("square_avg", variable)
        self.assign(v, c(self.rho) * v + c(1 - self.rho) * ops.square(g))
        denom = ops.sqrt(v + c(self.epsilon)) if self.eps_inside else ops.sqrt(v) + c(self.epsilon)
        self.assign_sub(variable, c(self.lr) * g / denom)


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
