"""Diagnose mode: strict-fp32 training that captures tensors after selected steps and reduces them to
histograms (harness.numerics), and the gradient fingerprint the parity check compares.

Capture is an optional adapter capability (Trainer.captured_step, Trainer.layer_outputs): ordinary runs never
call it, so their records and step times are unchanged.
"""
from __future__ import annotations

import math

import numpy as np

from harness import fp8, microscaling, numerics
from harness.model import reference
from harness.model.graph import Graph

PROJECTIONS = 4  # random projections per gradient in a fingerprint


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0]


def diagnose(spec, layers, data, masks, trainer, record: dict, every: int, progress=None) -> None:
    """`layers`: the spec's Graph, or a native model's Modules, whose layers are its modules: the histograms are
    per module, and what needs the spec's layers (each matmul's inputs as FP8 and 16 bits would cast them,
    attention's inner values) is left out."""
    x_fixed, y_fixed = data.fixed_batch()
    graph = layers if isinstance(layers, Graph) else None
    groups: dict[str, dict[str, list]] = {kind: {} for kind in numerics.KINDS}
    counts: dict[str, dict] = {}
    captured, losses, available = [], [], True
    casts = fp8.CastStatistics()
    blocks = microscaling.BlockStatistics()  # the block recipes' underflow, clipping and product errors
    matmul_error: dict[str, dict[str, float]] = {}  # per layer and format, the largest over the captured steps

    def add(kind: str, layer: str, values: np.ndarray) -> None:
        groups[kind].setdefault(layer, []).append(numerics.histogram(values))

    for step in range(spec.steps):
        x, y = data.train_batch(step)
        batch = trainer.to_device(x, y, masks.for_step(step, len(y)))
        result = None
        if available and (step % every == 0 or step == spec.steps - 1):
            # copies: an adapter's get_weights may return views of its live weights (torch on a CPU does)
            before = {name: np.array(w, copy=True) for name, w in trainer.get_weights().items()}
            result = trainer.captured_step(batch)
            available = result is not None
        if result is None:
            loss = trainer.train_step(batch)
        else:
            loss, gradients = result
            after = trainer.get_weights()
            for name, grad in gradients.items():
                layer, update = _layer(name), after[name] - before[name]
                add("weights", layer, before[name])
                add("gradients", layer, grad)
                add("updates", layer, update)
                found = numerics.update_counts(before[name], update, grad)
                total = counts.setdefault(layer, dict.fromkeys(found, 0))
                for key, value in found.items():
                    total[key] += value
            outputs = trainer.layer_outputs(x_fixed, y_fixed) or {}
            for layer, (output, output_grad) in outputs.items():
                add("activations", layer, output)
                add("activation_gradients", layer, output_grad)
            if graph is not None:
                _matmul_inputs(graph, after, outputs, x_fixed, casts)
                sampled = _sampled_products(graph, after, outputs, x_fixed)
                _block_statistics(sampled, blocks)
                for layer, errors in _matmul_errors(sampled).items():
                    worst = matmul_error.setdefault(layer, {})
                    for name, error in errors.items():
                        worst[name] = max(worst.get(name, 0.0), error)
                for layer, values in _attention_numerics(graph, after, outputs).items():
                    for kind, value in values.items():
                        add(f"attention_{kind}", layer, value)
            captured.append(step)
        losses.append(loss)
        if progress:
            progress(step + 1, spec.steps)
    merged = {kind: {layer: numerics.merge(hs) for layer, hs in layers.items()} for kind, layers in groups.items()}
    diagnosis = {"captured_steps": captured, "every": every, "available": available and bool(captured),
                 "groups": merged, "updates": counts, "optimizer": spec.optimizer.type, "matmul_error": matmul_error,
                 "layer_types": layers.types}
    if diagnosis["available"]:
        declared = getattr(trainer, "attention_masks", None)  # what each causal attention's mask leaves in 16 bits
        if declared:  # (as the adapter declares it: Trainer.declare_attention_masks)
            diagnosis["attention_masks"] = declared
        low, high = numerics.loss_scale_window(numerics.all_gradients(merged))
        diagnosis.update(loss_scale_window=[low, high], verdicts=numerics.verdicts(diagnosis),
                         attention=numerics.attention_verdicts(diagnosis),
                         outcomes=numerics.outcomes(diagnosis), max_flushed=numerics.MAX_FLUSHED)
        if casts.result():
            diagnosis["fp8"] = casts.result()
        if blocks.result():
            diagnosis["blocks"] = blocks.result()
    finite = all(math.isfinite(v) for v in losses)
    record.update(status="ok" if finite else "diverged", reason=None if finite else "non-finite loss",
                  loss=[v if math.isfinite(v) else None for v in losses], diagnosis=diagnosis)


MATMUL_LAYERS = ("dense", "conv2d", "patches", "attention")


def _matmul_inputs(graph, weights: dict, outputs: dict, x, casts: fp8.CastStatistics) -> None:
    """Each matmul layer's inputs as FP8 would cast them (harness.fp8.CastStatistics): its input (the previous
    layer's captured output, or the network's input), its kernels, and its output's gradient (what the backward
    matmuls multiply). Attention: its input, its four kernels together, its output's gradient."""
    for info in graph.layers:
        if info.type not in MATMUL_LAYERS or info.path not in outputs:
            continue
        inputs = _captured_input(graph, info, outputs, x)
        if inputs is not None:
            casts.add(info.path, "input", inputs)
        casts.add(info.path, "weight", np.concatenate([np.ravel(weights[f"{info.path}.{name}"])
                                                       for name in info.params if name.endswith("kernel")]))
        casts.add(info.path, "output_gradient", outputs[info.path][1])


def _captured_input(graph, info, outputs: dict, x) -> np.ndarray | None:
    """A layer's input as captured: the previous layer's output, or the network's input; None where it was not
    captured or is not floating point (token ids)."""
    source = graph.input_of(info.path)
    inputs = x if source is None else outputs[source][0] if source in outputs else None
    return inputs if inputs is not None and np.issubdtype(np.asarray(inputs).dtype, np.floating) else None


MATMUL_ROWS = 4096  # at most about this many output rows per matmul: its error is a mean over rows, and convs' are many


def _sampled_products(graph, weights: dict, outputs: dict, x) -> dict[str, tuple[list, np.ndarray]]:
    """Per matmul layer whose input and output were captured: (its forward matmuls as (lhs, rhs), as
    harness.model.reference.matmuls states them, its output's gradient [rows, N]), on the first samples of the fixed
    batch that give about MATMUL_ROWS output rows, and at most that many (the gradient's rows likewise)."""
    found = {}
    for info in graph.layers:
        inputs = _captured_input(graph, info, outputs, x) if info.type in MATMUL_LAYERS else None
        if inputs is None or info.path not in outputs:
            continue
        rows = math.prod(np.shape(outputs[info.path][0])[1:-1])  # output rows per sample: positions, tokens
        samples = max(1, MATMUL_ROWS // max(rows, 1))
        inputs = np.asarray(inputs, np.float32)[:samples]
        # (a large image's positions alone are many rows: every k-th of them, k the fewest that leave MATMUL_ROWS)
        products = [(lhs[::-(-len(lhs) // MATMUL_ROWS)], rhs)
                    for lhs, rhs in reference.matmuls(info.spec, info.path, weights, inputs).values()]
        gradient = np.asarray(outputs[info.path][1], np.float32)[:samples]
        gradient = gradient.reshape(-1, gradient.shape[-1])
        found[info.path] = (products, gradient[::-(-len(gradient) // MATMUL_ROWS)])
    return found


def _matmul_errors(sampled: dict[str, tuple[list, np.ndarray]]) -> dict[str, dict[str, float]]:
    """Per matmul layer of `sampled` (_sampled_products), per 16-bit format, the largest relative error of its
    forward matmuls with their inputs rounded to the format (harness.numerics.matmul_error)."""
    found = {}
    for layer, (products, _) in sampled.items():
        errors = {}
        for name, fmt in numerics.FORMATS.items():
            measured = [e for e in (numerics.matmul_error(lhs, rhs, fmt) for lhs, rhs in products) if e is not None]
            if measured:
                errors[name] = max(measured)
        found[layer] = errors
    return found


BLOCK_ROWS = 1024  # at most this many rows per operand for the block recipes: 5 recipes quantize each twice


def _block_statistics(sampled: dict[str, tuple[list, np.ndarray]], blocks: microscaling.BlockStatistics) -> None:
    """Each matmul layer of `sampled` as the block recipes would quantize it (harness.microscaling.BlockStatistics):
    its forward products' operands (x and w along K; an input that several products share, as attention's query,
    key and value projections do, counted once) and its output's gradient (along N: what the dx product
    multiplies; attention's is its output projection's), on every k-th row, k the fewest that leave BLOCK_ROWS
    (blocks run along rows, so a row keeps its blocks whole)."""
    every = lambda rows: rows[::-(-len(rows) // BLOCK_ROWS)]  # noqa: E731
    for layer, (products, gradient) in sampled.items():
        seen: list = []
        for lhs, rhs in products:
            blocks.add_product(layer, every(lhs), rhs, count_input=not any(lhs is s for s in seen))
            seen.append(lhs)
        blocks.add_gradient(layer, every(gradient))


def _attention_numerics(graph, weights: dict, outputs: dict) -> dict[str, dict[str, np.ndarray]]:
    """Per attention layer whose input and output were captured: the values inside it that 16-bit formats must
    hold (harness.model.reference.attention_numerics), from the captured tensors and the current weights, the
    same in every framework that captures layer outputs."""
    found = {}
    for info in graph.layers:
        source = graph.input_of(info.path) if info.type == "attention" else None
        if source in outputs and info.path in outputs:
            found[info.path] = reference.attention_numerics(info.spec, info.path, weights, outputs[source][0],
                                                            outputs[info.path][1])
    return found


def gradient_fingerprint(gradients: dict[str, np.ndarray], seed: int) -> dict[str, list[float]] | None:
    """Per weight: its gradient's norm and PROJECTIONS random projections (fixed by the seed and the weight's
    name), enough to tell two frameworks' gradients apart without storing them. None when a gradient is not
    finite (the loss scaler skips that step: there is nothing to compare)."""
    if not all(np.isfinite(g).all() for g in gradients.values()):
        return None
    out = {}
    for name, grad in sorted(gradients.items()):
        g = np.asarray(grad, np.float64).ravel()
        rng = np.random.default_rng([seed, 0x6AD, *name.encode()])
        out[name] = [float(np.linalg.norm(g)), *(float(v) for v in rng.standard_normal((PROJECTIONS, g.size)) @ g)]
    return out
