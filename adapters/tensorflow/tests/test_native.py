"""Native specs in TensorFlow (`native: {keras: ...}`): the user's own Keras 3 model (a builder, or a saved .keras
file with its own weights), trained as it is in every precision, from the same initial weights; keras.applications
models with Keras' own parameter counts; and the mistakes that stop the command in one line."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

keras = pytest.importorskip("keras")

import native_models as M  # noqa: E402
from harness.run import native  # noqa: E402
from tests.native_runs import check_native, run_native  # noqa: E402

MODELS_FILE = Path(__file__).resolve().parent / "native_models.py"
IMAGES = {"name": "native_convnet", "native": {"keras": f"{MODELS_FILE}:convnet"}, "input": {"shape": [16, 16, 3]},
          "dataset": {"name": "synthetic", "num_classes": 4, "size": 64},
          "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
          "optimizer": {"type": "adamw", "learning_rate": 1e-3, "weight_decay": 0.01}, "batch_size": 8, "steps": 3,
          "seed": 5}
APPLICATION = {**IMAGES, "input": {"shape": [32, 32, 3]}, "dataset": {"name": "synthetic", "num_classes": 10,
                                                                       "size": 64},
               "loss": {"type": "sparse_categorical_crossentropy", "from_logits": False}}

_run, _check = partial(run_native, "tensorflow"), partial(check_native, "tensorflow")


def test_a_keras_model_trains_in_each_precision_from_the_same_weights():
    records = {p: _run(IMAGES, p) for p in ("fp32", "amp_bf16", "amp_fp16", "fp16", "bf16_sr")}
    reasons = {p: r["reason"] for p, r in records.items()}
    assert all(r["status"] in ("ok", "diverged") for r in records.values()), reasons
    assert len({r["options"]["native"]["initial_weights"] for r in records.values()}) == 1
    first = records["fp32"]["loss"][0]
    for precision, record in records.items():  # the same first batch through the same weights
        assert abs(record["loss"][0] - first) < 0.02, (precision, record["loss"][0], first)
    assert records["amp_bf16"]["options"]["policy"] == "mixed_bfloat16"
    assert records["amp_fp16"]["options"]["loss_scaler"] == "LossScaleOptimizer"
    fp8 = _run(IMAGES, "fp8_hybrid")  # refused before the model is built (Capabilities.no_fp8_for_native_models)
    assert fp8["status"] == "unsupported" and "native Keras model in FP8" in fp8["reason"], fp8["reason"]
    assert "`amp-harness import`" in fp8["reason"]


def test_a_saved_keras_model_trains_with_its_own_weights(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")  # saved in a policy of its own: re-made in each run's
    model = M.convnet()
    model.save(tmp_path / "mine.keras")
    spec = {**IMAGES, "native": {"keras": str(tmp_path / "mine.keras")}}
    records = {p: _run(spec, p) for p in ("fp32", "amp_bf16")}  # each re-made in its policy from the layers' configs
    assert all(r["status"] == "ok" for r in records.values()), {p: r["reason"] for p, r in records.items()}
    assert records["fp32"]["options"]["policy"] == "float32"
    saved = native.weights_digest(model.get_weights())
    assert {r["options"]["native"]["initial_weights"] for r in records.values()} == {saved}


@pytest.mark.parametrize("build", ["mobilenet_v2", "resnet50"])
def test_keras_applications_build_with_keras_s_own_parameter_counts(build, tmp_path):
    spec = {**APPLICATION, "name": build, "native": {"keras": f"{MODELS_FILE}:{build}"}}
    answer = _check(spec, tmp_path)
    assert "error" not in answer, answer
    model = getattr(M, build)()
    assert answer["params"] == sum(int(v.numpy().size) for v in model.trainable_weights)
    assert answer["output"] == [2, 10]


def test_mistakes_are_one_line_naming_the_spec(tmp_path):
    missing = _check({**IMAGES, "native": {"keras": str(tmp_path / "nowhere.keras")}}, tmp_path)["error"]
    assert missing == f"native_convnet: native keras {tmp_path / 'nowhere.keras'}: no such file"
    (tmp_path / "broken.keras").write_text("not a zip")
    refused = _check({**IMAGES, "native": {"keras": str(tmp_path / "broken.keras")}}, tmp_path)["error"]
    assert refused.startswith("native_convnet: native keras") and "Keras cannot load it" in refused
    wrong = _check({**IMAGES, "native": {"keras": f"{MODELS_FILE}:not_a_model"}}, tmp_path)["error"]
    assert "not_a_model() returned a str, not a Keras model" in wrong
    shape = _check({**IMAGES, "dataset": {"name": "synthetic", "num_classes": 3, "size": 64}}, tmp_path)["error"]
    assert "its output for 2 samples is [2, 4]" in shape
    assert all("\n" not in e for e in (missing, refused, wrong, shape))


def test_diagnose_and_the_profile_name_each_keras_layer():
    diagnosed = _run(IMAGES, "fp32", mode="diagnose", every=2)
    assert diagnosed["status"] == "ok", diagnosed["reason"]
    assert diagnosed["diagnosis"]["layer_types"] == {"conv2d": "Conv2D", "batch_normalization": "BatchNormalization",
                                                     "global_average_pooling2d": "GlobalAveragePooling2D",
                                                     "dense": "Dense"}
    assert {"conv2d", "batch_normalization", "dense"} <= set(diagnosed["diagnosis"]["groups"]["gradients"])
    profiled = _run({**IMAGES, "steps": 2}, "amp_bf16", warmup=2, mode="profile")
    assert profiled["status"] == "ok", profiled["reason"]
    layers = {layer["path"]: layer for layer in profiled["profile"]["layers"]}
    assert (layers["conv2d"]["compute"], layers["batch_normalization"]["compute"]) == ("bfloat16", "float32")
    assert layers["conv2d"]["forward_ms"] > 0 and layers["conv2d"]["backward_ms"] > 0
