"""The core's weight-writing rules (harness.rounding) in torch: stochastic rounding through bit-casts
(Tensor.view(dtype)), the fixed-point grid, Kahan-compensated updates, and the optimizer that computes its update
in float32 and writes the new weights by these rules (the precisions with a `rounding`)."""
from __future__ import annotations

import math

import torch

from harness.rounding import FLOAT16_MAX, NOISE_RANGE, Rounding

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fixed16": torch.float32}
_FLOAT16_MIN_BIASED_EXPONENT = 127 - 14  # float16's smallest normal exponent, as float32 stores it


def storage_dtype(rounding: Rounding) -> torch.dtype:
    """The dtype that holds the format's values: fixed-point values are float32 numbers on the grid."""
    return _DTYPES[rounding.format]


def draw_bits(shape, generator: torch.Generator) -> torch.Tensor:
    """16 random bits per value, on the generator's device (timed runs draw the noise where they train)."""
    return torch.randint(0, NOISE_RANGE, tuple(shape), generator=generator, device=generator.device,
                         dtype=torch.int32)


def round_nearest(x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """float32 `x` written to the format with round-to-nearest-even."""
    if rounding.format != "fixed16":
        return x.to(storage_dtype(rounding))  # torch's casts round to nearest even
    lo, hi = rounding.fixed_range
    return (torch.round(x / rounding.fixed_step) * rounding.fixed_step).clamp_(lo, hi)


def round_stochastic(x: torch.Tensor, bits: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """float32 `x` written to the format with stochastic rounding by the core's rule, `bits` int32 0..2^16-1."""
    if rounding.format == "bfloat16":
        # add the 16 bits to the float32 pattern and clear the 16 that bfloat16 drops: the cast is then exact
        rounded = ((x.view(torch.int32) + bits) & -NOISE_RANGE).view(torch.float32)
    else:
        magnitude = x.abs()
        if rounding.format == "float16":  # the gap, a power of two, built from x's exponent field
            exponent = (x.view(torch.int32) >> 23) & 0xFF
            gap = ((exponent.clamp_min(_FLOAT16_MIN_BIASED_EXPONENT) - 10) << 23).view(torch.float32)
        else:
            gap = torch.full_like(x, rounding.fixed_step)
        m = magnitude / gap  # exact: gap is a power of two
        low = torch.floor(m)
        away = bits.to(torch.float32) + (m - low) * NOISE_RANGE >= NOISE_RANGE
        rounded = torch.copysign((low + away) * gap, x)
        if rounding.format == "fixed16":
            rounded = rounded.clamp(*rounding.fixed_range)
        else:  # past float16's largest finite value: infinity, as a cast gives
            rounded = torch.where(rounded.abs() > FLOAT16_MAX, torch.copysign(torch.full_like(x, math.inf), x),
                                  rounded)
    # non-finite values as nearest rounding writes them: kept in a float format, saturated on the fixed grid
    kept = x.clamp(*rounding.fixed_range) if rounding.format == "fixed16" else x
    return torch.where(torch.isfinite(x), rounded, kept).to(storage_dtype(rounding))


class RoundedUpdate(torch.optim.Optimizer):
    """The spec's optimizer (SGD with or without momentum and Nesterov, Adam, RMSprop, in their spec forms)
    computed in float32 from weights, gradients and state stored in 16 bits; the state is written back with
    nearest rounding, the weights by the precision's rule (harness.rounding). Every slot is created here."""

    def __init__(self, params, spec, rounding: Rounding, device: torch.device, seed: int):
        super().__init__(list(params), {})
        self.spec, self.rounding = spec, rounding
        self.slots = {"sgd": ("momentum_buffer",) if getattr(spec, "momentum", 0) else (), "adam": ("exp_avg", "exp_avg_sq"),
                      "rmsprop": ("square_avg",)}[spec.type] + (("compensation",) if rounding.mode == "kahan" else ())
        for p in self.params:
            self.state[p] = {slot: torch.zeros_like(p) for slot in self.slots}
        self.steps = 0
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.given_bits: dict | None = None  # fingerprint runs: the core's bits for the next step, by parameter

    @property
    def params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        spec, t = self.spec, self.steps
        for p in self.params:
            if p.grad is None:
                continue
            state, g, w = self.state[p], p.grad.float(), p.float()
            if spec.type == "sgd":
                direction = g
                if spec.momentum:
                    buf = spec.momentum * state["momentum_buffer"].float() + g
                    state["momentum_buffer"].copy_(buf)
                    direction = g + spec.momentum * buf if spec.nesterov else buf
                new = w - spec.learning_rate * direction
            elif spec.type == "adam":
                m = spec.beta_1 * state["exp_avg"].float() + (1 - spec.beta_1) * g
                v = spec.beta_2 * state["exp_avg_sq"].float() + (1 - spec.beta_2) * g * g
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                step_size = spec.learning_rate / (1 - spec.beta_1 ** t)
                new = w - step_size * (m / (v.sqrt() / math.sqrt(1 - spec.beta_2 ** t) + spec.epsilon))
            else:
                v = spec.rho * state["square_avg"].float() + (1 - spec.rho) * g * g
                state["square_avg"].copy_(v)
                denom = (v + spec.epsilon).sqrt() if spec.epsilon_placement == "inside" else v.sqrt() + spec.epsilon
                new = w - spec.learning_rate * (g / denom)
            p.copy_(self._write(p, w, new, state))
        self.given_bits = None
        return None

    def _write(self, p, w, new, state):
        rounding = self.rounding
        if rounding.mode == "nearest":
            return round_nearest(new, rounding)
        if rounding.mode == "kahan":
            y = (new - w) - state["compensation"].float()
            s = (w + y).to(p.dtype)
            state["compensation"].copy_(((s.float() - w) - y).to(p.dtype))
            return s
        bits = self.given_bits[p] if self.given_bits is not None else draw_bits(p.shape, self.generator)
        return round_stochastic(new, bits, rounding)
