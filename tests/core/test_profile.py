"""Profiles: the core's mapping of profiler scopes to the spec's layers and parts (harness.run.profile), and
`amp-harness profile` end to end with the fake adapter, whose ops are named as frameworks name theirs."""
from __future__ import annotations

import json

import pytest

from harness.adapter import (
    LOSS_SCALE_SCOPE,
    LOSS_SCOPE,
    UPDATE_SCOPE,
    OpTime,
    layer_scope,
)
from harness.errors import HarnessError
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.run.profile import attribute, owner
from tests.core.test_runner import amp


@pytest.mark.parametrize("scope, found", [
    ("layer.3", ("layer", "3")),
    ("model/layer.5/layer.5.layers.0/Conv2D", ("layer", "5.layers.0")),  # the innermost layer
    ("layer.5.projection.1_2/FusedBatchNorm", ("layer", "5.projection.1")),  # TensorFlow's unique-name suffix
    ("gradient_tape/layer.12/MatMul", ("layer", "12")),
    (f"train/{LOSS_SCOPE}", ("part", "loss")),
    (f"{UPDATE_SCOPE}_1/ResourceApplyAdam", ("part", "update")),
    (f"{LOSS_SCALE_SCOPE}/layer.2", ("layer", "2")),  # innermost wins, whichever kind
    (f"layer.2/{LOSS_SCALE_SCOPE}", ("part", "loss_scale")),
    ("", None), ("model/dense_1/MatMul", None), ("layer.x", None), ("layer.3.weights.0", None),
    ("part.lossy", None), ("mylayer.3", None),
])
def test_owner_finds_the_innermost_layer_or_part(scope, found):
    assert owner(scope) == found


def test_layer_scope_is_what_owner_reads():
    for info in infer(load_spec("resnet8")).layers:
        assert owner(f"net/{layer_scope(info.path)}/op") == ("layer", info.path)


def test_attribute_sums_per_step_and_keeps_casts_apart():
    layers = infer(load_spec("small_convnet")).layers
    ops = [OpTime("conv", "layer.0", 0.040, inputs=("float16", "float16", "float32"), outputs=("float16",)),
           OpTime("pad", "layer.0", 0.042, inputs=("float32",)),  # heavier, but takes the data alone
           OpTime("layer.0", "layer.0", 0.050),  # the range's own time (Python): heavier, but names no dtype
           OpTime("conv_grad", "layer.0", 0.060, backward=True),
           OpTime("to", "layer.0", 0.010, cast=True, inputs=("float32",), outputs=("float16",)),
           OpTime("matmul", "layer.14", 0.004, inputs=("bfloat16", "bfloat16")),
           OpTime("bce", LOSS_SCOPE, 0.002), OpTime("rmsprop", UPDATE_SCOPE, 0.008),
           OpTime("mystery", "", 0.006)]
    p = attribute(layers, ops, [90.0, 70.0])  # two steps: 160 ms, op seconds are sums over both
    conv = p["layers"][0]
    assert (conv["forward_ms"], conv["backward_ms"], conv["cast_ms"]) == pytest.approx((66.0, 30.0, 5.0))
    assert (conv["op"], conv["compute"], conv["outputs"]) == ("conv", "float16", ["float16"])
    assert p["layers"][14]["compute"] == "bfloat16"
    assert "compute" not in p["layers"][1]  # no op ran in the relu's scope
    parts = p["parts"]
    assert (parts["casts"], parts["loss"], parts["update"], parts["unattributed"]) == pytest.approx((5, 1, 4, 3))
    assert p["step_mean_ms"] == 80.0
    named = 66 + 30 + 2 + 5 + 1 + 4  # layers (conv, dense) and parts: the unattributed op is "other"
    assert parts["other"] == pytest.approx(80 - named)
    assert p["coverage"] == pytest.approx(named / 80)
    assert p["top_ops"][0] == {"op": "conv_grad", "owner": "0", "backward": True, "ms": pytest.approx(30.0)}
    assert [op["op"] for op in p["top_ops"][1:3]] == ["layer.0", "pad"]


def test_a_scope_naming_a_layer_the_spec_lacks_is_an_error():
    with pytest.raises(HarnessError, match="layer scope '99'.*Conv2D"):
        attribute(infer(load_spec("mnist_mlp")).layers, [OpTime("Conv2D", "layer.99", 0.1)], [1.0])


def cli(out_dir, *args, faults=""):
    return amp(*args, "--out", str(out_dir), "--no-progress", faults=faults)


def test_profile_cli_maps_the_fake_adapters_ops(tmp_path):
    out = cli(tmp_path, "profile", "--framework", "fake", "--model", "resnet8,mnist_mlp", "--precision",
              "fp32,amp_bf16", "--steps", "3")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (tmp_path / "profiles.jsonl").read_text().splitlines()]
    assert [(r["model"], r["precision"]) for r in records] == [
        ("resnet8", "fp32"), ("resnet8", "amp_bf16"), ("mnist_mlp", "fp32"), ("mnist_mlp", "amp_bf16")]
    assert not (tmp_path / "results.jsonl").exists()  # profiles never mix with timed runs
    for r in records:
        p = r["profile"]
        assert r["status"] == "ok" and p["steps"] == 3 and p["warmup"] == 3
        graph = infer(load_spec(r["model"]))
        assert [layer["path"] for layer in p["layers"]] == [info.path for info in graph.layers]
        # the fake gives every layer 2 forward shares, 1 backward, 1 cast: nested and suffixed scopes included
        forward = [layer["forward_ms"] for layer in p["layers"]]
        assert min(forward) > 0 and max(forward) == pytest.approx(min(forward))
        assert all(layer["backward_ms"] == pytest.approx(f / 2) for layer, f in zip(p["layers"], forward))
        assert p["parts"]["casts"] == pytest.approx(len(graph.layers) * forward[0] / 2)
        assert p["coverage"] == pytest.approx(0.9, abs=0.08)  # the fake gives 90% of the measured time to ops
    assert "3.layers.4 batchnorm" in out.stdout and "ms per profiled step" in out.stdout


def test_profile_reports_an_adapter_that_cannot_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_FAKE_NO_PROFILE", "1")  # amp() passes the environment on
    out = cli(tmp_path, "profile", "--framework", "fake", "--model", "mnist_mlp", "--precision", "fp32")
    assert out.returncode == 0, out.stderr
    (r,) = [json.loads(line) for line in (tmp_path / "profiles.jsonl").read_text().splitlines()]
    assert r["status"] == "unsupported" and "cannot profile" in r["reason"]
    assert "cannot profile" in out.stdout


def test_profile_takes_the_matrix_models_and_sizes_but_its_own_steps(tmp_path):
    matrix = tmp_path / "m.yaml"
    matrix.write_text("precisions: [fp32]\nrepeats: 3\nwarmup: 2\nsteps: 10\nmodels:\n"
                      "  - {model: mnist_mlp, batch_size: 8, steps: 30}\n"
                      "  - {model: underflow_mlp, steps: 1000, loss_scales: [none, dynamic]}\n")
    out = cli(tmp_path, "profile", "--framework", "fake", "--matrix", str(matrix), "--precision", "amp_fp16",
              "--steps", "2")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (tmp_path / "profiles.jsonl").read_text().splitlines()]
    assert [(r["model"], r["batch_size"], r["profile"]["steps"]) for r in records] == [
        ("mnist_mlp", 8, 2), ("underflow_mlp", load_spec("underflow_mlp").batch_size, 2)]  # one run each


def test_a_non_finite_loss_in_a_profiled_step_is_recorded_not_a_crash(tmp_path):
    out = cli(tmp_path, "profile", "--framework", "fake", "--model", "mnist_mlp", "--precision", "fp16", "--steps", "3",
              faults="fp16=nan")  # the fake's 4th step, the first profiled one, returns NaN
    assert out.returncode == 0, out.stderr
    (r,) = [json.loads(line) for line in (tmp_path / "profiles.jsonl").read_text().splitlines()]
    assert r["status"] == "ok" and r["loss"][0] is None and r["profile"]["steps"] == 3


def test_a_matrix_models_commands_say_which_commands_take_it(tmp_path):
    matrix = tmp_path / "m.yaml"
    matrix.write_text("precisions: [fp32]\nrepeats: 3\nsteps: 3\nmodels:\n"
                      "  - {model: mnist_mlp, batch_size: 8, commands: [run, profile]}\n"
                      "  - {model: underflow_mlp, batch_size: 8, commands: [diagnose]}\n")
    for command, out_file in (("profile", "profiles.jsonl"), ("diagnose", "diagnoses.jsonl")):
        out = cli(tmp_path, command, "--framework", "fake", "--matrix", str(matrix),
                  *(["--steps", "2"] if command == "profile" else []))
        assert out.returncode == 0, out.stderr
        records = [json.loads(line) for line in (tmp_path / out_file).read_text().splitlines()]
        assert {r["model"] for r in records} == ({"mnist_mlp"} if command == "profile" else {"underflow_mlp"})
    matrix.write_text("precisions: [fp32]\nmodels:\n  - {model: mnist_mlp, commands: [diagnose]}\n")
    out = cli(tmp_path, "profile", "--framework", "fake", "--matrix", str(matrix))
    assert out.returncode == 2 and "no model is for profile" in out.stderr and len(out.stderr.splitlines()) == 1
    matrix.write_text("precisions: [fp32]\nmodels:\n  - {model: mnist_mlp, commands: [train]}\n")
    out = cli(tmp_path, "profile", "--framework", "fake", "--matrix", str(matrix))
    assert out.returncode == 2 and "models.0.commands.0" in out.stderr and len(out.stderr.splitlines()) == 1


def test_an_adapter_that_declares_no_gpu_profile_is_refused_there_with_its_reason():
    """Declared capabilities: the core words the refusal from the adapter's data, on a GPU only."""
    from harness.adapter import Capabilities, Device
    from harness.run.profile import refusal

    class CpuProfiler:
        name = "cpuprof"
        capabilities = Capabilities(no_gpu_profile="its profiler reads host times only")

    gpu, cpu = Device("cuda:0", "gpu", "a GPU"), Device("cpu", "cpu", "a CPU")
    assert refusal(CpuProfiler(), gpu) == "the cpuprof adapter does not profile on a GPU: its profiler reads host times only"
    assert refusal(CpuProfiler(), cpu) is None
    CpuProfiler.capabilities = Capabilities()
    assert refusal(CpuProfiler(), gpu) is None
