"""The spec's optimizers, gradient clipping and losses in torch. SGD, Adam and AdamW are torch's own (their math is
the spec's: torch's AdamW multiplies p by 1 - lr*weight_decay before Adam's step, which is the spec's decoupled
decay of p before the update, so each weight's decay is its param group's weight_decay, taken from the core);
RMSprop is written out because torch puts epsilon outside the square root only. Clipping is written out because
torch.nn.utils.clip_grad_norm_ divides by norm + 1e-6."""
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


def decay_groups(spec, named_params: dict[str, torch.nn.Parameter]) -> list[dict]:
    """The parameters as torch param groups, one per weight decay the core gives their canonical names
    (harness.model.optimizer.weight_decay; a single group of decay 0 for every optimizer but AdamW)."""
    from harness.model.optimizer import weight_decay

    groups: dict[float, list[torch.nn.Parameter]] = {}
    for name, p in named_params.items():
        groups.setdefault(weight_decay(spec, name), []).append(p)
    return [{"params": params, "weight_decay": decay} for decay, params in groups.items()]


def make_optimizer(spec, named_params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The spec's optimizer over the trainable weights (by canonical name) with all its state created now, not
    lazily in the first step: zero moments and momentum buffers (torch's first step would set a momentum buffer
    to the gradient: 0*momentum + g is the same), so that no timed step allocates state."""
    params, groups = list(named_params.values()), decay_groups(spec, named_params)
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
        for p in params:
            optimizer.state[p] = state(p)
    return optimizer


def clip_factor(grads: list[torch.Tensor], clip_norm: float) -> torch.Tensor:
    """clip_norm / max(n, clip_norm) for the global norm n of these (unscaled) gradients, on their device, in
    float32 (float64 for float64 gradients): 1 where n is not finite, so that a step the loss scaler skips
    keeps its gradients as they are (and no host sync decides it)."""
    dtype = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
    norm = torch.stack([g.to(dtype).square().sum() for g in grads]).sum().sqrt()
    clip = torch.full_like(norm, clip_norm)  # a tensor divided, not `float / tensor` (a reciprocal, then a product)
    return torch.where(norm.isfinite(), clip / torch.maximum(norm, clip), torch.ones_like(norm))


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
