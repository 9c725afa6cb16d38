"""`amp-harness import keras` against real Keras: each test model and keras.applications model
(tests/core/data/keras/build_models.py) is built in Keras, its config imported into a spec, the harness's TensorFlow network built from the spec holding the Keras
model's own weights (copied into the canonical layout), and both networks' outputs compared in float32 on the
same inputs; the parameter counts must match too."""
from __future__ import annotations

import gzip
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from amp_harness_tensorflow.network import Network  # noqa: E402
from harness.model.graph import Graph, infer  # noqa: E402
from harness.model.importers.keras import import_keras  # noqa: E402
from harness.model.spec import validate  # noqa: E402

DATA = Path(__file__).resolve().parents[3] / "tests" / "core" / "data" / "keras"
_loader = importlib.util.spec_from_file_location("keras_test_models", DATA / "build_models.py")
MODELS = importlib.util.module_from_spec(_loader)
_loader.loader.exec_module(MODELS)

# canonical parameter -> the Keras weight's name, where they differ (keras.layers.RMSNormalization's "scale")
KERAS_NAMES = {("rmsnorm", "gamma"): "scale"}


def canonical_weights(model, graph: Graph, sources: dict[str, str]) -> dict[str, np.ndarray]:
    """The Keras model's weights in the canonical layout (harness.model.weights): Keras's kernels are already
    [kH, kW, in, out] and [in, out]; MultiHeadAttention's [D, H, Dh] and [H, Dh, D] kernels and [H, Dh] biases
    reshape row-major into the spec's [D, D] and [D] (head h is columns h*Dh .. (h+1)*Dh-1)."""
    out = {}
    for info in graph.layers:
        if not info.params:
            continue
        layer = model.get_layer(sources[info.path])
        if info.type == "attention":
            found = {}
            for part in ("query", "key", "value", "output"):
                dense = getattr(layer, f"{part}_dense")
                found[f"{part}_kernel"] = dense.kernel
                if dense.bias is not None:
                    found[f"{part}_bias"] = dense.bias
        else:
            found = {w.name: w for w in layer.weights}
        for param, shape in info.params.items():
            value = keras.ops.convert_to_numpy(found[KERAS_NAMES.get((info.type, param), param)])
            assert math.prod(value.shape) == math.prod(shape), (info.path, param, value.shape, shape)
            out[f"{info.path}.{param}"] = value.reshape(shape).astype(np.float32)
    return out


def _randomise(model, seed: int) -> None:
    """Keras initialises biases, betas and moving means to 0 and scales and variances to 1, which would hide a
    weight copied into the wrong place: draw them (kernels keep Keras's own draw)."""
    rng = np.random.default_rng(seed)
    for w in model.weights:
        name = w.name
        if name in ("bias", "beta", "moving_mean"):
            w.assign(rng.uniform(-0.2, 0.2, w.shape).astype("float32"))
        elif name in ("gamma", "moving_variance", "scale"):
            w.assign(rng.uniform(0.7, 1.3, w.shape).astype("float32"))


def _inputs(spec, rng, batch: int = 3) -> np.ndarray:
    shape = (batch, *spec.input.shape)
    if spec.tokens:
        return rng.integers(0, spec.input.vocab, shape).astype("int64")
    return rng.normal(0, 1, shape).astype("float32")


# and keras.applications (depthwise, relu6, swish, squeeze-and-excite, stochastic depth, Rescaling, dense blocks'
# concatenations, zero padding): about 10 s for the four
BUILT = {**MODELS.MODELS, **{name: MODELS.APPLICATIONS[name] for name in ("MobileNetV2", "EfficientNetB0", "DenseNet121", "ResNet50")}}


@pytest.mark.parametrize("name", list(BUILT))
def test_imported_network_computes_the_keras_model(tmp_path, name):
    keras.utils.set_random_seed(0)
    model = BUILT[name]()
    _randomise(model, 1)
    path = tmp_path / f"{name}.json"
    path.write_text(model.to_json())
    imported = import_keras(path)
    # the data the core's tests read is what this Keras writes
    written = DATA / f"{name}.json"
    if not written.exists():
        written = tmp_path / "written.json"
        written.write_bytes(gzip.decompress((DATA / f"{name}.json.gz").read_bytes()))
    assert imported.spec["layers"] == import_keras(written).spec["layers"]
    spec = validate(imported.spec, name)
    graph = infer(spec)
    normalization = sum(math.prod(w.shape) for layer in model.layers if type(layer).__name__ == "Normalization"
                        for w in layer.weights)  # its mean and variance, left out (the identity before adapt())
    assert sum(math.prod(s) for s in graph.param_shapes().values()) == model.count_params() - normalization
    assert graph.param_count == sum(math.prod(w.shape) for w in model.trainable_weights)
    assert json.loads((DATA / "params.json").read_text())[name]["count_params"] == model.count_params()

    net = Network(spec, graph, canonical_weights(model, graph, imported.sources), "float32")
    x = _inputs(spec, np.random.default_rng(2))
    expected = keras.ops.convert_to_numpy(model(x, training=False))
    got = keras.ops.convert_to_numpy(net.model(x, training=False))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
