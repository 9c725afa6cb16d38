"""diagnose's block-format statistics and verdicts (harness.microscaling's last section): the counts on hand-made
blocks, each operand blocked along the axis its product sums over, the product error on training's own operands,
and diagnose on tests/specs/outlier_channel.yaml with a numpy trainer standing in for a framework: MXFP4
names the two layers the 100x channel passes through, MXFP8 is safe."""
from __future__ import annotations

import numpy as np
import pytest

from harness import microscaling as ms
from harness.model import reference
from harness.model.data import Data
from harness.model.dropout import DropoutMasks
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.model.weights import initial_weights
from harness.records import DiagnosisRecord
from harness.rounding import NUMPY_OPS
from harness.run.diagnose import diagnose
from tests.conftest import SPECS

SPEC = load_spec(str(SPECS / "outlier_channel.yaml"))


class SequentialTrainer:
    """The spec's dense, rescaling and relu layers in sequence, softmax cross-entropy (mean over the batch), plain
    SGD in float32: the Trainer methods diagnose calls."""

    def __init__(self, spec, weights):
        self.layers = [(str(i), layer) for i, layer in enumerate(spec.layers)]
        self.w = {name: np.asarray(value, np.float32).copy() for name, value in weights.items()}
        self.lr = np.float32(spec.optimizer.learning_rate)

    def to_device(self, x, y, masks):
        return np.asarray(x, np.float32), np.asarray(y)

    def get_weights(self):
        return self.w

    def _pass(self, x, y):
        inputs, h = [], np.asarray(x, np.float32)
        for path, layer in self.layers:
            inputs.append(h)
            if layer.type == "dense":
                h = h @ self.w[f"{path}.kernel"] + self.w[f"{path}.bias"]
            elif layer.type == "rescaling":
                h = (h * np.asarray(layer.scale, np.float32) + np.float32(layer.offset)).astype(np.float32)
            else:
                h = np.maximum(h, 0)
            inputs.append(h)  # the output, kept beside the input
        z = h
        shifted = z - z.max(-1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        loss = float(-log_p[np.arange(len(y)), y].mean())
        grad = np.exp(log_p)
        grad[np.arange(len(y)), y] -= 1
        grad /= len(y)
        outputs, grads = {}, {}
        for i in reversed(range(len(self.layers))):
            path, layer = self.layers[i]
            x_in, out = inputs[2 * i], inputs[2 * i + 1]
            outputs[path] = (out, grad)
            if layer.type == "dense":
                grads[f"{path}.kernel"], grads[f"{path}.bias"] = x_in.T @ grad, grad.sum(0)
                grad = grad @ self.w[f"{path}.kernel"].T
            elif layer.type == "rescaling":
                grad = grad * np.asarray(layer.scale, np.float32)
            else:
                grad = grad * (x_in > 0)
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


def _diagnosed() -> dict:
    graph = infer(SPEC)
    record: dict = {}
    trainer = SequentialTrainer(SPEC, initial_weights(graph, SPEC.seed))
    diagnose(SPEC, graph, Data(SPEC), DropoutMasks(graph, SPEC.seed), trainer, record, every=5)
    return record


def test_the_sequential_trainer_is_the_spec_s_math():
    graph = infer(SPEC)
    weights = initial_weights(graph, SPEC.seed)
    x, y = Data(SPEC).train_batch(0)
    _, outputs, grads = SequentialTrainer(SPEC, weights)._pass(np.asarray(x, np.float32), y)
    assert np.allclose(outputs["4"][0], reference.forward(SPEC, weights, x), rtol=1e-4, atol=1e-4)
    assert np.allclose(outputs["1"][1], outputs["2"][1] @ weights["2.kernel"].T)  # the rescaling's gradient flows
    assert np.allclose(grads["0.kernel"], np.asarray(x, np.float32).T @ outputs["0"][1], rtol=1e-4, atol=1e-6)


def test_diagnose_names_the_layers_the_outlier_channel_passes_for_mxfp4_and_calls_mxfp8_safe():
    record = _diagnosed()
    assert record["status"] == "ok", record
    diagnosis = record["diagnosis"]
    blocks = diagnosis["blocks"]
    assert set(blocks) == set(ms.RECIPES) and set(blocks["mxfp4"]) == {"0", "2", "4"}
    said = ms.block_verdicts(blocks, diagnosis["layer_types"])
    # layer 2 multiplies the 100x channel (its input), layer 0 gets its gradient 100x in one column (along N)
    assert ms.keep_in_higher_precision(ms.RECIPES["mxfp4"], blocks["mxfp4"]) == ["2", "0"], said["mxfp4"]
    assert said["mxfp4"].startswith("mxfp4: not safe: keep layers 2 (dense), 0 (dense) in higher precision: "
                                    "layer 2's input (mxfp4) loses "), said["mxfp4"]
    assert "layer 0's output gradient (mxfp4) loses " in said["mxfp4"]
    assert said["mxfp8"].startswith("mxfp8: safe: no layer stands out"), said["mxfp8"]
    assert said["fp8_block"].startswith("fp8_block: safe"), said["fp8_block"]
    # the outlier's block flushes the other 31 values of layer 2's input, in every row: about half of them
    counts = blocks["mxfp4"]["2"]["operands"]["input"]
    assert 0.4 < counts["underflow"] / counts["values"] < 0.55 and counts["format"] == "mxfp4"
    assert blocks["mxfp8"]["2"]["operands"]["input"]["underflow"] == 0
    # the record's typed model reads it, and the CLI's sentences come from the record
    typed = DiagnosisRecord.model_validate({**record, "run_id": "r", "framework": "numpy", "precision": "fp32",
                                            "model": SPEC.name})
    assert typed.diagnosis.blocks["mxfp4"]["0"].operands["output_gradient"].format == "mxfp4"


def test_counts_on_a_block_with_a_100x_value_and_the_floor_rule_s_clip():
    block = np.ones((1, 32), np.float32)
    block[0, 0] = 100.0
    # MXFP4: scale 2^(6 - 2) = 16; the ones are 1/16, below e2m1's half-subnormal 1/4: flushed; and 100 / 16 =
    # 6.25 is above e2m1's 6: the floor rule clips the block's largest to 96
    c = ms.operand_counts(block, ms.MXFP4, axis=1)
    assert (c["values"], c["underflow"], c["saturate"]) == (32, 31, 1) and c["lost"] == 31.0
    assert ms.operand_counts(block, ms.MXFP8_E4M3, axis=1)["underflow"] == 0
    # blocked along the other axis, each value is a block of its own: nothing underflows
    assert ms.operand_counts(block.T.copy(), ms.MXFP4, axis=1)["underflow"] == 0
    # the floor rule: amax 480 gives 2^(8 - 8) = 1, and 480 > 448 clips; 440 fits
    clipped = np.array([[480.0, 440.0] + [1.0] * 30], np.float32)
    assert ms.operand_counts(clipped, ms.MXFP8_E4M3, axis=1)["saturate"] == 1
    # a 16 x 16 tile (NVFP4's weights): the tile shares one scale; zeros are not counted
    tile = np.zeros((16, 16), np.float32)
    tile[0, 0], tile[5, 7] = 600.0, 1.0
    c = ms.operand_counts(tile, ms.NVFP4_WEIGHT, axis=0)
    assert (c["values"], c["underflow"]) == (2, 1)


def test_the_product_error_is_that_of_the_operands_training_multiplies():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 70)).astype(np.float32)  # partial blocks along K
    w = rng.standard_normal((70, 24)).astype(np.float32)
    for recipe in ms.RECIPES.values():
        qx, qw = ms.block_operands_with(NUMPY_OPS, x, w, recipe)
        exact = x.astype(np.float64) @ w.astype(np.float64)
        want = np.linalg.norm(qx.astype(np.float64) @ qw.astype(np.float64) - exact) / np.linalg.norm(exact)
        assert ms.product_error(x, w, recipe) == pytest.approx(want, rel=1e-12), recipe.name
    assert ms.product_error(np.zeros((2, 32), np.float32), w[:32], ms.RECIPES["mxfp4"]) is None


def test_the_gradient_is_blocked_along_n_and_a_safe_sentence_states_its_figures():
    stats = ms.BlockStatistics({"mxfp4": ms.RECIPES["mxfp4"]})
    rng = np.random.default_rng(4)
    dy = rng.standard_normal((64, 64)).astype(np.float32)
    stats.add_gradient("g", dy)
    stats.add_product("g", rng.standard_normal((64, 64)).astype(np.float32),
                      rng.standard_normal((64, 64)).astype(np.float32))
    said = ms.block_verdicts(stats.result())["mxfp4"]
    assert said.startswith("mxfp4: safe: no layer stands out") and "on Gaussian values" in said
    dy[:, 0] *= 100  # one column 100x: along N it shares every row's block with 31 ordinary values
    stats = ms.BlockStatistics({"mxfp4": ms.RECIPES["mxfp4"]})
    stats.add_gradient("g", dy)
    counts = stats.result()["mxfp4"]["g"]["operands"]["output_gradient"]
    assert counts["underflow"] >= 64 * 28, counts  # along M it would flush next to nothing
    assert ms.keep_in_higher_precision(ms.RECIPES["mxfp4"], stats.result()["mxfp4"]) == ["g"]
