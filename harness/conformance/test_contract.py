"""The adapter contract: what every adapter must do, checked on what the adapter itself did.

Each check names what to fix when it fails. The specs are the goldens' (every built-in model and pitfall spec
at CPU-sized batches), whose descriptions say which rule of the spec each one isolates.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from harness import results
from harness.conformance.plugin import THREADS
from harness.conformance.specs import SPECS, golden_request, hint, spec_file
from harness.model import reference
from harness.model.data import Data
from harness.model.dropout import DropoutMasks
from harness.model.graph import display_path, infer
from harness.model.weights import initial_weights
from harness.parity import TOLERANCES
from harness.precision import PRECISIONS, LossScale, LossScaler, parse_precision
from harness.records import Record
from harness.run.metrics import loss_and_correct


def build(adapter, spec, precision="fp32", loss_scale=LossScale()):
    graph = infer(spec)
    weights = initial_weights(graph, spec.seed)
    trainer = adapter.build(spec, graph, weights, parse_precision(precision), loss_scale, adapter.device("cpu"),
                            next(iter(adapter.variants)))
    return trainer, graph, weights


def batch(trainer, spec, data, step):
    x, y = data.train_batch(step)
    return trainer.to_device(x, y, DropoutMasks(infer(spec), spec.seed).for_step(step, len(y)))


def cli(cwd, *args, env=None):
    """The CLI in a fresh process. A run takes the adapter's first variant unless told: what the kit checks of a
    run (its records, its memory) is the network's, and `--variant auto` (tested in the core) would measure every
    variant first, torch.compile's workspace inside the memory figure and its compile time inside the kit's."""
    if args[0] == "run" and "--variant" not in args:
        from harness.adapter import load_adapter

        args = (*args, "--variant", next(iter(load_adapter(args[args.index("--framework") + 1]).variants)))
    out = subprocess.run([sys.executable, "-m", "harness", *args, "--out", str(cwd), "--no-progress",
                          "--threads", str(THREADS)],
                         capture_output=True, text=True, timeout=900, cwd=cwd, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return results.read_records([cwd])


# ---- packaging ----------------------------------------------------------------------------------------
def test_importing_the_entry_point_imports_no_framework(framework):
    """The core lists adapters without loading a framework: the adapter module imports it inside methods."""
    probe = (
        "import sys, harness.adapter\n"
        "from importlib.metadata import entry_points\n"
        f"(ep,) = [e for e in entry_points(group=harness.adapter.ENTRY_POINT_GROUP) if e.name == {framework!r}]\n"
        "own = ep.value.split('.')[0].split(':')[0]\n"
        "before = set(sys.modules)\n"
        "ep.load()\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(' '.join(sorted(new - set(sys.stdlib_module_names) - {own, 'harness'})))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert not out.stdout.split(), (f"importing the {framework} entry point imported {out.stdout.split()}: import "
                                    f"the framework inside methods (harness/adapter.py's first rule)")


def test_unsupported_reasons_are_one_line_and_fp32_runs_everywhere(unsupported):
    """The adapter's own reasons and the capability probe's, for every precision."""
    for name in PRECISIONS:
        reason = unsupported(name)
        assert reason is None or (isinstance(reason, str) and reason.strip() and "\n" not in reason), (
            f"unsupported({name}) must be None or a one-line reason, got {reason!r}")
    assert unsupported("fp32") is None, f"fp32 must run on every device: {unsupported('fp32')}"


# ---- the network and its math ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", SPECS)
def test_loads_canonical_weights_and_counts_the_same_parameters(adapter, name):
    spec = SPECS[name]
    trainer, graph, weights = build(adapter, spec)
    loaded = trainer.get_weights()
    assert sorted(loaded) == sorted(weights), hint(spec, "get_weights must return every canonical weight by name")
    for key, value in weights.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=hint(spec, f"{key} does not round-trip exactly "
                                      "(check the layout conversion in load and get_weights)"))
    assert trainer.param_count() == graph.param_count, hint(spec, "param_count differs from the spec's")


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
@pytest.mark.parametrize("name", SPECS)
def test_outputs_match_the_numpy_reference(adapter, unsupported, name, precision):
    if unsupported(precision):
        pytest.skip(f"{precision} unsupported here: {unsupported(precision)}")
    bound = TOLERANCES[precision][0]  # the parity check's bound for initial outputs
    spec = SPECS[name]
    trainer, graph, weights = build(adapter, spec, precision)
    x, _ = Data(spec).fixed_batch()
    expected = reference.forward(spec, weights, x)
    got = trainer.predict(x)
    assert got.shape == expected.shape, hint(spec, f"predict returned shape {got.shape}, expected {expected.shape}")
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert error < bound, hint(spec, f"{precision} inference outputs differ from the numpy reference by {error:.2e}"
                                     f"{first_differing_layer(trainer, spec, weights, x, bound)}")


def first_differing_layer(trainer, spec, weights, x, bound) -> str:
    """'; the first layer whose output differs: layers[1] (attention)', from the adapter's layer outputs (diagnose
    mode) against the reference's, in the network's order; '' when the adapter gives none or none differs."""
    expected: dict = {}
    reference.forward(spec, weights, x, layer_outputs=expected)
    got = trainer.layer_outputs(x, Data(spec).fixed_batch()[1]) or {}
    types = {info.path: info.type for info in infer(spec).layers}
    for path, want in expected.items():
        if path in got:
            error = np.abs(got[path][0] - want).max() / max(np.abs(want).max(), 1e-300)
            if not error < bound:
                return f"; the first layer whose output differs: layers{display_path(path)} ({types[path]})"
    return ""


@pytest.mark.parametrize("name", SPECS)
def test_first_training_step_computes_the_reference_loss_in_float64(adapter, unsupported, fingerprinted, name):
    """Training-mode forward (batch statistics, the core's dropout masks) and the loss, at the float64 bound
    for initial outputs: nothing has been trained yet to amplify rounding. The step is the first of the adapter's
    float64 fingerprint of the spec where --amp-fingerprints holds it (tox's, the same batch and masks), else one
    taken here."""
    if unsupported("fp64"):
        pytest.skip(f"fp64 unsupported here: {unsupported('fp64')}")
    spec = SPECS[name]
    graph = infer(spec)
    weights = initial_weights(graph, spec.seed)
    x, y = Data(spec).train_batch(0)
    masks = DropoutMasks(graph, spec.seed).for_step(0, len(y))
    outputs = reference.forward(spec, weights, x, training=True, masks=masks)
    expected = loss_and_correct(spec.loss, outputs, y)[0] / y.size
    record = fingerprinted(golden_request(adapter.name, name, "fp64"))
    if record is not None:
        got = record["loss"][0]
    else:
        trainer, _, _ = build(adapter, spec, "fp64")
        got = trainer.train_step(trainer.to_device(x, y, masks))
    assert abs(got - expected) <= TOLERANCES["fp64"][0] * abs(expected), hint(
        spec, f"training-mode loss {got!r}; the reference gives {expected!r}")


@pytest.mark.parametrize("name", ["mnist_mlp", "pitfall_batchnorm", "pitfall_same_padding"])
def test_fp32_training_lowers_the_loss(adapter, name):
    spec = SPECS[name]
    trainer, _, _ = build(adapter, spec)
    data = Data(spec)
    losses = [trainer.train_step(batch(trainer, spec, data, step)) for step in range(30)]
    assert all(np.isfinite(losses)), hint(spec, f"fp32 losses became non-finite: {losses}")
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), hint(spec, f"30 fp32 steps did not train: {losses}")


# ---- loss scaling: what the adapter reports and what it did ------------------------------------------------
def _loss_scaling_run(adapter, unsupported, settings, steps):
    spec = SPECS["pitfall_dropout_adam"]  # Adam: every applied step moves every weight that has a gradient
    if unsupported("amp_fp16"):
        pytest.skip(f"amp_fp16 unsupported here: {unsupported('amp_fp16')}")
    trainer, _, weights = build(adapter, spec, "amp_fp16", settings)
    data, rules, reported = Data(spec), LossScaler(settings), []
    for step in range(steps):
        before = {k: np.array(v, copy=True) for k, v in trainer.get_weights().items()}  # may be live views
        trainer.train_step(batch(trainer, spec, data, step))
        state = trainer.loss_scale_state()
        assert state is not None, "loss_scale_state must report the scaler's state in a scaled run"
        moved = any(not np.array_equal(before[k], v) for k, v in trainer.get_weights().items())
        assert moved != state.skipped, (f"step {step}: the adapter reports skipped={state.skipped} but the weights "
                                        f"{'moved' if moved else 'did not move'}")
        reported.append((state.scale, state.skipped))
    return reported, rules


def test_a_fixed_scale_that_overflows_skips_every_step(adapter, unsupported):
    reported, _ = _loss_scaling_run(adapter, unsupported, LossScale(mode="fixed", initial=1e30), 3)
    assert reported == [(1e30, True)] * 3, (f"a fixed scale of 1e30 overflows float16 gradients: every step must "
                                            f"be skipped and the scale kept; the adapter reported {reported}")


def test_dynamic_scaling_backs_off_and_grows_by_the_core_rules(adapter, unsupported):
    settings = LossScale(mode="dynamic", initial=2.0**32, growth_interval=2)  # powers of two: exact in any dtype
    reported, rules = _loss_scaling_run(adapter, unsupported, settings, 24)
    expected = []
    for _, skipped in reported:  # replay the adapter's overflows through the core's rules
        rules.update(finite=not skipped)
        expected.append((rules.scale, skipped))
    assert reported[0][1], "a scale of 2^32 must overflow float16 gradients on the first step"
    assert reported == expected, (f"(scale, skipped) after each step: the adapter reported {reported}; the core's "
                                  f"rules (harness.precision.LossScaler) give {expected}")
    assert any(b[0] > a[0] for a, b in zip(reported, reported[1:])), (
        f"the scale never backed off far enough to grow again in 24 steps: {reported}")


def test_dynamic_factors_the_scaler_cannot_follow_are_declared_not_trained_otherwise(adapter, unsupported):
    """Growth and back-off factors other than 2 and 0.5: the adapter's scaler follows them, or its capabilities
    say it cannot (Capabilities.dynamic_scale_factors), so that the run is recorded unsupported with the reason
    instead of training by other rules or failing in build."""
    settings = LossScale(mode="dynamic", initial=2.0**32, growth_interval=2, growth_factor=4.0, backoff_factor=0.25)
    reason = adapter.unsupported_loss_scale(parse_precision("amp_fp16"), settings)
    if reason:
        assert "\n" not in reason, f"unsupported_loss_scale's reason must be one line: {reason!r}"
        pytest.skip(f"declared: {reason}")
    reported, rules = _loss_scaling_run(adapter, unsupported, settings, 16)
    expected = []
    for _, skipped in reported:
        rules.update(finite=not skipped)
        expected.append((rules.scale, skipped))
    assert reported == expected, (
        f"(scale, skipped) after each step with growth factor 4 and back-off 0.25: the adapter reported {reported}; "
        f"the core's rules give {expected}. A scaler fixed to other factors declares them "
        f"(Capabilities.dynamic_scale_factors)")


# ---- timing ---------------------------------------------------------------------------------------------
def test_train_step_waits_for_the_device(adapter):
    """A step of known work cannot take less time than the device's own fastest matrix multiply allows: an
    adapter that returns before the device has finished the step fails here."""
    from harness.run.peak import matmul_gflops

    spec_dict = {"name": "conformance_timing", "input": {"shape": [1024]},
                 "dataset": {"name": "synthetic", "num_classes": 2, "size": 512},
                 "layers": [{"type": "dense", "units": 1024}, {"type": "relu"}, {"type": "dense", "units": 1024},
                            {"type": "relu"}, {"type": "dense", "units": 2}],
                 "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
                 "optimizer": {"type": "sgd", "learning_rate": 0.01, "momentum": 0.0, "nesterov": False},
                 "batch_size": 256, "steps": 5}
    from harness.model.spec import validate

    spec = validate(spec_dict, "conformance_timing")
    device = adapter.device("cpu")
    peak = matmul_gflops(adapter, device, "float32")
    if not peak:
        pytest.skip("the adapter measures no float32 matmul peak (Adapter.matmul)")
    trainer, graph, _ = build(adapter, spec)
    data = Data(spec)
    trainer.train_step(batch(trainer, spec, data, 0))  # warm-up: compilation
    steps = [batch(trainer, spec, data, step) for step in range(1, 4)]
    started = time.perf_counter()
    for b in steps:
        trainer.train_step(b)
    per_step = (time.perf_counter() - started) / len(steps)
    fastest = graph.train_step_flops(spec.batch_size) / (peak * 1e9)
    # a quarter: the square-matmul figure is not a hard ceiling (XLA ran this step at 2x its own figure here),
    # while a step that returns early takes a small fraction of the bound
    assert per_step >= 0.25 * fastest, (f"train_step took {per_step * 1e3:.2f} ms for work that needs at least "
                                       f"{fastest * 1e3:.2f} ms at the device's matmul peak: it returns before the "
                                       f"device has finished (synchronise before returning the loss)")


# ---- records --------------------------------------------------------------------------------------------
def test_run_writes_complete_records_for_each_precision(tmp_path, framework, adapter, unsupported):
    records = cli(tmp_path, "run", "--framework", framework, "--model", spec_file(tmp_path, "mnist_mlp"),
                  "--precision", "fp32,amp_bf16,amp_fp16", "--steps", "30", "--repeats", "1")
    by_precision = {r["precision"]: r for r in records}
    assert set(by_precision) == {"fp32", "amp_bf16", "amp_fp16"}
    assert by_precision["fp32"]["status"] == "ok", by_precision["fp32"]["reason"]
    for precision, r in by_precision.items():
        if r["status"] == "unsupported":
            assert r["reason"] == unsupported(precision), (
                f"{precision} is unsupported in the record ({r['reason']}), but the capability probe says "
                f"{unsupported(precision) or 'it runs'}")
            continue
        assert r["status"] == "ok", (precision, r["reason"])
        optional = ("reason", "study", "fingerprint", "diagnosis", "variant_choice", "tokens_per_sample",
                    "nonfinite", "width", "matmul_curve", "matmul_shapes", "auto_round") + (
            ("efficiency",) if adapter.matmul((2, 2, 2), "float32", adapter.device("cpu")) is None
            else ())  # no peak known
        missing = [k for k in Record.fields() if r[k] is None and k not in optional]
        assert not missing, f"{precision}: record fields left empty: {missing}"
        assert len(r["loss"]) == 35 and len(r["step_times_ms"]) == 30
        assert r["framework"] == framework and r["framework_version"]


def test_mnist_mlp_fp32_learns_digits(tmp_path, framework):
    spec = SPECS["mnist_mlp"].model_dump(mode="json")
    path = tmp_path / "mnist_mlp_full.yaml"
    path.write_text(yaml.safe_dump({**spec, "batch_size": 64, "steps": 300}))
    (record,) = cli(tmp_path, "run", "--framework", framework, "--model", str(path), "--precision", "fp32",
                    "--repeats", "1")
    assert record["status"] == "ok" and record["eval_accuracy"] > 0.90, (
        f"mnist_mlp reaches {record['eval_accuracy']} in fp32 after 300 steps; every framework reaches > 0.90")


# ---- tensor capture (optional) ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, precision", [("pitfall_batchnorm", "fp32"), ("pitfall_dropout_adam", "amp_fp16")])
def test_the_capturing_twin_trains_as_the_plain_step(adapter, unsupported, name, precision):
    """Fingerprints train every step through captured_step (harness.run.worker): one compiled step instead of
    two. So the twin must train as train_step does, loss scaling and batchnorm's statistics included: the same
    losses, scales and outputs within the parity check's bounds for the precision."""
    if unsupported(precision):
        pytest.skip(f"{precision} unsupported here: {unsupported(precision)}")
    spec, steps = SPECS[name], 4
    settings = LossScale(mode="dynamic", initial=2.0**20, growth_interval=2) if precision == "amp_fp16" else LossScale()
    runs = []
    for capturing in (False, True):
        trainer, _, _ = build(adapter, spec, precision, settings)
        data, losses, scales = Data(spec), [], []
        for step in range(steps):
            b = batch(trainer, spec, data, step)
            captured = trainer.captured_step(b) if capturing else None
            if capturing and captured is None:
                pytest.skip(f"{adapter.name} cannot capture tensors")
            losses.append(captured[0] if capturing else trainer.train_step(b))
            state = trainer.loss_scale_state()
            scales.append(state and (state.scale, state.skipped))
        runs.append((np.array(losses), scales, trainer.predict(data.fixed_batch()[0])))
    (plain_losses, plain_scales, plain_out), (twin_losses, twin_scales, twin_out) = runs
    _, loss_bound, output_bound = TOLERANCES[precision]
    assert twin_scales == plain_scales, hint(spec, f"loss scale (scale, skipped) per step: train_step "
                                                  f"{plain_scales}, captured_step {twin_scales}")
    loss_error = np.abs(twin_losses - plain_losses).max() / np.abs(plain_losses).max()
    assert loss_error <= loss_bound, hint(spec, f"{precision} losses: train_step {plain_losses}, captured_step "
                                               f"{twin_losses}: the capturing twin must train as the plain step")
    output_error = np.abs(twin_out - plain_out).max() / np.abs(plain_out).max()
    assert output_error <= output_bound, hint(spec, f"{precision} outputs after {steps} steps differ by "
                                                   f"{output_error:.2e} between train_step and captured_step")


@pytest.mark.parametrize("name", ["pitfall_nested_residual_dropout", "pitfall_batchnorm", "mnist_mlp"])
def test_tensor_capture_in_canonical_names_and_layouts(adapter, name):
    """Diagnose mode: gradients of every trainable weight, each layer's output and its gradient."""
    spec = SPECS[name]
    trainer, graph, weights = build(adapter, spec, "fp64")
    data = Data(spec)
    x, y = data.train_batch(0)
    masks = DropoutMasks(graph, spec.seed).for_step(0, len(y))
    captured = trainer.captured_step(trainer.to_device(x, y, masks))
    if captured is None:
        pytest.skip(f"{adapter.name} cannot capture tensors")
    loss, gradients = captured
    trainable = graph.trainable_shapes()
    assert {k: v.shape for k, v in gradients.items()} == trainable, "captured gradients: one per trainable weight"
    # the gradient of the loss at the initial weights: check one weight by a central difference in float64
    name0 = next(iter(trainable))
    index = np.unravel_index(np.argmax(np.abs(gradients[name0])), trainable[name0])

    def loss_at(delta):
        w = {k: v.astype(np.float64) for k, v in weights.items()}
        w[name0][index] += delta
        outputs = reference.forward(spec, w, x, training=True, masks=masks)
        return loss_and_correct(spec.loss, outputs, y)[0] / y.size
    numeric = (loss_at(1e-6) - loss_at(-1e-6)) / 2e-6
    assert gradients[name0][index] == pytest.approx(numeric, rel=1e-5, abs=1e-9), hint(
        spec, f"the captured gradient of {name0} is not the loss's derivative (unscaled, before the update)")
    outputs = trainer.layer_outputs(*data.fixed_batch())
    shapes = {info.path: info.out_shape for info in graph.layers}
    assert outputs and set(outputs) <= set(shapes), f"layer_outputs keys must be layer paths: {sorted(outputs)}"
    for path, (value, grad) in outputs.items():
        assert value.shape[1:] == shapes[path] and grad.shape == value.shape, f"{path}: canonical (NHWC) shapes"
