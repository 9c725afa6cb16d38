"""Shape inference from the spec alone: each layer's output shape, parameter shapes and forward FLOPs.

Adapters and the weight initialiser both read parameter shapes from here, so there is one source of truth.
Shapes exclude the batch axis; a sequence is [T, D] (token ids [T] before the embedding). FLOPs count
multiply-adds as 2 in dense, conv, patch and attention layers only (attention: the four projections, 8*T*D^2
with every head its own keys and values, less with grouped ones,
and the scores and the probabilities times the values, 4*T^2*D, counted in full even when causal: the
frameworks compute the masked half too); a training step is counted as 3x the forward pass (backward = 2x
forward), elementwise ops and the optimizer excluded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from harness.errors import SpecError
from harness.model.spec import MERGE_TYPES

if TYPE_CHECKING:  # for annotations only
    from harness.model.spec import ModelSpec


@dataclass
class LayerInfo:
    path: str  # canonical name prefix of the layer's weights, e.g. "3" or "5.layers.0"
    type: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # canonical layouts
    flops: int = 0  # forward, per sample
    spec: Any = None  # the spec's layer (its hyper-parameters: a dropout's rate, a pool's size...)
    # where its inputs come from: indices of earlier layers in its own list, -1 for the list's input (a residual
    # block's input, or the network's); a chain's layer takes the one before it, a merge two or more
    sources: tuple[int, ...] = ()
    in_shapes: tuple[tuple[int, ...], ...] = ()  # a merge's inputs' shapes (in_shape is its first's)

    @property
    def param_count(self) -> int:
        """Trainable parameters (batchnorm's moving statistics are state, not parameters)."""
        return sum(math.prod(s) for name, s in self.params.items() if not name.startswith("moving_"))


def _forward_key(path: str) -> tuple:
    parts = [int(p) if p.isdigit() else {"layers": 0, "projection": 1}[p] for p in path.split(".")]
    return (*parts, math.inf)


@dataclass
class Graph:
    layers: list[LayerInfo]  # depth-first, residual blocks followed by their inner layers
    output_shape: tuple[int, ...]
    inputs_known = True  # input_of names each layer's input (a native model's Modules cannot)

    @property
    def param_count(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    @property
    def forward_flops(self) -> int:
        return sum(layer.flops for layer in self.layers)

    def train_step_flops(self, batch_size: int) -> int:
        return 3 * self.forward_flops * batch_size

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {f"{layer.path}.{name}": shape for layer in self.layers for name, shape in layer.params.items()}

    def input_of(self, path: str) -> str | None:
        """The path of the layer whose output is `path`'s (first) input ("5.layers.0" -> block 5's input), or None
        where it is the network's input."""
        head, _, _ = path.rpartition(".")
        source = self.info(path).sources[0]
        if source >= 0:
            return f"{head}.{source}" if head else str(source)
        return self.input_of(head.rpartition(".")[0]) if head else None

    def info(self, path: str) -> LayerInfo:
        if not hasattr(self, "_by_path"):
            self._by_path = {layer.path: layer for layer in self.layers}
        return self._by_path[path]

    @property
    def types(self) -> dict[str, str]:
        """Each layer's type by path."""
        return {layer.path: layer.type for layer in self.layers}

    @staticmethod
    def forward_order(paths) -> list[str]:
        """`paths` in the order the forward pass computes their layers (a residual block after its inner layers)."""
        return sorted(paths, key=_forward_key)

    @staticmethod
    def weight_order(names) -> list[str]:
        """Weight names in their layers' forward order."""
        return sorted(names, key=lambda name: (*_forward_key(name.rsplit(".", 1)[0]), name))

    def trainable_shapes(self) -> dict[str, tuple[int, ...]]:
        """param_shapes without batchnorm's moving statistics (state, not parameters)."""
        return {f"{layer.path}.{name}": shape for layer in self.layers for name, shape in layer.params.items()
                if not name.startswith("moving_")}


DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def state_memory_mb(graph: Graph, optimizer, precision) -> dict[str, float]:
    """What training keeps besides activations, from the graph alone (state_memory_of)."""
    weights = sum(math.prod(shape) for shape in graph.param_shapes().values())
    return state_memory_of(graph.param_count, weights, optimizer, precision)


def state_memory_of(trainable: int, weights: int, optimizer, precision) -> dict[str, float]:
    """What training keeps besides activations, from the counts of the trainable weights and of all the weights
    (batchnorm's moving statistics, a native model's buffers): weights, their gradients and the optimizer's slots,
    all in the weights' dtype (a Precision's param_dtype), and for Kahan-compensated updates a compensation buffer
    per trainable weight. Pure 16-bit training halves the first three; mixed precision keeps them in float32."""
    size = DTYPE_BYTES[precision.param_dtype] / 2**20
    slots = {"adam": 2, "adamw": 2, "rmsprop": 1, "sgd": 1 if getattr(optimizer, "momentum", 0) else 0}[optimizer.type]
    state = {"weights": weights * size, "gradients": trainable * size, "optimizer_state": slots * trainable * size}
    if precision.rounding is not None and precision.rounding.mode == "kahan":
        state["compensation"] = trainable * size
    return state


@dataclass(frozen=True)
class Matmul:
    """One of a training step's 2D matrix products: an m x k matrix times a k x n one, at a layer (`path`) in a
    pass: "forward", "input gradient" (the output's gradient times the weights, transposed) or "weight gradient"
    (the input, transposed, times the output's gradient)."""
    path: str
    type: str
    pass_: str
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


PASSES = ("forward", "input gradient", "weight gradient")


def step_matmuls(graph: Graph, batch_size: int) -> list[Matmul]:
    """The 2D matmuls of a training step at their own shapes: per weighted layer its forward product and the two
    of its backward pass (together 3x the forward's FLOPs, as train_step_flops counts them). A dense layer on a
    sequence multiplies batch x positions rows; a conv2d or patches layer is counted as its im2col product (rows:
    batch x output positions, k: kernel x kernel x input channels), which is the work its kernel does, whatever
    algorithm a framework picks; attention's four projections are (batch x positions) x dim x dim each. Attention's
    scores and probabilities times values are batched products (one per sample and head), not 2D ones, and are
    left out, as are grouped convolutions' products (one per group): step_matmul_share says how much of the step's
    FLOPs the list covers."""
    out = []
    for layer in graph.layers:
        shape, spec = layer.in_shape, layer.spec
        if layer.type == "dense":
            forward = [(batch_size * math.prod(shape[:-1]), shape[-1], spec.units)]
        elif layer.type == "conv2d" and spec.groups == 1:  # grouped: a product per group, left out as attention's
            ho, wo, _ = layer.out_shape
            forward = [(batch_size * ho * wo, spec.kernel_size**2 * shape[-1], spec.filters)]
        elif layer.type == "patches":
            count, dim = layer.out_shape
            forward = [(batch_size * count, spec.size**2 * shape[-1], dim)]
        elif layer.type == "attention":
            length, dim = shape
            forward = [(batch_size * length, dim, width) for width in attention_widths(spec, dim).values()]
        else:
            continue
        for m, k, n in forward:
            out += [Matmul(layer.path, layer.type, "forward", m, k, n),
                    Matmul(layer.path, layer.type, "input gradient", m, n, k),
                    Matmul(layer.path, layer.type, "weight gradient", k, m, n)]
    return out


def step_matmul_share(graph: Graph, batch_size: int) -> float:
    """The share of a training step's FLOPs (train_step_flops) its 2D matmuls (step_matmuls) hold."""
    total = graph.train_step_flops(batch_size)
    return sum(mm.flops for mm in step_matmuls(graph, batch_size)) / total if total else 0.0


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's 'same' padding (before, after): the odd pixel goes after."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def effective_kernel(conv) -> int:
    """A conv2d layer's window in pixels: its kernel's taps `dilation` apart."""
    return (conv.kernel_size - 1) * conv.dilation + 1


def window_output(size: int, kernel: int, stride: int, padding: str) -> int:
    if padding == "same":
        return math.ceil(size / stride)
    return (size - kernel) // stride + 1


@dataclass(frozen=True)
class Padding:
    """The spec's padding of a conv or pool window, for frameworks whose ops pad symmetrically only
    (PyTorch, MXNet): `symmetric` (h, w) goes to the op; when TF's 'same' puts an odd pixel at the
    bottom/right, `symmetric` is (0, 0) and `explicit` (top, bottom, left, right) must be padded first."""

    symmetric: tuple[int, int]
    explicit: tuple[int, int, int, int] | None


def window_padding(in_shape: tuple[int, ...], kernel: int, stride: int, padding: str) -> Padding:
    if padding == "valid":
        return Padding((0, 0), None)
    (top, bottom), (left, right) = (same_padding(n, kernel, stride) for n in in_shape[:2])
    if top == bottom and left == right:
        return Padding((top, left), None)
    return Padding((0, 0), (top, bottom, left, right))


def avgpool_divisors(in_shape: tuple[int, ...], kernel: int, stride: int, padding: str) -> np.ndarray:
    """[Ho, Wo] float64: how many real (unpadded) pixels each average-pooling window covers. The spec's
    'same' average pooling divides each window's sum by this, as TensorFlow does."""
    def counts(size: int) -> np.ndarray:
        before = same_padding(size, kernel, stride)[0] if padding == "same" else 0
        starts = np.arange(window_output(size, kernel, stride, padding)) * stride - before
        return np.minimum(starts + kernel, size) - np.maximum(starts, 0)

    return np.outer(counts(in_shape[0]), counts(in_shape[1])).astype(np.float64)


def infer(spec: ModelSpec, source: str | None = None) -> Graph:
    source = source or spec.name
    if spec.native is not None:  # the commands that take a native model never ask for its graph
        raise SpecError(f"{source}: native: a {spec.native.kind} model's own code has no spec layers, which this "
                        f"command needs; `amp-harness import {spec.native.kind} {spec.native.target} ...` translates "
                        f"it to a spec")
    out: list[LayerInfo] = []
    if spec.tokens and spec.layers[0].type != "embedding":
        raise SpecError(f"{source}: layers[0] ({spec.layers[0].type}): the input is token ids: the first layer must "
                        f"be an embedding")
    shape = _infer_list(spec.layers, tuple(spec.input.shape), "", out, source, spec.input.vocab)
    loss, classes = spec.loss.type, spec.classes
    if spec.dataset.next_token:
        if loss != "sparse_categorical_crossentropy":
            raise SpecError(f"{source}: loss: next-token prediction needs sparse_categorical_crossentropy")
        want, what = (spec.input.shape[0], classes), f"next-token prediction over vocab {classes}"
    else:
        want, what = (1,) if loss == "binary_crossentropy" else (classes,), f"{loss} on {classes} classes"
    if loss == "binary_crossentropy" and classes != 2:
        raise SpecError(f"{source}: loss: binary_crossentropy needs dataset.num_classes 2")
    if shape != want:
        raise SpecError(f"{source}: layers: the network outputs {list(shape)} but {what} needs {list(want)}")
    return Graph(out, shape)


def _infer_list(layers, shape, prefix, out, source, vocab=None, names=None) -> tuple[int, ...]:
    """The list's output shape; its layers' LayerInfos appended to `out`. `names`: the names given so far in the
    whole spec (a name is given once; a layer takes only names of its own list, or `input`)."""
    names = set() if names is None else names
    here = {"input": (-1, shape)}  # this list's named tensors: (index, shape)
    shapes = [shape]  # the list's input, then each layer's output
    for index, layer in enumerate(layers):
        path = f"{prefix}{index}"
        try:
            if layer.type == "embedding" and path != "0":
                raise ValueError("an embedding takes the token ids: it must be the first layer")
            wanted = layer.inputs if layer.type in MERGE_TYPES else [layer.input] if layer.input else None
            unknown = [name for name in wanted or () if name not in here]
            if unknown:
                elsewhere = " (named in another list: a layer takes names of its own list)" if unknown[0] in names \
                    else ""
                raise ValueError(f"no earlier layer of this list is named '{unknown[0]}'{elsewhere}; named here: "
                                 f"{', '.join(here)}")
            sources = tuple(here[name][0] for name in wanted) if wanted else (index - 1,)
            in_shapes = tuple(shapes[s + 1] for s in sources)
            if layer.type in MERGE_TYPES:
                shape = _merged(layer, in_shapes)
                info = LayerInfo(path, layer.type, in_shapes[0], shape, spec=layer, sources=sources,
                                 in_shapes=in_shapes)
                out.append(info)
            else:
                shape = _infer_one(layer, in_shapes[0], path, out, source, vocab, names)
                next(i for i in reversed(out) if i.path == path).sources = sources
            if layer.name is not None:
                if layer.name in names or layer.name == "input":
                    raise ValueError(f"the name '{layer.name}' is given twice (`input` names a list's input)")
                names.add(layer.name)
                here[layer.name] = (index, shape)
            shapes.append(shape)
        except SpecError:
            raise
        except ValueError as exc:
            raise SpecError(f"{source}: layers{display_path(path)} ({layer.type}): {exc}") from None
    return shape


def broadcast_shape(shapes) -> tuple[int, ...]:
    """numpy's broadcast of per-sample shapes (aligned at their last axes), or ValueError naming them."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast (aligned at their "
                         f"last axes)") from None


def _merged(layer, shapes) -> tuple[int, ...]:
    if layer.type == "concat":
        heads = {s[:-1] for s in shapes}
        if len({len(s) for s in shapes}) > 1 or len(heads) > 1:
            raise ValueError(f"concat joins the last axis: the others must agree, got "
                             f"{' and '.join(str(list(s)) for s in shapes)}")
        return (*shapes[0][:-1], sum(s[-1] for s in shapes))
    return broadcast_shape(shapes)


def display_path(path: str) -> str:
    """A canonical layer path as a spec file's place: "5.layers.0" -> "[5].layers[0]"."""
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))


def _infer_one(layer, shape, path, out, source, vocab=None, names=None) -> tuple[int, ...]:
    t = layer.type
    info = LayerInfo(path, t, shape, shape, spec=layer)
    out.append(info)
    if t == "dense":  # on a vector, or on the last axis of a sequence
        if len(shape) == 3:
            raise ValueError(f"expects a vector or a sequence, got an image {list(shape)} (add a flatten)")
        info.params = {"kernel": (shape[-1], layer.units)} | ({"bias": (layer.units,)} if layer.use_bias else {})
        info.flops = 2 * math.prod(shape) * layer.units
        info.out_shape = (*shape[:-1], layer.units)
    elif t == "embedding":
        if vocab is None:
            raise ValueError("takes token ids: give the input a vocab (and a token dataset)")
        info.params = {"embeddings": (vocab, layer.dim)}
        info.out_shape = (shape[0], layer.dim)
    elif t == "position_embedding":
        length, dim = _sequence(shape)
        rows = layer.max_length or length
        if length > rows:
            raise ValueError(f"the sequence has {length} positions but the position table max_length {rows}")
        info.params = {"embeddings": (rows, dim)}
    elif t == "attention":
        length, dim = _sequence(shape)
        if dim % layer.heads:
            raise ValueError(f"heads {layer.heads} do not divide the model dimension {dim}")
        if layer.heads % layer.key_heads:
            raise ValueError(f"kv_heads {layer.key_heads} do not divide the heads {layer.heads}")
        if layer.rotary and (dim // layer.heads) % 2:
            raise ValueError(f"rotary turns pairs of dimensions: the head dimension {dim // layer.heads} is odd")
        widths = attention_widths(layer, dim)
        info.params = {f"{n}_kernel": (dim, width) for n, width in widths.items()}
        if layer.use_bias:
            info.params |= {f"{n}_bias": (width,) for n, width in widths.items()}
        info.flops = 2 * length * dim * sum(widths.values()) + 4 * length * length * dim
    elif t == "bias":
        info.params = {"bias": (shape[-1],)}
    elif t == "rmsnorm":
        info.params = {"gamma": (shape[-1],)}
    elif t == "sequence_pool":
        info.out_shape = (_sequence(shape)[1],)
    elif t == "patches":
        h, w, c = _image(shape)
        p = layer.size
        if h % p or w % p:
            raise ValueError(f"patch size {p} does not divide the image {list(shape)}")
        count = (h // p) * (w // p)
        info.params = {"kernel": (p, p, c, layer.dim), "bias": (layer.dim,)}
        info.flops = 2 * count * p * p * c * layer.dim
        info.out_shape = (count, layer.dim)
    elif t == "conv2d":
        h, w, c = _image(shape)
        k, s, g = layer.kernel_size, layer.strides, layer.groups
        if c % g or layer.filters % g:
            raise ValueError(f"groups {g} must divide the input's channels ({c}) and the filters ({layer.filters})")
        if s > 1 and layer.dilation > 1:
            raise ValueError("strides and dilation both above 1: no framework computes that alike")
        ho, wo = (window_output(n, effective_kernel(layer), s, layer.padding) for n in (h, w))
        if ho < 1 or wo < 1:
            raise ValueError(f"kernel {k} does not fit input {list(shape)}")
        info.params = {"kernel": (k, k, c // g, layer.filters)} | \
            ({"bias": (layer.filters,)} if layer.use_bias else {})
        info.flops = 2 * ho * wo * k * k * (c // g) * layer.filters
        info.out_shape = (ho, wo, layer.filters)
    elif t == "zero_pad2d":
        h, w, c = _image(shape)
        top, bottom, left, right = layer.pads
        info.out_shape = (h + top + bottom, w + left + right, c)
    elif t in ("maxpool2d", "avgpool2d"):
        h, w, c = _image(shape)
        k, s = layer.pool_size, layer.strides or layer.pool_size
        ho, wo = (window_output(n, k, s, layer.padding) for n in (h, w))
        if ho < 1 or wo < 1:
            raise ValueError(f"pool {k} does not fit input {list(shape)}")
        info.out_shape = (ho, wo, c)
    elif t in ("global_avgpool2d", "global_maxpool2d"):
        info.out_shape = (1, 1, _image(shape)[2]) if layer.keepdims else (_image(shape)[2],)
    elif t == "rescaling":
        for what in ("scale", "offset"):
            value = getattr(layer, what)
            if isinstance(value, list) and len(value) not in (1, shape[-1]):
                raise ValueError(f"{what}: {len(value)} values for {shape[-1]} channels (features)")
    elif t == "flatten":
        info.out_shape = (math.prod(shape),)
    elif t in ("batchnorm", "layernorm"):
        if t == "batchnorm" and len(shape) == 2:
            raise ValueError(f"on a sequence {list(shape)}: normalise tokens with layernorm or rmsnorm")
        c = shape[-1]
        names = ("gamma", "beta", "moving_mean", "moving_variance") if t == "batchnorm" else ("gamma", "beta")
        info.params = {name: (c,) for name in names}
    elif t == "residual":
        main = _infer_list(layer.layers, shape, f"{path}.layers.", out, source, names=names)
        shortcut = _infer_list(layer.projection, shape, f"{path}.projection.", out, source, names=names) \
            if layer.projection else shape
        if main != shortcut:
            what = "projection" if layer.projection else "input (add a projection)"
            raise SpecError(f"{source}: layers{display_path(path)} (residual): block output {list(main)} does not "
                            f"match its {what} {list(shortcut)}")
        info.out_shape = main
    return info.out_shape


def attention_widths(spec, dim: int) -> dict[str, int]:
    """An attention layer's projections and their output widths: the key and value projections of grouped heads
    are narrower (kv_heads x the head dimension)."""
    grouped = dim // spec.heads * spec.key_heads
    return {"query": dim, "key": grouped, "value": grouped, "output": dim}


def _image(shape) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ValueError(f"expects an image input [H, W, C], got shape {list(shape)}")
    return shape


def _sequence(shape) -> tuple[int, int]:
    if len(shape) != 2:
        kind = "an image" if len(shape) == 3 else "a vector"
        raise ValueError(f"expects a sequence [T, D], got {kind} {list(shape)}")
    return shape
