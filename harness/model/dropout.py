"""Dropout masks, drawn by the core so that every framework drops the same units.

A framework's own dropout draws from its own random stream, so a spec with dropout would train differently
in each framework. Instead the core draws each mask from a counter-based generator (Philox) keyed by the
spec's seed and the layer, with the training step as the counter: any step's mask can be drawn without
replaying the steps before it (a resumed run, a fingerprint, a diagnosis all see the same masks).

A mask is float32 1 (keep) or 0 (drop) in the canonical layout of the layer's output ([N, H, W, C] for
images, [N, F] for vectors). Adapters apply it in training as ``x * mask / (1 - rate)`` and ignore dropout
in inference. Masks are drawn and handed over with the batch (``Trainer.to_device``), outside the timed step.
"""
from __future__ import annotations

import numpy as np

from harness.model.graph import Graph

_STREAM = 0xD809  # keeps dropout keys apart from any other use of the spec's seed


class DropoutMasks:
    def __init__(self, graph: Graph, seed: int):
        #: (canonical layer path, rate, output shape) of every dropout layer that drops anything
        self.layers = [(info.path, info.spec.rate, info.out_shape) for info in graph.layers
                       if info.type == "dropout" and info.spec.rate > 0]
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
