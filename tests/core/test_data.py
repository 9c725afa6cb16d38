"""Datasets, batch order, canonical weights and the numpy reference forward pass."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

from harness.errors import HarnessError
from harness.model.data import Data
from harness.model.graph import infer
from harness.model.reference import forward
from harness.model.spec import load_spec, validate
from harness.model.weights import initial_weights
from harness.run.metrics import loss_and_correct


def test_batches_are_deterministic_and_cover_each_epoch():
    spec = load_spec("mnist_mlp").with_overrides(batch_size=100)
    a, b = Data(spec), Data(spec)
    x0, y0 = a.train_batch(3)
    x1, y1 = b.train_batch(3)
    assert x0.shape == (100, 28, 28, 1) and x0.dtype == np.float32 and y0.dtype == np.int64
    np.testing.assert_array_equal(x0, x1)
    np.testing.assert_array_equal(y0, y1)
    epoch = np.concatenate([a.train_indices(s) for s in range(a.batches_per_epoch)])
    assert len(set(epoch)) == len(epoch) == a.batches_per_epoch * 100
    assert not set(epoch) & set(a.eval_idx)  # held-out samples never train
    assert not np.array_equal(a.train_indices(0), a.train_indices(a.batches_per_epoch))  # reshuffled


def test_digits_resize_and_channels():
    spec = load_spec("small_convnet").with_overrides(input_size=(64, 96), batch_size=8)
    x, y = Data(spec).train_batch(0)
    assert x.shape == (8, 64, 96, 3) and set(np.unique(y)) <= {0, 1}
    assert 0.0 <= x.min() and x.max() <= 1.0 + 1e-6


def test_digits_as_vectors():
    data = yaml.safe_load(open("tests/specs/pitfall_rmsprop_epsilon.yaml"))
    data.update(input={"shape": [64]}, dataset={"name": "digits", "num_classes": 10})
    data["layers"][-2]["units"] = 10
    x, y = Data(validate(data, "test")).train_batch(0)
    assert x.shape == (16, 64) and y.max() <= 9
    data["input"]["shape"] = [60]
    with pytest.raises(HarnessError, match="needs a square size, got 60"):
        Data(validate(data, "test"))


def test_synthetic_is_learnable_by_its_templates():
    spec = load_spec("resnet8")
    data = Data(spec)
    x, y = data.train_batch(0)
    templates = data.source.templates.reshape(len(data.source.templates), -1)
    nearest = ((x.reshape(len(x), 1, -1) - templates[None]) ** 2).sum(-1).argmin(1)
    assert (nearest == y).mean() > 0.9


def test_image_folder(tmp_path):
    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        for i in range(12):
            Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(tmp_path / label / f"{i}.png")
    data = yaml.safe_load(open("tests/specs/pitfall_batchnorm.yaml"))
    data["dataset"] = {"name": "image_folder", "num_classes": 2, "path": str(tmp_path)}
    data["batch_size"] = 4
    spec = validate(data, "test")
    d = Data(spec)
    x, y = d.train_batch(0)
    assert x.shape == (4, 8, 8, 3) and len(d.eval_idx) + len(d.train_idx) == 24
    (tmp_path / "dog" / "bad.png").write_text("not an image")
    with pytest.raises(HarnessError, match="bad.png: unreadable image"):
        Data(spec)
    (tmp_path / "dog" / "bad.png").unlink()
    (tmp_path / "bird").mkdir()
    with pytest.raises(HarnessError, match="found 3 class folders"):
        Data(validate(data, "test"))


def test_initial_weights_are_canonical_and_seeded():
    spec = load_spec("resnet8")
    graph = infer(spec)
    w = initial_weights(graph, spec.seed)
    assert {k: v.shape for k, v in w.items()} == graph.param_shapes()
    assert w["0.kernel"].shape == (3, 3, 3, 16) and w["10.kernel"].shape == (64, 10)
    assert all(v.dtype == np.float32 for v in w.values())
    np.testing.assert_array_equal(w["0.kernel"], initial_weights(graph, spec.seed)["0.kernel"])
    assert not np.array_equal(w["0.kernel"], initial_weights(graph, spec.seed + 1)["0.kernel"])


def test_reference_forward_of_a_known_network():
    data = yaml.safe_load(open("tests/specs/pitfall_flatten_dense.yaml"))
    data["layers"] = [{"type": "flatten"}, {"type": "dense", "units": 3}]
    spec = validate(data, "test")
    x = np.arange(2 * 8 * 6 * 2, dtype=np.float32).reshape(2, 8, 6, 2)
    w = initial_weights(infer(spec), 0)
    expected = x.reshape(2, -1) @ w["1.kernel"] + w["1.bias"]  # NHWC flatten order
    np.testing.assert_allclose(forward(spec, w, x), expected, rtol=1e-5)


def test_metrics():
    spec = load_spec("mnist_mlp")
    logits = np.array([[10.0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 10.0, 0, 0, 0, 0, 0, 0, 0]])
    total, correct = loss_and_correct(spec.loss, logits, np.array([0, 1]))
    assert correct == 1 and total == pytest.approx(np.log(1 + 9 * np.exp(-10)) + 10 + np.log(1 + 9 * np.exp(-10)))
    bce = load_spec("small_convnet").loss
    total, correct = loss_and_correct(bce, np.array([[0.9], [0.2]]), np.array([1, 1]))
    assert correct == 1 and total == pytest.approx(-np.log(0.9) - np.log(0.2))


def test_digits_are_scikit_learns_without_importing_it():
    """The shipped file gives load_digits()'s arrays (scikit-learn is installed in the core's env for this check
    alone), and reading it imports no scikit-learn."""
    code = ("import sys, numpy as np; from harness.model.data import digits; pixels, labels = digits(); "
            "assert 'sklearn' not in sys.modules, 'sklearn imported'; "
            "from sklearn.datasets import load_digits; d = load_digits(); "
            "assert np.array_equal(pixels, d.images) and np.array_equal(labels, d.target), 'values differ'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr.strip().splitlines()[-1:]
