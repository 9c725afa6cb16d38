"""`amp-harness import keras MODEL`: a Keras model's JSON configuration (`model.to_json()`, or a `.keras` file's
`config.json`) into a spec, read as data: Keras is never imported.

What maps: a Sequential model, or a functional one: a chain with residual adds (an Add of the chain's output and an
earlier tensor, either directly or through a projection branch) becomes residual blocks; any other graph of
single-input layers and merges (Add, Multiply, Concatenate on the channel axis) is written with named tensors
(harness.model.spec), in the model's own layer order; the layers in LAYERS below, each Keras option either copied into the spec's field or held to the one value the spec's math has (FIXED);
`activation=` arguments become the spec's activation layer after the layer; the compile configuration (Keras 3's
`compile_config`, Keras 2's `training_config`) gives the loss and the optimizer (LOSSES, OPTIMIZERS). Keras 3 and
Keras 2.11+'s RMSprop put epsilon inside the square root, Keras 2's legacy one (TF <= 2.10 without momentum)
outside it (tf.keras optimizer_v2/rmsprop.py: `var - lr * grad / (sqrt(rms) + epsilon)`).

What does not map is one line per problem naming the layer (its index in `model.layers` and its name) and the
field; initialisers are dropped with a note (the core draws every weight: harness.model.weights).
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from harness.errors import HarnessError, clip
from harness.model.importers import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_STEPS,
    Chain,
    Imported,
    ImportProblems,
    Problem,
    dataset as choose_dataset,
    default_loss,
    finish,
    name_tensors,
    untag,
)

MAX_CONFIG_BYTES = 16 << 20  # a model's configuration is KiBs; a .keras file's weights are not read


# ---- the layer table ----------------------------------------------------------------------------------------
def _one(key: str, what: str = "size") -> Callable[[dict], int | None]:
    """A window field the spec takes as one number: Keras's [a, a] (or a) -> a."""
    def read(config: dict):
        value = config.get(key)
        if value is None or isinstance(value, int):
            return value
        if isinstance(value, list) and value and all(v == value[0] for v in value) and isinstance(value[0], int):
            return value[0]
        raise Problem(f"{key} {_show(value)}", f"not square; the spec takes one {what} for height and width")
    return read


def _pads(value) -> int | list[int]:
    """ZeroPadding2D's padding (a, (h, w) or ((top, bottom), (left, right))) as the spec's zero_pad2d takes it."""
    if isinstance(value, int):
        return value
    if isinstance(value, list) and len(value) == 2:
        if all(isinstance(v, int) for v in value):
            return [value[0], value[0], value[1], value[1]]
        if all(isinstance(v, list) and len(v) == 2 and all(isinstance(n, int) for n in v) for v in value):
            return [*value[0], *value[1]]
    raise Problem(f"padding {_show(value)}", "expected a, (h, w) or ((top, bottom), (left, right))")


def _copy(key: str) -> Callable[[dict], object]:
    return lambda config: config.get(key)


def _const(value) -> Callable[[dict], object]:
    return lambda config: value


@dataclass(frozen=True)
class Rule:
    type: str  # the spec's layer type
    fields: dict[str, Callable[[dict], object]] = field(default_factory=dict)  # spec field <- the Keras config
    fixed: dict[str, tuple] = field(default_factory=dict)  # Keras option -> the values the spec's math has
    activation: bool = False  # takes `activation=`: the spec's activation layer follows
    read: tuple[str, ...] = ()  # Keras options the fields read (anything else must hold its neutral value)


CHANNELS_LAST = {"data_format": ("channels_last", None)}
WINDOW = {"pool_size": _one("pool_size"), "strides": _one("strides", "stride"), "padding": _copy("padding")}
NORM = {"center": (True,), "scale": (True,)}
LAST_AXIS = (-1, [-1])

LAYERS: dict[str, Rule] = {
    "Dense": Rule("dense", {"units": _copy("units"), "use_bias": _copy("use_bias")}, activation=True,
                  read=("units", "use_bias")),
    "Conv2D": Rule("conv2d", {"filters": _copy("filters"), "kernel_size": _one("kernel_size", "kernel size"),
                              "strides": _one("strides", "stride"), "padding": _copy("padding"),
                              "use_bias": _copy("use_bias"), "groups": _copy("groups"),
                              "dilation": _one("dilation_rate", "dilation")},
                   CHANNELS_LAST, activation=True,
                   read=("filters", "kernel_size", "strides", "padding", "use_bias", "groups", "dilation_rate")),
    # the spec's conv2d with groups = the input's channels (KerasImporter.convert sets them and the filters)
    "DepthwiseConv2D": Rule("conv2d", {"kernel_size": _one("kernel_size", "kernel size"),
                                       "strides": _one("strides", "stride"), "padding": _copy("padding"),
                                       "use_bias": _copy("use_bias"), "dilation": _one("dilation_rate", "dilation")},
                            CHANNELS_LAST, activation=True,
                            read=("kernel_size", "strides", "padding", "use_bias", "depth_multiplier",
                                  "dilation_rate")),
    "ZeroPadding2D": Rule("zero_pad2d", {"padding": lambda config: _pads(config.get("padding"))}, CHANNELS_LAST,
                          read=("padding",)),
    "Rescaling": Rule("rescaling", {"scale": _copy("scale"), "offset": _copy("offset")}, read=("scale", "offset")),
    # (x - mean) / max(sqrt(variance), 1e-7): a rescaling (KerasImporter.convert computes it)
    "Normalization": Rule("rescaling", fixed={"axis": (*LAST_AXIS, 3, [3]), "invert": (False,)},
                          read=("mean", "variance")),
    "MaxPooling2D": Rule("maxpool2d", WINDOW, CHANNELS_LAST, read=tuple(WINDOW)),
    "AveragePooling2D": Rule("avgpool2d", WINDOW, CHANNELS_LAST, read=tuple(WINDOW)),
    "GlobalAveragePooling2D": Rule("global_avgpool2d", {"keepdims": _copy("keepdims")}, CHANNELS_LAST,
                                   read=("keepdims",)),
    "GlobalMaxPooling2D": Rule("global_maxpool2d", {"keepdims": _copy("keepdims")}, CHANNELS_LAST,
                               read=("keepdims",)),
    "GlobalAveragePooling1D": Rule("sequence_pool", {"mode": _const("mean")},
                                   {**CHANNELS_LAST, "keepdims": (False,)}),
    "Flatten": Rule("flatten", fixed=CHANNELS_LAST),
    "BatchNormalization": Rule("batchnorm", {"momentum": _copy("momentum"), "epsilon": _copy("epsilon")},
                               {**NORM, "axis": (*LAST_AXIS, 3, [3]), "renorm": (False,)},
                               read=("momentum", "epsilon", "renorm_momentum", "synchronized")),
    "LayerNormalization": Rule("layernorm", {"epsilon": _copy("epsilon")},
                               {**NORM, "axis": LAST_AXIS, "rms_scaling": (False,)}, read=("epsilon",)),
    "RMSNormalization": Rule("rmsnorm", {"epsilon": _copy("epsilon")}, {"axis": LAST_AXIS}, read=("epsilon",)),
    # noise_shape (None, 1, ...): one draw per sample (EfficientNet's stochastic depth), the spec's per_sample
    "Dropout": Rule("dropout", {"rate": _copy("rate"), "per_sample": lambda c: bool(c.get("noise_shape"))},
                    {"noise_shape": (None, *([None] + [1] * n for n in (1, 2, 3)))}, read=("rate",)),
    "Embedding": Rule("embedding", {"dim": _copy("output_dim")}, {"mask_zero": (False,)},
                      read=("input_dim", "output_dim", "input_length")),
    "MultiHeadAttention": Rule("attention", {"heads": _copy("num_heads"), "dropout": _copy("dropout"),
                                             "use_bias": _copy("use_bias")},
                               {"output_shape": (None,), "attention_axes": (None, 1, [1]), "use_gate": (False,)},
                               read=("num_heads", "key_dim", "value_dim", "dropout", "use_bias")),
    "Activation": Rule("", activation=True),  # only its activation
    "ReLU": Rule("relu", fixed={"max_value": (None, 6, 6.0), "negative_slope": (0, 0.0), "threshold": (0, 0.0)}),
    "Softmax": Rule("softmax", fixed={"axis": LAST_AXIS}),
}
ACTIVATIONS: dict[str | None, list[dict]] = {  # Keras's activation name -> the spec's layers
    None: [], "linear": [], "relu": [{"type": "relu"}], "sigmoid": [{"type": "sigmoid"}],
    "tanh": [{"type": "tanh"}], "softmax": [{"type": "softmax"}],
    "gelu": [{"type": "gelu"}],  # keras.activations.gelu: approximate=False, the erf form, the spec's default
    "relu6": [{"type": "relu6"}], "swish": [{"type": "silu"}], "silu": [{"type": "silu"}],
    "hard_swish": [{"type": "hard_swish"}], "hard_silu": [{"type": "hard_swish"}],
}
MERGES = {"Add": "add", "Multiply": "multiply", "Concatenate": "concat"}  # Keras class -> the spec's merge
GENERIC = ("name", "trainable", "dtype", "seed", "activation", "build_config")  # options every layer has

# ---- losses and optimizers ----------------------------------------------------------------------------------
LOSSES = {"binary_crossentropy": "binary_crossentropy", "BinaryCrossentropy": "binary_crossentropy",
          "sparse_categorical_crossentropy": "sparse_categorical_crossentropy",
          "SparseCategoricalCrossentropy": "sparse_categorical_crossentropy"}
LOSS_FIXED = {"label_smoothing": (0, 0.0), "ignore_class": (None,), "axis": (-1,),
              "reduction": ("sum_over_batch_size", "auto", None)}
# Keras class -> (the spec's type, the Keras defaults of the fields the spec takes)
OPTIMIZERS = {
    "SGD": ("sgd", {"learning_rate": 0.01, "momentum": 0.0, "nesterov": False}),
    "Adam": ("adam", {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}),
    "AdamW": ("adamw", {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7,
                        "weight_decay": 0.004}),
    "RMSprop": ("rmsprop", {"learning_rate": 0.001, "rho": 0.9, "epsilon": 1e-7}),
}
OPTIMIZER_FIXED = {"clipnorm": (None,), "clipvalue": (None,), "use_ema": (False,), "loss_scale_factor": (None,),
                   "gradient_accumulation_steps": (None, 1), "amsgrad": (False,), "centered": (False,),
                   "decay": (0, 0.0), "momentum": (0, 0.0)}  # momentum: RMSprop's (SGD reads its own)
OPTIMIZER_IGNORED = ("name", "ema_momentum", "ema_overwrite_frequency", "jit_compile", "is_legacy_optimizer",
                     "global_clipnorm", "weight_decay", "lr")


def _show(value) -> str:
    return clip(json.dumps(value), 40)


def _f32(value):
    """A hyper-parameter Keras kept in float32 (9.999999747378752e-05) as written (0.0001); others unchanged."""
    if isinstance(value, float) and float(np.float32(value)) == value:
        short = float(str(np.float32(value)))
        return short if float(np.float32(short)) == value else value
    return value


def _class(obj) -> tuple[str | None, dict]:
    """(class name, config) of a serialised object or a plain name; Keras 3 writes functions as
    {class_name: function, config: NAME}."""
    if isinstance(obj, str):
        return obj, {}
    if isinstance(obj, dict):
        name, config = obj.get("class_name"), obj.get("config")
        if name == "function" and isinstance(config, str):
            return config, {}
        return name, config if isinstance(config, dict) else {}
    return None, {}


# ---- reading ------------------------------------------------------------------------------------------------
def read_config(path: Path) -> dict:
    """The model's configuration from a JSON file or a .keras zip's config.json; HarnessError in one line."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                try:
                    info = archive.getinfo("config.json")
                except KeyError:
                    raise HarnessError(f"{path}: a zip without config.json: not a .keras file") from None
                if info.file_size > MAX_CONFIG_BYTES:
                    raise HarnessError(f"{path}: config.json is larger than {MAX_CONFIG_BYTES >> 20} MiB")
                raw = archive.read(info)
        else:
            with open(path, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
            if len(raw) > MAX_CONFIG_BYTES:
                raise HarnessError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB: not a model's JSON")
    except OSError as exc:
        raise HarnessError(f"{clip(path, 200)}: cannot read: {exc.strerror or exc}") from None
    except zipfile.BadZipFile as exc:
        raise HarnessError(f"{path}: a broken zip: {clip(exc, 80)}") from None
    try:
        config = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise HarnessError(f"{path}: byte {exc.start}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise HarnessError(f"{path}: line {exc.lineno}: not JSON ({exc.msg}); give model.to_json()'s output or "
                           f"a .keras file") from None
    except RecursionError:
        raise HarnessError(f"{path}: JSON nested too deeply for a model") from None
    if not isinstance(config, dict) or "class_name" not in config or not isinstance(config.get("config"), dict):
        raise HarnessError(f"{path}: not a Keras model's configuration (no class_name and config at the top level)")
    return config


@dataclass
class Node:
    index: int  # in model.layers
    name: str
    cls: str
    config: dict
    inputs: list[str] = field(default_factory=list)  # the layers whose outputs it takes, in argument order
    kwargs: dict = field(default_factory=dict)  # call arguments that are not tensors
    shapes: list = field(default_factory=list)  # the input tensors' shapes, where Keras 3 wrote them

    @property
    def where(self) -> str:
        return f"layer {self.index} '{clip(self.name, 40)}' ({self.cls})"


def _history(item) -> tuple | None:
    """A Keras 3 tensor reference's (layer, node, index) and shape, or None."""
    if isinstance(item, dict) and item.get("class_name") == "__keras_tensor__":
        config = item.get("config") or {}
        return tuple(config.get("keras_history") or ()), config.get("shape")
    return None


def _node_inputs(node: Node, inbound) -> None:
    """Fill node.inputs, kwargs and shapes from its inbound_nodes (Keras 3 dicts, Keras 2 lists)."""
    if not isinstance(inbound, list) or not inbound:
        return
    if len(inbound) > 1:
        raise Problem("inbound_nodes", f"called {len(inbound)} times: a shared layer is not a chain")
    call = inbound[0]
    refs: list = []
    if isinstance(call, dict):  # Keras 3: {"args": [...], "kwargs": {...}}
        def walk(obj):
            found = _history(obj)
            if found:
                refs.append(found)
            elif isinstance(obj, list):
                for item in obj:
                    walk(item)
        walk(call.get("args", []))
        for key, value in (call.get("kwargs") or {}).items():
            before = len(refs)
            walk(value)
            if len(refs) == before:
                node.kwargs[key] = value
    else:  # Keras 2: [[layer, node, index, kwargs], ...]
        for entry in call:
            refs.append((tuple(entry[:3]), None))
            if len(entry) > 3 and isinstance(entry[3], dict):
                node.kwargs.update(entry[3])
    for (layer, *rest), shape in refs:
        if any(rest):
            raise Problem("inbound_nodes", f"takes output {rest} of '{layer}': shared layers and layers of several "
                          f"outputs are not a chain")
        node.inputs.append(layer)
        node.shapes.append(shape)


def _endpoint(value, what: str) -> str:
    if isinstance(value, list) and value and isinstance(value[0], str):
        value = [value]  # Keras 3 writes a single input as [name, 0, 0]
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], list):
        raise Problem(what, f"{_show(value)}: the spec has one input and one output")
    return value[0][0]


# ---- the importer -------------------------------------------------------------------------------------------
class KerasImporter:
    def __init__(self, path: Path, config: dict):
        self.path, self.model = path, config
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.initializers: set[str] = set()
        self.policies: set[str] = set()
        self.vocab: int | None = None

    def problem(self, where: str, message: str) -> None:
        line = f"{self.path}: {where}: {message}"
        if line not in self.problems:  # a graph's problem is met again on every path through it
            self.problems.append(line)

    # a layer into the spec's layers, each tagged with its Keras name (_source)
    def convert(self, node: Node, first: bool) -> list[dict]:
        rule, config = LAYERS.get(node.cls), node.config
        if rule is None:
            self.problem(node.where, f"layer class {node.cls}: not in the spec (mapped: {', '.join(sorted(LAYERS))})")
            return []
        try:
            out = self.options(node, rule)
        except Problem as exc:
            self.problem(node.where, str(exc))
            return []
        if node.cls == "DepthwiseConv2D":
            channels = (next((s for s in node.shapes if s), None) or [None])[-1]
            if not isinstance(channels, int):
                self.problem(node.where, "the input's channels are not in the configuration (Keras 3 writes them); "
                             "the spec's depthwise conv2d needs them")
                return []
            out[0].update(groups=channels, filters=channels * (config.get("depth_multiplier") or 1))
        elif node.cls == "ReLU" and config.get("max_value") is not None:
            out[0]["type"] = "relu6"
        elif node.cls == "Normalization":
            return [dict(layer, _source=node.name) for layer in self.normalization(node)]
        elif node.cls == "Embedding":
            if not first:
                self.problem(node.where, "an embedding takes the token ids: it must be the model's first layer")
            self.vocab = config.get("input_dim")
        elif node.cls == "MultiHeadAttention":
            self.attention(node, out[0])
        return [dict(layer, _source=node.name) for layer in out]

    def options(self, node: Node, rule: Rule) -> list[dict]:
        config, problems = node.config, []
        for key, value in config.items():
            if key.endswith("_initializer"):
                self.initializers.add(key)
            elif key.endswith(("_regularizer", "_constraint")) and value is not None:
                problems.append(Problem(f"{key} {_class(value)[0] or _show(value)}", "the spec has no regularizers "
                                        "or constraints"))
            elif key in rule.fixed:
                if value not in rule.fixed[key]:
                    allowed = [_show(v) for v in rule.fixed[key] if v is not None]
                    problems.append(Problem(f"{key} {_show(value)}", f"the spec's {rule.type or 'layer'} takes only "
                                            f"{' or '.join(allowed)}" if allowed else
                                            f"not in the spec's {rule.type or 'layer'}"))
            elif key not in GENERIC + rule.read and value not in (None, False, 0, [], {}):
                problems.append(Problem(f"{key} {_show(value)}", f"not in the spec's {rule.type or 'layers'}"))
        if config.get("trainable") is False:
            problems.append(Problem("trainable false", "the spec trains every weight"))
        policy = config.get("dtype")
        policy = _class(policy)[1].get("name") if isinstance(policy, dict) else policy
        if isinstance(policy, str) and policy != "float32":
            self.policies.add(policy)
        layer = {"type": rule.type}
        for spec_field, read in rule.fields.items():
            try:
                value = read(config)
            except Problem as exc:
                problems.append(exc)
                continue
            if value is not None:
                layer[spec_field] = value
        if "pool_size" in rule.fields and layer.get("strides") == layer.get("pool_size"):
            del layer["strides"]  # Keras writes the default (the pool size) out
        activation = []
        if rule.activation:
            name, _ = _class(config.get("activation"))
            if name not in ACTIVATIONS:
                problems.append(Problem(f"activation {_show(name)}", f"the spec's activations are "
                                        f"{', '.join(a for a in ACTIVATIONS if a)}"))
            activation = ACTIVATIONS.get(name, [])
        for problem in problems[1:]:
            self.problem(node.where, str(problem))
        if problems:
            raise problems[0]
        return ([layer] if rule.type else []) + [dict(a) for a in activation]

    def normalization(self, node: Node) -> list[dict]:
        """Keras's Normalization, (x - mean) / max(sqrt(variance), epsilon 1e-7), as a rescaling. Its mean and
        variance are in the configuration only where given to the constructor; adapt() and loaded weights keep them
        as weights, which the importer does not read."""
        mean, variance = node.config.get("mean"), node.config.get("variance")
        if mean is None or variance is None:
            self.notes.append(f"{node.where}: its mean and variance are weights, not in the configuration: left out "
                              f"(Keras's values before adapt(): mean 0, variance 1, the identity); add them as a "
                              f"rescaling if the model was adapted")
            return []
        mean, std = np.asarray(mean, np.float64), np.maximum(np.sqrt(np.asarray(variance, np.float64)), 1e-7)
        scale, offset = 1 / std, -mean / std

        def listed(value):
            return float(value) if value.ndim == 0 else [float(v) for v in value.ravel()]

        return [{"type": "rescaling", "scale": listed(scale), "offset": listed(offset)}]

    def attention(self, node: Node, layer: dict) -> None:
        """Keras's MultiHeadAttention is the spec's attention when it is self-attention over [T, D] with
        num_heads * key_dim = D and value_dim = key_dim (its [D, H, key_dim] kernels are the spec's [D, D])."""
        config, kwargs = node.config, node.kwargs
        if len(set(node.inputs)) != 1:
            self.problem(node.where, "query, value and key are different tensors: the spec's attention is "
                         "self-attention")
        for key in ("attention_mask", "return_attention_scores"):
            if kwargs.get(key) not in (None, False):
                self.problem(node.where, f"called with {key}: not in the spec's attention")
        layer["causal"] = bool(kwargs.get("use_causal_mask", False))
        heads, key_dim = config.get("num_heads"), config.get("key_dim")
        shape = next((s for s in node.shapes if s), None)
        if config.get("value_dim") not in (None, key_dim):
            self.problem(node.where, f"value_dim {config.get('value_dim')}: the spec's attention has value_dim = "
                         f"key_dim")
        if shape is None or len(shape) != 3:
            self.problem(node.where, f"input shape {_show(shape)}: the spec's attention takes a sequence [T, D]")
        elif heads * key_dim != shape[-1]:
            self.problem(node.where, f"key_dim {key_dim}: num_heads {heads} x key_dim is not the model dimension "
                         f"{shape[-1]}, which the spec's attention needs")

    # the model's graph: a list of nodes from input to output into the spec's layers
    def layers(self) -> tuple[list[Node], list[int] | None, list[dict]]:
        """(the nodes, the input shape with its batch axis, the spec's layers)."""
        cls, config = self.model["class_name"], self.model["config"]
        entries = config.get("layers")
        if cls not in ("Sequential", "Functional", "Model") or not isinstance(entries, list):
            raise HarnessError(f"{self.path}: a {clip(cls, 40)} model: its configuration holds no layer graph (a "
                               f"subclassed model?); give a Sequential or functional model")
        entries = [e for e in entries if isinstance(e, dict)]
        if cls == "Sequential":
            return self.sequential(entries)
        return self.functional(entries, config)

    def sequential(self, entries: list[dict]):
        shape = None
        nodes = []
        for entry in entries:
            c = entry.get("config") or {}
            shape = shape or c.get("batch_shape") or c.get("batch_input_shape")
            if entry.get("class_name") != "InputLayer":
                nodes.append(Node(len(nodes), c.get("name", "?"), entry.get("class_name"), c))
        shape = shape or (self.model.get("build_config") or {}).get("input_shape") or \
            self.model["config"].get("build_input_shape")
        layers = [layer for i, node in enumerate(nodes) for layer in self.convert(node, i == 0)]
        return nodes, shape, layers

    def functional(self, entries: list[dict], config: dict):
        nodes: dict[str, Node] = {}
        for index, entry in enumerate(entries):
            c = entry.get("config") or {}
            node = Node(index, entry.get("name") or c.get("name", "?"), entry.get("class_name"), c)
            try:
                _node_inputs(node, entry.get("inbound_nodes"))
            except Problem as exc:
                self.problem(node.where, str(exc))
            nodes[node.name] = node
        try:
            start, end = (_endpoint(config.get(k), k) for k in ("input_layers", "output_layers"))
        except Problem as exc:
            raise ImportProblems([f"{self.path}: {exc}"]) from None
        if start not in nodes or end not in nodes:
            raise HarnessError(f"{self.path}: input_layers or output_layers names a layer the model does not hold")
        shape = (nodes[start].config.get("batch_shape") or nodes[start].config.get("batch_input_shape"))
        known = list(self.problems)  # a layer's own problems, met by both readings of the graph
        chain = _Chain(self, nodes, start)
        layers = chain.walk(end, start)
        if not self.problems and not (set(nodes) - chain.visited - {start}):
            return list(nodes.values()), shape, layers
        self.problems, self.notes = known, []  # not a chain with residual adds: the graph as it is
        return list(nodes.values()), shape, self.graph(nodes, start, end)

    def graph(self, nodes: dict[str, Node], start: str, end: str) -> list[dict]:
        """The layers from the input to the output in the model's own order (Keras writes a functional model's
        layers in an order that computes each after its inputs), with named tensors where a layer does not take the
        one before it and for every merge's inputs."""
        needed, stack = set(), [end]
        while stack:
            name = stack.pop()
            if name in needed or name == start:
                continue
            if name not in nodes:
                raise ImportProblems([f"{self.path}: a layer takes '{clip(name, 40)}', which the model does not hold"])
            needed.add(name)
            stack += nodes[name].inputs
        users: dict[str, list[Node]] = {}
        for name in needed:
            for source in set(nodes[name].inputs):
                users.setdefault(source, []).append(nodes[name])
        out: list[dict] = []
        last: dict[str, int] = {}  # node -> the index in `out` of the layer that gives its output
        alias: dict[str, str] = {start: start}  # node -> the node whose output it is (a layer that maps to none)
        wanted: set[str] = set()  # nodes whose output a later layer takes by name
        current = start  # the node whose output the last layer so far gives
        failed: set[str] = set()  # nodes not written (their problem said), and those that take their output
        for node in (nodes[name] for name in nodes if name in needed):
            sources = [alias.get(name, name) for name in node.inputs]
            if failed & set(sources):
                failed.add(node.name)
                continue
            early = [name for name in sources if name not in last and name != start]
            layers, problems = [], len(self.problems)
            if early:
                self.problem(node.where, f"takes '{clip(early[0], 40)}', which the configuration lists after it: "
                             f"not a model Keras wrote")
            elif node.cls in MERGES:
                layers = self.merge(node)
                if layers:
                    layers[0]["inputs"] = sources
                    wanted.update(sources)
            elif len(set(sources)) != 1 and node.cls != "MultiHeadAttention":
                self.problem(node.where, f"takes {len(set(sources))} tensors: only {', '.join(MERGES)} join "
                             f"branches in the spec")
            elif node.cls == "Reshape" and self.to_image(node, out, last, users, sources[0]):
                alias[node.name] = sources[0]
                continue
            else:
                layers = self.convert(node, sources[0] == start)
                if not layers and len(self.problems) == problems:  # a layer that computes nothing (linear)
                    alias[node.name] = sources[0]
                    continue
                if layers and sources[0] != current:
                    layers[0]["input"] = sources[0]
                    wanted.add(sources[0])
            if not layers:  # its problem is said
                failed.add(node.name)
                continue
            out += layers
            last[node.name] = len(out) - 1
            current = node.name
        return name_tensors(out, last, {node: node for node in sorted(wanted - {start})}, start)

    def merge(self, node: Node) -> list[dict]:
        kind, config = MERGES[node.cls], node.config
        for key, value in config.items():
            if key not in GENERIC + ("axis",) and value not in (None, False, 0, [], {}):
                self.problem(node.where, f"{key} {_show(value)}: not in the spec's {kind}")
                return []
        if kind == "concat":
            rank = len(next((s for s in node.shapes if s), None) or [0, 0])
            if config.get("axis", -1) not in (-1, rank - 1):
                self.problem(node.where, f"axis {config.get('axis')}: the spec concatenates the last (channel or "
                             f"feature) axis")
                return []
        return [{"type": kind, "_source": node.name}]

    def to_image(self, node: Node, out: list[dict], last: dict[str, int], users: dict[str, list[Node]],
                 source: str) -> bool:
        """Whether a Reshape of a vector [C] to [1, 1, C] (a squeeze-and-excite gate) needs no layer: it is a global
        pool's [C] that nothing else takes (the pool keeps its dims instead), or it feeds only Adds and Multiplies
        (the spec's merges broadcast [C] as [1, 1, C])."""
        target, shape = node.config.get("target_shape"), next((s for s in node.shapes if s), None)
        if not (isinstance(target, list) and len(target) == 3 and target[:2] == [1, 1] and shape
                and list(shape[1:]) == target[2:]):
            return False
        producer = out[last[source]] if source in last else {}
        if producer.get("type", "").startswith("global_") and len(users.get(source, [])) == 1:
            producer["keepdims"] = True
            return True
        return all(MERGES.get(user.cls) in ("add", "multiply") for user in users.get(node.name, [None]) if user)


class _Chain(Chain):
    """A functional graph read back from the output (harness.model.importers.Chain): single-input layers, and Adds
    whose two branches meet at a fork."""

    def __init__(self, importer: KerasImporter, nodes: dict[str, Node], start: str):
        super().__init__(nodes, start, str(importer.path))
        self.importer = importer

    def is_add(self, node: Node) -> bool:
        return node.cls == "Add"

    def inputs(self, node: Node) -> list[str]:
        return node.inputs

    def before(self, node: Node) -> str:
        if node.cls == "MultiHeadAttention" and node.inputs:
            return node.inputs[0]  # the query; convert() says where value and key differ from it
        return super().before(node)

    def convert(self, node: Node, first: bool) -> list[dict]:
        return self.importer.convert(node, first)

    def problem(self, node: Node, message: str) -> None:
        self.importer.problem(node.where, message)


def import_keras(path: str | Path, dataset: str | None = None, batch_size: int | None = None,
                 steps: int | None = None) -> Imported:
    """A Keras model's configuration as a validated spec (ImportProblems: everything the spec cannot express)."""
    path = Path(path)
    importer = KerasImporter(path, read_config(path))
    try:
        nodes, shape, layers = importer.layers()
    except Problem as exc:
        raise ImportProblems([f"{path}: {exc}"]) from None
    input_ = _input(importer, shape, layers)
    loss = _loss(importer, layers)
    optimizer = _optimizer(importer)
    if importer.problems:
        raise ImportProblems(importer.problems)
    if importer.initializers:
        importer.notes.append(f"the Keras initializers ({', '.join(sorted(importer.initializers))}) are dropped: the "
                              f"core draws every initial weight (harness.model.weights)")
    if importer.policies:
        importer.notes.append(f"the dtype policy {', '.join(sorted(importer.policies))} is dropped: the precision "
                              f"is the run's --precision")
    tags: dict[str, dict] = {}
    name = str(importer.model["config"].get("name") or path.stem)
    spec = {
        "name": name,
        "description": f"Imported from the Keras model '{name}' ({path.name}) by `amp-harness import keras`.",
        "input": input_,
        "dataset": choose_dataset(dataset, input_, layers, loss, importer.notes),
        "layers": untag(layers, "", tags),
        "loss": loss,
        "optimizer": optimizer,
        "batch_size": batch_size or DEFAULT_BATCH_SIZE,
        "steps": steps or DEFAULT_STEPS,
        "seed": 0,
    }
    if batch_size is None or steps is None:
        importer.notes.append(f"batch_size {spec['batch_size']} and steps {spec['steps']}: the Keras model says "
                              f"neither (--batch-size and --steps set them)")
    sources = tags.get("_source", {})
    spec = finish(spec, sources, str(path), "the Keras layer")  # what `amp-harness check` asks
    return Imported(spec, importer.notes, sources)


def _input(importer: KerasImporter, shape, layers: list[dict]) -> dict:
    if not isinstance(shape, list) or len(shape) < 2:
        importer.problem("input", f"no input shape ({_show(shape)}): build the model or give it a keras.Input")
        return {"shape": [1]}
    dims = shape[1:]
    if not all(isinstance(d, int) and d > 0 for d in dims):
        importer.problem("input", f"shape {_show(dims)}: the spec needs every size fixed")
    elif len(dims) not in (1, 3) or (importer.vocab is not None and len(dims) != 1):
        importer.problem("input", f"shape {_show(dims)}: the spec takes images [H, W, C], vectors [F] or token ids "
                         f"[T] (into an Embedding)")
    out = {"shape": dims}
    if importer.vocab is not None:
        out["vocab"] = importer.vocab
    return out


def _compile(importer: KerasImporter) -> tuple[dict | None, bool]:
    """(the compile configuration, whether Keras 2 wrote it)."""
    if isinstance(importer.model.get("compile_config"), dict):
        return importer.model["compile_config"], False
    legacy = importer.model.get("training_config")
    if isinstance(legacy, dict):
        return {"loss": legacy.get("loss"), "optimizer": legacy.get("optimizer_config")}, True
    return None, False


def _loss(importer: KerasImporter, layers: list[dict]) -> dict:
    compiled, _ = _compile(importer)
    if compiled is None or compiled.get("loss") is None:
        loss, why = default_loss(layers)
        importer.notes.append(f"no compile configuration: {why}")
        return loss
    name, config = _class(compiled["loss"])
    if name not in LOSSES:
        hint = "; one-hot labels: the spec's labels are class indices" if name and "categorical" in name else ""
        importer.problem("compile_config.loss", f"{_show(name or compiled['loss'])}: the spec's losses are "
                         f"sparse_categorical_crossentropy and binary_crossentropy{hint}")
        return {"type": "binary_crossentropy", "from_logits": False}
    for key, value in config.items():
        if key in LOSS_FIXED and value not in LOSS_FIXED[key]:
            importer.problem("compile_config.loss", f"{name}: {key} {_show(value)}: the spec's loss takes "
                             f"{_show(LOSS_FIXED[key][0])}")
    return {"type": LOSSES[name], "from_logits": bool(config.get("from_logits", False))}


def _optimizer(importer: KerasImporter) -> dict:
    compiled, legacy = _compile(importer)
    if compiled is None or compiled.get("optimizer") is None:
        importer.notes.append("no compile configuration: optimizer rmsprop with Keras's defaults (compile's default "
                              "optimizer: learning_rate 0.001, rho 0.9, epsilon 1e-7 inside the square root)")
        return {"type": "rmsprop", "learning_rate": 0.001, "rho": 0.9, "epsilon": 1e-7, "epsilon_placement": "inside"}
    name, config = _class(compiled["optimizer"])
    where = "compile_config.optimizer" if not legacy else "training_config.optimizer_config"
    if name not in OPTIMIZERS:
        importer.problem(where, f"{_show(name)}: the spec's optimizers are {', '.join(OPTIMIZERS)}")
        return {"type": "sgd", "learning_rate": 0.01, "momentum": 0.0, "nesterov": False}
    kind, defaults = OPTIMIZERS[name]
    out: dict = {"type": kind}
    for key, default in defaults.items():
        value = config.get(key, config.get("lr", default) if key == "learning_rate" else default)
        if key == "learning_rate" and isinstance(value, dict):
            importer.problem(where, f"{name}: learning_rate {_show(_class(value)[0])}: a Keras schedule; the spec's "
                             f"schedules are constant and warmup_cosine (edit the spec's `schedule`)")
            value = default
        rounded = _f32(value)
        if rounded != value:
            importer.notes.append(f"{key} {value!r} read as {rounded!r} (Keras keeps it in float32)")
        out[key] = rounded
    for key, value in config.items():
        if key in OPTIMIZER_FIXED and not (kind == "sgd" and key == "momentum") and value not in OPTIMIZER_FIXED[key]:
            importer.problem(where, f"{name}: {key} {_show(value)}: not in the spec's {kind}")
        elif key not in OPTIMIZER_FIXED and key not in OPTIMIZER_IGNORED and key not in defaults \
                and value not in (None, False, 0, 0.0):
            importer.problem(where, f"{name}: {key} {_show(value)}: not in the spec's {kind}")
    decay = config.get("weight_decay")
    if kind == "adam" and decay:  # Keras's weight_decay is decoupled, on every variable: the spec's adamw
        out = {**out, "type": "adamw", "weight_decay": _f32(decay)}
    elif kind in ("sgd", "rmsprop") and decay:
        importer.problem(where, f"{name}: weight_decay {decay}: the spec's {kind} has no weight decay (adamw has)")
    if out["type"] == "adamw":
        out["no_decay"] = []  # Keras decays every variable not excluded by name; the config does not say which
    if kind in ("adam", "adamw"):
        importer.notes.append(f"{name}'s epsilon is Keras's 'epsilon hat' (added to sqrt(v) before the bias "
                              f"correction); the spec's adam adds it after (PyTorch's form): the same value weighs "
                              f"1/sqrt(1 - beta_2^t) more in Keras's first steps")
    if kind == "rmsprop":  # Keras 3 and 2.11+: inside the root; Keras 2's legacy RMSprop without momentum: outside
        out["epsilon_placement"] = "outside" if legacy and config.get("is_legacy_optimizer", True) else "inside"
    if config.get("global_clipnorm") is not None:
        out["clip_norm"] = _f32(config["global_clipnorm"])
    return out
