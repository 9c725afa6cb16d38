"""Trainer.profile for TensorFlow: the steps under TensorFlow's own profiler (tf.profiler.experimental), read back
from the XSpace it writes.

Graph steps: the executor traces every op it runs as "node_name:OpType" on the host plane, and a node's name holds
the name scopes it was built in: each Keras layer's (its name, network.py), the parts' (adapter.py, optimizers.py)
and, for a gradient, "gradient_tape/<the forward op's scopes>/", which GradientTape gives every op of a backward
function. Each op is joined by name to the graph of the tf.function that ran, for its dtypes (fixed when the
function was traced; the trace records none). Five kinds of time get their scopes otherwise:
- Grappler's remapper (oneDNN on CPU) fuses a matmul or convolution with the bias add and activation after it into
  one kernel named after the last node it fused, often the next layer's activation: the kernel gets the scopes and
  dtypes of the matmul or convolution it starts from, the node doing its work.
- GradientTape sums the gradients of a tensor used more than once (AddN) in the scope tape.gradient was called in:
  the sum gets the scopes its summed gradients share (a batchnorm's input feeds three of its ops: the sum is that
  layer's backward; a residual block's input feeds both branches: no layer's).
- The executor's own work between the ops of one ExecutorState::Process event (readying a node's inputs, passing
  on its outputs; the executor runs ops one after another on one thread, inter-op threads being 1) goes to the op
  before it, in entries of its own named after that event, as a torch layer's Python glue goes to its layer.
- The tf.function's own trace event on the calling thread, less the run of its graph in it, is the runtime's
  dispatch (Python handling the arguments and outputs, the eager runtime launching the function): RUNTIME_SCOPE.
  On a small model it is a large share of the step (mnist_mlp: about 0.6 of 2.5 ms).
- A jit-compiled function that a graph step calls (Keras' TensorFlow backend compiles every grouped convolution so:
  TensorFlow's CPU kernels have no float64 gradient for one) runs as an asynchronous kernel
  (ExecutorState::ProcessAsync::Start) with no node event, its XLA program's thunks traced inside it, named by
  instructions of the function's own graph, which holds no layer's scope. Its thunks and its launch (the kernel's
  time outside them) go to the scope of the node calling it (_compiled_calls).

XLA steps (the "xla" variant): the CPU runtime traces every thunk of the compiled program by its HLO instruction,
and the profile carries the program's HLO, whose instructions' scopes, dtypes and casts harness.run.xla_profile
reads (as JAX's). XLA runs independent thunks at once (the caller's thread and the intra-op pool), so their times
can add up to more than the step.
"""
from __future__ import annotations

import re
import tempfile
from bisect import bisect_left
from collections import defaultdict
from dataclasses import replace
from os.path import commonprefix
from pathlib import Path

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from harness.adapter import RUNTIME_SCOPE, OpTime, ProfiledOps
from harness.errors import HarnessError
from harness.run import xla_profile

OP_EVENT = re.compile(r"^([A-Za-z0-9.][\w./>-]*):(\w+)$")  # TraceMeOp's "node_name:OpType"
PROCESS = "ExecutorState::Process"  # the executor running a batch of ready nodes, one after another
GRAPH_RUN = "KernelAndDeviceFunc::Run"  # the caller's thread running the function's graph (waiting on the executor)
ASYNC = "ExecutorState::ProcessAsync::Start"  # an asynchronous kernel's run: a compiled function call's in a graph
LAUNCH = "XLA launch"  # the op of a compiled call's time outside its thunks
LOWERED = re.compile(r"^(.+?)/(then|else)/_\d+/(.+)$")  # a cond branch's node inlined by the If lowering pass
# a node a Grappler optimizer rewrote: "<scope>/ArithmeticOptimizer/AddOpsRewrite_Leaf_1_<the node's name>"
REWRITTEN = re.compile(r"^(.+)/\w+Optimizer/(\w+)$")
GRADIENT = "gradient_tape"  # GradientTape's scope for backward ops
BACKWARD_MARK = f"{GRADIENT}/"  # in the op_name of an XLA instruction a backward op became
# the xla variant's profile (measured, resnet8 at batch 4 on 32x32 inputs, two intra-op threads: layers and parts
# held 43% of the fp32 step and 51% of the amp_fp16 step, whose float16 convolutions XLA redoes in float32; 36% and
# 26% when the instructions XLA made were left unattributed)
XLA_NOTE = ("XLA's own trace of the same compiled step, thunk by thunk: a fusion goes to the layer most of its ops "
            "come from, an instruction XLA created to the layer using its result, and with more than one intra-op "
            "thread part of the work finishes outside any traced thunk, so the layers hold only part of the step.")
FUSED_HOPS = 4  # a fused pattern's start lies this many first-input hops back at most (MatMul, BiasAdd, Add, Relu)


def profile_steps(trainer, run_steps) -> ProfiledOps:
    """Run the core's steps under the profiler and return every op (or XLA thunk) that ran on the host."""
    step = trainer._step  # the tf.function: its traced graphs give the ops' dtypes
    with tempfile.TemporaryDirectory(prefix="amp-harness-tf-profile-", ignore_cleanup_errors=True) as logdir:
        # host events only (this is the CPU path); Python calls are not traced
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0,
                                                           device_tracer_level=0)
        with tf.profiler.experimental.Profile(logdir, options=options):
            run_steps()
        files = sorted(Path(logdir).glob("plugins/profile/*/*.xplane.pb"))
        if len(files) != 1:
            raise HarnessError(f"TensorFlow's profiler wrote {len(files)} trace files, expected one")
        serialized = files[0].read_bytes()
    host = next((plane for plane in xplane_pb2.XSpace.FromString(serialized).planes if plane.name == "/host:CPU"), None)
    if host is None:
        raise HarnessError("TensorFlow's profiler wrote no host plane")
    ran = _functions_run(host)
    # the step's traced functions (a tf.function lists them only privately), by the name the trace ran them under
    graphs = [cf.graph for cf in step._list_all_concrete_functions() if cf.name.decode() in ran]
    if not graphs:
        raise HarnessError(f"TensorFlow's profile shows none of the step's functions running (it ran: "
                           f"{', '.join(sorted(ran)) or 'no function'})")
    # the XLA programs in the profile by module name (for a graph step, only those of the compiled functions it calls)
    hlo = {name: module for (name, _), module in xla_profile.modules(serialized, BACKWARD_MARK).items()}
    called = _compiled_calls(graphs)
    nested = {name: called[_function(name)] for name in hlo if _function(name) in called}  # module -> scope
    ops = []
    for key, (self_ps, calls, executor_ps) in _event_times(host, hlo, set(nested)).items():
        if key[0] == "hlo":  # an instruction that ran, as an op named by XLA (its name without its number); no
            # weight is named by a TensorFlow step's arguments: none to find
            ops.append(hlo[key[1]].op_time(key[2], self_ps * 1e-12, calls, {}, op=re.sub(r"\.\d+$", "", key[2])))
            if key[1] in nested:  # a compiled call's: its caller's scope
                ops[-1] = replace(ops[-1], scope=nested[key[1]], backward=GRADIENT in nested[key[1]].split("/"))
            continue
        if key[0] == "launch":
            scope = nested[key[1]]
            ops.append(OpTime(op=LAUNCH, scope=scope, seconds=self_ps * 1e-12, backward=GRADIENT in scope.split("/"),
                              calls=calls))
            if executor_ps:
                ops.append(replace(ops[-1], op=PROCESS, seconds=executor_ps * 1e-12))
            continue
        _, name, op_type = key
        if name in ran:  # an XLA-compiled function's launch: its thunks are the ops
            continue
        node = _node(graphs, name)
        where = (_fused_root(node, op_type) or node) if node is not None else None
        scope = _scope(where) if where is not None else name.rpartition("/")[0]
        dtypes = {side: tuple(t.dtype.name for t in getattr(where, side) if t.dtype.name in xla_profile.FLOATS.values())
                  for side in ("inputs", "outputs")} if where is not None else {}
        ops.append(OpTime(op=op_type, scope=scope, seconds=self_ps * 1e-12, backward=GRADIENT in scope.split("/"),
                          cast=_base_type(op_type) == "Cast", calls=calls, **dtypes))
        if executor_ps:  # the executor handling this node's tensors
            ops.append(replace(ops[-1], op=PROCESS, seconds=executor_ps * 1e-12, cast=False))
    compiled_step = len(hlo) > len(nested)  # the xla variant: the step's own program
    if not compiled_step:
        dispatch_ps, calls = _dispatch(host, step.__name__)
        if calls:
            ops.append(OpTime(op=f"{step.__name__} dispatch", scope=RUNTIME_SCOPE, seconds=dispatch_ps * 1e-12,
                              calls=calls))
    return ProfiledOps(f"tf.profiler.experimental (TensorFlow {tf.__version__}, host trace)", ops,
                       XLA_NOTE if compiled_step else "")


def _compiled_calls(graphs) -> dict[str, str]:
    """{function name: the scope its call ran in} for each call of a jit-compiled function in the step's graphs (the
    module docstring). A forward call is named in its layer's scope; the call of its gradient function is made
    outside every scope but takes the forward call's outputs: it gets that call's scope under GradientTape's."""
    out = {}
    for graph in graphs:
        calls = [op for op in graph.get_operations() if op.type.endswith("PartitionedCall") and _jit(op)]
        scopes = {op.name: op.name.rpartition("/")[0] for op in calls}
        for op in calls:
            scope = scopes[op.name] or next((f"{GRADIENT}/{scopes[t.op.name]}" for t in op.inputs
                                             if scopes.get(t.op.name)), "")
            out[op.get_attr("f").name.lstrip("_")] = scope
    return out


def _jit(op) -> bool:
    try:
        return bool(op.get_attr("_XlaMustCompile"))
    except ValueError:  # not set
        return False


def _function(module: str) -> str:
    """The function an XLA module was compiled from, as _compiled_calls names it: "a_forward__conv_xla_71__.1" ->
    "forward__conv_xla_71"."""
    return re.sub(r"^a_|__(\.\d+)?$", "", module)


def _dispatch(plane, function: str) -> tuple[int, int]:
    """(picoseconds, calls) of the runtime's dispatch (the module docstring), by the event named after `function`."""
    total = calls = 0
    for line in plane.lines:
        spans: dict[str, list[tuple[int, int]]] = {function: [], GRAPH_RUN: []}
        for event in line.events:
            name = plane.event_metadata[event.metadata_id].name
            if name in spans:
                spans[name].append((event.offset_ps, event.offset_ps + event.duration_ps))
        for start, end in spans[function]:
            total += end - start - sum(e - s for s, e in spans[GRAPH_RUN] if start <= s and e <= end)
            calls += 1
    return total, calls


def _stats(plane, event) -> dict:
    return {plane.stat_metadata[s.metadata_id].name: s.str_value or (plane.stat_metadata[s.ref_value].name
                                                                      if s.ref_value else s.int64_value)
            for s in event.stats}


def _functions_run(plane) -> set[str]:
    """The functions the trace shows running: an eager call of one has its name in an "eager_op" stat."""
    ids = {i for i, meta in plane.stat_metadata.items() if meta.name == "eager_op"}
    return {_stats(plane, event)["eager_op"] for line in plane.lines for event in line.events
            if any(s.metadata_id in ids for s in event.stats)}


def _event_times(plane, hlo: dict, nested: set) -> dict[tuple, list[int]]:
    """{("op", node name, op type), ("hlo", module, instruction) or ("launch", module): [self picoseconds, calls,
    executor picoseconds after it]} over every thread. An op's self time excludes the ops nested in it on its thread
    (a function-call op runs its body inline); XLA thunks call none, and the pool's threads share one line, where
    their thunks overlap without nesting. A "launch" is the asynchronous kernel running a `nested` module (a
    compiled call in a graph step) less the time its module's thunks ran in it, on any thread; it takes the place
    of an op among the executor's."""
    totals: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    lines, thunks = [], []  # each line's (ops, processes, launches); (start, end, module) of the nested modules' thunks
    for line in plane.lines:
        ops, processes, launches = [], [], []
        for event in line.events:
            name = plane.event_metadata[event.metadata_id].name
            span = (event.offset_ps, event.offset_ps + event.duration_ps)
            if name == PROCESS:
                processes.append(span)
            elif name == ASYNC and nested:
                launches.append(span)
            elif match := OP_EVENT.match(name):
                ops.append((*span, ("op", *match.groups())))
            elif hlo and event.stats:
                stats = _stats(plane, event)
                key = (stats.get("hlo_module"), stats.get("hlo_op"))
                if key[0] in hlo and key[1] in hlo[key[0]].by_name:
                    totals[("hlo", *key)][0] += event.duration_ps
                    totals[("hlo", *key)][1] += 1
                    if key[0] in nested:
                        thunks.append((*span, key[0]))
        lines.append((ops, processes, launches))
    for ops, processes, launches in lines:
        for start, end in launches:
            inside = [t for t in thunks if start <= t[0] and t[1] <= end]
            if inside:
                key = ("launch", inside[0][2])
                ops.append((start, end, key))
                totals[key][0] -= _covered(inside)
        ops.sort(key=lambda e: (e[0], -e[1]))
        outer, enclosing = [], []  # ops nested in no other op; the ops enclosing the current one
        for start, end, key in ops:
            while enclosing and enclosing[-1][0] < end:
                enclosing.pop()
            if enclosing:
                totals[enclosing[-1][1]][0] -= end - start
            else:
                outer.append((start, end, key))
            totals[key][0] += end - start
            totals[key][1] += 1
            enclosing.append((end, key))
        starts = [e[0] for e in outer]
        for p_start, p_end in processes:
            inside = [e for e in outer[bisect_left(starts, p_start):bisect_left(starts, p_end)] if e[1] <= p_end]
            if not inside:
                continue
            totals[inside[0][2]][2] += inside[0][0] - p_start  # readying the first node
            for (_, end, key), following in zip(inside, [*(e[0] for e in inside[1:]), p_end]):
                totals[key][2] += following - end
    return totals


def _covered(spans) -> int:
    """Picoseconds in the union of (start, end, ...) spans (thunks on several threads overlap)."""
    total, reach = 0, None
    for start, end, *_ in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def _node(graphs, name: str):
    """The graph node the executor ran as `name`, looking into cond branches that the runtime inlined, or for a
    node a Grappler optimizer rewrote, the node it rewrote (the same dtypes); None when there is none."""
    for graph in graphs:
        try:
            return graph.get_operation_by_name(name)
        except (KeyError, ValueError):
            pass
    if lowered := LOWERED.match(name):
        cond, branch, inner = lowered.groups()
        op = _node(graphs, cond)
        # cond_v2 keeps each branch's graph on the If op (its gradient needs them)
        graph = getattr(op, "_true_graph" if branch == "then" else "_false_graph", None) if op is not None else None
        return _node([graph], inner) if graph is not None else None
    if rewritten := REWRITTEN.match(name):
        scope, stage = rewritten.groups()
        tails = stage.split("_")
        return next((node for node in (_node(graphs, f"{scope}/{'_'.join(tails[i:])}") for i in range(1, len(tails)))
                     if node is not None), None)
    return None


def _scope(node) -> str:
    """The scopes a graph node ran in: its name's, or for GradientTape's AddN, those its summed gradients share."""
    scope = node.name.rpartition("/")[0]
    if node.type != "AddN" or GRADIENT in scope.split("/"):
        return scope
    summed = [_scope(t.op).split("/") for t in node.inputs]
    return "/".join(commonprefix(summed)) if all(GRADIENT in s for s in summed) else scope


def _base_type(op_type: str) -> str:
    """The graph's op type behind an oneDNN kernel's: "_MklNativeFusedConv2D" -> "FusedConv2D"."""
    return re.sub(r"^_?(Mkl)?(Native)?", "", op_type)


def _fused_root(node, op_type: str):
    """The node a fused kernel's pattern starts from (_MklNativeFusedMatMul named after a Relu: the MatMul), or None."""
    base = _base_type(op_type)
    if base == node.type or "Fused" not in base:
        return None
    start = base.replace("Fused", "").lstrip("_")  # FusedMatMul -> MatMul, FusedConv2D -> Conv2D
    for _ in range(FUSED_HOPS):
        if not node.inputs:
            return None
        node = node.inputs[0].op
        if node.type == start:
            return node
    return None
