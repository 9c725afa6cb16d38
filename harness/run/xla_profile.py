"""XLA's side of a profile, read once for every framework that compiles with XLA (JAX; TensorFlow's xla variant):
the optimised HLO modules a profiler's XSpace carries, and which layer or part each instruction belongs to.

- Scopes: an instruction's op_name metadata names the framework op it came from, with the scopes it was built in
  (harness.adapter.layer_scope's "layer.3", LOSS_SCOPE's "part.loss"...): JAX's jax.named_scope writes
  "jit(step)/jvp(layer.3)/conv_general_dilated", TensorFlow's name scopes "layer.3/conv2d/Conv2D". An
  instruction's scope is the layer and part tokens its op_name names, outermost first; it is backward when its
  op_name carries the framework's mark of a derived op (JAX's "transpose(", TensorFlow's "gradient_tape/").
- Fusions: XLA fuses ops of neighbouring layers (a batchnorm with the next relu, the update with the loss scaler's
  select): a fusion goes to the scope most of its arithmetic instructions carry, the one nearest its root on a tie.
- Instructions XLA makes itself have no op_name (layout copies, the converts of its float normalisation, the iota
  constants of a max-pool's gradient, the dots and weight-gradient convolutions it rewrites): they go to the
  nearest named instruction that uses their result (inside a fusion, the fused one that reads it), except that a
  result only the loss scaling or the update uses is a weight's gradient, which goes to the backward pass of the
  weight's layer when the step's argument those uses read names the weight (JAX's params['0.kernel'] or its
  optimizer state); with no use, to the nearest named operand.
  Why this rule and not leaving them unattributed (TensorFlow's reader did, and gave a fusion only the scopes all
  its named instructions share): those instructions are real work of a layer (a float16 convolution XLA redoes in
  float32, a max-pool gradient's indices), so leaving them out left half of an XLA step outside every layer, and a
  fusion across two layers went to neither; the use that consumes a result is the op XLA made it for.
- Dtypes: the element types of the instruction's operands and results in the compiled HLO. A cast is a convert
  between two floating-point types, or a fusion of nothing but such converts (and bitcasts or reshapes).

The protos are read in protobuf's wire format, with no framework's or protobuf's classes (jaxlib ships none for
the XSpace and HLO protos, and the core imports no framework); the field numbers are those of tsl's xplane.proto
and XLA's hlo.proto.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from harness.adapter import OpTime
from harness.errors import HarnessError

# xla_data.proto's PrimitiveType numbers of the floating-point types
FLOATS = {10: "float16", 11: "float32", 12: "float64", 16: "bfloat16"}
# harness.adapter.layer_scope's tokens, LOSS_SCOPE's... and the "_1" TensorFlow adds to a scope entered twice
SCOPE_TOKEN = re.compile(r"layer\.\d[\w.]*|part\.[a-z]+(?:_[a-z]+)*(?:_\d+)?")
WEIGHT_ARGUMENT = re.compile(r"\['([^'\]]+)'\]$")  # the step's arguments: params['0.kernel'], opt_state['m']['0.kernel']
# instructions that compute nothing (they move or reinterpret data): no vote on where a fusion's time goes
NO_ARITHMETIC = {"parameter", "constant", "broadcast", "bitcast", "reshape", "transpose", "copy", "slice",
                 "concatenate", "tuple", "get-tuple-element", "iota", "pad"}
PURE_CASTS = {"convert", "bitcast", "reshape", "parameter"}  # a fusion of nothing else only converts


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

    def __init__(self, proto: bytes, backward_mark: str):
        self.backward_mark = backward_mark  # what a derived (backward) op's op_name contains
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
            return self.scope(self.named(i))
        users = self._first_use(i)
        if self.scope(users)[0].startswith("part."):
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
            return self.scope(users)
        return self.scope(next((self.named(j) for j in self._walk(i, lambda k: self.by_id[k].operands)
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
            votes = Counter(self.scope(self.named(j)) for j in voters)
            winner = max(votes, key=votes.get) if votes else None  # a tie: the first counted, nearest the root
            name = next((self.named(j) for j in voters if self.scope(self.named(j)) == winner), "")
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
        return self.scope(self.named(i))[0].startswith("part.")

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

    def op_time(self, name: str, seconds: float, calls: int, weights: dict[str, str], op: str | None = None) -> OpTime:
        """The instruction `name` that ran `calls` times for `seconds`, as the profile's op (named `op`, default
        `name`): its owner's scope and pass, whether it is a cast, and its operands' and results' dtypes."""
        i = self.by_name[name]
        scope, backward = self.owner(i, weights)
        return OpTime(op or name, scope, seconds, backward=backward, cast=self.is_cast(i), calls=calls,
                      inputs=self.inputs(i), outputs=self.by_id[i].dtypes)


    def scope(self, op_name: str) -> tuple[str, bool]:
        """(the scopes named in an op_name, outermost first; whether it is a backward op)."""
        return "/".join(SCOPE_TOKEN.findall(op_name)), self.backward_mark in op_name


def modules(xspace: bytes, backward_mark: str) -> dict[tuple[str, int], Module]:
    """The HLO modules in a serialized XSpace's metadata plane, by (module name, program id or -1); `backward_mark`:
    what the framework's backward ops' op_names contain."""
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
            if "Hlo Proto" in stats:
                module = _scalar(_fields(stats["Hlo Proto"]), 1, b"")  # HloProto.hlo_module
                # JAX's profiler names each executable's program id; TensorFlow's, none (-1)
                key = _scalar(_fields(module), 1, b"").decode(), stats.get("program_id", -1)
                modules[key] = Module(module, backward_mark)
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


# -- protobuf's wire format (see the module docstring)
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
            raise HarnessError(f"the profile's XSpace has a protobuf field of unknown wire type {kind}")
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
