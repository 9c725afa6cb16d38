"""@HEADER@"""
# The Keras 3 (TensorFlow backend) template of `amp-harness export` (harness/export.py fills in the docstring above
# and CONFIG below). Keras' layouts are the canonical ones (NHWC images, [kH, kW, in, out] and [in, out] kernels,
# H, W, C flatten order) and its 'same' padding is the spec's (TensorFlow's: the odd pixel at the bottom/right;
# 'same' average pooling excludes padded pixels), so the weights load without conversion. What keeps the spec's
# math besides:
# - Adam: Keras' own folds epsilon into a bias-corrected rate ("epsilon hat"); SpecAdam below puts it where the
#   spec (and PyTorch) does: p -= lr*m_hat/(sqrt(v_hat) + eps);
# - RMSprop: Keras' own has epsilon inside the square root; SpecRMSprop below covers "outside" too;
# - losses on probabilities are written out: Keras' would take the logits of a softmax/sigmoid output instead of
#   clipping the probabilities to [1e-7, 1 - 1e-7] as the spec does;
# - mixed precision: the global dtype policy (mixed_bfloat16 / mixed_float16) set before the model is built, and
#   for float16 keras.mixed_precision.LossScaleOptimizer with the harness's settings (Keras' default initial
#   scale is 2^15).
import argparse
import json
import math
import os
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

CONFIG = {}  # @CONFIG@

PROB_EPSILON = 1e-7  # probabilities are clipped to [eps, 1 - eps] in losses on probabilities


def make_layer(cfg):
    t = cfg["type"]
    if t == "dense":
        return keras.layers.Dense(cfg["units"], use_bias=cfg["use_bias"])
    if t == "conv2d":
        return keras.layers.Conv2D(cfg["filters"], cfg["kernel_size"], strides=cfg["strides"],
                                   padding=cfg["padding"], use_bias=cfg["use_bias"])
    if t == "maxpool2d":
        return keras.layers.MaxPooling2D(cfg["pool_size"], strides=cfg["strides"], padding=cfg["padding"])
    if t == "avgpool2d":
        return keras.layers.AveragePooling2D(cfg["pool_size"], strides=cfg["strides"], padding=cfg["padding"])
    if t == "global_avgpool2d":
        return keras.layers.GlobalAveragePooling2D()
    if t == "flatten":
        return keras.layers.Flatten()  # H, W, C order
    if t in ("relu", "tanh", "sigmoid"):
        return keras.layers.Activation(t)
    if t == "gelu":
        approximate = cfg["approximate"]
        return keras.layers.Activation(lambda x: keras.activations.gelu(x, approximate=approximate))
    if t == "softmax":
        return keras.layers.Softmax(axis=-1)
    if t == "batchnorm":  # Keras' momentum form and biased batch variance are the spec's
        return keras.layers.BatchNormalization(momentum=cfg["momentum"], epsilon=cfg["epsilon"])
    if t == "layernorm":
        return keras.layers.LayerNormalization(axis=-1, epsilon=cfg["epsilon"])
    if t == "dropout":
        return keras.layers.Dropout(cfg["rate"])  # Keras' own masks, not the harness's
    raise ValueError(f"layer type {t!r} is not exported")


def apply(layer_cfgs, x, layers):
    """The layers applied to the symbolic x; `layers` receives (spec path -> Keras layer) for load_canonical."""
    for cfg in layer_cfgs:
        if cfg["type"] == "residual":
            main = apply(cfg["layers"], x, layers)
            shortcut = apply(cfg["projection"], x, layers) if cfg["projection"] else x
            x = keras.layers.Add()([main, shortcut])
        else:
            layers[cfg["path"]] = layer = make_layer(cfg)
            x = layer(x)
    return x


def load_canonical(layers, data):
    """The canonical initial weights into the layers: Keras' attribute names (kernel, bias, gamma, beta,
    moving_mean, moving_variance) and layouts are the canonical ones."""
    for key in data.files:
        if key.startswith("w/"):
            path, name = key[2:].rsplit(".", 1)
            getattr(layers[path], name).assign(data[key])


class SpecSGD(keras.optimizers.Optimizer):
    """SGD: buf = m*buf + g; p -= lr*buf (nesterov: p -= lr*(g + m*buf)). Keras' own SGD is the same math at a
    constant rate (its velocity is -lr*buf), but casts momentum through float32, which a float64 run would see."""

    def __init__(self, learning_rate, momentum, nesterov, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_sgd", **kwargs)
        self.momentum, self.nesterov = momentum, nesterov

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.buffers = [self.add_variable_from_reference(v, "momentum") for v in var_list] if self.momentum else []

    def update_step(self, gradient, variable, learning_rate):
        c = lambda value: ops.convert_to_tensor(value, dtype=variable.dtype)  # noqa: E731
        lr, g = ops.cast(learning_rate, variable.dtype), ops.cast(gradient, variable.dtype)
        if not self.momentum:
            self.assign_sub(variable, lr * g)
            return
        buf = self.buffers[self._get_variable_index(variable)]
        self.assign(buf, c(self.momentum) * buf + g)
        self.assign_sub(variable, lr * (g + c(self.momentum) * buf if self.nesterov else buf))


class SpecAdam(keras.optimizers.Optimizer):
    """Adam as the spec (and PyTorch) computes it: p -= lr*m_hat/(sqrt(v_hat) + eps)."""

    def __init__(self, learning_rate, beta_1, beta_2, epsilon, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_adam", **kwargs)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.m = [self.add_variable_from_reference(v, "m") for v in var_list]
        self.v = [self.add_variable_from_reference(v, "v") for v in var_list]

    def update_step(self, gradient, variable, learning_rate):
        c = lambda value: ops.convert_to_tensor(value, dtype=variable.dtype)  # noqa: E731
        lr, g = ops.cast(learning_rate, variable.dtype), ops.cast(gradient, variable.dtype)
        t = ops.cast(self.iterations + 1, variable.dtype)
        index = self._get_variable_index(variable)
        m, v = self.m[index], self.v[index]
        self.assign(m, c(self.beta_1) * m + c(1 - self.beta_1) * g)
        self.assign(v, c(self.beta_2) * v + c(1 - self.beta_2) * ops.square(g))
        m_hat = m / (c(1.0) - ops.power(c(self.beta_1), t))
        v_hat = v / (c(1.0) - ops.power(c(self.beta_2), t))
        self.assign_sub(variable, lr * m_hat / (ops.sqrt(v_hat) + c(self.epsilon)))


class SpecRMSprop(keras.optimizers.Optimizer):
    """RMSprop: v = rho*v + (1-rho)*g^2; p -= lr*g/sqrt(v + eps) ("inside", Keras' own) or lr*g/(sqrt(v) + eps)."""

    def __init__(self, learning_rate, rho, epsilon, inside, **kwargs):
        super().__init__(learning_rate=learning_rate, name="spec_rmsprop", **kwargs)
        self.rho, self.epsilon, self.inside = rho, epsilon, inside

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.square_avg = [self.add_variable_from_reference(v, "square_avg") for v in var_list]

    def update_step(self, gradient, variable, learning_rate):
        c = lambda value: ops.convert_to_tensor(value, dtype=variable.dtype)  # noqa: E731
        lr, g = ops.cast(learning_rate, variable.dtype), ops.cast(gradient, variable.dtype)
        v = self.square_avg[self._get_variable_index(variable)]
        self.assign(v, c(self.rho) * v + c(1 - self.rho) * ops.square(g))
        denom = ops.sqrt(v + c(self.epsilon)) if self.inside else ops.sqrt(v) + c(self.epsilon)
        self.assign_sub(variable, lr * g / denom)


def make_optimizer(cfg):
    if cfg["type"] == "sgd":
        return SpecSGD(cfg["learning_rate"], cfg["momentum"], cfg["nesterov"])
    if cfg["type"] == "adam":
        return SpecAdam(cfg["learning_rate"], cfg["beta_1"], cfg["beta_2"], cfg["epsilon"])
    if cfg["type"] == "rmsprop":
        return SpecRMSprop(cfg["learning_rate"], cfg["rho"], cfg["epsilon"], cfg["epsilon_placement"] == "inside")
    raise ValueError(f"optimizer {cfg['type']!r} is not exported")


def make_loss(cfg):
    """The batch-mean loss (Keras computes losses in float32 under the mixed policies)."""
    if cfg["type"] == "sparse_categorical_crossentropy":
        if cfg["from_logits"]:
            return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def sparse_categorical_crossentropy(y_true, y_pred):  # per sample; Keras takes the batch mean
            probs = ops.clip(y_pred / ops.sum(y_pred, axis=-1, keepdims=True), PROB_EPSILON, 1 - PROB_EPSILON)
            picked = ops.take_along_axis(ops.log(probs), ops.expand_dims(ops.cast(y_true, "int32"), -1), axis=-1)
            return -picked[:, 0]

        return sparse_categorical_crossentropy
    if cfg["from_logits"]:
        return keras.losses.BinaryCrossentropy(from_logits=True)

    def binary_crossentropy(y_true, y_pred):
        p, y = ops.clip(y_pred[:, 0], PROB_EPSILON, 1 - PROB_EPSILON), ops.cast(y_true[:, 0], y_pred.dtype)
        return -(y * ops.log(p) + (1 - y) * ops.log(1 - p))

    return binary_crossentropy


def main():
    parser = argparse.ArgumentParser(description=f"train {CONFIG['model']} in Keras, {CONFIG['precision']}")
    parser.add_argument("--data", default=str(Path(__file__).with_name(CONFIG["data_file"])))
    parser.add_argument("--steps", type=int, default=CONFIG["steps"])
    parser.add_argument("--losses-json", help="write each step's loss here as JSON")
    args = parser.parse_args()

    data = np.load(args.data)
    if str(data["spec_hash"]) != CONFIG["spec_hash"]:
        raise SystemExit(f"{args.data} holds the data of another spec ({data['spec_hash']}); export again")
    if not 1 <= args.steps <= len(data["x"]):
        raise SystemExit(f"--steps: the data file holds {len(data['x'])} batches")
    if keras.backend.backend() == "tensorflow":  # strict float32 on GPUs (TensorFlow enables TF32 by default)
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)
    keras.utils.set_random_seed(CONFIG["seed"])
    # process-wide: set before the model is built
    keras.config.set_floatx(CONFIG["dtype"])
    compute = CONFIG["compute_dtype"]
    keras.mixed_precision.set_global_policy(f"mixed_{compute}" if compute else CONFIG["dtype"])

    layers = {}
    inputs = keras.Input(shape=tuple(CONFIG["input_shape"]))
    model = keras.Model(inputs, apply(CONFIG["layers"], inputs, layers), name=CONFIG["model"])
    load_canonical(layers, data)
    optimizer = make_optimizer(CONFIG["optimizer"])
    if CONFIG["loss_scale"]:
        ls = CONFIG["loss_scale"]  # Keras grows by 2 and backs off by 0.5
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer, initial_scale=ls["initial"],
                                                             dynamic_growth_steps=ls["growth_interval"])
    model.compile(optimizer=optimizer, loss=make_loss(CONFIG["loss"]))

    binary = CONFIG["loss"]["type"] == "binary_crossentropy"
    losses = []
    for step in range(args.steps):
        x, y = data["x"][step].astype(CONFIG["dtype"]), data["y"][step]
        loss = model.train_on_batch(x, y[:, None] if binary else y)  # this batch's loss, before the update
        losses.append(float(loss))
        print(f"step {step} loss {losses[-1]:.8g}", flush=True)
    if args.losses_json:
        Path(args.losses_json).write_text(json.dumps({
            "model": CONFIG["model"], "framework": "tensorflow", "precision": CONFIG["precision"],
            "spec_hash": CONFIG["spec_hash"], "losses": [v if math.isfinite(v) else None for v in losses]}))


if __name__ == "__main__":
    main()
