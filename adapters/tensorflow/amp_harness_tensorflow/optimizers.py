"""The spec's optimizers and losses in TensorFlow. Keras' own Adam folds epsilon into a bias-corrected learning
rate ("epsilon hat") and its AdamW decays every variable not excluded by name, so their math differs from the
spec's, and its optimizers are written out in Keras ops, a pass over memory per operation. Adam (AdamW too) and
SGD here run on TensorFlow's fused training kernels (one pass per variable; `tf.raw_ops.ResourceApply*`) with
arguments chosen so that each computes the spec's math; RMSprop, which has no fused kernel without a momentum
slot, is written out. Hyper-parameters are Python floats converted to the variable's dtype (_const; not Keras' float
learning-rate variable), and a schedule's rate is a float64 variable the trainer sets (scheduled_rate)."""
from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from harness.adapter import UPDATE_SCOPE
from harness.model.optimizer import scheduled, weight_decay
from harness.model.training import ClipOps, LossOps, clip_factor_with


class SpecOptimizer(keras.optimizers.Optimizer):
    """The spec's rules every optimizer here shares: the step's learning rate, AdamW's decay, the clipping."""
    SLOTS: tuple[str, ...] = ()

    def __init__(self, spec, weight_names, kinds=None, name=None):
        super().__init__(learning_rate=spec.learning_rate, name=name or f"spec_{spec.type}")
        self.spec = spec
        # by the order of the variables build is given: the decay harness.model.optimizer gives each weight (a
        # native model's by its kind)
        self.decays = [weight_decay(spec, weight, (kinds or {}).get(weight)) for weight in weight_names]
        self.scheduled_rate = tf.Variable(spec.learning_rate, dtype=tf.float64, trainable=False,
                                          name="scheduled_rate") if scheduled(spec) else None

    def build(self, var_list):
        if not self.built:  # LossScaleOptimizer's build builds its inner optimizer again
            super().build(var_list)
            self.slots = {name: self.add_optimizer_variables(var_list, name) for name in self.SLOTS}

    def slot(self, name, variable):
        return self.slots[name][self._get_variable_index(variable)]

    def decay_of(self, variable) -> float:
        return self.decays[self._get_variable_index(variable)]

    def rate(self, dtype):
        """The step's learning rate in `dtype`: the spec's constant converted directly, or the schedule's."""
        if self.scheduled_rate is None:
            return ops.convert_to_tensor(self.spec.learning_rate, dtype=dtype)
        return ops.cast(self.scheduled_rate, dtype)

    def apply(self, grads, trainable_variables=None):
        # a profile's update part, also where LossScaleOptimizer (the loss-scale part) calls this, with the
        # unscaled gradients of a step its finite check let through
        with tf.name_scope(UPDATE_SCOPE):
            if self.spec.clip_norm is not None:
                # the spec's clipping factor (harness.model.training), in float32 for 16-bit gradients and float64
                # for float64 ones: the update casts them to its own dtype
                dtype = tf.float64 if grads[0].dtype == tf.float64 else tf.float32
                grads = [tf.cast(g, dtype) for g in grads]
                norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads]))
                scale = clip_factor_with(CLIP_OPS, norm, self.spec.clip_norm)
                grads = [g * scale for g in grads]
            return super().apply(grads, trainable_variables)


def _const(value: float, like):
    """A Python hyper-parameter as a tensor of `like`'s dtype, converted directly: `ops.cast(0.9, "float64")`
    would go through float32 first (0.8999999761...), which an fp64 run must not."""
    return ops.convert_to_tensor(value, dtype=like.dtype)


class SGD(SpecOptimizer):
    def __init__(self, spec, weight_names, kinds=None):
        super().__init__(spec, weight_names, kinds)
        self.SLOTS = ("momentum",) if spec.momentum else ()  # plain SGD has no state

    def update_step(self, gradient, variable, learning_rate):
        spec, lr, g = self.spec, self.rate(variable.dtype), ops.cast(gradient, variable.dtype)
        if spec.momentum == 0:
            tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=lr, delta=g)
            return
        # ResourceApplyKerasMomentum keeps a velocity in learning-rate units, v = m*v - lr*g = -lr*buf: w += v is the
        # spec's w -= lr*buf (buf = m*buf + g), and with Nesterov w += m*v - lr*g its w -= lr*(g + m*buf). Under a
        # schedule that velocity would sum earlier steps' rates: ResourceApplyMomentum keeps the spec's buf (gradient
        # units) and multiplies by this step's rate, w -= lr*buf or lr*(g + m*buf)
        kernel = (tf.raw_ops.ResourceApplyKerasMomentum if self.scheduled_rate is None
                  else tf.raw_ops.ResourceApplyMomentum)
        buffer, momentum = self.slot("momentum", variable), _const(spec.momentum, variable)
        kernel(var=variable.handle, accum=buffer.handle, lr=lr, grad=g, momentum=momentum, use_nesterov=spec.nesterov)


class Adam(SpecOptimizer):
    """Adam, and AdamW: the decay of the weights decay_of names."""
    SLOTS = ("m", "v")

    def update_step(self, gradient, variable, learning_rate):
        spec, c = self.spec, lambda value: _const(value, variable)  # noqa: E731
        lr, decay = self.rate(variable.dtype), self.decay_of(variable)
        if decay:  # decoupled, of the weight before the update: p*(1 - lr*wd), then the kernel's Adam step
            self.assign(variable, variable * ops.cast(1 - self.rate(tf.float64) * decay, variable.dtype))
        t = ops.cast(self.iterations + 1, variable.dtype)
        beta_1_power, beta_2_power = ops.power(c(spec.beta_1), t), ops.power(c(spec.beta_2), t)
        # the kernel: w -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v) + eps'); with eps' = eps*sqrt(1-b2^t) that is
        # the spec's lr*m_hat/(sqrt(v_hat) + eps)
        epsilon = c(spec.epsilon) * ops.sqrt(c(1.0) - beta_2_power)
        m, v = self.slot("m", variable), self.slot("v", variable)
        tf.raw_ops.ResourceApplyAdam(var=variable.handle, m=m.handle, v=v.handle, beta1_power=beta_1_power,
                                     beta2_power=beta_2_power, lr=lr, beta1=c(spec.beta_1),
                                     beta2=c(spec.beta_2), epsilon=epsilon, grad=ops.cast(gradient, variable.dtype))


class RMSprop(SpecOptimizer):
    SLOTS = ("square_avg",)

    def update_step(self, gradient, variable, learning_rate):
        spec, c = self.spec, lambda value: _const(value, variable)  # noqa: E731
        g, v = ops.cast(gradient, variable.dtype), self.slot("square_avg", variable)
        self.assign(v, c(spec.rho) * v + c(1 - spec.rho) * ops.square(g))
        denom = ops.sqrt(v + c(spec.epsilon)) if spec.epsilon_placement == "inside" else ops.sqrt(v) + c(spec.epsilon)
        self.assign_sub(variable, self.rate(variable.dtype) * g / denom)


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": Adam, "rmsprop": RMSprop}  # each takes (spec, weight_names, kinds)


def _nll(logp, labels):
    # one gather, not take_along_axis (a dozen index-building operations): each label's class, on the last axis
    rank = len(labels.shape)
    return -ops.mean(tf.gather(logp, labels, axis=rank, batch_dims=rank))


# harness.model.training's primitives: Keras ops, and TensorFlow's fused softmax cross-entropy (one kernel:
# log-softmax and pick, and its gradient softmax - onehot)
LOSS_OPS = LossOps(
    upcast=lambda x: x if x.dtype == "float64" else ops.cast(x, "float32"),
    softmax_cross_entropy=lambda out, labels: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=out)),
    normalized=lambda x: x / ops.sum(x, axis=-1, keepdims=True), nll=_nll,
    first_column=lambda x: x[:, 0], labels_like=lambda labels, out: ops.cast(labels, out.dtype),
    clip=ops.clip, log=ops.log, log1p=ops.log1p, exp=ops.exp, abs=ops.abs, relu=ops.relu, mean=ops.mean,
)
CLIP_OPS = ClipOps(full_like=lambda norm, value: tf.constant(value, norm.dtype), maximum=tf.maximum, where=tf.where,
                   ones_like=tf.ones_like)
