"""`amp-harness import torch MODULE:ATTR --input-shape C,H,W`: a PyTorch nn.Module into a spec.

A PyTorch model is Python code, so it is read by running it: `MODULE:ATTR` names an importable module (or a file,
`path/to/file.py:ATTR`) and an attribute that is an nn.Module, or a class or function of no arguments that returns
one. It runs once in eval mode on a zero (or token-id) input of the given shape, batch 3. Then torch.export.export
captures its forward as an ATen graph, which importer_export.py reads: the ops of each known leaf module (MODULES,
importer_modules.py, Hugging Face's Conv1D, modules whose values are the spec's activations or rmsnorm) become its spec layers, the
glue between modules is read from the ATen ops (merges, pools, flattens, pads, position tables), and
scaled_dot_product_attention with its projections is the spec's attention. Where torch.export cannot capture the
module, torch.fx.symbolic_trace turns its forward into a graph, which one forward pass (fx's ShapeProp) annotates
with every tensor's shape; that graph must be a chain with residual adds (`x + f(x)`, or `f(x) + g(x)` for a
projection shortcut: harness.model.importers.Chain, as Keras's functional graphs) of the modules in MODULES and the
calls in FUNCTIONS below. Either way each option is copied into the spec's field or held to the value the spec's
math has, and everything else is one line per problem naming the module (its qualified name in the model, or the
module whose forward made a call) and the field.

Conventions that differ from the spec's and how they map:
- images are NCHW in PyTorch and NHWC in the spec: the input shape C,H,W is the spec's [H, W, C];
- PyTorch flattens an image in C, H, W order, the spec in H, W, C order: the spec's layer is just `flatten`, and
  the import records, for the dense layer after it (and any batchnorm or layernorm on the flat features between),
  the [C, H, W] its inputs were flattened from (Imported.flattened): canonical_weights permutes those rows;
- BatchNorm's momentum m (running = (1 - m) * running + m * batch) is the spec's 1 - m, and PyTorch updates its
  running variance with the unbiased batch variance where the spec uses the biased one (a note says so);
- PyTorch pads a window symmetrically; the spec's 'same' is TensorFlow's (an odd pixel at the bottom/right). They
  agree at stride 1 with an odd kernel k and padding k // 2 (and for Conv2d's padding='same', which PyTorch allows
  at stride 1 only and pads as TensorFlow does), whatever the input's size: those map to 'same', padding 0 to
  'valid', anything else is refused. Average pooling with padding must exclude it (count_include_pad=False), as
  the spec's 'same' does.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import math
import operator
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from amp_harness_torch.importer_modules import MODULES, _gelu, _show, _softmax_dim, embedding_note
from harness.errors import HarnessError, clip
from harness.run.native import load_object
from harness.model.importers import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_STEPS,
    Chain,
    ImportOptions,
    Imported,
    ImportProblems,
    Problem,
    dataset,
    default_loss,
    finish,
    untag,
)

SHAPE_BATCH = 3  # the batch of the shape-finding pass: not 1 (a flatten that folds the batch in would pass)
# no loss or optimizer in a module: torch.optim.Adam's defaults, the spec's adam form exactly (epsilon outside)
DEFAULT_OPTIMIZER = {"type": "adam", "learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8}


# ---- loading ------------------------------------------------------------------------------------------------
def load_module(target: str) -> nn.Module:
    """The nn.Module that `target` ("MODULE:ATTR", "path/to/file.py:ATTR") names; HarnessError in one line."""
    return load_object(target, lambda obj: isinstance(obj, nn.Module), "an nn.Module")


# ---- the graph's nodes --------------------------------------------------------------------------------------
@dataclass
class Node:
    fx: torch.fx.Node
    module: nn.Module | None  # a call_module's module
    inputs: list[str]  # the tensors it takes, in argument order (fx node names; repeats kept)

    @property
    def name(self) -> str:
        return self.fx.name

    @property
    def source(self) -> str:
        """What Imported.sources names: the module's qualified name, or the fx node's name for a functional call."""
        return str(self.fx.target) if self.fx.op == "call_module" else self.fx.name

    @property
    def where(self) -> str:
        if self.fx.op == "call_module":
            return f"module '{clip(str(self.fx.target), 60)}' ({type(self.module).__name__})"
        stack = self.fx.meta.get("nn_module_stack") or {}
        owner = list(stack.values())[-1][0] if stack else ""
        caller = f"module '{clip(owner, 60)}'" if owner else "forward"
        return f"{caller} calls {function_name(self.fx)} (fx node '{clip(self.fx.name, 40)}')"


def function_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.target in (operator.add, operator.iadd):
        return "+"
    return _qualified(node.target)


def _qualified(function) -> str:
    """torch.nn.functional.gelu, torch.cat: where users call it from (not torch._C._nn)."""
    module = getattr(function, "__module__", None) or "torch"
    module = {"torch._C._nn": "torch.nn.functional", "_operator": "operator"}.get(module, module)
    module = "torch" if module.startswith("torch._C") else module
    return f"{module}.{getattr(function, '__name__', str(function))}"


def _shape(node) -> tuple[int, ...] | None:
    """A node's tensor shape, batch axis included (None: not a tensor)."""
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _holds_tensors(node: torch.fx.Node) -> bool:
    """A tensor, or a tuple of them (an LSTM's output): ShapeProp's tensor_meta; not a size or a shape."""
    return node.meta.get("tensor_meta") is not None


def _arg(node: torch.fx.Node, index: int, key: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(key, default)


# ---- functional calls and tensor methods --------------------------------------------------------------------
def _dims(value, ndim: int) -> set[int] | None:
    if isinstance(value, int):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(d, int) for d in value):
        return None
    return {d % ndim for d in value}


def _mean(node: torch.fx.Node, shape) -> list[dict]:
    dims = _dims(_arg(node, 1, "dim"), len(shape))
    if _arg(node, 3, "dtype") is not None:
        raise Problem(f"dtype {_show(_arg(node, 3, 'dtype'))}", "the spec's mean keeps the compute dtype")
    if len(shape) == 4 and dims == {2, 3}:
        return [{"type": "global_avgpool2d"}]
    if len(shape) == 3 and dims == {1} and not _arg(node, 2, "keepdim", False):
        return [{"type": "sequence_pool", "mode": "mean"}]
    raise Problem(f"dim {_show(_arg(node, 1, 'dim'))}", f"a mean over an input {list(shape[1:])}: the spec's means are "
                  f"over an image's height and width (dim (2, 3): global_avgpool2d) or a sequence's positions (dim 1: "
                  f"sequence_pool)")


def _flat_call(node: torch.fx.Node, shape) -> list[dict]:
    start, end = _arg(node, 1, "start_dim", 0), _arg(node, 2, "end_dim", -1)
    if start != 1 or end not in (-1, len(shape) - 1):
        raise Problem(f"start_dim {_show(start)}, end_dim {_show(end)}", "the spec's flatten keeps the batch axis "
                      "and flattens the rest (torch.flatten(x, 1))")
    return [{"type": "flatten"}]


def _reshape(node: torch.fx.Node, shape) -> list[dict]:
    out = _shape(node)
    if out is not None and len(out) == 2 and out[0] == shape[0] and out[1] == math.prod(shape[1:]):
        return [{"type": "flatten"}]
    raise Problem(f"shape {list(out[1:]) if out else '?'}", f"from {list(shape[1:])}: the spec reshapes only to "
                  f"flatten (x.view(x.size(0), -1))")


def _adaptive_call(node: torch.fx.Node, shape) -> list[dict]:
    size = _arg(node, 1, "output_size")
    if size not in (1, (1, 1), [1, 1]):
        raise Problem(f"output_size {_show(size)}", "the spec's global_avgpool2d is output_size 1")
    return [{"type": "global_avgpool2d"}]


def _nothing(node, shape) -> list[dict]:
    return []


FUNCTIONS = {  # function or "Tensor method" -> its spec layers (from the call and its input's shape)
    F.relu: lambda n, s: [{"type": "relu"}], torch.relu: lambda n, s: [{"type": "relu"}],
    torch.relu_: lambda n, s: [{"type": "relu"}], "relu": lambda n, s: [{"type": "relu"}],
    torch.sigmoid: lambda n, s: [{"type": "sigmoid"}], F.sigmoid: lambda n, s: [{"type": "sigmoid"}],
    "sigmoid": lambda n, s: [{"type": "sigmoid"}],
    torch.tanh: lambda n, s: [{"type": "tanh"}], F.tanh: lambda n, s: [{"type": "tanh"}],
    "tanh": lambda n, s: [{"type": "tanh"}],
    F.gelu: lambda n, s: _gelu(_arg(n, 1, "approximate", "none")),
    F.softmax: lambda n, s: _softmax_dim(_arg(n, 1, "dim"), s),
    torch.softmax: lambda n, s: _softmax_dim(_arg(n, 1, "dim"), s),
    "softmax": lambda n, s: _softmax_dim(_arg(n, 1, "dim"), s),
    torch.flatten: _flat_call, "flatten": _flat_call,
    "view": _reshape, "reshape": _reshape, torch.reshape: _reshape,
    torch.mean: _mean, "mean": _mean,
    F.adaptive_avg_pool2d: _adaptive_call,
    "contiguous": _nothing,
}
ADDS = (operator.add, operator.iadd, torch.add, "add", "add_")  # with two tensors: a residual join
FEATUREWISE = ("relu", "sigmoid", "tanh", "gelu", "softmax", "dropout", "batchnorm", "layernorm", "flatten")


def _mapped() -> str:
    names = {f"Tensor.{f}" if isinstance(f, str) else _qualified(f) for f in FUNCTIONS if f != "contiguous"}
    return ", ".join(["+ (residual adds)", *sorted(names)])


# ---- the importer -------------------------------------------------------------------------------------------
class TorchChain(Chain):
    join = "add (x + y)"

    def __init__(self, importer: "TorchImporter", nodes: dict[str, Node], start: str):
        super().__init__(nodes, start, importer.target)
        self.importer = importer

    def is_add(self, node: Node) -> bool:
        return node.name in self.importer.adds

    def inputs(self, node: Node) -> list[str]:
        return node.inputs

    def missing(self, name: str) -> str:
        return (f"uses the tensor attribute '{clip(name, 40)}' directly: the spec's weights belong to its layers "
                f"(hold it in a module the table maps)")

    def convert(self, node: Node, first: bool) -> list[dict]:
        if isinstance(node.module, nn.Embedding) and not first:
            self.importer.problem(node.where, "an embedding takes the token ids: it must be the model's first layer")
        return [dict(layer) for layer in self.importer.converted.get(node.name, [])]

    def problem(self, node: Node, message: str) -> None:
        self.importer.problem(node.where, message)


class TorchImporter:
    def __init__(self, target: str, model: nn.Module, input_shape: tuple[int, ...]):
        self.target, self.model, self.input_shape = target, model, tuple(input_shape)
        self.problems: list[str] = []
        self.flagged: set[str] = set()  # the nodes (their `where`) a problem names
        self.notes: list[str] = []
        self.adds: set[str] = set()
        self.converted: dict[str, list[dict]] = {}  # fx node -> its spec layers, tagged
        self.vocab: int | None = None
        self.batchnorm = False  # a BatchNorm was mapped (a note on its running variance)
        self.export_failure: str | None = None  # why torch.export could not capture it (then torch.fx reads it)
        self.graph = None  # the ExportedGraph, where torch.export captured it
        self.unused_parameters = 0  # module parameters the spec does not hold (TorchImported.unused_parameters)

    def read(self) -> list[dict]:
        """The spec's layers: torch.export's graph (importer_export), or torch.fx's where export cannot capture the
        module; problems in self.problems."""
        from amp_harness_torch.importer_export import CaptureFailed, export_layers

        required = _required_arguments(self.model)
        if required is not None and len(required) > 1:
            raise ImportProblems([f"{self.target}: forward takes {len(required)} tensors "
                                  f"({', '.join(required) or 'none'}): the spec has one input"])
        modes = {name: m.training for name, m in self.model.named_modules()}
        try:
            self.model.eval()
            sample = self.sample()
            try:
                return export_layers(self, self.model, sample)
            except CaptureFailed as exc:
                self.export_failure = str(exc)
                self.problems, self.flagged, self.notes, self.vocab, self.batchnorm = [], set(), [], None, False
        finally:
            for name, m in self.model.named_modules():
                m.training = modes[name]
        traced = self.trace()
        nodes, start, end = self.nodes(traced)
        chain = TorchChain(self, nodes, start)
        layers = chain.walk(end, start) if end != start else []
        for name, node in nodes.items():  # once the walk met a problem, the nodes it did not reach say nothing new
            if name not in chain.visited and name != start and not self.problems:
                self.problem(node.where, "not on the chain from the input to the output (an in-place op whose result "
                             "is not used, or a branch the spec cannot express: only residual adds join the chain)")
        return layers

    def sample(self) -> torch.Tensor:
        """The capture's input: token ids (zeros) for a model with an embedding and one size, else zeros; the module
        run on it once (HarnessError: it fails on that shape)."""
        from amp_harness_torch.importer_export import _output

        embeds = len(self.input_shape) == 1 and any(isinstance(m, nn.Embedding) for m in self.model.modules())
        floating = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        error = None
        for dtype in ((torch.int64, floating) if embeds else (floating,)):
            sample = torch.zeros((SHAPE_BATCH, *self.input_shape), dtype=dtype)
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _output(self.model(sample))
                return sample
            except HarnessError as exc:
                raise HarnessError(f"{self.target}: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - the module's own failure, said in one line
                error = error or exc
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise HarnessError(f"{self.target}: --input-shape {','.join(map(str, self.input_shape))}: the module fails "
                           f"on a {'token' if embeds else 'zero'} input of that shape ({type(error).__name__}: "
                           f"{clip(first, 160)})") from None

    def problem(self, where: str, message: str, repeat: bool = False) -> None:
        """One line per node: a node refused where it was converted is not refused again by the walk (`repeat`: one
        line per problem of the node)."""
        line = f"{self.target}: {where}: {message}"
        if (where not in self.flagged or repeat) and line not in self.problems:
            self.flagged.add(where)
            self.problems.append(line)

    def trace(self) -> torch.fx.GraphModule:
        try:
            traced = torch.fx.symbolic_trace(self.model)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            exported = f"torch.export.export cannot capture it ({self.export_failure}), and " \
                if self.export_failure else ""
            raise HarnessError(f"{self.target}: {exported}torch.fx.symbolic_trace cannot trace it "
                               f"({type(exc).__name__}: {clip(first, 160)}): the importer reads a forward without "
                               f"data-dependent control flow") from None
        placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
        used = [n for n in placeholders if n.users]
        if len(used) != 1:
            raise ImportProblems([f"{self.target}: forward takes {len(used)} tensors "
                                  f"({', '.join(n.name for n in used) or 'none'}): the spec has one input"])
        first = list(used[0].users)
        tokens = any((n.op == "call_module" and isinstance(traced.get_submodule(n.target), nn.Embedding))
                     or (n.op == "call_function" and n.target is F.embedding) for n in first)
        if tokens and len(self.input_shape) != 1:
            raise HarnessError(f"{self.target}: --input-shape {','.join(map(str, self.input_shape))}: an embedding "
                               f"takes token ids [T]: give one size")
        dtype = torch.int64 if tokens else torch.float32
        sample = [torch.zeros((SHAPE_BATCH, *self.input_shape), dtype=dtype) if n in used else None
                  for n in placeholders]
        modes = {name: m.training for name, m in self.model.named_modules()}
        try:
            from torch.fx.passes.shape_prop import ShapeProp

            traced.eval()
            # ShapeProp prints the traceback of a failing node itself: the one line below says it
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
                ShapeProp(traced).propagate(*sample)
        except Exception as exc:
            exc = exc.__cause__ or exc  # ShapeProp's RuntimeError wraps the module's own
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise HarnessError(f"{self.target}: --input-shape {','.join(map(str, self.input_shape))}: the module "
                               f"fails on a {'token' if tokens else 'zero'} input of that shape "
                               f"({type(exc).__name__}: {clip(first_line, 160)})") from None
        finally:
            for name, m in self.model.named_modules():
                m.training = modes[name]
        return traced

    def nodes(self, traced: torch.fx.GraphModule) -> tuple[dict[str, Node], str, str]:
        """(the graph's tensor nodes by name, the input's name, the output's name); every node converted."""
        nodes: dict[str, Node] = {}
        start = end = None
        order: dict[str, tuple | None] = {}  # the [C, H, W] a node's features were flattened from, if any
        for fx in traced.graph.nodes:
            if fx.op == "placeholder":
                if fx.users:
                    start = fx.name
                    nodes[fx.name] = Node(fx, None, [])
                    order[fx.name] = None
                continue
            if fx.op == "output":
                result = fx.args[0]
                if not isinstance(result, torch.fx.Node):
                    raise ImportProblems([f"{self.target}: forward returns {type(result).__name__}: the spec has one "
                                          f"output tensor"])
                end = result.name
                continue
            if fx.op == "get_attr" or not _holds_tensors(fx):
                continue  # a tensor attribute (reported where it is used), or a size, a shape...
            inputs: list[str] = []
            torch.fx.node.map_arg((fx.args, fx.kwargs), lambda a: inputs.append(a.name)
                                  if a.op == "get_attr" or _holds_tensors(a) else None)
            node = Node(fx, traced.get_submodule(fx.target) if fx.op == "call_module" else None, inputs)
            nodes[fx.name] = node
            self.convert(node)
            order[fx.name] = self.flat_order(node, order)
        if start is None or end is None:
            raise ImportProblems([f"{self.target}: forward takes or returns no tensor"])
        return nodes, start, end

    def convert(self, node: Node) -> None:
        fx = node.fx
        inputs = [a for a in fx.all_input_nodes if _holds_tensors(a)]
        shape = _shape(inputs[0]) if inputs else None
        key = fx.target if fx.op in ("call_function", "call_method") else None
        try:
            if fx.op == "call_module":
                rule = next((rule for cls, rule in MODULES.items() if type(node.module) is cls), None)
                if rule is None:
                    mapped = ", ".join(cls.__name__ for cls in MODULES)
                    raise Problem(f"module class {type(node.module).__name__}", f"not in the spec (mapped: {mapped})")
                layers = rule(node.module, shape)
                if isinstance(node.module, nn.Embedding):
                    self.vocab = node.module.num_embeddings
                    embedding_note(self, node.where, node.module)
                if isinstance(node.module, (nn.BatchNorm1d, nn.BatchNorm2d)):
                    self.batchnorm = True
            elif key in ADDS:
                if fx.kwargs.get("alpha", 1) != 1:
                    raise Problem(f"alpha {_show(fx.kwargs['alpha'])}", "a residual adds its branches as they are")
                if any(not isinstance(a, torch.fx.Node) for a in fx.args) or len(node.inputs) != 2:
                    raise Problem(f"arguments {_show(fx.args)}", "adds a constant: the spec adds only a residual "
                                  "block's two branches")
                self.adds.add(node.name)
                return
            elif fx.op in ("call_function", "call_method") and key in FUNCTIONS:
                if len(inputs) != 1 and not (fx.op == "call_method" and key in ("view", "reshape")):
                    raise Problem("inputs", f"takes {len(inputs)} tensors: only an add (x + y) joins branches in "
                                  f"the spec")
                layers = FUNCTIONS[key](fx, shape)
            else:
                raise Problem("call", f"not in the spec (mapped functions: {_mapped()})")
        except Problem as exc:
            self.problem(node.where, str(exc))
            return
        self.converted[node.name] = [dict(layer, _source=node.source) for layer in layers]

    def flat_order(self, node: Node, order: dict[str, tuple | None]) -> tuple | None:
        """The [C, H, W] whose C, H, W-order flatten `node`'s output features follow (None: none, or not flat)."""
        known = [order.get(name) for name in node.inputs]
        if node.name in self.adds:
            if len(set(known)) > 1:
                self.problem(node.where, "adds features flattened from an image (PyTorch's C, H, W order) to "
                             "features in another order: the spec flattens in H, W, C order, which no weight "
                             "permutation reconciles here")
            return known[0] if known else None
        layers = self.converted.get(node.name)
        before = known[0] if known else None
        if not layers:  # nn.Identity, Tensor.contiguous (or a problem, reported)
            return before
        kind = layers[0]["type"]
        shape = _shape(node.fx.all_input_nodes[0]) if node.fx.all_input_nodes else None
        if kind == "flatten" and shape is not None and len(shape) == 4:  # PyTorch's C, H, W order
            return tuple(shape[1:]) if shape[2] * shape[3] > 1 else None
        if before is None:
            return None
        if kind in ("dense", "batchnorm", "layernorm"):  # a dense's input rows, a norm's features: permuted
            layers[0]["_flattened"] = before
        return before if kind in FEATUREWISE else None

    def input_spec(self) -> dict:
        shape = self.input_shape
        if len(shape) == 3:  # C, H, W -> the spec's H, W, C
            return {"shape": [shape[1], shape[2], shape[0]]}
        return {"shape": list(shape)} | ({"vocab": self.vocab} if self.vocab is not None else {})


def import_nn_module(model: nn.Module, input_shape: tuple[int, ...], options: ImportOptions | None = None,
                  target: str | None = None) -> Imported:
    """An nn.Module as a validated spec (ImportProblems: everything the spec cannot express, one line each)."""
    options = options or ImportOptions()
    target = target or type(model).__name__
    importer = TorchImporter(target, model, input_shape)
    layers = importer.read()
    if not layers and not importer.problems:
        importer.problems.append(f"{target}: forward computes nothing the spec can hold")
    if importer.problems:
        raise ImportProblems(importer.problems)
    notes = importer.notes
    notes.append("the module's own weights are not read: the core draws every initial weight "
                 "(harness.model.weights); canonical_weights in amp_harness_torch.importer copies them")
    if importer.batchnorm:
        notes.append("PyTorch's BatchNorm updates its running variance with the unbiased batch variance, the spec's "
                     "batchnorm with the biased one (momentum is written as the spec's 1 - PyTorch's)")
    input_ = importer.input_spec()
    loss, why = default_loss(layers)
    notes.append(f"a torch module holds no loss: {why}")
    notes.append("a torch module holds no optimizer: adam with torch.optim.Adam's defaults (learning_rate 0.001, "
                 "betas 0.9 and 0.999, epsilon 1e-8 outside the square root: the spec's adam); edit the spec for "
                 "another")
    name = target.rpartition(":")[2].rpartition(".")[2] or type(model).__name__
    tags: dict[str, dict] = {}
    spec = {
        "name": clip(name, 100),
        "description": f"Imported from the PyTorch module {target} ({type(model).__name__}) by `amp-harness import "
                       f"torch` with input {list(input_shape)}.",
        "input": input_,
        "dataset": dataset(options.dataset, input_, layers, loss, notes),
        "layers": untag(layers, "", tags),
        "loss": loss,
        "optimizer": dict(DEFAULT_OPTIMIZER),
        "batch_size": options.batch_size or DEFAULT_BATCH_SIZE,
        "steps": options.steps or DEFAULT_STEPS,
        "seed": 0,
    }
    if options.batch_size is None or options.steps is None:
        notes.append(f"batch_size {spec['batch_size']} and steps {spec['steps']}: a torch module says neither "
                     f"(--batch-size and --steps set them)")
    sources = tags.get("_source", {})
    if importer.graph is None:
        spec = finish(spec, sources, target, "the torch module")
        return Imported(spec, notes, sources, tags.get("_flattened", {}))
    from amp_harness_torch.importer_export import TorchImported

    weights = tags.get("_weights", {})
    shared = _shared(importer, weights, notes)
    spec = finish(spec, sources, target, "the torch module")
    return TorchImported(spec, notes, sources, tags.get("_flattened", {}), weights, shared,
                         importer.unused_parameters)


def _shared(importer, weights: dict[str, dict[str, tuple]], notes: list[str]) -> int:
    """The parameters the spec holds more than once (a tied or shared weight), with a note for each tensor."""
    tensors = importer.graph.tensors
    uses: dict[tuple, list[str]] = {}
    for path, params in weights.items():
        for param, (fqn, _, part) in params.items():
            if fqn is not None and fqn in tensors:
                tensor = tensors[fqn]
                uses.setdefault((tensor.data_ptr(), tuple(tensor.shape), part), []).append(fqn)
    extra = 0
    for (_, shape, part), names in uses.items():
        if len(names) > 1:
            size = math.prod(shape) // (part[1] if part else 1)
            extra += size * (len(names) - 1)
            notes.append(f"{' and '.join(dict.fromkeys(names))} are one tensor (tied or shared weights) used "
                         f"{len(names)} times: the spec holds {len(names)} weights, {size * (len(names) - 1):,} "
                         f"parameters more than the module, which train apart")
    return extra


def _required_arguments(model: nn.Module) -> list[str] | None:
    """The names of forward's arguments without defaults (None: not read)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.default is inspect.Parameter.empty and
            p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def import_torch(target: str, input_shape: tuple[int, ...], options: ImportOptions | None = None) -> Imported:
    """`amp-harness import torch MODULE:ATTR --input-shape ...` (TorchAdapter.import_model)."""
    return import_nn_module(load_module(target), input_shape, options, target)


# ---- weights ------------------------------------------------------------------------------------------------
TORCH_NAMES = {  # canonical parameter -> the torch module's attribute
    "kernel": "weight", "bias": "bias", "gamma": "weight", "beta": "bias", "moving_mean": "running_mean",
    "moving_variance": "running_var", "embeddings": "weight",
}


def flatten_permutation(chw: tuple[int, int, int]) -> np.ndarray:
    """perm such that features_hwc = features_chw[perm]: the spec's H, W, C flatten from PyTorch's C, H, W one."""
    c, h, w = chw
    return np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).reshape(-1)


def canonical_weights(model: nn.Module, imported: Imported, dtype=np.float32) -> dict[str, np.ndarray]:
    """The module's own weights (and batchnorm statistics) in the spec's canonical names and layouts
    (harness.model.weights), for the network built from `imported.spec`, in `dtype`: kernels from channels-first,
    and the rows of a dense after a flatten (and the features of a norm between) permuted from C, H, W to H, W, C
    order. A torch.export import (importer_export.TorchImported) names each weight's parameter and layout: a Linear's
    [out, in] transposed, a Conv1D's [in, out] as it is, a fused q, k, v projection split in three."""
    from harness.model.graph import infer
    from harness.model.spec import validate
    from harness.model.weights import from_channels_first

    graph = infer(validate(imported.spec, imported.spec["name"]))
    sources = getattr(imported, "weights", None)
    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    out = {}
    for info in graph.layers:
        if not info.params:
            continue
        perm = flatten_permutation(imported.flattened[info.path]) if info.path in imported.flattened else None
        for param, shape in info.params.items():
            name = f"{info.path}.{param}"
            if sources is not None:
                fqn, layout, part = sources[info.path][param]
                value = tensors[fqn].detach().cpu().double().numpy()
                if layout == "linear":
                    value = value.T
                elif layout == "conv":
                    value = value.transpose(2, 3, 1, 0)
                elif isinstance(layout, tuple) and layout[0] == "row":
                    value = value[layout[1]]
                if part is not None:
                    index, count = part
                    width = value.shape[-1] // count
                    value = value[..., index * width:(index + 1) * width]
                value = value.reshape(shape)
            else:
                module = model.get_submodule(imported.sources[info.path])
                value = from_channels_first(getattr(module, TORCH_NAMES[param]).detach().cpu().double().numpy(), name)
            if perm is not None and (info.type != "dense" or param == "kernel"):
                value = value[perm]  # a dense's input rows ([in, out]; not its bias), a norm's features
            assert value.shape == tuple(shape), (name, value.shape, shape)
            out[name] = np.ascontiguousarray(value, dtype=dtype)
    return out
