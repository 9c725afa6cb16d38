"""Importers: another framework's saved model description into a spec (`amp-harness import FRAMEWORK MODEL`).

An importer reads the framework's own serialised configuration as data (JSON, a zip's member) and never imports
the framework. What the spec cannot express is refused, one line per problem naming the layer and the field
(ImportProblems); what it leaves out on purpose (initialisers: the core draws every weight) is a note. The result
is a spec that `amp-harness check` accepts, plus, per canonical layer path, the framework layer it came from (what
a weight copier needs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from harness.errors import SpecError


class ImportProblems(SpecError):
    """Everything the spec cannot express in one model: one line per problem."""

    def __init__(self, lines: list[str]):
        super().__init__(lines[0] if len(lines) == 1 else f"{lines[0]} (and {len(lines) - 1} more)")
        self.lines = lines


@dataclass
class Imported:
    spec: dict  # a valid spec (harness.model.spec.validate and graph.infer passed), as plain data
    notes: list[str] = field(default_factory=list)  # what was assumed or dropped: one line each, for stderr
    sources: dict[str, str] = field(default_factory=dict)  # canonical layer path -> the framework layer's name


def _flow(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()
    return text.removesuffix("\n...")  # a plain scalar's document end marker


def _layers_yaml(layers: list[dict], indent: str) -> list[str]:
    lines = []
    for layer in layers:
        nested = {k: v for k, v in layer.items() if k in ("layers", "projection")}
        if not nested:
            lines.append(f"{indent}- {_flow(layer)}")
            continue
        lines.append(f"{indent}- type: {layer['type']}")
        for key, inner in nested.items():
            lines.append(f"{indent}  {key}:")
            lines += _layers_yaml(inner, indent + "    ")
    return lines


def to_yaml(spec: dict) -> str:
    """A spec as the built-in models are written (models/*.yaml): one line per layer, residual blocks nested."""
    lines = []
    for key, value in spec.items():
        if key == "layers":
            lines += ["layers:", *_layers_yaml(value, "  ")]
        elif key == "description":
            lines.append(f"description: {_flow(value)}")
        else:
            lines.append(f"{key}: {_flow(value)}")
    return "\n".join(lines) + "\n"
