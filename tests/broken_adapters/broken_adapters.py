"""Deliberately broken adapters: the torch adapter with one classic bug each, which the conformance kit must
fail with a message naming it (test_kit_catches_broken_adapters.py). Each patches torch's adapter when it
builds (never on import: the kit checks that importing an entry point imports no framework); the kit runs one
adapter per process."""
from __future__ import annotations

from amp_harness_torch.adapter import TorchAdapter


class _Broken(TorchAdapter):
    def build(self, *args, **kwargs):
        self.break_it()
        return super().build(*args, **kwargs)


class FlattenChannelsFirst(_Broken):
    """flatten in torch's own C, H, W order instead of the spec's H, W, C"""

    def break_it(self):
        from amp_harness_torch import network

        network.Flatten.forward = lambda self, x: x.flatten(1)


class SamePaddingTopLeft(_Broken):
    """'same' padding with the odd pixel top/left (Caffe's habit) instead of bottom/right"""

    def break_it(self):
        from amp_harness_torch import network

        from harness.model.graph import Padding, window_padding

        def top_left(*args):
            padding = window_padding(*args)
            if not padding.explicit:
                return padding
            top, bottom, left, right = padding.explicit
            return Padding(padding.symmetric, (bottom, top, right, left))

        network.window_padding = top_left


def _adam(real, epsilon_inside: bool, float32_lr: bool):
    """torch's make_optimizer (`real`) with Adam's epsilon inside the square root, or a float32 learning rate."""
    def make_optimizer(spec, named_params, kinds=None):
        import numpy as np
        import torch

        lr = float(np.float32(spec.learning_rate)) if float32_lr else spec.learning_rate
        if spec.type != "adam" or not epsilon_inside:
            return real(spec.model_copy(update={"learning_rate": lr}), named_params, kinds)

        class Adam(torch.optim.Optimizer):  # lr*m_hat/sqrt(v_hat + eps) instead of lr*m_hat/(sqrt(v_hat) + eps)
            @torch.no_grad()
            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        state = self.state[p]
                        if not state:
                            state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                        state["t"] += 1
                        b1, b2, t = spec.beta_1, spec.beta_2, state["t"]
                        state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                        state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                        m_hat, v_hat = state["m"] / (1 - b1**t), state["v"] / (1 - b2**t)
                        p.sub_(lr * m_hat / (v_hat + spec.epsilon).sqrt())

        return Adam(list(named_params.values()), {})
    return make_optimizer


class AdamEpsilonInside(_Broken):
    """Adam with epsilon inside the square root"""

    def break_it(self):
        from amp_harness_torch import optimizers

        optimizers.make_optimizer = _adam(optimizers.make_optimizer, epsilon_inside=True, float32_lr=False)


class Float32LearningRate(_Broken):
    """the learning rate rounded to float32 (what a float64 run must not do; fp32 rows cannot see it)"""

    def break_it(self):
        from amp_harness_torch import optimizers

        optimizers.make_optimizer = _adam(optimizers.make_optimizer, epsilon_inside=False, float32_lr=True)


class ScalerNeverSkips(_Broken):
    """a fixed loss scale whose overflowing steps are applied anyway"""

    def break_it(self):
        from amp_harness_torch.adapter import TorchTrainer

        def apply_anyway(self, loss, capture):
            (loss * self.scaler.scale).backward()
            for p in self.net.parameters():
                if p.grad is not None:
                    p.grad.div_(self.scaler.scale)
            self.skipped = False
            self.optimizer.step()

        TorchTrainer._manual_scaled_step = apply_anyway


class ClipBeforeUnscale(_Broken):
    """the global norm taken of the scaled gradients: clipping before the loss scale is divided out"""

    def break_it(self):
        from amp_harness_torch.adapter import TorchTrainer

        def clip_scaled(self, loss, capture):
            scale = self.scaler.scale
            (loss * scale).backward()
            self._prepare_update()  # the schedule's rate, and the clip, here on gradients still scaled
            grads = [p.grad for p in self.net.parameters() if p.grad is not None]
            self.torch._foreach_mul_(grads, 1.0 / scale)
            self.skipped = self.scaler.update(finite=all(bool(g.isfinite().all()) for g in grads))
            if capture is not None:
                capture.update(self.net.canonical_gradients())
            if not self.skipped:
                self.optimizer.step()

        TorchTrainer._manual_scaled_step = clip_scaled


def _unfused_attention(probabilities):
    """Attention.attend with the unfused math everywhere (no SDPA), its probabilities from `probabilities`."""
    def attend(self, q, k, v):
        return self.dropped(probabilities(self, q, k)) @ v
    return attend


class CausalMaskShifted(_Broken):
    """the causal mask shifted by one: position i also sees position i+1"""

    def break_it(self):
        import math

        import torch
        from amp_harness_torch import network

        def probabilities(self, q, k):
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            if self.causal:
                length = scores.shape[-1]
                shifted = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(2)
                scores = scores.masked_fill(shifted, float("-inf"))
            return torch.softmax(scores, dim=-1)

        network.Attention.attend = _unfused_attention(probabilities)


class SoftmaxScaleAfter(_Broken):
    """attention's 1/sqrt(Dh) applied after the softmax instead of to the scores before it"""

    def break_it(self):
        import math

        import torch
        from amp_harness_torch import network

        def probabilities(self, q, k):
            scores = q @ k.transpose(-2, -1)
            if self.causal:
                length = scores.shape[-1]
                future = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
            return torch.softmax(scores, dim=-1) / math.sqrt(self.head_dim)

        network.Attention.attend = _unfused_attention(probabilities)
