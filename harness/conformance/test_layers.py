"""Layer builders: the adapter builds every layer type the spec defines, each by one builder registered with the
core's registry (harness.model.layers.LayerBuilders; docs/plugins.md, "Adding a layer type")."""
from __future__ import annotations

from harness.conformance.specs import SPECS
from harness.conformance.test_contract import build
from harness.model import layers
from harness.model.spec import LAYER_TYPES


def test_every_spec_layer_type_has_a_builder(adapter):
    # building a trainer imports the adapter's network module, which registers its builders
    build(adapter, SPECS["mnist_mlp"] if "mnist_mlp" in SPECS else next(iter(SPECS.values())))
    registry = layers.builders(adapter.name)
    assert registry is not None, (
        f"the {adapter.name} adapter registers no layer builders: build its network with a "
        f"harness.model.layers.LayerBuilders('{adapter.name}') and one @LAYERS.builder(type) per spec layer type")
    assert not registry.missing(), (
        f"the {adapter.name} adapter has no builder for layer type(s) {', '.join(registry.missing())} "
        f"(the spec defines {', '.join(LAYER_TYPES)}): register one with @LAYERS.builder(type)")
