"""`amp-harness import keras`: real Keras configurations (tests/core/data/keras, written by build_models.py with
Keras 3.15) into specs that `check` accepts and whose parameters are Keras's count; everything the spec cannot
express is one line per problem and exit 2. No framework is imported here."""
from __future__ import annotations

import copy
import gzip
import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from harness.cli import main
from harness.model.graph import infer
from harness.model.importers.keras import import_keras
from harness.model.spec import MODELS_DIR, validate
from tests.conftest import ROOT

DATA = Path(__file__).parent / "data" / "keras"
PARAMS = json.loads((DATA / "params.json").read_text())
MODELS = ["small_convnet", "resnet_mini", "mnist_mlp_dropout", "tiny_transformer", "inception_mini", "mobilenetv2_mini"]
# keras.applications at 32x32x3 and 10 classes, random weights (build_models.py)
APPLICATIONS = ["MobileNetV2", "ResNet50", "DenseNet121", "EfficientNetB0"]


def config(name: str) -> dict:
    path = DATA / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    with gzip.open(DATA / f"{name}.json.gz", "rt") as f:
        return json.load(f)


def layer(model: dict, name: str) -> dict:
    return next(entry for entry in model["config"]["layers"] if entry["config"].get("name") == name)


def run_import(tmp_path, capsys, model: dict | Path, *options: str) -> tuple[int, str, list[str]]:
    path = model if isinstance(model, Path) else tmp_path / "model.json"
    if not isinstance(model, Path):
        path.write_text(json.dumps(model))
    code = main(["import", "keras", str(path), *options])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def errors(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("amp-harness: error:")]


@pytest.mark.parametrize("name", MODELS)
def test_imports_a_spec_check_accepts_with_keras_parameter_count(tmp_path, capsys, name):
    code, out, err = run_import(tmp_path, capsys, DATA / f"{name}.json")
    assert code == 0 and not errors(err), err
    spec = validate(yaml.safe_load(out), name)
    assert spec.name == name
    graph = infer(spec)
    counts = PARAMS[name]
    assert graph.param_count == counts["trainable"]  # batchnorm's moving statistics are state, not parameters
    assert sum(math.prod(shape) for shape in graph.param_shapes().values()) == counts["count_params"]
    (tmp_path / "spec.yaml").write_text(out)
    assert main(["check", str(tmp_path / "spec.yaml")]) == 0
    assert f"{tmp_path / 'spec.yaml'}: ok  {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", APPLICATIONS)
def test_keras_applications_import_with_keras_parameter_count(tmp_path, capsys, name):
    code, out, err = run_import(tmp_path, capsys, config(name))
    assert code == 0 and not errors(err), err
    graph = infer(validate(yaml.safe_load(out), name))
    assert graph.param_count == PARAMS[name]["trainable"]
    weights = sum(math.prod(shape) for shape in graph.param_shapes().values())
    # EfficientNet's Normalization holds its mean, variance and count (7 numbers) as weights, which the importer
    # does not read (a note says so): the identity before adapt()
    assert weights == PARAMS[name]["count_params"] - (7 if name.startswith("EfficientNet") else 0)


def test_the_imported_spec_the_frameworks_are_held_to_is_what_the_importer_writes():
    """tests/specs/imported_mobilenetv2_mini.yaml (in tox's identity matrix) is the importer's output, as it is."""
    kept = yaml.safe_load((ROOT / "tests" / "specs" / "imported_mobilenetv2_mini.yaml").read_text())
    imported = import_keras(DATA / "mobilenetv2_mini.json").spec
    assert {key: value for key, value in kept.items() if key != "description"} == \
        {key: value for key, value in imported.items() if key != "description"}


def test_branches_and_merges_become_named_tensors():
    """EfficientNet's squeeze-and-excite: a kept-dims pool (its Reshape to [1, 1, C]), two 1x1 convolutions and
    a Multiply of the block's tensor by the gate; DenseNet's concatenations of every earlier output in a block."""
    effnet = import_keras_config("EfficientNetB0").spec["layers"]
    gates = [i for i, layer in enumerate(effnet) if layer["type"] == "multiply"]
    assert gates, [layer["type"] for layer in effnet]
    first = gates[0]
    named = {layer.get("name"): i for i, layer in enumerate(effnet) if layer.get("name")}
    block, gate = effnet[first]["inputs"]
    assert effnet[named[gate]]["type"] == "sigmoid"
    assert [layer["type"] for layer in effnet[named[block] + 1:named[gate] + 1]] == [
        "global_avgpool2d", "conv2d", "silu", "conv2d", "sigmoid"]
    assert effnet[named[block] + 1].get("keepdims") is True and effnet[named[block] + 2].get("input") is None
    assert effnet[0] == {"type": "rescaling", "scale": 1 / 255}
    densenet = import_keras_config("DenseNet121").spec["layers"]
    concats = [layer for layer in densenet if layer["type"] == "concat"]
    assert len(concats) == 6 + 12 + 24 + 16 and all(len(c["inputs"]) == 2 for c in concats)


def test_branches_from_one_tensor_take_it_by_name():
    """Three branches from the stem (a 1x1, a depthwise of multiplier 2, a dilated conv with swish) concatenated in
    the model's order; a vector gate whose Reshape to [1, 1, C] only feeds a Multiply (the spec's merges broadcast)."""
    layers = import_keras(DATA / "inception_mini.json").spec["layers"]
    assert layers[1:11] == [
        {"type": "relu6", "name": "stem"},
        {"type": "conv2d", "filters": 4, "kernel_size": 1, "name": "branch_1x1"},
        {"type": "conv2d", "filters": 16, "kernel_size": 3, "padding": "same", "groups": 8,
         "name": "branch_depthwise", "input": "stem"},
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same", "dilation": 2, "input": "stem"},
        {"type": "silu", "name": "branch_dilated"},
        {"type": "concat", "name": "mixed", "inputs": ["branch_1x1", "branch_depthwise", "branch_dilated"]},
        {"type": "global_maxpool2d"},
        {"type": "dense", "units": 24},
        {"type": "sigmoid", "name": "gate"},
        {"type": "multiply", "inputs": ["mixed", "gate"]}]


def import_keras_config(name: str):
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.json"
        path.write_text(json.dumps(config(name)))
        return import_keras(path)


def test_stochastic_depth_is_per_sample_dropout():
    """EfficientNet's Dropout(noise_shape=(None, 1, 1, 1)) before each residual add (drop_connect_rate 0.2, growing
    with depth); its other Dropout, before the classifier, drops units."""
    layers = import_keras_config("EfficientNetB0").spec["layers"]
    dropouts = [layer for layer in layers if layer["type"] == "dropout"]
    assert len(dropouts) == 10 and all(d.get("per_sample") for d in dropouts[:9]) and "per_sample" not in dropouts[9]
    assert [round(d["rate"], 4) for d in dropouts[:2]] == [0.025, 0.05]


def test_the_seed_model_imports_as_small_convnet():
    spec = import_keras(DATA / "small_convnet.json").spec
    builtin = yaml.safe_load((MODELS_DIR / "small_convnet.yaml").read_text())
    assert validate(spec, "imported").layers == validate(builtin, "built-in").layers  # defaults filled in
    assert spec["input"] == builtin["input"]
    assert spec["loss"] == builtin["loss"]
    # Keras's RMSprop: lr 1e-4 (kept in float32 by Keras, read back as written), its default epsilon, inside
    assert spec["optimizer"] == {"type": "rmsprop", "learning_rate": 1e-4, "rho": 0.9, "epsilon": 1e-7,
                                 "epsilon_placement": "inside"}
    assert spec["dataset"] == {"name": "synthetic", "num_classes": 2}


def test_residual_adds_become_blocks_with_identity_and_projection_shortcuts():
    imported = import_keras(DATA / "resnet_mini.json")
    blocks = [layer for layer in imported.spec["layers"] if layer["type"] == "residual"]
    assert [len(b["layers"]) for b in blocks] == [5, 5]
    assert "projection" not in blocks[0]
    assert [layer["type"] for layer in blocks[1]["projection"]] == ["conv2d", "batchnorm"]
    assert blocks[1]["projection"][0] == {"type": "conv2d", "filters": 32, "kernel_size": 1, "strides": 2,
                                          "use_bias": False}
    assert imported.spec["optimizer"] == {"type": "sgd", "learning_rate": 0.05, "momentum": 0.9, "nesterov": False}
    # every canonical layer path names the Keras layer it came from (what a weight copier needs)
    assert imported.sources["5.projection.0"] == "conv2d_9" and imported.sources["5"] == "add_1"


def test_attention_embedding_and_adamw_map_exactly():
    spec = import_keras(DATA / "tiny_transformer.json").spec
    assert spec["input"] == {"shape": [16], "vocab": 64}
    assert spec["layers"][1]["layers"][1] == {"type": "attention", "heads": 4, "causal": True}
    assert spec["optimizer"]["type"] == "adamw" and spec["optimizer"]["no_decay"] == []  # Keras decays every weight
    assert spec["optimizer"]["clip_norm"] == 1.0 and spec["optimizer"]["weight_decay"] == 0.01
    assert spec["dataset"] == {"name": "synthetic_tokens", "num_classes": 4}


def test_a_keras_file_is_read_through_its_config_json(tmp_path, capsys):
    from_zip = import_keras(DATA / "mnist_mlp_dropout.keras")
    assert from_zip.spec["layers"] == import_keras(DATA / "mnist_mlp_dropout.json").spec["layers"]
    code, out, _ = run_import(tmp_path, capsys, DATA / "mnist_mlp_dropout.keras", "-o", str(tmp_path / "mlp.yaml"))
    assert code == 0 and "wrote" in out
    assert validate(yaml.safe_load((tmp_path / "mlp.yaml").read_text()), "mlp").name == "mnist_mlp_dropout"
    broken = tmp_path / "weights_only.keras"
    with zipfile.ZipFile(broken, "w") as archive:
        archive.writestr("metadata.json", "{}")
    code, _, err = run_import(tmp_path, capsys, broken)
    assert code == 2 and len(err) == 1 and "a zip without config.json" in err[0], err


def test_initializers_are_dropped_with_one_note(tmp_path, capsys):
    code, _, err = run_import(tmp_path, capsys, DATA / "resnet_mini.json", "--batch-size", "8", "--steps", "5")
    notes = [line for line in err if "initializers" in line]
    assert code == 0 and len(notes) == 1 and notes[0].startswith("amp-harness: note:"), err


def test_without_a_compile_config_the_defaults_are_said(tmp_path, capsys):
    model = config("resnet_mini")
    del model["compile_config"]
    code, out, err = run_import(tmp_path, capsys, model)
    spec = yaml.safe_load(out)
    assert code == 0
    assert spec["loss"] == {"type": "sparse_categorical_crossentropy", "from_logits": True}  # a dense, no softmax
    assert spec["optimizer"]["type"] == "rmsprop" and spec["optimizer"]["epsilon_placement"] == "inside"
    assert any("no compile configuration: loss" in line for line in err)
    assert any("no compile configuration: optimizer rmsprop" in line for line in err)
    model = config("small_convnet")
    del model["compile_config"]
    code, out, _ = run_import(tmp_path, capsys, model)
    assert yaml.safe_load(out)["loss"] == {"type": "binary_crossentropy", "from_logits": False}  # sigmoid output


def test_keras2_training_config_legacy_rmsprop_puts_epsilon_outside(tmp_path, capsys):
    model = config("small_convnet")
    compiled = model.pop("compile_config")
    optimizer = {"class_name": "RMSprop", "config": {k: v for k, v in compiled["optimizer"]["config"].items()
                                                     if k in ("name", "learning_rate", "rho", "momentum", "epsilon",
                                                              "centered")} | {"decay": 0.0}}
    model["training_config"] = {"loss": "binary_crossentropy", "optimizer_config": optimizer}
    code, out, _ = run_import(tmp_path, capsys, model)
    assert code == 0 and yaml.safe_load(out)["optimizer"]["epsilon_placement"] == "outside"
    optimizer["config"]["is_legacy_optimizer"] = False  # Keras 2.11+'s new optimizer: inside, as Keras 3
    code, out, _ = run_import(tmp_path, capsys, model)
    assert code == 0 and yaml.safe_load(out)["optimizer"]["epsilon_placement"] == "inside"


def test_adam_with_weight_decay_is_adamw_on_every_weight(tmp_path, capsys):
    model = config("mnist_mlp_dropout")
    model["compile_config"]["optimizer"]["config"]["weight_decay"] = 0.05
    code, out, _ = run_import(tmp_path, capsys, model)
    optimizer = yaml.safe_load(out)["optimizer"]
    assert code == 0 and optimizer["type"] == "adamw" and optimizer["weight_decay"] == 0.05
    assert optimizer["no_decay"] == []


def test_dataset_option():
    assert import_keras(DATA / "mnist_mlp_dropout.json", "digits").spec["dataset"] == {"name": "digits",
                                                                                       "num_classes": 10}
    assert import_keras(DATA / "small_convnet.json", "digits").spec["dataset"] == {"name": "digits", "num_classes": 2}


@pytest.mark.parametrize("option, expected", [
    ("imagenet", "--dataset imagenet: expected synthetic, digits, image_folder:PATH"),
    ("text", "input.vocab: text gives token ids"),
    ("image_folder:/some/images", "image_folder needs an image input [H, W, 1] or [H, W, 3], got [64]"),  # check's
])
def test_a_dataset_the_model_cannot_take_is_one_line(tmp_path, capsys, option, expected):
    code, out, err = run_import(tmp_path, capsys, DATA / "mnist_mlp_dropout.json", "--dataset", option)
    assert code == 2 and not out and len(errors(err)) == 1 and expected in errors(err)[0], err


def _set(name, key, value):
    def edit(model):
        layer(model, name)["config"][key] = value
    return edit


def _rename(name, cls):
    def edit(model):
        layer(model, name)["class_name"] = cls
    return edit


def _compiled(part, value):
    def edit(model):
        model["compile_config"][part] = value
    return edit


def _optimizer_option(key, value):
    def edit(model):
        model["compile_config"]["optimizer"]["config"][key] = value
    return edit


# (category, model, edit, the one line's telling part); each edit is one problem, so one line
UNSUPPORTED = [
    ("layer class", "small_convnet", _rename("conv2d_1", "SeparableConv2D"),
     "layer 2 'conv2d_1' (SeparableConv2D): layer class SeparableConv2D: not in the spec"),
    ("layer class", "mnist_mlp_dropout", _rename("activation_4", "PReLU"),
     "layer 4 'activation_4' (PReLU): layer class PReLU: not in the spec"),
    ("non-square kernel", "small_convnet", _set("conv2d", "kernel_size", [3, 5]),
     "layer 0 'conv2d' (Conv2D): kernel_size [3, 5]: not square"),
    ("non-square stride", "resnet_mini", _set("conv2d_7", "strides", [2, 1]),
     "layer 11 'conv2d_7' (Conv2D): strides [2, 1]: not square"),
    ("dilation", "small_convnet", _set("conv2d_2", "dilation_rate", [2, 1]),
     "layer 4 'conv2d_2' (Conv2D): dilation_rate [2, 1]: not square"),
    ("groups", "resnet_mini", _set("conv2d_5", "groups", 3),
     "model.json (imported): layers[3].layers[0] (conv2d): groups 3 must divide the input's channels (16) and the filters "
     "(16) (the Keras layer 'conv2d_5')"),
    ("channels_first", "small_convnet", _set("max_pooling2d", "data_format", "channels_first"),
     "layer 1 'max_pooling2d' (MaxPooling2D): data_format \"channels_first\": the spec's maxpool2d takes "
     "only \"channels_last\""),
    ("activation", "mnist_mlp_dropout", _set("dense_2", "activation", "elu"),
     "layer 0 'dense_2' (Dense): activation \"elu\": the spec's activations are"),
    ("regularizer", "mnist_mlp_dropout", _set("dense_3", "kernel_regularizer", {"class_name": "L2", "config": {}}),
     "layer 3 'dense_3' (Dense): kernel_regularizer L2: the spec has no regularizers"),
    ("frozen", "mnist_mlp_dropout", _set("dense_3", "trainable", False),
     "layer 3 'dense_3' (Dense): trainable false: the spec trains every weight"),
    ("batchnorm without scale", "resnet_mini", _set("batch_normalization", "scale", False),
     "layer 2 'batch_normalization' (BatchNormalization): scale false:"),
    ("optimizer", "small_convnet", _compiled("optimizer", {"class_name": "Adagrad", "config": {}}),
     "compile_config.optimizer: \"Adagrad\": the spec's optimizers are SGD, Adam, AdamW, RMSprop"),
    ("optimizer option", "small_convnet", _optimizer_option("momentum", 0.9),
     "compile_config.optimizer: RMSprop: momentum 0.9: not in the spec's rmsprop"),
    ("optimizer option", "small_convnet", _optimizer_option("centered", True),
     "compile_config.optimizer: RMSprop: centered true: not in the spec's rmsprop"),
    ("optimizer schedule", "mnist_mlp_dropout", _optimizer_option(
        "learning_rate", {"class_name": "ExponentialDecay", "config": {"initial_learning_rate": 0.1}}),
     "compile_config.optimizer: Adam: learning_rate \"ExponentialDecay\": a Keras schedule"),
    ("loss", "mnist_mlp_dropout", _compiled("loss", "categorical_crossentropy"),
     "compile_config.loss: \"categorical_crossentropy\": the spec's losses are sparse_categorical_crossentropy and "
     "binary_crossentropy; one-hot labels"),
    ("loss option", "small_convnet", _compiled("loss", {"class_name": "BinaryCrossentropy",
                                                       "config": {"from_logits": False, "label_smoothing": 0.1}}),
     "compile_config.loss: BinaryCrossentropy: label_smoothing 0.1: the spec's loss takes 0"),
    ("merge", "resnet_mini", _rename("add", "Subtract"),
     "layer 9 'add' (Subtract): takes 2 tensors: only Add, Multiply, Concatenate join branches in the spec"),
    ("concat axis", "resnet_mini", lambda m: (_rename("add", "Concatenate")(m), _set("add", "axis", 1)(m)),
     "layer 9 'add' (Concatenate): axis 1: the spec concatenates the last (channel or feature) axis"),
    ("cross-attention", "tiny_transformer", lambda m: layer(m, "multi_head_attention")["inbound_nodes"][0]["args"][1]
     ["config"].update(keras_history=["embedding", 0, 0]),
     "layer 3 'multi_head_attention' (MultiHeadAttention): query, value and key are different tensors"),
]


@pytest.mark.parametrize("category, name, edit, expected", UNSUPPORTED, ids=[f"{u[0]}-{u[1]}" for u in UNSUPPORTED])
def test_what_the_spec_cannot_express_is_one_line_and_exit_2(tmp_path, capsys, category, name, edit, expected):
    model = copy.deepcopy(config(name))
    edit(model)
    code, out, err = run_import(tmp_path, capsys, model)
    lines = errors(err)
    assert code == 2 and not out, (code, err)
    assert len(lines) == 1 and lines[0].startswith(f"amp-harness: error: {tmp_path / 'model.json'}") and \
        expected in lines[0], err
    assert not any("Traceback" in line for line in err)


def test_each_problem_gets_its_own_line(tmp_path, capsys):
    model = config("small_convnet")
    _set("conv2d", "kernel_size", [3, 5])(model)
    _set("conv2d_2", "dilation_rate", [2, 1])(model)
    _compiled("loss", "mse")(model)
    code, _, err = run_import(tmp_path, capsys, model)
    lines = errors(err)
    assert code == 2 and len(lines) == 3, err
    assert "'conv2d'" in lines[0] and "'conv2d_2'" in lines[1] and "compile_config.loss" in lines[2]


@pytest.mark.parametrize("text, expected", [
    ("{not json", "line 1: not JSON"),
    ('{"class_name": "MyModel", "config": {"name": "m"}}', "a MyModel model: its configuration holds no layer graph"),
    ("[1, 2]", "not a Keras model's configuration"),
])
def test_a_file_that_is_not_a_keras_model_is_one_line(tmp_path, capsys, text, expected):
    path = tmp_path / "model.json"
    path.write_text(text)
    code, _, err = run_import(tmp_path, capsys, path)
    assert code == 2 and len(err) == 1 and f"{path}: {expected}" in err[0], err


def test_the_importer_imports_no_framework():
    code = ("import sys; from harness.cli import main; "
            f"main(['import', 'keras', {str(DATA / 'tiny_transformer.json')!r}]); "
            "bad = [m for m in ('keras', 'tensorflow', 'torch', 'jax', 'mxnet') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "name: tiny_transformer" in done.stdout


def test_the_coverage_table_in_the_docs_is_what_the_importer_gives():
    """docs/import.md's table is benchmarks/import_coverage.py's output: its Keras rows, rerun here."""
    import importlib.util

    loader = importlib.util.spec_from_file_location("import_coverage", ROOT / "benchmarks" / "import_coverage.py")
    coverage = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(coverage)
    doc = (ROOT / "docs" / "import.md").read_text()
    stale = [row for row in coverage.keras_rows() if f"| {' | '.join(row)} |" not in doc]
    assert not stale, f"docs/import.md's coverage table is stale (rerun benchmarks/import_coverage.py): {stale}"
