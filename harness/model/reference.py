"""A float64 numpy forward pass of a spec: the framework-free reference every adapter's outputs are checked
against. Slow and simple on purpose; it is the executable statement of the spec's math."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from harness.model.graph import avgpool_divisors, effective_kernel, same_padding
from harness.model.rotary import rotary_tables, rotate
from harness.model.spec import MERGE_TYPES, ModelSpec


def forward(spec: ModelSpec, weights: dict[str, np.ndarray], x: np.ndarray, training: bool = False,
            masks: dict[str, np.ndarray] | None = None, layer_outputs: dict | None = None) -> np.ndarray:
    """Outputs for inputs x. training=True uses batch statistics in batchnorm (running stats untouched)
    and applies the dropout `masks` (harness.model.dropout) by layer path. `layer_outputs`, when given, receives
    every layer's output by its canonical path."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    x = x if spec.tokens else x.astype(np.float64)  # token ids stay integers
    return _layers(spec.layers, "", w, x, training, masks or {}, layer_outputs)


def _layers(layers, prefix, w, x, training, masks, record=None):
    named = {"input": x}  # the list's named tensors (harness.model.spec, "named tensors")
    for index, layer in enumerate(layers):
        path = f"{prefix}{index}"
        if layer.type in MERGE_TYPES:
            x = _merge(layer.type, [named[name] for name in layer.inputs])
        else:
            x = _layer(layer, path, w, named[layer.input] if layer.input else x, training, masks, record)
        if layer.name is not None:
            named[layer.name] = x
        if record is not None:
            record[path] = x
    return x


def _merge(kind, values):
    if kind == "concat":
        return np.concatenate(values, axis=-1)
    # per-sample shapes aligned at their last axes: a [N, C] gate against [N, H, W, C] gets two axes after N
    rank = max(v.ndim for v in values)
    values = [v.reshape(v.shape[:1] + (1,) * (rank - v.ndim) + v.shape[1:]) for v in values]
    out = values[0]
    for v in values[1:]:
        out = out + v if kind == "add" else out * v
    return out


def _relu6(x):
    return np.minimum(np.maximum(x, 0), 6)


def _pad(x, kernel, stride, padding, value=0.0):
    if padding == "valid":
        return x
    (t, b), (l, r) = (same_padding(n, kernel, stride) for n in x.shape[1:3])
    return np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)), constant_values=value)


def _windows(x, k, s, d=1):  # [N, Ho, Wo, C, k, k]: taps d pixels apart
    span = (k - 1) * d + 1
    return sliding_window_view(x, (span, span), axis=(1, 2))[:, ::s, ::s, :, ::d, ::d]


def _conv2d(layer, path, w, x):
    k, s, d, g = layer.kernel_size, layer.strides, layer.dilation, layer.groups
    win = _windows(_pad(x, effective_kernel(layer), s, layer.padding), k, s, d)  # [N, Ho, Wo, C, k, k]
    kernel = w[f"{path}.kernel"]  # [k, k, C/g, F]
    n, ho, wo, c = win.shape[:4]
    groups = win.reshape(n, ho, wo, g, c // g, k, k)
    kernels = kernel.reshape(k, k, c // g, g, -1)  # group i's filters: columns i*F/g .. (i+1)*F/g - 1
    out = np.einsum("nhwgcij,ijcgo->nhwgo", groups, kernels).reshape(n, ho, wo, -1)
    return out + w.get(f"{path}.bias", 0.0)


def _layer(layer, path, w, x, training, masks, record):
    t = layer.type
    if t == "dense":
        return x @ w[f"{path}.kernel"] + w.get(f"{path}.bias", 0.0)
    if t == "conv2d":
        return _conv2d(layer, path, w, x)
    if t == "zero_pad2d":
        top, bottom, left, right = layer.pads
        return np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    if t in ("maxpool2d", "avgpool2d"):
        k, s = layer.pool_size, layer.strides or layer.pool_size
        if t == "maxpool2d":
            return _windows(_pad(x, k, s, layer.padding, -np.inf), k, s).max(axis=(-2, -1))
        sums = _windows(_pad(x, k, s, layer.padding), k, s).sum(axis=(-2, -1))
        return sums / avgpool_divisors(x.shape[1:], k, s, layer.padding)[None, :, :, None]
    if t in ("global_avgpool2d", "global_maxpool2d"):
        pool = np.mean if t == "global_avgpool2d" else np.max
        return pool(x, axis=(1, 2), keepdims=layer.keepdims)
    if t == "rescaling":
        return x * np.asarray(layer.scale, np.float64) + np.asarray(layer.offset, np.float64)
    if t == "relu6":
        return _relu6(x)
    if t == "silu":
        return x / (1 + np.exp(-x))
    if t == "hard_swish":
        return x * _relu6(x + 3) / 6
    if t == "flatten":
        return x.reshape(len(x), -1)
    if t == "relu":
        return np.maximum(x, 0)
    if t == "tanh":
        return np.tanh(x)
    if t == "sigmoid":
        return 1 / (1 + np.exp(-x))
    if t == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if t == "gelu":
        if layer.approximate:
            return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
        from scipy.special import erf

        return 0.5 * x * (1 + erf(x / np.sqrt(2)))
    if t == "batchnorm":
        axes = tuple(range(x.ndim - 1))
        mean, var = (x.mean(axes), x.var(axes)) if training else (w[f"{path}.moving_mean"], w[f"{path}.moving_variance"])
        return (x - mean) / np.sqrt(var + layer.epsilon) * w[f"{path}.gamma"] + w[f"{path}.beta"]
    if t == "layernorm":
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + layer.epsilon) * w[f"{path}.gamma"] + w[f"{path}.beta"]
    if t == "dropout":
        if training and layer.rate > 0:
            return x * masks[path] / (1 - layer.rate)
        return x
    if t == "embedding":
        return w[f"{path}.embeddings"][x]
    if t == "position_embedding":
        return x + w[f"{path}.embeddings"][:x.shape[1]]
    if t == "attention":
        return _attention(layer, path, w, x, masks.get(path) if training else None)
    if t == "rmsnorm":
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + layer.epsilon) * w[f"{path}.gamma"]
    if t == "bias":
        return x + w[f"{path}.bias"]
    if t == "sequence_pool":
        return x.mean(axis=1) if layer.mode == "mean" else x[:, 0 if layer.mode == "first" else -1]
    if t == "patches":
        n, h, width, c = x.shape
        p = layer.size
        cut = x.reshape(n, h // p, p, width // p, p, c).transpose(0, 1, 3, 2, 4, 5)  # [N, h, w, P, P, C]
        flat = cut.reshape(n, (h // p) * (width // p), p * p * c)
        return flat @ w[f"{path}.kernel"].reshape(p * p * c, -1) + w[f"{path}.bias"]
    if t == "residual":
        main = _layers(layer.layers, f"{path}.layers.", w, x, training, masks, record)
        shortcut = _layers(layer.projection, f"{path}.projection.", w, x, training, masks, record) \
            if layer.projection else x
        return main + shortcut
    raise AssertionError(f"reference forward has no layer {t!r}")


def _attention(layer, path, w, x, mask):
    """Multi-head self-attention as the spec defines it (harness.model.spec); `mask` [N, H, T, T] in training."""
    return _attention_parts(layer, path, w, x, mask)["out"]


def _attention_parts(layer, path, w, x, mask=None) -> dict[str, np.ndarray]:
    """The attention's intermediate values: q, k, v [N, H, T, Dh], the scaled scores (masked ones -inf), the
    probabilities (after dropout) and the output."""
    n, length, dim = x.shape
    heads = layer.heads
    head_dim = dim // heads

    def project(name, value):
        return value @ w[f"{path}.{name}_kernel"] + w.get(f"{path}.{name}_bias", 0.0)

    def split(value):  # [N, T, heads x Dh] -> [N, heads, T, Dh]
        return value.reshape(n, length, -1, head_dim).transpose(0, 2, 1, 3)

    q, k, v = (split(project(name, x)) for name in ("query", "key", "value"))
    if layer.rotary:
        tables = rotary_tables(length, head_dim, layer.rotary.base, layer.rotary.pairing)
        q, k = rotate(q, *tables), rotate(k, *tables)
    group = heads // layer.key_heads  # query heads per key/value head
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim)
    if layer.causal:
        scores = np.where(causal_mask(length), -np.inf, scores)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    if mask is not None and layer.dropout > 0:
        probs = probs * mask / (1 - layer.dropout)
    heads_out = (probs @ v).transpose(0, 2, 1, 3).reshape(n, length, dim)
    return {"q": q, "k": k, "v": v, "scores": scores, "probs": probs, "out": project("output", heads_out)}


def _geometry(layer) -> tuple[int, int, int, str]:
    """A conv2d's or patches layer's (kernel size, stride, dilation, padding): a patch embedding is a conv2d of
    kernel and stride P."""
    if layer.type == "patches":
        return layer.size, layer.size, 1, "valid"
    return layer.kernel_size, layer.strides, layer.dilation, layer.padding


def windows(layer, x: np.ndarray) -> np.ndarray:
    """A conv2d's or patches layer's input as its product's rows (im2col): [N, Ho, Wo, k*k*C], each window's taps
    in the kernel's (i, j, c) order (c fastest), the padding's zeros included."""
    k, s, d, padding = _geometry(layer)
    win = _windows(_pad(x, (k - 1) * d + 1, s, padding), k, s, d)  # [N, Ho, Wo, C, k, k]
    n, ho, wo, c = win.shape[:4]
    return win.transpose(0, 1, 2, 4, 5, 3).reshape(n, ho, wo, k * k * c)


def fold_windows(layer, rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """windows()'s adjoint (col2im): rows [N, Ho, Wo, k*k*C], each added back to the input pixels its window read;
    the gradient of an input of `shape` [N, H, W, C] from its windows' gradients."""
    k, s, d, padding = _geometry(layer)
    n, h, width, c = shape
    (top, bottom), (left, right) = ((same_padding(size, (k - 1) * d + 1, s) for size in (h, width))
                                    if padding == "same" else ((0, 0), (0, 0)))
    out = np.zeros((n, h + top + bottom, width + left + right, c), rows.dtype)
    ho, wo = rows.shape[1:3]
    taps = rows.reshape(n, ho, wo, k, k, c)
    for i in range(k):
        for j in range(k):
            out[:, i * d:i * d + (ho - 1) * s + 1:s, j * d:j * d + (wo - 1) * s + 1:s] += taps[:, :, :, i, j]
    return out[:, top:top + h, left:left + width]


def matmuls(layer, path, w, x) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A dense, conv2d, patches or attention layer's forward matmuls as {name: (lhs [M, K], rhs [K, N])}, from its
    input `x` and the weights, as the spec defines them (bias and activation left out): a conv2d's is its input's
    windows (im2col, in the kernel's (i, j, c) order) times its kernel; an attention's are its four projections,
    the output projection's input (the heads' outputs) computed in float64 from `x`."""
    t = layer.type
    if t == "dense":
        return {"kernel": (x.reshape(-1, x.shape[-1]), w[f"{path}.kernel"])}
    if t in ("conv2d", "patches"):
        kernel = w[f"{path}.kernel"]  # [k, k, C/g, F]
        g = layer.groups if t == "conv2d" else 1
        if g > 1:  # the groups' products as one, its kernel block-diagonal: the same sums, zeros elsewhere
            k, c, f = kernel.shape[0], x.shape[-1], kernel.shape[-1]
            full = np.zeros((k, k, c, f), kernel.dtype)
            for i in range(g):
                full[:, :, i * c // g:(i + 1) * c // g, i * f // g:(i + 1) * f // g] = \
                    kernel[..., i * f // g:(i + 1) * f // g]
            kernel = full
        lhs = windows(layer, x)
        return {"kernel": (lhs.reshape(-1, lhs.shape[-1]), kernel.reshape(-1, kernel.shape[-1]))}
    if t == "attention":
        x64 = np.asarray(x, np.float64)
        w64 = {name: np.asarray(value, np.float64) for name, value in w.items() if name.startswith(f"{path}.")}
        parts = _attention_parts(layer, path, w64, x64)
        heads = (parts["probs"] @ parts["v"]).transpose(0, 2, 1, 3).reshape(-1, x.shape[-1])
        flat = x.reshape(-1, x.shape[-1])
        return {**{name: (flat, w[f"{path}.{name}_kernel"]) for name in ("query", "key", "value")},
                "output": (heads, w[f"{path}.output_kernel"])}
    raise AssertionError(f"{t!r} has no matmul")


def causal_mask(length: int) -> np.ndarray:
    """[T, T], True where a causal attention masks the score (j > i)."""
    return np.triu(np.ones((length, length), bool), 1)


def attention_numerics(layer, path, w, x, out_grad) -> dict[str, np.ndarray]:
    """Inference-mode attention's values that 16-bit formats must hold, in float64 from the layer's input `x`
    [N, T, D], the weights and the loss's gradient with respect to the layer's output `out_grad`: q and k, the
    scaled scores the softmax takes and the loss's gradient with respect to them (masked entries left out: they
    are -inf by definition, and their gradient is 0)."""
    x, out_grad = np.asarray(x, np.float64), np.asarray(out_grad, np.float64)
    w = {name: np.asarray(value, np.float64) for name, value in w.items() if name.startswith(f"{path}.")}
    parts = _attention_parts(layer, path, w, x)
    n, length, dim = x.shape
    head_dim = dim // layer.heads
    # back through the output projection and the heads' concatenation, then p @ v and the softmax
    d_heads = (out_grad @ w[f"{path}.output_kernel"].T).reshape(n, length, layer.heads, head_dim).transpose(0, 2, 1, 3)
    d_probs = d_heads @ parts["v"].transpose(0, 1, 3, 2)
    probs = parts["probs"]
    d_scores = probs * (d_probs - (d_probs * probs).sum(axis=-1, keepdims=True))
    kept = ~causal_mask(length) if layer.causal else np.ones((length, length), bool)
    return {"q": parts["q"], "k": parts["k"], "scores": parts["scores"][..., kept],
            "score_gradients": d_scores[..., kept]}
