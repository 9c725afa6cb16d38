"""The spec's network as a pure function of (params, batchnorm statistics, inputs) in jax.numpy.

The canonical layouts are JAX's own (NHWC activations, HWIO conv kernels, [in, out] dense kernels, H, W, C
flatten order, sequences [N, T, D] batch first), so weights load without conversion. Mixed precision is written
the way Flax modules do it (`dtype` / `param_dtype`): dense, conv, patches and attention layers cast their input
and their float32 weights to the compute dtype; embedding lookups gather from the float32 table and cast what
they gathered (as Keras' Embedding does, so that the table's gradient accumulates in float32); position
embeddings add their rows cast to the compute dtype; normalisation layers (batchnorm, layernorm, rmsnorm)
compute in the weights' dtype (the usual advice for normalisation in JAX mixed precision); every other layer
computes in the dtype it receives.

Attention is written out as Flax's dot_product_attention computes it, with the spec's order: scores q k^T /
sqrt(Dh) in the compute dtype, masked where j > i with jnp.finfo(compute dtype).min (Flax's big_neg; exp of it
minus the row's maximum is exactly 0 in every dtype, as -inf's would be: a causal row always keeps j = i), the
softmax in the compute dtype too (Flax's default, force_fp32_for_softmax=False), the core's dropout masks on the
probabilities. Read from the step's jaxpr under amp_bf16 / amp_fp16: the scores and the masked scores (bfloat16
min -3.39e38, float16 min -65504) are bfloat16 / float16, and so are the softmax's max, exp and division and the
probabilities; only its sum accumulates in float32 (jnp.sum upcasts 16-bit inputs) before it is rounded back.
layernorm and rmsnorm run in float32, their output float32 (the next dense casts it back). The fused
jax.nn.dot_product_attention (implementation "xla") is not used: its softmax is always float32, 4.5e-8 from the
reference in a float64 run (not exact), under amp a float32 softmax this adapter's policy (Flax's) does not
have, and it takes no dropout mask; in float32 it matches the reference as this attention does (1.1e-7).

FP8 (a precision with an fp8 policy, harness.fp8): the dense, conv2d, patches and attention projection layers
multiply their inputs and kernels cast by the core's rule (fake_quantize_with over rounding.OPS, the amax by the
recipe: recipe_amax_with; a custom_vjp passes the gradient straight through) and cast the gradient of the product
on its way back (a second custom_vjp), the bias added after, as the torch adapter does. The delayed recipe's amax
histories are state beside batchnorm's statistics (Network.fp8_histories).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from harness.adapter import layer_scope
from harness.errors import HarnessError
from harness.fp8 import ROLES, Fp8Format, fake_quantize_with, recipe_amax_with
from harness.model.graph import Graph, avgpool_divisors, window_padding
from harness.model.layers import LayerBuilders
from harness.numerics import AttentionMask

CONV_DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def _pads(info, kernel: int, stride: int, padding: str) -> list[tuple[int, int]]:
    """[(top, bottom), (left, right)]: lax takes TF's asymmetric 'same' padding as it is."""
    pad = window_padding(info.in_shape, kernel, stride, padding)
    if pad.explicit:
        top, bottom, left, right = pad.explicit
        return [(top, bottom), (left, right)]
    (h, w) = pad.symmetric
    return [(h, h), (w, w)]


@jax.custom_vjp
def add_bias(x, bias):
    """x + bias, the bias broadcast over x's leading axes (a dense bias [D], a position table's rows [T, D])."""
    return x + bias


def _add_bias_fwd(x, bias):
    return x + bias, bias  # kept only for its number of axes (it is alive in the forward anyway)


def _add_bias_bwd(bias, grad):
    # the bias's gradient sums the output's over the batch (and pixels, positions): XLA's CPU reduction of a
    # 16-bit array accumulates in 16 bits and overflows float16 where the sum itself does not (PyTorch's and
    # cuDNN's bias gradients accumulate in float32), which would make loss scalers skip steps the others take
    total = grad.sum(axis=tuple(range(grad.ndim - bias.ndim)), dtype=jnp.promote_types(grad.dtype, jnp.float32))
    return grad, total.astype(grad.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def cast_input(x, amax, fmt: Fp8Format):
    """A matmul input as FP8 gives it (harness.fp8), scaled by `amax`; its gradient passed through unchanged."""
    from amp_harness_jax.rounding import OPS

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
    from amp_harness_jax.rounding import OPS

    amax, recorded = recipe_amax_with(OPS, grad, history)
    return fake_quantize_with(OPS, grad, amax, fmt), recorded


cast_gradient.defvjp(lambda y, history, fmt: (y, history), _cast_gradient_bwd)


def product(net, multiply, x, kernel, run, site: str):
    """multiply(x, kernel) in the compute dtype, with FP8's casts where the network trains in FP8 (net.fp8: `site`
    names the product's amax histories in the state under the delayed recipe, recorded in training)."""
    from amp_harness_jax.rounding import OPS

    x, kernel = x.astype(net.compute), kernel.astype(net.compute)
    if net.fp8 is None:
        return multiply(x, kernel)
    cast = []
    for role, value in (("input", x), ("weight", kernel)):
        amax, recorded = recipe_amax_with(OPS, lax.stop_gradient(value), run.state.get(fp8_key(site, role)))
        if recorded is not None and run.training:
            run.state[fp8_key(site, role)] = recorded
        cast.append(cast_input(value, amax, net.fp8.forward))
    return cast_gradient(multiply(*cast), run.state.get(fp8_key(site, "output_gradient")), net.fp8.backward)


def fp8_key(site: str, role: str) -> str:
    """The state's name of the amax history of a product's input (harness.fp8.ROLES) under the delayed recipe."""
    return f"fp8:{site}:{role}"


@dataclass
class Run:
    """What one call of the network gives its layers: the weights, the batchnorm statistics (updated in place in
    training), the dropout masks by path, whether it trains, and the taps and record of Network.apply."""

    params: dict
    state: dict
    masks: dict | None
    training: bool
    taps: dict | None
    record: dict | None


LAYERS = LayerBuilders("jax")  # each builder: (LayerInfo, Network) -> a function (x, Run) -> the layer's output


@LAYERS.builder("dense")
def dense(info, net):
    kernel, bias = f"{info.path}.kernel", f"{info.path}.bias"
    net.products.append(info.path)

    def apply(x, run):
        x = product(net, jnp.matmul, x, run.params[kernel], run, info.path)
        return add_bias(x, run.params[bias].astype(net.compute)) if info.spec.use_bias else x

    return apply


@LAYERS.builder("conv2d")
def conv2d(info, net):
    spec, kernel, bias = info.spec, f"{info.path}.kernel", f"{info.path}.bias"
    net.products.append(info.path)
    strides, pads = (spec.strides, spec.strides), _pads(info, spec.kernel_size, spec.strides, spec.padding)

    def apply(x, run):
        x = product(net, lambda x, k: lax.conv_general_dilated(x, k, strides, pads, dimension_numbers=CONV_DIMENSIONS),
                    x, run.params[kernel], run, info.path)
        return add_bias(x, run.params[bias].astype(net.compute)) if spec.use_bias else x

    return apply


@LAYERS.builder("maxpool2d", "avgpool2d")
def pool2d(info, net):
    spec = info.spec
    k, s = spec.pool_size, spec.strides or spec.pool_size
    window, strides = (1, k, k, 1), (1, s, s, 1)
    pads = [(0, 0), *_pads(info, k, s, spec.padding), (0, 0)]
    # TF's 'same' average pooling divides by the real (unpadded) pixels of each window
    divisors = avgpool_divisors(info.in_shape, k, s, spec.padding)[None, :, :, None]

    # Python-scalar identities: lax then picks its differentiable max/sum window primitives
    def maxpool(x, run):  # padded pixels never win: they hold -inf
        return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, pads)

    def avgpool(x, run):
        sums = lax.reduce_window(x, 0.0, lax.add, window, strides, pads)
        return sums / jnp.asarray(divisors, x.dtype)

    return maxpool if spec.type == "maxpool2d" else avgpool


@LAYERS.builder("global_avgpool2d")
def global_avgpool2d(info, net):
    return lambda x, run: x.mean(axis=(1, 2))


@LAYERS.builder("flatten")
def flatten(info, net):
    return lambda x, run: x.reshape(x.shape[0], -1)  # NHWC: H, W, C order, as the spec's


@LAYERS.builder("relu")
def relu(info, net):
    return lambda x, run: jax.nn.relu(x)  # its gradient at 0 is 0, as in the other frameworks (jnp.maximum's is 1/2)


@LAYERS.builder("tanh")
def tanh(info, net):
    return lambda x, run: jnp.tanh(x)


@LAYERS.builder("sigmoid")
def sigmoid(info, net):
    return lambda x, run: jax.nn.sigmoid(x)


@LAYERS.builder("softmax")
def softmax(info, net):
    return lambda x, run: jax.nn.softmax(x, axis=-1)


@LAYERS.builder("gelu")
def gelu(info, net):
    # written out: Python constants take x's dtype (float64 in a float64 run)
    if info.spec.approximate:
        return lambda x, run: 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    return lambda x, run: 0.5 * x * (1.0 + lax.erf(x / math.sqrt(2.0)))


@LAYERS.builder("batchnorm")
def batchnorm(info, net):
    spec, path = info.spec, info.path

    def apply(x, run):
        gamma, beta = run.params[f"{path}.gamma"], run.params[f"{path}.beta"]
        x = x.astype(gamma.dtype)
        axes = tuple(range(x.ndim - 1))
        if run.training:
            mean, var = x.mean(axis=axes), x.var(axis=axes)  # the biased variance, as the spec's
            m = spec.momentum
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
    table = f"{info.path}.embeddings"
    # the rows gathered from the table in its own dtype, then cast: the table's gradient (a scatter-add of the
    # rows' gradients) accumulates in float32 under mixed precision, as with Keras' Embedding, which casts its
    # output and not its table
    return lambda ids, run: jnp.take(run.params[table], ids, axis=0).astype(net.compute)


@LAYERS.builder("position_embedding")
def position_embedding(info, net):
    table, length = f"{info.path}.embeddings", info.in_shape[0]

    def apply(x, run):  # the table's first T rows; their gradient sums over the batch in float32 (add_bias)
        return add_bias(x.astype(net.compute), run.params[table][:length].astype(net.compute))

    return apply


def _causal_blocked(length: int):
    """[T, T] True where key position j is after query position i (j > i): the scores a causal row masks."""
    return jnp.triu(jnp.ones((length, length), bool), k=1)


def attention_mask(info, precision, device_kind: str) -> AttentionMask:
    """What a causal attention layer's mask leaves in the scores it masks (harness.numerics.AttentionMask; measured,
    docs/diagnose.md "Masks in 16 bits"): jnp.finfo(compute dtype).min, put in by jnp.where on the compute dtype's
    scores (-65504 in float16, -3.39e38 in bfloat16), and jax.nn.softmax in that dtype (its sum accumulates in
    float32), on any device (the code says so, not a kernel's choice)."""
    compute = precision.compute_dtype
    return AttentionMask(float(jnp.finfo(compute).min), compute, compute)


@LAYERS.builder("attention")
def attention(info, net):
    spec, path = info.spec, info.path
    length, dim = info.in_shape
    heads, head_dim = spec.heads, dim // spec.heads
    scale = math.sqrt(head_dim)
    dropped = spec.dropout > 0
    net.attention[path] = "unfused (attention dropout: the core's masks)" if dropped else "unfused"
    net.products += [f"{path}.{name}" for name in ("query", "key", "value", "output")]

    def project(x, name, run):  # a dense layer of the compute dtype: [N, T, D] -> [N, T, H, Dh]
        out = product(net, jnp.matmul, x, run.params[f"{path}.{name}_kernel"], run, f"{path}.{name}")
        if spec.use_bias:
            out = add_bias(out, run.params[f"{path}.{name}_bias"].astype(net.compute))
        return out

    def apply(x, run):
        x = x.astype(net.compute)
        split = lambda value: value.reshape(*value.shape[:-1], heads, head_dim)  # noqa: E731
        q, k, v = (split(project(x, name, run)) for name in ("query", "key", "value"))
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k) / scale  # [N, H, T, T], scaled before the softmax
        if spec.causal:
            scores = jnp.where(_causal_blocked(length), jnp.finfo(scores.dtype).min, scores)
        probs = jax.nn.softmax(scores, axis=-1)  # over the keys
        if dropped and run.training:
            if run.masks is None or path not in run.masks:
                raise HarnessError(f"attention layer {path}: no attention dropout mask was given with the batch")
            probs = probs * run.masks[path].astype(probs.dtype) / (1 - spec.dropout)
        out = jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(x.shape)  # the heads concatenated in head order
        out = product(net, jnp.matmul, out, run.params[f"{path}.output_kernel"], run, f"{path}.output")
        return add_bias(out, run.params[f"{path}.output_bias"].astype(net.compute)) if spec.use_bias else out

    return apply


@LAYERS.builder("sequence_pool")
def sequence_pool(info, net):
    mode = info.spec.mode
    if mode == "mean":
        return lambda x, run: x.mean(axis=1)
    position = 0 if mode == "first" else -1
    return lambda x, run: x[:, position]


@LAYERS.builder("patches")
def patches(info, net):
    size, kernel, bias = info.spec.size, f"{info.path}.kernel", f"{info.path}.bias"
    net.products.append(info.path)

    def apply(x, run):  # a conv2d of kernel and stride P, 'valid': [N, H/P, W/P, D], then the patches row-major
        x = product(net, lambda x, k: lax.conv_general_dilated(x, k, (size, size), [(0, 0), (0, 0)],
                                                               dimension_numbers=CONV_DIMENSIONS),
                    x, run.params[kernel], run, info.path)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        return add_bias(x, run.params[bias].astype(net.compute))

    return apply


@LAYERS.builder("residual")
def residual(info, net):
    main = net.build(info.spec.layers, f"{info.path}.layers.")
    projection = net.build(info.spec.projection, f"{info.path}.projection.") if info.spec.projection else None

    def apply(x, run):
        return net.run(main, x, run) + (net.run(projection, x, run) if projection else x)

    return apply


class Network:
    def __init__(self, spec, graph: Graph, compute_dtype: str, fp8=None):
        self.spec, self.compute, self.fp8 = spec, jnp.dtype(compute_dtype), fp8  # fp8: an FP8 precision's policy
        self.infos = {info.path: info for info in graph.layers}
        #: the trainable weights' canonical names; batchnorm's moving statistics are state, not parameters
        self.trainable = [n for n in graph.param_shapes() if not n.rsplit(".", 1)[1].startswith("moving_")]
        self.statistics = [n for n in graph.param_shapes() if n.rsplit(".", 1)[1].startswith("moving_")]
        #: how each attention layer computes (canonical path -> a short name), filled by its builder
        self.attention: dict[str, str] = {}
        self.products: list[str] = []  # the matmuls' names (product's sites), filled by the builders
        self.layers = self.build(spec.layers, "")

    def fp8_histories(self) -> dict[str, jnp.ndarray]:
        """The delayed FP8 recipe's amax histories, empty (zeros), by their state names (fp8_key): state, threaded
        through the step with batchnorm's statistics; those of output gradients also differentiated (cast_gradient)."""
        n = self.fp8.recipe.history if self.fp8 else 0
        return {fp8_key(site, role): jnp.zeros(n, jnp.float32) for site in self.products for role in ROLES} if n else {}

    @staticmethod
    def gradient_histories(state: dict) -> dict:
        """The output gradients' amax histories among `state`, which the step differentiates to record them."""
        return {name: value for name, value in state.items() if name.endswith(":output_gradient")}

    def build(self, specs, prefix: str) -> list[tuple[str, object]]:
        """(path, layer function) of each of `specs`, the layers at `prefix`0, `prefix`1..."""
        return [(f"{prefix}{index}", LAYERS.build(self.infos[f"{prefix}{index}"], self)) for index in range(len(specs))]

    def apply(self, params: dict, state: dict, x, masks: dict | None, training: bool, taps: dict | None = None,
              record: dict | None = None):
        """(outputs, new batchnorm statistics). In training the statistics are updated and `masks` (the core's
        dropout masks by path) applied; `taps` (zeros by layer path) are added to each layer's output, so that
        differentiating with respect to them gives the gradient of the loss with respect to that output;
        `record` receives each layer's output by path."""
        run = Run(params, dict(state), masks, training, taps, record)
        return self.run(self.layers, x, run), run.state

    @staticmethod
    def run(layers, x, run: Run):
        for path, layer in layers:
            # the scope only names the HLO ops' metadata (their op_name), by which a profile finds each layer's ops
            with jax.named_scope(layer_scope(path)):
                x = layer(x, run)
            if run.taps is not None:
                x = x + run.taps[path]
            if run.record is not None:
                run.record[path] = x
        return x
