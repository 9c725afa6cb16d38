"""The spec's network as a pure function of (params, batchnorm statistics, inputs) in jax.numpy.

The canonical layouts are JAX's own (NHWC activations, HWIO conv kernels, [in, out] dense kernels, H, W, C
flatten order), so weights load without conversion. Mixed precision is written the way Flax modules do it
(`dtype` / `param_dtype`): dense and conv layers cast their input and their float32 weights to the compute
dtype, normalisation layers compute in the weights' dtype (the usual advice for batchnorm in JAX mixed
precision), and every other layer computes in the dtype it receives.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from harness.adapter import layer_scope
from harness.errors import HarnessError
from harness.model.graph import Graph, avgpool_divisors, window_padding

CONV_DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def _pads(info, kernel: int, stride: int, padding: str) -> list[tuple[int, int]]:
    """[(top, bottom), (left, right)]: lax takes TF's asymmetric 'same' padding as it is."""
    pad = window_padding(info.in_shape, kernel, stride, padding)
    if pad.explicit:
        top, bottom, left, right = pad.explicit
        return [(top, bottom), (left, right)]
    (h, w) = pad.symmetric
    return [(h, h), (w, w)]


@jax.custom_vjp
def add_bias(x, bias):
    return x + bias


def _add_bias_fwd(x, bias):
    return x + bias, None


def _add_bias_bwd(_, grad):
    # the bias's gradient sums the output's over the batch (and pixels): XLA's CPU reduction of a 16-bit array
    # accumulates in 16 bits and overflows float16 where the sum itself does not (PyTorch's and cuDNN's bias
    # gradients accumulate in float32), which would make loss scalers skip steps the other frameworks take
    total = grad.sum(axis=tuple(range(grad.ndim - 1)), dtype=jnp.promote_types(grad.dtype, jnp.float32))
    return grad, total.astype(grad.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


class Network:
    def __init__(self, spec, graph: Graph, compute_dtype: str):
        self.spec, self.compute = spec, jnp.dtype(compute_dtype)
        self.infos = {info.path: info for info in graph.layers}
        #: the trainable weights' canonical names; batchnorm's moving statistics are state, not parameters
        self.trainable = [n for n in graph.param_shapes() if not n.rsplit(".", 1)[1].startswith("moving_")]
        self.statistics = [n for n in graph.param_shapes() if n.rsplit(".", 1)[1].startswith("moving_")]

    def apply(self, params: dict, state: dict, x, masks: dict | None, training: bool, taps: dict | None = None,
              record: dict | None = None):
        """(outputs, new batchnorm statistics). In training the statistics are updated and `masks` (the core's
        dropout masks by path) applied; `taps` (zeros by layer path) are added to each layer's output, so that
        differentiating with respect to them gives the gradient of the loss with respect to that output;
        `record` receives each layer's output by path."""
        new_state = dict(state)
        out = self._layers(self.spec.layers, "", params, new_state, x, masks, training, taps, record)
        return out, new_state

    def _layers(self, specs, prefix, p, state, x, masks, training, taps, record):
        for index, spec in enumerate(specs):
            path = f"{prefix}{index}"
            # the scope only names the HLO ops' metadata (their op_name), by which a profile finds each layer's ops
            with jax.named_scope(layer_scope(path)):
                x = self._layer(spec, path, p, state, x, masks, training, taps, record)
            if taps is not None:
                x = x + taps[path]
            if record is not None:
                record[path] = x
        return x

    def _layer(self, spec, path, p, state, x, masks, training, taps, record):
        t, info = spec.type, self.infos[path]
        if t == "dense":
            x = x.astype(self.compute) @ p[f"{path}.kernel"].astype(self.compute)
            return add_bias(x, p[f"{path}.bias"].astype(self.compute)) if spec.use_bias else x
        if t == "conv2d":
            k, s = spec.kernel_size, spec.strides
            x = lax.conv_general_dilated(x.astype(self.compute), p[f"{path}.kernel"].astype(self.compute), (s, s),
                                         _pads(info, k, s, spec.padding), dimension_numbers=CONV_DIMENSIONS)
            return add_bias(x, p[f"{path}.bias"].astype(self.compute)) if spec.use_bias else x
        if t in ("maxpool2d", "avgpool2d"):
            k, s = spec.pool_size, spec.strides or spec.pool_size
            window, strides = (1, k, k, 1), (1, s, s, 1)
            pads = [(0, 0), *_pads(info, k, s, spec.padding), (0, 0)]
            # Python-scalar identities: lax then picks its differentiable max/sum window primitives
            if t == "maxpool2d":  # padded pixels never win: they hold -inf
                return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, pads)
            # TF's 'same' average pooling divides by the real (unpadded) pixels of each window
            divisors = avgpool_divisors(info.in_shape, k, s, spec.padding)[None, :, :, None]
            sums = lax.reduce_window(x, 0.0, lax.add, window, strides, pads)
            return sums / jnp.asarray(divisors, x.dtype)
        if t == "global_avgpool2d":
            return x.mean(axis=(1, 2))
        if t == "flatten":
            return x.reshape(x.shape[0], -1)  # NHWC: H, W, C order, as the spec's
        if t == "relu":
            return jax.nn.relu(x)  # its gradient at 0 is 0, as in the other frameworks (jnp.maximum's is 1/2)
        if t == "tanh":
            return jnp.tanh(x)
        if t == "sigmoid":
            return jax.nn.sigmoid(x)
        if t == "softmax":
            return jax.nn.softmax(x, axis=-1)
        if t == "gelu":  # written out: Python constants take x's dtype (float64 in a float64 run)
            if spec.approximate:
                return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
            return 0.5 * x * (1.0 + lax.erf(x / math.sqrt(2.0)))
        if t == "batchnorm":
            return self._batchnorm(spec, path, p, state, x, training)
        if t == "layernorm":
            gamma, beta = p[f"{path}.gamma"], p[f"{path}.beta"]
            x = x.astype(gamma.dtype)
            mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
            return (x - mean) / jnp.sqrt(var + spec.epsilon) * gamma + beta
        if t == "dropout":
            if not training or spec.rate == 0:
                return x
            if masks is None or path not in masks:
                raise HarnessError(f"dropout layer {path}: no mask was given with the batch")
            return x * masks[path].astype(x.dtype) / (1 - spec.rate)
        if t == "residual":
            main = self._layers(spec.layers, f"{path}.layers.", p, state, x, masks, training, taps, record)
            shortcut = self._layers(spec.projection, f"{path}.projection.", p, state, x, masks, training, taps,
                                    record) if spec.projection else x
            return main + shortcut
        raise AssertionError(f"no JAX layer for {t!r}")

    def _batchnorm(self, spec, path, p, state, x, training):
        gamma, beta = p[f"{path}.gamma"], p[f"{path}.beta"]
        x = x.astype(gamma.dtype)
        axes = tuple(range(x.ndim - 1))
        if training:
            mean, var = x.mean(axis=axes), x.var(axis=axes)  # the biased variance, as the spec's
            m = spec.momentum
            for name, batch in (("moving_mean", mean), ("moving_variance", var)):
                running = state[f"{path}.{name}"]
                state[f"{path}.{name}"] = m * running + (1 - m) * lax.stop_gradient(batch).astype(running.dtype)
        else:
            mean, var = state[f"{path}.moving_mean"], state[f"{path}.moving_variance"]
        return (x - mean) / jnp.sqrt(var + spec.epsilon) * gamma + beta

