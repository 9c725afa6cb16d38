"""Specs as graphs in torch (harness.model.spec, "named tensors"): merges, names taken across a residual block's list,
grouped, depthwise and dilated convolutions, each layer's output against the numpy reference in float64 in both
memory layouts; a merge's dtype is torch's own; a list without names runs as the nn.Sequential it always was."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from amp_harness_torch.adapter import TorchAdapter  # noqa: E402
from amp_harness_torch.network import Network  # noqa: E402
from harness.model import reference  # noqa: E402
from harness.model.data import Data  # noqa: E402
from harness.model.graph import infer  # noqa: E402
from harness.model.spec import validate  # noqa: E402
from harness.model.weights import initial_weights  # noqa: E402
from harness.precision import LossScale, parse_precision  # noqa: E402

BASE = {"dataset": {"name": "synthetic", "num_classes": 3, "size": 64},
        "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
        "optimizer": {"type": "sgd", "learning_rate": 0.05, "momentum": 0.9, "nesterov": False},
        "batch_size": 8, "steps": 2, "seed": 3}
SPECS = {
    # one-number zero padding, a depthwise stride-2 conv of multiplier 2, a merge of four in a residual block's list
    # (its input by name, a dilated branch, an [H, W, 1] image broadcast), a grouped stride-2 'valid' conv
    "images": {"input": {"shape": [8, 8, 4]}, "layers": [
        {"type": "zero_pad2d", "padding": 1},
        {"type": "conv2d", "filters": 8, "kernel_size": 3, "strides": 2, "padding": "same", "groups": 4},
        {"type": "relu6"},
        {"type": "residual", "layers": [
            {"type": "conv2d", "filters": 8, "kernel_size": 3, "padding": "same", "dilation": 2, "name": "a"},
            {"type": "hard_swish", "input": "input", "name": "b"},
            {"type": "conv2d", "filters": 1, "kernel_size": 1, "input": "input", "name": "one"},
            {"type": "add", "inputs": ["a", "b", "input", "one"]},
            {"type": "batchnorm"}]},
        {"type": "conv2d", "filters": 6, "kernel_size": 3, "strides": 2, "groups": 2},
        {"type": "global_maxpool2d"},
        {"type": "dense", "units": 3}]},
    # a [D] gate multiplied onto a [T, D] sequence, a branch by name, a concat of three vectors
    "sequence": {"input": {"shape": [6], "vocab": 16},
                 "dataset": {"name": "synthetic_tokens", "task": "classification", "num_classes": 3, "size": 64},
                 "layers": [
        {"type": "embedding", "dim": 8, "name": "seq"},
        {"type": "sequence_pool", "mode": "mean"},
        {"type": "dense", "units": 8},
        {"type": "sigmoid", "name": "gate"},
        {"type": "multiply", "inputs": ["seq", "gate"]},
        {"type": "silu"},
        {"type": "sequence_pool", "mode": "mean", "name": "v1"},
        {"type": "sequence_pool", "mode": "first", "input": "seq", "name": "v2"},
        {"type": "concat", "inputs": ["v1", "gate", "v2"]},
        {"type": "dense", "units": 3}]},
    # vectors: a product of two branches, then a concat with the network's input
    "vectors": {"input": {"shape": [10]}, "layers": [
        {"type": "dense", "units": 6, "name": "h1"},
        {"type": "relu", "name": "r"},
        {"type": "dense", "units": 6, "input": "input", "name": "h2"},
        {"type": "multiply", "inputs": ["r", "h2"], "name": "m"},
        {"type": "concat", "inputs": ["m", "input", "h1"]},
        {"type": "dense", "units": 3}]},
}


def _spec(name: str):
    return validate({**BASE, "name": name, **SPECS[name]}, name)


@pytest.mark.parametrize("variant", ["eager", "channels_last"])
@pytest.mark.parametrize("name", SPECS)
def test_every_layer_of_a_graph_computes_the_reference_in_float64(name, variant):
    spec = _spec(name)
    graph = infer(spec)
    weights = initial_weights(graph, spec.seed)
    adapter = TorchAdapter()
    trainer = adapter.build(spec, graph, weights, parse_precision("fp64"), LossScale(), adapter.device("cpu"), variant)
    x, y = Data(spec).fixed_batch()
    want = {}
    reference.forward(spec, weights, x, layer_outputs=want)
    got = trainer.layer_outputs(x, y)
    assert set(got) == set(want)
    for path, expected in want.items():
        error = np.abs(got[path][0] - expected).max() / np.abs(expected).max()
        assert error < 1e-12, (path, error)
    loaded = trainer.get_weights()  # grouped kernels [k, k, C/groups, F] back in the canonical layout
    assert all(np.array_equal(loaded[key], value) for key, value in weights.items())


def _network(spec) -> Network:
    graph = infer(spec)
    return Network(spec.layers, graph, initial_weights(graph, spec.seed))


def test_a_merge_gives_torch_s_own_dtype_under_autocast():
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        outputs, _ = _network(_spec("vectors")).layer_outputs(torch.randn(4, 10))
    # bfloat16 times bfloat16, then a concat of it with the float32 input: float32, as torch.cat promotes
    assert (outputs["3"].dtype, outputs["4"].dtype) == (torch.bfloat16, torch.float32)


def test_only_a_list_with_names_leaves_nn_sequential_s_loop():
    chain = validate({**BASE, "name": "chain", "input": {"shape": [10]},
                      "layers": [{"type": "dense", "units": 4}, {"type": "residual", "layers": [{"type": "relu"}]},
                                 {"type": "dense", "units": 3}]}, "chain")
    net = _network(chain)
    assert not net.layers.wired and not net.layers[1].main.wired
    assert _network(_spec("vectors")).layers.wired
