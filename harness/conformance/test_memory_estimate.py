"""The memory estimate (`amp-harness check`, the guard in `run`) against what the framework really holds: each
built-in model at a batch size where its own memory dwarfs the noise, measured as the process's peak above
its level before the build, minus the same figure for a one-layer network (the framework's fixed cost: its
allocator, thread pools, kernel caches), must be within a factor of two of the estimate."""
from __future__ import annotations

import pytest
import yaml

from harness.conformance.test_contract import cli
from harness.model import memory
from harness.model.graph import infer
from harness.model.spec import load_spec, validate
from harness.precision import parse_precision

# estimate 70-560 MiB: above the tens of MiB by which a process's peak moves from run to run (thread pools, the
# allocator: underflow_mlp at 4096, 18.6 MiB, measured 2.12x once on a Sapphire Rapids Xeon and 0.4-0.6x there since)
CASES = {"small_convnet": 8, "resnet8": 512, "mnist_mlp": 1024, "underflow_mlp": 16384}
TINY = {"name": "tiny", "input": {"shape": [4]}, "dataset": {"name": "synthetic", "num_classes": 2, "size": 64},
        "layers": [{"type": "dense", "units": 2}],
        "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
        "optimizer": {"type": "sgd", "learning_rate": 0.1, "momentum": 0.0, "nesterov": False},
        "batch_size": 8, "steps": 2}
# XLA compiles the training step inside the measured region and keeps its buffers: measured here 1.8-3.5x the
# estimate, which is what the estimate says it leaves out (the framework's own workspace)
OVER_ESTIMATE_EXPECTED = {"jax": "XLA's compilation and buffer assignment are part of the measured peak"}


def _peak(tmp_path, framework, model, batch) -> float:
    out = tmp_path / f"{framework}-{batch}-{model.replace('/', '_')}"
    out.mkdir()
    (record,) = cli(out, "run", "--framework", framework, "--model", model, "--batch-size", str(batch),
                    "--precision", "fp32", "--steps", "2", "--warmup", "1", "--repeats", "1", "--device", "cpu")
    assert record["status"] == "ok", record["reason"]
    assert record["memory_kind"].startswith("process peak RSS")
    return record["peak_memory_mb"]


@pytest.fixture(scope="module")
def fixed_cost(tmp_path_factory, framework) -> float:
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    return _peak(folder, framework, str(folder / "tiny.yaml"), 8)


def _at_batch(model: str, batch: int, folder) -> tuple:
    """The built-in model at `batch`, its synthetic dataset grown to four batches where it holds fewer (the
    training split must hold one), and the spec file the CLI takes."""
    data = load_spec(model).with_overrides(batch).model_dump(mode="json")
    if data["dataset"]["name"] == "synthetic":
        data["dataset"]["size"] = max(data["dataset"]["size"], 4 * batch)
    path = folder / f"{model}.yaml"
    path.write_text(yaml.safe_dump(data))
    return validate(data, model), str(path)


@pytest.mark.parametrize("model", CASES)
def test_the_memory_estimate_is_within_2x_of_the_measured_peak(model, framework, fixed_cost, tmp_path):
    spec, path = _at_batch(model, CASES[model], tmp_path)
    estimate = memory.estimate(infer(spec), spec, parse_precision("fp32")).step_mb
    measured = _peak(tmp_path, framework, path, CASES[model]) - fixed_cost
    ratio = measured / estimate
    print(f"{framework} {model} batch {CASES[model]}: measured {measured:.1f} MiB above the fixed cost "
          f"{fixed_cost:.1f} MiB, estimate {estimate:.1f} MiB: {ratio:.2f}x")
    if framework in OVER_ESTIMATE_EXPECTED and ratio > 2:
        pytest.xfail(f"{ratio:.2f}x: {OVER_ESTIMATE_EXPECTED[framework]}")
    assert 0.5 <= ratio <= 2, (f"{model}: the step holds {measured:.1f} MiB, the estimate says {estimate:.1f} MiB "
                               f"({ratio:.2f}x): the estimate (harness/model/memory.py) and what the adapter holds disagree")
