"""benchmarks/overhead.py's models without any framework: every MODELS entry loads under its --model name, a spec
with attention goes to the plain transformer networks as the Transformer they build, and a transformer those
networks would build differently from the spec is refused in one line naming its layers."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from harness.model.graph import infer
from harness.model.spec import load_spec
from tests.conftest import ROOT, SPECS


@pytest.fixture(scope="module")
def overhead():
    spec = importlib.util.spec_from_file_location("overhead", ROOT / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["overhead"] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["overhead"]


def test_every_model_loads_under_its_name(overhead):
    names = [overhead.model_name(source) for source, _, _ in overhead.MODELS]
    assert names == ["mnist_mlp", "small_convnet", "transformer_block", "native_encoder"]
    for source, batch_size, input_size in overhead.MODELS:
        spec = load_spec(source).with_overrides(batch_size, None, input_size)
        assert spec.name == overhead.model_name(source)
        if spec.native is None:  # (a native model's shapes are its own code's: torch's env builds it)
            infer(spec)


def test_the_transformer_block_is_what_the_plain_networks_build(overhead):
    spec = load_spec(str(ROOT / "benchmarks" / "transformer_block.yaml"))
    built = overhead._plain_network(spec, infer(spec), stack=lambda *_: "stack", transformer=lambda shape: shape)
    assert built == overhead.Transformer(vocab=256, length=64, dim=64, heads=4, causal=True, hidden=256,
                                         epsilon=1e-5, blocks=1, outputs=256)
    assert overhead._transformer(load_spec("tiny_gpt")).blocks == 2


def test_a_stack_of_layers_goes_to_the_stack(overhead):
    spec = load_spec("mnist_mlp")
    assert overhead._plain_network(spec, infer(spec), stack=lambda *_: "stack", transformer=None) == "stack"


def test_a_transformer_built_otherwise_is_refused_naming_its_layers(overhead):
    with pytest.raises(SystemExit) as exc:  # rmsnorm before the MLP, attention dropout
        overhead._transformer(load_spec(str(SPECS / "pitfall_pre_norm.yaml")))
    assert str(exc.value) == ("pitfall_pre_norm: layers[5:]: the plain transformer loops here need a final "
                              "layernorm and a dense head with a bias")
    data = load_spec(str(ROOT / "benchmarks" / "transformer_block.yaml")).model_dump()
    data["layers"][2]["layers"][1]["dropout"] = 0.1
    from harness.model.spec import validate

    with pytest.raises(SystemExit, match=r"^transformer_block: layers\[2:4\]: .*attention without dropout"):
        overhead._transformer(validate(data, "transformer_block"))
