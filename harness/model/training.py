"""The spec's loss and its global-norm clipping, written once for every adapter against a small table of the
framework's primitives (`LossOps`, `ClipOps`), which each adapter's optimizers.py fills, as einops' backends do
(harness.rounding's RoundingOps is the same idea for the rounded update). The math is harness.model.spec's:

- The loss is a batch mean, computed in float32 whatever the compute dtype (float64 outputs stay float64); a
  next-token batch (outputs [N, T, vocab], labels [N, T]) is the mean over every token.
- Losses on probabilities clip them to [PROB_EPSILON, 1 - PROB_EPSILON] before the log (Keras' epsilon);
  sparse categorical cross-entropy on probabilities normalises each row first.
- Binary cross-entropy from logits is the stable form, max(z, 0) - z*y + log(1 + exp(-|z|)).
- Clipping multiplies the unscaled gradients by c / max(n, c), n the global norm of them all (no epsilon),
  accumulated in float32 (float64 for float64 gradients); a step the loss scaler skips is left as it is (its
  factor is 1 where the caller says the gradients are not finite).

The framework keeps what its own kernels compute differently in the last bits (a fused softmax cross-entropy, the
order its reductions sum in): those are the table's entries, the rules around them are here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from harness.model.spec import PROB_EPSILON


@dataclass(frozen=True)
class LossOps:
    """One framework's primitives for the loss. Tensors support + - * and unary minus with Python numbers."""

    upcast: Callable  # outputs -> float32, float64 left as it is
    softmax_cross_entropy: Callable  # (logits, labels) -> mean over samples (tokens) of -log softmax at the label
    normalized: Callable  # x -> x over its sum along the last axis
    nll: Callable  # (log-probabilities, labels) -> mean over samples (tokens) of -log-probability at the label
    first_column: Callable  # [N, 1] outputs -> [N]
    labels_like: Callable  # (labels, outputs) -> the labels in the outputs' dtype
    clip: Callable  # (x, lo, hi), Python floats
    log: Callable
    log1p: Callable
    exp: Callable
    abs: Callable
    relu: Callable
    mean: Callable  # the mean of every value
    #: (logits, labels) -> the framework's own fused binary cross-entropy from logits, where it has one; None:
    #: the stable form below in the primitives above
    sigmoid_cross_entropy: Callable | None = None


def loss_with(ops: LossOps, loss, outputs, labels) -> Any:
    """The spec's `loss` (its section) of `outputs` against `labels`, a batch mean in float32 or float64."""
    out = ops.upcast(outputs)
    if loss.type == "sparse_categorical_crossentropy":
        if loss.from_logits:
            return ops.softmax_cross_entropy(out, labels)
        return ops.nll(ops.log(ops.clip(ops.normalized(out), PROB_EPSILON, 1 - PROB_EPSILON)), labels)
    z, y = ops.first_column(out), ops.labels_like(labels, out)
    if loss.from_logits:
        if ops.sigmoid_cross_entropy is not None:
            return ops.sigmoid_cross_entropy(z, y)
        return ops.mean(ops.relu(z) - z * y + ops.log1p(ops.exp(-ops.abs(z))))
    p = ops.clip(z, PROB_EPSILON, 1 - PROB_EPSILON)
    return -ops.mean(y * ops.log(p) + (1 - y) * ops.log(1 - p))


@dataclass(frozen=True)
class ClipOps:
    """One framework's primitives for the clipping factor of a global norm (a scalar tensor, or a Python float
    where the framework reads the norm on the host)."""

    full_like: Callable  # (norm, Python float) -> that value in the norm's dtype and place
    maximum: Callable
    where: Callable  # (condition, a, b)
    ones_like: Callable


def clip_factor_with(ops: ClipOps, norm, clip_norm: float, finite=None) -> Any:
    """c / max(norm, c) for the global norm `norm` of the unscaled gradients (accumulated in float32, or float64
    for float64 gradients); with `finite` (the caller's check, where the factor is computed before it is known
    whether the loss scaler skips the step), 1 where it is false, so that a skipped step's gradients stay as
    they are and no NaN reaches a discarded update."""
    c = ops.full_like(norm, clip_norm)  # a tensor divided, not `float / tensor` (a reciprocal, then a product)
    factor = c / ops.maximum(norm, c)
    return factor if finite is None else ops.where(finite, factor, ops.ones_like(factor))
