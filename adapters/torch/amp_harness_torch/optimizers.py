"""The spec's optimizers and losses in torch. SGD and Adam are torch's own (their math is the spec's);
RMSprop is written out because torch puts epsilon outside the square root only."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.model.spec import PROB_EPSILON


class RMSprop(torch.optim.Optimizer):
    def __init__(self, params, lr: float, rho: float, eps: float, eps_inside: bool):
        super().__init__(params, {"lr": lr, "rho": rho, "eps": eps, "eps_inside": eps_inside})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, rho, eps = group["lr"], group["rho"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["square_avg"] = torch.zeros_like(p)
                v = state["square_avg"]
                v.mul_(rho).addcmul_(p.grad, p.grad, value=1 - rho)
                denom = v.add(eps).sqrt_() if group["eps_inside"] else v.sqrt().add_(eps)
                p.addcdiv_(p.grad, denom, value=-lr)


def make_optimizer(spec, params) -> torch.optim.Optimizer:
    if spec.type == "sgd":
        return torch.optim.SGD(params, lr=spec.learning_rate, momentum=spec.momentum, nesterov=spec.nesterov)
    if spec.type == "adam":
        return torch.optim.Adam(params, lr=spec.learning_rate, betas=(spec.beta_1, spec.beta_2), eps=spec.epsilon)
    return RMSprop(params, spec.learning_rate, spec.rho, spec.epsilon, spec.epsilon_placement == "inside")


def loss_fn(spec, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Batch-mean loss in float32 (or float64 for float64 outputs), whatever the compute dtype."""
    out = outputs if outputs.dtype == torch.float64 else outputs.float()
    if spec.type == "sparse_categorical_crossentropy":
        if spec.from_logits:
            return F.cross_entropy(out, labels)
        probs = (out / out.sum(dim=1, keepdim=True)).clamp(PROB_EPSILON, 1 - PROB_EPSILON)
        return F.nll_loss(probs.log(), labels)
    z, y = out[:, 0], labels.to(out.dtype)
    if spec.from_logits:
        return F.binary_cross_entropy_with_logits(z, y)
    p = z.clamp(PROB_EPSILON, 1 - PROB_EPSILON)
    return -(y * p.log() + (1 - y) * (1 - p).log()).mean()
