"""The spec's network as one Gluon HybridBlock holding the core's canonical weights in MXNet layouts, and
TrainingLoss, the network with the spec's loss, which the trainer hybridizes into one graph.

Activations are NCHW (MXNet's CPU convolutions and pooling take no NHWC); sequences are [N, T, D], batch first, as
the spec's. MXNet 1.9 has no fused attention with a softmax: attention is the spec's math in operators, rotary
position embeddings and grouped key/value heads included (the attention builder says where and why).

Under mxnet.contrib.amp, from its lists (contrib/amp/lists/symbol_fp16.py, symbol_bf16.py) and measured by typing
the AMP-patched graph of tiny_gpt, vit_tiny and pitfall_rotary (infer_type: no 16-bit kernel runs on this CPU):
- amp_fp16: FullyConnected (and the patch Convolution) run in float16 (FP16_FUNCS); batch_dot and the additions
  follow their widest input (WIDEST_TYPE_CASTS), so q k^T and its scaling are float16; so is the rotation of q and
  k, whose float32 tables the attention casts to q's dtype first, and the repeat of grouped k and v (take and
  repeat: FP16_FP32_FUNCS, in their input's dtype). The causal mask (a float32 constant) widens the scores to
  float32 before it is added: the masked scores are -inf in float32, never a 16-bit value (without a mask,
  softmax's own cast widens the float16 scores). softmax, log_softmax, LayerNorm, mean, sum, square and exp run in
  float32 (FP32_FUNCS), so the probabilities are float32, and so is their product with the (widened) values;
  rmsnorm is float32 throughout. Embedding runs in its table's dtype (FP16_FP32_FUNCS): float32.
- amp_bf16: only FullyConnected and Convolution run in bfloat16 (BF16_FUNCS); reshape and transpose are
  FP32_FUNCS there, so the heads, their rotation and repeat, both batch_dots, the -inf mask (float32), softmax and
  LayerNorm are all float32.
- merges (typed in pitfall_mobile_graph's graph): an add or multiply of inputs of one shape is `+` or `*`, as the
  residual block's sum (elemwise_add, elemwise_mul: WIDEST_TYPE_CASTS in both lists), a broadcasting one
  broadcast_add (WIDEST) or broadcast_mul (WIDEST; FP32_FUNCS under amp_bf16, so a gate's product is float32 there);
  concat is WIDEST under amp_fp16, and under amp_bf16 the adapter casts its inputs to their widest (concat's builder).
  The imperative variant's `*` is NDArray's broadcast_mul: under amp_bf16 its products of one shape (a multiply's,
  silu's, dropout's) are float32 where the graph's elemwise_mul keeps bfloat16.

In the hybridized graph every node is named after the scopes it was built in ("layer.3/layer.3.layers.0/
convolution0", "part.loss/log_softmax0"; harness.adapter.layer_scope), which a profile reads back (profile.py).
Operators run imperatively are not named.
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator
from dataclasses import dataclass, replace

import mxnet as mx
import numpy as np
from mxnet import gluon

from amp_harness_mxnet.optimizers import loss_ops
from harness.adapter import LOSS_SCOPE, layer_scope
from harness.model.dropout import DropoutMasks
from harness.model.graph import (Graph, Padding, attention_widths, avgpool_divisors, effective_kernel,
                                 window_padding)
from harness.model.layers import LayerBuilders, aligned_shape, run_list
from harness.model.rotary import rotary_tables
from harness.model.training import loss_with
from harness.model.weights import to_channels_first
from harness.numerics import AttentionMask


def _key(name: str) -> str:
    return "p" + name.replace(".", "_")


def _scope(F, scope: str):
    """Name the graph nodes built inside after `scope` (a "/"-joined path); nothing when run imperatively."""
    # mx.name.Prefix replaces the block's own prefix ("spec_"), so each scope carries its outer ones
    return mx.name.Prefix(f"{scope}/") if F is mx.sym else contextlib.nullcontext()


def _pad(F, x, padding, value: float = 0.0):
    """NCHW `x` with the window's explicit padding (where the operators' symmetric `pad` cannot give it)."""
    if not padding.explicit:
        return x
    top, bottom, left, right = padding.explicit
    return F.pad(x, mode="constant", pad_width=(0, 0, 0, 0, top, bottom, left, right), constant_value=value)


def _feature(shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """For a layer of the spec's "last axis" (layernorm, rmsnorm, softmax) on an input of canonical `shape`
    (no batch axis): the axis it acts on, an NCHW image's channels or a vector's or a sequence's last axis, and
    the shape that broadcasts a [C] vector along that axis."""
    return (1, (1, -1, 1, 1)) if len(shape) == 3 else (-1, (1,) * len(shape) + (-1,))


@dataclass
class Run:
    """What one call of the network gives its layers: the symbol or ndarray namespace (F), the weights and
    constants by key, the dropout masks by path, the list collecting float64 batchnorms' batch statistics, the
    probe of layer_outputs (None in training) and the scope the layer is built in."""

    F: object
    params: dict
    masks: dict
    stats: list
    probe: object = None
    scope: str = ""

    def weight(self, path: str, name: str):
        return self.params[_key(f"{path}.{name}")]


# each builder: (LayerInfo, Network) -> a function (x, Run) -> the layer's output (a merge's x: its inputs, a list)
LAYERS = LayerBuilders("mxnet")


def _fully_connected(x, run: Run, path: str, prefix: str, units: int, use_bias: bool):
    """FullyConnected on the last axis, with the layer's weights `prefix`kernel and `prefix`bias."""
    bias = run.weight(path, f"{prefix}bias") if use_bias else None
    return run.F.FullyConnected(x, run.weight(path, f"{prefix}kernel"), bias, num_hidden=units, no_bias=not use_bias,
                                flatten=False)


@LAYERS.builder("dense")
def dense(info, net):
    return lambda x, run: _fully_connected(x, run, info.path, "", info.spec.units, info.spec.use_bias)


@LAYERS.builder("conv2d")
def conv2d(info, net):
    # grouped: MXNet's weight [F, C/g, k, k] is the canonical [k, k, C/g, F] channels first (to_channels_first), its
    # output channel o group o // (F/g), as the spec's
    spec = info.spec
    k, s, d = spec.kernel_size, spec.strides, spec.dilation
    padding = window_padding(info.in_shape, effective_kernel(spec), s, spec.padding)

    def apply(x, run):
        F, bias = run.F, run.weight(info.path, "bias") if spec.use_bias else None
        return F.Convolution(_pad(F, x, padding), run.weight(info.path, "kernel"), bias, kernel=(k, k), stride=(s, s),
                             dilate=(d, d), pad=padding.symmetric, num_filter=spec.filters, num_group=spec.groups,
                             no_bias=not spec.use_bias)

    return apply


@LAYERS.builder("zero_pad2d")
def zero_pad2d(info, net):
    padding = Padding((0, 0), info.spec.pads)
    return lambda x, run: _pad(run.F, x, padding)


@LAYERS.builder("maxpool2d", "avgpool2d")
def pool2d(info, net):
    k, s = info.spec.pool_size, info.spec.strides or info.spec.pool_size
    padding, average = window_padding(info.in_shape, k, s, info.spec.padding), info.type == "avgpool2d"
    if average and padding.explicit:  # each window's sum divided by the core's divisors: the real pixels' count
        net.constant(info.path, "divisors", avgpool_divisors(info.in_shape, k, s, info.spec.padding)[None, None])

    def apply(x, run):
        F = run.F
        if not average:
            return F.Pooling(_pad(F, x, padding, -math.inf), kernel=(k, k), stride=(s, s), pad=padding.symmetric,
                             pool_type="max")
        if padding.explicit:
            sums = F.Pooling(_pad(F, x, padding), kernel=(k, k), stride=(s, s), pool_type="sum")
            return F.broadcast_div(sums, run.weight(info.path, "divisors"))
        return F.Pooling(x, kernel=(k, k), stride=(s, s), pad=padding.symmetric, pool_type="avg",
                         count_include_pad=False)

    return apply


@LAYERS.builder("global_avgpool2d")
def global_avgpool2d(info, net):  # keepdims: [N, C, 1, 1], the canonical [1, 1, C] channels first
    return lambda x, run: run.F.mean(x, axis=(2, 3), keepdims=info.spec.keepdims)


@LAYERS.builder("global_maxpool2d")
def global_maxpool2d(info, net):
    # Gluon's GlobalMaxPool2D: a tie's gradient goes to one pixel, as max pooling's (the max operator's goes, whole,
    # to every tied pixel)
    def apply(x, run):
        pooled = run.F.Pooling(x, global_pool=True, kernel=(1, 1), pool_type="max")
        return pooled if info.spec.keepdims else run.F.reshape(pooled, shape=(0, 0))

    return apply


@LAYERS.builder("rescaling")
def rescaling(info, net):
    """x * scale + offset; a per-channel list as a constant laid out as the input's channels (C, 1, 1 on NCHW)."""
    image = len(info.in_shape) == 3
    factors = {}
    for what in ("scale", "offset"):
        value = getattr(info.spec, what)
        if isinstance(value, list):
            net.constant(info.path, what, np.asarray(value).reshape((-1, 1, 1) if image else (-1,)))
        factors[what] = value

    def apply(x, run):
        F = run.F
        scale, offset = factors["scale"], factors["offset"]
        x = F.broadcast_mul(x, run.weight(info.path, "scale")) if isinstance(scale, list) else x * scale
        return F.broadcast_add(x, run.weight(info.path, "offset")) if isinstance(offset, list) else x + offset

    return apply


@LAYERS.builder("flatten")
def flatten(info, net):
    if len(info.in_shape) == 3 and info.in_shape[2] > 1:  # H, W, C order; with one channel NCHW already is
        return lambda x, run: run.F.flatten(run.F.transpose(x, axes=(0, 2, 3, 1)))
    return lambda x, run: run.F.flatten(x)


@LAYERS.builder("relu", "tanh", "sigmoid")
def activation(info, net):  # the Activation operator has oneDNN kernels; F.relu is ~3x slower
    return lambda x, run: run.F.Activation(x, act_type=info.type)


@LAYERS.builder("relu6")
def relu6(info, net):  # as Gluon's model zoo writes it (MobileNetV2's RELU6)
    return lambda x, run: run.F.clip(x, 0, 6)


@LAYERS.builder("silu")
def silu(info, net):  # Gluon's Swish (beta 1) on the Activation operator's sigmoid
    return lambda x, run: x * run.F.Activation(x, act_type="sigmoid")


@LAYERS.builder("hard_swish")
def hard_swish(info, net):  # hard_sigmoid's slope 1/6 is a float32 attribute: the spec's relu6(x + 3) / 6 instead
    return lambda x, run: x * run.F.clip(x + 3, 0, 6) / 6


@LAYERS.builder("softmax")
def softmax(info, net):
    axis = _feature(info.in_shape)[0]
    return lambda x, run: run.F.softmax(x, axis=axis)


@LAYERS.builder("gelu")
def gelu(info, net):
    def apply(x, run):
        F = run.F
        if info.spec.approximate:
            return 0.5 * x * (1 + F.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
        if net.float64:
            # MXNet's fused gelu is off by ~1e-7 in float64, and erf's backward by ~3e-8: the exact value,
            # with the exact derivative Phi(x) + x*phi(x) attached as a straight-through gradient
            value = 0.5 * x * (1 + F.erf(x / math.sqrt(2)))
            slope = 0.5 * (1 + F.erf(x / math.sqrt(2))) + x * F.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
            return F.BlockGrad(value) + F.BlockGrad(slope) * (x - F.BlockGrad(x))
        return F.LeakyReLU(x, act_type="gelu")  # the erf form

    return apply


@LAYERS.builder("batchnorm")
def batchnorm(info, net):
    spec, names = info.spec, ("gamma", "beta", "moving_mean", "moving_variance")

    def apply(x, run):
        F, weights = run.F, [run.weight(info.path, name) for name in names]
        if run.probe is not None:
            # layer_outputs is the inference network: the running statistics, which MXNet's BatchNorm uses in
            # its backward too only when told to
            return F.BatchNorm(x, *weights, eps=spec.epsilon, fix_gamma=False, axis=1, use_global_stats=True)
        # Gluon's momentum form and biased running variance are the spec's. Momentum is a float32 attribute (0.9 ->
        # 0.8999999762): float64 runs keep the running statistics (momentum 1), updated in float64 by the trainer
        out = F.BatchNorm(x, *weights, eps=spec.epsilon, momentum=1.0 if net.float64 else spec.momentum,
                          fix_gamma=False, axis=1, output_mean_var=net.float64)
        if not net.float64:
            return out
        run.stats += [out[1], out[2]]
        return out[0]

    return apply


@LAYERS.builder("layernorm")
def layernorm(info, net):
    epsilon = info.spec.epsilon
    axis, shape = _feature(info.in_shape)

    def apply(x, run):
        F, gamma, beta = run.F, run.weight(info.path, "gamma"), run.weight(info.path, "beta")
        if net.float64:  # the operator takes epsilon as a float32 attribute
            centred = F.broadcast_sub(x, F.mean(x, axis=axis, keepdims=True))
            norm = F.broadcast_div(centred, F.sqrt(F.mean(F.square(centred), axis=axis, keepdims=True) + epsilon))
            return F.broadcast_add(F.broadcast_mul(norm, F.reshape(gamma, shape=shape)), F.reshape(beta, shape=shape))
        return F.LayerNorm(x, gamma, beta, axis=axis, eps=epsilon)

    return apply


@LAYERS.builder("dropout")
def dropout(info, net):  # the core's mask, pre-divided by 1 - rate; ones in inference
    if info.spec.per_sample:  # [N, 1, 1, 1]: one value per sample
        return lambda x, run: run.F.broadcast_mul(x, run.masks[info.path]) if info.path in run.masks else x
    return lambda x, run: x * run.masks[info.path] if info.path in run.masks else x


@LAYERS.builder("embedding")
def embedding(info, net):
    vocab, dim = info.params["embeddings"]

    def apply(ids, run):  # int32 ids (MXNetTrainer._input)
        return run.F.Embedding(ids, run.weight(info.path, "embeddings"), input_dim=vocab, output_dim=dim,
                               dtype=net.dtype)

    return apply


@LAYERS.builder("position_embedding")
def position_embedding(info, net):
    length = info.in_shape[0]

    def apply(x, run):
        F = run.F
        rows = F.slice_axis(run.weight(info.path, "embeddings"), axis=0, begin=0, end=length)
        return F.broadcast_add(x, F.expand_dims(rows, axis=0))

    return apply


@LAYERS.builder("bias")
def bias(info, net):  # added as position_embedding adds its table: broadcast_add, the dtype AMP's lists give it
    shape = _feature(info.in_shape)[1]
    return lambda x, run: run.F.broadcast_add(x, run.F.reshape(run.weight(info.path, "bias"), shape=shape))


def attention_implementation(info) -> str:
    """What runs an attention layer (the trainer's options["attention"]): MXNet 1.9's contrib
    interleaved_matmul_selfatt_* are the two products alone, on [T, N, 3*D] interleaved projections (and take no
    grouped heads or rotation between the projections and the scores)."""
    spec = info.spec
    return ("unfused: batch_dot, softmax"
            + (f", rotary ({spec.rotary.pairing}): the core's tables, a take of the partners" if spec.rotary else "")
            + (f", {spec.heads // spec.key_heads} query heads per key/value head: k and v repeated"
               if spec.key_heads < spec.heads else "")
            + (", causal: an additive -inf mask" if spec.causal else "")
            + (", attention dropout: the core's masks" if spec.dropout else ""))


def attention_mask(info, precision, device_kind: str) -> AttentionMask:
    """docs/diagnose.md, "Masks in 16 bits": a constant in the weights' dtype (float32 under AMP, whose softmax is
    float32 too: the module docstring) added to the scores; the same on any device (so are AMP's lists)."""
    return AttentionMask(-math.inf, precision.param_dtype, precision.param_dtype)


@LAYERS.builder("attention")
def attention(info, net):
    """The spec's attention in operators: the projections (k and v narrower with grouped heads,
    harness.model.graph.attention_widths), the heads split out as [N*heads, T, Dh], the rotation of q and k, k and v
    repeated up to the query heads, then the scores, the softmax and the heads' products."""
    spec = info.spec
    length, dim = info.in_shape
    heads, head_dim = spec.heads, dim // spec.heads
    widths, group = attention_widths(spec, dim), spec.heads // spec.key_heads  # query heads per key/value head
    root = math.sqrt(head_dim)
    if spec.causal:  # [T, T]: 0 where key j <= query i, -inf where j > i (added to the scores)
        net.constant(info.path, "causal_mask", np.where(np.triu(np.ones((length, length), bool), 1), -np.inf, 0.0))
    if spec.rotary:  # in the weights' dtype, as the spec takes them; the partners as floats, which take accepts
        cos, signed_sin, partner = rotary_tables(length, head_dim, spec.rotary.base, spec.rotary.pairing)
        for name, table in (("rotary_cos", cos), ("rotary_signed_sin", signed_sin), ("rotary_partner", partner)):
            net.constant(info.path, name, table)

    def apply(x, run):
        F = run.F

        def project(name, value):
            return _fully_connected(value, run, info.path, f"{name}_", widths[name], spec.use_bias)

        def split(value):  # [N, T, h*Dh] -> [N*h, T, Dh], head j the columns j*Dh .. (j+1)*Dh-1
            heads_last = F.reshape(value, shape=(0, 0, -4, -1, head_dim))  # [N, T, h, Dh]
            return F.reshape(F.transpose(heads_last, axes=(0, 2, 1, 3)), shape=(-3, 0, 0))

        def rotate(value, cos, signed_sin):  # x*cos + x[partner]*signed_sin, in that order (harness.model.rotary)
            partners = F.take(value, run.weight(info.path, "rotary_partner"), axis=-1)
            return F.broadcast_mul(value, cos) + F.broadcast_mul(partners, signed_sin)

        q, k, v = (split(project(name, x)) for name in ("query", "key", "value"))
        if spec.rotary:
            # after the projections and their biases, before the scores; every head alike ([1, T, Dh] broadcast over
            # N*heads). Under AMP the tables are cast to q's dtype, as Hugging Face casts its float32 tables to the
            # query's: amp_multicast to the narrower of the two gives float16 under amp_fp16 (reshape and transpose
            # keep the projection's float16) and leaves float32 under amp_bf16 (they are float32 functions there).
            # Left float32, the tables would widen the float16 products to float32 (broadcast_mul: WIDEST_TYPE_CASTS)
            tables = [F.expand_dims(run.weight(info.path, f"rotary_{name}"), axis=0) for name in ("cos", "signed_sin")]
            if net.amp:
                tables = [F.amp_multicast(q, table, num_outputs=2, cast_narrow=True)[1] for table in tables]
            q, k = rotate(q, *tables), rotate(k, *tables)
        if group > 1:
            # batch_dot takes no grouped heads: Llama's repeat_kv. Each row n*kv_heads + g of [N*kv_heads, T, Dh]
            # repeated `group` times in place gives row n*heads + h the key/value head g = h // group
            k, v = F.repeat(k, repeats=group, axis=0), F.repeat(v, repeats=group, axis=0)  # [N*heads, T, Dh]
        scores = F.batch_dot(q, k, transpose_b=True) / root  # [N*H, T, T], scaled before the softmax
        if spec.causal:  # 0 where j <= i, -inf where j > i: exp gives exactly 0 there, as the spec's -inf
            scores = F.broadcast_add(scores, F.expand_dims(run.weight(info.path, "causal_mask"), axis=0))
        probs = F.softmax(scores, axis=-1)
        if info.path in run.masks:  # [N, H, T, T], pre-divided by 1 - rate; ones in inference
            probs = probs * F.reshape(run.masks[info.path], shape=(-3, 0, 0))
        merged = F.reshape(F.batch_dot(probs, v), shape=(-4, -1, heads, 0, 0))  # [N, H, T, Dh]
        return project("output", F.reshape(F.transpose(merged, axes=(0, 2, 1, 3)), shape=(0, 0, -3)))

    return apply


@LAYERS.builder("rmsnorm")
def rmsnorm(info, net):
    epsilon = info.spec.epsilon
    axis, shape = _feature(info.in_shape)  # a vector's too, not only tokens'

    def apply(x, run):  # MXNet 1.9 has no RMSNorm operator; written in operators whose scalars are float64
        F = run.F
        norm = F.broadcast_div(x, F.sqrt(F.mean(F.square(x), axis=axis, keepdims=True) + epsilon))
        return F.broadcast_mul(norm, F.reshape(run.weight(info.path, "gamma"), shape=shape))

    return apply


@LAYERS.builder("sequence_pool")
def sequence_pool(info, net):
    mode, length = info.spec.mode, info.in_shape[0]
    if mode == "mean":
        return lambda x, run: run.F.mean(x, axis=1)
    position = 0 if mode == "first" else length - 1
    return lambda x, run: run.F.reshape(run.F.slice_axis(x, axis=1, begin=position, end=position + 1), shape=(0, -1))


@LAYERS.builder("patches")
def patches(info, net):
    size, dim = info.spec.size, info.spec.dim

    def apply(x, run):  # a convolution of kernel and stride P on NCHW, its [N, D, H/P, W/P] rows joined in order
        F = run.F
        grid = F.Convolution(x, run.weight(info.path, "kernel"), run.weight(info.path, "bias"), kernel=(size, size),
                             stride=(size, size), num_filter=dim)
        return F.transpose(F.reshape(grid, shape=(0, 0, -1)), axes=(0, 2, 1))  # [N, H/P * W/P, D]

    return apply


@LAYERS.builder("residual")
def residual(info, net):
    main = net.build(info.spec.layers, f"{info.path}.layers.")
    projection = net.build(info.spec.projection, f"{info.path}.projection.") if info.spec.projection else None

    def apply(x, run):
        inner = replace(run, scope=f"{run.scope}/")
        return net.run(main, x, inner) + (net.run(projection, x, inner) if projection else x)

    return apply


def _aligned(F, x, shape: tuple[int, ...], rank: int):
    """A merge's input of canonical per-sample `shape` laid out to broadcast against its output of `rank` axes
    (aligned_shape): ones before it, and against an image, its last axis moved first as NCHW's channels."""
    if len(shape) == rank:  # an image is NCHW already; vectors and sequences are canonical
        return x
    aligned = aligned_shape(shape, rank)
    if rank < 3:
        return F.reshape(x, shape=(0, *aligned))
    if aligned[:2] == (1, 1):  # a [C] gate: [C, 1, 1], its elements in the same order, no transpose
        return F.reshape(x, shape=(0, aligned[2], 1, 1))
    return F.transpose(F.reshape(x, shape=(0, *aligned)), axes=(0, 3, 1, 2))


@LAYERS.builder("add", "multiply")
def elementwise(info, net):
    # Inputs of one shape: `+` and `*`, as the residual block's sum, a graph's elemwise_add and elemwise_mul; others:
    # the broadcasting operators, as a Gluon user writes a squeeze-and-excite gate. No casts: under AMP each gives
    # the dtype its list says for its inputs (the module docstring).
    rank, add, same = len(info.out_shape), info.type == "add", len(set(info.in_shapes)) == 1

    def apply(values, run):
        F = run.F
        combine = (operator.add if add else operator.mul) if same else F.broadcast_add if add else F.broadcast_mul
        return functools.reduce(combine, (_aligned(F, value, shape, rank)
                                          for value, shape in zip(values, info.in_shapes)))

    return apply


@LAYERS.builder("concat")
def concat(info, net):
    axis = _feature(info.out_shape)[0]  # the canonical last axis: an image's channels, NCHW's axis 1
    # AMP's float16 lists cast Concat's inputs to their widest dtype (WIDEST_TYPE_CASTS), as the sums'; its bfloat16
    # lists leave it uncast (BF16_FP32_FUNCS), and Concat refuses a bfloat16 input beside a float32 one ("Non-uniform
    # data type in Concat"): there the same cast, amp_multicast, is written out
    widest = net.amp == "bfloat16"

    def apply(values, run):
        F = run.F
        return F.concat(*(F.amp_multicast(*values, num_outputs=len(values)) if widest else values), dim=axis)

    return apply


class Network(gluon.HybridBlock):
    """Called as net(x, *masks): the dropout masks (dropout layers' and attention dropout's) in `masked`
    order, each already divided by its 1 - rate (MXNetTrainer.to_device), so that inference can pass ones and get
    dropout's identity.

    Returns the outputs; in a float64 run with batchnorm, (outputs, mean, inv_std, mean, inv_std, ...) with
    each batchnorm's batch statistics in `batchnorm_paths` order (MXNetTrainer updates the running ones)."""

    def __init__(self, spec, graph: Graph, dtype: str, amp: str | None = None):
        super().__init__(prefix="spec_")
        self.spec, self.dtype, self.float64 = spec, dtype, dtype == "float64"
        self.amp = amp  # AMP's 16-bit dtype; None without AMP
        self.infos = {info.path: info for info in graph.layers}
        self.batchnorm_paths = [info.path for info in graph.layers if info.type == "batchnorm"]
        self.masked = DropoutMasks(graph, spec.seed).layers  # (path, rate, shape) of each mask
        self.handles = {}  # canonical weight name -> Parameter
        self.registered = {}  # what hybrid_forward receives as **params: handles and constants, by key
        with self.name_scope():
            for name, shape in graph.param_shapes().items():
                state = name.rsplit(".", 1)[1].startswith("moving_")
                # attributes, because Gluon passes only attribute-registered parameters to hybrid_forward
                self.handles[name] = self._register(_key(name), self.params.get(
                    _key(name), shape=to_channels_first(np.empty(shape), name).shape, dtype=dtype,
                    init=mx.init.Zero(), grad_req="null" if state else "write", differentiable=not state))
            self.layers = self.build(spec.layers, "")  # the builders register the constants they need

    def _register(self, key: str, param):
        setattr(self, key, param)
        self.registered[key] = param
        return param

    def constant(self, path: str, name: str, value: np.ndarray) -> None:
        """A constant of the layer at `path`, which its builder needs in the graph (a Gluon Constant)."""
        key = _key(f"{path}.{name}")
        self._register(key, self.params.get_constant(key, mx.nd.array(value, dtype=self.dtype)))

    def load(self, weights: dict[str, np.ndarray], ctx) -> None:
        for name, param in self.handles.items():
            param.set_data(mx.nd.array(to_channels_first(weights[name], name), ctx=ctx, dtype=param.dtype))

    def build(self, specs, prefix: str) -> list[tuple[object, object]]:
        """(LayerInfo, layer function) of each of `specs`, the layers at `prefix`0, `prefix`1..."""
        infos = [self.infos[f"{prefix}{index}"] for index in range(len(specs))]
        return [(info, LAYERS.build(info, self)) for info in infos]

    def hybrid_forward(self, F, x, *masks, **params):
        stats = []  # float64 runs: each batchnorm's batch (mean, 1/sqrt(var + eps)), in batchnorm_paths order
        out = self.run(self.layers, x, Run(F, params, {path: m for (path, _, _), m in zip(self.masked, masks)}, stats))
        return (out, *stats) if stats else out

    def layer_outputs(self, x, ctx, probe):
        """The network's output, run imperatively in inference mode with `probe(path, output)` applied to
        each layer's output (diagnose mode: the probe records it and returns what the next layer gets)."""
        params = {key: param.data(ctx) for key, param in self.registered.items()}
        return self.run(self.layers, x, Run(mx.nd, params, {}, [], probe))

    @staticmethod
    def run(layers, x, run: Run):
        """The layers applied to x as the spec wires them (run_list), each in its scope (a residual block's inner
        layers in the block's too); the probe's value is what the layers reading the output get."""
        outer = run.scope

        def call(info, layer, value):
            scope = f"{outer}{layer_scope(info.path)}"
            with _scope(run.F, scope):
                out = layer(value, replace(run, scope=scope))
            return out if run.probe is None else run.probe(info.path, out)

        return run_list(layers, x, call)


class TrainingLoss(gluon.HybridBlock):
    """The network and the spec's loss as one block, so that a hybridized training step is one cached graph
    (the loss's operators are not dispatched one by one from Python). Called as block(x, labels, *masks);
    returns the batch-mean loss, or (loss, mean, inv_std, ...) where the network returns statistics."""

    def __init__(self, net: Network, loss, cast_outputs: bool):
        super().__init__(prefix="train_")
        self.loss, self.cast_outputs = loss, cast_outputs
        self.net = net  # a child block: its parameters are the network's own

    def hybrid_forward(self, F, x, labels, *masks):
        outputs = self.net(x, *masks)
        stats = outputs[1:] if isinstance(outputs, (list, tuple)) else ()
        with _scope(F, LOSS_SCOPE):
            loss = loss_with(loss_ops(F, self.cast_outputs), self.loss, outputs[0] if stats else outputs, labels)
        return (loss, *stats) if stats else loss
