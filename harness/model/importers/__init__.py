"""Importers: another framework's model into a spec (`amp-harness import FRAMEWORK MODEL`).

The Keras importer (keras.py) reads Keras's own serialised configuration as data (JSON, a zip's member) and never
imports the framework. An importer that must run the framework to read a model (PyTorch's: a Python module traced
by torch.fx) lives in that framework's adapter, behind the optional hook `harness.adapter.Adapter.import_model`,
and uses the pieces here. What the spec cannot express is refused, one line per problem naming the layer and the
field (ImportProblems); what it leaves out on purpose (initialisers: the core draws every weight) is a note. The
result is a spec that `amp-harness check` accepts, plus, per canonical layer path, the framework layer it came from
(what a weight copier needs).

Shared by every importer: the result (Imported) and its YAML (to_yaml), the options (ImportOptions), the defaults
where a model says nothing (DEFAULT_BATCH_SIZE, DEFAULT_STEPS, default_loss, dataset), the walk of a chain with
residual adds (Chain) and the final check (finish).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import yaml

from harness.errors import HarnessError, SpecError, clip

DEFAULT_BATCH_SIZE, DEFAULT_STEPS = 32, 100  # Keras fit's default batch; a short run (no model file says either)
DATASETS = "synthetic, digits, image_folder:PATH, text[:PATH] or synthetic_tokens"


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
    #: canonical layer path -> the channels-first [C, H, W] whose flatten (in C, H, W order) its input features
    #: follow, where the framework flattens channels-first (PyTorch): the spec flattens in H, W, C order, so a
    #: weight copier permutes that layer's input rows (dense) or features (batchnorm, layernorm)
    flattened: dict[str, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ImportOptions:
    """What `amp-harness import` takes beside the model: the spec's dataset (--dataset, DATASETS), batch size and
    steps (None: the defaults, with a note)."""

    dataset: str | None = None
    batch_size: int | None = None
    steps: int | None = None


class Problem(Exception):
    """One thing the spec cannot express: (the framework's field, what is wrong)."""

    def __init__(self, key: str, why: str):
        super().__init__(f"{key}: {why}")


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


# ---- defaults where the model says nothing ------------------------------------------------------------------
def outputs(layers: list[dict]) -> tuple[int | None, str | None]:
    """The last dense's units and the layer after it (an activation), at the top level."""
    for i in range(len(layers) - 1, -1, -1):
        if layers[i]["type"] == "dense":
            after = [layer["type"] for layer in layers[i + 1:]]
            return layers[i]["units"], after[-1] if after else None
    return None, None


def default_loss(layers: list[dict]) -> tuple[dict, str]:
    """The loss that follows from the output, and what it followed from (for a note): a dense of 1 unit is binary
    cross-entropy, any other sparse categorical; a sigmoid or softmax at the end means probabilities."""
    units, last = outputs(layers)
    loss = {"type": "binary_crossentropy" if units == 1 else "sparse_categorical_crossentropy",
            "from_logits": last not in ("sigmoid", "softmax")}
    return loss, (f"loss {loss['type']} from_logits {str(loss['from_logits']).lower()} (the model ends in "
                  f"{'a dense' if last is None else last} of {units} units)")


def dataset(option: str | None, input_: dict, layers: list[dict], loss: dict, notes: list[str]) -> dict:
    """The spec's dataset from --dataset (None: synthetic data of the model's input and classes, with a note)."""
    units, _ = outputs(layers)
    binary = loss["type"] == "binary_crossentropy"
    classes = 2 if binary else units
    tokens = "vocab" in input_
    next_token = tokens and not any(layer["type"] in ("sequence_pool", "flatten") for layer in layers)
    name, _, path = (option or "").partition(":")
    if option is None:
        name = "synthetic_tokens" if tokens else "synthetic"
        what = "next-token prediction" if next_token else f"{classes} classes " + \
            ("(binary: a dense of 1 unit)" if binary else "(the last dense's units)")
        notes.append(f"dataset {name} with input {input_['shape']} and {what}; --dataset chooses another "
                     f"({DATASETS})")
    if name == "synthetic" and tokens:
        name = "synthetic_tokens"
    if name not in ("synthetic", "digits", "image_folder", "text", "synthetic_tokens") or \
            (name == "image_folder" and not path) or (path and name not in ("image_folder", "text")):
        raise HarnessError(f"--dataset {clip(option, 60)}: expected {DATASETS}")
    out: dict = {"name": name}
    if path:
        out["path"] = path
    if name != "text" and not next_token:
        out["num_classes"] = classes
    return out


# ---- the result ---------------------------------------------------------------------------------------------
def untag(layers: list[dict], prefix: str, tags: dict[str, dict[str, object]]) -> list[dict]:
    """The layers without their tags (keys starting with "_": `_source`, the framework layer's name, and any other
    an importer adds), which go into tags[key][canonical path]."""
    out = []
    for index, layer in enumerate(layers):
        path = f"{prefix}{index}"
        layer = dict(layer)
        for key in [k for k in layer if k.startswith("_")]:
            tags.setdefault(key, {})[path] = layer.pop(key)
        for key in ("layers", "projection"):
            if key in layer:
                layer[key] = untag(layer[key], f"{path}.{key}.", tags)
        out.append(layer)
    return out


def named(message: str, sources: dict[str, str], what: str) -> str:
    """A spec error with the framework layer its place came from ("(the Keras layer 'dense_1')")."""
    found = re.search(r"layers((?:\[\d+\](?:\.(?:layers|projection))?)+)", message)
    if found:
        path = ".".join(re.findall(r"\d+|layers|projection", found.group(1)))
        if sources.get(path):
            return f"{message} ({what} '{sources[path]}')"
    return message


def finish(spec: dict, sources: dict[str, str], source: str, what: str) -> dict:
    """`spec` checked as `amp-harness check` checks it (so that the file written passes it), its layers written
    without the spec's defaults; ImportProblems (one line, naming the framework layer: `what`) otherwise."""
    from harness.model import data
    from harness.model.graph import infer
    from harness.model.spec import validate

    try:
        checked = validate(spec, f"{source} (imported)")
        infer(checked, f"{source} (imported)")
        data.check(checked, f"{source} (imported)")
    except HarnessError as exc:
        raise ImportProblems([named(str(exc), sources, what)]) from None
    return {**spec, "layers": [_readable(layer.model_dump(exclude_defaults=True)) for layer in checked.layers]}


def _readable(layer: dict) -> dict:
    """A layer's fields as a spec is written: its type first, its hyper-parameters, then its wiring (the name of its
    output, the tensors it takes)."""
    wiring = ("name", "input", "inputs")
    out = {"type": layer["type"], **{k: v for k, v in layer.items() if k not in ("type", *wiring)}}
    for key in ("layers", "projection"):
        if key in out:
            out[key] = [_readable(inner) for inner in out[key]]
    return out | {k: layer[k] for k in wiring if k in layer}


# ---- a graph's named tensors ---------------------------------------------------------------------------------
def name_tensors(layers: list[dict], outputs: dict[str, int], labels: dict[str, str], start: str) -> list[dict]:
    """A graph's layers with their named tensors written (harness.model.spec, "named tensors"): `layers` name the
    nodes they take (`input`, `inputs`) by the importer's keys; `outputs` gives the index of the layer whose output
    each node is; `labels` (in the order names are given) a readable label of each node a later layer takes, which
    becomes its tensor name (letters, digits and _, not starting with a digit, never `input`, unique) on the layer
    giving it; the model's input (`start`) is `input`."""
    names: dict[str, str] = {}
    for node, label in labels.items():
        base = re.sub(r"\W", "_", label)
        base = f"_{base}" if not base or base[0].isdigit() or base == "input" else base
        name, n = base, 1
        while name in names.values():
            n += 1
            name = f"{base}_{n}"
        names[node] = name
    for node, index in outputs.items():
        if node in names:
            layers[index]["name"] = names[node]
    rename = {**names, start: "input"}
    for layer in layers:
        if "input" in layer:
            layer["input"] = rename[layer["input"]]
        if "inputs" in layer:
            layer["inputs"] = [rename[name] for name in layer["inputs"]]
    return layers


# ---- a chain with residual adds -----------------------------------------------------------------------------
class Stop(Exception):
    """The walk met a problem, already reported."""


class Chain:
    """A model's graph read back from the output: single-input layers, and adds whose two branches meet at a fork,
    the nearest tensor every path to both passes through (a residual block: main branch, then identity or
    projection). An importer subclasses it with its nodes (by name) and the hooks below."""

    join = "Add"  # what joins branches, in the framework's words ("only Add joins branches in the spec")

    def __init__(self, nodes: dict[str, object], start: str, source: str):
        self.nodes, self.start, self.source = nodes, start, source
        self.visited: set[str] = set()
        self._spines: dict[str, list[str]] = {}

    # -- the importer's hooks --------------------------------------------------------------------------------
    def is_add(self, node) -> bool:
        raise NotImplementedError

    def inputs(self, node) -> list[str]:
        """The names of the tensors a node takes, in argument order."""
        raise NotImplementedError

    def before(self, node) -> str:
        """The one tensor a layer node takes (Problem: it takes several)."""
        inputs = self.inputs(node)
        if len(set(inputs)) != 1:
            raise Problem("inputs", f"takes {len(set(inputs))} tensors: only {self.join} joins branches in the spec")
        return inputs[0]

    def missing(self, name: str) -> str:
        """Why a node's input `name` is not in the graph."""
        return f"takes '{clip(name, 40)}', which the model does not hold"

    def convert(self, node, first: bool) -> list[dict]:
        """The spec's layers for a layer node, each tagged `_source`; problems reported, not raised."""
        raise NotImplementedError

    def problem(self, node, message: str) -> None:
        raise NotImplementedError

    def name(self, node) -> str:
        return node.name

    # -- the walk ---------------------------------------------------------------------------------------------
    def step(self, name: str) -> str:
        """The tensor before `name` on every path back to the input (Stop: a problem, reported)."""
        node = self.nodes[name]
        try:
            if self.is_add(node):
                inputs = self.inputs(node)
                if len(inputs) != 2:
                    raise Problem("inputs", f"an {self.join} of {len(inputs)} tensors: a residual adds two")
                missing = [name for name in inputs if name not in self.nodes]
                if missing:
                    raise Problem("inputs", self.missing(missing[0]))
                return self.fork(*inputs)
            before = self.before(node)
            if before not in self.nodes:
                raise Problem("inputs", self.missing(before))
            return before
        except Problem as exc:
            self.problem(node, str(exc))
            raise Stop from None

    def spine(self, name: str) -> list[str]:
        if name not in self._spines:
            out, current = [name], name
            while current != self.start:
                current = self.step(current)
                out.append(current)
            self._spines[name] = out
        return self._spines[name]

    def fork(self, a: str, b: str) -> str:
        on_b = set(self.spine(b))
        return next(t for t in self.spine(a) if t in on_b)  # the input is on both

    def walk(self, end: str, stop: str) -> list[dict]:
        """The spec's layers computing `end` from `stop`."""
        out: list[dict] = []
        current = end
        while current != stop:
            node = self.nodes.get(current)
            if node is None or current == self.start:
                raise ImportProblems([f"{self.source}: the graph is not a chain: '{clip(current, 40)}' does not lead "
                                      f"back to '{clip(stop, 40)}'"])
            if self.name(node) in self.visited:
                self.problem(node, "on two paths: only residual adds join the chain")
                return out
            self.visited.add(self.name(node))
            try:
                before = self.step(current)
            except Stop:
                return out
            if self.is_add(node):
                out[:0] = [self.block(node, before)]
            else:
                out[:0] = self.convert(node, before == self.start)
            current = before
        return out

    def block(self, node, fork: str) -> dict:
        branches = [self.walk(name, fork) for name in self.inputs(node)]
        main, shortcut = branches
        # the identity side is the shortcut; of two branches the longer is the main path (ties: the first)
        if not main or (shortcut and len(shortcut) > len(main)):
            main, shortcut = shortcut, main
        if not main:
            self.problem(node, "adds a tensor to itself: not a residual block")
        block = {"type": "residual", "layers": main, "_source": self.name(node)}
        return block | ({"projection": shortcut} if shortcut else {})
