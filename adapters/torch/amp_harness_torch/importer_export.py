"""The PyTorch importer's first reading of a module: torch.export.export's ATen graph, mapped to spec layers.

torch.export (non-strict, eval mode, one zero or token-id input of batch SHAPE_BATCH) records every ATen op the
forward runs and, per op, the stack of modules that called it (`node.meta["nn_module_stack"]`). The graph is read
in four steps:

1. Values. Every node is *data* (it depends on the input) or *static* (parameters, buffers, constants and what is
   computed from them alone: position ids, attention masks, rotary tables). One run of the graph on the sample gives
   every static node's value. Ops that change nothing (alias, clone, contiguous, a `to` of the same dtype, a view to
   the same shape, a zero pad, a dropout of 0, a concatenation with empty tensors) are looked through.
2. Units. The data ops of one call of a *known leaf module* (Linear, Hugging Face's Conv1D, Conv2d, the norms,
   Embedding, Dropout, pools, activations; a parameterless module whose values are one of the spec's activations;
   an RMSNorm whose values are the spec's rmsnorm) are one unit, whatever ATen ops it lowered to; every other data
   op is a unit of its own (the glue between modules).
3. Patterns. Each scaled_dot_product_attention is read with its surroundings: q, k and v must be the heads of
   projections of one tensor (three Linears or Conv1Ds, or one fused projection whose output is q, k, v in that
   order along its last axis), the heads' outputs merged back and projected by a Linear; the index maps of every
   view, transpose, split and select between them are checked by running them on tensors of indices, so any
   layout that computes the spec's head split is read, and no other; key/value projections of G heads repeated
   for the query heads (Llama's repeat_kv: expand and reshape) or given to SDPA as they are (enable_gqa) are
   kv_heads G. Where ops other than layout ones lie between a q or k projection and SDPA, they must be the spec's
   rotary, which is read by its values: those ops, run on a table of random values with the sample's static
   operands (the cos and sin tables the model computed), must give the heads turned as harness.model.rotary turns
   them, by one pairing, with the base read from the turn of the lowest frequency at position 1; q and k alike.
   Masks are read from their values: none, or causal. The dropout on the probabilities is what each call gets in
   a forward in training mode (_sdpa_dropouts). A Conv2d of kernel = stride = P whose output is flattened to a
   sequence of patches in row-major order is `patches`.
4. Layers. Each unit maps to spec layers; adds of two tensors are residual blocks where the graph is a chain with
   residual adds (harness.model.importers.Chain), else the graph is written with the spec's named tensors and
   merges (add, multiply, concat), as the Keras importer writes a functional graph. An embedding of constant ids
   0 added to the data (BERT's token types, not given) is a bias holding the table's row 0.

Every canonical weight is recorded with the module parameter it comes from and how (TorchImported.weights), which
is what amp_harness_torch.importer.canonical_weights copies.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import math
import operator
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from amp_harness_torch import importer_modules as base
from harness.errors import HarnessError, clip
from harness.model.importers import Chain, Imported, ImportProblems, Problem, name_tensors
from harness.model.rotary import rotary_tables

WRAPPER = "model"  # the attribute of the wrapper module that holds the user's model (stripped from every name)

#: ops that only move data (their index maps are run on tensors of indices)
LAYOUT = {"view", "reshape", "_unsafe_view", "transpose", "permute", "unflatten", "flatten", "squeeze", "unsqueeze",
          "select", "slice", "split", "split_with_sizes", "chunk", "unbind", "getitem", "expand", "t", "contiguous",
          "clone", "alias", "movedim", "lift_fresh_copy", "detach"}
SAME = {"alias", "clone", "contiguous", "detach", "detach_", "lift_fresh_copy", "alias_copy"}  # always the identity
SAME_IF_SHAPE = {"to", "_to_copy", "type_as", "view", "reshape", "_unsafe_view", "expand", "flatten", "squeeze",
                 "unsqueeze", "unflatten", "slice", "expand_as"}  # the identity where shape and dtype are kept
ROTARY = "rotary position embedding"
DROPOUTS = {"dropout", "dropout_", "feature_dropout", "feature_dropout_", "native_dropout"}


@dataclass
class TorchImported(Imported):
    #: canonical layer path -> {canonical weight: (the module's parameter or buffer, its layout, part)}: layout
    #: "linear" (torch's [out, in], transposed), "plain" (as it is), "conv" ([out, in, kH, kW] -> [kH, kW, in, out]),
    #: ("row", r): row r of a table (an embedding of constant ids: BERT's token-type row); part (i, n): the i-th of n
    #: equal slices of the last axis (a fused q, k, v projection)
    weights: dict[str, dict[str, tuple]] = field(default_factory=dict)
    #: parameters the spec holds twice (a tied or shared weight): the spec counts them once more per extra use
    shared_parameters: int = 0
    #: the module's parameters the spec does not hold (a constant-id embedding's other rows: BERT's token types)
    unused_parameters: int = 0


class CaptureFailed(Exception):
    """torch.export could not capture the module (the importer falls back to torch.fx)."""


# ---- small helpers --------------------------------------------------------------------------------------------
def _op(node: torch.fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[-1]
        # an in-place op (x.add_(y), relu_): export points every later use at its result, so it reads as the op
        return name[:-1] if name.endswith("_") and not name.endswith("__") else name
    return getattr(target, "__name__", str(target))


def _bound(node: torch.fx.Node) -> dict:
    """The op's arguments by their schema names (defaults filled in)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return {}
    out = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _shape(node) -> tuple[int, ...] | None:
    value = _val(node)
    return tuple(int(d) for d in value.shape) if isinstance(value, torch.Tensor) else None


def _strip(path: str) -> str | None:
    """A module path in the wrapper as the user's model names it (None: the wrapper itself)."""
    if path == WRAPPER:
        return ""
    if path.startswith(WRAPPER + "."):
        return path[len(WRAPPER) + 1:]
    return None


def _where_module(path: str, module: nn.Module) -> str:
    return f"module '{clip(path, 60)}' ({type(module).__name__})"


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2's projections): a Linear whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers") and \
        getattr(module, "weight", None) is not None and module.weight.dim() == 2


ACTIVATION_PROBE = torch.linspace(-8.0, 8.0, 2001, dtype=torch.float64).reshape(1, -1)


def _activations() -> dict[str, object]:
    import torch.nn.functional as F

    return {"relu": torch.relu, "relu6": lambda x: x.clamp(0, 6), "sigmoid": torch.sigmoid, "tanh": torch.tanh,
            "silu": F.silu, "hard_swish": lambda x: x * (x + 3).clamp(0, 6) / 6, "gelu": F.gelu,
            "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _identify(module: nn.Module) -> list[dict] | None:
    """A module without parameters or children whose values are one of the spec's activations (Hugging Face's
    GELUActivation, NewGELUActivation...), or an RMSNorm whose values are the spec's rmsnorm; None otherwise."""
    if any(True for _ in module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    try:
        if not params:
            with torch.no_grad():
                y = module(ACTIVATION_PROBE.clone())
            if not isinstance(y, torch.Tensor) or y.shape != ACTIVATION_PROBE.shape:
                return None
            for name, fn in _activations().items():
                expected = fn(ACTIVATION_PROBE)
                if torch.allclose(y.double(), expected, rtol=1e-12, atol=1e-12):
                    return [{"type": "gelu", "approximate": True}] if name == "gelu_tanh" else [{"type": name}]
            return None
        if "RMSNorm" in type(module).__name__ and list(params) == ["weight"] and params["weight"].dim() == 1:
            eps = next((getattr(module, key) for key in ("variance_epsilon", "eps", "epsilon")
                        if isinstance(getattr(module, key, None), float)), None)
            if eps is None:
                return None
            dim = params["weight"].shape[0]
            x = torch.randn((2, 3, dim), generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 3
            with torch.no_grad():
                y = module(x)
                w = params["weight"].detach().float()
                expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
            if isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y.float(), expected, rtol=1e-5,
                                                                                      atol=1e-5 * float(w.abs().max())):
                return [{"type": "rmsnorm", "epsilon": eps}]
    except Exception:  # noqa: BLE001 - a module the probe does not fit is simply not identified
        return None
    return None


# ---- the units ------------------------------------------------------------------------------------------------
@dataclass
class Dense:
    """What a projection is made of: the parameters of its kernel and bias and the kernel's layout."""
    kernel: str
    bias: str | None
    layout: str  # "linear" (torch's [out, in]) or "plain" ([in, out]: Conv1D)


@dataclass
class Unit:
    name: str  # the name of its output node: what later units take
    nodes: list[torch.fx.Node]
    where: str
    source: str  # Imported.sources: the module's path, or the calling module's (or the node's name)
    module: nn.Module | None = None
    path: str | None = None  # the module's qualified name (a leaf module's unit)
    entry: torch.fx.Node | None = None  # the raw node its first data input comes from (outside it)
    inputs: list[str] = field(default_factory=list)
    layers: list[dict] | None = None  # its spec layers, tagged (None: refused)
    merge: str | None = None  # "add", "multiply" or "concat" of its inputs
    kind: str = "module"  # "module", "call", "attention", "patches"
    refused: bool = False  # a problem was reported for it: it gives no layers and no more lines

    @property
    def output(self) -> torch.fx.Node:
        return self.nodes[-1]


class ExportedGraph:
    """A module captured by torch.export and read into units and spec layers (the module docstring)."""

    def __init__(self, importer, model: nn.Module):
        self.importer, self.model = importer, model
        self.modules = dict(model.named_modules())
        self.tensors = {**dict(model.named_parameters(remove_duplicate=False)),
                        **dict(model.named_buffers(remove_duplicate=False))}
        self._identified: dict[int, list[dict] | None] = {}
        self._static_ops: dict[torch.fx.Node, set[str]] = {}
        self._identities: dict[torch.fx.Node, bool] = {}

    # -- capture ---------------------------------------------------------------------------------------------
    def capture(self, sample: torch.Tensor) -> None:
        """Export the module (CaptureFailed: torch.export cannot), then read every static node's value."""
        model = self.model
        keywords = {"use_cache": False} if _takes(model, "use_cache") else {}

        class Wrapper(nn.Module):
            def __init__(self):
                super().__init__()
                setattr(self, WRAPPER, model)

            def forward(self, x):
                return _output(getattr(self, WRAPPER)(x, **keywords))

        wrapper = Wrapper().eval()
        try:
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), _quiet_torch_logs():
                warnings.simplefilter("ignore")
                self.program = torch.export.export(wrapper, (sample,), strict=False)
        except HarnessError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the capture: the fx reading is tried instead
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CaptureFailed(f"{type(exc).__name__}: {clip(first, 160)}") from None
        self.graph = self.program.graph_module.graph
        signature = self.program.graph_signature
        self.kinds: dict[str, tuple[str, str | None]] = {}  # placeholder name -> (kind, the user's name for it)
        for spec in signature.input_specs:
            target = spec.target
            name = _strip(target) if isinstance(target, str) else None
            self.kinds[spec.arg.name] = (spec.kind.name, name if name is not None else target)
        outputs = [spec.arg.name for spec in signature.output_specs if spec.kind.name == "USER_OUTPUT"]
        if len(outputs) != 1:
            raise ImportProblems([f"{self.importer.target}: forward returns {len(outputs)} tensors: the spec has one "
                                  f"output tensor"])
        nodes = list(self.graph.nodes)
        self.order = {node: i for i, node in enumerate(nodes)}
        self.user_input = next(n for n in nodes if n.op == "placeholder" and self.kinds[n.name][0] == "USER_INPUT")
        self.end_node = next(n for n in nodes if n.name == outputs[0])
        self.values = self._run(sample)
        self.data: set[torch.fx.Node] = set()
        for node in nodes:
            if node is self.user_input or (node.op == "call_function" and
                                           any(a in self.data for a in node.all_input_nodes)):
                self.data.add(node)
        self.sdpa_nodes = [n for n in nodes if n.op == "call_function" and _op(n) == "scaled_dot_product_attention"]
        rates = _sdpa_dropouts(model, sample, keywords)
        self.attention_dropouts = dict(zip(self.sdpa_nodes, rates)) if len(rates or ()) == len(self.sdpa_nodes) \
            else {}
        if self.end_node not in self.data:
            raise ImportProblems([f"{self.importer.target}: the output does not depend on the input"])
        self.rep: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in nodes:
            if node in self.data:
                ins = self.data_inputs(node)
                self.rep[node] = self.rep[ins[0]] if node is not self.user_input and self.identity(node) else node
        self.users: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}  # raw data users
        for node in nodes:
            if node in self.data and node is not self.user_input and _val(node) is not None:  # not an assert
                for arg in self.data_inputs(node):
                    self.users[arg].append(node)

    def _run(self, sample: torch.Tensor) -> dict:
        """Every node's value on the sample (eval mode, no gradients)."""
        state, constants = self.program.state_dict, self.program.constants
        args = []
        for node in self.graph.nodes:
            if node.op != "placeholder":
                continue
            kind, _ = self.kinds[node.name]
            spec = next(s for s in self.program.graph_signature.input_specs if s.arg.name == node.name)
            if kind == "USER_INPUT":
                args.append(sample)
            elif spec.target in state:
                args.append(state[spec.target])
            else:
                args.append(constants[spec.target])
        values: dict = {}

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                values[n] = out
                return out

        with torch.no_grad():
            Recorder(self.program.graph_module).run(*args)
        return values

    # -- what a node is --------------------------------------------------------------------------------------
    def data_inputs(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The data nodes a node takes, in argument order (repeats kept)."""
        out: list[torch.fx.Node] = []
        torch.fx.node.map_arg((node.args, node.kwargs), lambda a: out.append(a) if a in self.data else None)
        return out

    def identity(self, node: torch.fx.Node) -> bool:
        """The node gives its one data input unchanged."""
        if node not in self._identities:
            self._identities[node] = self._identity(node)
        return self._identities[node]

    def _identity(self, node: torch.fx.Node) -> bool:
        op, ins = _op(node), self.data_inputs(node)
        if op == "cat":
            parts = node.args[0]
            data = [p for p in parts if p in self.data]
            return len(data) == 1 and all(p in self.data or _numel(p) == 0 for p in parts)
        if len(set(ins)) != 1:
            return False
        if op in SAME:
            return True
        if op in SAME_IF_SHAPE:
            before, after = _val(ins[0]), _val(node)
            same = isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and \
                before.shape == after.shape and before.dtype == after.dtype
            if op == "slice":
                return same and _bound(node).get("step", 1) == 1
            return same
        args = _bound(node)
        if op in ("pad", "constant_pad_nd"):
            return all(p == 0 for p in args.get("pad") or [])
        if op in DROPOUTS:
            return args.get("p") == 0
        if op in ("mul", "div") and len(node.args) == 2 and node.args[1] == 1 and not isinstance(node.args[1], bool):
            return True
        if op in ("add", "sub") and len(node.args) == 2 and node.args[1] == 0 and args.get("alpha", 1) == 1:
            return True
        return False

    def param_name(self, node) -> str | None:
        """The user's name of the parameter or buffer a placeholder holds (None: not one)."""
        if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
            return None
        kind, name = self.kinds.get(node.name, (None, None))
        return name if kind in ("PARAMETER", "BUFFER") else None

    def stack(self, node: torch.fx.Node) -> list[tuple[str, str, nn.Module]]:
        """(call key, path, module) from the outermost module to the innermost; the wrapper left out."""
        out = []
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            path = _strip(path)
            if path is None or path not in self.modules:
                continue
            out.append((key, path, self.modules[path]))
        return out

    def owner(self, node: torch.fx.Node) -> tuple[str, nn.Module | None]:
        stack = self.stack(node)
        return (stack[-1][1], stack[-1][2]) if stack else ("", None)

    def call_where(self, node: torch.fx.Node) -> str:
        path, module = self.owner(node)
        caller = _where_module(path, module) if module is not None and path else "forward"
        at = ""
        trace = node.meta.get("stack_trace") or ""
        frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
        if frames:
            file, line = frames[-1]
            at = f", {file.rsplit('/', 1)[-1]}:{line}"
        return f"{caller} calls aten.{_op(node)} (node '{clip(node.name, 40)}'{at})"

    def static_ops(self, node: torch.fx.Node) -> set[str]:
        """The ops a static node is computed with (its static ancestry)."""
        if node not in self._static_ops:
            ops, seen, stack = set(), set(), [node]
            while stack:
                current = stack.pop()
                if current in seen or current in self.data:
                    continue
                seen.add(current)
                if current.op == "call_function":
                    ops.add(_op(current))
                stack += current.all_input_nodes
            self._static_ops[node] = ops
        return self._static_ops[node]

    # -- leaf modules ----------------------------------------------------------------------------------------
    def leaf(self, node: torch.fx.Node):
        """(call key, path, module) of the outermost known leaf module that called the node, or None."""
        for key, path, module in self.stack(node):
            if self.is_leaf(module):
                return key, path, module
        return None

    def is_leaf(self, module: nn.Module) -> bool:
        if type(module) in base.MODULES or _is_conv1d(module):
            return True
        if type(module).__module__.startswith("torch.nn.modules") and not any(True for _ in module.children()):
            return True  # a torch.nn layer the table does not map: refused by its class
        return self.identified(module) is not None

    def identified(self, module: nn.Module) -> list[dict] | None:
        key = id(module)
        if key not in self._identified:
            builtin = type(module).__module__.startswith("torch.nn.modules")
            self._identified[key] = None if builtin else _identify(module)
        return self._identified[key]

    # -- units -----------------------------------------------------------------------------------------------
    def build_units(self) -> None:
        self.units: list[Unit] = []
        self.owner_of: dict[torch.fx.Node, Unit] = {}
        current, current_key = None, None
        for node in self.graph.nodes:
            if node not in self.data or node is self.user_input or self.rep[node] is not node:
                continue
            if not isinstance(_val(node), torch.Tensor) and _op(node) not in ("split", "split_with_sizes", "chunk",
                                                                               "unbind", "adaptive_max_pool2d",
                                                                               "max_pool2d_with_indices"):
                continue  # asserts and the like
            leaf = self.leaf(node)
            if leaf is not None and current is not None and current_key == leaf[0]:
                current.nodes.append(node)
                self.owner_of[node] = current
                continue
            if leaf is not None:
                key, path, module = leaf
                current = Unit(node.name, [node], _where_module(path, module), path, module, path, kind="module")
                current_key = key
            else:
                current, current_key = Unit(node.name, [node], self.call_where(node), self.source_of(node),
                                            kind="call"), None
            self.units.append(current)
            self.owner_of[node] = current
        for unit in self.units:
            self.wire(unit)

    def source_of(self, node: torch.fx.Node) -> str:
        path, _ = self.owner(node)
        return path or node.name

    def wire(self, unit: Unit, report: bool = False) -> None:
        """A unit's output node (the one the rest uses, put last), its inputs and its entry."""
        inside = set(unit.nodes)
        end = self.rep[self.end_node]
        used = [n for n in unit.nodes if n is end or any(u not in inside for u in self._rep_users(n))]
        if len(used) > 1 and report and not unit.refused:
            self.importer.problem(unit.where, f"gives {len(used)} tensors that the rest of the model uses: a spec "
                                  f"layer gives one")
        if used:
            unit.nodes = [n for n in unit.nodes if n is not used[-1]] + [used[-1]]
            unit.name = used[-1].name
        unit.inputs, unit.entry = [], None
        for node in sorted(unit.nodes, key=lambda n: self.order[n]):
            for arg in self.data_inputs(node):
                source = self.rep[arg]
                if source in inside:
                    continue
                if unit.entry is None:
                    unit.entry = arg
                unit.inputs.append(self.tensor_name(source, report))

    def _rep_users(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The nodes that take `node`'s value, looking through identities."""
        out, stack = [], list(self.users[node])
        while stack:
            user = stack.pop()
            if self.rep[user] is not user:
                stack += self.users[user]
            else:
                out.append(user)
        return out

    def tensor_name(self, node: torch.fx.Node, report: bool = False) -> str:
        """The name of the unit whose output a (rep) node is, or the input's."""
        if node is self.user_input:
            return node.name
        unit = self.owner_of.get(node)
        if unit is None:
            return node.name
        if unit.output is not node and report and not unit.refused:
            self.importer.problem(unit.where, f"a tensor inside it (node '{clip(node.name, 40)}') is used outside "
                                  f"it: a spec layer gives one tensor")
        return unit.name

    def replace(self, old: list[Unit], new: Unit) -> None:
        """`new` in place of the units `old` (at the first one's place)."""
        first = min(self.units.index(u) for u in old)
        for unit in old:
            self.units.remove(unit)
        self.units.insert(first, new)
        for node in new.nodes:
            self.owner_of[node] = new
        self.units.sort(key=lambda u: self.order[u.output])

    def rewire(self, report: bool = False) -> None:
        for unit in self.units:
            self.wire(unit, report)

    # -- dense units -----------------------------------------------------------------------------------------
    def dense_of(self, unit: Unit) -> Dense | None:
        """A projection's parameters: a Linear or Conv1D module's, or a linear call's on parameters."""
        if unit.kind == "module" and isinstance(unit.module, nn.Linear) and type(unit.module) in _linear_types():
            prefix = f"{unit.path}." if unit.path else ""
            return Dense(prefix + "weight", prefix + "bias" if unit.module.bias is not None else None, "linear")
        if unit.kind == "module" and _is_conv1d(unit.module):
            prefix = f"{unit.path}." if unit.path else ""
            return Dense(prefix + "weight", prefix + "bias" if getattr(unit.module, "bias", None) is not None
                         else None, "plain")
        if unit.kind == "call" and _op(unit.output) == "linear":
            args = _bound(unit.output)
            kernel, bias = self.param_name(args.get("weight")), args.get("bias")
            if kernel is not None and (bias is None or self.param_name(bias) is not None):
                return Dense(kernel, self.param_name(bias) if bias is not None else None, "linear")
        return None

    # -- index maps ------------------------------------------------------------------------------------------
    def run_chain(self, chain: list[torch.fx.Node], value: torch.Tensor) -> torch.Tensor | None:
        """`value` (a tensor of indices standing for the chain's first input) through the layout ops `chain`, each
        taking the one before; None where an op does not run on it."""
        previous = None
        for node in chain:
            ins = self.data_inputs(node)
            if previous is not None and ins and ins[0] is not previous and self.rep.get(ins[0]) is not previous:
                return None
            previous = node
            if self.identity(node):
                continue
            if _op(node) == "getitem":
                value = value[node.args[1]]
                continue
            data = self.data_inputs(node)[0]
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                                 lambda a: value if a is data else self.values.get(a))
            value = _apply(node, args, kwargs)
            if value is None:
                return None
        return value

    def back_chain(self, node: torch.fx.Node, stop) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
        """Walk back from `node` through layout ops to a node `stop` accepts: (that node, the ops from it to `node`),
        or (None, ...) where something else is met."""
        chain: list[torch.fx.Node] = []
        while not stop(node):
            ins = self.data_inputs(node)
            if node is self.user_input or len(set(ins)) != 1 or not (self.identity(node) or _op(node) in LAYOUT):
                return None, chain
            chain.insert(0, node)
            node = ins[0]
        return node, chain

    def forward_chains(self, node: torch.fx.Node) -> list[tuple[torch.fx.Node, list[torch.fx.Node]]]:
        """(node, the layout ops from `node` to it) for `node` and each node after it along single-user layout
        ops."""
        out, chain = [(node, [])], []
        while len(self.users[node]) == 1:
            user = self.users[node][0]
            if not (self.identity(user) or _op(user) in LAYOUT) or len(set(self.data_inputs(user))) != 1:
                break
            chain = chain + [user]
            node = user
            out.append((node, chain))
        return out

    # -- attention -------------------------------------------------------------------------------------------
    def attention(self, sdpa: torch.fx.Node) -> None:
        """Read one scaled_dot_product_attention with its projections (the module docstring, step 3)."""
        args = _bound(sdpa)
        path, module = self.owner(sdpa)
        where = _where_module(path, module) if module is not None else self.call_where(sdpa)
        dense_units = {u.output: u for u in self.units if self.dense_of(u) is not None}
        found = {}
        for part in ("query", "key", "value"):
            producers = self.producers(args[part], dense_units)
            if len(producers) != 1:
                self.importer.problem(where, f"attention: its {part} is not the heads of one projection (a Linear "
                                      f"or Conv1D of the attention's input): not the spec's attention")
                return self.absorb_failed(sdpa, where)
            found[part] = producers[0]
        out = self.output_projection(sdpa, dense_units)
        q_shape = _shape(args["query"])
        if out is None or q_shape is None or len(q_shape) != 4:
            self.importer.problem(where, "attention: its heads are not merged back and projected by one Linear: not "
                                  "the spec's attention")
            return self.absorb_failed(sdpa, where)
        out_unit, mid_chain = out
        heads, head_dim = q_shape[1], q_shape[3]
        distinct = len({id(u) for u in found.values()})
        fused = distinct == 1
        if distinct == 2:
            self.importer.problem(where, "attention: two of q, k and v come from one projection and the third from "
                                  "another: the spec's attention reads three projections, or one that gives q, k "
                                  "and v")
            self.absorb_failed(sdpa, where)
            return self.absorb(sdpa, found, out_unit, None, where, None)
        try:
            x, _, fields = self.attention_input(found, fused, heads, head_dim, args)
            y = self.attention_output(sdpa, out_unit, mid_chain, heads, head_dim)
            layer = self.attention_layer(sdpa, args, module, heads, head_dim, found, out_unit, fused) | fields
        except Problem as exc:
            self.importer.problem(where, f"attention: {exc}")
            self.absorb_failed(sdpa, where)
            mask = args.get("attn_mask")
            if mask is not None and mask in self.data:  # the mask's own ops say nothing more
                own = self.ancestors(mask) - self.ancestors(self.rep[next(iter(found.values())).entry])
                for unit in self.units:
                    if any(n in own for n in unit.nodes):
                        unit.refused, unit.where = True, where
            return self.absorb(sdpa, found, out_unit, None, where, None)
        self.absorb(sdpa, found, out_unit, (x, y), where, layer)

    def producers(self, node: torch.fx.Node, dense_units: dict) -> list[Unit]:
        """The projection units a q, k or v is computed from (any data ops between)."""
        seen, stack, found = set(), [node], []
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            rep = self.rep[current]
            if rep in dense_units:
                if dense_units[rep] not in found:
                    found.append(dense_units[rep])
                continue
            if current is self.user_input:
                return []
            stack += self.data_inputs(current)
        return found

    def output_projection(self, sdpa: torch.fx.Node, dense_units: dict):
        """(the Linear that projects the merged heads, the layout ops from the attention's output to it)."""
        entries = {}
        for unit in dense_units.values():
            if unit.entry is not None:
                entries.setdefault(unit.entry, []).append(unit)
        for node, chain in self.forward_chains(sdpa):
            users = self.users[node]
            if len(users) == 1 and len(entries.get(node, [])) == 1 and users[0] in entries[node][0].nodes:
                return entries[node][0], chain
        return None

    def attention_input(self, found: dict, fused: bool, heads: int, head_dim: int, args: dict):
        """The attention's input tensor (checked: q, k and v are its projections' heads in the spec's order, q and k
        turned by the spec's rotary or not at all), the layout ops before the projections and the layer's fields
        that say so (kv_heads, rotary)."""
        units = list({id(u): u for u in found.values()}.values())
        entries = {u.entry for u in units}
        if len(entries) != 1:
            raise Problem("inputs", "q, k and v are projections of different tensors: the spec's attention is "
                          "self-attention")
        entry = units[0].entry
        allowed = {n for u in units for n in u.nodes}
        candidates, node, chain = [(entry, [])], entry, []
        while node is not self.user_input and (self.identity(node) or _op(node) in LAYOUT) and \
                len(set(self.data_inputs(node))) == 1 and all(u in allowed for u in self.users[node]):
            allowed.add(node)
            chain = [node] + chain
            node = self.data_inputs(node)[0]
            candidates.append((node, list(chain)))
        between = None
        for x, pre in reversed(candidates):
            shape = _shape(x)
            if shape is None or len(shape) != 3 or shape[2] != heads * head_dim:
                continue
            fields, problem = self.check_projections(x, pre, found, fused, heads, head_dim, args)
            if fields is not None:
                return x, pre, fields
            between = between or problem
        if between is not None:
            raise between
        raise Problem("heads", f"q, k and v are not the heads of {heads} x {head_dim} columns of their projections "
                      f"of a sequence [N, T, D] in the spec's order (head h: columns h*Dh .. (h+1)*Dh-1; a fused "
                      f"projection: q, k, v along its last axis; grouped key/value heads: query head h reads key/value "
                      f"head h // (H/G))")

    def check_projections(self, x, pre, found, fused, heads, head_dim, args) -> tuple[dict | None,
                                                                                     Problem | None]:
        """(the layer's fields kv_heads and rotary) where q, k and v are the heads of the projections of x (through
        the layout ops `pre`) in the spec's order, key/value head h // (H/G) repeated for query head h (repeat_kv,
        or SDPA's enable_gqa), q and k turned alike by the spec's rotary or not at all; else (None, the problem
        with what lies between a projection and SDPA, or None: not its heads)."""
        n, length, dim = _shape(x)
        rows = self.run_chain(pre, torch.arange(n * length * dim, dtype=torch.float64).reshape(n, length, dim))
        if rows is None or rows.shape[-1] != dim or not bool((rows % dim == torch.arange(dim)).all()):
            return None, None
        rows = torch.div(rows[..., 0], dim, rounding_mode="floor")  # the row (n * T + t) of x each row came from
        nn_, tt, dd = (torch.arange(s, dtype=torch.float64) for s in (n, length, head_dim))
        widths = {part: _shape(unit.output)[-1] for part, unit in found.items()}
        kv_heads = heads if fused else widths["key"] // head_dim
        if widths["value"] != widths["key"] or not kv_heads:
            return None, None
        fields = {"kv_heads": kv_heads} if kv_heads != heads else {}
        turns = {}
        for part in ("value", "query", "key"):  # v first: its layout alone says whether these are the heads
            unit, width = found[part], widths[part]
            if _shape(unit.output)[:-1] != tuple(rows.shape):
                return None, None
            own = heads if part == "query" else kv_heads  # the heads its projection gives
            taken = (_shape(args[part]) or (0, 0))[1]  # the heads SDPA takes (own, or repeated to `heads`)
            if (width != (3 * dim if fused else own * head_dim)) or heads % own or \
                    taken not in ((heads, own) if args.get("enable_gqa") else (heads,)):
                return None, None
            offset = ("query", "key", "value").index(part) * dim if fused else 0
            hh = torch.div(torch.arange(taken), taken // own, rounding_mode="floor").double()  # its projection's head
            # for each element of the tensor SDPA takes, the element of the projection's output it is
            expected = (nn_[:, None, None, None] * length + tt[None, None, :, None]) * width + offset + \
                hh[None, :, None, None] * head_dim + dd[None, None, None, :]
            ids = rows[..., None] * width + torch.arange(width, dtype=torch.float64)
            start, post = self.back_chain(args[part], lambda node, u=unit: node is u.output)
            if start is not None:  # layout ops only
                got = self.run_chain(post, ids)
                if got is None or tuple(got.shape) != tuple(expected.shape) or not torch.equal(got, expected):
                    return None, None
                continue
            if part == "value":
                return None, None

            def run(table, unit=unit, ids=ids, end=args[part]):
                return self.run_region(unit.output, end, table[ids.long()])

            turns[part] = self.rotation(run, expected, n * length * width, head_dim)
            if turns[part] is None:
                region = self.between(unit.output, args[part])
                if any(_op(node) == "mul" and any(a not in self.data and self.static_ops(a) & {"cos", "sin"}
                                                  for a in node.all_input_nodes) for node in region):
                    return None, Problem(ROTARY, f"its {part} heads are not turned as the spec's rotary turns them "
                                         f"(dimension i with i + Dh/2: pairing half, Hugging Face's rotate_half; or "
                                         f"2i with 2i + 1: interleaved; by the angle t * base^(-2f/Dh) at position "
                                         f"t): a scaled or partial rotation is not in the spec")
                ops = sorted({f"aten.{_op(node)}" for node in region if not (self.identity(node) or
                                                                            _op(node) in LAYOUT)})
                return None, Problem(part, f"computed from its projection's heads by {', '.join(ops)}: neither "
                                     f"layout ops nor the spec's rotary")
        if turns:
            if len(turns) == 1:
                return None, Problem(ROTARY, f"turns its {next(iter(turns))} only: the spec's rotary turns the "
                                     f"queries and the keys")
            if turns["query"] != turns["key"]:
                return None, Problem(ROTARY, f"turns its queries ({_show_rotary(turns['query'])}) and its keys "
                                     f"({_show_rotary(turns['key'])}) differently: the spec's rotary turns both "
                                     f"alike")
            fields["rotary"] = turns["query"]
        return fields, None

    def rotation(self, run, expected: torch.Tensor, size: int, head_dim: int) -> dict | None:
        """The spec's rotary ({base, pairing}) that `run` computes, or None: `run` takes a table of `size` values
        and gives what SDPA takes as q (or k), [N, H, T, Dh], where element `expected[...]` of the table is what
        the spec's heads hold before they are turned. The base is read from the turn of the lowest frequency at
        position 1 (to 6 significant figures: float32 tables hold about 7); then every entry must match, to the
        precision of tables computed in float32 (as Hugging Face computes them: the angle t * inv_freq rounded to
        float32 is off by up to about t * 6e-8)."""
        length = expected.shape[2]
        if length < 2:
            raise Problem(ROTARY, "one position turns nothing: import with an input of 2 or more positions to read "
                          "the rotation")
        table = torch.rand(size, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2 - 1
        got = run(table)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
            return None
        before = table[expected.long()]  # the heads before they are turned
        tolerance = 1e-6 + 4 * length * torch.finfo(torch.float32).eps
        for pairing in ("half", "interleaved"):
            for radix in self.rotary_bases(run, expected, size, head_dim, pairing):
                cos, signed_sin, partner = (torch.from_numpy(t) for t in rotary_tables(length, head_dim, radix,
                                                                                       pairing))
                want = before * cos + before[..., partner] * signed_sin
                if torch.allclose(got.double(), want, rtol=0, atol=tolerance):
                    return {"base": radix, "pairing": pairing}
        return None

    def rotary_bases(self, run, expected, size, head_dim, pairing) -> list[float]:
        """The bases the turn of `pairing`'s lowest frequency at position 1 says (rounded to 6 significant figures,
        then as read); none where it is not a turn by an angle in (0, 1)."""
        if head_dim == 2:  # one frequency, whose angle is t whatever the base
            return [10000.0]
        low = head_dim // 2 - 1  # the lowest frequency: angle base^(-2 low / Dh) at position 1
        i = low if pairing == "half" else 2 * low
        _, signed_sin, partner = rotary_tables(2, head_dim, 10000.0, pairing)
        j = int(partner[i])
        table = torch.zeros(size, dtype=torch.float64)
        table[expected[:, 0, 1, i].long()] = 1.0  # head 0's dimension i at position 1, in every sample
        got = run(table)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
            return []
        out = got[0, 0, 1].double()
        angle = math.atan2(float(out[j]) * math.copysign(1.0, float(signed_sin[1, j])), float(out[i]))
        if not 0 < angle < 1:
            return []
        radix = math.exp(-math.log(angle) * head_dim / (2 * low))
        return [float(f"{radix:.6g}"), radix]

    def run_region(self, start: torch.fx.Node, end: torch.fx.Node, value: torch.Tensor) -> torch.Tensor | None:
        """`value` standing for `start`'s through the data ops on the paths from `start` to `end`, run as the model
        runs them, their other operands the static values of the sample; None where another data tensor enters or
        an op does not run on it."""
        computed = {start: value}
        for node in sorted(self.between(start, end), key=lambda n: self.order[n]):
            if any(a not in computed for a in self.data_inputs(node)):
                return None
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                                 lambda a: computed[a] if a in computed else self.values.get(a))
            if _op(node) == "getitem":
                computed[node] = args[0][args[1]]
                continue
            computed[node] = _apply(node, args, kwargs)
            if computed[node] is None:
                return None
        return computed.get(end)

    def attention_output(self, sdpa, out_unit: Unit, mid: list, heads: int, head_dim: int) -> torch.fx.Node:
        """The node whose value is the attention's output [N, T, D] (checked: the heads merged in the spec's order,
        projected, put back)."""
        n, _, length, _ = _shape(sdpa)
        dim = heads * head_dim
        ids = torch.arange(n * heads * length * head_dim, dtype=torch.float64).reshape(n, heads, length, head_dim)
        merged = self.run_chain(mid, ids)
        if merged is None or merged.shape[-1] != dim:
            raise Problem("heads", "the heads' outputs are not merged into a [N, T, D] in head order before the "
                          "output projection")
        sample = torch.div(merged, heads * length * head_dim, rounding_mode="floor")
        head = torch.div(merged, length * head_dim, rounding_mode="floor") % heads
        position = torch.div(merged, head_dim, rounding_mode="floor") % length
        column = merged % head_dim
        key = sample * length + position
        if not (bool((head * head_dim + column == torch.arange(dim)).all()) and
                bool((key == key[..., :1]).all())):
            raise Problem("heads", "the heads' outputs are not merged in the spec's order (head h: columns h*Dh .. "
                          "(h+1)*Dh-1) before the output projection")
        out_shape = _shape(out_unit.output)
        if out_shape[:-1] != tuple(key.shape[:-1]) or out_shape[-1] != dim:
            raise Problem("output projection", f"gives {list(out_shape[1:])}, not the model dimension {dim}")
        rows = key[..., 0][..., None] * dim + torch.arange(dim, dtype=torch.float64)
        expected = torch.arange(n * length * dim, dtype=torch.float64).reshape(n, length, dim)
        for node, chain in reversed(self.forward_chains(out_unit.output)):
            got = self.run_chain(chain, rows)
            if got is not None and tuple(got.shape) == tuple(expected.shape) and torch.equal(got, expected):
                return node
        raise Problem("output", "the projected output is not put back as the sequence [N, T, D] it came from")

    def attention_layer(self, sdpa, args, module, heads, head_dim, found, out_unit, fused) -> dict:
        causal = bool(args.get("is_causal"))
        mask = args.get("attn_mask")
        if mask is not None:
            if mask in self.data:
                raise Problem("attn_mask", "a mask computed from the input (a padding mask?): the spec's attention "
                              "masks nothing or the future")
            causal = self.mask_is_causal(self.values[mask], _shape(sdpa)[2], causal)
        scale = args.get("scale")
        if scale is not None and abs(scale * math.sqrt(head_dim) - 1) > 1e-6:
            raise Problem(f"scale {scale:g}", f"the spec scales the scores by 1/sqrt({head_dim})")
        if args.get("dropout_p"):
            rate = float(args["dropout_p"])
        elif sdpa in self.attention_dropouts:  # what it is called with in training
            rate = self.attention_dropouts[sdpa]
        else:
            rate = _attention_dropout(module)
        denses = [self.dense_of(u) for u in {id(u): u for u in [*found.values(), out_unit]}.values()]
        biases = {d.bias is not None for d in denses}
        if len(biases) != 1:
            raise Problem("biases", "some of its projections have biases and some not: the spec's use_bias is one "
                          "flag for all four")
        layer = {"type": "attention", "heads": heads} | ({"causal": True} if causal else {}) | \
            ({} if biases == {True} else {"use_bias": False}) | ({"dropout": rate} if rate else {})
        weights = {}
        for part in ("query", "key", "value"):
            dense = self.dense_of(found[part])
            slot = (("query", "key", "value").index(part), 3) if fused else None
            weights[f"{part}_kernel"] = (dense.kernel, dense.layout, slot)
            if dense.bias is not None:
                weights[f"{part}_bias"] = (dense.bias, "plain", slot)
        dense = self.dense_of(out_unit)
        weights["output_kernel"] = (dense.kernel, dense.layout, None)
        if dense.bias is not None:
            weights["output_bias"] = (dense.bias, "plain", None)
        if fused:
            kernel = self.dense_of(found["query"]).kernel
            self.importer.notes.append(f"{self.attention_where(sdpa)}: '{kernel}' projects to q, k and v at once (its "
                                       f"[D, 3D] columns in q, k, v order); the spec's attention holds three [D, D] "
                                       f"kernels: a weight copier splits it (canonical_weights does)")
        return layer | {"_weights": weights}

    def attention_where(self, sdpa) -> str:
        path, module = self.owner(sdpa)
        return _where_module(path, module) if module is not None else self.call_where(sdpa)

    def mask_is_causal(self, mask: torch.Tensor, length: int, causal: bool) -> bool:
        mask = mask.detach()
        if mask.shape[-2:] != (length, length):
            raise Problem(f"attn_mask {list(mask.shape)}", f"not a [T, T] mask for T = {length}")
        flat = mask.reshape(-1, length, length)
        if not all(torch.equal(flat[0], m) for m in flat[1:]):
            raise Problem("attn_mask", "a mask that differs between samples or heads: the spec's attention masks "
                          "nothing or the future")
        first = flat[0]
        if first.dtype == torch.bool:
            allowed = first
        else:
            allowed = first == 0
            if not bool((allowed | (first <= -1e4)).all()):
                raise Problem("attn_mask", "adds a bias to the scores: the spec's attention masks nothing or the "
                              "future")
        tril = torch.ones(length, length, dtype=torch.bool).tril()
        if bool(allowed.all()):
            return causal
        if torch.equal(allowed, tril):
            return True
        raise Problem("attn_mask", "a mask that is neither empty nor causal: the spec's attention masks nothing or "
                      "the future")

    def absorb(self, sdpa, found, out_unit, ends, where, layer) -> None:
        """One attention unit in place of the nodes from its input to its output (`ends`: (input, output) nodes;
        None: from the projections' input to the output projection's output)."""
        if ends is None:
            entry = next(iter(found.values())).entry
            x, y = self.rep[entry], out_unit.output
        else:
            x, y = ends
        region = self.between(x, y)
        leaking = [n for n in region if n is not y and any(u not in region for u in self.users[n])]
        if leaking and layer is not None:
            self.importer.problem(where, f"attention: a tensor inside it (node '{clip(leaking[0].name, 40)}') is "
                                  f"used elsewhere: the spec's attention gives only its output")
            layer = None
        old = [u for u in self.units if any(n in region for n in u.nodes)]
        if not old:
            return
        nodes = sorted({n for u in old for n in u.nodes} | {n for n in region if self.rep[n] is n},
                       key=lambda n: self.order[n])
        output = self.rep[y]
        nodes = [n for n in nodes if n is not output] + [output]
        path, module = self.owner(sdpa)
        unit = Unit(output.name, nodes, where, path or sdpa.name, module, path, kind="attention")
        unit.layers = [dict(layer, _source=unit.source)] if layer is not None else None
        unit.refused = layer is None
        self.replace(old, unit)

    def absorb_failed(self, sdpa, where) -> None:
        """An attention that is not the spec's, reported once: its own module's data ops give no more lines."""
        path, _ = self.owner(sdpa)
        for unit in self.units:
            if unit.kind == "call" and self.owner(unit.output)[0] == path:
                unit.refused = True
                unit.where = where

    def ancestors(self, node: torch.fx.Node) -> set:
        """The data nodes a node is computed from, itself included."""
        out, stack = set(), [node]
        while stack:
            current = stack.pop()
            if current not in out:
                out.add(current)
                stack += self.data_inputs(current)
        return out

    def between(self, x: torch.fx.Node, y: torch.fx.Node) -> set:
        """The data nodes on paths from x (left out) to y (included)."""
        after, stack = set(), list(self.users[x])
        while stack:
            node = stack.pop()
            if node not in after:
                after.add(node)
                stack += self.users[node]
        before, stack = set(), [y]
        while stack:
            node = stack.pop()
            if node not in before and node is not x:
                before.add(node)
                stack += self.data_inputs(node)
        return after & before

    # -- patches ---------------------------------------------------------------------------------------------
    def patches(self, unit: Unit) -> None:
        """A Conv2d of kernel = stride = P, unpadded, whose output is flattened to a sequence of patches in
        row-major order: the spec's patches."""
        m = unit.module
        if not (type(m) is nn.Conv2d and m.kernel_size[0] == m.kernel_size[1] == m.stride[0] == m.stride[1] and
                m.padding in ((0, 0), "valid") and m.dilation == (1, 1) and m.groups == 1 and
                m.padding_mode == "zeros"):
            return
        shape = _shape(unit.output)
        if shape is None or len(shape) != 4:
            return
        n, dim, h, w = shape
        ids = torch.arange(n * dim * h * w, dtype=torch.float64).reshape(n, dim, h, w)
        expected = ids.flatten(2).transpose(1, 2)
        for node, chain in reversed(self.forward_chains(unit.output)[1:]):
            got = self.run_chain(chain, ids)
            if got is not None and tuple(got.shape) == tuple(expected.shape) and torch.equal(got, expected):
                nodes = unit.nodes + [c for c in chain if self.rep[c] is c]
                old = [unit] + [u for u in self.units if u is not unit and any(c in u.nodes for c in chain)]
                if any(len(u.nodes) != 1 for u in old[1:]):
                    return
                prefix = f"{unit.path}." if unit.path else ""
                layer = {"type": "patches", "size": m.kernel_size[0], "dim": m.out_channels,
                         "_source": unit.path, "_weights": {"kernel": (prefix + "weight", "conv", None),
                                                            "bias": (prefix + "bias", "plain", None)}}
                if m.bias is None:
                    self.importer.problem(unit.where, "bias False: the spec's patches have a bias")
                    return
                output = self.rep[node]
                patched = Unit(output.name, [x for x in nodes if x is not output] + [output], unit.where,
                               unit.source, m, unit.path, kind="patches")
                patched.layers = [layer]
                self.replace(old, patched)
                return

    # -- the whole reading ----------------------------------------------------------------------------------
    def read(self) -> list[Unit]:
        self.build_units()
        for sdpa in [n for n in self.graph.nodes if n in self.data and _op(n) == "scaled_dot_product_attention"]:
            if self.owner_of.get(sdpa) is None or self.owner_of[sdpa].kind == "attention":
                continue
            self.attention(sdpa)
        for unit in [u for u in self.units if u.kind == "module" and type(u.module) is nn.Conv2d]:
            self.patches(unit)
        self.rewire(report=True)
        self.written_out()
        for unit in self.units:
            if unit.layers is None and not unit.refused and unit.kind in ("module", "call"):
                self.convert(unit)
        self.keepdims()
        return self.units

    def written_out(self) -> None:
        """A product of two tensors computed from the input (q k^T, p v: attention written out as matmuls and a
        softmax) is one line for the module call that makes it; that call's other ops say nothing more."""
        for unit in self.units:
            node = unit.output
            if unit.kind != "call" or unit.refused or _op(node) not in ("matmul", "bmm", "baddbmm", "einsum") or \
                    len(set(self.data_inputs(node))) < 2:
                continue
            stack = self.stack(node)
            key = stack[-1][0] if stack else None
            self.importer.problem(unit.where, "multiplies two tensors computed from the input (attention written out "
                                  "as matmuls and a softmax?): the importer reads attention from torch's "
                                  "scaled_dot_product_attention (Hugging Face: attn_implementation='sdpa'; "
                                  "nn.MultiheadAttention: need_weights=False)")
            for other in self.units:
                other_stack = self.stack(other.output)
                if other.kind == "call" and (other_stack[-1][0] if other_stack else None) == key:
                    other.refused = True
            if key is None:
                return

    # -- conversion ------------------------------------------------------------------------------------------
    def in_shape(self, unit: Unit) -> tuple[int, ...] | None:
        return _shape(self.rep[unit.entry]) if unit.entry is not None else None

    def convert(self, unit: Unit) -> None:
        try:
            layers = self.convert_module(unit) if unit.kind == "module" else self.convert_call(unit)
        except _Elsewhere as exc:
            self.importer.problem(exc.where, exc.why)
            unit.refused = True
            return
        except Problem as exc:
            self.importer.problem(unit.where, str(exc))
            unit.refused = True
            return
        unit.layers = [dict(layer, _source=layer.get("_source", unit.source)) for layer in layers]

    def convert_module(self, unit: Unit) -> list[dict]:
        m, shape = unit.module, self.in_shape(unit)
        if len(set(unit.inputs)) > 1:
            raise Problem("inputs", f"takes {len(set(unit.inputs))} tensors: a spec layer takes one (merges: add, "
                          f"multiply, concat)")
        if shape is None:
            raise Problem("input", "takes no tensor that depends on the model's input")
        prefix = f"{unit.path}." if unit.path else ""
        if _is_conv1d(m):
            return [{"type": "dense", "units": m.weight.shape[1],
                     "_weights": {"kernel": (prefix + "weight", "plain", None), "bias": (prefix + "bias", "plain",
                                                                                         None)}}
                    | ({} if m.bias is not None else {"use_bias": False})]
        rule = base.MODULES.get(type(m)) or (base._linear if type(m) in _linear_types() else None)
        if rule is None:
            identified = self.identified(m)
            if identified is not None:
                out = _shape(unit.output)
                if out != shape:
                    raise Problem(f"module class {type(m).__name__}", "changes the shape of its input")
                layers = [dict(layer) for layer in identified]
                if layers[0]["type"] == "rmsnorm":
                    layers[0]["_weights"] = {"gamma": (prefix + "weight", "plain", None)}
                return layers
            mapped = ", ".join(cls.__name__ for cls in base.MODULES)
            raise Problem(f"module class {type(m).__name__}", f"not in the spec (mapped: {mapped}, Hugging Face's "
                          f"Conv1D, and modules whose values are the spec's activations or rmsnorm)")
        layers = rule(m, shape)
        if isinstance(m, nn.Embedding):
            self.importer.vocab = m.num_embeddings
            base.embedding_note(self.importer, unit.where, m)
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            self.importer.batchnorm = True
        if isinstance(m, nn.Dropout) and m.p == 0:
            return []
        weights = base.module_weights(layers[0]["type"], prefix, m) if layers else {}
        if layers and weights:
            layers[0] = dict(layers[0], _weights=weights)
        return layers

    def convert_call(self, unit: Unit) -> list[dict]:
        node = unit.output
        op, args = _op(node), _bound(node)
        shape = self.in_shape(unit)
        ins = self.data_inputs(node)
        simple = {"relu": "relu", "relu_": "relu", "silu": "silu", "silu_": "silu", "sigmoid": "sigmoid",
                  "sigmoid_": "sigmoid", "tanh": "tanh", "tanh_": "tanh", "hardswish": "hard_swish",
                  "hardswish_": "hard_swish", "relu6": "relu6"}
        if op in simple:
            return [{"type": simple[op]}]
        if op in ("hardtanh", "hardtanh_"):
            if (args.get("min_val"), args.get("max_val")) == (0, 6):
                return [{"type": "relu6"}]
            raise Problem(f"min_val {args.get('min_val')}, max_val {args.get('max_val')}", "the spec's relu6 is "
                          "hardtanh(0, 6); other bounds are not in the spec")
        if op == "gelu":
            return base._gelu(args.get("approximate", "none"))
        if op in ("softmax", "_softmax"):
            return base._softmax_dim(args.get("dim"), shape)
        if op in DROPOUTS:
            return [{"type": "dropout", "rate": float(args["p"])}]
        if op == "mean":
            return self.mean(node, args, shape)
        if op == "adaptive_avg_pool2d":
            if list(args.get("output_size") or []) != [1, 1]:
                raise Problem(f"output_size {base._show(args.get('output_size'))}", "the spec's global_avgpool2d is "
                              "output_size 1")
            return [{"type": "global_avgpool2d", "_keep": True}]
        if op in ("max_pool2d", "avg_pool2d"):
            return self.pool(op, args, shape, base)
        if op in ("flatten", "view", "reshape", "_unsafe_view"):
            out = _shape(node)
            if out is not None and len(out) == 2 and out[0] == shape[0] and out[1] == math.prod(shape[1:]):
                return [{"type": "flatten"}]
            raise Problem(f"shape {list(out[1:]) if out else '?'}", f"from {list(shape[1:])}: the spec reshapes only "
                          f"to flatten (x.view(x.size(0), -1), torch.flatten(x, 1))")
        if op in ("pad", "constant_pad_nd"):
            return self.pad(args, shape)
        if op == "select":
            return self.select(args, shape)
        if op == "linear":
            dense = self.dense_of(unit)
            if dense is None:
                raise Problem("weight", "not a parameter of the model: the spec's dense holds its own kernel")
            if len(shape) == 4:
                raise Problem("input [C, H, W]", "a linear on an image acts on its last axis (W); the spec's dense "
                              "takes a vector or a sequence: flatten first")
            units = _shape(node)[-1]
            return [{"type": "dense", "units": units, "_weights": {"kernel": (dense.kernel, "linear", None),
                                                                   "bias": (dense.bias, "plain", None)}}
                    | ({} if dense.bias is not None else {"use_bias": False})]
        if op == "layer_norm":
            weight, bias = self.param_name(args.get("weight")), self.param_name(args.get("bias"))
            if weight is None or bias is None or list(args.get("normalized_shape")) != [shape[-1]] or len(shape) == 4:
                raise Problem("layer_norm", "the spec's layernorm normalises the last axis of a vector or a sequence "
                              "with a weight and a bias of the model")
            return [{"type": "layernorm", "epsilon": args.get("eps"),
                     "_weights": {"gamma": (weight, "plain", None), "beta": (bias, "plain", None)}}]
        if op == "embedding":
            weight = self.param_name(args.get("weight"))
            if weight is None:
                raise Problem("weight", "not a parameter of the model")
            self.importer.vocab = int(_shape(args["weight"])[0])
            return [{"type": "embedding", "dim": int(_shape(args["weight"])[1]),
                     "_weights": {"embeddings": (weight, "plain", None)}}]
        if op in ("add", "mul"):
            return self.binary(unit, node, op, args, ins, shape)

        if op == "cat":
            return self.cat(unit, node, args)
        raise Problem("call", "not in the spec (mapped: the spec's activations, softmax, dropout, mean over an image "
                      "or a sequence, pools, flatten, zero padding, linear, layer_norm, embedding, add, mul, cat, "
                      "select, scaled_dot_product_attention with its projections)")

    def mean(self, node, args, shape) -> list[dict]:
        dims = args.get("dim")
        dims = {d % len(shape) for d in (dims if isinstance(dims, (list, tuple)) else [dims])} \
            if dims is not None else None
        if args.get("dtype") is not None:
            raise Problem(f"dtype {args.get('dtype')}", "the spec's mean keeps the compute dtype")
        keep = bool(args.get("keepdim"))
        if len(shape) == 4 and dims == {2, 3}:
            return [{"type": "global_avgpool2d"} | ({"_keep": True} if keep else {})]
        if len(shape) == 3 and dims == {1} and not keep:
            return [{"type": "sequence_pool", "mode": "mean"}]
        raise Problem(f"dim {sorted(dims) if dims else dims}", f"a mean over an input {list(shape[1:])}: the spec's "
                      f"means are over an image's height and width (global_avgpool2d) or a sequence's positions "
                      f"(dim 1: sequence_pool)")

    def pool(self, op, args, shape, base) -> list[dict]:
        """F.max_pool2d, F.avg_pool2d: nn.MaxPool2d's and nn.AvgPool2d's rules."""
        args = {key: tuple(value) if isinstance(value, list) else value for key, value in args.items()}
        stride = args.get("stride") or None  # () is the kernel's
        if op == "max_pool2d":
            module = nn.MaxPool2d(args["kernel_size"], stride, args.get("padding", 0), args.get("dilation", 1),
                                  ceil_mode=bool(args.get("ceil_mode")))
        else:
            module = nn.AvgPool2d(args["kernel_size"], stride, args.get("padding", 0), bool(args.get("ceil_mode")),
                                  bool(args.get("count_include_pad", True)), args.get("divisor_override"))
        return base._pool(module, shape)

    def pad(self, args, shape) -> list[dict]:
        pads = list(args.get("pad") or [])
        if args.get("mode", "constant") != "constant" or (args.get("value") or 0) != 0:
            raise Problem(f"mode {args.get('mode')}, value {args.get('value')}", "the spec pads with zeros")
        if len(shape) != 4 or len(pads) not in (2, 4) or any(p < 0 for p in pads):
            raise Problem(f"pad {pads}", "the spec's zero_pad2d pads an image's height and width (F.pad's last two "
                          "axes of NCHW) by zero or more pixels")
        left, right, top, bottom = (pads + [0, 0])[:4]
        return [{"type": "zero_pad2d", "padding": [top, bottom, left, right]}]

    def select(self, args, shape) -> list[dict]:
        dim, index = args.get("dim"), args.get("index")
        if len(shape) == 3 and dim % 3 == 1:
            length = shape[1]
            if index % length == 0:
                return [{"type": "sequence_pool", "mode": "first"}]
            if index % length == length - 1:
                return [{"type": "sequence_pool", "mode": "last"}]
        raise Problem(f"dim {dim}, index {index}", "the spec selects only a sequence's first or last position "
                      "(x[:, 0], x[:, -1]: sequence_pool)")

    def binary(self, unit: Unit, node, op, args, ins, shape) -> list[dict]:
        kind = {"add": "add", "mul": "multiply"}[op]
        operands = [node.args[0], node.args[1]] if len(node.args) > 1 else [node.args[0], node.kwargs.get("other")]
        data = [a for a in operands if isinstance(a, torch.fx.Node) and a in self.data]
        if len(data) == 2:
            if args.get("alpha", 1) != 1:
                raise Problem(f"alpha {args.get('alpha')}", "the spec adds tensors as they are")
            unit.merge = kind
            return [{"type": kind}]
        other = next((a for a in operands if not (isinstance(a, torch.fx.Node) and a in self.data)), None)
        if kind == "add" and isinstance(other, torch.fx.Node):
            return self.position(unit, other, shape)
        what = "a tensor the model computes from its weights alone" if isinstance(other, torch.fx.Node) else \
            f"the constant {base._show(other)}"
        raise Problem("operands", f"{'adds' if kind == 'add' else 'multiplies by'} {what}: the spec's merges join "
                      f"tensors computed from the input")

    def origin(self, node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
        """A static node traced back through layout ops (and identities) to where it is made."""
        chain = []
        while node.op == "call_function" and (_op(node) in LAYOUT or _op(node) in SAME_IF_SHAPE) and \
                node.all_input_nodes:
            chain.insert(0, node)
            node = node.args[0] if isinstance(node.args[0], torch.fx.Node) else node.all_input_nodes[0]
        return node, chain

    def static_chain(self, chain, value):
        for node in chain:
            source = node.args[0]
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                                 lambda a: value if a is source else self.values.get(a))
            if _op(node) == "getitem":
                value = value[node.args[1]]
                continue
            value = _apply(node, args, kwargs)
            if value is None:
                return None
        return value

    def position(self, unit: Unit, other: torch.fx.Node, shape) -> list[dict]:
        """x + a table's first T rows: the spec's position_embedding (a learned table: an Embedding of the positions
        0 .. T-1, or a parameter)."""
        if len(shape) != 3:
            raise Problem("operands", "adds a tensor the model computes from its weights alone: the spec adds a "
                          "position table to a sequence only")
        length, dim = shape[1], shape[2]
        origin, chain = self.origin(other)
        if origin.op == "call_function" and _op(origin) == "embedding":
            args = _bound(origin)
            table = self.param_name(args["weight"])
            path, module = self.owner(origin)
            where = _where_module(path, module) if module is not None else self.call_where(origin)
            ids = self.values[args["indices"]]
            rows, width = _shape(args["weight"])
            looked_up = torch.arange(rows * width, dtype=torch.float64).reshape(rows, width)
            got = self.static_chain(chain, looked_up[ids.long()])
            if table is not None and got is not None and got.shape[-2:] == (length, dim):
                flat = got.reshape(-1, length, dim)
                if all(torch.equal(f, looked_up[:length]) for f in flat):
                    return [{"type": "position_embedding"} | ({"max_length": rows} if rows != length else {})
                            | {"_source": path or table, "_weights": {"embeddings": (table, "plain", None)}}]
                constant = ids.flatten()
                row = looked_up[int(constant[0])] if len(constant) else None
                if row is not None and all(torch.equal(f, row.expand(length, dim)) for f in flat):
                    if int(constant[0]) == 0:  # BERT's token-type embedding without token types: its row 0
                        self.importer.unused_parameters += (rows - 1) * width
                        self.importer.notes.append(
                            f"{where}: takes constant ids (all 0: its ids are not given to the model's forward): "
                            f"the spec's bias holds row 0 of its table; the other {rows - 1} row(s) "
                            f"({(rows - 1) * width:,} parameters) are not in the spec")
                        return [{"type": "bias", "_source": path or table,
                                 "_weights": {"bias": (table, ("row", 0), None)}}]
                    raise _Elsewhere(where, f"takes constant ids (all {int(constant[0])}: its ids are not given to "
                                     f"the model's forward) and adds row {int(constant[0])} of its table to every "
                                     f"position: the spec's bias is a token-type embedding's row 0 (ids all 0)")
            raise _Elsewhere(where, "adds an embedding of ids that are not the positions 0 .. T-1: not in the spec")
        table = self.param_name(origin)
        if table is not None and self.kinds[origin.name][0] == "PARAMETER":
            numel = math.prod(_shape(origin))
            rows = numel // dim if numel % dim == 0 else 0
            ids = torch.arange(numel, dtype=torch.float64).reshape(_shape(origin))
            got = self.static_chain(chain, ids)
            if rows and got is not None and got.shape[-2:] == (length, dim):
                flat = got.reshape(-1, length, dim)
                expected = torch.arange(numel, dtype=torch.float64).reshape(rows, dim)[:length]
                if all(torch.equal(f, expected) for f in flat):
                    return [{"type": "position_embedding"} | ({"max_length": rows} if rows != length else {})
                            | {"_source": table, "_weights": {"embeddings": (table, "plain", None)}}]
            raise Problem("operands", f"adds the parameter '{clip(table, 60)}' {list(_shape(origin))}: the spec adds "
                          f"a [T, D] position table's first T rows only")
        if table is not None or origin.op == "placeholder":
            name = table or self.kinds.get(origin.name, (None, origin.name))[1]
            raise Problem("operands", f"adds the fixed tensor '{clip(str(name), 60)}' (a buffer or a constant, not "
                          f"trained): the spec's position table is learned (position_embedding)")
        raise Problem("operands", "adds a tensor the model computes from its weights alone: the spec adds a position "
                      "table only")

    def cat(self, unit: Unit, node, args) -> list[dict]:
        parts = list(args.get("tensors") or [])
        static = [p for p in parts if p not in self.data and _numel(p) != 0]
        if static:
            origin, _ = self.origin(static[0])
            name = self.param_name(origin)
            what = f"the learned tensor '{clip(name, 60)}'" if name else "a tensor computed from the weights alone"
            axis = args.get("dim", 0)
            raise Problem("tensors", f"concatenates {what} with the data along axis {axis} (a class token?): the "
                          f"spec has no class token or other learned rows")
        rank = len(_shape(node))
        dim = args.get("dim", 0) % rank
        if dim != (1 if rank == 4 else rank - 1):
            raise Problem(f"dim {args.get('dim')}", "the spec concatenates the last axis (an image's channels: dim 1 "
                          "of NCHW)")
        unit.merge = "concat"
        return [{"type": "concat"}]

    def keepdims(self) -> None:
        """A global pool of an image [N, C, 1, 1] keeps its dims ([1, 1, C]) unless only flattens take it (then the
        fx importer's spec: [C], flattened as it is)."""
        takers: dict[str, list[Unit]] = {}
        for unit in self.units:
            for name in unit.inputs:
                takers.setdefault(name, []).append(unit)
        for unit in self.units:
            for layer in unit.layers or []:
                layer.pop("_keep", None)
                if layer["type"] in ("global_avgpool2d", "global_maxpool2d") and len(_shape(unit.output) or ()) == 4:
                    users = takers.get(unit.name, [])
                    if not users or not all(u.layers and u.layers[0]["type"] == "flatten" for u in users):
                        layer["keepdims"] = True


class _Elsewhere(Problem):
    """A problem that belongs to another module than the unit being converted."""

    def __init__(self, where: str, why: str):
        Exception.__init__(self, why)
        self.where, self.why = where, why


def _show_rotary(rotary: dict) -> str:
    return f"base {rotary['base']:g}, pairing {rotary['pairing']}"


def _apply(node: torch.fx.Node, args, kwargs):
    """A layout op on a tensor of indices (a view as a reshape: the indices' strides are not the model's)."""
    try:
        if _op(node) in ("view", "_unsafe_view"):
            return torch.reshape(args[0], args[1])
        return node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that does not run on it: not the layout looked for
        return None


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch's own loggers (export's warnings about data-dependent guards) say nothing while it captures: what
    matters reaches the user as one line."""
    import logging

    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _numel(node) -> int:
    shape = _shape(node)
    return math.prod(shape) if shape is not None else -1


def _linear_types() -> tuple:
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

    return (nn.Linear, NonDynamicallyQuantizableLinear)


def _sdpa_dropouts(model: nn.Module, sample: torch.Tensor, keywords: dict) -> list[float] | None:
    """The dropout_p of each call of F.scaled_dot_product_attention in a forward in training mode (in eval mode
    every model calls it with 0), in call order; batch norms stay in eval mode (their statistics untouched), no
    gradients, the global random state put back. None where the forward fails."""
    import torch.nn.functional as F
    from torch.nn.modules.batchnorm import _BatchNorm

    calls: list[float] = []
    original = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(float(args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)))
        return original(*args, **kwargs)

    modes = {m: m.training for m in model.modules()}
    try:
        F.scaled_dot_product_attention = recording  # MultiheadAttention and Hugging Face call it by this name
        for m in model.modules():
            m.training = not isinstance(m, _BatchNorm)
        with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(sample, **keywords)
    except Exception:  # noqa: BLE001 - then the calling module's attributes say it
        return None
    finally:
        F.scaled_dot_product_attention = original
        for m, training in modes.items():
            m.training = training
    return calls


def _attention_dropout(module: nn.Module | None) -> float:
    """The attention's dropout on its probabilities from the module that calls it, where the training forward
    could not say it: an attribute named for it, a rate or an nn.Dropout."""
    for key in ("attn_dropout", "attention_dropout", "dropout_prob", "attn_pdrop", "dropout_p", "dropout"):
        value = getattr(module, key, None)
        if isinstance(value, nn.Dropout):
            return float(value.p)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


def _takes(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _output(out):
    """The tensor a forward gives: itself, or a Hugging Face output's logits; anything else is refused."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise HarnessError(f"forward returns {type(out).__name__}: the spec has one output tensor (a tensor, or a Hugging "
                       f"Face output's logits)")


# ---- units to layers ------------------------------------------------------------------------------------------
class UnitChain(Chain):
    join = "add (x + y)"

    def __init__(self, importer, units: dict[str, Unit], start: str):
        super().__init__(units, start, importer.target)
        self.importer = importer

    def is_add(self, unit: Unit) -> bool:
        return unit.merge == "add"

    def inputs(self, unit: Unit) -> list[str]:
        return unit.inputs

    def before(self, unit: Unit) -> str:
        if unit.merge is not None:
            raise Problem("inputs", f"a {unit.merge}: only residual adds join a chain")
        return super().before(unit)

    def convert(self, unit: Unit, first: bool) -> list[dict]:
        return [dict(layer) for layer in unit.layers or []]

    def problem(self, unit: Unit, message: str) -> None:
        self.importer.problem(unit.where, message)


def _ancestors(by_name: dict[str, Unit], start: str, end: str) -> set[str]:
    """The units `end` is computed from (itself included), back to `start`."""
    needed, stack = set(), [end]
    while stack:
        name = stack.pop()
        if name in needed or name == start or name not in by_name:
            continue
        needed.add(name)
        stack += by_name[name].inputs
    return needed


def graph_layers(importer, units: list[Unit], start: str, end: str) -> list[dict]:
    """The units from the input to the output in the graph's order, with named tensors where a layer does not take
    the one before it and for every merge's inputs (as the Keras importer writes a functional graph)."""
    by_name = {u.name: u for u in units}
    needed = _ancestors(by_name, start, end)
    out: list[dict] = []
    last: dict[str, int] = {}
    alias: dict[str, str] = {start: start}
    wanted: set[str] = set()
    current = start
    for unit in units:
        if unit.name not in needed:
            continue
        sources = [alias.get(name, name) for name in unit.inputs]
        layers = [dict(layer) for layer in unit.layers or []]
        if unit.merge is not None:
            layers[0]["inputs"] = sources
            wanted.update(sources)
        elif len(set(sources)) != 1 and not unit.refused:
            importer.problem(unit.where, f"takes {len(set(sources))} tensors: only add, multiply and concat join "
                             f"branches in the spec")
            continue
        else:
            if not layers:
                alias[unit.name] = sources[0]
                continue
            if sources[0] != current:
                layers[0]["input"] = sources[0]
                wanted.add(sources[0])
        out += layers
        last[unit.name] = len(out) - 1
        current = unit.name
    # a tensor is named after its module's path (`blocks.0.attn` -> `blocks_0_attn`), or its ATen node's name
    labels = {u.name: u.path if u.kind != "call" and u.path else u.name for u in units if u.name in wanted - {start}}
    return name_tensors(out, last, labels, start)


FEATUREWISE = ("relu", "relu6", "silu", "hard_swish", "sigmoid", "tanh", "gelu", "softmax", "dropout", "batchnorm",
               "layernorm", "flatten")


def flat_orders(importer, graph: ExportedGraph, units: list[Unit]) -> None:
    """PyTorch flattens an image in C, H, W order: each dense after a flatten (and any norm on the flat features
    between) is tagged with the [C, H, W] its input rows follow (`_flattened`), which canonical_weights permutes."""
    order: dict[str, tuple | None] = {graph.user_input.name: None}
    for unit in units:
        known = [order.get(name) for name in unit.inputs]
        before = known[0] if known else None
        if unit.merge is not None:
            flat = [k for k in known if k is not None]
            if flat and (unit.merge == "concat" or len(set(known)) > 1):
                importer.problem(unit.where, f"{'concatenates' if unit.merge == 'concat' else 'joins'} features "
                                 f"flattened from an image (PyTorch's C, H, W order) with features in another order: "
                                 f"the spec flattens in H, W, C order, which no weight permutation reconciles here")
            order[unit.name] = before if unit.merge != "concat" else None
            continue
        layers = unit.layers
        if not layers:
            order[unit.name] = before
            continue
        kind = layers[0]["type"]
        shape = graph.in_shape(unit)
        if kind == "flatten" and shape is not None and len(shape) == 4:
            order[unit.name] = tuple(shape[1:]) if shape[2] * shape[3] > 1 else None
            continue
        if before is None:
            order[unit.name] = None
            continue
        if kind in ("dense", "batchnorm", "layernorm"):
            layers[0]["_flattened"] = before
        order[unit.name] = before if all(layer["type"] in FEATUREWISE for layer in layers) else None


def export_layers(importer, model: nn.Module, sample: torch.Tensor) -> list[dict]:
    """The spec's layers of a module read by torch.export from `sample` (CaptureFailed: it cannot be captured);
    problems are the importer's (TorchImporter.problem), and so are the notes, the vocab and the graph."""
    graph = ExportedGraph(importer, model)
    graph.capture(sample)
    units = graph.read()
    flat_orders(importer, graph, units)
    importer.graph = graph
    start, end = graph.user_input.name, graph.tensor_name(graph.rep[graph.end_node])
    if end == start:
        return []
    by_name = {u.name: u for u in units}
    needed = _ancestors(by_name, start, end)
    known, flagged = list(importer.problems), set(importer.flagged)
    chain = UnitChain(importer, {**by_name, start: Unit(start, [graph.user_input], "the input", start, kind="input")},
                      start)
    try:
        layers = chain.walk(end, start)
    except ImportProblems:
        layers = None
    if layers is not None and importer.problems == known and not (needed - chain.visited):
        return layers

    importer.problems, importer.flagged = known, flagged  # not a chain with residual adds: the graph as it is
    return graph_layers(importer, units, start, end)
