"""`amp-harness export` without any framework: the data file holds the canonical weights and the fingerprint's
batches, every framework's script is generated (valid Python) without importing the framework, and what the export
does not cover is refused in one line naming the spec file and the place, exit 2."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.errors import HarnessError
from harness.export import FRAMEWORKS, PRECISIONS, add_parser, cmd_export, export, template_path
from harness.model.data import Data
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.model.weights import initial_weights

ROOT = Path(__file__).resolve().parents[2]
EXPORTED = [f for f in FRAMEWORKS if template_path(f) is not None]


def cli(argv: list[str]) -> int:
    """What harness.cli does with the export command: a HarnessError is one line on stderr and exit 2."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["export", *argv])
    try:
        return args.func(args)
    except HarnessError as exc:
        print(f"amp-harness: error: {exc}", file=sys.stderr)
        return 2


def test_every_framework_but_mxnet_has_a_template():
    assert EXPORTED == ["torch", "tensorflow", "jax"]


def test_data_file_holds_canonical_weights_and_the_fingerprints_batches(tmp_path):
    spec_file = ROOT / "tests/specs/pitfall_residual_projection.yaml"
    _, data_file = export(str(spec_file), "torch", "fp32", tmp_path, steps=3)
    spec = load_spec(str(spec_file)).with_overrides(steps=3)
    graph = infer(spec)
    saved = np.load(data_file)
    weights = initial_weights(graph, spec.seed)
    assert sorted(k[2:] for k in saved.files if k.startswith("w/")) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(saved[f"w/{name}"], value)
    data = Data(spec, order_seed=spec.seed)  # as harness.run.worker._fingerprint takes them
    assert saved["x"].shape == (3, spec.batch_size, *spec.input.shape) and saved["x"].dtype == np.float32
    for step in range(3):
        x, y = data.train_batch(step)
        np.testing.assert_array_equal(saved["x"][step], x)
        np.testing.assert_array_equal(saved["y"][step], y)
    assert str(saved["spec_hash"]) == spec.spec_hash()


@pytest.mark.parametrize("framework", EXPORTED)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_scripts_are_generated_without_the_framework(framework, precision, tmp_path):
    frameworks = {"torch", "tensorflow", "keras", "jax", "mxnet"}
    before = frameworks & set(sys.modules)
    for model in ("mnist_mlp", "resnet8", str(ROOT / "tests/specs/pitfall_batchnorm.yaml")):
        script, data_file = export(model, framework, precision, tmp_path, steps=2)
        text = script.read_text()
        compile(text, str(script), "exec")
        assert script.name == f"{load_spec(model).name}_{framework}_{precision}.py"
        assert data_file.name == f"{load_spec(model).name}_data.npz"
        assert "import harness" not in text and "from harness" not in text
        assert "@CONFIG@" not in text and "@HEADER@" not in text
    assert frameworks & set(sys.modules) == before  # generating imported no framework


def test_header_says_dropout_losses_are_not_comparable(tmp_path):
    script, _ = export(str(ROOT / "tests/specs/pitfall_dropout_adam.yaml"), "torch", "fp32", tmp_path, steps=1)
    assert "framework's own dropout" in script.read_text()


def test_cli_writes_and_names_the_files(tmp_path, capsys):
    assert cli(["mnist_mlp", "--framework", "jax", "--precision", "amp_bf16", "--steps", "2", "-o",
                str(tmp_path)]) == 0
    assert (tmp_path / "mnist_mlp_jax_amp_bf16.py").is_file() and (tmp_path / "mnist_mlp_data.npz").is_file()
    assert "mnist_mlp_jax_amp_bf16.py" in capsys.readouterr().out


@pytest.mark.parametrize("argv,expected", [
    (["tiny_gpt", "--framework", "torch"], "tiny_gpt.yaml: layers[0]: export does not cover layer type 'embedding'"),
    ([str(ROOT / "tests/specs/pitfall_adamw_decay.yaml"), "--framework", "torch"],
     "pitfall_adamw_decay.yaml: layers[0]: export does not cover layer type 'embedding'"),
    ([str(ROOT / "tests/specs/pitfall_warmup_cosine.yaml"), "--framework", "jax"],
     "pitfall_warmup_cosine.yaml: optimizer.schedule: export does not cover schedule 'warmup_cosine'"),
    ([str(ROOT / "tests/specs/pitfall_clip_scaled.yaml"), "--framework", "jax"],
     "pitfall_clip_scaled.yaml: optimizer.clip_norm: export does not cover gradient clipping"),
    (["mnist_mlp", "--framework", "torch", "--precision", "bf16_sr"], "--precision bf16_sr: export covers"),
    (["mnist_mlp", "--framework", "mxnet"], "--framework mxnet: export has no template for mxnet"),
    (["mnist_mlp", "--framework", "caffe"], "--framework caffe: export knows"),
])
def test_what_is_not_covered_is_one_line_exit_2(argv, expected, tmp_path, capsys):
    assert cli([*argv, "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # nothing written


def test_nested_layer_and_optimizer_refusals_name_the_place(tmp_path, capsys):
    spec = (ROOT / "tests/specs/pitfall_residual_projection.yaml").read_text()
    nested = tmp_path / "nested.yaml"
    nested.write_text(spec.replace("- {type: relu}", "- {type: rmsnorm}"))
    assert cli([str(nested), "--framework", "torch", "-o", str(tmp_path / "out")]) == 2
    assert "nested.yaml: layers[0].layers[1]: export does not cover layer type 'rmsnorm'" in capsys.readouterr().err
    adamw = tmp_path / "adamw.yaml"
    adamw.write_text((ROOT / "models/mnist_mlp.yaml").read_text().replace(
        "{type: adam,", "{type: adamw, weight_decay: 0.01,"))
    assert cli([str(adamw), "--framework", "tensorflow", "-o", str(tmp_path / "out")]) == 2
    assert "adamw.yaml: optimizer.type: export does not cover optimizer 'adamw'" in capsys.readouterr().err
