"""The spec's network as a Keras 3 functional model (channels-last), holding the core's canonical weights.

Keras' own layouts are the canonical ones (NHWC activations, [kH, kW, in/groups, out] and [in, out] kernels, H, W,
C flatten order, sequences [N, T, D], embedding tables [rows, D]) and its 'same' padding is the spec's, so weights
load without conversion. Token ids stay int64 from the input to Keras' Embedding (ops.take on the float32 table).

Under the mixed policies (measured from the traced graphs, Keras 3.15 on TensorFlow 2.21; the layers compute in
the policy's float16/bfloat16, with float32 variables cast on read, unless said; attention: SelfAttention):
- keras.layers.Softmax (the spec's softmax) runs in the compute dtype: float16 / bfloat16 in and out.
- LayerNormalization (autocast off) and ops.rms_normalization (the spec's rmsnorm) compute in float32 (moments,
  rsqrt) and return the compute dtype; rmsnorm's gamma is read cast to the compute dtype first, layernorm's is not.
- the embedding gathers from the float32 table and casts the rows to the compute dtype; the loss is float32.

FP8 (a precision with an fp8 policy, harness.fp8): the dense, conv2d, patches and attention projection layers
multiply by Fp8Casts.product, the bias added after, as the torch adapter does. The block-scaled precisions
(harness.microscaling.BlockRecipe): the dense layers and the attention projections multiply by block_product, the
conv2d and patches layers by block_conv2d (the product of their windows), the bias added after; everything else
runs in float32 as in fp32 runs.
"""
from __future__ import annotations

import math
from functools import partial

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from amp_harness_tensorflow.rounding import OPS, draw_bits
from harness.adapter import layer_scope
from harness.fp8 import ROLES, Fp8Policy, fake_quantize_with, recipe_amax_with
from harness.microscaling import BlockRecipe, block_gradient_operands_with, block_operands_with
from harness.model.dropout import DropoutMasks
from harness.model.graph import Graph, same_padding
from harness.model.layers import LayerBuilders, run_list
from harness.model.rotary import rotary_tables
from harness.numerics import AttentionMask

LAYERS = LayerBuilders("tensorflow")  # each builder: (LayerInfo, Network) -> a Keras layer


class CanonicalLayer(keras.layers.Layer):
    """A layer of this adapter's own, built from its LayerInfo: named by its scope, keeping the spec's layer (`spec`),
    its canonical weights attributes of their names (`query_kernel`, `embeddings`...) created holding them."""

    def __init__(self, info, net, **kwargs):
        super().__init__(name=layer_scope(info.path), **kwargs)
        self.spec = info.spec
        for param, shape in info.params.items():
            setattr(self, param, self.add_weight(name=param, shape=shape,
                                                 initializer=_given(net.weights, f"{info.path}.{param}")))


@LAYERS.builder("gelu")
class GELU(CanonicalLayer):
    """GELU with its constants in the compute dtype: Keras' (tf.nn.gelu) rounds them to float32 first,
    which an fp64 run must not."""

    def call(self, x):
        c = lambda v: ops.convert_to_tensor(v, dtype=x.dtype)  # noqa: E731
        if self.spec.approximate:
            inner = c(math.sqrt(2 / math.pi)) * (x + c(0.044715) * x * x * x)
            return c(0.5) * x * (c(1.0) + ops.tanh(inner))
        return c(0.5) * x * (c(1.0) + ops.erf(x / c(math.sqrt(2.0))))


def _dropped(x, mask, rate: float):
    """x * mask / (1 - rate): the core's dropout, its constant in x's dtype."""
    return x * ops.cast(mask, x.dtype) / ops.convert_to_tensor(1 - rate, dtype=x.dtype)


@LAYERS.builder("dropout")
class MaskedDropout(CanonicalLayer):
    """Dropout with the core's mask (harness.model.dropout), a second input of the training model: called as
    layer(x, mask), _apply passing the mask."""

    def call(self, x, mask):
        return _dropped(x, mask, self.spec.rate)


@LAYERS.builder("position_embedding")
class PositionEmbedding(CanonicalLayer):
    def call(self, x):  # the table's first T rows, autocast to the compute dtype by the policy
        return x + self.embeddings[:x.shape[1]]


@LAYERS.builder("bias")
class Bias(CanonicalLayer):
    def call(self, x):  # the vector autocast to the compute dtype by the policy, as position_embedding's table
        return x + self.bias


@LAYERS.builder("rmsnorm")
class RMSNorm(CanonicalLayer):
    def call(self, x):  # Keras' own op: x * rsqrt(mean(x^2) + epsilon) * scale, in at least float32
        return ops.rms_normalization(x, scale=self.gamma, axis=-1, epsilon=self.spec.epsilon)


@LAYERS.builder("sequence_pool")
class SequencePool(CanonicalLayer):
    def call(self, x):
        if self.spec.mode == "mean":
            return ops.mean(x, axis=1)
        return x[:, 0] if self.spec.mode == "first" else x[:, -1]


class Fp8Casts:
    """One matmul's FP8 casts by the core's rule (fake_quantize_with over rounding.OPS, the amax by the recipe:
    recipe_amax_with): its input and kernel on the way forward, its output's gradient on the way back (custom
    gradients: the forward casts pass their gradient through); under the delayed recipe each keeps its amax history
    in a variable, assigned in training only (in the backward pass for the gradient's: the step's tf.function runs
    the assignment with the gradient it belongs to)."""

    def __init__(self, policy: Fp8Policy):
        self.policy, n = policy, policy.recipe.history
        self.histories = {role: tf.Variable(tf.zeros([n]), trainable=False, name=f"fp8_{role}_amax_history")
                          for role in ROLES} if n else {}

    def cast(self, x, role: str, training):
        amax, history = recipe_amax_with(OPS, x, self.histories.get(role))
        if history is not None and training:
            self.histories[role].assign(history)
        return fake_quantize_with(OPS, x, amax, self.policy.format(role))

    def product(self, product, x, kernel, training=None):
        """product(x, kernel) of FP8's casts."""
        def cast_input(v, role):
            @tf.custom_gradient
            def cast(v):
                return self.cast(v, role, training), lambda grad: grad
            return cast(v)

        @tf.custom_gradient
        def cast_gradient(v):
            return tf.identity(v), lambda grad: self.cast(grad, "output_gradient", True)

        return cast_gradient(product(cast_input(x, "input"), cast_input(kernel, "weight")))


class BlockNoise:
    """The bits of a stochastic recipe's gradient casts (BlockRecipe.stochastic): two fresh tensors of dy's shape
    per product, drawn in the backward from one tf.random.Generator of the run's seed (harness.rounding.device_seed)
    for the network's products, on the device, as the rounded optimizer draws its own; `given` (the kit's) in their
    place. Created outside the step's tf.function (the generator's state is a variable the step reads and moves)."""

    def __init__(self, seed: int | None, given=None):
        self.given = given
        self.generator = tf.random.Generator.from_seed(seed) if given is None else None

    def __call__(self, dy):
        if self.given is not None:
            return self.given
        return draw_bits(tf.shape(dy), self.generator), draw_bits(tf.shape(dy), self.generator)


def block_matmul(x, w, recipe: BlockRecipe, noise: BlockNoise | None = None):
    """y = x @ w, x [M, K] (the rows: samples x positions) and w [K, N] float32, under a block-scaled recipe: the
    core's rule (BlockRecipe's docstring) on rounding.OPS, each of the three products multiplying its operands
    quantized along the axis it sums over, in float32. A custom gradient, since the backward's products take x, w
    and dy quantized anew along their other axes, not the forward's operands; the gradients are float32 matmuls of
    block_gradient_operands_with's (a square weight tile gives dx the forward's quantized w); `noise` a stochastic
    recipe's bits, drawn in the backward (the generator is read there only, so custom_gradient sees no variable)."""
    @tf.custom_gradient
    def product(x, w):
        qx, qw = block_operands_with(OPS, x, w, recipe)

        def backward(dy):
            bits = noise(dy) if recipe.stochastic else None
            dy_n, w_n, x_m, dy_m = block_gradient_operands_with(OPS, x, w, dy, recipe, qw, bits)
            return tf.matmul(dy_n, w_n, transpose_b=True), tf.matmul(x_m, dy_m, transpose_a=True)
        return tf.matmul(qx, qw), backward
    # a kernel variable read here, outside: eagerly, custom_gradient would see Keras' variable read inside it and
    # want the gradient of its tf.Variable as a `variables` argument; the read's own gradient takes dw to it
    return product(tf.convert_to_tensor(x), tf.convert_to_tensor(w))


def block_product(x, kernel, recipe: BlockRecipe, noise: BlockNoise | None = None):
    """x [..., K] @ kernel [K, N] by block_matmul: x's leading axes flattened into the rows (a sequence's rows are
    its samples x positions, so an MX block along M spans positions and samples), the result shaped back to
    [..., N]. The dense layers', the attention projections' and Adapter.block_linear's product; `noise`
    block_matmul's."""
    rows = tf.reshape(x, [-1, x.shape[-1]])
    y = block_matmul(rows, kernel, recipe, noise)
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], tf.shape(y)[-1:]], 0))


def windows(x, k: int, stride: int, dilation: int, pads):
    """A convolution's input x [N, H, W, C] as its product's rows (im2col): [N, Ho, Wo, k*k*C], each window's taps in
    the kernel's (i, j, c) order, c fastest, the padding's zeros included (harness.model.reference.windows), `pads`
    ((top, bottom), (left, right)). Built from explicit zeros and k*k strided slices, one per tap: exact, and each
    slice's gradient puts its rows back on the pixels it read (a pad), so the windows' gradient is their fold
    (col2im), summed in a fixed order, in graph mode and under XLA alike. tf.image.extract_patches gives the same
    order and compiles, but its gradient is a scatter-add (unsorted_segment_sum over the patches of an index image),
    whose order of additions a GPU does not fix, and under XLA its forward is a convolution with a one-hot kernel."""
    x = tf.pad(x, [[0, 0], *pads, [0, 0]])
    h, w = x.shape[1] - (k - 1) * dilation, x.shape[2] - (k - 1) * dilation  # the first tap's span
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    taps = [x[:, i * dilation:i * dilation + (ho - 1) * stride + 1:stride,
              j * dilation:j * dilation + (wo - 1) * stride + 1:stride] for i in range(k) for j in range(k)]
    return tf.reshape(tf.stack(taps, axis=3), [-1, ho, wo, k * k * x.shape[3]])  # [N, Ho, Wo, k*k, C] flattened


def block_conv2d(x, kernel, recipe: BlockRecipe, stride: int, pads, dilation: int,
                 noise: BlockNoise | None = None):
    """A convolution of x [N, H, W, C] and kernel [k, k, C, F] (groups 1) without its bias under a block-scaled
    recipe: the core's rule (harness.microscaling.block_conv2d) multiplies the windows (rows [N*Ho*Wo, k*k*C], taps
    in (i, j, c) order) by the kernel as [k*k*C, F], as a dense layer's rows (block_product: an MX block along M
    spans the output pixels of the batch); [N, Ho, Wo, F]. Its pads are explicit ((top, bottom), (left, right):
    TensorFlow's 'same' puts the odd pixel after, as the spec does)."""
    k = kernel.shape[0]
    return block_product(windows(x, k, stride, dilation, pads), tf.reshape(kernel, [-1, kernel.shape[-1]]), recipe,
                         noise)


class _Fp8Product:
    """A Keras Dense or Conv2D whose product (`product`) is FP8's under an FP8 policy (`fp8`; Fp8Casts.product), or
    the block-scaled one under a block recipe (`blocks`; `blocked`: a Dense's block_product, a Conv2D's
    block_conv2d), the bias added after (its gradient dy's sum, uncast); Keras' own call without either."""

    def __init__(self, *args, fp8=None, blocks=None, noise=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8 = Fp8Casts(fp8) if fp8 else None
        self.blocks, self.noise = blocks, noise  # noise: a stochastic recipe's bits (BlockNoise), else None

    def call(self, x, training=None):
        if self.blocks is not None:
            y = self.blocked(x, self.kernel, self.blocks, self.noise)
        elif self.fp8 is not None:
            y = self.fp8.product(self.product, x, self.kernel, training)
        else:
            return super().call(x)
        return y + self.bias if self.use_bias else y


class Fp8Dense(_Fp8Product, keras.layers.Dense):
    product = staticmethod(tf.matmul)
    blocked = staticmethod(block_product)


class Fp8Conv2D(_Fp8Product, keras.layers.Conv2D):
    product = keras.layers.Conv2D.convolution_op

    def blocked(self, x, kernel, recipe, noise=None):
        """block_conv2d with this layer's geometry (groups 1: the core refuses a grouped one under a block recipe)."""
        (k, _), (stride, _), (dilation, _) = self.kernel_size, self.strides, self.dilation_rate
        pads = [same_padding(n, (k - 1) * dilation + 1, stride) if self.padding == "same" else (0, 0)
                for n in x.shape[1:3]]
        return block_conv2d(x, kernel, recipe, stride, pads, dilation, noise)


class Patches(Fp8Conv2D):
    """The spec's patch embedding: a conv2d of kernel and stride P ('valid'), whose [N, H/P, W/P, D] output read
    in row-major order is the [N, H/P * W/P, D] sequence (Keras' kernel [P, P, C, D] is the canonical one)."""

    def call(self, x, training=None):
        out = super().call(x, training)
        return ops.reshape(out, (-1, out.shape[1] * out.shape[2], out.shape[3]))

    def compute_output_shape(self, input_shape):
        n, h, w, d = super().compute_output_shape(input_shape)
        return (n, h * w, d)


FUSED = "keras.ops.dot_product_attention"
UNFUSED = "unfused (attention dropout: the core's masks)"
# Keras' _get_large_negative for scores that are not float16: -0.7 * 3.38953e38 (bfloat16's largest value), here
# in float32 (keras/src/backend/tensorflow/nn.py, Keras 3.15)
KERAS_LARGE_NEGATIVE = float(np.float32(-0.7 * 3.38953e38))


def attention_implementation(spec) -> str:
    """Which attention an attention layer runs: Keras' fused op without dropout, the unfused math with it."""
    return UNFUSED if spec.dropout > 0 else FUSED


def attention_mask(info, precision, device_kind: str) -> AttentionMask:
    """What a causal attention layer's mask leaves in the scores it masks (measured, docs/diagnose.md "Masks in 16
    bits"; SelfAttention says where from), the same on any device (Keras' TensorFlow backend has one path)."""
    compute = precision.compute_dtype
    if attention_implementation(info.spec) == FUSED:
        wide = "float64" if compute == "float64" else "float32"
        return AttentionMask(-0.7 * 3.38953e38 if wide == "float64" else KERAS_LARGE_NEGATIVE, wide, wide)
    return AttentionMask(-math.inf, compute, compute)


PROJECTIONS = ("query", "key", "value", "output")


@LAYERS.builder("attention")
class SelfAttention(CanonicalLayer):
    """The spec's multi-head self-attention from the canonical kernels (harness.model.spec: query and output [D, D],
    key and value [D, kv_heads*Dh]). Before either path below, q, k and v are split into heads [N, T, heads, Dh],
    q and k rotated when the spec has rotary (_rotate: after the projections and their biases, before the scores),
    and each key/value head repeated for its group of query heads (Llama's repeat_kv: kv head g serves query heads
    g*group .. (g+1)*group-1): Keras 3.15's fused op repeats grouped heads itself but not a single one
    (multi-query), which its einsum then rejects, and the unfused path's einsums need equal heads. The attention
    then switches as keras.layers.MultiHeadAttention does (measured under the mixed policies, Keras 3.15 on
    TensorFlow 2.21):
    - without dropout, Keras' fused ops.dot_product_attention (on TensorFlow an einsum, the scale, a tf.where mask
      and a softmax): q k^T in the compute dtype, then the scale, the causal mask (KERAS_LARGE_NEGATIVE, never
      -inf; -0.7 * 65500 only for float16 scores, which this path never has) and the softmax on the scores cast to
      result_type(compute dtype, float32), float32 (float64 in fp64 runs); p v in the compute dtype. The scale goes
      in as a tensor of that dtype: the op casts a Python float through float32 (inexact in fp64).
    - with dropout, which the fused op would draw itself, the same math in keras.ops in the compute dtype with the
      core's mask [N, H, T, T] (a second input in training: called as layer(x, mask)): scores scaled, -inf where
      j > i when causal, softmax over keys, p * mask / (1 - rate), as MultiHeadAttention's explicit path does with
      its Softmax layer (which masks with -3e4 in float16, -1e9 else: -9.98e8 once rounded to bfloat16)."""

    def __init__(self, info, net, **kwargs):
        super().__init__(info, net, **kwargs)
        self.implementation = attention_implementation(info.spec)
        self.fp8 = {name: Fp8Casts(net.fp8) for name in PROJECTIONS} if net.fp8 else None
        self.blocks, self.noise = net.blocks, net.block_noise  # a block-scaled precision's recipe (and :sr's bits)
        self.group = info.spec.heads // info.spec.key_heads  # query heads per key/value head

    def _project(self, x, name: str, training):
        kernel = getattr(self, f"{name}_kernel")
        if self.blocks is not None:
            out = block_product(x, kernel, self.blocks, self.noise)
        elif self.fp8 is not None:
            out = self.fp8[name].product(tf.matmul, x, kernel, training)
        else:
            out = ops.matmul(x, kernel)
        return out + getattr(self, f"{name}_bias") if self.spec.use_bias else out

    def _rotate(self, q, k):
        """q and k [N, T, heads, Dh] rotated (harness.model.rotary): x * cos + x[..., partner] * signed_sin, in that
        order. The tables are constants in the parameter dtype (the variables': float32, float64 in fp64 runs), cast
        to q's dtype (the compute dtype under mixed precision), as Hugging Face casts its float32 tables."""
        length, head_dim = q.shape[1], q.shape[3]
        cos, signed_sin, partner = rotary_tables(length, head_dim, self.spec.rotary.base, self.spec.rotary.pairing)
        cos, signed_sin = (ops.cast(ops.convert_to_tensor(table.astype(self.variable_dtype)[:, None, :]), q.dtype)
                           for table in (cos, signed_sin))  # [T, 1, Dh]: the same angles for every head

        def rotate(x):
            return x * cos + ops.take(x, partner, axis=-1) * signed_sin
        return rotate(q), rotate(k)

    def call(self, x, mask=None, training=None):
        length, dim = x.shape[1], x.shape[2]
        head_dim = dim // self.spec.heads
        # [N, T, heads, Dh]: head h is columns h*Dh .. (h+1)*Dh-1 (k and v: kv_heads of them)
        counts = {"query": self.spec.heads, "key": self.spec.key_heads, "value": self.spec.key_heads}
        q, k, v = (ops.reshape(self._project(x, name, training), (-1, length, n, head_dim))
                   for name, n in counts.items())
        if self.spec.rotary:
            q, k = self._rotate(q, k)
        if self.group > 1:  # each key/value head repeated for its group (repeat_kv), not the heads tiled
            k, v = ops.repeat(k, self.group, axis=2), ops.repeat(v, self.group, axis=2)
        scale = 1 / math.sqrt(head_dim)
        if self.implementation == FUSED:
            scale = ops.convert_to_tensor(scale, dtype=keras.backend.result_type(x.dtype, "float32"))
            heads = ops.dot_product_attention(q, k, v, scale=scale, is_causal=self.spec.causal)
        else:
            scores = ops.einsum("btnh,bsnh->bnts", q, k) * ops.convert_to_tensor(scale, dtype=x.dtype)
            if self.spec.causal:  # j > i: above the diagonal
                above = ops.triu(ops.ones((length, length), dtype="bool"), k=1)
                scores = ops.where(above, ops.convert_to_tensor(-math.inf, dtype=x.dtype), scores)
            probs = ops.softmax(scores, axis=-1)
            if mask is not None:
                probs = _dropped(probs, mask, self.spec.dropout)
            heads = ops.einsum("bnts,bsnh->btnh", probs, v)
        return self._project(ops.reshape(heads, (-1, length, dim)), "output", training)

    def compute_output_shape(self, input_shape):
        """The input's [N, T, D]: said, so that Keras' functional model does not trace call with an unknown batch
        to infer it (the block-scaled quantizer blocks the rows, so it needs their number)."""
        return input_shape


def _given(weights: dict[str, np.ndarray], name: str):
    """An initialiser returning the core's canonical weight: the variable is created holding it, with no random tensor
    drawn first only to be overwritten (a build-time temporary that would sit in the process's memory figure)."""
    return lambda shape, dtype=None: weights[name].astype(dtype, copy=False)


def _named(info, net) -> dict:
    """A layer's name and weight initialisers. The name is its name scope in the graph, which is how a profile
    finds a layer's ops (weights are mapped by variable, not by name)."""
    return {"name": layer_scope(info.path)} | {f"{param}_initializer": _given(net.weights, f"{info.path}.{param}")
                                               for param in info.params}


@LAYERS.builder("dense", "conv2d", "patches")
def matmul_layer(info, net):  # FP8's product under an FP8 policy, the block-scaled one under a recipe
    spec, named = info.spec, {"fp8": net.fp8, "blocks": net.blocks, "noise": net.block_noise, **_named(info, net)}
    if info.type == "dense":
        return Fp8Dense(spec.units, use_bias=spec.use_bias, **named)
    if info.type == "patches":
        return Patches(spec.dim, spec.size, strides=spec.size, padding="valid", **named)
    # Conv2D's grouped kernel [k, k, C/groups, F] is the canonical one, output channel o in group o // (F/groups)
    # (depthwise: groups = C; DepthwiseConv2D's [k, k, C, multiplier] would need converting both ways). Keras'
    # TensorFlow backend runs a grouped convolution as an XLA-compiled function, on every device and in every
    # variant (TensorFlow's CPU kernels have no float64 gradient for it; profile.py attributes its time). TF's 'same'
    # pads for the dilated window, as the spec does.
    return Fp8Conv2D(spec.filters, spec.kernel_size, strides=spec.strides, padding=spec.padding,
                     use_bias=spec.use_bias, groups=spec.groups, dilation_rate=spec.dilation, **named)


@LAYERS.builder("maxpool2d", "avgpool2d")
def pool2d(info, net):  # TF's 'same' average pooling excludes padded pixels, as the spec says
    spec = info.spec
    pool = keras.layers.MaxPooling2D if info.type == "maxpool2d" else keras.layers.AveragePooling2D
    return pool(spec.pool_size, strides=spec.strides, padding=spec.padding, **_named(info, net))


# the Keras layers built from fixed arguments and their name. Merges are called on the list of their inputs, residual's
# Add as layer([main, shortcut]) (_apply runs the block's branches). Keras' Add and Multiply align inputs of lower
# rank at their last axes (expand_dims after the batch axis: a [N, C] gate against [N, H, W, C] is [N, 1, 1, C]),
# numpy's broadcasting per sample as the spec says; like every layer they cast float inputs to the policy's
# compute dtype. Keras' activation names: "silu" is x * sigmoid(x) (tf.nn.silu), "hard_swish" Keras' hard_silu,
# x * relu6(x + 3) / 6.
FIXED = {"flatten": keras.layers.Flatten, "residual": keras.layers.Add, "add": keras.layers.Add,
         "multiply": keras.layers.Multiply, "concat": partial(keras.layers.Concatenate, axis=-1),
         "softmax": partial(keras.layers.Softmax, axis=-1),
         **{name: partial(keras.layers.Activation, name)
            for name in ("relu", "relu6", "silu", "hard_swish", "tanh", "sigmoid")}}


@LAYERS.builder(*FIXED)
def fixed(info, net):
    return FIXED[info.type](**_named(info, net))


@LAYERS.builder("global_avgpool2d", "global_maxpool2d")
def global_pool2d(info, net):
    pool = keras.layers.GlobalAveragePooling2D if info.type == "global_avgpool2d" else keras.layers.GlobalMaxPooling2D
    return pool(keepdims=info.spec.keepdims, **_named(info, net))


@LAYERS.builder("rescaling")
def rescaling(info, net):  # Keras' own: in the policy's compute dtype, a list broadcast on the last axis
    return keras.layers.Rescaling(info.spec.scale, info.spec.offset, **_named(info, net))


@LAYERS.builder("zero_pad2d")
def zero_pad2d(info, net):
    top, bottom, left, right = info.spec.pads
    return keras.layers.ZeroPadding2D(((top, bottom), (left, right)), **_named(info, net))


@LAYERS.builder("batchnorm")
def batchnorm(info, net):  # Keras' momentum form and biased batch variance are the spec's
    return keras.layers.BatchNormalization(momentum=info.spec.momentum, epsilon=info.spec.epsilon,
                                           **_named(info, net))


@LAYERS.builder("layernorm")
def layernorm(info, net):
    return keras.layers.LayerNormalization(axis=-1, epsilon=info.spec.epsilon, **_named(info, net))


@LAYERS.builder("embedding")
def embedding(info, net):  # the ids stay integer: Keras' own lookup (ops.take), its output in the compute dtype
    vocab, dim = info.params["embeddings"]
    return keras.layers.Embedding(vocab, dim, **_named(info, net))


def _lists(graph: Graph, layers: dict) -> dict[str, list]:
    """Each list's (LayerInfo, Keras layer) pairs in order, by its paths' prefix: "" the network's, "5.layers." and
    "5.projection." block 5's (graph.layers is depth-first, each list in its order)."""
    lists: dict[str, list] = {}
    for info in graph.layers:
        head, dot, _ = info.path.rpartition(".")
        lists.setdefault(head + dot, []).append((info, layers[info.path]))
    return lists


def _apply(lists: dict, prefix: str, x, masks: dict | None, record: dict | None = None):
    """The list at `prefix` applied to x as the spec wires it (run_list: named tensors, merges on lists);
    `masks` (symbolic inputs by path) in the training graph, None in inference. With `record`, each layer's output
    is kept there by path (diagnose mode, run eagerly)."""
    def call(info, layer, value):
        if info.type == "residual":
            main = _apply(lists, f"{info.path}.layers.", value, masks, record)
            shortcut = _apply(lists, f"{info.path}.projection.", value, masks, record) \
                if info.spec.projection else value
            value = layer([main, shortcut])
        elif masks is not None and info.path in masks:  # a dropout's (or attention dropout's) mask, in training
            value = layer(value, masks[info.path])
        elif info.type != "dropout":  # a dropout without its mask drops nothing
            value = layer(value)
        if record is not None:
            record[info.path] = value
        return value

    return run_list(lists[prefix], x, call)


class Network:
    """Two functional models sharing every layer: `train_model` takes [inputs, *dropout masks] (masks in
    `mask_paths` order), `model` takes the inputs alone and runs without dropout (inference)."""

    def __init__(self, spec, graph: Graph, weights: dict[str, np.ndarray], floatx: str, fp8=None, blocks=None,
                 noise_seed: int | None = None):
        self.input_dtype = "int64" if spec.tokens else floatx  # never a float: bfloat16 holds integers up to 256 only
        inputs = keras.Input(shape=tuple(spec.input.shape), dtype=self.input_dtype)
        masks = {path: keras.Input(shape, dtype=floatx) for path, _, shape in DropoutMasks(graph, spec.seed).layers}
        self.mask_paths = list(masks)
        self.spec, self.weights = spec, weights  # the canonical weights, which the layers are created holding
        self.fp8 = fp8  # the FP8 policy of an FP8 precision (harness.fp8), else None
        self.blocks = blocks  # the BlockRecipe of a block-scaled precision (harness.microscaling), else None
        # a stochastic recipe's bits, one generator for the network's products
        self.block_noise = BlockNoise(noise_seed) if blocks is not None and blocks.stochastic else None
        self.layers = layers = {info.path: LAYERS.build(info, self) for info in graph.layers}  # by canonical path
        self.lists = _lists(graph, layers)
        self.model = keras.Model(inputs, _apply(self.lists, "", inputs, None), name=spec.name)
        self.train_model = keras.Model([inputs, *masks.values()],
                                       _apply(self.lists, "", inputs, masks)) if masks else self.model
        #: which attention ran, by canonical layer path (the trainer's options["attention"])
        self.attention = {path: layer.implementation for path, layer in layers.items()
                          if isinstance(layer, SelfAttention)}
        # by canonical name: Keras' attribute names (and this adapter's layers') are the canonical ones
        self.variables = {f"{info.path}.{param}": getattr(layers[info.path], param)
                          for info in graph.layers for param in info.params}
        self.name_of = {id(v): name for name, v in self.variables.items()}  # canonical name of each variable
        self.weight_kinds = None  # the canonical names say each weight's kind (a native model's do not)

    def layer_outputs(self, x):
        """(each layer's output by canonical path, the network's output): the inference network run eagerly,
        so that a GradientTape can differentiate the loss with respect to every output."""
        outputs: dict = {}
        return outputs, _apply(self.lists, "", x, None, outputs)
