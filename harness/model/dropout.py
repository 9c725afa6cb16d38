"""Dropout masks, drawn by the core so that every framework drops the same units.

A framework's own dropout draws from its own random stream, so a spec with dropout would train differently
in each framework. Instead the core draws each mask from a counter-based generator (Philox) keyed by the
spec's seed and the layer, with the training step as the counter: any step's mask can be drawn without
replaying the steps before it (a resumed run, a fingerprint, a diagnosis all see the same masks).

A mask is float32 1 (keep) or 0 (drop) in the canonical layout of the layer's output ([N, H, W, C] for
images, [N, F] for vectors, [N, T, D] for sequences; a per-sample dropout's [N, 1, 1, 1], [N, 1]: adapters broadcast
it), or for an attention layer's dropout of its probabilities
[N, heads, T, T] (query position, then key position), keyed by the attention layer's path. Adapters apply it in training as ``x * mask / (1 - rate)`` and ignore dropout
in inference. Masks are drawn and handed over with the batch (``Trainer.to_device``), outside the timed step.
"""
from __future__ import annotations

import numpy as np

from harness.model.graph import Graph

_STREAM = 0xD809  # keeps dropout keys apart from any other use of the spec's seed


def _dropped(info) -> tuple[float, tuple[int, ...]]:
    """(rate, mask shape per sample) of a layer; rate 0 for a layer that drops nothing."""
    if info.type == "dropout":
        return info.spec.rate, (1,) * len(info.out_shape) if info.spec.per_sample else info.out_shape
    if info.type == "attention":
        length = info.in_shape[0]
        return info.spec.dropout, (info.spec.heads, length, length)
    return 0.0, ()


class DropoutMasks:
    def __init__(self, graph: Graph | None, seed: int):
        #: (canonical layer path, rate, mask shape) of every dropout layer and attention dropout that drops anything;
        #: none for a native model (graph None), whose dropout is its framework's own
        self.layers = [(info.path, *_dropped(info)) for info in graph.layers if _dropped(info)[0] > 0] if graph else []
        self._keys = {path: np.random.SeedSequence([seed % 2**63, _STREAM, index]).generate_state(2, np.uint64)
                      for index, (path, _, _) in enumerate(self.layers)}

    def __bool__(self) -> bool:
        return bool(self.layers)

    def for_step(self, step: int, batch_size: int, out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The masks of training step `step` (warm-up steps count), by layer path; {} without dropout. Written
        into `out` (masks of an earlier call) when given, so that a training loop allocates no new masks."""
        masks = {}
        for path, rate, shape in self.layers:
            key = int(self._keys[path][0]) << 64 | int(self._keys[path][1])
            generator = np.random.Generator(np.random.Philox(key=key, counter=[0, 0, 0, step]))
            if out is None:
                masks[path] = (generator.random((batch_size, *shape), dtype=np.float32) >= rate).astype(np.float32)
            else:
                mask = masks[path] = out[path]
                generator.random(dtype=np.float32, out=mask)
                np.greater_equal(mask, rate, out=mask, casting="unsafe")
        return masks
