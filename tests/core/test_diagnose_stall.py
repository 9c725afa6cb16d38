"""diagnose (harness.run.diagnose) on tests/specs/norm_stall.yaml, with a numpy trainer of that spec standing in for
a framework: the capture, the per-layer update counts, the matmul errors and the verdicts they make, from real SGD
training. The trainer is held to the reference forward (harness.model.reference) and to its gradients."""
from __future__ import annotations

import numpy as np
import pytest

from harness import numerics
from harness.model import reference
from harness.model.data import Data
from harness.model.dropout import DropoutMasks
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.model.weights import initial_weights
from harness.run.diagnose import diagnose
from tests.conftest import SPECS

SPEC = load_spec(str(SPECS / "norm_stall.yaml"))


class NumpyTrainer:
    """dense 0 -> rmsnorm 1 -> relu 2 -> dense 3 -> softmax cross-entropy (mean over the batch), trained with the
    spec's plain SGD in float32: the Trainer methods diagnose calls."""

    def __init__(self, spec, weights):
        self.w = {name: np.asarray(value, np.float32).copy() for name, value in weights.items()}
        self.lr, self.epsilon = np.float32(spec.optimizer.learning_rate), spec.layers[1].epsilon

    def to_device(self, x, y, masks):
        return np.asarray(x, np.float32), np.asarray(y)

    def get_weights(self):
        return self.w  # live, as torch's on a CPU: diagnose copies what it keeps

    def _pass(self, x, y):
        """The loss, every layer's output and the loss's gradient with respect to each output and weight."""
        w = self.w
        h0 = x @ w["0.kernel"] + w["0.bias"]
        rms = np.sqrt((h0 * h0).mean(-1, keepdims=True) + np.float32(self.epsilon))
        normed = h0 / rms
        h1 = normed * w["1.gamma"]
        h2 = np.maximum(h1, 0)
        z = h2 @ w["3.kernel"] + w["3.bias"]
        shifted = z - z.max(-1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        loss = float(-log_p[np.arange(len(y)), y].mean())
        dz = np.exp(log_p)
        dz[np.arange(len(y)), y] -= 1
        dz /= len(y)
        dh2 = dz @ w["3.kernel"].T
        dh1 = dh2 * (h1 > 0)
        dnormed = dh1 * w["1.gamma"]
        dh0 = (dnormed - normed * (dnormed * normed).mean(-1, keepdims=True)) / rms
        grads = {"0.kernel": x.T @ dh0, "0.bias": dh0.sum(0), "1.gamma": (dh1 * normed).sum(0),
                 "3.kernel": h2.T @ dz, "3.bias": dz.sum(0)}
        outputs = {"0": (h0, dh0), "1": (h1, dh1), "2": (h2, dh2), "3": (z, dz)}
        return loss, outputs, grads

    def captured_step(self, batch):
        loss, _, grads = self._pass(*batch)
        for name, grad in grads.items():
            self.w[name] -= self.lr * grad
        return loss, grads

    def train_step(self, batch):
        return self.captured_step(batch)[0]

    def layer_outputs(self, x, y):
        return self._pass(np.asarray(x, np.float32), np.asarray(y))[1]


def test_the_numpy_trainer_is_the_spec_s_math():
    graph = infer(SPEC)
    weights = initial_weights(graph, SPEC.seed)
    x, y = Data(SPEC).train_batch(0)
    trainer = NumpyTrainer(SPEC, weights)
    loss, outputs, grads = trainer._pass(np.asarray(x, np.float32), y)

    def reference_loss(w):
        z = reference.forward(SPEC, w, x)
        z = z - z.max(-1, keepdims=True)
        return float(-(z[np.arange(len(y)), y] - np.log(np.exp(z).sum(-1))).mean())

    w64 = {k: v.astype(np.float64) for k, v in weights.items()}
    assert loss == pytest.approx(reference_loss(w64), rel=1e-5)
    for name, index in (("1.gamma", (5,)), ("0.kernel", (20, 7)), ("3.bias", (2,))):
        bumped = [{**w64, name: w64[name].copy()} for _ in range(2)]
        bumped[0][name][index] += 1e-6
        bumped[1][name][index] -= 1e-6
        numeric = (reference_loss(bumped[0]) - reference_loss(bumped[1])) / 2e-6
        assert grads[name][index] == pytest.approx(numeric, rel=1e-3, abs=1e-7), name


def test_diagnose_names_the_norm_that_bf16_never_moves_and_finds_stochastic_rounding_and_kahan_safe():
    graph = infer(SPEC)
    record: dict = {}
    diagnose(SPEC, graph, Data(SPEC), DropoutMasks(graph, SPEC.seed),
             NumpyTrainer(SPEC, initial_weights(graph, SPEC.seed)), record, every=10)
    assert record["status"] == "ok", record
    d = record["diagnosis"]
    assert d["captured_steps"] == [0, 10, 20, 30, 40, 49] and d["layer_types"]["1"] == "rmsnorm"
    outcomes = d["outcomes"]
    assert outcomes["bf16"] == "stalls: 100.0% of layer 1 (rmsnorm)'s updates vanish in bfloat16 (fix: bf16_sr or " \
                               "bf16_kahan)"
    assert outcomes["bf16_sr"] == outcomes["bf16_kahan"] == outcomes["amp_bf16"] == "safe", outcomes
    assert outcomes["fp16"].startswith("stalls: ") and outcomes["fp16"].endswith("(fix: fp16_sr)")
    # the norm's scales: every update below half a bfloat16 ulp of 1.0, kept by stochastic rounding and Kahan
    norm = d["updates"]["1"]
    assert norm["bfloat16"] == norm["updates"] > 0 and norm["bfloat16_sr"] == 0
    assert norm["bfloat16_kahan"] < 0.01 * norm["magnitude"]
    # the two dense layers' matmuls, measured on the captured inputs: bfloat16's rounding, not a conditioning problem
    assert set(d["matmul_error"]) == {"0", "3"}
    for errors in d["matmul_error"].values():
        assert 2.0**-14 < errors["float16"] < errors["bfloat16"] < numerics.MATMUL_ERROR / 4
