"""harness.model.layers: the registry every adapter builds its network with."""
from __future__ import annotations

import pytest

from harness.errors import HarnessError
from harness.model import layers
from harness.model.graph import infer
from harness.model.spec import LAYER_TYPES, load_spec


@pytest.fixture
def registry():
    registry = layers.LayerBuilders("test-framework")
    yield registry
    del layers._REGISTRIES["test-framework"]


def test_a_builder_takes_the_layer_info_and_the_network(registry):
    @registry.builder("dense", "relu")
    def build(info, net):
        return (info.type, info.path, net)

    dense = next(info for info in infer(load_spec("mnist_mlp")).layers if info.type == "dense")
    assert registry.build(dense, "the network") == ("dense", dense.path, "the network")
    assert registry.types() == ["dense", "relu"]
    assert registry.missing() == [t for t in LAYER_TYPES if t not in ("dense", "relu")]
    assert layers.builders("test-framework") is registry


def test_a_type_without_a_builder_is_one_line_naming_it(registry):
    registry.builder("dense")(lambda info, net: None)
    conv = next(info for info in infer(load_spec("small_convnet")).layers if info.type == "conv2d")
    with pytest.raises(HarnessError, match=r"^the test-framework adapter has no builder for layer type 'conv2d' "
                                           r"\(layer \d+\); it builds: dense$"):
        registry.build(conv, None)


def test_a_builder_names_a_spec_layer_type_once(registry):
    with pytest.raises(HarnessError, match="'dens' is not a spec layer type"):
        registry.builder("dens")
    registry.builder("dense")(lambda info, net: None)
    with pytest.raises(HarnessError, match="two builders for layer type 'dense'"):
        registry.builder("dense")
    with pytest.raises(HarnessError, match="two layer-builder registries"):
        layers.LayerBuilders("test-framework")
