"""The spec loader, shape inference and precision parsing: no framework involved."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from harness.errors import HarnessError, SpecError
from harness.model.graph import infer, same_padding
from harness.model.spec import builtin_models, load_spec
from harness.precision import PRECISIONS, parse_loss_scale, parse_precision
from harness.run.plan import resolve
from tests.conftest import pitfall_specs

BASE = yaml.safe_load((__import__("harness.model.spec", fromlist=["MODELS_DIR"]).MODELS_DIR / "mnist_mlp.yaml").read_text())


def write(tmp_path, data, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_builtin_models_load():
    assert {"mnist_mlp", "small_convnet", "resnet8"} <= set(builtin_models())
    for name in builtin_models():
        spec = load_spec(name)
        assert infer(spec).param_count > 0


def test_mnist_mlp_is_784_512_10():
    graph = infer(load_spec("mnist_mlp"))
    assert graph.param_count == 784 * 512 + 512 + 512 * 10 + 10
    # forward multiply-adds: 2 FLOPs each, training step = 3x forward
    assert graph.train_step_flops(64) == 3 * 2 * (784 * 512 + 512 * 10) * 64


def test_resnet8_shapes_and_params():
    graph = infer(load_spec("resnet8"))
    assert graph.output_shape == (10,)
    by_path = {l.path: l for l in graph.layers}
    assert by_path["5.layers.0"].out_shape == (16, 16, 32)  # stride-2 'same' on 32: ceil(32/2)
    assert by_path["7"].out_shape == (8, 8, 64)
    convs = [l for l in graph.layers if l.type == "conv2d"]
    assert sum(l.param_count for l in convs) == 3 * 3 * 3 * 16 + 2 * 9 * 16 * 16 + 9 * 16 * 32 + 9 * 32 * 32 + \
        16 * 32 + 9 * 32 * 64 + 9 * 64 * 64 + 32 * 64


def test_same_padding_puts_the_odd_pixel_after():
    assert same_padding(8, 3, 2) == (0, 1)
    assert same_padding(7, 3, 2) == (1, 1)
    assert same_padding(8, 3, 1) == (1, 1)
    assert same_padding(8, 2, 1) == (0, 1)


@pytest.mark.parametrize("path", pitfall_specs(), ids=lambda p: p.stem)
def test_pitfall_specs_are_valid(path):
    resolve(str(path))


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["layers"][1].update(units=-3), "layers[1].units: Input should be greater than 0"),
    (lambda d: d["layers"][1].update(type="dense3d"), "layers[1]: unknown type 'dense3d' (valid: dense, conv2d"),
    (lambda d: d["layers"][1].update(unitz=5), "layers[1].unitz: unknown key; did you mean 'units'?"),
    (lambda d: d["optimizer"].pop("epsilon"), "optimizer.epsilon: Field required"),
    (lambda d: d.update(batch_size="many"), "batch_size: Input should be a valid integer"),
    (lambda d: d["layers"].insert(1, {"type": "conv2d", "filters": 4, "kernel_size": 3}),
     "layers[1] (conv2d): expects an image input [H, W, C], got shape [784]"),
    (lambda d: d["layers"].pop(0), "layers[0] (dense): expects a vector or a sequence, got an image [28, 28, 1]"),
    (lambda d: d["layers"][-1].update(units=7), "the network outputs [7] but sparse_categorical_crossentropy"),
    (lambda d: d["loss"].pop("from_logits"), "loss.from_logits: Field required"),
    # named tensors: every place a name can be wrong
    (lambda d: d["layers"].insert(2, {"type": "add", "inputs": ["x", "input"]}),
     "layers[2] (add): no earlier layer of this list is named 'x'; named here: input"),
    (lambda d: (d["layers"][1].update(name="h"), d["layers"][2].update(name="h")),
     "layers[2] (relu): the name 'h' is given twice"),
    (lambda d: d["layers"].insert(2, {"type": "multiply", "input": "h", "inputs": ["h", "h"]}),
     "layers[2]: a merge takes `inputs` (a list of names), not `input`"),
    (lambda d: (d["layers"][1].update(name="h"), d["layers"].insert(3, {"type": "concat", "inputs": ["h", "input"]})),
     "layers[3] (concat): concat joins the last axis: the others must agree, got [512] and [28, 28, 1]"),
    (lambda d: d["layers"][1].update(input="later", name="early"),
     "layers[1] (dense): no earlier layer of this list is named 'later'"),
    (lambda d: d["layers"][1].update(name="1st"),
     "layers[1].name: a tensor name is letters, digits and _, not starting with a digit"),
])
def test_malformed_spec_gives_one_line_naming_the_field(tmp_path, mutate, expected):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(SpecError) as info:
        resolve(str(path))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert expected in message


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, "name: x\nlayers: [\n  {type: dense\n")
    with pytest.raises(SpecError, match=r"line \d+: invalid YAML"):
        load_spec(str(path))


def test_unknown_model_and_missing_file():
    with pytest.raises(SpecError, match="unknown model 'nope'; built-in models: .*mnist_mlp"):
        load_spec("nope")
    with pytest.raises(SpecError, match="cannot read"):
        load_spec("/nonexistent/spec.yaml")


def test_residual_shape_mismatch_is_rejected(tmp_path):
    data = yaml.safe_load((pitfall_specs()[0].parent / "pitfall_residual_projection.yaml").read_text())
    data["layers"][1].pop("projection")
    path = write(tmp_path, data)
    with pytest.raises(SpecError, match=r"layers\[1\] \(residual\): block output \[4, 4, 6\] does not match"):
        resolve(str(path))
    load_spec(str(path))  # the schema alone has no opinion on shapes: resolving the spec asks shape inference


def test_spec_hash_is_stable_and_covers_overrides():
    a, b = load_spec("resnet8"), load_spec("resnet8")
    assert a.spec_hash() == b.spec_hash() == a.with_overrides().spec_hash()
    assert a.with_overrides(batch_size=8).spec_hash() != a.spec_hash()
    assert a.with_overrides(input_size=(16, 16)).spec_hash() != a.spec_hash()
    # the same hash in another process (no per-process randomness in it)
    out = subprocess.run([sys.executable, "-c", "from harness.model.spec import load_spec;"
                          "print(load_spec('resnet8').spec_hash())"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == a.spec_hash()


def test_input_size_override_only_for_images():
    spec = load_spec("small_convnet").with_overrides(input_size=(64, 96), batch_size=8, steps=3)
    assert spec.input.shape == [64, 96, 3] and spec.batch_size == 8 and spec.steps == 3
    with pytest.raises(SpecError, match="^small_convnet: layers.*does not fit"):
        resolve("small_convnet", input_size=(32, 32))


def test_precisions():
    assert parse_precision("amp_fp16").mixed and not parse_precision("fp16").mixed
    with pytest.raises(HarnessError, match="unknown precision 'fp8'; valid: fp32, tf32, amp_fp16"):
        parse_precision("fp8")
    assert set(PRECISIONS) == {"fp32", "tf32", "amp_fp16", "amp_bf16", "fp16", "bf16", "fp64", "bf16_sr", "fp16_sr",
                               "bf16_kahan", "fixed16_sr", "fixed16_rn", "fp8_e4m3", "fp8_hybrid", "mxfp8", "mxfp6",
                               "mxfp4", "nvfp4", "fp8_block"}
    assert parse_precision("fp8_hybrid:current").fp8.backward.name == "e5m2"
    rht = parse_precision("nvfp4:rht")
    assert rht.blocks.hadamard and rht.blocks.name == "nvfp4:rht" and not parse_precision("nvfp4").blocks.hadamard
    with pytest.raises(HarnessError, match="takes any of :rht"):
        parse_precision("mxfp8:delayed")
    with pytest.raises(HarnessError, match="each once"):
        parse_precision("nvfp4:sr:sr")
    combined = parse_precision("nvfp4:sr:rht")  # named in the canonical order
    assert combined.name == combined.blocks.name == "nvfp4:rht:sr"
    assert combined.blocks.hadamard and combined.blocks.stochastic and not combined.blocks.native
    assert "stochastically rounded gradients" in combined.description
    assert parse_precision("mxfp8:native").blocks.native and "(emulated)" not in parse_precision("mxfp8:native").description
    assert parse_precision("fp8_e4m3:delayed:8").fp8.recipe.history == 8
    assert parse_precision("fp8_e4m3:delayed").fp8.recipe.history == 16
    with pytest.raises(HarnessError, match="current, delayed or delayed:N"):
        parse_precision("fp8_e4m3:later")
    assert parse_loss_scale(None, parse_precision("amp_fp16")).mode == "dynamic"
    assert parse_loss_scale(None, parse_precision("fp16")).mode == "none"
    fixed = parse_loss_scale("128", parse_precision("amp_fp16"))
    assert (fixed.mode, fixed.initial) == ("fixed", 128.0)
    assert parse_loss_scale("dynamic:1024", parse_precision("fp32")).initial == 1024.0
    with pytest.raises(HarnessError, match="--loss-scale 'lots'"):
        parse_loss_scale("lots", parse_precision("amp_fp16"))


def test_check_says_where_a_layer_s_inputs_come_from(capsys):
    from harness.cli import main

    assert main(["check", "tests/specs/pitfall_mobile_graph.yaml"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:] if line.startswith("  ")}
    assert lines["26"].split()[1] == "concat" and lines["26"].endswith("<- 24, 18, 25")
    assert lines["21"].endswith("<- 18") and lines["22"].endswith("FLOPs")  # a chain's layer says nothing
    graph = infer(load_spec("tests/specs/pitfall_mobile_graph.yaml"))
    assert graph.input_of("25") == "18" and graph.input_of("26") == "24" and graph.input_of("0") is None
