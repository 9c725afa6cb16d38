"""The spec's optimizers and losses in TensorFlow. Keras' own Adam folds epsilon into a bias-corrected learning
rate ("epsilon hat"), so its math differs from the spec's, and its optimizers are written out in Keras ops, a
pass over memory per operation. Adam and SGD here run on TensorFlow's fused training kernels (one pass per
variable; `tf.raw_ops.ResourceApply*`) with arguments chosen so that each computes the spec's math; RMSprop,
which has no fused kernel without a momentum slot, is written out. Hyper-parameters are Python floats converted
to the variable's dtype (not Keras' float learning-rate variable): exact in float64."""
from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from harness.adapter import UPDATE_SCOPE
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

    def apply(self, grads, trainable_variables=None):
        # a profile's update part, also where LossScaleOptimizer (the loss-scale part) calls this: a name scope is
        # a name in the graph, free at run time
        with tf.name_scope(UPDATE_SCOPE):
            return super().apply(grads, trainable_variables)


def _const(value: float, like):
    """A Python hyper-parameter as a tensor of `like`'s dtype, converted directly: `ops.cast(0.9, "float64")`
    would go through float32 first (0.8999999761...), which an fp64 run must not."""
    return ops.convert_to_tensor(value, dtype=like.dtype)


class SGD(SpecOptimizer):
    def __init__(self, learning_rate, momentum, nesterov, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_sgd", **kwargs)
        self.lr, self.momentum, self.nesterov = learning_rate, momentum, nesterov
        self.SLOTS = ("momentum",) if momentum else ()  # plain SGD has no state

    def update_step(self, gradient, variable, learning_rate):
        lr, g = _const(self.lr, variable), ops.cast(gradient, variable.dtype)
        if self.momentum == 0:
            tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=lr, delta=g)
            return
        # the kernel keeps a velocity in learning-rate units, v = m*v - lr*g = -lr*buf: w += v is the spec's
        # w -= lr*buf (buf = m*buf + g), and with Nesterov w += m*v - lr*g its w -= lr*(g + m*buf)
        velocity = self.slot("momentum", variable)
        tf.raw_ops.ResourceApplyKerasMomentum(var=variable.handle, accum=velocity.handle, lr=lr, grad=g,
                                              momentum=_const(self.momentum, variable), use_nesterov=self.nesterov)


class Adam(SpecOptimizer):
    SLOTS = ("m", "v")

    def __init__(self, learning_rate, beta_1, beta_2, epsilon, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_adam", **kwargs)
        self.lr, self.beta_1, self.beta_2, self.epsilon = learning_rate, beta_1, beta_2, epsilon

    def update_step(self, gradient, variable, learning_rate):
        c = lambda value: _const(value, variable)  # noqa: E731
        t = ops.cast(self.iterations + 1, variable.dtype)
        beta_1_power, beta_2_power = ops.power(c(self.beta_1), t), ops.power(c(self.beta_2), t)
        # the kernel: w -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v) + eps'); with eps' = eps*sqrt(1-b2^t) that is
        # the spec's lr*m_hat/(sqrt(v_hat) + eps)
        epsilon = c(self.epsilon) * ops.sqrt(c(1.0) - beta_2_power)
        m, v = self.slot("m", variable), self.slot("v", variable)
        tf.raw_ops.ResourceApplyAdam(var=variable.handle, m=m.handle, v=v.handle, beta1_power=beta_1_power,
                                     beta2_power=beta_2_power, lr=c(self.lr), beta1=c(self.beta_1),
                                     beta2=c(self.beta_2), epsilon=epsilon, grad=ops.cast(gradient, variable.dtype))


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


def make_optimizer(spec, variables) -> keras.optimizers.Optimizer:
    """The spec's optimizer over these trainable variables, built: every slot created now."""
    if spec.type == "sgd":
        optimizer = SGD(spec.learning_rate, spec.momentum, spec.nesterov)
    elif spec.type == "adam":
        optimizer = Adam(spec.learning_rate, spec.beta_1, spec.beta_2, spec.epsilon)
    else:
        optimizer = RMSprop(spec.learning_rate, spec.rho, spec.epsilon, spec.epsilon_placement == "inside")
    optimizer.build(variables)
    return optimizer


def loss_fn(spec, outputs, labels):
    """Batch-mean loss in float32 (or float64 for float64 outputs), whatever the compute dtype. Next-token labels
    [N, T] with outputs [N, T, vocab]: the mean over every token of the batch."""
    out = outputs if outputs.dtype == "float64" else ops.cast(outputs, "float32")
    if spec.type == "sparse_categorical_crossentropy":
        if spec.from_logits:  # one fused kernel (log-softmax and pick), and its gradient softmax - onehot
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=out))
        logp = ops.log(ops.clip(out / ops.sum(out, axis=-1, keepdims=True), PROB_EPSILON, 1 - PROB_EPSILON))
        # one gather, not take_along_axis (a dozen index-building operations): each label's class, on the last axis
        rank = len(labels.shape)
        return -ops.mean(tf.gather(logp, labels, axis=rank, batch_dims=rank))
    z, y = out[:, 0], ops.cast(labels, out.dtype)
    if spec.from_logits:
        return ops.mean(ops.relu(z) - z * y + ops.log1p(ops.exp(-ops.abs(z))))
    p = ops.clip(z, PROB_EPSILON, 1 - PROB_EPSILON)
    return -ops.mean(y * ops.log(p) + (1 - y) * ops.log(1 - p))
