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
                v = self.state[p]["square_avg"]  # created by make_optimizer
                v.mul_(rho).addcmul_(p.grad, p.grad, value=1 - rho)
                denom = v.add(eps).sqrt_() if group["eps_inside"] else v.sqrt().add_(eps)
                p.addcdiv_(p.grad, denom, value=-lr)


def make_optimizer(spec, params) -> torch.optim.Optimizer:
    """The spec's optimizer with all its state created now, not lazily in the first step: zero moments and
    momentum buffers (torch's first step would set a momentum buffer to the gradient: 0*momentum + g is the
    same), so that no timed step allocates state."""
    params = list(params)
    if spec.type == "sgd":
        optimizer = torch.optim.SGD(params, lr=spec.learning_rate, momentum=spec.momentum, nesterov=spec.nesterov)
        state = (lambda p: {"momentum_buffer": torch.zeros_like(p)}) if spec.momentum else None
    elif spec.type == "adam":
        optimizer = torch.optim.Adam(params, lr=spec.learning_rate, betas=(spec.beta_1, spec.beta_2),
                                     eps=spec.epsilon)
        state = lambda p: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),  # noqa: E731
                           "exp_avg_sq": torch.zeros_like(p)}
    else:
        optimizer = RMSprop(params, spec.learning_rate, spec.rho, spec.epsilon, spec.epsilon_placement == "inside")
        state = lambda p: {"square_avg": torch.zeros_like(p)}  # noqa: E731
    if state:
        for p in params:
            optimizer.state[p] = state(p)
    return optimizer


def loss_fn(spec, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Batch-mean loss in float32 (or float64 for float64 outputs), whatever the compute dtype; a next-token batch
    (outputs [N, T, vocab], labels [N, T]) is the mean over all N*T tokens."""
    out = outputs if outputs.dtype == torch.float64 else outputs.float()
    if spec.type == "sparse_categorical_crossentropy":
        out, labels = out.reshape(-1, out.shape[-1]), labels.reshape(-1)
        if spec.from_logits:
            return F.cross_entropy(out, labels)
        probs = (out / out.sum(dim=1, keepdim=True)).clamp(PROB_EPSILON, 1 - PROB_EPSILON)
        return F.nll_loss(probs.log(), labels)
    z, y = out[:, 0], labels.to(out.dtype)
    if spec.from_logits:
        return F.binary_cross_entropy_with_logits(z, y)
    p = z.clamp(PROB_EPSILON, 1 - PROB_EPSILON)
    return -(y * p.log() + (1 - y) * (1 - p).log()).mean()
