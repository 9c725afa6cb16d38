"""The spec's network as one Gluon HybridBlock holding the core's canonical weights in MXNet layouts.

Activations are NCHW (MXNet's CPU convolutions and pooling take no NHWC); `flatten` transposes to NHWC first
so that it flattens in the spec's H, W, C order. TF-style asymmetric 'same' padding is an explicit pad.
"""
from __future__ import annotations

import mxnet as mx
import numpy as np
from mxnet import gluon

from harness.graph import Graph, same_padding
from harness.weights import from_channels_first, to_channels_first




def _key(name: str) -> str:
    return "p" + name.replace(".", "_")


def _padding(in_shape, kernel: int, stride: int, padding: str):
    """(symmetric pad for the op, explicit pad_width or None) reproducing TF's 'same'."""
    if padding == "valid":
        return (0, 0), None
    (top, bottom), (left, right) = (same_padding(n, kernel, stride) for n in in_shape[:2])
    if top == bottom and left == right:
        return (top, left), None
    return (0, 0), (0, 0, 0, 0, top, bottom, left, right)


class Network(gluon.HybridBlock):
    def __init__(self, spec, graph: Graph, dtype: str):
        super().__init__(prefix="spec_")
        self.spec = spec
        self.infos = {info.path: info for info in graph.layers}
        self.handles = {}
        with self.name_scope():
            for name, shape in graph.param_shapes().items():
                state = name.rsplit(".", 1)[1].startswith("moving_")
                # attributes, because Gluon passes only attribute-registered parameters to hybrid_forward
                self.handles[name] = self._register(_key(name), self.params.get(
                    _key(name), shape=to_channels_first(np.empty(shape)).shape, dtype=dtype,
                    init=mx.init.Zero(), grad_req="null" if state else "write", differentiable=not state))
            # constant divisors for asymmetric 'same' average pooling (TF excludes padded pixels)
            for layer in graph.layers:
                spec_layer = self._spec_of(layer.path)
                if layer.type == "avgpool2d" and spec_layer.padding == "same":
                    k, s = spec_layer.pool_size, spec_layer.strides or spec_layer.pool_size
                    _, explicit = _padding(layer.in_shape, k, s, "same")
                    if explicit:
                        ones = mx.nd.pad(mx.nd.ones((1, 1, *layer.in_shape[:2])), mode="constant",
                                         pad_width=explicit)
                        counts = mx.nd.Pooling(ones, kernel=(k, k), stride=(s, s), pool_type="sum")
                        key = _key(f"{layer.path}.counts")
                        self._register(key, self.params.get_constant(key, counts.astype(dtype)))

    def _register(self, key: str, param):
        setattr(self, key, param)
        return param

    def _spec_of(self, path: str):
        parts, layers, layer = path.split("."), self.spec.layers, None
        for i in range(0, len(parts), 2):
            layer = layers[int(parts[i])]
            if i + 1 < len(parts):
                layers = getattr(layer, parts[i + 1])
        return layer

    def load(self, weights: dict[str, np.ndarray], ctx) -> None:
        for name, param in self.handles.items():
            param.set_data(mx.nd.array(to_channels_first(weights[name]), ctx=ctx, dtype=param.dtype))

    def canonical_weights(self) -> dict[str, np.ndarray]:
        return {name: from_channels_first(p.data().astype("float32").asnumpy()) for name, p in self.handles.items()}

    def hybrid_forward(self, F, x, **params):
        return self._layers(F, self.spec.layers, "", x, params)

    def _layers(self, F, layers, prefix, x, params):
        for index, layer in enumerate(layers):
            x = self._layer(F, layer, f"{prefix}{index}", x, params)
        return x

    def _layer(self, F, layer, path, x, p):
        t, info = layer.type, self.infos[path]
        w = lambda name: p[_key(f"{path}.{name}")]  # noqa: E731
        if t == "dense":
            return F.FullyConnected(x, w("kernel"), w("bias") if layer.use_bias else None, num_hidden=layer.units,
                                    no_bias=not layer.use_bias, flatten=False)
        if t == "conv2d":
            k, s = layer.kernel_size, layer.strides
            pad, explicit = _padding(info.in_shape, k, s, layer.padding)
            if explicit:
                x = F.pad(x, mode="constant", pad_width=explicit)
            return F.Convolution(x, w("kernel"), w("bias") if layer.use_bias else None, kernel=(k, k),
                                 stride=(s, s), pad=pad, num_filter=layer.filters, no_bias=not layer.use_bias)
        if t in ("maxpool2d", "avgpool2d"):
            k, s = layer.pool_size, layer.strides or layer.pool_size
            pad, explicit = _padding(info.in_shape, k, s, layer.padding)
            if t == "maxpool2d":
                if explicit:
                    x = F.pad(x, mode="constant", pad_width=explicit, constant_value=float("-inf"))
                return F.Pooling(x, kernel=(k, k), stride=(s, s), pad=pad, pool_type="max")
            if explicit:
                sums = F.Pooling(F.pad(x, mode="constant", pad_width=explicit), kernel=(k, k), stride=(s, s),
                                 pool_type="sum")
                return F.broadcast_div(sums, w("counts"))
            return F.Pooling(x, kernel=(k, k), stride=(s, s), pad=pad, pool_type="avg", count_include_pad=False)
        if t == "global_avgpool2d":
            return F.mean(x, axis=(2, 3))
        if t == "flatten":  # H, W, C order; with one channel NCHW already is
            return F.flatten(F.transpose(x, axes=(0, 2, 3, 1))) if len(info.in_shape) == 3 \
                and info.in_shape[2] > 1 else F.flatten(x)
        if t in ("relu", "tanh", "sigmoid"):  # the Activation operator has oneDNN kernels; F.relu is ~3x slower
            return F.Activation(x, act_type=t)
        if t == "softmax":
            return F.softmax(x, axis=1)  # channels in NCHW, features in [N, F]
        if t == "gelu":
            if layer.approximate:
                return 0.5 * x * (1 + F.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x * x * x)))
            return F.LeakyReLU(x, act_type="gelu")  # the erf form
        if t == "batchnorm":  # Gluon's momentum form and biased running variance are the spec's
            return F.BatchNorm(x, w("gamma"), w("beta"), w("moving_mean"), w("moving_variance"),
                               eps=layer.epsilon, momentum=layer.momentum, fix_gamma=False, axis=1)
        if t == "layernorm":
            return F.LayerNorm(x, w("gamma"), w("beta"), axis=1, eps=layer.epsilon)
        if t == "dropout":
            return F.Dropout(x, p=layer.rate) if layer.rate > 0 else x
        if t == "residual":
            main = self._layers(F, layer.layers, f"{path}.layers.", x, p)
            shortcut = self._layers(F, layer.projection, f"{path}.projection.", x, p) if layer.projection else x
            return main + shortcut
        raise AssertionError(f"no MXNet op for {t!r}")
