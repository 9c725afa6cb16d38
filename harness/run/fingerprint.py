"""The work of a `fingerprint` run: what the parity check compares across frameworks (harness.parity) and the
conformance kit's golden fingerprints embed."""
from __future__ import annotations

import math

import numpy as np

from harness.rounding import RoundingNoise
from harness.run.diagnose import gradient_fingerprint
from harness.run.request import BuiltRun
from harness.run.train import LossScaleLog

FINGERPRINT_POSITIONS = 4  # of a sequence's outputs: tiny_gpt's [16, 64, 256] whole would make a 5 MB record


def fingerprint(run: BuiltRun) -> None:
    """Outputs on a fixed batch before and after `spec.steps` untimed training steps, and the loss (and loss
    scale) of every step. A stochastically rounding precision rounds every step with the core's bits
    (RoundingNoise), so frameworks round alike."""
    spec, data, masks, trainer, record = run.spec, run.data, run.masks, run.trainer, run.record
    rounding = run.precision.rounding
    noise = RoundingNoise(run.graph.trainable_shapes(), spec.seed) if rounding is not None and rounding.stochastic \
        else None
    x, _ = data.fixed_batch()
    initial = trainer.predict(x)
    losses, scales, gradients = [], LossScaleLog(run.loss_scale), None
    # every step through the capturing twin where the adapter has one, so that a compiled step is built once, not
    # twice (the kit proves the twin trains as the plain step does); the first step's gradients are fingerprinted
    capturing = True
    for step in range(spec.steps):
        bx, by = data.train_batch(step)
        if noise is not None:
            trainer.set_rounding_noise(noise.for_step(step))
        batch = trainer.to_device(bx, by, masks.for_step(step, len(by)))
        captured = trainer.captured_step(batch) if capturing else None
        if captured is None:
            capturing = False
            losses.append(trainer.train_step(batch))
        else:
            losses.append(captured[0])
            if step == 0:
                gradients = gradient_fingerprint(captured[1], spec.seed)
        scales.after_step(trainer, step)
    final = trainer.predict(x)
    finite = all(math.isfinite(v) for v in losses) and np.isfinite(final).all()
    record.update(status="ok" if finite else "diverged", reason=None if finite else "non-finite loss or outputs",
                  loss=[v if math.isfinite(v) else None for v in losses],
                  fingerprint={"initial_outputs": _listed(initial), "final_outputs": _listed(final),
                               "loss_scales": scales.history or None, "skipped_steps": scales.skipped,
                               "gradients": gradients,
                               "spec": spec.model_dump(mode="json")})  # what the golden fingerprints embed


def _listed(a: np.ndarray) -> list:
    """Outputs as a fingerprint holds them: a row per sample; of sequence outputs [N, T, C], the outputs at
    FINGERPRINT_POSITIONS positions spread evenly from the first to the last (the kit's reference checks compare
    every position; a causal mask shifted by one changes the output at each of these)."""
    if a.ndim == 3:
        a = a[:, np.unique(np.linspace(0, a.shape[1] - 1, FINGERPRINT_POSITIONS).round().astype(int))]
    return [[v if math.isfinite(v) else None for v in row] for row in a.astype(float).reshape(len(a), -1).tolist()]
