"""Where a diverged run's first non-finite value comes from: the step that produced it is replayed with capture on
(a fresh trainer, the same weights, batches and dropout masks up to that step), and the first tensor holding an
inf or a NaN is named: the first layer, in the order the forward pass computes them, whose output is not finite,
or else, in the order the backward pass computes them, the first layer whose output gradient is not finite. The
capture is the adapter's `Trainer.layer_outputs` (its precision, inference mode, the unscaled loss), so a
framework that cannot capture gives no answer; the same in every framework that can."""
from __future__ import annotations

import math

import numpy as np

MAX_REPLAY_STEPS = 2000  # a divergence later than this is not replayed (the replay retrains up to it)


def _forward_order(path: str) -> tuple:
    """Sort key: the order the forward pass computes layers in (a residual block after its inner layers)."""
    parts = [int(p) if p.isdigit() else {"layers": 0, "projection": 1}[p] for p in path.split(".")]
    return (*parts, math.inf)


def _range(value: np.ndarray) -> list[float] | None:
    finite = value[np.isfinite(value)]
    return [float(finite.min()), float(finite.max())] if finite.size else None


def first_nonfinite(graph, x: np.ndarray, outputs: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict | None:
    """The first non-finite tensor among captured layer outputs and their gradients ({path: (output, gradient)}),
    with the finite range of its layer's input (the network's input `x` for the first layer); None if all finite."""
    types = {info.path: info.type for info in graph.layers}
    order = sorted(outputs, key=_forward_order)
    found = next(((path, "forward", "output") for path in order if not np.isfinite(outputs[path][0]).all()), None) \
        or next(((path, "backward", "output gradient") for path in reversed(order)
                 if not np.isfinite(outputs[path][1]).all()), None)
    if found is None:
        return None
    path, direction, tensor = found
    source = graph.input_of(path)
    value = outputs[path][0] if tensor == "output" else outputs[path][1]
    given = x if source is None else outputs[source][0] if source in outputs else None
    return {"layer": path, "layer_type": types[path], "pass": direction, "tensor": tensor,
            "values": "nan" if np.isnan(value).any() else "inf",
            "input_range": _range(np.asarray(given, np.float64)) if given is not None else None}


def locate(build, graph, data, masks, step: int) -> dict:
    """Replay up to `step` on a trainer from `build()` and name the first non-finite tensor of that step."""
    if step > MAX_REPLAY_STEPS:
        return {"found": False, "why": f"diverged at step {step}, past the {MAX_REPLAY_STEPS} steps a replay retrains"}
    trainer = build()
    for s in range(step):
        x, y = data.train_batch(s)
        trainer.train_step(trainer.to_device(x, y, masks.for_step(s, len(y))))
    x, y = data.train_batch(step)
    outputs = trainer.layer_outputs(x, y)
    if outputs is None:
        return {"found": False, "why": "this adapter cannot capture layer outputs"}
    found = first_nonfinite(graph, x, outputs)
    if found is None:
        return {"found": False, "why": f"replayed, step {step}'s layer outputs and their gradients are finite (in "
                                       f"inference mode, unscaled: the divergence needs training mode, a loss "
                                       f"scale or the optimizer's update)"}
    return {"found": True, "step": step, **found}


def describe(found: dict) -> str:
    """One line for the record's reader: "first non-finite: layer 25 (attention) output, forward pass, inf; its
    input in [-512, 498]"."""
    if not found.get("found"):
        return f"first non-finite value not located: {found.get('why')}"
    where = f"layer {found['layer']} ({found['layer_type']}) {found['tensor']}, {found['pass']} pass"
    span = found.get("input_range")
    given = f"; its input in [{span[0]:.4g}, {span[1]:.4g}]" if span else ""
    return f"first non-finite value at step {found['step']}: {where}, {found['values']}{given}"
