"""Locating a diverged run's first non-finite value (harness.run.nonfinite) on captured tensors: forward before
backward, a residual block after its inner layers, the backward pass from the output end, the input's range;
and the line the report shows beside the diverged status."""
from __future__ import annotations

import numpy as np

from harness.model.graph import infer
from harness.model.spec import validate
from harness.report.explain import explain
from harness.run.nonfinite import describe, first_nonfinite

SPEC = validate({"name": "n", "input": {"shape": [4]}, "dataset": {"name": "synthetic", "num_classes": 2},
                 "layers": [{"type": "dense", "units": 4},
                            {"type": "residual", "layers": [{"type": "dense", "units": 4}, {"type": "relu"}]},
                            {"type": "dense", "units": 2}],
                 "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
                 "optimizer": {"type": "sgd", "learning_rate": 0.1, "momentum": 0.0, "nesterov": False},
                 "batch_size": 2, "steps": 1}, "n")
GRAPH = infer(SPEC)
X = np.array([[1.0, -2.0, 3.0, 0.5], [0.0, 1.0, 2.0, -4.0]])


def captured(bad_output=(), bad_gradient=()):
    paths = [info.path for info in GRAPH.layers]  # 0, 1, 1.layers.0, 1.layers.1, 2
    out = {p: (np.full((2, 4), float(i + 1)), np.ones((2, 4))) for i, p in enumerate(paths)}
    for p in bad_output:
        out[p][0][0, 1] = np.inf
    for p in bad_gradient:
        out[p][1][1, 0] = np.nan
    return out


def test_the_forward_pass_comes_first_and_a_block_after_its_inner_layers():
    found = first_nonfinite(GRAPH, X, captured(bad_output=("1", "1.layers.1", "2"), bad_gradient=("0",)))
    assert found == {"layer": "1.layers.1", "layer_type": "relu", "pass": "forward", "tensor": "output",
                     "values": "inf", "input_range": [3.0, 3.0]}  # its input: 1.layers.0's output, all 3s
    assert first_nonfinite(GRAPH, X, captured(bad_output=("0",)))["input_range"] == [-4.0, 3.0]  # the network's input


def test_the_backward_pass_is_searched_from_the_output_end():
    found = first_nonfinite(GRAPH, X, captured(bad_gradient=("0", "1.layers.0")))
    assert (found["layer"], found["pass"], found["tensor"], found["values"]) == \
        ("1.layers.0", "backward", "output gradient", "nan")
    assert first_nonfinite(GRAPH, X, captured()) is None


def test_the_report_shows_it_beside_the_diverged_status():
    located = {"found": True, "step": 3, "layer": "25", "layer_type": "attention", "pass": "forward",
               "tensor": "output", "values": "nan", "input_range": [-512.0, 498.25]}
    line = describe(located)
    assert line == ("first non-finite value at step 3: layer 25 (attention) output, forward pass, nan; its input in "
                    "[-512, 498.2]")
    record = {"status": "diverged", "reason": "loss became nan at step 3", "precision": "fp16", "framework": "torch",
              "model": "m", "nonfinite": located}
    (why,) = [w for w in explain([record], {}, []) if "diverged" in w.title]
    assert line in why.text
