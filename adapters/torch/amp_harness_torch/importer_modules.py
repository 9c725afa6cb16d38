"""The PyTorch importer's table of torch.nn modules: each module class the spec maps (MODULES) into its spec layers,
read from the module's own fields and its input's shape, and where each canonical weight comes from
(module_weights). Shared by the torch.fx reading (importer.py) and the torch.export one (importer_export.py)."""
from __future__ import annotations

import torch
from torch import nn

from harness.errors import clip
from harness.model.importers import Problem


def _pair(value, key: str, what: str) -> int:
    """A window field the spec takes as one number: PyTorch's (a, a) (or a) -> a."""
    if isinstance(value, int):
        return value
    if isinstance(value, (tuple, list)) and value and all(v == value[0] for v in value) and isinstance(value[0], int):
        return value[0]
    raise Problem(f"{key} {_show(value)}", f"not square; the spec takes one {what} for height and width")


def _show(value) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_show(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, torch.fx.Node):
        return f"<{value.name}>"
    return clip(repr(value), 40)


def _window_padding(padding, kernel: int, stride: int, key: str = "padding") -> str:
    """PyTorch's symmetric padding as the spec's: 0 is 'valid'; k // 2 at stride 1 with an odd k is 'same'
    (TensorFlow's then pads (k - 1) / 2 on each side too, whatever the input's size); nothing else matches."""
    if padding in ("valid", "same"):
        return padding
    p = _pair(padding, key, "padding")
    if p == 0:
        return "valid"
    if stride == 1 and kernel % 2 == 1 and p == kernel // 2:
        return "same"
    raise Problem(f"{key} {_show(padding)}", f"with kernel {kernel} and stride {stride}: PyTorch pads {p} on every "
                  f"side, the spec's 'same' (TensorFlow's) puts an odd pixel at the bottom/right and 'valid' pads "
                  f"nothing; they agree only for padding 0, or kernel // 2 at stride 1 with an odd kernel")


def _held(module: nn.Module, kind: str, fixed: dict[str, tuple]) -> None:
    """Options held to the values the spec's `kind` has (the first is what to set)."""
    for key, allowed in fixed.items():
        value = getattr(module, key, allowed[0])
        if value not in allowed:
            raise Problem(f"{key} {_show(value)}", f"the spec's {kind} takes only {_show(allowed[0])}")


# ---- modules ------------------------------------------------------------------------------------------------
def _linear(m: nn.Linear, shape: tuple[int, ...]) -> list[dict]:
    if len(shape) == 4:
        raise Problem("input [C, H, W]", "a Linear on an image acts on its last axis (W); the spec's dense takes a "
                      "vector or a sequence: flatten first")
    return [{"type": "dense", "units": m.out_features} | ({} if m.bias is not None else {"use_bias": False})]


def _conv2d(m: nn.Conv2d, shape) -> list[dict]:
    k, s = _pair(m.kernel_size, "kernel_size", "kernel size"), _pair(m.stride, "stride", "stride")
    d = _pair(m.dilation, "dilation", "dilation")
    _held(m, "conv2d", {"padding_mode": ("zeros",)})
    if s > 1 and d > 1:
        raise Problem(f"dilation {_show(m.dilation)}", f"with stride {s}: the spec's conv2d takes a dilation at "
                      f"stride 1 only")
    padding = _window_padding(m.padding, (k - 1) * d + 1, s)
    layer = {"type": "conv2d", "filters": m.out_channels, "kernel_size": k}
    return [layer | ({"strides": s} if s != 1 else {}) | ({"padding": padding} if padding != "valid" else {})
            | ({} if m.bias is not None else {"use_bias": False}) | ({"groups": m.groups} if m.groups != 1 else {})
            | ({"dilation": d} if d != 1 else {})]


def _zero_pad(m: nn.ZeroPad2d, shape) -> list[dict]:
    left, right, top, bottom = m.padding
    if min(m.padding) < 0:
        raise Problem(f"padding {_show(m.padding)}", "crops: the spec's zero_pad2d adds pixels")
    return [{"type": "zero_pad2d", "padding": [top, bottom, left, right]}]


def _rmsnorm(m, shape) -> list[dict]:
    if tuple(m.normalized_shape) != (shape[-1],) or len(shape) == 4:
        raise Problem(f"normalized_shape {_show(tuple(m.normalized_shape))}", "the spec's rmsnorm normalises the last "
                      "axis of a vector or a sequence")
    if m.eps is None:
        raise Problem("eps None", "PyTorch then uses the input dtype's machine epsilon; the spec's rmsnorm takes one "
                      "number")
    if not m.elementwise_affine:
        raise Problem("elementwise_affine False", "the spec's rmsnorm has gamma")
    return [{"type": "rmsnorm", "epsilon": m.eps}]


def _adaptive_max(m, shape) -> list[dict]:
    if m.output_size not in (1, (1, 1), [1, 1]) or m.return_indices:
        raise Problem(f"output_size {_show(m.output_size)}", "the spec's global_maxpool2d is output_size 1 without "
                      "indices")
    return [{"type": "global_maxpool2d"}]


def _pool(m, shape) -> list[dict]:
    k = _pair(m.kernel_size, "kernel_size", "pool size")
    s = k if m.stride is None else _pair(m.stride, "stride", "stride")
    if isinstance(m, nn.MaxPool2d):
        kind = "maxpool2d"
        _held(m, kind, {"dilation": (1, (1, 1)), "ceil_mode": (False,), "return_indices": (False,)})
    else:
        kind = "avgpool2d"
        _held(m, kind, {"ceil_mode": (False,), "divisor_override": (None,)})
    padding = _window_padding(m.padding, k, s)
    if kind == "avgpool2d" and padding == "same" and m.count_include_pad:
        raise Problem("count_include_pad True", f"with padding {_show(m.padding)}: PyTorch divides a border window by "
                      f"k*k; the spec's 'same' average pooling excludes padded pixels (count_include_pad=False)")
    layer = {"type": kind, "pool_size": k}
    return [layer | ({"strides": s} if s != k else {}) | ({"padding": padding} if padding != "valid" else {})]


def _adaptive(m: nn.AdaptiveAvgPool2d, shape) -> list[dict]:
    if m.output_size not in (1, (1, 1), [1, 1]):
        raise Problem(f"output_size {_show(m.output_size)}", "the spec's global_avgpool2d is output_size 1; other "
                      "adaptive pools are not in the spec")
    return [{"type": "global_avgpool2d"}]


def _flatten(m: nn.Flatten, shape) -> list[dict]:
    if (m.start_dim, m.end_dim) not in ((1, -1), (1, len(shape) - 1)):
        raise Problem(f"start_dim {m.start_dim}, end_dim {m.end_dim}", "the spec's flatten keeps the batch axis and "
                      "flattens the rest (start_dim 1, end_dim -1)")
    return [{"type": "flatten"}]


def _softmax_dim(dim, shape) -> list[dict]:
    ndim = len(shape)
    if dim is None:  # torch's legacy implicit dim (torch.nn.functional._get_softmax_dim)
        dim = 0 if ndim in (0, 1, 3) else 1
    if not isinstance(dim, int):
        raise Problem(f"dim {_show(dim)}", "not a constant axis")
    dim = dim % ndim if ndim else dim
    if dim != (1 if ndim == 4 else ndim - 1):
        raise Problem(f"dim {dim}", "the spec's softmax acts on an image's channels (dim 1 of NCHW) or on the last "
                      "axis of a vector or a sequence")
    return [{"type": "softmax"}]


def _gelu(approximate) -> list[dict]:
    if approximate not in ("none", "tanh"):
        raise Problem(f"approximate {_show(approximate)}", "the spec's gelu is 'none' (erf) or 'tanh'")
    return [{"type": "gelu"} | ({"approximate": True} if approximate == "tanh" else {})]


def _batchnorm(m, shape) -> list[dict]:
    if isinstance(m, nn.BatchNorm1d) and len(shape) != 2:
        raise Problem(f"input {list(shape[1:])}", "BatchNorm1d on [N, C, L] normalises C over N and L; the spec's "
                      "batchnorm takes vectors [N, F] (images: BatchNorm2d)")
    if not m.affine:
        raise Problem("affine False", "the spec's batchnorm has gamma and beta")
    if not m.track_running_stats:
        raise Problem("track_running_stats False", "the spec's batchnorm normalises inference with running "
                      "statistics")
    if m.momentum is None:
        raise Problem("momentum None", "a cumulative average; the spec's running statistics are exponential")
    momentum = round(1 - m.momentum, 12)  # PyTorch: running = (1 - m) running + m batch; the spec's m is Keras's
    if not 0 < momentum < 1:
        raise Problem(f"momentum {m.momentum}", "the spec's momentum (1 - PyTorch's) must be strictly between 0 and 1")
    return [{"type": "batchnorm", "momentum": momentum, "epsilon": m.eps}]


def _layernorm(m: nn.LayerNorm, shape) -> list[dict]:
    if len(shape) == 4 or tuple(m.normalized_shape) != (shape[-1],):
        raise Problem(f"normalized_shape {_show(tuple(m.normalized_shape))}", f"on an input {list(shape[1:])}: the "
                      f"spec's layernorm normalises the last axis of a vector or a sequence (images: its channels, "
                      f"which a LayerNorm on NCHW cannot name)")
    if not m.elementwise_affine or getattr(m, "bias", True) is None:
        raise Problem("elementwise_affine False" if not m.elementwise_affine else "bias False",
                      "the spec's layernorm has gamma and beta")
    return [{"type": "layernorm", "epsilon": m.eps}]


def _embedding(m: nn.Embedding, shape) -> list[dict]:
    _held(m, "embedding", {"max_norm": (None,), "scale_grad_by_freq": (False,), "sparse": (False,)})
    return [{"type": "embedding", "dim": m.embedding_dim}]


def embedding_note(importer, where: str, m: nn.Embedding) -> None:
    """padding_idx: the same lookup, but PyTorch never trains that row; a note, not a refusal."""
    if m.padding_idx is not None:
        importer.notes.append(f"{where}: padding_idx {m.padding_idx}: PyTorch's embedding gives that row no gradient "
                              f"(it never trains); the spec's embedding trains every row")


MODULES = {  # module class -> its spec layers (from the module and its input's shape, batch axis included)
    nn.Linear: _linear,
    nn.Conv2d: _conv2d,
    nn.MaxPool2d: _pool,
    nn.AvgPool2d: _pool,
    nn.AdaptiveAvgPool2d: _adaptive,
    nn.Flatten: _flatten,
    nn.ReLU: lambda m, shape: [{"type": "relu"}],
    nn.Sigmoid: lambda m, shape: [{"type": "sigmoid"}],
    nn.Tanh: lambda m, shape: [{"type": "tanh"}],
    nn.GELU: lambda m, shape: _gelu(m.approximate),
    nn.Softmax: lambda m, shape: _softmax_dim(m.dim, shape),
    nn.BatchNorm1d: _batchnorm,
    nn.BatchNorm2d: _batchnorm,
    nn.LayerNorm: _layernorm,
    nn.Dropout: lambda m, shape: [{"type": "dropout", "rate": m.p}],
    nn.Embedding: _embedding,
    nn.Identity: lambda m, shape: [],
    nn.ReLU6: lambda m, shape: [{"type": "relu6"}],
    nn.SiLU: lambda m, shape: [{"type": "silu"}],
    nn.Hardswish: lambda m, shape: [{"type": "hard_swish"}],
    nn.ZeroPad2d: _zero_pad,
    nn.AdaptiveMaxPool2d: _adaptive_max,
}
if hasattr(nn, "RMSNorm"):  # torch 2.4 on
    MODULES[nn.RMSNorm] = _rmsnorm


def module_weights(kind: str, prefix: str, m: nn.Module) -> dict[str, tuple]:
    """Where a module's spec layer finds each canonical weight: (the module's parameter or buffer, its layout, part)
    (importer_export.TorchImported.weights)."""
    names = {"dense": {"kernel": ("weight", "linear"), "bias": ("bias", "plain")},
             "conv2d": {"kernel": ("weight", "conv"), "bias": ("bias", "plain")},
             "batchnorm": {"gamma": ("weight", "plain"), "beta": ("bias", "plain"),
                           "moving_mean": ("running_mean", "plain"), "moving_variance": ("running_var", "plain")},
             "layernorm": {"gamma": ("weight", "plain"), "beta": ("bias", "plain")},
             "rmsnorm": {"gamma": ("weight", "plain")},
             "embedding": {"embeddings": ("weight", "plain")}}.get(kind, {})
    return {param: (prefix + attr, layout, None) for param, (attr, layout) in names.items()
            if getattr(m, attr, None) is not None}
