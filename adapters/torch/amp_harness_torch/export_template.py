"""@HEADER@"""
# The PyTorch template of `amp-harness export` (harness/export.py fills in the docstring above and CONFIG below).
# PyTorch is channels-first: images come in NHWC and are permuted to NCHW; conv kernels [kH, kW, in, out] become
# [out, in, kH, kW] and dense kernels [in, out] become [out, in]. What keeps the spec's math:
# - 'same' padding is TensorFlow's (the odd pixel at the bottom/right): explicit nn.ZeroPad2d where it is uneven;
#   average pooling with 'same' divides by the real pixels of each window, as TensorFlow does;
# - flatten flattens in the spec's H, W, C order (FlattenHWC), so the canonical dense kernel needs no reordering;
# - batchnorm's running variance is the biased batch variance (nn.BatchNorm2d's own update uses the unbiased one);
# - RMSprop with epsilon inside the square root is written out (torch.optim.RMSprop puts it outside).
import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {}  # @CONFIG@

PROB_EPSILON = 1e-7  # probabilities are clipped to [eps, 1 - eps] in losses on probabilities


def torch_layout(array: np.ndarray) -> np.ndarray:
    """A canonical weight in PyTorch's layout: conv [kH, kW, in, out] -> [out, in, kH, kW], dense [in, out] ->
    [out, in], vectors unchanged."""
    if array.ndim == 4:
        return array.transpose(3, 2, 0, 1)
    if array.ndim == 2:
        return array.T
    return array


class FlattenHWC(nn.Module):
    """The spec's flatten: NCHW activations flattened in H, W, C order (nn.Flatten would give C, H, W)."""

    def forward(self, x):
        return (x.permute(0, 2, 3, 1) if x.dim() == 4 else x).flatten(1)


class AvgPoolSame(nn.Module):
    """TensorFlow's 'same' average pooling: the window's sum over the zero-padded input divided by the number of
    real pixels it covers."""

    def __init__(self, k, s, pads, in_hw):
        super().__init__()
        top, bottom, left, right = pads
        self.k, self.s, self.pad = k, s, (left, right, top, bottom)
        ones = F.pad(torch.ones(1, 1, *in_hw, dtype=torch.float64), self.pad)
        self.register_buffer("count", F.avg_pool2d(ones, k, s, divisor_override=1)[0, 0])

    def forward(self, x):
        sums = F.avg_pool2d(F.pad(x, self.pad), self.k, self.s, divisor_override=1)
        return sums / self.count.to(sums.dtype)


class SpecBatchNorm(nn.modules.batchnorm._BatchNorm):
    """nn.BatchNorm1d/2d with the spec's running statistics: running = m*running + (1-m)*batch with the biased
    batch variance (PyTorch's own update would use the unbiased one, which shows in evaluation)."""

    def __init__(self, channels, momentum, eps):
        super().__init__(channels, eps=eps, momentum=1 - momentum)

    def _check_input_dim(self, x):
        pass

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        with torch.no_grad():
            dims = [d for d in range(x.dim()) if d != 1]
            var, mean = torch.var_mean(x if x.dtype == torch.float64 else x.float(), dim=dims, correction=0)
            self.running_mean.mul_(1 - self.momentum).add_(mean.to(self.running_mean.dtype), alpha=self.momentum)
            self.running_var.mul_(1 - self.momentum).add_(var.to(self.running_var.dtype), alpha=self.momentum)
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)


class ChannelLayerNorm(nn.LayerNorm):
    """Layer normalisation over the channels (the spec's last axis): NCHW images go through NHWC."""

    def forward(self, x):
        if x.dim() == 4:
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return super().forward(x)


class Residual(nn.Module):
    def __init__(self, main, shortcut):
        super().__init__()
        self.main, self.shortcut = main, shortcut

    def forward(self, x):
        return self.main(x) + self.shortcut(x)


def make_layer(cfg, weights):
    """The PyTorch module of one spec layer; `weights` receives (canonical name -> (tensor, kind)) of its
    parameters and buffers, for load_canonical."""
    t, shape = cfg["type"], cfg["in_shape"]
    if t == "dense":
        layer = nn.Linear(shape[-1], cfg["units"], bias=cfg["use_bias"])
        weights[f"{cfg['path']}.kernel"] = layer.weight
        if cfg["use_bias"]:
            weights[f"{cfg['path']}.bias"] = layer.bias
        return layer
    if t == "conv2d":
        top, bottom, left, right = cfg["pads"]
        even = top == bottom and left == right
        conv = nn.Conv2d(shape[2], cfg["filters"], cfg["kernel_size"], cfg["strides"],
                         padding=(top, left) if even else 0, bias=cfg["use_bias"])
        weights[f"{cfg['path']}.kernel"] = conv.weight
        if cfg["use_bias"]:
            weights[f"{cfg['path']}.bias"] = conv.bias
        return conv if even else nn.Sequential(nn.ZeroPad2d((left, right, top, bottom)), conv)
    if t == "maxpool2d":
        top, bottom, left, right = cfg["pads"]
        pool = nn.MaxPool2d(cfg["pool_size"], cfg["strides"])
        if not any(cfg["pads"]):
            return pool
        return nn.Sequential(nn.ConstantPad2d((left, right, top, bottom), float("-inf")), pool)
    if t == "avgpool2d":
        if not any(cfg["pads"]):
            return nn.AvgPool2d(cfg["pool_size"], cfg["strides"])
        return AvgPoolSame(cfg["pool_size"], cfg["strides"], cfg["pads"], shape[:2])
    if t == "global_avgpool2d":
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    if t == "flatten":
        return FlattenHWC()
    if t == "relu":
        return nn.ReLU()
    if t == "gelu":
        return nn.GELU(approximate="tanh" if cfg["approximate"] else "none")
    if t == "tanh":
        return nn.Tanh()
    if t == "sigmoid":
        return nn.Sigmoid()
    if t == "softmax":
        return nn.Softmax(dim=1 if len(shape) == 3 else -1)  # images: the channel axis of NCHW
    if t == "batchnorm":
        layer = SpecBatchNorm(shape[-1], cfg["momentum"], cfg["epsilon"])
        for name, attr in (("gamma", "weight"), ("beta", "bias"), ("moving_mean", "running_mean"),
                           ("moving_variance", "running_var")):
            weights[f"{cfg['path']}.{name}"] = getattr(layer, attr)
        return layer
    if t == "layernorm":
        layer = ChannelLayerNorm(shape[-1], eps=cfg["epsilon"])
        weights[f"{cfg['path']}.gamma"], weights[f"{cfg['path']}.beta"] = layer.weight, layer.bias
        return layer
    if t == "dropout":
        return nn.Dropout(cfg["rate"])  # PyTorch's own masks, not the harness's
    if t == "residual":
        main = nn.Sequential(*(make_layer(sub, weights) for sub in cfg["layers"]))
        shortcut = nn.Sequential(*(make_layer(sub, weights) for sub in cfg["projection"])) \
            if cfg["projection"] else nn.Identity()
        return Residual(main, shortcut)
    raise ValueError(f"layer type {t!r} is not exported")


def load_canonical(weights, data):
    """Copy the canonical initial weights of the data file into the network, converted to PyTorch's layouts."""
    with torch.no_grad():
        for name, tensor in weights.items():
            value = torch.from_numpy(np.ascontiguousarray(torch_layout(data[f"w/{name}"])))
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name}: data file has {tuple(value.shape)}, the network {tuple(tensor.shape)}")
            tensor.copy_(value)


class RMSpropInside(torch.optim.Optimizer):
    """RMSprop with epsilon inside the square root: v = rho*v + (1-rho)*g^2; p -= lr*g/sqrt(v + eps)."""

    def __init__(self, params, lr, rho, eps):
        super().__init__(params, {"lr": lr, "rho": rho, "eps": eps})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                v = self.state[p].setdefault("square_avg", torch.zeros_like(p))
                v.mul_(group["rho"]).addcmul_(p.grad, p.grad, value=1 - group["rho"])
                p.addcdiv_(p.grad, v.add(group["eps"]).sqrt_(), value=-group["lr"])


def make_optimizer(cfg, params):
    if cfg["type"] == "sgd":  # buf = m*buf + g; p -= lr*buf (nesterov: lr*(g + m*buf)): PyTorch's own
        return torch.optim.SGD(params, lr=cfg["learning_rate"], momentum=cfg["momentum"], nesterov=cfg["nesterov"])
    if cfg["type"] == "adam":  # p -= lr*m_hat/(sqrt(v_hat) + eps): PyTorch's own form
        return torch.optim.Adam(params, lr=cfg["learning_rate"], betas=(cfg["beta_1"], cfg["beta_2"]),
                                eps=cfg["epsilon"])
    if cfg["type"] == "rmsprop":
        if cfg["epsilon_placement"] == "outside":  # p -= lr*g/(sqrt(v) + eps): PyTorch's own
            return torch.optim.RMSprop(params, lr=cfg["learning_rate"], alpha=cfg["rho"], eps=cfg["epsilon"])
        return RMSpropInside(params, cfg["learning_rate"], cfg["rho"], cfg["epsilon"])
    raise ValueError(f"optimizer {cfg['type']!r} is not exported")


def loss_fn(cfg, outputs, labels):
    """The batch-mean loss in float32 (float64 in a float64 run), whatever the compute dtype."""
    out = outputs if outputs.dtype == torch.float64 else outputs.float()
    if cfg["type"] == "sparse_categorical_crossentropy":
        if cfg["from_logits"]:
            return F.cross_entropy(out, labels)
        probs = (out / out.sum(dim=1, keepdim=True)).clamp(PROB_EPSILON, 1 - PROB_EPSILON)
        return F.nll_loss(probs.log(), labels)
    z, y = out[:, 0], labels.to(out.dtype)
    if cfg["from_logits"]:
        return F.binary_cross_entropy_with_logits(z, y)
    p = z.clamp(PROB_EPSILON, 1 - PROB_EPSILON)
    return -(y * p.log() + (1 - y) * (1 - p).log()).mean()


def main():
    parser = argparse.ArgumentParser(description=f"train {CONFIG['model']} in PyTorch, {CONFIG['precision']}")
    parser.add_argument("--data", default=str(Path(__file__).with_name(CONFIG["data_file"])))
    parser.add_argument("--steps", type=int, default=CONFIG["steps"])
    parser.add_argument("--losses-json", help="write each step's loss here as JSON")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    data = np.load(args.data)
    if str(data["spec_hash"]) != CONFIG["spec_hash"]:
        raise SystemExit(f"{args.data} holds the data of another spec ({data['spec_hash']}); export again")
    if not 1 <= args.steps <= len(data["x"]):
        raise SystemExit(f"--steps: the data file holds {len(data['x'])} batches")
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # strict float32 on GPUs
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(CONFIG["seed"])

    weights = {}
    net = nn.Sequential(*(make_layer(cfg, weights) for cfg in CONFIG["layers"]))
    load_canonical(weights, data)
    dtype = {"float32": torch.float32, "float64": torch.float64}[CONFIG["dtype"]]
    net = net.to(device, dtype=dtype).train()
    images = len(CONFIG["input_shape"]) == 3
    if images:  # channels-last memory: oneDNN's and tensor cores' fast layout (the harness's default variant)
        net = net.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(CONFIG["optimizer"], net.parameters())
    compute = {None: None, "bfloat16": torch.bfloat16, "float16": torch.float16}[CONFIG["compute_dtype"]]
    scaler = None
    if CONFIG["loss_scale"]:
        ls = CONFIG["loss_scale"]
        scaler = torch.amp.GradScaler(device.type, init_scale=ls["initial"], growth_factor=ls["growth_factor"],
                                      backoff_factor=ls["backoff_factor"], growth_interval=ls["growth_interval"])

    losses = []
    for step in range(args.steps):
        x = torch.from_numpy(data["x"][step]).to(device, dtype)
        if images:
            x = x.permute(0, 3, 1, 2)  # NHWC memory seen as NCHW: a channels-last tensor, no copy
        y = torch.from_numpy(data["y"][step]).to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=compute, enabled=compute is not None):
            out = net(x)
        loss = loss_fn(CONFIG["loss"], out, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped when the scaled gradients hold an inf or NaN
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
        print(f"step {step} loss {losses[-1]:.8g}", flush=True)
    if args.losses_json:
        Path(args.losses_json).write_text(json.dumps({
            "model": CONFIG["model"], "framework": "torch", "precision": CONFIG["precision"],
            "spec_hash": CONFIG["spec_hash"], "losses": [v if math.isfinite(v) else None for v in losses]}))


if __name__ == "__main__":
    main()
