"""Loss and accuracy of network outputs, in numpy: the one evaluation every framework's outputs go through."""
from __future__ import annotations

import numpy as np

from harness.model.spec import PROB_EPSILON, Loss


def loss_and_correct(loss: Loss, outputs: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
    """Summed loss and number of correct predictions for one batch (float64 math), over every label: a sample's,
    or with next-token labels [N, T] (outputs [N, T, vocab]) every token's, so divide by labels.size."""
    out = outputs.astype(np.float64).reshape(labels.size, -1)
    labels = labels.reshape(-1)
    if loss.type == "sparse_categorical_crossentropy":
        if loss.from_logits:
            shifted = out - out.max(axis=1, keepdims=True)
            logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        else:
            probs = np.clip(out / out.sum(axis=1, keepdims=True), PROB_EPSILON, 1 - PROB_EPSILON)
            logp = np.log(probs)
        total = -logp[np.arange(len(labels)), labels].sum()
        correct = int((out.argmax(axis=1) == labels).sum())
    else:  # binary_crossentropy on one output unit
        z, y = out[:, 0], labels.astype(np.float64)
        if loss.from_logits:
            total = (np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))).sum()
            predicted = z > 0
        else:
            p = np.clip(z, PROB_EPSILON, 1 - PROB_EPSILON)
            total = -(y * np.log(p) + (1 - y) * np.log(1 - p)).sum()
            predicted = z > 0.5
        correct = int((predicted == labels.astype(bool)).sum())
    return float(total), correct
