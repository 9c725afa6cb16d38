"""Trainer.profile for torch: the steps under torch.profiler (CPU activities, with input shapes and dtypes), read
back from its events.

- Scopes: the record_function ranges the trainer opens while profiling (Network.scoped's, per layer, not under
  torch.compile: COMPILED_NOTE; TorchTrainer._scope's, per part); an op's scope is those it ran in, outermost
  first. A range's own self time is the Python (or the engine's C++) running between its ops: an op of its own,
  named after the range.
- Backward: the autograd engine runs each node as "autograd::engine::evaluate_function: <node>", carrying the
  sequence number of the forward op that created the node (whose own event carries it too, as the last op to
  start with that number): the node and every op under it get that forward op's scope. An AccumulateGrad node
  (writing a weight's .grad) has no forward op; the engine runs it right after the node that computed its
  gradient (its ready-queue priority is the highest), so it gets the scope of the node before it on its thread.
- Dtypes: the input dtypes the profiler recorded, floating-point ones only. A cast is aten::to, aten::_to_copy or
  aten::copy_ that copies between two floating-point dtypes (copy_'s inputs: destination, source), with the ops
  under it (the destination's allocation); its output dtype is the destination's. Other ops' outputs are not
  recorded.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity

from harness.adapter import PART_SCOPES, OpTime, ProfiledOps

BACKWARD = "autograd::engine::evaluate_function: "
ACCUMULATE = "torch::autograd::AccumulateGrad"
CONVERSIONS = {"aten::to", "aten::_to_copy", "aten::copy_"}
FLOATS = {"float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16"}
COMPILED_NOTE = ("torch.compile runs the network as one compiled graph whose fused kernels open no layer ranges "
                 "(hooks and record_function do not survive compilation), so its forward and backward, and the "
                 "dispatch of both, are not attributed to layers and count as 'other'; the loss, the update, loss "
                 "scaling and the autograd engine run eagerly in their scopes")


def profile_steps(trainer, run_steps) -> ProfiledOps:
    """Run the core's steps under the profiler and return every op that ran, with its scope."""
    compiled = trainer.compiled  # no layer ranges (COMPILED_NOTE): hooks added to the layers would not run
    trainer.profiling = True  # the parts' ranges open (TorchTrainer._scope)
    try:
        with contextlib.nullcontext(set()) if compiled else trainer.net.scoped() as scopes:
            with torch.profiler.profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                run_steps()
    finally:
        trainer.profiling = False
    events = prof.events()
    ours = scopes | PART_SCOPES
    scope: dict[int, tuple[str, ...]] = {}  # by id(event): the ranges it ran in
    nodes = []  # the autograd nodes' events: they and the events under them are backward
    for event in events:
        if event.cpu_parent is None:
            _walk(event, (), ours, scope, nodes)
    backward = {id(e) for node in nodes for e in _subtree(node)}
    # the forward op that created each autograd node: the last to start with its number (an op carries the number
    # the next node will get: ops before the node's, like the previous step's loss.item(), carry it too)
    forward = {(e.thread, e.sequence_nr): scope[id(e)] for e in sorted(events, key=lambda e: e.time_range.start)
               if e.sequence_nr >= 0 and id(e) not in backward}
    previous: dict[int, tuple[str, ...]] = {}  # by thread: the scope of the node that ran last
    for node in sorted(nodes, key=lambda e: e.time_range.start):
        if node.name == BACKWARD + ACCUMULATE:
            where = previous.get(node.thread, ())
        else:
            where = previous[node.thread] = forward.get((node.fwd_thread, node.sequence_nr), ())
        for event in _subtree(node):
            scope[id(event)] = where + scope[id(event)]
    totals: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for event in events:
        cast = _cast(event)
        key = (event.name, "/".join(scope[id(event)]), id(event) in backward, cast is not None,
               tuple(FLOATS[d] for d in event.input_dtypes or () if d in FLOATS), (cast,) if cast else ())
        totals[key][0] += event.self_cpu_time_total * 1e-6  # self times: nothing counts twice
        totals[key][1] += 1
    ops = [OpTime(op=name, scope=where, seconds=seconds, backward=backward, cast=cast, calls=calls, inputs=inputs,
                  outputs=outputs)
           for (name, where, backward, cast, inputs, outputs), (seconds, calls) in totals.items()]
    return ProfiledOps(f"torch.profiler (torch {torch.__version__}, CPU activities)", ops,
                       COMPILED_NOTE if compiled else "")


def _walk(event, outer: tuple[str, ...], ours: set[str], scope: dict, nodes: list) -> None:
    """Give `event` and the events under it the ranges in `ours` they ran in; an autograd node starts afresh (it
    gets its forward op's scope later)."""
    if event.name.startswith(BACKWARD):
        nodes.append(event)
        outer = ()
    inner = outer + (event.name,) if event.name in ours else outer
    scope[id(event)] = inner
    for child in event.cpu_children:
        _walk(child, inner, ours, scope, nodes)


def _subtree(event):
    yield event
    for child in event.cpu_children:
        yield from _subtree(child)


def _cast(event) -> str | None:
    """The destination dtype if `event` converts between floating-point dtypes or runs inside such a
    conversion; None otherwise."""
    while event is not None:
        if event.name in CONVERSIONS:
            for copy in _subtree(event):
                if copy.name == "aten::copy_":
                    dst, src = (FLOATS.get(d) for d in (copy.input_dtypes or ["", ""])[:2])
                    if dst and src and dst != src:
                        return dst
        event = event.cpu_parent
    return None
