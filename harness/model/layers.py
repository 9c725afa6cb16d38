"""How every adapter builds the spec's network: a registry of layer builders, one per spec layer type.

Each adapter's network.py holds one `LayerBuilders` and registers a builder for each type the spec defines
(harness.model.spec.LAYER_TYPES):

    LAYERS = LayerBuilders("torch")

    @LAYERS.builder("dense")
    def dense(info: LayerInfo, net: Network):
        ...

A builder takes the layer's LayerInfo (its canonical path, shapes and parameter shapes from harness.model.graph;
`info.spec` is the spec's layer, with its hyper-parameters) and the adapter's network under construction (what
the adapter's layers need of it: the canonical weights, the compute dtype, `net.build(layers, prefix)` for a
residual block's inner layers), and returns the framework's layer: whatever the network then calls. The shape is
the same in every adapter, so a new layer type is the core's definition (spec.py, graph.py) plus one builder per
adapter (docs/plugins.md, "Adding a layer type"); the conformance kit checks that each adapter builds every type
(harness/conformance/test_layers.py).
"""
from __future__ import annotations

from typing import Callable

from harness.errors import HarnessError
from harness.model.spec import LAYER_TYPES, MERGE_TYPES

_REGISTRIES: dict[str, "LayerBuilders"] = {}  # by framework: filled when an adapter's network module is imported


class LayerBuilders:
    """One adapter's builders, by spec layer type."""

    def __init__(self, framework: str):
        if framework in _REGISTRIES:
            raise HarnessError(f"two layer-builder registries for framework '{framework}'")
        self.framework = framework
        self._builders: dict[str, Callable] = {}
        _REGISTRIES[framework] = self

    def builder(self, *types: str):
        """Register the decorated function (or class) as the builder of these spec layer types."""
        for t in types:
            if t not in LAYER_TYPES:  # a typo would otherwise leave the real type without a builder, silently
                raise HarnessError(f"{self.framework}: '{t}' is not a spec layer type ({', '.join(LAYER_TYPES)})")
            if t in self._builders:
                raise HarnessError(f"{self.framework}: two builders for layer type '{t}'")

        def register(build: Callable) -> Callable:
            self._builders.update(dict.fromkeys(types, build))
            return build

        return register

    def build(self, info, net):
        """The framework's layer for `info` (a LayerInfo), by its type's builder."""
        build = self._builders.get(info.type)
        if build is None:
            raise HarnessError(f"the {self.framework} adapter has no builder for layer type '{info.type}' "
                               f"(layer {info.path}); it builds: {', '.join(self.types())}")
        return build(info, net)

    def types(self) -> list[str]:
        """The layer types this adapter builds, in the spec's order."""
        return [t for t in LAYER_TYPES if t in self._builders]

    def missing(self) -> list[str]:
        """The spec's layer types this adapter does not build."""
        return [t for t in LAYER_TYPES if t not in self._builders]


def builders(framework: str) -> LayerBuilders | None:
    """The framework's registry, once its network module is imported (building a trainer imports it); None if it
    registers none."""
    return _REGISTRIES.get(framework)


def run_list(items, x, call):
    """A list's layers applied as the spec wires them (harness.model.spec, "named tensors"; LayerInfo.sources):
    `items` (LayerInfo, the framework's layer) in the list's order, `x` the list's input; `call(info, layer, value)`
    gives a layer's output, `value` being its input, or a merge's list of inputs. Returns the last layer's output."""
    last_use = {source: index for index, (info, _) in enumerate(items) for source in info.sources}
    outputs: dict[int, object] = {}  # each layer's output until the last layer that takes it
    for index, (info, layer) in enumerate(items):
        values = [x if source < 0 else outputs[source] for source in info.sources]
        outputs[index] = call(info, layer, values if info.type in MERGE_TYPES else values[0])
        for source in set(info.sources):
            if source >= 0 and last_use[source] == index:
                del outputs[source]
    return outputs[len(items) - 1]


def aligned_shape(shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """A merge input's per-sample canonical shape with ones before it up to `rank` (the merge's output's), as numpy
    broadcasting aligns it: a [C] gate against an [H, W, C] image is [1, 1, C] (channels-first frameworks then
    move its last axis first, as their activations are laid out)."""
    return (1,) * (rank - len(shape)) + tuple(shape)
