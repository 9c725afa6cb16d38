"""`amp-harness import torch MODULE:ATTR --input-shape ...` against real PyTorch: each test model (import_models.py,
and the Hugging Face models and nn.TransformerEncoder of native_models.py) is captured by torch.export (torch.fx where
export cannot) into a spec that the core accepts; the module's own weights are copied into the canonical layout
(the flatten permutation, transposed Linears, a fused q, k, v projection split in three) and the spec computed with
them, by the harness's torch network in float32 and by the float64 reference (harness.model.reference), gives the
module's outputs in eval mode; the trainable parameter counts match too. What the spec cannot express is one line
naming the module and the field, and exit 2."""
from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")

import import_models as M  # noqa: E402
import native_models as NATIVE  # noqa: E402
from amp_harness_torch import importer_export  # noqa: E402
from amp_harness_torch.importer import canonical_weights, flatten_permutation, import_nn_module  # noqa: E402
from amp_harness_torch.network import Network  # noqa: E402
from harness.cli import main  # noqa: E402
from harness.model import reference  # noqa: E402
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
    ("module", "unsupported_module", "8", "module '1' (ELU): module class ELU: not in the spec (mapped: Linear"),
    ("field", "unsupported_field", "3,8,8", "module '0' (Conv2d): padding_mode 'reflect': the spec's conv2d takes "
     "only 'zeros'"),
    ("padding", "unsupported_padding", "3,8,8", "module '0' (Conv2d): padding (1, 1): with kernel 3 and stride 2: "
     "PyTorch pads 1 on every side"),
    ("avgpool divisor", "unsupported_avgpool", "3,8,8", "module '0' (AvgPool2d): count_include_pad True: with "
     "padding 1: PyTorch divides a border window by k*k"),
    ("function", "UnsupportedFunction", "8", "forward calls aten.exp (node 'exp', import_models.py:"),
    ("concatenation axis", "ConcatHeight", "3,8,8", "forward calls aten.cat (node 'cat', import_models.py:"),
    ("constant product", "Scaled", "8", "calls aten.mul (node 'mul', import_models.py:"),
    ("rotation pairs", "rotary_mixed", "12", "module 'attention' (RotaryAttention): attention: rotary position "
     "embedding: its query heads are not turned as the spec's rotary turns them (dimension i with i + Dh/2"),
    ("scaled rotation", "rotary_scaled", "12", "module 'attention' (RotaryAttention): attention: rotary position "
     "embedding: its query heads are not turned"),
    ("padding mask", "PaddingMasked", "12", "module 'attention' (MultiheadAttention): attention: attn_mask: a mask "
     "computed from the input (a padding mask?)"),
    ("attention written out", "WrittenOut", "12", "module 'attention' (MultiheadAttention) calls aten.bmm (node 'bmm', "
     "activation.py:"),
    ("shape", "MLP", "3,8,8", "--input-shape 3,8,8: the module fails on a zero input of that shape"),
    ("trace", "Untraceable", "8", "torch.export.export cannot capture it (GuardOnDataDependentSymNode"),
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


def test_an_in_place_op_reads_as_its_op():
    """torch.export points every later use of a tensor changed in place at the op's result: `torch.relu_(x)` then
    `fc(x)` is a relu and a dense (torch.fx saw an unused node there and refused it)."""

    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            torch.relu_(x)
            return self.fc(x)

    layers = import_nn_module(InPlace(), (4,)).spec["layers"]
    assert [layer["type"] for layer in layers] == ["relu", "dense"]


def test_where_export_cannot_capture_torch_fx_reads_the_module_as_before(monkeypatch):
    """The fx reading is the fallback: with torch.export failing, every classic model gives the spec it gives
    through export."""
    def fail(*args, **kwargs):
        raise importer_export.CaptureFailed("ExportError: no export here")

    through_export = {name: import_nn_module(make(), shape).spec for name, (make, shape) in MODELS.items()}
    monkeypatch.setattr(importer_export, "export_layers", fail)
    for name, (make, shape) in MODELS.items():
        imported = import_nn_module(make(), shape)
        assert not hasattr(imported, "weights")  # an fx import: canonical_weights reads modules by their names
        assert imported.spec == through_export[name], name


# ---- graphs, attention and Hugging Face models through torch.export -----------------------------------------
def _randomise_all(model: torch.nn.Module, seed: int = 1) -> None:
    """_randomise, every bias drawn too (Hugging Face starts them at 0), and every matrix (Linear, Conv1D,
    embedding) drawn at a scale of 1/sqrt(its last axis): Hugging Face's 0.02 leaves attention's scores near 0, its
    probabilities near uniform, which would hide a query swapped for a key."""
    _randomise(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.rand(param.shape, generator=gen, dtype=param.dtype) * 0.2 - 0.1)
            elif param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) / math.sqrt(param.shape[-1]))
            elif param.dim() == 1:  # norm scales, RMSNorm's included
                param.copy_(torch.rand(param.shape, generator=gen, dtype=param.dtype) * 0.6 + 0.7)


# name -> (factory, input shape in PyTorch's layout)
GRAPHS = {
    "branches": (M.Branches, (8,)),
    "crossing": (M.Crossing, (8,)),
    "gated_convnet": (M.GatedConvNet, (3, 16, 16)),
    "functional_ops": (M.FunctionalOps, (3, 8, 8)),
    "patch_encoder": (M.PatchEncoder, (3, 16, 16)),
    "tiny_causal_lm": (M.TinyCausalLM, (12,)),
    "tiny_causal_lm_masked": (M.tiny_causal_lm_masked, (12,)),
    "encoder": (NATIVE.encoder, (16,)),  # benchmarks/native/torch_*.yaml's inputs
    "gpt2": (NATIVE.gpt2, (16,)),
    "mobilenet_v2": (NATIVE.mobilenet_v2, (3, 16, 16)),
    "rotary_lm": (M.RotaryLM, (12,)),
    "rotary_half": (M.rotary_half, (12,)),
    "llama": (NATIVE.llama, (16,)),
    "bert": (NATIVE.bert, (16,)),
    "gptj": (M.gptj, (16,)),
}
# Hugging Face computes Llama's and GPT-J's rotary tables in float32 whatever the model's dtype (the spec's in
# float64)
FLOAT64_TOLERANCE = {"llama": 1e-5, "gptj": 1e-5}


@functools.lru_cache(maxsize=None)
def _imported(name: str):
    """(the module in float64, eval mode, its weights drawn; its import) for a GRAPHS model."""
    make, shape = GRAPHS[name]
    torch.manual_seed(0)
    model = make().double().eval()
    _randomise_all(model)
    return model, import_nn_module(model, shape, target=name)


def _sample(spec, shape, dtype=torch.float64):
    gen = torch.Generator().manual_seed(2)
    if spec.tokens:
        return torch.randint(0, spec.input.vocab, (4, *shape), generator=gen)
    return torch.randn((4, *shape), generator=gen, dtype=dtype)


def _reference(name: str, weights=None):
    """(the module's outputs, the float64 reference's from the spec and the module's weights)."""
    model, imported = _imported(name)
    spec = validate(imported.spec, name)
    x = _sample(spec, GRAPHS[name][1])
    with torch.no_grad():
        out = model(x)
    expected = getattr(out, "logits", out).numpy()
    weights = weights if weights is not None else canonical_weights(model, imported, np.float64)
    return expected, reference.forward(spec, weights, x.permute(0, 2, 3, 1).numpy() if x.dim() == 4 else x.numpy())


@pytest.mark.parametrize("name", list(GRAPHS))
def test_the_spec_computes_the_module_in_float64(name):
    """The spec, computed by the float64 reference from the module's own weights, gives the module's outputs to
    1e-9 (Llama: 1e-5, FLOAT64_TOLERANCE); its trainable parameters are the module's (a tied weight counted once
    more per use, BERT's token-type rows other than row 0 not at all)."""
    model, imported = _imported(name)
    graph = infer(validate(imported.spec, name))
    assert graph.param_count == sum(p.numel() for p in model.parameters()) + imported.shared_parameters - \
        imported.unused_parameters
    expected, got = _reference(name)
    assert got.shape == expected.shape
    tolerance = FLOAT64_TOLERANCE.get(name, 1e-9)
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", ["encoder", "gpt2", "patch_encoder", "rotary_lm", "llama", "bert", "gptj"])
def test_the_harness_torch_network_computes_the_module_in_float32(name):
    model, imported = _imported(name)
    model = copy.deepcopy(model).float()
    spec = validate(imported.spec, name)
    net = Network(spec.layers, infer(spec), canonical_weights(model, imported)).eval()
    x = _sample(spec, GRAPHS[name][1], torch.float32)
    with torch.no_grad():
        out = model(x)
        expected, got = getattr(out, "logits", out).numpy(), net(x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_what_the_transformers_import_as():
    layers = _imported("gpt2")[1].spec["layers"]
    assert [layer["type"] for layer in layers[:4]] == ["embedding", "position_embedding", "dropout", "residual"]
    assert layers[3]["layers"][1] == {"type": "attention", "heads": 4, "causal": True, "dropout": 0.1}
    assert layers[4]["layers"][2] == {"type": "gelu", "approximate": True}  # NewGELUActivation, by its values
    assert layers[-1] == {"type": "dense", "units": 64, "use_bias": False}
    encoder = _imported("encoder")[1].spec["layers"]  # post-norm: the norm after each residual block
    assert [layer["type"] for layer in encoder] == ["embedding"] + ["residual", "layernorm"] * 4 + ["dense"]
    assert encoder[1]["layers"] == [{"type": "attention", "heads": 4}]
    patches = _imported("patch_encoder")[1].spec["layers"]
    assert patches[:2] == [{"type": "patches", "size": 4, "dim": 32}, {"type": "position_embedding"}]
    lm, masked = (_imported(name)[1].spec["layers"] for name in ("tiny_causal_lm", "tiny_causal_lm_masked"))
    assert lm == masked  # is_causal=True and an explicit -inf mask above the diagonal are the same spec
    # the dropout SDPA is called with in training (0.05), not the module's `dropout` attribute (0.1: a layer after)
    attention = lm.index({"type": "attention", "heads": 4, "causal": True, "use_bias": False, "dropout": 0.05})
    assert lm[attention + 1] == {"type": "dropout", "rate": 0.1, "name": "attention_dropout"}
    assert patches[2]["layers"][1] == {"type": "attention", "heads": 4, "dropout": 0.1}  # MultiheadAttention's
    assert {"type": "multiply", "inputs": ["silu", "up"]} in lm  # SwiGLU: silu(gate(x)) * up(x)
    assert {"type": "rmsnorm", "name": "norm2"} in lm  # a Llama-style RMSNorm, by its values (epsilon 1e-6)
    assert {"type": "rmsnorm", "epsilon": 1e-5} in lm  # nn.RMSNorm
    assert lm[1] == {"type": "position_embedding", "max_length": 24, "name": "add"}
    llama = _imported("llama")[1].spec["layers"]
    # rotary read from the values: Hugging Face's rotate_half and base 10000, the spec's defaults
    assert llama[2] == {"type": "attention", "heads": 4, "kv_heads": 2, "causal": True, "use_bias": False,
                        "rotary": {}, "name": "model_layers_0_self_attn"}
    rotary = _imported("rotary_lm")[1].spec["layers"][1]["layers"][1]
    assert rotary == {"type": "attention", "heads": 4, "kv_heads": 1, "causal": True, "use_bias": False,
                      "rotary": {"base": 500.0, "pairing": "interleaved"}}  # GPT-J's pairs, SDPA's enable_gqa
    assert _imported("rotary_half")[1].spec["layers"][1]["layers"][1]["rotary"] == {}
    gptj = _imported("gptj")[1].spec["layers"][1]["layers"][1]["projection"][0]  # attention beside the MLP
    assert gptj == {"type": "attention", "heads": 4, "causal": True, "use_bias": False,
                    "rotary": {"pairing": "interleaved"}}
    bert = _imported("bert")[1].spec["layers"]  # the token-type row, then post-norm blocks and the pooler
    assert [layer["type"] for layer in bert[:4]] == ["embedding", "bias", "position_embedding", "layernorm"]
    assert [layer["type"] for layer in bert[-5:]] == ["sequence_pool", "dense", "tanh", "dropout", "dense"]
    assert bert[6] == {"type": "layernorm", "epsilon": 1e-12} and bert[7]["layers"][1] == {"type": "gelu"}


def test_notes_say_what_a_weight_copier_must_know():
    notes = _imported("gpt2")[1].notes
    assert any("'transformer.h.0.attn.c_attn.weight' projects to q, k and v at once" in n for n in notes)
    assert any(n.startswith("transformer.wte.weight and lm_head.weight are one tensor") and "2,048 parameters more"
               in n for n in notes)
    assert _imported("gpt2")[1].shared_parameters == 64 * 32
    bert = _imported("bert")[1]
    assert any(n.startswith("module 'bert.embeddings.token_type_embeddings' (Embedding): takes constant ids (all 0")
               and "the spec's bias holds row 0 of its table; the other 1 row(s) (32 parameters)" in n
               for n in bert.notes)
    assert bert.unused_parameters == 32
    padded = torch.nn.Sequential(torch.nn.Embedding(20, 8, padding_idx=0), torch.nn.Linear(8, 20))
    notes = import_nn_module(padded, (6,)).notes
    assert any("module '0' (Embedding): padding_idx 0: PyTorch's embedding gives that row no gradient" in n
               for n in notes)


@pytest.mark.parametrize("name, one, other", [("gpt2", "query", "key"), ("tiny_causal_lm", "query", "key"),
                                              ("llama", "key", "value")])
def test_the_head_split_is_what_makes_them_equal(name, one, other):
    """Swapping two projections' kernels (a copier that splits a fused projection in the wrong order, or maps
    separate ones to the wrong places; Llama's grouped key and value kernels are narrower than the query's) changes
    the outputs: the check above sees the attention's weights."""
    model, imported = _imported(name)
    weights = canonical_weights(model, imported, np.float64)
    path = next(p for p, layer in _layer_paths(imported.spec["layers"]) if layer["type"] == "attention")
    weights[f"{path}.{one}_kernel"], weights[f"{path}.{other}_kernel"] = \
        weights[f"{path}.{other}_kernel"], weights[f"{path}.{one}_kernel"]
    expected, got = _reference(name, weights)
    assert not np.allclose(got, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["rotary_lm", "llama", "gptj"])
def test_the_rotary_pairing_and_base_are_what_make_them_equal(name):
    """The other pairing, or another base, in the imported spec changes the outputs: the check above sees the
    rotation the importer read."""
    model, imported = _imported(name)
    weights = canonical_weights(model, imported, np.float64)
    expected, _ = _reference(name)
    x = _sample(validate(imported.spec, name), GRAPHS[name][1]).numpy()
    for change in ({"pairing": "half" if name in ("rotary_lm", "gptj") else "interleaved"}, {"base": 1000.0}):
        spec = copy.deepcopy(imported.spec)
        for _, layer in _layer_paths(spec["layers"]):
            if layer["type"] == "attention":
                layer["rotary"] = {**layer["rotary"], **change}
        got = reference.forward(validate(spec, name), weights, x)
        assert not np.allclose(got, expected, rtol=1e-3, atol=1e-3), change


def _layer_paths(layers, prefix=""):
    for index, layer in enumerate(layers):
        yield f"{prefix}{index}", layer
        for key in ("layers", "projection"):
            yield from _layer_paths(layer.get(key) or [], f"{prefix}{index}.{key}.")


# Hugging Face models the spec cannot hold yet: one line each, naming the module
REFUSED = {
    "vit": ["vit: module 'vit.embeddings' (ViTEmbeddings) calls aten.cat (node 'cat', modeling_vit.py:"],
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_spec_cannot_hold_yet_is_one_line_each(name):
    shape = (3, 16, 16) if name == "vit" else (16,)
    with pytest.raises(ImportProblems) as caught:
        import_nn_module(getattr(NATIVE, name)(), shape, target=name)
    lines = caught.value.lines
    assert len(lines) == len(REFUSED[name]), lines
    for line, expected in zip(lines, REFUSED[name]):
        assert line.startswith(expected), line
    if name == "vit":
        assert "concatenates the learned tensor 'vit.embeddings.cls_token' with the data along axis 1 (a class " \
               "token?)" in lines[0]


@pytest.mark.parametrize("name, shape", [("gpt2", "16"), ("mobilenet_v2", "3,16,16")])
def test_a_hugging_face_import_passes_check(tmp_path, capsys, name, shape):
    out = tmp_path / f"{name}.yaml"
    assert main(["import", "torch", f"{HERE / 'native_models.py'}:{name}", "--input-shape", shape, "-o",
                 str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["check", str(out)]) == 0


def test_the_imported_llama_the_frameworks_are_held_to_is_what_the_importer_writes(tmp_path, capsys):
    """tests/specs/imported_llama.yaml (in tox's identity matrix) is the importer's output, as it is."""
    out = tmp_path / "llama.yaml"
    assert main(["import", "torch", f"{HERE / 'native_models.py'}:llama", "--input-shape", "16",
                 "--dataset", "synthetic_tokens", "-o", str(out)]) == 0, capsys.readouterr().err
    kept = yaml.safe_load((ROOT / "tests" / "specs" / "imported_llama.yaml").read_text())
    imported = yaml.safe_load(out.read_text())
    assert {key: value for key, value in kept.items() if key != "description"} == \
        {key: value for key, value in imported.items() if key != "description"}
