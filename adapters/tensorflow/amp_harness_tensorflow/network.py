"""The spec's network as a Keras 3 functional model (channels-last), holding the core's canonical weights.

Keras' own layouts are the canonical ones (NHWC activations, [kH, kW, in, out] and [in, out] kernels, H, W, C
flatten order) and its 'same' padding is the spec's, so weights load without conversion.
"""
from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

from harness.adapter import layer_scope
from harness.model.dropout import DropoutMasks
from harness.model.graph import Graph
from harness.model.layers import LayerBuilders

# canonical parameter name -> attribute of the Keras layer holding that variable
ATTRIBUTES = {"kernel": "kernel", "bias": "bias", "gamma": "gamma", "beta": "beta",
              "moving_mean": "moving_mean", "moving_variance": "moving_variance"}


class GELU(keras.layers.Layer):
    """GELU with its constants in the compute dtype: Keras' (tf.nn.gelu) rounds them to float32 first,
    which an fp64 run must not."""

    def __init__(self, approximate: bool, **kwargs):
        super().__init__(**kwargs)
        self.approximate = approximate

    def call(self, x):
        c = lambda v: ops.convert_to_tensor(v, dtype=x.dtype)  # noqa: E731
        if self.approximate:
            inner = c(math.sqrt(2 / math.pi)) * (x + c(0.044715) * x * x * x)
            return c(0.5) * x * (c(1.0) + ops.tanh(inner))
        return c(0.5) * x * (c(1.0) + ops.erf(x / c(math.sqrt(2.0))))


class MaskedDropout(keras.layers.Layer):
    """Dropout with the core's mask (harness.model.dropout), a second input of the training model."""

    def __init__(self, rate: float, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, x, mask):
        return x * ops.cast(mask, x.dtype) / ops.convert_to_tensor(1 - self.rate, dtype=x.dtype)


def _given(weights: dict[str, np.ndarray], name: str):
    """An initialiser returning the core's canonical weight: the variable is created holding it, without
    Keras drawing a random tensor first only to be overwritten (build-time temporaries that would sit in the
    process's memory figure)."""
    return lambda shape, dtype=None: weights[name].astype(dtype, copy=False)


LAYERS = LayerBuilders("tensorflow")  # each builder: (LayerInfo, Network) -> a Keras layer


def _named(info, net) -> dict:
    """A layer's name and weight initialisers. The name is its name scope in the graph, which is how a profile
    finds a layer's ops (weights are mapped by variable, not by name)."""
    return {"name": layer_scope(info.path)} | {f"{param}_initializer": _given(net.weights, f"{info.path}.{param}")
                                               for param in info.params}


@LAYERS.builder("dense")
def dense(info, net):
    return keras.layers.Dense(info.spec.units, use_bias=info.spec.use_bias, **_named(info, net))


@LAYERS.builder("conv2d")
def conv2d(info, net):
    spec = info.spec
    return keras.layers.Conv2D(spec.filters, spec.kernel_size, strides=spec.strides, padding=spec.padding,
                               use_bias=spec.use_bias, **_named(info, net))


@LAYERS.builder("maxpool2d")
def maxpool2d(info, net):
    spec = info.spec
    return keras.layers.MaxPooling2D(spec.pool_size, strides=spec.strides, padding=spec.padding, **_named(info, net))


@LAYERS.builder("avgpool2d")
def avgpool2d(info, net):  # TF's 'same' average pooling excludes padded pixels, as the spec says
    spec = info.spec
    return keras.layers.AveragePooling2D(spec.pool_size, strides=spec.strides, padding=spec.padding,
                                         **_named(info, net))


@LAYERS.builder("global_avgpool2d")
def global_avgpool2d(info, net):
    return keras.layers.GlobalAveragePooling2D(**_named(info, net))


@LAYERS.builder("flatten")
def flatten(info, net):
    return keras.layers.Flatten(**_named(info, net))


@LAYERS.builder("relu", "tanh", "sigmoid")
def activation(info, net):
    return keras.layers.Activation(info.type, **_named(info, net))


@LAYERS.builder("softmax")
def softmax(info, net):
    return keras.layers.Softmax(axis=-1, **_named(info, net))


@LAYERS.builder("gelu")
def gelu(info, net):
    return GELU(info.spec.approximate, **_named(info, net))


@LAYERS.builder("batchnorm")
def batchnorm(info, net):  # Keras' momentum form and biased batch variance are the spec's
    return keras.layers.BatchNormalization(momentum=info.spec.momentum, epsilon=info.spec.epsilon,
                                           **_named(info, net))


@LAYERS.builder("layernorm")
def layernorm(info, net):
    return keras.layers.LayerNormalization(axis=-1, epsilon=info.spec.epsilon, **_named(info, net))


@LAYERS.builder("dropout")
def dropout(info, net):  # called as layer(x, mask): _apply passes the core's mask
    return MaskedDropout(info.spec.rate, **_named(info, net))


@LAYERS.builder("residual")
def residual(info, net):  # called as layer([main, shortcut]): _apply runs the block's branches
    return keras.layers.Add(**_named(info, net))


def _apply(specs, prefix: str, x, layers: dict, masks: dict | None, record: dict | None = None):
    """The layers applied to x; `masks` (symbolic inputs by path) in the training graph, None in inference.
    With `record`, each layer's output is kept there by path (diagnose mode, run eagerly)."""
    for index, spec in enumerate(specs):
        path = f"{prefix}{index}"
        if spec.type == "residual":
            main = _apply(spec.layers, f"{path}.layers.", x, layers, masks, record)
            shortcut = _apply(spec.projection, f"{path}.projection.", x, layers, masks, record) \
                if spec.projection else x
            x = layers[path]([main, shortcut])
        elif spec.type == "dropout":
            if masks is not None and path in masks:
                x = layers[path](x, masks[path])
        else:
            x = layers[path](x)
        if record is not None:
            record[path] = x
    return x


class Network:
    """Two functional models sharing every layer: `train_model` takes [inputs, *dropout masks] (masks in
    `mask_paths` order), `model` takes the inputs alone and runs without dropout (inference)."""

    def __init__(self, spec, graph: Graph, weights: dict[str, np.ndarray], input_dtype: str):
        inputs = keras.Input(shape=tuple(spec.input.shape), dtype=input_dtype)
        dropouts = DropoutMasks(graph, spec.seed).layers
        self.mask_paths = [path for path, _, _ in dropouts]
        masks = {path: keras.Input(shape=shape, dtype=input_dtype) for path, _, shape in dropouts}
        self.spec, self.weights = spec, weights  # the canonical weights, which the layers are created holding
        self.layers = layers = {info.path: LAYERS.build(info, self) for info in graph.layers}  # by canonical path
        self.model = keras.Model(inputs, _apply(spec.layers, "", inputs, layers, None), name=spec.name)
        self.train_model = keras.Model([inputs, *masks.values()],
                                       _apply(spec.layers, "", inputs, layers, masks)) if masks else self.model
        self.variables = {}
        for name in graph.param_shapes():
            path, param = name.rsplit(".", 1)
            self.variables[name] = getattr(layers[path], ATTRIBUTES[param])
        self.name_of = {id(v): name for name, v in self.variables.items()}  # canonical name of each variable

    def layer_outputs(self, x):
        """(each layer's output by canonical path, the network's output): the inference network run eagerly,
        so that a GradientTape can differentiate the loss with respect to every output."""
        outputs: dict = {}
        out = _apply(self.spec.layers, "", x, self.layers, None, outputs)
        return outputs, out

    def canonical_weights(self) -> dict[str, np.ndarray]:
        values = {name: keras.ops.convert_to_numpy(v) for name, v in self.variables.items()}
        return {name: v if v.dtype == np.float64 else v.astype(np.float32) for name, v in values.items()}
