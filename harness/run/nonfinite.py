"""Where a run's first non-finite value comes from: the run is replayed up to the step that went wrong (a fresh
trainer, the same weights, batches and dropout masks), and the first tensor holding an inf or a NaN is named.

- An update first: the replay checks the weights after every step, so a weight that some steps never read (an
  embedding row) and that an update made non-finite is found at that update, steps before the loss shows it,
  with the gradients it was made from (Trainer.captured_step).
- Else the step itself, captured (Trainer.layer_outputs: the run's precision, inference mode): the first layer, in
  the order the forward pass computes them, whose output is not finite, or else, in the order the backward pass
  computes them, the first layer whose output gradient is not finite. The capture differentiates the unscaled
  loss; for a step the loss scaler skipped, the gradients are multiplied by the scale of that step and rounded to
  the compute dtype, so the layer named is the first whose scaled gradient does not fit there.

A framework that cannot capture gives no answer; the same in every framework that can."""
from __future__ import annotations

import math

import numpy as np

from harness.numerics import FORMATS

MAX_REPLAY_STEPS = 2000  # a divergence later than this is not replayed (the replay retrains up to it)


def _range(value: np.ndarray) -> list[float] | None:
    finite = value[np.isfinite(value)]
    return [float(finite.min()), float(finite.max())] if finite.size else None


def _scaled(gradient: np.ndarray, scale: float | None, compute_dtype: str) -> np.ndarray:
    """The gradient as the scaled backward pass holds it: times the loss scale, rounded to the compute dtype."""
    if not scale or compute_dtype not in FORMATS:
        return gradient
    with np.errstate(over="ignore", invalid="ignore"):
        return FORMATS[compute_dtype].round(np.asarray(gradient, np.float64) * scale)


def first_nonfinite(graph, x: np.ndarray, outputs: dict[str, tuple[np.ndarray, np.ndarray]],
                    scale: float | None = None, compute_dtype: str = "float32") -> dict | None:
    """The first non-finite tensor among captured layer outputs and their gradients ({path: (output, gradient)}),
    the gradients scaled by `scale` in `compute_dtype` (a skipped step's), with the finite range of its layer's
    input (the network's input `x` for the first layer); None if all finite."""
    types = graph.types
    order = graph.forward_order(outputs)
    found = next(((path, "forward", "output") for path in order if not np.isfinite(outputs[path][0]).all()), None) \
        or next(((path, "backward", "output gradient") for path in reversed(order)
                 if not np.isfinite(_scaled(outputs[path][1], scale, compute_dtype)).all()), None)
    if found is None:
        return None
    path, direction, tensor = found
    value = outputs[path][0] if tensor == "output" else _scaled(outputs[path][1], scale, compute_dtype)
    given = None
    if graph.inputs_known:
        source = graph.input_of(path)
        given = x if source is None else outputs[source][0] if source in outputs else None
    return {"layer": path, "layer_type": types[path], "pass": direction, "tensor": tensor,
            "values": "nan" if np.isnan(value).any() else "inf",
            "input_range": _range(np.asarray(given, np.float64)) if given is not None else None}


def lost_epsilon(optimizer, precision) -> tuple[float, str] | None:
    """(epsilon, format) when the optimizer's epsilon rounds to 0 in the dtype its update is computed in: the
    weights' own 16-bit dtype, where the framework's optimizer steps them (not a rounding precision, whose update is
    computed in float32)."""
    epsilon = getattr(optimizer, "epsilon", None)
    fmt = FORMATS.get(precision.param_dtype)
    if epsilon and fmt and precision.rounding is None and fmt.round(np.array([epsilon]))[0] == 0:
        return epsilon, fmt.name
    return None


def _update(graph, step: int, name: str, weight: np.ndarray, gradient: np.ndarray | None, weight_dtype: str,
            epsilon: tuple[float, str] | None) -> dict:
    """The update of `step` made `weight` non-finite: which values, and what its gradient was there: finite or not,
    and how often its square is 0 in the weights' dtype (an optimizer's second moment then stays 0)."""
    layer = name.rsplit(".", 1)[0]
    bad = ~np.isfinite(weight)
    found = {"found": True, "step": step, "layer": layer,
             "layer_type": graph.types.get(layer, "?"), "pass": "update",
             "tensor": "weights", "weight": name, "values": "nan" if np.isnan(weight).any() else "inf",
             "share": float(bad.mean())}
    if gradient is not None and np.shape(gradient) == weight.shape:
        g = np.asarray(gradient, np.float64)
        squares = FORMATS[weight_dtype].round(g * g) if weight_dtype in FORMATS else g * g
        found.update(gradient_finite=bool(np.isfinite(g).all()), zero_square_share=float((squares[bad] == 0).mean()),
                     gradient_range=_range(np.abs(g)))
    if epsilon is not None:
        found.update(epsilon=epsilon[0], epsilon_format=epsilon[1])
    return found


def locate(build, graph, data, masks, step: int, scale: float | None = None, compute_dtype: str = "float32",
           weight_dtype: str = "float32", epsilon: tuple[float, str] | None = None) -> dict:
    """Replay up to `step` on a trainer from `build()`, checking the weights after every update, and name the first
    non-finite tensor: an update's, else step `step`'s (its gradients scaled by `scale`, the loss scale the run
    used at that step, if any). `epsilon`: lost_epsilon's answer, quoted beside an update's NaNs."""
    if step > MAX_REPLAY_STEPS:
        return {"found": False, "why": f"diverged at step {step}, past the {MAX_REPLAY_STEPS} steps a replay retrains"}
    trainer = build()
    capturing = True
    for s in range(step):
        x, y = data.train_batch(s)
        batch = trainer.to_device(x, y, masks.for_step(s, len(y)))
        captured = trainer.captured_step(batch) if capturing else None
        if captured is None:
            capturing = False
            trainer.train_step(batch)
        weights = trainer.get_weights()
        bad = graph.weight_order(n for n, w in weights.items() if not np.isfinite(w).all())
        if bad:
            return _update(graph, s, bad[0], np.asarray(weights[bad[0]]),
                           captured[1].get(bad[0]) if captured else None, weight_dtype, epsilon)
    x, y = data.train_batch(step)
    outputs = trainer.layer_outputs(x, y)
    if outputs is None:
        return {"found": False, "why": "this adapter cannot capture layer outputs"}
    found = first_nonfinite(graph, x, outputs, scale, compute_dtype)
    if found is None:
        return {"found": False, "why": f"replayed, step {step}'s layer outputs and their gradients are finite (in "
                                       f"inference mode{', scaled by ' + _power(scale) if scale else ', unscaled'}: "
                                       f"the non-finite value needs training mode"
                                       f"{'' if scale else ', a loss scale'} or the optimizer's update)"}
    return {"found": True, "step": step, **found, **({"loss_scale": scale} if scale else {})}


def _power(scale: float) -> str:
    exponent = math.log2(scale)
    return f"2^{exponent:g}" if exponent.is_integer() else f"{scale:g}"


def describe(found: dict) -> str:
    """One line for the record's reader: "first non-finite: layer 25 (attention) output, forward pass, inf; its
    input in [-512, 498]"."""
    if not found.get("found"):
        return f"first non-finite value not located: {found.get('why')}"
    if found.get("pass") == "update":
        line = (f"first non-finite value at step {found['step']}: its update made {found['share']:.1%} of layer "
                f"{found['layer']} ({found['layer_type']})'s weight {found['weight']} {found['values']}")
        if "gradient_finite" in found:
            line += " from finite gradients" if found["gradient_finite"] else " from non-finite gradients"
            if found["gradient_finite"]:
                line += (f"; where it did, the gradient's square is 0 in the weights' dtype for "
                         f"{found['zero_square_share']:.0%} of them")
        if found.get("epsilon") is not None:
            line += (f"; the optimizer's epsilon {found['epsilon']:g} is 0 in {found['epsilon_format']}, so where the "
                     f"second moment underflows to 0 the update divides by 0")
        return line
    where = f"layer {found['layer']} ({found['layer_type']}) {found['tensor']}, {found['pass']} pass"
    if found.get("loss_scale"):
        where += f" at loss scale {_power(found['loss_scale'])}"
    span = found.get("input_range")
    given = f"; its input in [{span[0]:.4g}, {span[1]:.4g}]" if span else ""
    return f"first non-finite value at step {found['step']}: {where}, {found['values']}{given}"
