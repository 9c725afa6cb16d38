"""The rules for a native model (a spec with `native:`, the user's own network object) that every adapter follows,
written once: what its output must look like for the spec's loss and dataset, which of its weights AdamW decays,
and what training keeps of its weights. The framework's worker loads the model (never this process: a user's
module may import anything); the adapter reports its weights' names, shapes and modules, the core decides.
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.model.graph import LayerInfo

#: the `native` kind -> a word for the object it names, for messages
OBJECTS = {"torch": "a torch.nn.Module", "keras": "a Keras model"}


def expected_output(spec, n: int) -> tuple[int, ...]:
    """The output shape the spec's loss takes for `n` samples: [N, classes] (sparse categorical cross-entropy),
    [N, T, vocab] (next-token prediction) or [N, 1] (binary cross-entropy)."""
    if spec.loss.type == "binary_crossentropy":
        return (n, 1)
    if spec.dataset.next_token:
        return (n, spec.input.shape[0], spec.classes)
    return (n, spec.classes)


def output_problem(spec, shape: tuple[int, ...]) -> str | None:
    """Why a native model's output of this shape (for 2 samples) does not fit the spec's loss and dataset; None
    when it fits."""
    expected = expected_output(spec, 2)
    if tuple(shape) == expected:
        return None
    what = "one logit per sample" if spec.loss.type == "binary_crossentropy" else \
        f"logits over the vocabulary ({spec.classes}) at every position" if spec.dataset.next_token else \
        f"logits over its {spec.classes} classes"
    return f"its output for 2 samples is {list(shape)}; {spec.loss.type} on {spec.dataset.name} needs {list(expected)} " \
           f"({what})"


def weight_kind(name: str, ndim: int, in_embedding: bool) -> str:
    """A native weight's kind, as harness.model.weights.weight_kind names a spec's (the kinds AdamW's `no_decay`
    exempts: harness.model.optimizer): a bias, an embedding table, a norm's scale (a one-axis weight that is not a
    bias), else a kernel. `in_embedding`: its module is the framework's embedding layer."""
    if name.rsplit(".", 1)[-1].endswith("bias"):
        return "bias"
    if in_embedding:
        return "embeddings"
    return "gamma" if ndim == 1 else "kernel"


def describe(spec) -> str:
    """One line for `amp-harness check`."""
    native = spec.native
    return (f"native {native.kind} model {native.target} ({OBJECTS[native.kind]}), run by the {native.framework} "
            f"adapter, which counts its parameters when it builds it; its FLOPs are not counted (a spec's layers "
            f"are)")



@dataclass(frozen=True)
class Modules:
    """A native model's layers for numerics and the first-inf locator, with a spec Graph's interface: its modules by
    their own names (`transformer.h.0.attn`) and classes, in the order the framework lists them."""
    modules: dict[str, str]  # name -> class (NativeInfo.modules)

    @property
    def layers(self) -> list[LayerInfo]:
        return [LayerInfo(name, kind, (), ()) for name, kind in self.modules.items()]

    @property
    def types(self) -> dict[str, str]:
        return dict(self.modules)

    #: a module's input is whatever its parent's code passes it: not known (Graph.input_of knows a layer's)
    inputs_known = False

    @staticmethod
    def forward_order(paths) -> list[str]:
        """As captured: a layer's output is recorded when its forward returns, so the capture's order is the order
        the forward pass finished computing them in (a module after the modules it calls)."""
        return list(paths)

    def weight_order(self, names) -> list[str]:
        """Weight names by their modules' order in the model, then by name."""
        index = {name: i for i, name in enumerate(self.modules)}
        return sorted(names, key=lambda name: (index.get(name.rsplit(".", 1)[0], len(index)), name))
