"""The spec's network as a torch.nn.Module, holding the core's canonical weights in torch layouts.

Activations are NCHW tensors (torch's convention) whose memory may be channels-last. `flatten` permutes to
NHWC first so that it flattens in the spec's H, W, C order and the canonical dense kernel needs no reordering.
Sequences are [N, T, D], the canonical layout (dense, the norms and softmax act on the last axis); token ids
come in as int64 and go to F.embedding as they are.

Each list of layers (the network's, a residual block's, its projection's) is a Chain: an nn.Sequential that runs
named tensors as the spec wires them (harness.model.layers.run_list). A merge's inputs of a lower rank than its
output (a [C] gate against an image) are aligned as numpy aligns them (aligned_shape), then laid out as torch's
activations are (channels first). A grouped or depthwise conv2d's canonical kernel [k, k, C/groups, F] becomes
torch's grouped layout [F, C/groups, k, k] by the same transpose as any conv kernel (to_channels_first).

Under autocast on CPU (dtypes printed, torch 2.13): the projections and q k^T run in the autocast dtype;
torch.softmax, F.layer_norm and F.rms_norm keep their input's dtype (CPU autocast casts none of them to float32),
so a norm after a 16-bit dense gives 16 bits and a norm on the residual stream float32 (a 16-bit branch plus the
float32 shortcut promotes to float32). F.rms_norm with a 16-bit input and float32 gamma takes torch's composite
path (it warns once that it cannot use the fused kernel). CUDA autocast's lists cast softmax and layer_norm to
float32 instead (torch's documentation; not measured here, no GPU). The loss is float32 (optimizers.LOSS_OPS).

FP8 (a precision with an fp8 policy: harness.fp8, docs/fp8.md): each matmul layer's product goes through
matmul_layer, its casts (Fp8Casts) emulated by the core's rule or, where the policy is native, multiplied by
torch._scaled_mm.

Block-scaled training (a precision with a BlockRecipe: harness.microscaling, docs/microscaling.md): each dense
layer's and attention projection's product goes through BlockLinear, which quantizes its operands in blocks along
each product's reduction axis by the core's rule (on OPS) and multiplies the dequantized values in float32
(emulation).
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator

import numpy as np
import torch
import torch.nn.functional as F
from amp_harness_torch.rounding import OPS, draw_bits
from torch import nn

from harness.adapter import layer_scope
from harness.errors import HarnessError
from harness.fp8 import ROLES, Fp8Policy, fake_quantize_with, recipe_amax_with, scale_with
from harness.microscaling import BLOCK_LAYERS, BlockRecipe, block_gradient_operands_with, block_operands_with
from harness.model.graph import Graph, LayerInfo, avgpool_divisors, effective_kernel, window_padding
from harness.model.layers import LayerBuilders, aligned_shape, run_list
from harness.model.rotary import rotary_tables
from harness.model.weights import from_channels_first, to_channels_first
from harness.numerics import AttentionMask

LAYERS = LayerBuilders("torch")  # each builder: (LayerInfo, Network) -> an nn.Module (here the Layer classes)


class Fp8Casts(nn.Module):
    """One matmul's FP8 casts (harness.fp8): its input and kernel on the way forward, its output's gradient on the
    way back, each scaled by the recipe; under the delayed one each keeps its amax history (a buffer, recorded in
    training only)."""

    def __init__(self, policy: Fp8Policy):
        super().__init__()
        self.policy = policy
        for role in ROLES:
            self.register_buffer(role, torch.zeros(policy.recipe.history) if policy.recipe.history else None,
                                 persistent=False)

    def amax(self, x, role: str):
        """The amax x's cast is scaled by (the recipe's; a delayed history recorded in training)."""
        amax, history = recipe_amax_with(OPS, x, getattr(self, role))
        if history is not None and self.training:
            getattr(self, role).copy_(history)
        return amax

    def cast(self, x, role: str):
        """x as its FP8 cast gives it, in float32 (emulation)."""
        return fake_quantize_with(OPS, x, self.amax(x, role), self.policy.format(role))

    def quantize(self, x, role: str):
        """(x scaled and cast to torch's FP8 dtype, the scale): the same values as cast(), before dequantizing.
        torch's cast rounds to nearest even but gives e4m3fn NaN past 448: the clamp saturates first, as the
        core's rule does (NaN stays NaN)."""
        fmt = self.policy.format(role)
        scale = scale_with(OPS, self.amax(x, role), fmt)
        return (x * scale).clamp(-fmt.max, fmt.max).to(FP8_DTYPES[fmt.name]), scale


class Cast(torch.autograd.Function):
    """A matmul input (`role` "input" or "weight") as FP8 gives it (harness.fp8), its gradient passed through; or
    (role None) the identity on a matmul's output, its gradient cast. So the backward matmuls multiply the cast
    output gradient with the cast values the forward saved, as an FP8 matmul's backward does."""

    @staticmethod
    def forward(ctx, x, casts, role):
        ctx.casts, ctx.role = casts, role
        return x.view_as(x) if role is None else casts.cast(x, role)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.role is not None else ctx.casts.cast(grad, "output_gradient")), None, None


FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
NATIVE_FP8 = "native: torch._scaled_mm (FP8 operands, float32 products)"


def _padded(x):
    """A 2D float tensor zero-padded to multiples of 16 in both sizes (CUDA's FP8 GEMMs need them; zeros change
    neither an amax nor a product)."""
    return F.pad(x, (0, -x.shape[1] % 16, 0, -x.shape[0] % 16))


def scaled_mm(a, b, scale_a, scale_b):
    """a @ b of FP8 tensors [m, k] and [k, n] through torch._scaled_mm, float32 out, each dequantized by its
    scale's inverse; b laid out column-major, as the kernel wants it."""
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=1 / scale_a, scale_b=1 / scale_b,
                            out_dtype=torch.float32)


class NativeLinear(torch.autograd.Function):
    """x @ kernel^T with torch._scaled_mm on the casts Fp8Casts gives, forward and back (the output gradient's cast
    times the saved casts), as an FP8 training kernel does."""

    @staticmethod
    def forward(ctx, x, kernel, casts):
        (m, k), n = x.shape, kernel.shape[0]
        (qx, sx), (qw, sw) = casts.quantize(_padded(x), "input"), casts.quantize(_padded(kernel), "weight")
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.casts, ctx.sizes = casts, (m, k, n)
        return scaled_mm(qx, qw.t(), sx, sw)[:m, :n]

    @staticmethod
    def backward(ctx, grad):
        qx, sx, qw, sw = ctx.saved_tensors
        m, k, n = ctx.sizes
        qg, sg = ctx.casts.quantize(_padded(grad), "output_gradient")
        return scaled_mm(qg, qw, sg, sw)[:m, :k], scaled_mm(qg.t(), qx, sg, sx)[:n, :k], None


class BlockNoise:
    """The bits of a stochastic recipe's gradient casts (BlockRecipe.stochastic): two fresh tensors of dy's shape
    per product, drawn on dy's device from the run's seed (harness.rounding.device_seed), as a stochastically
    rounded weight update draws its own; `given` (the kit's) in their place."""

    def __init__(self, seed: int | None, given=None):
        self.seed, self.given, self.generator = seed, given, None

    def __call__(self, dy):
        if self.given is not None:
            return self.given
        if self.generator is None:
            self.generator = torch.Generator(device=dy.device).manual_seed(self.seed)
        return draw_bits(dy.shape, self.generator), draw_bits(dy.shape, self.generator)


class BlockLinear(torch.autograd.Function):
    """x @ kernel^T, x [M, K] and F.linear's kernel [N, K], under a block-scaled recipe (harness.microscaling's
    BlockRecipe): the forward multiplies x and the canonical w = kernel^T [K, N] quantized along K, the backward
    quantizes dy, w, x afresh along each of its products' reduction axes (block_gradient_operands_with), all
    float32. The forward saves x and w themselves, not only their casts: the backward blocks them along other axes
    (a square weight tile's cast alone serves both products, so it is saved too)."""

    @staticmethod
    def forward(ctx, x, kernel, recipe: BlockRecipe, noise: BlockNoise | None):
        w = kernel.t()
        qx, qw = block_operands_with(OPS, x, w, recipe)
        ctx.save_for_backward(x, w, qw if recipe.tiled_weight else None)
        ctx.recipe, ctx.noise = recipe, noise
        return qx @ qw

    @staticmethod
    def backward(ctx, grad):
        x, w, qw = ctx.saved_tensors
        bits = ctx.noise(grad) if ctx.recipe.stochastic else None
        g_n, w_n, x_m, g_m = block_gradient_operands_with(OPS, x, w, grad, ctx.recipe, qw, bits)
        # dw = x_m^T g_m [K, N], returned in the kernel's layout [N, K]
        return g_n @ w_n.t(), g_m.t() @ x_m, None, None


def block_linear(x, kernel, recipe: BlockRecipe, noise: BlockNoise | None = None):
    """F.linear(x, kernel) without its bias under a block-scaled recipe, x [..., K]: its leading axes are the
    product's rows (a sequence's: samples x positions), blocked along M together; `noise` a stochastic recipe's
    bits."""
    y = BlockLinear.apply(x.reshape(-1, x.shape[-1]), kernel, recipe, noise)
    return y.reshape(*x.shape[:-1], kernel.shape[0])


def block_conv2d(x, kernel, recipe: BlockRecipe, stride: int, padding: tuple[int, int], dilation: int,
                 noise: BlockNoise | None = None):
    """F.conv2d(x, kernel) without its bias under a block-scaled recipe, x [N, C, H, W], kernel [F, C, k, k]: the
    core's rule (harness.microscaling.block_conv2d) multiplies the windows (im2col rows [N*Ho*Wo, k*k*C], taps in
    (i, j, c) order) by the kernel as a dense layer does (BlockLinear); F.unfold's rows are in (c, i, j) order, so
    both are permuted. unfold's backward (fold) adds each window's gradient back to the pixels it read."""
    n, c = x.shape[:2]
    f, k = kernel.shape[0], kernel.shape[-1]
    rows = F.unfold(x, k, dilation=dilation, padding=padding, stride=stride)  # [N, C*k*k, Ho*Wo]
    positions = rows.shape[-1]
    rows = rows.view(n, c, k, k, positions).permute(0, 4, 2, 3, 1).reshape(n * positions, k * k * c)
    y = BlockLinear.apply(rows, kernel.permute(0, 2, 3, 1).reshape(f, k * k * c), recipe, noise)
    ho = (x.shape[2] + 2 * padding[0] - dilation * (k - 1) - 1) // stride + 1
    return y.view(n, ho, positions // ho, f).permute(0, 3, 1, 2)


def matmul_layer(layer, product, x, kernel, bias, bias_shape=(-1,), name="product", blocked=block_linear):
    """product(x, kernel) + bias, with FP8's casts where the network trains in FP8 (the layer's fp8 casts of the
    product `name`); F.linear's through torch's FP8 matmuls where the policy is native. A layer with a block-scaled
    recipe runs `blocked`'s product (a dense or attention layer's F.linear: block_linear; a convolution's:
    block_conv2d), the bias added after it (its gradient dy's sum, uncast, as FP8's)."""
    if layer.blocks is not None:
        y = blocked(x, kernel, layer.blocks, layer.block_noise)
        return y if bias is None else y + bias.view(bias_shape)
    if layer.fp8 is None:
        return product(x, kernel, bias)
    casts = layer.fp8[name]
    if casts.policy.native and product is F.linear:
        y = NativeLinear.apply(x.reshape(-1, x.shape[-1]), kernel, casts).reshape(*x.shape[:-1], kernel.shape[0])
    else:
        y = Cast.apply(product(Cast.apply(x, casts, "input"), Cast.apply(kernel, casts, "weight"), None), casts, None)
    return y if bias is None else y + bias.view(bias_shape)


class Layer(nn.Module):
    """A spec layer; its weights are attributes named as in the canonical weights (kernel, gamma, ...), taken
    from the network being built (net.weights)."""

    #: its matmuls (matmul_layer's names), each given its FP8 casts where the network trains in FP8
    PRODUCTS: tuple[str, ...] = ()

    def __init__(self, info: LayerInfo, net: "Network"):
        super().__init__()
        self.info = info
        self.fp8 = nn.ModuleDict({name: Fp8Casts(net.fp8) for name in self.PRODUCTS}) \
            if net.fp8 and self.PRODUCTS else None
        # the block-scaled recipe of its products, if any: a dense, attention, conv2d or patches layer's (BLOCK_LAYERS)
        self.blocks = net.blocks if info.type in BLOCK_LAYERS else None
        self.block_noise = net.block_noise
        for name in info.params:
            canonical = f"{info.path}.{name}"
            # a copy: a view of the core's array (vectors and embedding tables keep their layout) would train it too
            value = torch.tensor(to_channels_first(net.weights[canonical], canonical))
            if name.startswith("moving_"):
                self.register_buffer(name, value)
            else:
                self.register_parameter(name, nn.Parameter(value))

    def dropped(self, x):
        """A dropout or attention layer's x times the core's mask for this step (self.mask, set by Network.forward),
        over 1 - self.rate, in training; torch's own RNG is never used."""
        if not self.training or self.rate == 0:
            return x
        if self.mask is None:
            raise HarnessError(f"{self.info.type} layer {self.info.path}: no dropout mask was given with the batch")
        return x * self.mask.to(x.dtype) / (1 - self.rate)


@LAYERS.builder("dense")
class Dense(Layer):
    PRODUCTS = ("product",)

    def forward(self, x):
        return matmul_layer(self, F.linear, x, self.kernel, getattr(self, "bias", None))


@LAYERS.builder("conv2d", "patches")
class Conv2D(Layer):
    """conv2d (torch's grouped and dilated convolution: its kernel [F, C/groups, k, k], output channel o from group
    o // (F/groups), is the spec's); patches is a conv2d of kernel and stride P whose [N, D, H/P, W/P] output is read
    as H/P * W/P patches in row-major order."""

    PRODUCTS = ("product",)

    def __init__(self, info, net):
        super().__init__(info, net)
        spec = info.spec
        self.patches = info.type == "patches"
        window, self.stride, padding, self.dilation, self.groups = (spec.size, spec.size, "valid", 1, 1) \
            if self.patches else (effective_kernel(spec), spec.strides, spec.padding, spec.dilation, spec.groups)
        self.padding = window_padding(info.in_shape, window, self.stride, padding)  # 'same' on the dilated window

    def forward(self, x):
        if self.padding.explicit:
            x = F.pad(x, _pad_arg(self.padding.explicit))
        y = matmul_layer(self, lambda x, k, b: F.conv2d(x, k, b, self.stride, self.padding.symmetric, self.dilation,
                                                        self.groups),
                         x, self.kernel, getattr(self, "bias", None), (1, -1, 1, 1),
                         blocked=lambda x, k, recipe, noise: block_conv2d(x, k, recipe, self.stride,
                                                                          self.padding.symmetric, self.dilation, noise))
        return y.flatten(2).transpose(1, 2) if self.patches else y


def _pad_arg(pads) -> tuple[int, int, int, int]:
    top, bottom, left, right = pads
    return left, right, top, bottom  # F.pad: last axis (W) first


@LAYERS.builder("zero_pad2d")
class ZeroPad2D(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.pads = _pad_arg(info.spec.pads)

    def forward(self, x):
        return F.pad(x, self.pads)


@LAYERS.builder("maxpool2d", "avgpool2d")
class Pool2D(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        spec = info.spec
        self.kind, self.k, self.s = spec.type, spec.pool_size, spec.strides or spec.pool_size
        self.padding = window_padding(info.in_shape, self.k, self.s, spec.padding)
        if self.kind == "avgpool2d" and self.padding.explicit:  # TF excludes padded pixels from the mean
            divisors = avgpool_divisors(info.in_shape, self.k, self.s, spec.padding)
            self.register_buffer("divisors", torch.from_numpy(divisors))

    def forward(self, x):
        if self.kind == "maxpool2d":
            if self.padding.explicit:
                x = F.pad(x, _pad_arg(self.padding.explicit), value=float("-inf"))
            return F.max_pool2d(x, self.k, self.s, self.padding.symmetric)
        if self.padding.explicit:
            sums = F.avg_pool2d(F.pad(x, _pad_arg(self.padding.explicit)), self.k, self.s, divisor_override=1)
            return sums / self.divisors.to(sums.dtype)
        return F.avg_pool2d(x, self.k, self.s, self.padding.symmetric, count_include_pad=False)


@LAYERS.builder("global_avgpool2d", "global_maxpool2d")
class GlobalPool2D(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.max, self.keepdims = info.type == "global_maxpool2d", info.spec.keepdims  # keepdims: [N, C, 1, 1]

    def forward(self, x):
        return x.amax(dim=(2, 3), keepdim=self.keepdims) if self.max else x.mean(dim=(2, 3), keepdim=self.keepdims)


@LAYERS.builder("rescaling")
class Rescaling(Layer):
    """x * scale + offset, per channel (NCHW's dim 1) or feature (the last axis), in the input's dtype (autocast
    casts no elementwise op: a float32 input stays float32, where Keras' Rescaling computes in the compute dtype)."""

    def __init__(self, info, net):
        super().__init__(info, net)
        shape = (-1, 1, 1) if len(info.in_shape) == 3 else (-1,)
        for name in ("scale", "offset"):  # constants, not weights: buffers, so that .to() gives them the dtype
            value = getattr(info.spec, name)
            self.register_buffer(name, torch.tensor(value if isinstance(value, list) else [value],
                                                    dtype=torch.float64).view(shape), persistent=False)

    def forward(self, x):
        return x * self.scale.to(x.dtype) + self.offset.to(x.dtype)


@LAYERS.builder("flatten")
class Flatten(Layer):
    def forward(self, x):
        return (x.permute(0, 2, 3, 1) if x.dim() == 4 else x).flatten(1)


ACTIVATIONS = {"relu": F.relu, "relu6": F.relu6, "silu": F.silu, "hard_swish": F.hardswish, "tanh": torch.tanh,
               "sigmoid": torch.sigmoid}


@LAYERS.builder("relu", "relu6", "silu", "hard_swish", "gelu", "tanh", "sigmoid", "softmax")
class Activation(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.type, self.approximate = info.type, "tanh" if getattr(info.spec, "approximate", False) else "none"

    def forward(self, x):
        if self.type == "gelu":
            return F.gelu(x, approximate=self.approximate)
        if self.type == "softmax":  # over the channel axis in NCHW, the last otherwise
            return torch.softmax(x, dim=1 if x.dim() == 4 else -1)
        return ACTIVATIONS[self.type](x)


@LAYERS.builder("batchnorm")
class BatchNorm(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.momentum, self.eps = info.spec.momentum, info.spec.epsilon

    def forward(self, x):
        if not self.training:
            return F.batch_norm(x, self.moving_mean, self.moving_variance, self.gamma, self.beta, False, 0.0, self.eps)
        # torch's own running-variance update uses the unbiased variance; the spec (like Keras and MXNet)
        # uses the biased one, so the running statistics are updated here instead.
        with torch.no_grad():
            dims = [d for d in range(x.dim()) if d != 1]
            var, mean = torch.var_mean(x if x.dtype == torch.float64 else x.float(), dim=dims, correction=0)
            m = self.momentum
            self.moving_mean.mul_(m).add_(mean.to(self.moving_mean.dtype), alpha=1 - m)
            self.moving_variance.mul_(m).add_(var.to(self.moving_variance.dtype), alpha=1 - m)
        return F.batch_norm(x, None, None, self.gamma, self.beta, True, 0.0, self.eps)


@LAYERS.builder("layernorm", "rmsnorm")
class Norm(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.rms, self.eps, self.channels = info.type == "rmsnorm", info.spec.epsilon, info.in_shape[-1]

    def forward(self, x):
        if self.rms:
            return F.rms_norm(x, (self.channels,), self.gamma, self.eps)  # epsilon inside the root, as the spec's
        nchw = x.dim() == 4  # normalized over the channels, the last axis of NHWC
        y = F.layer_norm(x.permute(0, 2, 3, 1) if nchw else x, (self.channels,), self.gamma, self.beta, self.eps)
        return y.permute(0, 3, 1, 2) if nchw else y


@LAYERS.builder("dropout")
class Dropout(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.rate, self.mask = info.spec.rate, None

    def forward(self, x):
        return self.dropped(x)


@LAYERS.builder("embedding")
class Embedding(Layer):
    def forward(self, ids):  # integer ids [N, T], never cast to a float dtype
        return F.embedding(ids, self.embeddings)


@LAYERS.builder("position_embedding")
class PositionEmbedding(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.length = info.in_shape[0]  # the table's first T rows

    def forward(self, x):
        return x + self.embeddings[:self.length]


SDPA = "sdpa"
UNFUSED = "unfused (attention dropout: the core's masks)"


def attention_kernel(spec) -> str:
    """Which attention an attention layer runs: SDPA without dropout, the unfused math with it."""
    return SDPA if spec.dropout == 0 else UNFUSED


def attention_mask(info, precision, device_kind: str) -> AttentionMask | None:
    """What a causal attention layer's mask leaves in the scores it masks, on a CPU as docs/diagnose.md ("Masks in
    16 bits", torch 2.13) has it: SDPA's flash kernel keeps -inf scores in float32 (the opmath type: read in
    aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), the unfused math masks in the compute dtype. On a GPU: None
    for SDPA (CUDA picks among its kernels; not measured); CUDA autocast runs the unfused softmax in float32 (its
    documented op list; not measured here)."""
    compute = precision.compute_dtype
    if attention_kernel(info.spec) == SDPA:
        if device_kind != "cpu":
            return None
        accumulate = "float64" if compute == "float64" else "float32"
        return AttentionMask(-math.inf, accumulate, accumulate, "safe")
    return AttentionMask(-math.inf, compute, "float32" if device_kind == "gpu" and precision.mixed else compute)


@LAYERS.builder("attention")
class Attention(Layer):
    """Multi-head self-attention. Without dropout: torch's fused F.scaled_dot_product_attention (its math is the
    spec's; on CPU torch 2.13 picks its flash kernel in every dtype, which matched the unfused math to 3e-16 in
    float64, forward and backward, and to 2e-7 in float32). With dropout: the math written out, because SDPA's
    dropout draws its own mask and the core's must be applied to the probabilities."""

    PRODUCTS = ("query", "key", "value", "output")

    def __init__(self, info, net):
        super().__init__(info, net)
        spec = info.spec
        length, dim = info.in_shape
        self.heads, self.head_dim, self.causal, self.rate = spec.heads, dim // spec.heads, spec.causal, spec.dropout
        self.group = spec.heads // spec.key_heads  # query heads per key/value head
        self.kernel = attention_kernel(spec)
        self.mask = None  # this step's dropout mask [N, H, T, T] (set by Network.forward)
        if self.causal and self.kernel == UNFUSED:  # the keys after the query's position (j > i)
            self.register_buffer("future", torch.ones(length, length, dtype=torch.bool).triu(1), persistent=False)
        self.rotary = spec.rotary is not None
        if self.rotary:  # float64 buffers: .to() gives them the parameters' dtype, as the spec takes them
            cos, signed_sin, partner = rotary_tables(length, self.head_dim, spec.rotary.base, spec.rotary.pairing)
            self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
            self.register_buffer("signed_sin", torch.from_numpy(signed_sin), persistent=False)
            self.register_buffer("partner", torch.from_numpy(partner), persistent=False)

    def forward(self, x):
        n, length, dim = x.shape
        q, k, v = (self._project(name, x).view(n, length, -1, self.head_dim).transpose(1, 2)
                   for name in ("query", "key", "value"))
        if self.rotary:
            q, k = self.rotate(q), self.rotate(k)
        if self.group > 1:  # Llama's repeat_kv: query head h reads key/value head h // group
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        heads = self.attend(q, k, v)  # [N, H, T, Dh]
        return self._project("output", heads.transpose(1, 2).reshape(n, length, dim))

    def rotate(self, x):
        """The spec's rotary rule (harness.model.rotary) on heads [N, H, T, Dh], the tables in x's dtype."""
        return x * self.cos.to(x.dtype) + x.index_select(-1, self.partner) * self.signed_sin.to(x.dtype)

    def _project(self, name, x):
        return matmul_layer(self, F.linear, x, getattr(self, f"{name}_kernel"), getattr(self, f"{name}_bias", None),
                            name=name)

    def attend(self, q, k, v):
        """softmax(q k^T / sqrt(Dh), causal) v per head, with the core's dropout on the probabilities in training."""
        if self.kernel == SDPA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=1 / math.sqrt(self.head_dim))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if self.causal:  # the future keys (j > i) at -inf
            scores = scores.masked_fill(self.future, float("-inf"))
        return self.dropped(torch.softmax(scores, dim=-1)) @ v


@LAYERS.builder("bias")
class Bias(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.shape = (-1, 1, 1) if len(info.in_shape) == 3 else (-1,)  # an image's channels are NCHW's dim 1

    def forward(self, x):
        return x + self.bias.view(self.shape)


@LAYERS.builder("sequence_pool")
class SequencePool(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.mode = info.spec.mode

    def forward(self, x):
        return x.mean(dim=1) if self.mode == "mean" else x[:, 0 if self.mode == "first" else -1]


@LAYERS.builder("residual")
class Residual(Layer):
    def __init__(self, info, net):
        super().__init__(info, net)
        self.main = net.build(info.spec.layers, f"{info.path}.layers.")
        self.projection = net.build(info.spec.projection or [], f"{info.path}.projection.")  # empty: the identity

    def forward(self, x):
        return self.main(x) + self.projection(x)


@LAYERS.builder("add", "multiply", "concat")
class Merge(Layer):
    """A merge of named tensors (its input: their list, in the order named): add and multiply broadcast as numpy
    does per sample, concat joins the channel axis (NCHW's dim 1) or a vector's or sequence's last. Its dtype is
    what torch's own +, * and cat give its inputs, as a residual block's sum is: a 16-bit and a float32 input give
    float32 (torch's type promotion; autocast casts none of the three down, and promotes cat's inputs to the
    widest)."""

    def __init__(self, info, net):
        super().__init__(info, net)
        rank = len(info.out_shape)
        self.image, self.concat = rank == 3, info.type == "concat"
        self.combine = operator.add if info.type == "add" else operator.mul
        # an input of a lower rank than the output is a vector or a sequence, in the canonical layout (torch's):
        # its per-sample shape with leading ones, as numpy aligns it (None: the input has the output's rank)
        self.aligned = [aligned_shape(shape, rank) if len(shape) < rank else None for shape in info.in_shapes]

    def forward(self, xs):
        if self.concat:
            return torch.cat(xs, dim=1 if self.image else -1)
        return functools.reduce(self.combine, (x if shape is None else self._aligned(x, shape)
                                               for x, shape in zip(xs, self.aligned)))

    def _aligned(self, x, shape):
        x = x.reshape(x.shape[0], *shape)
        return x.permute(0, 3, 1, 2) if self.image else x  # aligned as an NHWC image, then laid out as torch's


class Chain(nn.Sequential):
    """A list of layers, run as the spec wires them (harness.model.layers.run_list). A list without named tensors
    runs as nn.Sequential does: run_list would hold every layer's output until the list ends, which no chain did."""

    def __init__(self, layers: list[Layer]):
        super().__init__(*layers)
        self.wired = any(layer.info.sources != (index - 1,) for index, layer in enumerate(layers))

    def forward(self, x):
        if not self.wired:
            return super().forward(x)
        return run_list([(layer.info, layer) for layer in self], x, _call)


def _call(info, layer, value):
    return layer(value)


class Network(nn.Module):
    def __init__(self, layer_specs, graph: Graph, weights: dict[str, np.ndarray], fp8=None,
                 blocks: BlockRecipe | None = None, noise_seed: int | None = None):
        super().__init__()
        # while building only: the layers copy their weights from the canonical ones (Layer.__init__)
        self.infos, self.weights = {info.path: info for info in graph.layers}, weights
        self.fp8, self.blocks = fp8, blocks  # the layers' FP8 policy or block-scaled recipe, if any
        # a stochastic recipe's bits, one generator for the network's products
        self.block_noise = BlockNoise(noise_seed) if blocks is not None and blocks.stochastic else None
        self.layers = self.build(layer_specs, "")
        del self.infos, self.weights
        self._layers = [m for m in self.modules() if isinstance(m, Layer)]  # nested ones too, outer first
        self._owners = {f"{m.info.path}.{name}": (m, name) for m in self._layers for name in m.info.params}
        # the layers that take a dropout mask with each batch: dropout layers, and attention layers' probabilities
        self._masked = {m.info.path: m for m in self._layers if isinstance(m, (Dropout, Attention)) and m.rate > 0}
        #: which attention ran in each attention layer, by canonical path (the trainer's options["attention"])
        self.attention_kernels = {m.info.path: m.kernel for m in self._layers if isinstance(m, Attention)}
        #: how the FP8 products ran where not all emulated (the trainer's options["fp8"]["matmuls"])
        self.fp8_matmuls = None
        if fp8 is not None and fp8.native:
            convolutions = sorted({m.info.type for m in self._layers if isinstance(m, Conv2D)})
            self.fp8_matmuls = NATIVE_FP8 + (f"; {' and '.join(convolutions)} emulated (torch has no FP8 "
                                             f"convolution)" if convolutions else "")

    def build(self, specs, prefix: str) -> Chain:
        """The modules of `specs`, the layers at `prefix`0, `prefix`1..."""
        return Chain([LAYERS.build(self.infos[f"{prefix}{index}"], self) for index in range(len(specs))])

    def forward(self, x, masks=None):
        for path, layer in self._masked.items():
            layer.mask = masks.get(path) if masks else None
        return self.layers(x)

    @contextlib.contextmanager
    def scoped(self):
        """Profile mode: every layer's forward runs in a record_function range named layer_scope(path), opened and
        closed by hooks that exist only inside this context (a timed step runs no hook); yields the ranges' names."""
        ranges = []  # open ones, innermost last: a residual block's range holds its layers'

        def open_range(layer, args):
            ranges.append(torch.profiler.record_function(layer_scope(layer.info.path)).__enter__())

        def close_range(layer, args, out):
            ranges.pop().__exit__(None, None, None)

        with contextlib.ExitStack() as hooks:  # each removed on leaving
            for layer in self._layers:
                hooks.enter_context(layer.register_forward_pre_hook(open_range))
                hooks.enter_context(layer.register_forward_hook(close_range, always_call=True))
            yield {layer_scope(layer.info.path) for layer in self._layers}

    def layer_outputs(self, x):
        """(each layer's output by canonical path, the network's output): one forward with hooks."""
        outputs = {}
        with contextlib.ExitStack() as hooks:
            for layer in self._layers:
                hooks.enter_context(layer.register_forward_hook(
                    lambda m, args, out: outputs.__setitem__(m.info.path, out)))
            return outputs, self(x)

    @staticmethod
    def canonical_activation(t) -> np.ndarray:
        return _numpy(t.permute(0, 2, 3, 1) if t.dim() == 4 else t)  # NCHW -> the canonical NHWC

    def canonical_parameters(self) -> dict[str, nn.Parameter]:
        """The trainable weights by canonical name, in the order of parameters()."""
        return {name: getattr(module, attr) for name, (module, attr) in self._owners.items()
                if not attr.startswith("moving_")}

    def canonical_gradients(self) -> dict[str, np.ndarray]:
        """The trainable weights' current .grad in canonical names and layouts: copies, since on CPU the numpy array
        would share the gradient's memory, which clipping then scales in place."""
        return {name: np.array(from_channels_first(_numpy(p.grad), name))
                for name, p in self.canonical_parameters().items()}

    def canonical_weights(self) -> dict[str, np.ndarray]:
        return {name: from_channels_first(_numpy(getattr(module, attr)), name)
                for name, (module, attr) in self._owners.items()}


def _numpy(t) -> np.ndarray:
    """float32 numpy (float64 in a float64 run), whatever the tensor's dtype and device."""
    return (t if t.dtype == torch.float64 else t.float()).detach().cpu().numpy()
