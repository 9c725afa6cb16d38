"""The spec's network as a Keras 3 functional model (channels-last), holding the core's canonical weights.

Keras' own layouts are the canonical ones (NHWC activations, [kH, kW, in, out] and [in, out] kernels, H, W, C
flatten order) and its 'same' padding is the spec's, so weights load without conversion.
"""
from __future__ import annotations

import keras
import numpy as np

from harness.graph import Graph

# canonical parameter name -> attribute of the Keras layer holding that variable
ATTRIBUTES = {"kernel": "kernel", "bias": "bias", "gamma": "gamma", "beta": "beta",
              "moving_mean": "moving_mean", "moving_variance": "moving_variance"}


def _gelu(approximate: bool):
    return lambda x: keras.activations.gelu(x, approximate=approximate)


def _layer(spec, seed: int) -> keras.layers.Layer:
    t = spec.type
    if t == "dense":
        return keras.layers.Dense(spec.units, use_bias=spec.use_bias)
    if t == "conv2d":
        return keras.layers.Conv2D(spec.filters, spec.kernel_size, strides=spec.strides, padding=spec.padding,
                                   use_bias=spec.use_bias)
    if t == "maxpool2d":
        return keras.layers.MaxPooling2D(spec.pool_size, strides=spec.strides, padding=spec.padding)
    if t == "avgpool2d":  # TF's 'same' average pooling excludes padded pixels, as the spec says
        return keras.layers.AveragePooling2D(spec.pool_size, strides=spec.strides, padding=spec.padding)
    if t == "global_avgpool2d":
        return keras.layers.GlobalAveragePooling2D()
    if t == "flatten":
        return keras.layers.Flatten()
    if t in ("relu", "tanh", "sigmoid"):
        return keras.layers.Activation(t)
    if t == "softmax":
        return keras.layers.Softmax(axis=-1)
    if t == "gelu":
        return keras.layers.Activation(_gelu(spec.approximate))
    if t == "batchnorm":  # Keras' momentum form and biased batch variance are the spec's
        return keras.layers.BatchNormalization(momentum=spec.momentum, epsilon=spec.epsilon)
    if t == "layernorm":
        return keras.layers.LayerNormalization(axis=-1, epsilon=spec.epsilon)
    if t == "dropout":
        return keras.layers.Dropout(spec.rate, seed=seed)
    raise AssertionError(f"no Keras layer for {t!r}")


def _apply(specs, prefix: str, x, owners: dict, seed: int):
    for index, spec in enumerate(specs):
        path = f"{prefix}{index}"
        if spec.type == "residual":
            main = _apply(spec.layers, f"{path}.layers.", x, owners, seed)
            shortcut = _apply(spec.projection, f"{path}.projection.", x, owners, seed) if spec.projection else x
            x = keras.layers.Add()([main, shortcut])
        else:
            layer = _layer(spec, seed)
            x = layer(x)
            owners[path] = layer
    return x


class Network:
    def __init__(self, spec, graph: Graph, weights: dict[str, np.ndarray], input_dtype: str):
        inputs = keras.Input(shape=tuple(spec.input.shape), dtype=input_dtype)
        owners: dict[str, keras.layers.Layer] = {}
        outputs = _apply(spec.layers, "", inputs, owners, spec.seed)
        self.model = keras.Model(inputs, outputs, name=spec.name)
        self.variables = {}
        for name in graph.param_shapes():
            path, param = name.rsplit(".", 1)
            self.variables[name] = getattr(owners[path], ATTRIBUTES[param])
        for name, variable in self.variables.items():
            variable.assign(weights[name].astype(variable.dtype))

    def canonical_weights(self) -> dict[str, np.ndarray]:
        return {name: np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float32)
                for name, v in self.variables.items()}
