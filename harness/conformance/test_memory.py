"""The memory figure means the same in every framework: the process's peak above its level before the model
was built, so that weights, gradients and optimizer state are inside it. Adam keeps two slots per weight,
plain SGD none: the same network's figure with Adam must exceed the one with SGD by at least Adam's state."""
from __future__ import annotations

import pytest
import yaml

from harness.conformance.test_contract import cli

NETWORK = {"input": {"shape": [1024]}, "dataset": {"name": "synthetic", "num_classes": 2, "size": 256},
           "layers": [{"type": "dense", "units": 2048}, {"type": "relu"}, {"type": "dense", "units": 2}],
           "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True}, "batch_size": 32, "steps": 3}
OPTIMIZERS = {"adam": {"type": "adam", "learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
              "sgd": {"type": "sgd", "learning_rate": 0.01, "momentum": 0.0, "nesterov": False}}

@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory")
    paths = {}
    for name, optimizer in OPTIMIZERS.items():
        paths[name] = folder / f"memory_{name}.yaml"
        paths[name].write_text(yaml.safe_dump({"name": f"memory_{name}", **NETWORK, "optimizer": optimizer}))
    return paths


def test_optimizer_state_is_inside_the_memory_figure(specs, tmp_path, framework):
    figures = {}
    for name, path in specs.items():
        (tmp_path / name).mkdir()
        (record,) = cli(tmp_path / name, "run", "--framework", framework, "--model", str(path), "--precision", "fp32",
                        "--warmup", "1", "--repeats", "1", "--device", "cpu")
        assert record["status"] == "ok", record["reason"]
        assert record["memory_kind"].startswith("process peak RSS") and "optimizer state" in record["memory_kind"]
        figures[name] = record
    adam_state = figures["adam"]["state_memory_mb"]["optimizer_state"]
    assert figures["sgd"]["state_memory_mb"]["optimizer_state"] == 0
    measured = figures["adam"]["peak_memory_mb"] - figures["sgd"]["peak_memory_mb"]
    print(f"{framework}: peak {figures['adam']['peak_memory_mb']:.1f} MB with Adam, "
          f"{figures['sgd']['peak_memory_mb']:.1f} MB with SGD; Adam's state {adam_state:.1f} MB")
    assert measured >= 0.9 * adam_state  # the state, and whatever temporaries the update needs
    state = figures["sgd"]["state_memory_mb"]
    assert figures["sgd"]["peak_memory_mb"] >= state["weights"] + state["gradients"]
