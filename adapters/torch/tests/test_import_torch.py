"""`amp-harness import torch MODULE:ATTR --input-shape ...` against real PyTorch: each test model (import_models.py)
is traced into a spec that the core accepts, the harness's torch network is built from the spec holding the
module's own weights (copied into the canonical layout, the flatten permutation included), and both networks'
outputs are compared in float32 in eval mode on the same inputs; the trainable parameter counts must match too.
What the spec cannot express is one line naming the module and the field, and exit 2."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")

import import_models as M  # noqa: E402
from amp_harness_torch.importer import canonical_weights, flatten_permutation, import_nn_module  # noqa: E402
from amp_harness_torch.network import Network  # noqa: E402
from harness.cli import main  # noqa: E402
from harness.model.graph import infer  # noqa: E402
from harness.model.importers import ImportProblems  # noqa: E402
from harness.model.spec import MODELS_DIR, validate  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS_FILE = HERE / "import_models.py"
ROOT = HERE.parents[2]

# name -> (factory, input shape in PyTorch's layout)
MODELS = {
    "small_convnet": (M.small_convnet, (3, 64, 96)),
    "resnet_mini": (M.ResNetMini, (3, 16, 16)),
    "mlp": (M.MLP, (64,)),
    "conv_flatten_norm": (M.ConvFlattenNorm, (2, 7, 8)),
    "token_bag": (M.TokenBag, (12,)),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """PyTorch starts biases, norm betas and running means near 0 and scales and variances at 1, which would hide a
    weight copied into the wrong place: draw them (kernels keep PyTorch's own draw)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.LayerNorm)):
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) * 0.6 + 0.7)
                module.bias.copy_(torch.rand(module.bias.shape, generator=gen) * 0.4 - 0.2)
            if isinstance(module, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
                module.running_mean.copy_(torch.rand(module.running_mean.shape, generator=gen) * 0.4 - 0.2)
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=gen) * 0.6 + 0.7)


def _inputs(spec, shape: tuple[int, ...], seed: int = 2, batch: int = 4):
    gen = torch.Generator().manual_seed(seed)
    if spec.tokens:
        return torch.randint(0, spec.input.vocab, (batch, *shape), generator=gen)
    return torch.randn((batch, *shape), generator=gen)


def _both(name: str, flattened: bool = True):
    """(the module's outputs, the harness network's outputs) on the same inputs, in eval mode, float32."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    _randomise(model, 1)
    model.eval()
    imported = import_nn_module(model, shape)
    if not flattened:  # a copier that forgets PyTorch's C, H, W flatten order
        imported.flattened.clear()
    spec = validate(imported.spec, name)
    graph = infer(spec)
    net = Network(spec.layers, graph, canonical_weights(model, imported)).eval()
    x = _inputs(spec, shape)
    with torch.no_grad():
        return model(x).numpy(), net(x).numpy()


@pytest.mark.parametrize("name", list(MODELS))
def test_imported_network_computes_the_torch_module(name):
    make, shape = MODELS[name]
    model = make()
    imported = import_nn_module(model, shape)
    spec = validate(imported.spec, name)
    graph = infer(spec)
    assert graph.param_count == sum(p.numel() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var")))
    assert sum(math.prod(s) for s in graph.param_shapes().values()) == graph.param_count + buffers
    if len(shape) == 3:
        c, h, w = shape
        assert spec.input.shape == [h, w, c]  # NCHW's C, H, W is the spec's NHWC [H, W, C]
    expected, got = _both(name)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["small_convnet", "conv_flatten_norm"])
def test_the_flatten_permutation_is_what_makes_them_equal(name):
    """Without the C, H, W -> H, W, C permutation of the dense's rows (and the norm's features) the outputs differ:
    the round trip above sees a missing or wrong permutation."""
    expected, got = _both(name, flattened=False)
    assert not np.allclose(got, expected, rtol=1e-3, atol=1e-3)
    assert list(flatten_permutation((2, 1, 3))) == [0, 3, 1, 4, 2, 5]  # h, w, c order of a [C=2, H=1, W=3] flatten


def test_the_seed_model_imports_as_small_convnet():
    spec = import_nn_module(M.small_convnet(), (3, 64, 96)).spec
    builtin = yaml.safe_load((MODELS_DIR / "small_convnet.yaml").read_text())
    assert validate(spec, "imported").layers == validate(builtin, "built-in").layers
    assert spec["input"] == {"shape": [64, 96, 3]}
    assert spec["loss"] == builtin["loss"]  # a dense of 1 unit and a sigmoid


def test_residual_blocks_batchnorm_momentum_and_sources():
    imported = import_nn_module(M.ResNetMini(), (3, 16, 16))
    blocks = [layer for layer in imported.spec["layers"] if layer["type"] == "residual"]
    assert [len(b["layers"]) for b in blocks] == [5, 5]
    assert "projection" not in blocks[0]
    assert blocks[1]["projection"] == [{"type": "conv2d", "filters": 32, "kernel_size": 1, "strides": 2,
                                        "use_bias": False}, {"type": "batchnorm", "momentum": 0.9, "epsilon": 1e-5}]
    assert blocks[0]["layers"][1] == {"type": "batchnorm", "momentum": 0.8}  # PyTorch's 0.2; eps 1e-3 the default
    assert imported.sources["5.projection.0"] == "layer2.downsample.0" and imported.sources["5.layers.0"] == \
        "layer2.conv1"


def test_options_and_notes(tmp_path, capsys):
    out = tmp_path / "mlp.yaml"
    code = main(["import", "torch", f"{MODELS_FILE}:MLP", "--input-shape", "64", "--dataset", "digits",
                 "--batch-size", "16", "--steps", "7", "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 0 and "wrote" in captured.out, captured.err
    spec = yaml.safe_load(out.read_text())
    assert spec["name"] == "MLP" and spec["dataset"] == {"name": "digits", "num_classes": 10}
    assert (spec["batch_size"], spec["steps"]) == (16, 7)
    assert spec["optimizer"] == {"type": "adam", "learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999,
                                 "epsilon": 1e-8}
    notes = [line for line in captured.err.splitlines() if line.startswith("amp-harness: note:")]
    assert any("holds no optimizer: adam" in n for n in notes) and any("holds no loss" in n for n in notes)
    assert any("unbiased batch variance" in n for n in notes)
    assert main(["check", str(out)]) == 0


def test_a_module_name_on_the_path_and_a_class_or_factory(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    assert main(["import", "torch", "import_models:small_convnet", "--input-shape", "3,64,96"]) == 0
    spec = yaml.safe_load(capsys.readouterr().out)
    assert spec["name"] == "small_convnet" and spec["input"] == {"shape": [64, 96, 3]}
    assert main(["import", "torch", "import_models:TokenBag", "--input-shape", "12"]) == 0
    spec = yaml.safe_load(capsys.readouterr().out)
    assert spec["input"] == {"shape": [12], "vocab": 50} and spec["dataset"]["name"] == "synthetic_tokens"


def _run(capsys, target: str, shape: str) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr's lines), where a refusal's stderr is nothing but its error lines (no traceback)."""
    code = main(["import", "torch", target, "--input-shape", shape])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    if code:
        assert all(line.startswith("amp-harness: error:") for line in lines), err
    return code, out, lines


# (category, attribute, input shape, the one line's telling part)
UNSUPPORTED = [
    ("module", "unsupported_module", "8", "module '1' (SiLU): module class SiLU: not in the spec (mapped: Linear"),
    ("field", "unsupported_field", "3,8,8",
     "module '0' (Conv2d): dilation (2, 2): the spec's conv2d takes only (1, 1)"),
    ("padding", "unsupported_padding", "3,8,8", "module '0' (Conv2d): padding (1, 1): with kernel 3 and stride 2: "
     "PyTorch pads 1 on every side"),
    ("avgpool divisor", "unsupported_avgpool", "3,8,8", "module '0' (AvgPool2d): count_include_pad True: with "
     "padding 1: PyTorch divides a border window by k*k"),
    ("function", "UnsupportedFunction", "8", "forward calls torch.nn.functional.silu (fx node 'silu'): call: not in "
     "the spec (mapped functions:"),
    ("concatenation", "Branches", "8", "forward calls torch.cat (fx node 'cat'): call: not in the spec"),
    ("graph", "Crossing", "8", "module 'a' (Linear): on two paths: only residual adds join the chain"),
    ("shape", "MLP", "3,8,8", "--input-shape 3,8,8: the module fails on a zero input of that shape"),
    ("trace", "Untraceable", "8", "torch.fx.symbolic_trace cannot trace it (TraceError"),
    ("not a module", "not_a_module", "8", "not_a_module is a int, not an nn.Module"),
    ("no attribute", "nothing_here", "8", "has no attribute nothing_here"),
]


@pytest.mark.parametrize("category, attr, shape, expected", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_what_the_spec_cannot_express_is_one_line_and_exit_2(capsys, category, attr, shape, expected):
    target = f"{MODELS_FILE}:{attr}"
    code, out, lines = _run(capsys, target, shape)
    assert code == 2 and not out, (code, lines)
    assert len(lines) == 1 and f"{target}: " in lines[0] and expected in lines[0], lines


def test_a_file_that_is_not_there_is_one_line(tmp_path, capsys):
    code, _, lines = _run(capsys, f"{tmp_path / 'none.py'}:Net", "8")
    assert code == 2 and len(lines) == 1 and "none.py: no such file" in lines[0], lines
    code, _, lines = _run(capsys, "no_such_module_here:Net", "8")
    assert code == 2 and len(lines) == 1 and "importing no_such_module_here failed: ModuleNotFoundError" in lines[0]


def test_each_problem_gets_its_own_line(tmp_path, capsys):
    path = tmp_path / "two.py"
    path.write_text("from torch import nn\n"
                    "def net():\n"
                    "    return nn.Sequential(nn.Conv2d(3, 4, (3, 5)), nn.ELU(), nn.Flatten(), nn.LazyLinear(2))\n")
    code, _, lines = _run(capsys, f"{path}:net", "3,8,8")
    assert code == 2 and len(lines) == 2, lines
    assert "module '0' (Conv2d): kernel_size (3, 5): not square" in lines[0]
    assert "module '1' (ELU): module class ELU: not in the spec" in lines[1]


def test_an_unused_in_place_result_is_refused():
    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            torch.relu_(x)  # fx records a node whose result nothing uses: the chain would skip the relu
            return self.fc(x)

    with pytest.raises(ImportProblems) as caught:
        import_nn_module(InPlace(), (4,))
    assert caught.value.lines == ["InPlace: forward calls torch.relu_ (fx node 'relu_'): not on the chain from the "
                                  "input to the output (an in-place op whose result is not used, or a branch the "
                                  "spec cannot express: only residual adds join the chain)"]
