"""Canonical initial weights, drawn in numpy from the spec's seed; every adapter loads exactly these.

Layouts: dense kernel [in, out]; conv kernel [kH, kW, in, out]; vectors [C]. Frameworks' own initialisers
are never used. Biases and normalisation parameters get small random values rather than 0/1 so that a
parity check would notice one loaded into the wrong place.
"""
from __future__ import annotations

import math

import numpy as np

from harness.model.graph import Graph


def weight_kind(name: str) -> str:
    """A canonical weight's kind from its name: kernel, bias, beta, gamma, mean, variance or embeddings
    (attention's query_kernel is a kernel, its query_bias a bias)."""
    return name.rsplit(".", 1)[-1].rsplit("_", 1)[-1]


def initial_weights(graph: Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 0x5EED])
    weights: dict[str, np.ndarray] = {}
    for name, shape in graph.param_shapes().items():
        kind = weight_kind(name)
        if kind == "kernel":  # Glorot uniform, as Keras does by default
            receptive = math.prod(shape[:-2]) if len(shape) > 2 else 1
            fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            value = rng.uniform(-limit, limit, shape)
        elif kind in ("bias", "beta", "mean"):
            value = rng.uniform(-0.05, 0.05, shape)
        elif kind in ("gamma", "variance"):
            value = rng.uniform(0.95, 1.05, shape)
        elif kind == "embeddings":  # token and position tables, as Keras' Embedding initialises them
            value = rng.uniform(-0.05, 0.05, shape)
        else:
            raise AssertionError(f"no initialiser for parameter kind {kind!r}")
        weights[name] = value.astype(np.float32)
    return weights


def to_channels_first(array: np.ndarray, name: str = "") -> np.ndarray:
    """A canonical weight (named `name`) in the layout of channels-first frameworks (PyTorch, MXNet): conv and
    patch kernels [kH, kW, in, out] -> [out, in, kH, kW], dense and attention kernels [in, out] -> [out, in];
    vectors and embedding tables ([rows, D] in every framework) unchanged."""
    if name.endswith("embeddings"):
        return array
    if array.ndim == 4:
        return array.transpose(3, 2, 0, 1)
    if array.ndim == 2:
        return array.T
    return array


def from_channels_first(array: np.ndarray, name: str = "") -> np.ndarray:
    """The inverse of to_channels_first."""
    if name.endswith("embeddings"):
        return array
    if array.ndim == 4:
        return array.transpose(2, 3, 1, 0)
    if array.ndim == 2:
        return array.T
    return array
