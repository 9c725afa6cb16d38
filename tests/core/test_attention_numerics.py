"""The core's attention numerics: q, k, the scores and their gradients computed from a layer's captured input and
output gradient (harness.model.reference.attention_numerics), and the verdict sentences drawn from them."""
from __future__ import annotations

import numpy as np
import pytest

from harness import numerics
from harness.model import reference
from harness.model.graph import infer
from harness.model.spec import validate
from harness.model.weights import initial_weights

SPEC = {"name": "a", "input": {"shape": [5], "vocab": 7}, "dataset": {"name": "synthetic_tokens", "num_classes": 2},
        "layers": [{"type": "embedding", "dim": 8}, {"type": "attention", "heads": 2, "causal": True},
                   {"type": "sequence_pool", "mode": "mean"}, {"type": "dense", "units": 2}],
        "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
        "optimizer": {"type": "adam", "learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
        "batch_size": 3, "steps": 1}


def test_score_gradients_are_the_derivative_of_the_loss_through_the_softmax():
    spec = validate(SPEC, "a")
    graph = infer(spec)
    info = graph.layers[1]
    w = {k: v.astype(np.float64) for k, v in initial_weights(graph, 0).items()}
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((3, 5, 8)), rng.standard_normal((3, 5, 8))
    found = reference.attention_numerics(info.spec, info.path, w, x, g)
    parts = reference._attention_parts(info.spec, info.path, w, x)
    assert found["scores"].shape == (3, 2, 15)  # the 15 kept (i >= j) of 25 per head
    assert np.array_equal(found["q"], parts["q"]) and np.isfinite(found["scores"]).all()

    def loss(scores):  # the loss <out, g> as a function of the scores, through softmax, p @ v and the projection
        e = np.exp(scores - scores.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
        heads = (p @ parts["v"]).transpose(0, 2, 1, 3).reshape(3, 5, 8)
        return ((heads @ w["1.output_kernel"] + w["1.output_bias"]) * g).sum()

    kept = np.argwhere(~reference.causal_mask(5))
    for n, h, (i, j) in [(0, 0, kept[3]), (2, 1, kept[-1]), (1, 1, kept[7])]:
        bumped = [parts["scores"].copy() for _ in range(2)]
        bumped[0][n, h, i, j] += 1e-6
        bumped[1][n, h, i, j] -= 1e-6
        numeric = (loss(bumped[0]) - loss(bumped[1])) / 2e-6
        index = int(np.flatnonzero((kept == (i, j)).all(1))[0])
        assert found["score_gradients"][n, h, index] == pytest.approx(numeric, rel=1e-6, abs=1e-10)


def _histograms(scores, q, k, grads):
    return {"groups": {f"attention_{kind}": {"3.layers.1": numerics.histogram(np.array([value, -value / 3]))}
                       for kind, value in (("scores", scores), ("q", q), ("k", k), ("score_gradients", grads))}}


def test_the_verdicts_name_the_layer_the_overflow_the_spacing_and_the_loss_scale():
    """Scores near 2^16.5 overflow float16 and are 512 apart in bfloat16 (2^(16 - 7)): too coarse for the softmax;
    scores near 6 are 2^-8 apart in float16 (2^(2 - 10)) and 2^-5 in bfloat16."""
    big = numerics.attention_verdicts(_histograms(2.0**16.5, 2.0**9, 2.0**8, 2.0**-3))["3.layers.1"]
    assert big == ("attention 3.layers.1: scores reach 2^16.5 (q 2^9.0, k 2^8.0); float16 overflows in the forward "
                   "pass (65504 is its largest value); their gradients reach 2^-3.0 and overflow float16 at a loss "
                   "scale of 2^19 or more; bfloat16 holds them but 512 apart at their largest, so rounding alone "
                   "moves a score by up to 256: unsafe")
    small = numerics.attention_verdicts(_histograms(6.0, 2.0, 2.0, 2.0**-10))["3.layers.1"]
    assert "float16 holds them (2^-8 apart at their largest)" in small and "loss scale of 2^26 or more" in small
    assert small.endswith("bfloat16 is safe (2^-5 apart at their largest)")
    coarse = numerics.attention_verdicts(_histograms(1500.0, 2.0**5, 2.0**5, 2.0**-10))["3.layers.1"]
    assert "float16 holds them but 1 apart at their largest, so rounding alone moves a score by up to 0.5: " \
           "unsafe" in coarse and coarse.endswith("bfloat16 holds them but 8 apart at their largest, so rounding "
                                                  "alone moves a score by up to 4: unsafe")


def _spec(layers: list, shape: list, **more) -> dict:
    return {"name": "m", "input": {"shape": shape, **more.pop("input", {})},
            "dataset": {"name": more.pop("dataset", "synthetic"), "num_classes": 2}, "layers": layers,
            "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
            "optimizer": {"type": "sgd", "learning_rate": 0.1, "momentum": 0.0, "nesterov": False},
            "batch_size": 2, "steps": 1, **more}


@pytest.mark.parametrize("spec", [
    _spec([{"type": "conv2d", "filters": 3, "kernel_size": 3, "strides": 2, "padding": "same"},
           {"type": "conv2d", "filters": 2, "kernel_size": 2, "padding": "valid"}, {"type": "flatten"},
           {"type": "dense", "units": 2}], [7, 6, 2]),
    _spec([{"type": "patches", "size": 2, "dim": 4}, {"type": "dense", "units": 6},
           {"type": "attention", "heads": 2, "causal": True}, {"type": "sequence_pool", "mode": "mean"},
           {"type": "dense", "units": 2}], [4, 6, 3])])
def test_each_matmul_layer_s_products_are_its_outputs_without_the_bias(spec):
    """reference.matmuls, which diagnose rounds to measure each matmul's error in 16 bits, states the layers' math:
    its products plus the bias are the reference forward's outputs (an attention's query projection is its q)."""
    spec = validate(spec, "m")
    graph = infer(spec)
    w = {k: v.astype(np.float64) for k, v in initial_weights(graph, 0).items()}
    x = np.random.default_rng(0).standard_normal((2, *spec.input.shape))
    outputs: dict = {}
    reference.forward(spec, w, x, layer_outputs=outputs)
    checked = []
    for info in graph.layers:
        if info.type not in ("dense", "conv2d", "patches", "attention"):
            continue
        source = graph.input_of(info.path)
        products = reference.matmuls(info.spec, info.path, w, x if source is None else outputs[source])
        if info.type == "attention":
            parts = reference._attention_parts(info.spec, info.path, w, outputs[source])
            q = parts["q"].transpose(0, 2, 1, 3).reshape(-1, parts["q"].shape[1] * parts["q"].shape[3])
            lhs, rhs = products["query"]
            np.testing.assert_allclose(lhs @ rhs + w[f"{info.path}.query_bias"], q, rtol=1e-12, atol=1e-12)
            lhs, rhs = products["output"]
            expected = outputs[info.path].reshape(len(lhs), -1)
            np.testing.assert_allclose(lhs @ rhs + w[f"{info.path}.output_bias"], expected, rtol=1e-12, atol=1e-12)
        else:
            (lhs, rhs), = products.values()
            expected = outputs[info.path].reshape(len(lhs), -1)
            np.testing.assert_allclose(lhs @ rhs + w.get(f"{info.path}.bias", 0.0), expected, rtol=1e-12, atol=1e-12)
        checked.append(info.type)
    assert checked in (["conv2d", "conv2d", "dense"], ["patches", "dense", "attention", "dense"])
