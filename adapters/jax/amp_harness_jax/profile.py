"""Trainer.profile for JAX: the jitted step's runs under jax.profiler, read back from the XSpace it writes.

- What ran: on XLA:CPU the profiler records an event per executed HLO instruction (a thunk: a fusion, a
  convolution, a copy...) on the host plane, with the instruction's name, its module's name and the executable's
  program id. The XSpace also holds each loaded executable's optimised HLO module (the profiler's "Hlo Proto"), so
  events are joined to the instructions of the very program that ran, not of a recompilation.
- Scopes: the adapter names layers and parts with jax.named_scope, which writes nothing but the ops' op_name
  metadata: "jit(step)/jvp(layer.3)/conv_general_dilated" forward, "jit(step)/transpose(jvp(layer.3))/..." for
  the backward ops JAX derives from them (transpose(...) marks those). XLA fuses ops of neighbouring layers (a
  batchnorm with the next relu, the update with the loss scaler's select): a fusion goes to the scope most of its
  arithmetic instructions carry, the one nearest its root on a tie.
- Instructions XLA makes itself have no op_name (layout copies, the converts of its float normalisation, the
  iota constants of a max-pool's gradient, the dots and weight-gradient convolutions it rewrites): they go to the
  nearest named instruction that uses their result (inside a fusion, the fused one that reads it), except that a
  result only the loss scaling or the update uses is a weight's gradient, which goes to the backward pass of the
  weight's layer (the weight is the step's argument, params['0.kernel'] or its optimizer state, that those uses
  read); with no use, to the nearest named operand.
- Dtypes: the element types of the instruction's operands and results in the compiled HLO. A cast is a convert
  between two floating-point types, or a fusion of nothing but such converts (and bitcasts or reshapes).
- Times: an instruction runs for its event or, if XLA:CPU runs it asynchronously (its convolutions: the event
  only launches them on the thread pool), until it completes; where instructions overlap (XLA runs independent
  ones on its threads at once) each instant is shared equally among those running, so that no time counts twice.
  An instant in which no instruction ran but the runtime's own events were open (the jitted step's dispatch, the
  thunk executor between instructions, handing back outputs) is the runtime's (RUNTIME_SCOPE), under the name of
  the innermost such event. An annotation named after a scope is that scope's: while profiling, the adapter runs
  train_step (its Python around the jitted call) in RUNTIME_SCOPE and the loss scaler's update on the host in
  LOSS_SCALE_SCOPE.
"""
from __future__ import annotations

import bisect
import functools
import re
import tempfile
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import jax

from harness.adapter import RUNTIME_SCOPE, OpTime, ProfiledOps, layer_scope
from harness.errors import HarnessError

# xla_data.proto's PrimitiveType numbers of the floating-point types
FLOATS = {10: "float16", 11: "float32", 12: "float64", 16: "bfloat16"}
SCOPE_TOKEN = re.compile(r"layer\.\d[\w.]*|part\.[a-z_]+")  # harness.adapter.layer_scope's, LOSS_SCOPE's...
WEIGHT_ARGUMENT = re.compile(r"\['([^'\]]+)'\]$")  # the step's arguments: params['0.kernel'], opt_state['m']['0.kernel']
# instructions that compute nothing (they move or reinterpret data): no vote on where a fusion's time goes
NO_ARITHMETIC = {"parameter", "constant", "broadcast", "bitcast", "reshape", "transpose", "copy", "slice",
                 "concatenate", "tuple", "get-tuple-element", "iota", "pad"}
ASYNC = {"convolution"}  # XLA:CPU's convolution thunk runs Eigen's convolution on the intra-op pool, asynchronously
PURE_CASTS = {"convert", "bitcast", "reshape", "parameter"}  # a fusion of nothing else only converts
NOTE = ("the timed runs' own jitted executable, train_step wrapped in a profiler annotation; XLA fuses ops across "
        "layers: a fusion goes to the layer most of its ops come from, an instruction XLA made itself to the layer "
        "using its result (a weight's gradient to the weight's layer), and overlapping instructions share the time")


@dataclass
class Instruction:
    name: str
    opcode: str
    dtypes: tuple[str, ...]  # its result's floating-point element types (a tuple's, in order)
    op_name: str  # from its metadata: the jit name stack, scopes included; "" for none
    operands: list[int]  # instruction ids
    calls: list[int]  # computation ids: a fusion's fused computation, a reduce's reducer...
    parameter: int  # a parameter's number


class Module:
    """The instructions of one optimised HLO module (an HloModuleProto)."""

    def __init__(self, proto: bytes):
        self.by_id: dict[int, Instruction] = {}
        self.roots: dict[int, int] = {}  # computation id -> its root instruction's id
        self.members: dict[int, list[int]] = {}  # computation id -> its instructions' ids
        for number, computation in _fields(proto):
            if number != 3:  # HloModuleProto.computations
                continue
            fields = _fields(computation)
            ids = []
            for instruction in (value for n, value in fields if n == 2):
                ins = _instruction(instruction)
                self.by_id[ins[0]] = ins[1]
                ids.append(ins[0])
            cid = _scalar(fields, 5)
            self.roots[cid], self.members[cid] = _scalar(fields, 6), ids
        self.by_name = {ins.name: i for i, ins in self.by_id.items()}
        self.users: dict[int, list[int]] = defaultdict(list)
        for i, ins in self.by_id.items():
            for operand in ins.operands:
                self.users[operand].append(i)
        self._named: dict[int, str] = {}

    def owner(self, i: int, weights: dict[str, str]) -> tuple[str, bool]:
        """(scope, backward) of an instruction by the rules in the module docstring; `weights`: each trainable
        weight's layer scope by its canonical name."""
        if self.named(i):
            return _scope(self.named(i))
        users = self._first_use(i)
        if _scope(users)[0].startswith("part."):
            # only the loss scaling or the update uses it: a weight's gradient if, through them, it reaches one
            # that reads a weight (or the weight's optimizer state)
            through = (lambda k: self.users.get(k) if k == i or not self.named(k) or self._in_part(k) else None)
            for j in self._walk(i, through):
                for k in self.by_id[j].operands if self._in_part(j) else ():
                    weight = WEIGHT_ARGUMENT.search(self.by_id[k].op_name) \
                        if self.by_id[k].opcode == "parameter" else None
                    if weight and weight.group(1) in weights:
                        return weights[weight.group(1)], True
        if users:
            return _scope(users)
        return _scope(next((self.named(j) for j in self._walk(i, lambda k: self.by_id[k].operands)
                            if self.named(j)), ""))

    def named(self, i: int) -> str:
        """An instruction's own op_name; a fusion's (or call's) is that of the scope most of its arithmetic
        instructions carry (of its instructions, if none computes), the one nearest its root on a tie. "" for
        none."""
        if i in self._named:
            return self._named[i]
        ins = self.by_id[i]
        name = ins.op_name
        if ins.opcode == "parameter":  # the step's arguments are named after them ("x", "params['0.kernel']")
            name = ""
        elif ins.opcode in ("fusion", "call") and ins.calls:
            root = self.roots[ins.calls[0]]
            members = [j for j in (root, *self._walk(root, lambda k: self.by_id[k].operands)) if self.named(j)]
            voters = [j for j in members if self.by_id[j].opcode not in NO_ARITHMETIC] or members
            votes = Counter(_scope(self.named(j)) for j in voters)
            winner = max(votes, key=votes.get) if votes else None  # a tie: the first counted, nearest the root
            name = next((self.named(j) for j in voters if _scope(self.named(j)) == winner), "")
        self._named[i] = name
        return name

    def _first_use(self, i: int) -> str:
        """The op_name of the nearest named use of i's result (through unnamed users): inside a fusion, that of the
        instruction nearest the fused parameter that i's result arrives as."""
        seen, queue = {i}, deque([i])
        while queue:
            k = queue.popleft()
            for j in self.users.get(k, ()):
                if j in seen:
                    continue
                seen.add(j)
                user = self.by_id[j]
                inside = [p for p in self.members[user.calls[0]] if self.by_id[p].opcode == "parameter" and
                          user.operands[self.by_id[p].parameter] == k] if user.opcode == "fusion" else []
                named = next((self.named(q) for p in inside for q in self._walk(p, self.users.get) if self.named(q)),
                             "") or self.named(j)
                if named:
                    return named
                queue.append(j)
        return ""

    def _in_part(self, i: int) -> bool:
        return _scope(self.named(i))[0].startswith("part.")

    def _walk(self, i: int, edges):
        """The instructions reached from i through edges(instruction) (its users or its operands; None for
        none), nearest first."""
        seen, queue = {i}, deque([i])
        while queue:
            for j in edges(queue.popleft()) or ():
                if j not in seen:
                    seen.add(j)
                    queue.append(j)
                    yield j

    def is_cast(self, i: int) -> bool:
        """A convert between floating-point types, or a fusion of nothing but them (and bitcasts, reshapes)."""
        ins = self.by_id[i]
        if ins.opcode == "convert":
            return bool(ins.dtypes) and all(self.by_id[j].dtypes for j in ins.operands)
        if ins.opcode != "fusion" or not ins.calls:
            return False
        members = [self.by_id[j] for j in self.members[ins.calls[0]]]
        converts = [j for j in self.members[ins.calls[0]] if self.by_id[j].opcode == "convert"]
        return all(m.opcode in PURE_CASTS for m in members) and any(self.is_cast(j) for j in converts)

    def inputs(self, i: int) -> tuple[str, ...]:
        return tuple(dtype for j in self.by_id[i].operands for dtype in self.by_id[j].dtypes)


def annotated(function, scope: str):
    """`function`, run in a profiler annotation (a host event) named `scope`."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        with jax.profiler.TraceAnnotation(scope):
            return function(*args, **kwargs)

    return run


def profile_steps(run_steps, layers) -> ProfiledOps:
    """Run the core's steps under jax.profiler and return every HLO instruction that ran, with its scopes;
    `layers`: the graph's LayerInfos."""
    weights = {f"{info.path}.{name}": layer_scope(info.path) for info in layers for name in info.params}
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no event per Python call (overhead): XLA's events are C++ ones
    options.enable_hlo_proto = True  # the executables' HLO modules, which the events are joined to
    with tempfile.TemporaryDirectory(prefix="amp-harness-jax-profile-") as log_dir:
        jax.profiler.start_trace(log_dir, profiler_options=options)
        try:
            run_steps()
        finally:
            jax.profiler.stop_trace()
        found = list(Path(log_dir).glob("plugins/profile/*/*.xplane.pb"))
        if len(found) != 1:
            raise HarnessError(f"jax.profiler wrote {len(found)} XSpace files (*.xplane.pb), expected one")
        xspace = found[0].read_bytes()
    modules = _modules(xspace)
    plane = jax.profiler.ProfileData.from_serialized_xspace(xspace).find_plane_with_name("/host:CPU")
    instructions, runtime = _events(plane)
    instructions = _intervals(instructions, modules)
    if not instructions:
        raise HarnessError("jax.profiler recorded no HLO instruction (thunk) events on the host plane")
    totals: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for (_, _, key), seconds in zip(instructions + runtime, _timeline(instructions, runtime)):
        totals[key][0] += seconds
        totals[key][1] += 1
    ops = []
    for key, (seconds, calls) in totals.items():
        if len(key) == 1:  # a runtime event (or a scope the adapter annotated): the instants no instruction ran in
            if seconds > 0:
                scope = key[0] if SCOPE_TOKEN.fullmatch(key[0]) else RUNTIME_SCOPE
                ops.append(OpTime(key[0], scope, seconds, calls=calls))
            continue
        module, program, name = key
        hlo = modules.get((module, program))
        if hlo is None or name not in hlo.by_name:  # not expected: its time is then "other", under its own name
            ops.append(OpTime(name, "", seconds, calls=calls))
            continue
        i = hlo.by_name[name]
        scope, backward = hlo.owner(i, weights)
        ops.append(OpTime(name, scope, seconds, backward=backward, cast=hlo.is_cast(i), calls=calls,
                          inputs=hlo.inputs(i), outputs=hlo.by_id[i].dtypes))
    return ProfiledOps(f"jax.profiler (jax {jax.__version__}; XLA:CPU instruction events joined to the executable's "
                       f"HLO)", ops, NOTE)


def _scope(op_name: str) -> tuple[str, bool]:
    """(the scopes named in an op_name, outermost first; whether it is a backward op)."""
    return "/".join(SCOPE_TOKEN.findall(op_name)), "transpose(" in op_name


def _events(plane) -> tuple[list, list]:
    """The host plane's events: HLO instructions as (start ns, end ns, ns of their "end: <instruction>" event or
    None, (module, program id, instruction)), the end event being the one their flow leads to (the event's "_p"
    stat, the end's "_c"); and the runtime's own (jit dispatch, the thunk executor, handing back outputs...) as
    (start ns, end ns, (name,))."""
    started, finished, runtime = [], {}, []
    for line in plane.lines if plane is not None else ():
        for event in line.events:
            stats = dict(event.stats)
            if "hlo_op" in stats:
                started.append((int(event.start_ns), int(event.end_ns), stats.get("_p"),
                                (stats.get("hlo_module", ""), int(stats.get("program_id", -1)), stats["hlo_op"])))
                continue
            if event.name.startswith("end: ") and "_c" in stats:
                finished[stats["_c"]] = int(event.start_ns)
            if event.end_ns > event.start_ns:
                runtime.append((int(event.start_ns), int(event.end_ns), (event.name,)))
    return [(start, end, finished.get(flow), key) for start, end, flow, key in started], runtime


def _intervals(instructions: list, modules: dict) -> list[tuple[int, int, tuple]]:
    """(start ns, end ns, key) of each instruction: its event's span, except for the instructions XLA:CPU runs
    asynchronously (ASYNC: the event only launches them on the thread pool, whose threads record nothing), which
    end at the first start of an instruction using their result or at their end event, whichever comes first (the
    end event comes once the completion callback has also run the successors it runs inline)."""
    starts = defaultdict(list)
    for start, _, _, key in instructions:
        starts[key].append(start)
    for times in starts.values():
        times.sort()
    intervals = []
    for start, end, finished, key in instructions:
        hlo = modules.get(key[:2])
        i = hlo.by_name.get(key[2]) if hlo is not None else None
        if i is not None and hlo.by_id[i].opcode in ASYNC:
            uses = (starts.get((*key[:2], hlo.by_id[j].name), []) for j in hlo.users.get(i, []))
            later = [times[k] for times in uses for k in [bisect.bisect_right(times, start)] if k < len(times)]
            end = max(end, min(later + ([finished] if finished else []), default=end))
        intervals.append((start, end, key))
    return intervals


def _timeline(instructions: list, runtime: list) -> list[float]:
    """Seconds of each event (instructions, then runtime events): an instant in which k instructions ran counts
    1/k to each of them; an instant in which none ran counts to the innermost (latest started) runtime event open
    then, if any."""
    intervals = [(start, end) for start, end, _ in instructions + runtime]
    edges = sorted({t for interval in intervals for t in interval})
    starts, ends = defaultdict(list), defaultdict(list)
    for index, (start, end) in enumerate(intervals):
        starts[start].append(index)
        ends[end].append(index)
    seconds, running, open_ = [0.0] * len(intervals), set(), set()
    for t, following in zip(edges, edges[1:]):
        for index in ends[t]:
            (running if index < len(instructions) else open_).discard(index)
        for index in starts[t]:
            if intervals[index][1] > t:
                (running if index < len(instructions) else open_).add(index)
        if running:
            for index in running:
                seconds[index] += (following - t) / 1e9 / len(running)
        elif open_:
            seconds[max(open_, key=lambda index: (intervals[index][0], index))] += (following - t) / 1e9
    return seconds


def _modules(xspace: bytes) -> dict[tuple[str, int], Module]:
    """The HLO modules in the XSpace's metadata plane, by (module name, program id)."""
    modules = {}
    for number, plane in _fields(xspace):
        plane = _fields(plane) if number == 1 else []  # XSpace.planes
        if _scalar(plane, 2) != b"/host:metadata":  # XPlane.name
            continue
        stat_names = {}
        for entry in (value for n, value in plane if n == 5):  # XPlane.stat_metadata: id -> XStatMetadata
            entry = _fields(entry)
            stat_names[_scalar(entry, 1, 0)] = _scalar(_fields(_scalar(entry, 2, b"")), 2, b"").decode()
        for entry in (value for n, value in plane if n == 4):  # XPlane.event_metadata: id -> XEventMetadata
            stats = {}
            for stat in (value for n, value in _fields(_scalar(_fields(entry), 2, b"")) if n == 5):
                stat = _fields(stat)  # XStat: metadata_id = 1, then its value's field
                stats[stat_names.get(_scalar(stat, 1, 0))] = next((v for n, v in stat if n != 1), None)
            if "Hlo Proto" in stats and "program_id" in stats:
                module = _scalar(_fields(stats["Hlo Proto"]), 1, b"")  # HloProto.hlo_module
                modules[_scalar(_fields(module), 1, b"").decode(), stats["program_id"]] = Module(module)
    return modules


def _instruction(proto: bytes) -> tuple[int, Instruction]:
    """(id, Instruction) of an HloInstructionProto."""
    fields = _fields(proto)
    metadata = _fields(_scalar(fields, 7, b""))  # OpMetadata: op_name = 2
    return _scalar(fields, 35, 0), Instruction(
        name=_scalar(fields, 1, b"").decode(), opcode=_scalar(fields, 2, b"").decode(),
        dtypes=_float_types(_scalar(fields, 3, b"")), op_name=_scalar(metadata, 2, b"").decode(),
        operands=_repeated(fields, 36), calls=_repeated(fields, 38), parameter=_scalar(fields, 9, 0))


def _float_types(shape: bytes) -> tuple[str, ...]:
    """The floating-point element types of a ShapeProto (element_type = 2, tuple_shapes = 4)."""
    fields = _fields(shape)
    element = _scalar(fields, 2, 0)
    if element in FLOATS:
        return (FLOATS[element],)
    return tuple(dtype for n, value in fields if n == 4 for dtype in _float_types(value))


# -- protobuf's wire format: jaxlib ships no Python classes for the XSpace and HLO protos, and jax needs no
# protobuf package; the field numbers are those of tsl's xplane.proto and XLA's hlo.proto
def _fields(message: bytes) -> list[tuple[int, int | bytes]]:
    """A message's fields in order as (number, value): varints as ints, every other kind as bytes."""
    fields, i = [], 0
    while i < len(message):
        key, i = _varint(message, i)
        kind = key & 7
        if kind == 0:
            value, i = _varint(message, i)
        elif kind in (1, 2, 5):  # fixed64, length-delimited, fixed32
            size, i = (8, i) if kind == 1 else (4, i) if kind == 5 else _varint(message, i)
            value, i = message[i:i + size], i + size
        else:
            raise HarnessError(f"jax.profiler's output has a protobuf field of unknown wire type {kind}")
        fields.append((key >> 3, value))
    return fields


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i


def _scalar(fields, number: int, default=None):
    """The last value of a singular field (protobuf's rule for repeated occurrences)."""
    return next((value for n, value in reversed(fields) if n == number), default)


def _repeated(fields, number: int) -> list[int]:
    """A repeated integer field, packed (proto3's default) or not."""
    values = []
    for n, value in fields:
        if n == number and isinstance(value, int):
            values.append(value)
        elif n == number:
            i = 0
            while i < len(value):
                item, i = _varint(value, i)
                values.append(item)
    return values
