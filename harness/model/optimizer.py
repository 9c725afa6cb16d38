"""The optimizer rules every adapter applies the same way (the math is in harness.model.spec's docstring): the
learning rate of each step under the spec's schedule, and which weights AdamW decays. Plain Python: the adapter
feeds the step's rate to its framework's update and decays the weights `decays` names.
"""
from __future__ import annotations

import math

from harness.model.weights import weight_kind

# a weight kind (harness.model.weights.weight_kind) -> the `no_decay` entry that exempts it
NO_DECAY_OF_KIND = {"bias": "biases", "beta": "biases", "gamma": "norm_scales", "embeddings": "embeddings"}


def learning_rate(optimizer, step: int, steps: int) -> float:
    """The learning rate of step `step` (0-based: every step the trainer takes) of a spec whose `steps` is
    `steps`."""
    schedule, peak = optimizer.schedule, optimizer.learning_rate
    if schedule is None or schedule.type == "constant":
        return peak
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    end = schedule.decay_steps or steps
    if step >= end or end <= warmup:  # the spec's own steps can be fewer than the warm-up (an override)
        return schedule.min_learning_rate
    progress = (step - warmup) / (end - warmup)
    return schedule.min_learning_rate + (peak - schedule.min_learning_rate) * (1 + math.cos(math.pi * progress)) / 2


def scheduled(optimizer) -> bool:
    """The learning rate changes from step to step."""
    return optimizer.schedule is not None and optimizer.schedule.type != "constant"


def weight_decay(optimizer, name: str, kind: str | None = None) -> float:
    """The decoupled weight decay AdamW applies to the canonical weight `name` (a native model's weight: of
    `kind`, harness.model.native.weight_kind): 0 for other optimizers and for the kinds its `no_decay` names."""
    if optimizer.type != "adamw":
        return 0.0
    exempt = NO_DECAY_OF_KIND.get(kind or weight_kind(name))
    return 0.0 if exempt in optimizer.no_decay else optimizer.weight_decay


def describe(optimizer, steps: int) -> str:
    """One line for `amp-harness check`: the optimizer, its schedule, decay and clipping."""
    parts = [f"{optimizer.type}, learning rate {optimizer.learning_rate:g}"]
    if scheduled(optimizer):
        schedule = optimizer.schedule
        parts[0] += (f": warm-up over {schedule.warmup_steps} steps, cosine to {schedule.min_learning_rate:g} at step "
                     f"{schedule.decay_steps or steps}")
    if optimizer.type == "adamw":
        exempt = f" (not on {', '.join(k.replace('_', ' ') for k in optimizer.no_decay)})" if optimizer.no_decay else ""
        parts.append(f"weight decay {optimizer.weight_decay:g}{exempt}")
    if optimizer.clip_norm is not None:
        parts.append(f"gradients clipped to a global norm of {optimizer.clip_norm:g}")
    return "; ".join(parts)
