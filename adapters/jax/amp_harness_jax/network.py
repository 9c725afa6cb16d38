"""The spec's network as a pure function of (params, batchnorm statistics, inputs) in jax.numpy.

JAX's layouts are the canonical ones (NHWC, HWIO conv kernels, H, W, C flatten order, sequences [N, T, D]), so
weights load without conversion. Mixed precision is written the way Flax modules do it (`dtype` /
`param_dtype`): dense, conv, patches and attention layers cast their input and their float32 weights to the
compute dtype, embeddings the rows they take, position_embedding and bias their input and the weights they add;
normalisation layers (batchnorm, layernorm, rmsnorm) compute in the weights' dtype (the usual advice for
normalisation in JAX mixed precision); every other layer computes in the dtype it receives, and a merge (add,
multiply, concat) of a 16-bit and a float32 tensor gives what jnp's own type promotion gives for them (float32),
as a residual block's sum does.

Attention is written out as Flax's dot_product_attention computes it, in the spec's order, its softmax in the
compute dtype (Flax's default, force_fp32_for_softmax=False; jnp.sum accumulates its sum in float32). The fused
jax.nn.dot_product_attention (implementation "xla") is not used: its softmax is always float32, 4.5e-8 from the
reference in a float64 run (not exact), under amp a float32 softmax this adapter's policy (Flax's) does not
have, and it takes no dropout mask; in float32 it matches the reference as this attention does (1.1e-7).
Rotary position embedding turns each head of q and k right after the projections (and their biases), before the
scores, with the core's tables (harness.model.rotary) as constants in the weights' dtype, cast to the compute
dtype where they multiply, as Hugging Face's Llama casts its float32 tables to the query's dtype. Grouped
key/value heads are taken as jax.nn.dot_product_attention takes them: the query heads reshaped into [kv_heads,
group] so that each group's scores and output are one batched product with its key/value head, which gives
Llama's repeat_kv (head h reads key/value head h // group) without repeating k and v in memory.
Under a block-scaled precision (harness.microscaling.BlockRecipe) the dense layers and attention's four projections
multiply through block_matmul, a custom_vjp whose forward and backward quantize each product's operands by the
core's rule (through this adapter's RoundingOps) and multiply them in float32; the conv2d and patches layers
multiply their windows (im2col, block_convolution) by their kernels through it; the bias is added after it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial, reduce

import jax
import jax.numpy as jnp
from jax import lax

from amp_harness_jax.rounding import OPS, draw_bits
from harness.adapter import layer_scope
from harness.errors import HarnessError
from harness.fp8 import ROLES, Fp8Format, fake_quantize_with, recipe_amax_with
from harness.microscaling import BlockRecipe, block_gradient_operands_with, block_operands_with
from harness.model.graph import Graph, avgpool_divisors, effective_kernel, same_padding
from harness.model.layers import LayerBuilders, aligned_shape, run_list
from harness.model.rotary import rotary_tables
from harness.numerics import AttentionMask


def _pads(info, kernel: int, stride: int, padding: str) -> list[tuple[int, int]]:
    """[(top, bottom), (left, right)]: lax takes TF's asymmetric 'same' padding as it is."""
    return [same_padding(n, kernel, stride) if padding == "same" else (0, 0) for n in info.in_shape[:2]]


@jax.custom_vjp
def add_bias(x, bias):
    """x + bias, the bias broadcast over x's leading axes (a dense bias [D], a position table's rows [T, D])."""
    return x + bias


def _add_bias_bwd(bias, grad):
    # the bias's gradient sums the output's over the batch (and pixels, positions): XLA's CPU reduction of a
    # 16-bit array accumulates in 16 bits and overflows float16 where the sum itself does not (PyTorch's and
    # cuDNN's bias gradients accumulate in float32), which would make loss scalers skip steps the others take
    total = grad.sum(axis=tuple(range(grad.ndim - bias.ndim)), dtype=jnp.promote_types(grad.dtype, jnp.float32))
    return grad, total.astype(grad.dtype)


# the forward keeps the bias only for its number of axes (it is alive in the forward anyway)
add_bias.defvjp(lambda x, bias: (x + bias, bias), _add_bias_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def cast_input(x, amax, fmt: Fp8Format):
    """A matmul input as FP8 gives it (harness.fp8), scaled by `amax`; its gradient passed through unchanged."""
    return fake_quantize_with(OPS, x, amax, fmt)


cast_input.defvjp(lambda x, amax, fmt: (cast_input(x, amax, fmt), amax),
                  lambda fmt, amax, grad: (grad, jnp.zeros_like(amax)))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def cast_gradient(y, history, fmt: Fp8Format):
    """The identity on a matmul's output; its gradient cast as FP8 gives it to the backward matmuls. Under the
    delayed recipe `history` is the gradient's amax history, and what differentiation gives for it is the history
    after this step (Flax's fp8_ops idiom: the step keeps it as the new value)."""
    return y


def _cast_gradient_bwd(fmt, history, grad):
    amax, recorded = recipe_amax_with(OPS, grad, history)
    return fake_quantize_with(OPS, grad, amax, fmt), recorded


cast_gradient.defvjp(lambda y, history, fmt: (y, history), _cast_gradient_bwd)


def _float32_product(a, b):
    # HIGHEST: the emulation's products are float32 whatever the default matmul precision (TF32 on a GPU)
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def block_matmul(x, w, recipe: BlockRecipe, noise=None):
    """x [M, K] @ w [K, N] (float32) as a block-scaled precision multiplies (harness.microscaling.BlockRecipe): the
    forward's operands quantized along K, and in the backward dx's along N and dw's along M, each product float32.
    `noise`, a stochastic recipe's (not differentiated): a key the backward draws dy's two casts' bits from
    (gradient_bits), or the two int32 tensors themselves (the kit's, given)."""
    qx, qw = block_operands_with(OPS, x, w, recipe)
    return _float32_product(qx, qw)


def gradient_bits(noise, shape):
    """The bits of dy's two casts (for dx, for dw) from block_matmul's `noise`: drawn from a key, one fold each,
    on the device (in the backward: only the key is kept from the forward), or given."""
    if isinstance(noise, tuple):
        return noise
    return tuple(draw_bits(jax.random.fold_in(noise, cast), shape) for cast in (0, 1))


def _block_matmul_fwd(x, w, recipe, noise):
    qx, qw = block_operands_with(OPS, x, w, recipe)
    # x and w themselves: the backward quantizes them along the other axes; a tiled weight's Q_w serves dx as is
    return _float32_product(qx, qw), (x, w, qw if recipe.tiled_weight else None, noise)


def _block_matmul_bwd(recipe, saved, dy):
    x, w, qw, noise = saved
    bits = gradient_bits(noise, dy.shape) if recipe.stochastic else None
    g_n, w_n, x_m, g_m = block_gradient_operands_with(OPS, x, w, dy, recipe, qw, bits)
    return _float32_product(g_n, w_n.T), _float32_product(x_m.T, g_m), None  # the noise has no cotangent


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def block_product(recipe: BlockRecipe):
    """x [..., K] @ w [K, N] through block_matmul, for product: x's leading axes are the product's rows M (a
    sequence's: samples x positions), as the recipe blocks them; `noise` block_matmul's."""
    def multiply(x, w, noise=None):
        return block_matmul(x.reshape(-1, x.shape[-1]), w, recipe, noise).reshape(*x.shape[:-1], w.shape[-1])

    return multiply


def windows(x, k: int, stride: int, dilation: int, pads):
    """A convolution's input x [N, H, W, C] as its product's rows (im2col): [N, Ho, Wo, k*k*C], each window's taps in
    the kernel's (i, j, c) order, c fastest, the padding's zeros included (harness.model.reference.windows), `pads`
    ((top, bottom), (left, right)). Built from explicit zeros and k*k strided slices, one per tap: exact, and each
    slice's transpose puts its rows back on the pixels it read, so the windows' gradient is their fold (col2im).
    lax.conv_general_dilated_patches gives the taps in (c, i, j) order, by a convolution with a one-hot kernel
    whose float32 products a GPU's default precision (TF32) would round."""
    x = jnp.pad(x, ((0, 0), *pads, (0, 0)))
    n, c = x.shape[0], x.shape[3]
    h, w = x.shape[1] - (k - 1) * dilation, x.shape[2] - (k - 1) * dilation  # the first tap's span
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    taps = [lax.slice(x, (0, i * dilation, j * dilation, 0),
                      (n, i * dilation + (ho - 1) * stride + 1, j * dilation + (wo - 1) * stride + 1, c),
                      (1, stride, stride, 1)) for i in range(k) for j in range(k)]
    return jnp.stack(taps, axis=3).reshape(n, ho, wo, k * k * c)  # [N, Ho, Wo, k*k, C] flattened


def block_convolution(recipe: BlockRecipe, stride: int, pads, dilation: int = 1):
    """A convolution of NHWC inputs and HWIO kernels (groups 1) under a block-scaled recipe, for product: the core's
    rule (harness.microscaling.block_conv2d) multiplies the windows (rows [N*Ho*Wo, k*k*C], taps in (i, j, c)
    order) by the kernel as [k*k*C, F] through block_matmul, as a dense layer's rows (block_product: an MX block
    along M spans the output pixels of the batch); [N, Ho, Wo, F]. `pads` as convolution's (TF's 'same': the odd
    pixel after); `noise` block_matmul's."""
    def multiply(x, kernel, noise=None):
        rows = windows(x, kernel.shape[0], stride, dilation, pads)
        return block_product(recipe)(rows, kernel.reshape(-1, kernel.shape[-1]), noise)

    return multiply


def product(net, multiply, x, run, site: str, kernel: str, bias: str | None = None):
    """multiply(x, the weight `kernel`) in the compute dtype, plus the weight `bias` (None: none), with FP8's casts
    where net.fp8 asks for them (`site` names the product's delayed amax histories in the state)."""
    x, kernel = x.astype(net.compute), run.params[kernel].astype(net.compute)
    if net.fp8 is None:
        # a stochastic block recipe's bits: the step's key folded in with the product's index, fresh per product
        out = multiply(x, kernel) if run.noise is None else \
            multiply(x, kernel, jax.random.fold_in(run.noise, net.products.index(site)))
    else:
        cast = []
        for role, value in (("input", x), ("weight", kernel)):
            amax, recorded = recipe_amax_with(OPS, lax.stop_gradient(value), run.state.get(fp8_key(site, role)))
            if recorded is not None and run.training:
                run.state[fp8_key(site, role)] = recorded
            cast.append(cast_input(value, amax, net.fp8.forward))
        out = cast_gradient(multiply(*cast), run.state.get(fp8_key(site, "output_gradient")), net.fp8.backward)
    return out if bias is None else add_bias(out, run.params[bias].astype(net.compute))


def convolution(strides, pads, groups: int = 1, dilation: int = 1):
    """lax's convolution of NHWC inputs and HWIO kernels with these strides and (low, high) pads, in `groups`
    groups, its kernel's taps `dilation` pixels apart, for product. A grouped kernel is the spec's [k, k, C/g, F]
    as it is: lax's feature groups take output channels i*F/g .. (i+1)*F/g - 1 from group i's inputs, as the
    spec's groups do (a depthwise kernel of multiplier m: output channel c*m + j from input channel c)."""
    return partial(lax.conv_general_dilated, window_strides=strides, padding=pads, rhs_dilation=(dilation, dilation),
                   feature_group_count=groups, dimension_numbers=("NHWC", "HWIO", "NHWC"))


def fp8_key(site: str, role: str) -> str:
    """The state's name of the amax history of a product's input (harness.fp8.ROLES) under the delayed recipe."""
    return f"fp8:{site}:{role}"


@dataclass
class Run:
    """What one call of the network (Network.apply) gives its layers."""

    params: dict
    state: dict
    masks: dict | None
    training: bool
    taps: dict | None
    record: dict | None
    noise: object = None  # a stochastic block recipe's key for this call (Network.noise), else None


NOISE_STREAM = 2**32 - 1  # the first fold of Network.noise's key: a step count never reaches it
LAYERS = LayerBuilders("jax")  # each builder: (LayerInfo, Network) -> a function (x, Run) -> the layer's output


@LAYERS.builder("dense", "conv2d")
def dense_or_conv2d(info, net):
    spec, path = info.spec, info.path
    bias = f"{path}.bias" if spec.use_bias else None
    net.products.append(path)
    # a dilated kernel's 'same' padding is that of its window, (k-1)*d+1 pixels
    multiply = net.matmul() if info.type == "dense" else net.convolution(
        spec.strides, _pads(info, effective_kernel(spec), spec.strides, spec.padding), spec.groups, spec.dilation)
    return lambda x, run: product(net, multiply, x, run, path, f"{path}.kernel", bias)


@LAYERS.builder("zero_pad2d")
def zero_pad2d(info, net):
    top, bottom, left, right = info.spec.pads
    return lambda x, run: jnp.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))


@LAYERS.builder("maxpool2d", "avgpool2d")
def pool2d(info, net):
    spec = info.spec
    k, s = spec.pool_size, spec.strides or spec.pool_size
    window, strides = (1, k, k, 1), (1, s, s, 1)
    pads = [(0, 0), *_pads(info, k, s, spec.padding), (0, 0)]
    # TF's 'same' average pooling divides by the real (unpadded) pixels of each window
    divisors = avgpool_divisors(info.in_shape, k, s, spec.padding)[None, :, :, None]
    # Python-scalar identities: lax then picks its differentiable max/sum window primitives
    if spec.type == "maxpool2d":  # padded pixels never win: they hold -inf
        return lambda x, run: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, pads)
    return lambda x, run: lax.reduce_window(x, 0.0, lax.add, window, strides, pads) / jnp.asarray(divisors, x.dtype)


FUNCTIONS = {  # the layers that are a function of their input alone
    "flatten": lambda x: x.reshape(x.shape[0], -1),  # NHWC: H, W, C order, as the spec's
    "relu": jax.nn.relu,  # its gradient at 0 is 0, as in the other frameworks (jnp.maximum's is 1/2)
    "relu6": jax.nn.relu6,  # likewise at 0 and 6
    "silu": jax.nn.silu,  # x * sigmoid(x)
    "hard_swish": jax.nn.hard_swish,  # x * relu6(x + 3) / 6, its Python constants in x's dtype
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "softmax": partial(jax.nn.softmax, axis=-1),
}


@LAYERS.builder(*FUNCTIONS)
def function(info, net):
    return lambda x, run: FUNCTIONS[info.type](x)


@LAYERS.builder("global_avgpool2d", "global_maxpool2d")
def global_pool2d(info, net):
    pool = jnp.mean if info.type == "global_avgpool2d" else jnp.max
    return lambda x, run: pool(x, axis=(1, 2), keepdims=info.spec.keepdims)


@LAYERS.builder("rescaling")
def rescaling(info, net):  # in x's dtype: the constants take it (a list, one per channel on the last axis)
    scale, offset = info.spec.scale, info.spec.offset
    return lambda x, run: x * jnp.asarray(scale, x.dtype) + jnp.asarray(offset, x.dtype)


@LAYERS.builder("gelu")
def gelu(info, net):
    # written out: Python constants take x's dtype (float64 in a float64 run)
    if info.spec.approximate:
        return lambda x, run: 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    return lambda x, run: 0.5 * x * (1.0 + lax.erf(x / math.sqrt(2.0)))


@LAYERS.builder("batchnorm")
def batchnorm(info, net):
    spec, path, m = info.spec, info.path, info.spec.momentum

    def apply(x, run):
        gamma, beta = run.params[f"{path}.gamma"], run.params[f"{path}.beta"]
        x = x.astype(gamma.dtype)
        axes = tuple(range(x.ndim - 1))
        if run.training:
            mean, var = x.mean(axis=axes), x.var(axis=axes)  # the biased variance, as the spec's
            for name, batch in (("moving_mean", mean), ("moving_variance", var)):
                running = run.state[f"{path}.{name}"]
                run.state[f"{path}.{name}"] = m * running + (1 - m) * lax.stop_gradient(batch).astype(running.dtype)
        else:
            mean, var = run.state[f"{path}.moving_mean"], run.state[f"{path}.moving_variance"]
        return (x - mean) / jnp.sqrt(var + spec.epsilon) * gamma + beta

    return apply


@LAYERS.builder("layernorm")
def layernorm(info, net):
    gamma, beta, epsilon = f"{info.path}.gamma", f"{info.path}.beta", info.spec.epsilon

    def apply(x, run):
        x = x.astype(run.params[gamma].dtype)
        mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + epsilon) * run.params[gamma] + run.params[beta]

    return apply


@LAYERS.builder("rmsnorm")
def rmsnorm(info, net):
    gamma, epsilon = f"{info.path}.gamma", info.spec.epsilon

    def apply(x, run):
        x = x.astype(run.params[gamma].dtype)
        return x / jnp.sqrt((x * x).mean(axis=-1, keepdims=True) + epsilon) * run.params[gamma]

    return apply


@LAYERS.builder("dropout")
def dropout(info, net):
    rate, path = info.spec.rate, info.path

    def apply(x, run):
        if not run.training or rate == 0:
            return x
        if run.masks is None or path not in run.masks:
            raise HarnessError(f"dropout layer {path}: no mask was given with the batch")
        return x * run.masks[path].astype(x.dtype) / (1 - rate)

    return apply


@LAYERS.builder("embedding")
def embedding(info, net):
    # the rows gathered in the table's dtype, then cast: the table's gradient (a scatter-add) accumulates in float32
    # under mixed precision, as with Keras' Embedding, which casts its output and not its table
    return lambda ids, run: jnp.take(run.params[f"{info.path}.embeddings"], ids, axis=0).astype(net.compute)


@LAYERS.builder("position_embedding")
def position_embedding(info, net):
    table, length = f"{info.path}.embeddings", info.in_shape[0]
    # the table's first T rows; their gradient sums over the batch in float32 (add_bias)
    return lambda x, run: add_bias(x.astype(net.compute), run.params[table][:length].astype(net.compute))


@LAYERS.builder("bias")
def bias(info, net):
    weight = f"{info.path}.bias"
    # as position_embedding adds its rows: both in the compute dtype, the gradient summed in float32 (add_bias)
    return lambda x, run: add_bias(x.astype(net.compute), run.params[weight].astype(net.compute))


def attention_mask(info, precision, device_kind: str) -> AttentionMask:
    """jnp.finfo(compute dtype).min, and jax.nn.softmax in that dtype, on any device: the code says so, not a
    kernel's choice (measured: docs/diagnose.md "Masks in 16 bits")."""
    compute = precision.compute_dtype
    return AttentionMask(float(jnp.finfo(compute).min), compute, compute)


@LAYERS.builder("attention")
def attention(info, net):
    spec, path = info.spec, info.path
    length, dim = info.in_shape
    heads, head_dim, dropped = spec.heads, dim // spec.heads, spec.dropout > 0
    kv_heads, group = spec.key_heads, spec.heads // spec.key_heads  # group: query heads per key/value head
    tables = rotary_tables(length, head_dim, spec.rotary.base, spec.rotary.pairing) if spec.rotary else None
    net.attention[path] = "unfused (attention dropout: the core's masks)" if dropped else "unfused"
    net.products += [f"{path}.{name}" for name in ("query", "key", "value", "output")]

    def project(x, name, run):  # a dense layer of the compute dtype
        return product(net, net.matmul(), x, run, f"{path}.{name}", f"{path}.{name}_kernel",
                       f"{path}.{name}_bias" if spec.use_bias else None)

    def rotate(x, dtype):
        """x [N, T, heads, Dh] turned by position (harness.model.rotary), in the reference's order of operations:
        the tables are constants in the weights' dtype, cast to x's (the compute dtype) where they multiply."""
        cos, signed_sin = (jnp.asarray(table[:, None, :], dtype).astype(x.dtype) for table in tables[:2])
        return x * cos + jnp.take(x, tables[2], axis=-1) * signed_sin

    def apply(x, run):
        x = x.astype(net.compute)
        # [N, T, heads x Dh] -> [N, T, heads, Dh]: the key and value projections have kv_heads heads
        q, k, v = (project(x, name, run).reshape(*x.shape[:-1], -1, head_dim) for name in ("query", "key", "value"))
        if tables is not None:  # after the projections and their biases, before the scores
            q, k = (rotate(value, run.params[f"{path}.query_kernel"].dtype) for value in (q, k))
        # query head h = g*group + r reads key/value head g = h // group (the module's docstring): k and v stay
        # kv_heads wide, as the memory model counts what the backward keeps; group 1 is plain multi-head attention
        q = q.reshape(*q.shape[:2], kv_heads, group, head_dim)
        # [N, T, G, group, Dh] -> [N, H, T, T] (H = G x group, head order), scaled before the softmax
        scores = jnp.einsum("nqgrd,nkgd->ngrqk", q, k).reshape(x.shape[0], heads, length, length) / math.sqrt(head_dim)
        if spec.causal:  # where key j is after query i, Flax's big_neg: exp of it less the row's maximum is exactly
            # 0 in every dtype, as -inf's would be (a causal row always keeps j = i)
            blocked = jnp.triu(jnp.ones((length, length), bool), k=1)
            scores = jnp.where(blocked, jnp.finfo(scores.dtype).min, scores)
        probs = jax.nn.softmax(scores, axis=-1)  # over the keys
        if dropped and run.training:
            if run.masks is None or path not in run.masks:
                raise HarnessError(f"attention layer {path}: no attention dropout mask was given with the batch")
            probs = probs * run.masks[path].astype(probs.dtype) / (1 - spec.dropout)
        probs = probs.reshape(x.shape[0], kv_heads, group, length, length)
        out = jnp.einsum("ngrqk,nkgd->nqgrd", probs, v).reshape(x.shape)  # the heads concatenated in head order
        return project(out, "output", run)

    return apply


@LAYERS.builder("sequence_pool")
def sequence_pool(info, net):
    if info.spec.mode == "mean":
        return lambda x, run: x.mean(axis=1)
    return lambda x, run: x[:, 0 if info.spec.mode == "first" else -1]


@LAYERS.builder("patches")
def patches(info, net):
    size, path = info.spec.size, info.path
    multiply = net.convolution(size, [(0, 0), (0, 0)])
    net.products.append(path)

    def apply(x, run):  # a conv2d of kernel and stride P, 'valid': [N, H/P, W/P, D], then the patches row-major
        x = product(net, multiply, x, run, path, f"{path}.kernel")
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        return add_bias(x, run.params[f"{path}.bias"].astype(net.compute))

    return apply


@LAYERS.builder("residual")
def residual(info, net):
    main = net.build(info.spec.layers, f"{info.path}.layers.")
    projection = net.build(info.spec.projection, f"{info.path}.projection.") if info.spec.projection else None
    return lambda x, run: net.run(main, x, run) + (net.run(projection, x, run) if projection else x)


MERGES = {"add": jnp.add, "multiply": jnp.multiply}  # elementwise, with jnp's broadcasting and type promotion


@LAYERS.builder("add", "multiply", "concat")
def merge(info, net):  # each builds a function of the list of its inputs
    if info.type == "concat":  # the last axis is the channel (feature) axis in JAX's layouts, as in the spec's
        return lambda values, run: jnp.concatenate(values, axis=-1)
    # numpy's broadcasting would align a [N, C] gate's batch axis with an [N, H, W, C] image's W: each input is
    # given ones after its batch axis up to the output's rank, [N, 1, 1, C]
    shapes, combine = [aligned_shape(shape, len(info.out_shape)) for shape in info.in_shapes], MERGES[info.type]
    return lambda values, run: reduce(combine, (v.reshape(v.shape[0], *shape) for v, shape in zip(values, shapes)))


class Network:
    def __init__(self, spec, graph: Graph, compute_dtype: str, fp8=None, blocks: BlockRecipe | None = None,
                 noise_seed: int | None = None):
        self.compute, self.fp8 = jnp.dtype(compute_dtype), fp8  # fp8: an FP8 precision's policy
        self.blocks = blocks  # a block-scaled precision's recipe: the dense, attention and convolution matmuls'
        # (matmul, convolution)
        self.noise_seed = noise_seed  # the run's seed of a stochastic recipe's gradient bits (noise)
        self.infos = {info.path: info for info in graph.layers}
        self.trainable = list(graph.trainable_shapes())
        self.statistics = [n for n in graph.param_shapes() if n not in self.trainable]
        self.attention: dict[str, str] = {}  # how each attention layer computes (path -> a short name), by its builder
        self.products: list[str] = []  # the matmuls' names (product's sites), filled by the builders
        self.layers = self.build(spec.layers, "")

    def matmul(self):
        """The dense layers' and attention projections' multiply (for product): block_product under a block-scaled
        precision, else jnp.matmul. Attention's scores and p.v stay as they are (float32 under a block recipe)."""
        return jnp.matmul if self.blocks is None else block_product(self.blocks)

    def noise(self, count):
        """The key of a stochastic block recipe's gradient bits in the call of step `count` (a traced int: the
        optimizer's step count), for apply; None without one. Folded in apart from the rounded optimizer's key of
        the same seed (its first fold is the count), so the two never draw the same bits."""
        if self.blocks is None or not self.blocks.stochastic:
            return None
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.noise_seed), NOISE_STREAM), count)

    def convolution(self, stride: int, pads, groups: int = 1, dilation: int = 1):
        """The conv2d and patches layers' multiply (for product): block_convolution under a block-scaled precision
        (groups 1: the core refuses a grouped one, harness.microscaling.block_refusal), else lax's convolution."""
        if self.blocks is None:
            return convolution((stride, stride), pads, groups, dilation)
        return block_convolution(self.blocks, stride, pads, dilation)

    def fp8_histories(self) -> dict[str, jnp.ndarray]:
        """The delayed FP8 recipe's amax histories, zeros, by their names (fp8_key): state, as batchnorm's is."""
        n = self.fp8.recipe.history if self.fp8 else 0
        return {fp8_key(site, role): jnp.zeros(n, jnp.float32) for site in self.products for role in ROLES} if n else {}

    def build(self, specs, prefix: str) -> list[tuple[object, object]]:
        """(LayerInfo, layer function) of each of `specs`, the layers at `prefix`0, `prefix`1..."""
        infos = [self.infos[f"{prefix}{index}"] for index in range(len(specs))]
        return [(info, LAYERS.build(info, self)) for info in infos]

    def apply(self, params: dict, state: dict, x, masks: dict | None, training: bool, taps: dict | None = None,
              record: dict | None = None, noise=None):
        """(outputs, new state). In training the state is updated and `masks` (the core's dropout masks by path)
        applied; `taps` (zeros by layer path) are added to each layer's output, so that differentiating with
        respect to them gives the loss's gradient with respect to that output; `record` gets each layer's output;
        `noise` a stochastic block recipe's key (self.noise), which each product folds in with its index."""
        run = Run(params, dict(state), masks, training, taps, record, noise)
        return self.run(self.layers, x, run), run.state

    @staticmethod
    def run(layers, x, run: Run):
        """The output of a list's layers (build's pairs) on its input `x`, wired as the spec names their inputs."""
        def call(info, layer, value):
            # the scope only names the HLO ops' metadata (their op_name), by which a profile finds each layer's ops
            with jax.named_scope(layer_scope(info.path)):
                out = layer(value, run)
            if run.taps is not None:  # tapped before a later layer takes it (by name or not)
                out = out + run.taps[info.path]
            if run.record is not None:
                run.record[info.path] = out
            return out

        return run_list(layers, x, call)
