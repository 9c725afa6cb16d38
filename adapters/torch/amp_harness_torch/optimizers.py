"""The spec's optimizers, gradient clipping and losses in torch. SGD, Adam and AdamW are torch's own (their math is
the spec's: torch's AdamW multiplies p by 1 - lr*weight_decay before Adam's step, which is the spec's decoupled
decay of p before the update, so each weight's decay is its param group's weight_decay, taken from the core);
RMSprop is written out because torch puts epsilon outside the square root only. Clipping is written out because
torch.nn.utils.clip_grad_norm_ divides by norm + 1e-6."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.model.optimizer import weight_decay
from harness.model.training import ClipOps, LossOps, clip_factor_with


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


def make_optimizer(spec, named_params: dict[str, torch.nn.Parameter],
                   kinds: dict[str, str] | None = None) -> torch.optim.Optimizer:
    """The spec's optimizer over the trainable weights (by canonical name, or a native model's with their `kinds`),
    one param group per weight decay the core gives them (a single group of decay 0 for every optimizer but AdamW),
    with all its state created now, not lazily in the first step: zero moments and momentum buffers (torch's first
    step would set a momentum buffer to the gradient: 0*momentum + g is the same), so that no timed step allocates
    state."""
    by_decay: dict[float, list[torch.nn.Parameter]] = {}
    for name, p in named_params.items():
        by_decay.setdefault(weight_decay(spec, name, (kinds or {}).get(name)), []).append(p)
    groups = [{"params": params, "weight_decay": decay} for decay, params in by_decay.items()]
    if spec.type == "sgd":
        optimizer = torch.optim.SGD(groups, lr=spec.learning_rate, momentum=spec.momentum, nesterov=spec.nesterov)
        state = (lambda p: {"momentum_buffer": torch.zeros_like(p)}) if spec.momentum else None
    elif spec.type in ("adam", "adamw"):
        adam = torch.optim.AdamW if spec.type == "adamw" else torch.optim.Adam  # Adam: each group's decay is 0
        optimizer = adam(groups, lr=spec.learning_rate, betas=(spec.beta_1, spec.beta_2), eps=spec.epsilon)
        state = lambda p: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),  # noqa: E731
                           "exp_avg_sq": torch.zeros_like(p)}
    else:
        optimizer = RMSprop(groups, spec.learning_rate, spec.rho, spec.epsilon, spec.epsilon_placement == "inside")
        state = lambda p: {"square_avg": torch.zeros_like(p)}  # noqa: E731
    if state:
        for p in named_params.values():
            optimizer.state[p] = state(p)
    return optimizer


# harness.model.training's primitives: torch's fused cross-entropies (next-token batches as [N*T, vocab])
LOSS_OPS = LossOps(
    upcast=lambda x: x if x.dtype == torch.float64 else x.float(),
    softmax_cross_entropy=lambda out, labels: F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1)),
    normalized=lambda x: x / x.sum(dim=-1, keepdim=True),
    nll=lambda logp, labels: F.nll_loss(logp.reshape(-1, logp.shape[-1]), labels.reshape(-1)),
    first_column=lambda x: x[:, 0], labels_like=lambda labels, out: labels.to(out.dtype),
    clip=torch.clamp, log=torch.log, log1p=torch.log1p, exp=torch.exp, abs=torch.abs, relu=torch.relu,
    mean=torch.mean, sigmoid_cross_entropy=F.binary_cross_entropy_with_logits,
)
CLIP_OPS = ClipOps(full_like=torch.full_like, maximum=torch.maximum, where=torch.where, ones_like=torch.ones_like)


def clip_factor(grads: list[torch.Tensor], clip_norm: float) -> torch.Tensor:
    """The spec's clipping factor of these unscaled gradients' global norm, on their device: no host sync decides
    whether the loss scaler skips the step (harness.model.training.clip_factor_with)."""
    dtype = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
    norm = torch.stack([g.to(dtype).square().sum() for g in grads]).sum().sqrt()
    return clip_factor_with(CLIP_OPS, norm, clip_norm, norm.isfinite())

