"""What every adapter must do: load the canonical weights exactly, compute the spec's math, train, and fill
every field of a result record."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from harness import results
from harness.model import reference
from harness.model.data import Data
from harness.model.dropout import DropoutMasks
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.model.weights import initial_weights
from harness.parity import TOLERANCES
from harness.precision import LossScale, parse_precision
from harness.run.metrics import loss_and_correct
from tests.conftest import ROOT, pitfall_specs

# built-in models at sizes a 2-core CPU builds in seconds, and every pitfall spec
SPECS = {
    "mnist_mlp": lambda: load_spec("mnist_mlp").with_overrides(batch_size=16),
    "resnet8": lambda: load_spec("resnet8").with_overrides(batch_size=8, input_size=(16, 16)),
    "small_convnet": lambda: load_spec("small_convnet").with_overrides(batch_size=4, input_size=(64, 96)),
    **{p.stem: (lambda p=p: load_spec(str(p))) for p in pitfall_specs()},
}


def build(adapter, spec, precision="fp32"):
    graph = infer(spec)
    weights = initial_weights(graph, spec.seed)
    device = adapter.device("cpu")
    variant = next(iter(adapter.variants))
    trainer = adapter.build(spec, graph, weights, parse_precision(precision), LossScale(), device, variant)
    return trainer, graph, weights


def batch(trainer, spec, data, step):
    x, y = data.train_batch(step)
    return trainer.to_device(x, y, DropoutMasks(infer(spec), spec.seed).for_step(step, len(y)))


@pytest.mark.parametrize("name", SPECS)
def test_loads_canonical_weights_and_counts_the_same_parameters(adapter, name):
    spec = SPECS[name]()
    trainer, graph, weights = build(adapter, spec)
    loaded = trainer.get_weights()
    assert sorted(loaded) == sorted(weights)
    for key, value in weights.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    assert trainer.param_count() == graph.param_count


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
@pytest.mark.parametrize("name", SPECS)
def test_outputs_match_the_numpy_reference(adapter, name, precision):
    bound = TOLERANCES[precision][0]  # the parity check's bound for initial outputs
    spec = SPECS[name]()
    trainer, graph, weights = build(adapter, spec, precision)
    x, _ = Data(spec).fixed_batch()
    expected = reference.forward(spec, weights, x)
    got = trainer.predict(x)
    assert got.shape == expected.shape
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert error < bound, f"{precision}: max error {error:.2e} relative to the largest output"


@pytest.mark.parametrize("name", SPECS)
def test_first_training_step_computes_the_reference_loss_in_float64(adapter, name):
    """Training-mode forward (batch statistics, the core's dropout masks) and the loss, at the float64 bound
    for initial outputs: nothing has been trained yet to amplify rounding."""
    spec = SPECS[name]()
    trainer, graph, weights = build(adapter, spec, "fp64")
    data = Data(spec)
    x, y = data.train_batch(0)
    masks = DropoutMasks(graph, spec.seed).for_step(0, len(y))
    outputs = reference.forward(spec, weights, x, training=True, masks=masks)
    expected = loss_and_correct(spec.loss, outputs, y)[0] / len(y)
    got = trainer.train_step(trainer.to_device(x, y, masks))
    bound = TOLERANCES["fp64"][0]
    assert abs(got - expected) <= bound * abs(expected), f"loss {got!r}, the reference gives {expected!r}"


@pytest.mark.parametrize("name", ["mnist_mlp", "pitfall_batchnorm", "pitfall_same_padding"])
def test_fp32_training_lowers_the_loss(adapter, name):
    spec = SPECS[name]()
    trainer, _, _ = build(adapter, spec)
    data = Data(spec)
    losses = [trainer.train_step(batch(trainer, spec, data, step)) for step in range(30)]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def amp_run(tmp_path, *args):
    out = subprocess.run([sys.executable, "-m", "harness", "run", "--repeats", "1", "--out", str(tmp_path),
                          "--no-progress", "--threads", "2", *args], capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    return results.read_records([tmp_path])


def test_run_writes_complete_records_for_each_precision(tmp_path, framework):
    records = amp_run(tmp_path, "--framework", framework, "--model", "mnist_mlp",
                      "--precision", "fp32,amp_bf16,amp_fp16", "--steps", "30")
    by_precision = {r["precision"]: r for r in records}
    assert set(by_precision) == {"fp32", "amp_bf16", "amp_fp16"}
    for precision, r in by_precision.items():
        if r["status"] == "unsupported":
            assert r["reason"], precision
            continue
        assert r["status"] == "ok", (precision, r["reason"])
        assert set(r) == set(results.FIELDS)
        missing = [k for k in results.FIELDS if r[k] is None and k not in ("reason", "study", "fingerprint", "diagnosis")]
        assert not missing, (precision, missing)
        assert len(r["loss"]) == 35 and len(r["step_times_ms"]) == 30
        assert r["step_time_ms"]["p10"] <= r["step_time_ms"]["median"] <= r["step_time_ms"]["p90"]
        assert r["framework"] == framework and r["framework_version"] and r["peak_memory_mb"] is not None
    scale = by_precision["amp_fp16"]["loss_scale"]
    if by_precision["amp_fp16"]["status"] == "ok":
        assert scale["initial"] == 2.0**16 and scale["final"] > 0 and scale["skipped_steps"] >= 0
        assert len(scale["history"]) == 35
    assert len({r["spec_hash"] for r in records}) == 1


def test_mnist_mlp_fp32_learns_digits(tmp_path, framework):
    (record,) = amp_run(tmp_path, "--framework", framework, "--model", "mnist_mlp", "--precision", "fp32")
    assert record["status"] == "ok" and record["eval_accuracy"] > 0.90


def test_fixed_and_dynamic_loss_scaling_record_overflows(tmp_path, framework):
    # a huge fixed scale overflows float16 gradients: every such step is skipped and counted
    records = amp_run(tmp_path, "--framework", framework, "--model", "tests/specs/pitfall_rmsprop_epsilon.yaml",
                      "--precision", "amp_fp16", "--steps", "5", "--warmup", "0", "--loss-scale", "1e30")
    (r,) = records
    if r["status"] == "unsupported":
        pytest.skip(r["reason"])
    assert r["loss_scale"]["settings"]["mode"] == "fixed"
    assert r["loss_scale"]["skipped_steps"] == 5 and r["loss_scale"]["first_overflow_step"] == 0


@pytest.mark.parametrize("name", ["pitfall_nested_residual_dropout", "pitfall_batchnorm", "mnist_mlp"])
def test_tensor_capture_in_canonical_names_and_layouts(adapter, name):
    """Diagnose mode: gradients of every trainable weight, each layer's output and its gradient."""
    spec = SPECS[name]()
    trainer, graph, weights = build(adapter, spec, "fp64")
    data = Data(spec)
    x, y = data.train_batch(0)
    masks = DropoutMasks(graph, spec.seed).for_step(0, len(y))
    captured = trainer.captured_step(trainer.to_device(x, y, masks))
    if captured is None:
        pytest.skip(f"{adapter.name} cannot capture tensors")
    loss, gradients = captured
    trainable = {k: v.shape for k, v in weights.items() if not k.rsplit(".", 1)[1].startswith("moving_")}
    assert {k: v.shape for k, v in gradients.items()} == trainable
    # the gradient of the loss at the initial weights: check one weight by a central difference in float64
    name0 = next(iter(trainable))
    index = np.unravel_index(np.argmax(np.abs(gradients[name0])), trainable[name0])

    def loss_at(delta):
        w = {k: v.astype(np.float64) for k, v in weights.items()}
        w[name0][index] += delta
        outputs = reference.forward(spec, w, x, training=True, masks=masks)
        return loss_and_correct(spec.loss, outputs, y)[0] / len(y)
    numeric = (loss_at(1e-6) - loss_at(-1e-6)) / 2e-6
    assert gradients[name0][index] == pytest.approx(numeric, rel=1e-5, abs=1e-9)
    outputs = trainer.layer_outputs(*data.fixed_batch())
    shapes = {info.path: info.out_shape for info in graph.layers}
    assert outputs and set(outputs) <= set(shapes)
    for path, (value, grad) in outputs.items():
        assert value.shape[1:] == shapes[path] and grad.shape == value.shape, path
