"""The memory figure means the same in every framework: the process's peak above its level before the model
was built, so that weights, gradients and optimizer state are inside it. All three are alive together in every
step (Adam keeps two slots per weight, SGD none), so each figure must be at least their sum: a figure whose
baseline were taken after the build would miss the weights and the state (TensorFlow's Adam run then gave
25.2 MB, below its 32 MB).

The runs fix glibc's mmap threshold. By default it rises to the size of the largest block freed, after which
blocks of a gradient's size come from the heap and stay resident once freed: TensorFlow's SGD peak varied from
46 to 62 MB between identical runs, an upward noise that could hide a missing 24 MB. A fixed threshold maps
every large block on its own and unmaps it when freed, so the RSS follows live memory (the same SGD run:
35.3-35.9 MB over six runs). Other C libraries ignore the variable.

A difference of figures (Adam's minus SGD's at least Adam's state) is no such bound: MXNet's SGD run peaks on a
step's temporaries that Adam's run holds at another time, and the difference came out 10.6 MB for 16 MB of
state, every time."""
from __future__ import annotations

import pytest
import yaml

from harness.conformance.test_contract import cli

NETWORK = {"input": {"shape": [1024]}, "dataset": {"name": "synthetic", "num_classes": 2, "size": 256},
           "layers": [{"type": "dense", "units": 2048}, {"type": "relu"}, {"type": "dense", "units": 2}],
           "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True}, "batch_size": 32, "steps": 3}
OPTIMIZERS = {"adam": {"type": "adam", "learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
              "sgd": {"type": "sgd", "learning_rate": 0.01, "momentum": 0.0, "nesterov": False}}

EXACT_RSS = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


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
                        "--warmup", "1", "--repeats", "1", "--device", "cpu", env=EXACT_RSS)
        assert record["status"] == "ok", record["reason"]
        assert record["memory_kind"].startswith("process peak RSS") and "optimizer state" in record["memory_kind"]
        figures[name] = record
    for name, record in figures.items():
        state = record["state_memory_mb"]
        print(f"{framework} {name}: peak {record['peak_memory_mb']:.1f} MB; weights {state['weights']:.1f}, "
              f"gradients {state['gradients']:.1f}, optimizer state {state['optimizer_state']:.1f} MB")
        assert record["peak_memory_mb"] >= state["weights"] + state["gradients"] + state["optimizer_state"]
    assert figures["sgd"]["state_memory_mb"]["optimizer_state"] == 0
    assert figures["adam"]["state_memory_mb"]["optimizer_state"] >= 2 * figures["adam"]["state_memory_mb"]["weights"]
