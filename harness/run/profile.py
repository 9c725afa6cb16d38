"""Profile mode (`amp-harness profile`): where a training step's time goes, layer by layer, and the dtype each
layer really computed in.

The worker runs K untimed warm-up steps, moves K more batches to the device, then has the adapter run those K
steps under the framework's own profiler (Trainer.profile), timing each step itself. The adapter returns every op
that ran with the scopes it ran in (harness.adapter.OpTime); this module maps scopes to the spec's layers and
parts, once for every framework. Profiles go to their own file (profiles.jsonl): a profiled step carries the
profiler's overhead, so it is never compared with a timed run's step. `table` shows a profile as the command
prints it.
"""
from __future__ import annotations

import math
import re
import time
from collections import Counter

from harness.adapter import (
    LOSS_SCALE_SCOPE,
    LOSS_SCOPE,
    RUNTIME_SCOPE,
    UPDATE_SCOPE,
    OpTime,
    layer_scope,
)
from harness.errors import HarnessError
from harness.model.graph import Graph, LayerInfo
from harness.model.native import Modules

# a layer scope (harness.adapter.layer_scope), maybe made unique by the framework ("layer.3_1": TensorFlow names
# a scope entered twice in one graph so)
LAYER_TOKEN = re.compile(r"^layer\.(\d+(?:\.(?:layers|projection)\.\d+)*)(?:_\d+)?$")
LAYER_PREFIX = layer_scope("")
PART_TOKENS = {LOSS_SCOPE: "loss", UPDATE_SCOPE: "update", LOSS_SCALE_SCOPE: "loss_scale", RUNTIME_SCOPE: "runtime"}
PART_TOKEN = re.compile(r"^(part\.[a-z_]+?)(?:_\d+)?$")
PARTS = ("casts", "loss", "update", "loss_scale", "runtime")  # time apart from layers, in a profile's "parts"
TOP_OPS = 12  # the heaviest ops a profile keeps by name, for the reader who wants the framework's own words
COVERAGE_TOLERANCE = 0.15  # layers and parts must account for the profiled step within this share


def owner(scope: str, modules: set[str] | None = None) -> tuple[str, str] | None:
    """("layer", canonical path) or ("part", loss/update/loss_scale/runtime) of the innermost scope in `scope` that is
    either; None when it ran outside them all. `modules`: a native model's module names, its layers' paths (any
    name, where a spec's are numbers)."""
    for token in reversed(scope.split("/")):
        if modules is not None and token.startswith(LAYER_PREFIX) and token[len(LAYER_PREFIX):] in modules:
            return "layer", token[len(LAYER_PREFIX):]
        match = LAYER_TOKEN.match(token)
        if match:
            return "layer", match.group(1)
        match = PART_TOKEN.match(token)
        if match and match.group(1) in PART_TOKENS:
            return "part", PART_TOKENS[match.group(1)]
    return None


def label(info: LayerInfo) -> str:
    """How a report names a layer: its canonical path and type, e.g. "9 conv2d"."""
    return f"{info.path} {info.type}"


def refusal(adapter, device) -> str | None:
    """Why this adapter cannot profile on this device, from its declared capabilities; None where it can."""
    why = adapter.capabilities.no_gpu_profile
    if device.kind == "gpu" and why:
        return f"the {adapter.name} adapter does not profile on a GPU: {why}"
    return None


def profile(spec, layers: Graph | Modules, data, masks, trainer, record: dict, warmup: int, progress=None) -> None:
    """Warm up, then profile spec.steps steps and put the attributed profile in record["profile"]. `layers`: the
    spec's graph, or a native model's modules (its layers by their own names)."""
    total = warmup + spec.steps
    for step in range(warmup):  # untimed: first-step compilation, allocator growth, autotuning
        x, y = data.train_batch(step)
        trainer.train_step(trainer.to_device(x, y, masks.for_step(step, len(y))))
        if progress:
            progress(step + 1, total)
    batches = []  # converted before the profiler starts, so that it sees training steps only
    for step in range(warmup, total):
        x, y = data.train_batch(step)
        batches.append(trainer.to_device(x, y, masks.for_step(step, len(y))))
    step_ms, losses = [], []

    def run_steps() -> None:
        for batch in batches:
            t0 = time.perf_counter_ns()
            losses.append(trainer.train_step(batch))
            step_ms.append((time.perf_counter_ns() - t0) / 1e6)
            if progress:
                progress(warmup + len(step_ms), total)

    profiled = trainer.profile(run_steps)
    if profiled is None:
        record.update(status="unsupported", reason=f"the {record['framework']} adapter cannot profile on "
                                                   f"{record.get('device') or 'this device'} (Trainer.profile)")
        return
    if len(step_ms) != spec.steps:
        raise HarnessError(f"the {record['framework']} adapter's profile ran {len(step_ms)} of the {spec.steps} "
                           f"steps the core gave it (Trainer.profile must call run_steps once)")
    record.update(status="ok", loss=[v if math.isfinite(v) else None for v in losses],
                  profile={"tool": profiled.tool, "note": profiled.note, "warmup": warmup,
                           **attribute(layers.layers, profiled.ops, step_ms,
                                       None if isinstance(layers, Graph) else set(layers.types))})


def attribute(layers: list[LayerInfo], ops: list[OpTime], step_ms: list[float], modules: set[str] | None = None) -> dict:
    """Per step (the mean over the profiled steps): each layer's forward, backward and cast time and the dtypes
    its compute op ran in (_weight); time in casts, the loss, the update and loss scaling; and "other", the
    step time no op accounts for (negative where ops overlapped in time: an inter-op thread pool). `modules`: a
    native model's module names (owner)."""
    steps = len(step_ms)
    per_layer = {info.path: {"path": info.path, "type": info.type, "label": label(info), "forward_ms": 0.0,
                             "backward_ms": 0.0, "cast_ms": 0.0} for info in layers}
    compute: dict[str, OpTime] = {}  # per layer, the forward op that does its work
    parts = dict.fromkeys(PARTS, 0.0)
    unattributed = 0.0
    by_name: Counter = Counter()
    for op in ops:
        ms = op.seconds * 1e3 / steps
        found = owner(op.scope, modules)
        by_name[(op.op, found[1] if found else "", op.backward)] += ms
        if found and found[0] == "layer" and found[1] not in per_layer:
            raise HarnessError(f"the profile names a layer scope '{found[1]}' that the spec does not have "
                               f"(op {op.op} in scope {op.scope!r}); layers: {', '.join(per_layer)}")
        if op.cast:
            parts["casts"] += ms
            if found and found[0] == "layer":
                per_layer[found[1]]["cast_ms"] += ms
        elif found is None:
            unattributed += ms
        elif found[0] == "part":
            parts[found[1]] += ms
        else:
            per_layer[found[1]]["backward_ms" if op.backward else "forward_ms"] += ms
            if not op.backward and (op.inputs or op.outputs) and (
                    found[1] not in compute or _weight(op) > _weight(compute[found[1]])):
                compute[found[1]] = op
    for path, op in compute.items():
        per_layer[path].update(op=op.op, inputs=list(op.inputs), outputs=list(op.outputs), compute=compute_dtype(op))
    step = sum(step_ms) / steps
    named = sum(l["forward_ms"] + l["backward_ms"] for l in per_layer.values()) + sum(parts.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_OPS]
    return {"steps": steps, "step_ms": step_ms, "step_mean_ms": step, "layers": list(per_layer.values()),
            "parts": {**parts, "unattributed": unattributed, "other": step - named},
            "coverage": named / step if step > 0 else None,
            "top_ops": [{"op": name, "owner": where, "backward": bwd, "ms": ms} for (name, where, bwd), ms in top]}


def _weight(op: OpTime) -> tuple[int, float]:
    """Which forward op is a layer's compute: the one taking the most floating-point inputs (a convolution takes
    data, kernel and bias; the padding before it, the data alone), then the heaviest. Time alone would let a light
    op slowed by a busy machine (measured: MXNet's float32 Pad before a bfloat16 convolution, 100x slower under
    load) decide what the layer computed in. A range's own time (Python between ops) names no dtype: never."""
    return len(op.inputs), op.seconds


def compute_dtype(op: OpTime) -> str | None:
    """The dtype an op computed in: the one most of its floating-point inputs had (its weights included)."""
    if not op.inputs:
        return op.outputs[0] if op.outputs else None
    return Counter(op.inputs).most_common(1)[0][0]


def table(record: dict) -> str:
    """A profile record as text (`amp-harness profile`): a line per layer, then the parts apart from layers."""
    p = record["profile"]
    step = p["step_mean_ms"]
    width = max(len(layer["label"]) for layer in p["layers"]) + 2
    lines = [f"{record['framework']} {record['model']} {record['precision']}: {step:.2f} ms per profiled step (mean "
             f"of {p['steps']}; {p['tool']})",
             f"  {'':<{width}}{'forward ms':>11}{'backward ms':>12}{'share':>7}  computed in"]
    for layer in p["layers"]:
        total = layer["forward_ms"] + layer["backward_ms"]
        lines.append(f"  {layer['label']:<{width}}{layer['forward_ms']:>11.3f}{layer['backward_ms']:>12.3f}"
                     f"{total / step:>7.1%}  {layer.get('compute') or '-'}")
    for name, ms in p["parts"].items():
        if name != "unattributed":
            lines.append(f"  {name:<{width}}{ms:>23.3f}{ms / step:>7.1%}")
    return "\n".join(lines)
