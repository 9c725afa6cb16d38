"""harness.rounding's primitives in torch (RoundingOps: bit-casts through Tensor.view(dtype)), and the rounding
precisions' optimizer."""
from __future__ import annotations

import math

import numpy as np
import torch

from harness.model.optimizer import weight_decay
from harness.rounding import NOISE_RANGE, Rounding, RoundingOps, rounded_slots, rounded_update


def draw_bits(shape, generator: torch.Generator) -> torch.Tensor:
    """16 random bits per value, on the generator's device (timed runs draw the noise where they train)."""
    return torch.randint(0, NOISE_RANGE, tuple(shape), generator=generator, device=generator.device,
                         dtype=torch.int32)


OPS = RoundingOps(
    as_int32=lambda x: x.view(torch.int32),
    as_float32=lambda p: p.view(torch.float32),
    to_float32=lambda t: t.to(torch.float32),
    cast=lambda x, dtype: x.to(getattr(torch, dtype)),  # torch's casts round to nearest even
    bit_and=torch.bitwise_and, shift_right=torch.bitwise_right_shift, shift_left=torch.bitwise_left_shift,
    maximum=torch.clamp_min, add_mask=torch.add, floor=torch.floor, round_half_even=torch.round, abs=torch.abs,
    where=torch.where, isfinite=torch.isfinite, copysign=torch.copysign, clip=torch.clamp, full_like=torch.full_like,
    amax=lambda x: x.abs().amax(), shift_in=lambda history, value: torch.cat([value.reshape(1), history[:-1]]),
    to_tensor=lambda a, device: torch.from_numpy(np.array(a)).to(device.name),
    to_numpy=lambda t: t.cpu().numpy(),
    draw_bits=lambda shape, seed, device: draw_bits(shape, torch.Generator(device=device.name).manual_seed(seed)),
    on_device=lambda fn, device: fn,  # eager: each op runs where its inputs are
    sqrt=torch.sqrt,
    scalars=lambda fn, lr, t: fn(lr, t, math.sqrt),  # Python floats: float64, then float32 in each operation
    shape=lambda x: tuple(x.shape), reshape=torch.reshape, transpose=lambda x, order: x.permute(*order),
    pad=lambda x, widths: torch.nn.functional.pad(x, [n for width in reversed(widths) for n in width]),
    crop=lambda x, shape: x[tuple(slice(0, n) for n in shape)],
    max_over=lambda x, axes: torch.amax(x, dim=axes, keepdim=True), flip=lambda x, axis: torch.flip(x, [axis]),
    constant=lambda array, like: torch.as_tensor(array, device=like.device), float64=lambda fn: fn,
)


class RoundedUpdate(torch.optim.Optimizer):
    """The spec's optimizer over these trainable weights (by canonical name, or a native model's with their `kinds`),
    computed in float32 by the core's rule (harness.rounding.rounded_update) from weights, gradients and state stored
    in 16 bits, every slot created here; its noise drawn on the weights' device. Its one param group's lr is the
    step's rate (the trainer sets it under a schedule); the gradients are multiplied by `gradient_factor` (clipping's,
    set for the next step) in float32."""

    def __init__(self, named_params: dict, spec, rounding: Rounding, seed: int, kinds: dict[str, str] | None = None):
        super().__init__(list(named_params.values()), {"lr": spec.learning_rate})
        self.params = self.param_groups[0]["params"]
        self.spec, self.rounding = spec, rounding
        for p in self.params:
            self.state[p] = {slot: torch.zeros_like(p) for slot in rounded_slots(spec, rounding)}
        # AdamW's decay, by parameter
        self.decay = {p: weight_decay(spec, name, (kinds or {}).get(name)) for name, p in named_params.items()}
        self.steps = 0
        self.generator = torch.Generator(device=self.params[0].device).manual_seed(seed)
        self.given_bits: dict | None = None  # fingerprint runs: the core's bits for the next step, by parameter
        self.gradient_factor: torch.Tensor | None = None  # clipping's, for the next step

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.float()
            if self.gradient_factor is not None:
                g = g * self.gradient_factor
            bits = None
            if self.rounding.stochastic:
                bits = self.given_bits[p] if self.given_bits is not None else draw_bits(p.shape, self.generator)
            state = self.state[p]
            weights, kept = rounded_update(OPS, self.spec, self.rounding, p.float(), g, state,
                                           self.param_groups[0]["lr"], self.steps, self.decay[p], bits)
            for slot, value in kept.items():
                state[slot].copy_(value)
            p.copy_(weights)
        self.given_bits = self.gradient_factor = None
