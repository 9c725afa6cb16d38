"""The rules every adapter follows, kept once in the core: dropout masks, window geometry, loss-scale rules."""
from __future__ import annotations

import numpy as np
import pytest

from harness.model import reference
from harness.model.dropout import DropoutMasks
from harness.model.graph import avgpool_divisors, infer, window_padding
from harness.model.spec import load_spec, validate
from harness.model.weights import initial_weights
from harness.adapter import Capabilities
from harness.precision import LossScale, LossScaler, parse_precision
from tests.conftest import SPECS
from tests.fake_adapter.fake_adapter import FakeAdapter


def test_dropout_masks_are_a_function_of_seed_layer_and_step_alone():
    spec = load_spec(str(SPECS / "pitfall_nested_residual_dropout.yaml"))
    masks = DropoutMasks(infer(spec), spec.seed)
    (path, rate, shape), = masks.layers
    assert path == "2.layers.2.layers.2" and rate == 0.2 and shape == (12, 12, 6)
    step7 = masks.for_step(7, 16)[path]
    assert step7.shape == (16, 12, 12, 6) and step7.dtype == np.float32 and set(np.unique(step7)) == {0.0, 1.0}
    for step in range(7):
        masks.for_step(step, 16)  # drawing other steps first changes nothing: no stream to replay
    np.testing.assert_array_equal(DropoutMasks(infer(spec), spec.seed).for_step(7, 16)[path], step7)
    assert not np.array_equal(masks.for_step(8, 16)[path], step7)
    assert not np.array_equal(DropoutMasks(infer(spec), spec.seed + 1).for_step(7, 16)[path], step7)
    assert abs(1 - step7.mean() - rate) < 0.02  # 13824 draws: the dropped share is the rate


def test_each_dropout_layer_has_its_own_mask_and_rate_zero_has_none():
    spec = load_spec(str(SPECS / "pitfall_dropout_adam.yaml"))
    masks = DropoutMasks(infer(spec), spec.seed).for_step(0, 64)
    assert sorted(masks) == ["3", "6"]
    assert abs(1 - masks["3"].mean() - 0.3) < 0.03 and abs(1 - masks["6"].mean() - 0.15) < 0.03
    rate_zero = load_spec(str(SPECS / "pitfall_rmsprop_epsilon.yaml"))
    assert not DropoutMasks(infer(rate_zero), rate_zero.seed)


def test_the_reference_applies_masks_as_x_times_mask_over_keep_probability():
    spec = validate({"name": "d", "input": {"shape": [4]}, "dataset": {"name": "synthetic", "num_classes": 2},
                     "layers": [{"type": "dropout", "rate": 0.25}, {"type": "dense", "units": 2}],
                     "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
                     "optimizer": {"type": "sgd", "learning_rate": 0.1, "momentum": 0.0, "nesterov": False},
                     "batch_size": 3, "steps": 1}, "test")
    weights = initial_weights(infer(spec), 0)
    x = np.random.default_rng(0).standard_normal((3, 4))
    mask = np.array([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    expected = (x * mask / 0.75) @ weights["1.kernel"] + weights["1.bias"]
    np.testing.assert_allclose(reference.forward(spec, weights, x, training=True, masks={"0": mask}), expected)
    np.testing.assert_allclose(reference.forward(spec, weights, x), x @ weights["1.kernel"] + weights["1.bias"])


@pytest.mark.parametrize("size, kernel, stride", [(10, 3, 2), (12, 2, 1), (5, 3, 2), (7, 1, 3), (6, 4, 4)])
def test_window_geometry_matches_tensorflow_same_padding(size, kernel, stride):
    padding = window_padding((size, size, 3), kernel, stride, "same")
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    if padding.explicit is None:
        assert padding.symmetric[0] * 2 == total
    else:
        top, bottom, _, _ = padding.explicit
        assert (top, bottom) == (total // 2, total - total // 2) and bottom == top + 1
    # divisors: count the real pixels of each window by brute force
    divisors = avgpool_divisors((size, size, 1), kernel, stride, "same")
    before = total // 2
    rows = [sum(0 <= start * stride - before + i < size for i in range(kernel)) for start in range(-(-size // stride))]
    np.testing.assert_array_equal(divisors, np.outer(rows, rows))
    assert (avgpool_divisors((size, size, 1), min(kernel, size), stride, "valid") == min(kernel, size) ** 2).all()


def test_loss_scale_rules_back_off_at_once_and_grow_after_the_interval():
    rules = LossScaler(LossScale("dynamic", initial=8.0, growth_interval=3))
    trace = [(rules.update(finite), rules.scale) for finite in (True, False, True, True, True, True, False)]
    assert trace == [(False, 8.0), (True, 4.0), (False, 4.0), (False, 4.0), (False, 8.0), (False, 8.0), (True, 4.0)]
    fixed = LossScaler(LossScale("fixed", initial=1e30))
    assert [fixed.update(f) for f in (False, True)] == [True, False] and fixed.scale == 1e30


class FixedScalerAdapter(FakeAdapter):
    """An adapter whose own dynamic loss scaler grows by 2 and backs off by 0.5 only, and needs AMP."""

    name = "fake_fixed_scaler"
    capabilities = Capabilities(dynamic_scale_factors=(2.0, 0.5, "its AMP scaler"),
                                dynamic_scale_needs_mixed="scales the loss dynamically with AMP only")


def _run(monkeypatch, precision: str, loss_scale: str, growth: int = 2000) -> dict:
    from harness.run import worker
    from harness.run.plan import resolve

    monkeypatch.setattr(worker, "load_adapter", lambda name: FixedScalerAdapter())
    spec = resolve(str(SPECS / "pitfall_dropout_adam.yaml"), steps=2)[0].model_dump(mode="json")
    return worker.run(worker.RunRequest(framework="fake", model="m", spec=spec, precision=precision, repeat=0,
                                        run_id="r", warmup=1, mode="fingerprint", loss_scale=loss_scale,
                                        growth_interval=growth, measure_peak=False))


def test_a_loss_scale_rule_the_adapters_scaler_cannot_follow_is_unsupported_with_the_reason(monkeypatch):
    ok = _run(monkeypatch, "amp_fp16", "dynamic")
    assert ok["status"] == "ok", ok["reason"]
    adapter, precision = FixedScalerAdapter(), parse_precision("amp_fp16")
    other = LossScale("dynamic", growth_factor=4.0)
    assert adapter.unsupported_loss_scale(precision, other) == \
        "fake_fixed_scaler: its AMP scaler grows the loss scale by 2 and backs off by 0.5 only (asked: 4 and 0.5)"
    assert adapter.unsupported_loss_scale(precision, LossScale("fixed", growth_factor=4.0)) is None
    pure = _run(monkeypatch, "fp16", "dynamic")
    assert (pure["status"], pure["reason"]) == \
        ("unsupported", "fake_fixed_scaler scales the loss dynamically with AMP only")
    assert _run(monkeypatch, "fp16", "1024")["status"] == "ok"  # a fixed scale needs no scaler of its own


def _numpy_loss_ops():
    from harness.model.training import LossOps

    def nll(logp, labels):
        return -np.take_along_axis(logp, labels[..., None], axis=-1).mean()

    def log_softmax(x):
        shifted = x - x.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    return LossOps(upcast=lambda x: x if x.dtype == np.float64 else x.astype(np.float32),
                   softmax_cross_entropy=lambda out, labels: nll(log_softmax(out), labels),
                   normalized=lambda x: x / x.sum(axis=-1, keepdims=True), nll=nll,
                   first_column=lambda x: x[:, 0], labels_like=lambda labels, out: labels.astype(out.dtype),
                   clip=np.clip, log=np.log, log1p=np.log1p, exp=np.exp, abs=np.abs,
                   relu=lambda x: np.maximum(x, 0), mean=np.mean)


@pytest.mark.parametrize("kind, from_logits", [("sparse_categorical_crossentropy", True),
                                               ("sparse_categorical_crossentropy", False),
                                               ("binary_crossentropy", True), ("binary_crossentropy", False)])
def test_the_loss_is_written_once_as_the_evaluations_float64_one_in_float32(kind, from_logits):
    """harness.model.training.loss_with on numpy's primitives against the core's float64 evaluation: the upcast
    of 16-bit outputs, the probability epsilon and the stable binary cross-entropy from logits."""
    from harness.model.spec import Loss
    from harness.model.training import loss_with
    from harness.run.metrics import loss_and_correct

    rng = np.random.default_rng(1)
    loss = Loss(type=kind, from_logits=from_logits)
    if kind == "binary_crossentropy":
        outputs = rng.normal(0, 30, (64, 1)) if from_logits else rng.uniform(0, 1, (64, 1))
        outputs[:4, 0] = [0.0, 1.0, 500.0, -500.0] if not from_logits else [800.0, -800.0, 0.0, 1e-3]
        labels = rng.integers(0, 2, 64)
    else:
        outputs = rng.normal(0, 3, (8, 5, 11)) if from_logits else rng.uniform(0, 1, (8, 5, 11))
        labels = rng.integers(0, 11, (8, 5))
    half = outputs.astype(np.float16)
    value = loss_with(_numpy_loss_ops(), loss, half, labels)
    assert value.dtype == np.float32  # upcast: never computed in 16 bits
    expected = loss_and_correct(loss, half.astype(np.float64), labels)[0] / labels.size
    assert np.isfinite(value) and value == pytest.approx(expected, rel=1e-5)
    assert loss_with(_numpy_loss_ops(), loss, outputs, labels).dtype == np.float64


def test_clipping_is_c_over_the_larger_of_the_norm_and_c_and_leaves_a_skipped_step_alone():
    from harness.model.training import ClipOps, clip_factor_with

    ops = ClipOps(full_like=lambda n, v: np.full_like(n, v), maximum=np.maximum, where=np.where,
                  ones_like=np.ones_like)
    norms = np.array([0.5, 1.0, 4.0, np.inf, np.nan], np.float32)
    factor = clip_factor_with(ops, norms, 1.0)
    np.testing.assert_array_equal(factor[:3], np.float32([1.0, 1.0, 0.25]))  # no epsilon: exactly c / n
    assert factor.dtype == np.float32
    kept = clip_factor_with(ops, norms, 1.0, finite=np.isfinite(norms))
    np.testing.assert_array_equal(kept, np.float32([1.0, 1.0, 0.25, 1.0, 1.0]))
    assert clip_factor_with(ClipOps(lambda n, v: v, max, None, None), 8.0, 2.0) == 0.25  # on the host (MXNet)
