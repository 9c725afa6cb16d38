"""Trainer.profile for MXNet: the steps under MXNet's own profiler (mx.profiler), its Chrome trace read back, and
each operator it timed matched to the node of the hybridized graph it ran.

MXNet's engine runs a static graph in bulked segments of up to 15 operators, each timed as one event named after
the operator types in it, and names every event after its operator type only ("Convolution", never the node). So:
- The profiled steps run the same graph with bulk size 1 (NOTES). Operators that touch the graph's inputs or
  outputs run outside the static plan, as "ImperativeBulk" events.
- The nodes the graph runs, in the order it pushes them, with their dtypes and scopes, come from MXNet's operator
  hook (_executed_nodes). Node names carry the scopes they were built in (network.py).
- One worker thread runs the engine's operators, the first ready first, so a step's events are matched in time
  order to the graph's nodes (_match).
- Operators the step runs imperatively (the loss scaling, the update) are the events no node accounts for; each
  belongs to the part whose range (Ranges, a profiler event on the Python thread) began last before it ran
  (_attribute's exceptions). Where the engine runs nothing within a step, it waits for the Python thread: that
  time (IDLE) goes to the range the Python thread is in, MXNet's runtime or a part.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import mxnet as mx
import numpy as np
from mxnet.base import NDArrayHandle, py_str

from harness.adapter import LOSS_SCOPE, RUNTIME_SCOPE, STEP_SCOPE, OpTime, ProfiledOps
from harness.errors import HarnessError

BULK = "ImperativeBulk"  # the engine's name for operators pushed outside the static plan
BULK_SIZE = 1  # one operator per engine operation: the profiler times each
ENGINE_OPS = {"DeleteVariable", "WaitForVar"}  # the engine's work for the Python thread: freeing arrays, a sync
SEED = "SetValueOp"  # autograd's ones, the gradient of the loss with respect to itself
IDLE = "(engine idle)"  # the engine waiting for the Python thread to dispatch its next operator
CASTS = {"amp_cast", "amp_multicast", "Cast"}
GRADIENT_SUM = "sum_grad"  # MXNet's name for the sum of a tensor's gradients
SEARCH_LIMIT = 100_000  # tries at matching one step's operators to the graph's nodes
NOTES = {  # by the trainer's variant: how the profiled steps differ from the timed ones
    True: "MXNet's profiler times a bulked segment of up to 15 operators as one event, so the profiled steps run the "
          "timed runs' static graph with bulk size 1 (each operator its own engine operation)",
    False: "MXNet's profiler names an operator dispatched from Python by its type alone, so the imperative variant "
           "is profiled as the hybridized one's static graph with bulk size 1 (each operator its own engine "
           "operation)"}


@dataclass
class Node:
    """A node of the executed graph, as the operator hook saw it run."""

    name: str
    op: str
    inputs: list[str] = field(default_factory=list)  # floating-point dtypes (forward nodes only: the hook
    outputs: list[str] = field(default_factory=list)  # reports a backward node's outputs alone)
    deps: list[int] = field(default_factory=list)  # nodes (indices) whose outputs it reads, where known
    scope: str = ""
    backward: bool = False
    dynamic: bool = False  # runs outside the static plan, as an ImperativeBulk event


class Ranges:
    """MXNetTrainer._range while profiling: profiler events on the Python thread naming the part (or the step)
    whose operators are dispatched inside; `drain`: the range lasts until they have run."""

    def __init__(self):
        self.event = functools.cache(mx.profiler.Event)  # one per name, made once: a range costs two C calls

    @contextlib.contextmanager
    def __call__(self, name: str, drain: bool = False):
        event = self.event(name)
        event.start()
        try:
            yield
            if drain:
                mx.nd.waitall()
        finally:
            event.stop()


def profile_steps(trainer, run_steps) -> ProfiledOps:
    block, note = trainer.block, NOTES[trainer.hybridize]
    if trainer.net.float64 and trainer.net.batchnorm_paths:
        note += ", and lets the backward finish before float64's running statistics and the update are dispatched"
    active, flags = block._active, dict(block._flags)  # put back afterwards
    block.hybridize(static_alloc=True, static_shape=True, forward_bulk_size=BULK_SIZE, backward_bulk_size=BULK_SIZE)
    try:
        _settle(trainer, _zero_batch(trainer, trainer.net.spec.batch_size))  # the graph and its static memory
        nodes = _executed_nodes(trainer, _zero_batch(trainer, 1))  # the same nodes, in little memory
        with tempfile.TemporaryDirectory(prefix="amp-harness-mxnet-profile-") as tmp:
            trace = Path(tmp) / "profile.json"
            mx.profiler.set_config(profile_symbolic=True, profile_imperative=True, profile_memory=False,
                                   profile_api=False, aggregate_stats=False, filename=str(trace))
            trainer._range = Ranges()
            mx.profiler.set_state("run")
            try:
                run_steps()
            finally:
                mx.profiler.set_state("stop")
                del trainer._range  # the class's: no ranges
            mx.profiler.dump()
            events = json.loads(trace.read_text())["traceEvents"]
    finally:
        block.hybridize(active, **flags)
    ops = _attribute(nodes, *_spans(events))
    return ProfiledOps(f"mx.profiler (MXNet {mx.__version__}, operator events)", ops, note)


def _zero_batch(trainer, n: int) -> list:
    """Inputs of the step's shapes for `n` samples (block(x, labels, *masks)) for the untimed passes: values do
    not matter."""
    spec = trainer.net.spec
    x = np.zeros((n, *spec.input.shape), np.int64 if spec.tokens else np.float32)
    labels = np.zeros((n, spec.input.shape[0]) if spec.dataset.next_token else n)
    return [trainer._input(x), trainer._array(labels, trainer.label_dtype), *trainer.inference_masks(n)]


def _settle(trainer, batch) -> None:
    """One forward and backward of the block on `batch`, leaving no trace: the gradients it writes are
    overwritten by the next step, the running statistics it moves are put back."""
    running = [p.data(trainer.ctx) for p in trainer.net.handles.values() if p.grad_req == "null"]
    saved = [a.copy() for a in running]
    with mx.autograd.record():
        out = trainer.block(*batch)
        loss = out[0] if isinstance(out, (list, tuple)) else out
    mx.autograd.backward(loss)
    for a, s in zip(running, saved):
        s.copyto(a)
    mx.nd.waitall()


def _executed_nodes(trainer, batch) -> list[Node]:
    """The nodes the block's graph runs in a training step, in the order it pushes them, with their dtypes and
    scopes; from the operator hook of two copies of the block's cached op (the block's own hook cannot be removed
    again), run on copies of the weights: the hook sees every node of a dynamic graph, and of a static one the
    nodes it runs outside the static plan. A backward node is named after its forward node ("..._backward")."""
    block = trainer.block
    _, out = block._cached_graph
    args, data, params = [], [], []
    for i, (is_data, p) in enumerate(block._cached_op_args):
        if is_data:
            data.append(i)
            args.append(batch[p])
        else:
            params.append(i)
            copy = p.data(trainer.ctx).copy()
            if p.grad_req != "null":
                copy.attach_grad()
            args.append(copy)
    indices = [("data_indices", data), ("param_indices", params)]
    dynamic = _hooked_run(mx.nd.CachedOp(out, indices), args, monitor_all=True)
    static = _hooked_run(mx.nd.CachedOp(out, indices + block._flags), args, monitor_all=False)

    graph = json.loads(out.tojson(remove_amp_cast=False))["nodes"]
    forward = {n["name"]: n for n in graph if n["op"] != "null"}
    nodes = []
    for name, opr, entries in _group_names(dynamic, [*forward, *(f"{n}_backward" for n in forward)]):
        # the hook reports a forward node's inputs, then its outputs; a backward node's outputs only
        inputs = len(forward[name]["inputs"]) if name in forward else 0
        dtypes = [dtype for _, dtype in entries]
        nodes.append(Node(name, opr, inputs=[d for d in dtypes[:inputs] if d],
                          outputs=[d for d in dtypes[inputs:] if d]))
    outside = {name for name, _, _ in _group_names(static, [n.name for n in nodes])}
    index = {n.name: i for i, n in enumerate(nodes)}
    consumers = defaultdict(list)  # forward node -> the forward nodes reading its outputs
    for name, n in forward.items():
        for source, _, _ in n["inputs"]:
            if graph[source]["op"] != "null":
                consumers[graph[source]["name"]].append(name)

    def gradient_sources(name: str) -> list[int]:
        """The backward nodes computing the gradient of a forward node's outputs (through the nodes whose
        gradient needs no node of its own, an addition's)."""
        found = []
        for c in consumers[name]:
            found += [index[f"{c}_backward"]] if f"{c}_backward" in index else gradient_sources(c)
        return found

    for i, node in enumerate(nodes):
        node.dynamic = node.name in outside
        node.backward = node.name not in forward
        if node.name in forward:
            node.scope = node.name.rpartition("/")[0]
            node.deps = [index[graph[s]["name"]] for s, _, _ in forward[node.name]["inputs"]
                         if graph[s]["op"] != "null" and graph[s]["name"] in index]
        elif node.name.endswith("_backward"):
            source = node.name.removesuffix("_backward")
            node.scope = source.rpartition("/")[0]
            node.deps = gradient_sources(source)
        elif node.name == GRADIENT_SUM:
            node.scope = _sum_scope(nodes[i + 1:], consumers)
        else:  # a zero gradient for an output nothing reads (max pooling's mask): the next node's input
            node.scope = next((n.name.rpartition("/")[0] for n in nodes[i + 1:] if n.name.endswith("_backward")), "")
    return nodes


def _hooked_run(op, args, monitor_all: bool) -> list[tuple[str, str, str | None]]:
    """(entry name, operator, dtype) for each array the hook reports in one forward and backward of `op`."""
    calls = []

    def hook(name, opr, handle):
        array = mx.nd.NDArray(ctypes.cast(handle, NDArrayHandle), writable=False)  # frees the hook's handle
        calls.append((py_str(name), py_str(opr), _float_dtype(array.dtype)))

    op._register_op_hook(hook, monitor_all)
    with mx.autograd.record():
        out = op(*args)
        loss = out[0] if isinstance(out, (list, tuple)) else out
    mx.autograd.backward(loss)
    mx.nd.waitall()
    return calls


def _float_dtype(dtype) -> str | None:
    dtype = np.dtype(dtype)
    if dtype.names == ("bfloat16",):  # MXNet's numpy stand-in for bfloat16
        return "bfloat16"
    return dtype.name if dtype.kind == "f" else None


def _group_names(calls, names):
    """Consecutive hook calls of one node -> (node name, operator, [(entry, dtype)]). An entry is named
    "<node>_<input or output name>"; nodes MXNet adds to the backward share a name ("sum_grad")."""
    by_length = sorted(set(names), key=len, reverse=True)
    groups = []
    for entry, opr, dtype in calls:
        name = next((n for n in by_length if entry.startswith(f"{n}_")), entry.rpartition("_")[0])
        if not groups or groups[-1][:2] != (name, opr) or entry in (e for e, _ in groups[-1][2]):
            groups.append((name, opr, []))
        groups[-1][2].append((entry, dtype))
    return groups


def _sum_scope(following: list[Node], consumers) -> str:
    """A sum of gradients comes just before the backward node of the forward node whose output it is the gradient
    of: the scopes that output's readers share."""
    for node in following:
        readers = consumers.get(node.name.removesuffix("_backward"), [])
        if node.name.endswith("_backward") and len(readers) > 1:
            return "/".join(os.path.commonprefix([r.split("/")[:-1] for r in readers]))
    return ""


def _spans(events) -> tuple[list, list]:
    """(operators, ranges) as (start, end, name, thread) in microseconds. The engine's events are written as a
    begin and an end line, one after the other."""
    ops, ranges, begun = [], [], {}
    for e in events:
        if e.get("ph") not in ("B", "E") or e.get("cat") not in ("operator", "event"):
            continue
        key = (e["cat"], e["tid"], e["name"])
        if e["ph"] == "B":
            begun.setdefault(key, []).append(e["ts"])
        elif begun.get(key):
            span = (begun[key].pop(), e["ts"], e["name"], e["tid"])
            (ops if e["cat"] == "operator" else ranges).append(span)
    return sorted(ops), sorted(ranges)


def _attribute(nodes: list[Node], ops, ranges) -> list[OpTime]:
    steps = [r for r in ranges if r[2] == STEP_SCOPE]
    if not steps:
        raise HarnessError("MXNet's profile holds no training step (no step range)")
    totals: dict[tuple, list] = defaultdict(lambda: [0.0, 0])

    def add(key, microseconds):
        totals[key][0] += microseconds * 1e-6
        totals[key][1] += 1

    inside = [False] * len(ops)
    for s_start, s_end, _, _ in steps:
        step = [k for k, op in enumerate(ops) if s_start <= op[0] <= s_end]
        within = [r for r in ranges if r[2] != STEP_SCOPE and s_start <= r[0] <= s_end]  # a step's ranges don't nest
        parts = [r for r in within if r[2] != RUNTIME_SCOPE]  # the ranges dispatching imperative operators
        for k, match in zip(step, _match(nodes, [ops[k][2] for k in step])):
            (start, end, name, _), inside[k] = ops[k], True
            if match is not None:
                n = nodes[match]
                cast = n.op.removeprefix("_backward_") in CASTS  # a cast's gradient is cast back
                add((n.op, n.scope, n.backward, cast, tuple(n.inputs), tuple(n.outputs)), end - start)
                continue
            if name == SEED:  # run whenever the engine gets to it
                scope = LOSS_SCOPE
            elif name in ENGINE_OPS:  # run for the Python thread, in the range it is in
                scope = next((r[2] for r in within if r[0] <= start <= r[1]), "")
            else:
                scope = next((p[2] for p in reversed(parts) if p[0] <= start), "")
            add((name, scope, False, name in CASTS, (), ()), end - start)
        # the engine idle: waiting for the Python thread, whose range says what it was dispatching
        busy = sorted(ops[k][:2] for k in step)
        for r_start, r_end, name, _ in within:
            idle = _idle(busy, r_start, r_end)
            if idle > 0:
                add((IDLE, name, False, False, (), ()), idle)
    for (start, end, name, _), seen in zip(ops, inside):
        if not seen:  # between steps: the engine freeing the last step's arrays
            add((name, "", False, False, (), ()), end - start)
    return [OpTime(op, scope, seconds, backward, cast, calls, inputs, outputs)
            for (op, scope, backward, cast, inputs, outputs), (seconds, calls) in totals.items()]


def _idle(busy, start: int, end: int) -> int:
    """Microseconds of [start, end] in none of the `busy` spans (sorted by start)."""
    idle, reached = 0, start  # reached: where the spans so far cover up to
    for s, e in busy:
        idle += max(0, min(s, end) - reached)
        reached = max(reached, e)
    return idle + max(0, end - reached)


def _match(nodes: list[Node], names: list[str]) -> list[int | None]:
    """The node each of one step's events (operator names, in time order) ran, or None for an operator outside
    the graph: every node once, after the nodes it reads from (where known), preferring nodes pushed earlier and
    events that are nodes. Searched depth first: an early choice between nodes ready at once (say the cast of the
    labels or the loss gradient's first operator, both outside the static plan) shows its error a few events
    later, when an operator finds no node ready."""
    keys = [BULK if n.dynamic else n.op for n in nodes]
    left = Counter(names)  # events not yet assigned, by name
    unmatched = Counter(keys)  # nodes not yet matched, by operator
    done = [False] * len(nodes)
    stack: list[list] = []  # per event assigned so far: [what it may be, the index of the one it is]
    for _ in range(SEARCH_LIMIT):
        if len(stack) == len(names):
            return [options[tried] for options, tried in stack]
        name = names[len(stack)]
        left[name] -= 1
        ready = [j for j, key in enumerate(keys) if key == name and not done[j]
                 and all(done[d] for d in nodes[j].deps)]
        # an event may be no node while enough events of its name remain for the nodes of that operator
        stack.append([ready + ([None] if left[name] >= unmatched[name] else []), -1])
        while stack:  # the next option of the last event; back to the event before when none is left
            options, tried = stack[-1]
            name = names[len(stack) - 1]
            if tried >= 0 and options[tried] is not None:
                done[options[tried]], unmatched[name] = False, unmatched[name] + 1
            if tried + 1 < len(options):
                stack[-1][1] = tried + 1
                if options[tried + 1] is not None:
                    done[options[tried + 1]], unmatched[name] = True, unmatched[name] - 1
                break
            stack.pop()
            left[name] += 1
        if not stack:
            break
    raise HarnessError(f"MXNet's profile: no order of the graph's {len(nodes)} nodes fits the {len(names)} "
                       f"operators of a step (searched {SEARCH_LIMIT} assignments)")
