"""Is the harness's training step as fast as the plain loop a user of the framework writes? Run one framework per
invocation, with that framework's env python:

    .tox/mxnet/bin/python benchmarks/overhead.py --framework mxnet       # likewise torch, tensorflow, jax

Three models (mnist_mlp at batch 64; small_convnet at 112x168, batch 32; transformer_block, the spec file
benchmarks/transformer_block.yaml: one pre-norm GPT block, d 64, 4 causal heads, T 64, batch 32) and, in torch, a
native one (below) in fp32 and amp_bf16 (`--precision` adds amp_fp16 for the native one), on the CPU with 2 threads. Each precision runs in its own process (Keras' global dtype policy, MXNet's
amp.init and JAX's config are process-wide), which builds the harness's trainer exactly as `amp-harness run` does
(harness.run.worker: the core's weights, no loss scaling), in the variant whose memory layout and execution match
the plain loop's (HARNESS_VARIANT: torch `eager`, NCHW like the plain loop), and a plain loop for the same network,
then alternates rounds of the two (A B, B A, ...) so that background load hits both sides alike.

- harness: `trainer.to_device` outside the clock, `trainer.train_step` timed per step (it returns once the device
  has finished); a round's figure is the median over its steps, or their mean against model.fit.
- plain networks: a stack of layers (dense, conv, pooling, flatten, activations) for the MLP and the convnet; for a
  spec with attention the framework's own transformer pieces, built from the spec's Transformer shape (token
  embedding, a learned position table, pre-norm blocks of causal multi-head attention and a GELU MLP, a final
  layernorm, a dense head), no dropout; next-token losses are the mean over every token.
- plain, torch: eager modules (NCHW, contiguous): an nn.Sequential, or nn.Embedding, a position nn.Parameter and
  nn.TransformerEncoderLayer (norm_first, batch_first, gelu, its causal mask: SDPA with is_causal), nn.LayerNorm,
  nn.Linear; torch.optim, F.cross_entropy / F.binary_cross_entropy, torch.autocast for amp_bf16, `loss.item()` each
  step; timed per step.
- plain, tensorflow: `model.fit` on a keras.Sequential of the same layers, or a functional keras.Model of Embedding,
  a custom position-embedding layer, LayerNormalization, MultiHeadAttention(use_causal_mask=True), Dense and gelu,
  under the same dtype policy, Keras' own optimizer and loss, compiled with Keras' defaults; a round is a warm-up
  fit, then one fit of --steps batches, timed from the first step's start to the epoch's end (after fit's sync) and
  divided by the steps. fit does not sync each step, so this is a mean; its per-call and per-epoch setup (data
  adapter, callback list, dataset iterator), which a real fit pays once, is left out: over 20 steps it would add a
  third or more. So both sides' figures are means here; a second line shows fit's whole call's time per step.
- plain, mxnet: a gluon.nn.HybridSequential (for the transformer: Embedding, LayerNorm, Dense(flatten=False), GELU
  and HybridBlocks of their own for the position table, residuals and batch_dot attention with a constant causal
  mask) hybridized with static_alloc/static_shape, gluon.Trainer with MXNet's own optimizer of the spec's type,
  gluon.loss, contrib.amp for amp_bf16, `mx.nd.waitall()` after every step and the batch loss read back (`asscalar`,
  as the harness's step and torch's `loss.item()`); timed per step. MXNet's bf16 needs AVX-512 (oneDNN): on a CPU
  without it the amp_bf16 worker fails (run --precision fp32 there).
- plain, jax: jax.numpy layers on a params pytree (NHWC, lax.conv_general_dilated with HWIO kernels,
  lax.reduce_window pooling; for the transformer an embedding gather, layernorm written out and
  jax.nn.dot_product_attention(is_causal=True) on [B, T, H, Dh]), the spec's optimizer written out (no optax in the
  env), one train step under jax.jit with jax.value_and_grad, params and optimizer state donated as the harness
  donates its own; amp_bf16 as JAX users write it: float32 master weights, params and float inputs (not token ids)
  cast to bfloat16 inside the step, the loss in float32; `jax.block_until_ready` on the loss each step; timed per
  step. It runs under the JAX config the harness's build set (matmul precision `highest` in fp32), being traced
  after it in one process.

- native (torch only: benchmarks/native_encoder.yaml, the user's own nn.TransformerEncoder model, docs/native.md):
  the harness builds and trains the module as `run` does (its precision's default loss scaling: GradScaler in
  amp_fp16); the plain loop is the same module, made under the same seed, with torch.optim.AdamW, torch.autocast,
  GradScaler for float16, F.cross_entropy and `loss.item()` each step. Precisions fp32, amp_bf16 and amp_fp16.

Plain loops use their framework's initialisers (the values do not change the work done). Each row prints the
per-round figures of both sides and the ratio harness / plain of their medians over rounds; the last line names each
ratio over MAX_RATIO (1.05), or says there is none.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the harness is importable
    sys.path.insert(0, str(ROOT))

FRAMEWORKS = ("torch", "tensorflow", "mxnet", "jax")
PRECISIONS = ("fp32", "amp_bf16")
# (a built-in model's name or a spec file's path, batch size, input size); --model names one by its file's stem
MODELS = (("mnist_mlp", 64, None), ("small_convnet", 32, (112, 168)),
          (str(ROOT / "benchmarks" / "transformer_block.yaml"), 32, None),
          (str(ROOT / "benchmarks" / "native_encoder.yaml"), 32, None))  # a native spec: torch only
NATIVE_PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")  # a native model's plain loop: autocast, GradScaler for fp16
THREADS = 2
RESULT = "RESULT "  # the prefix of a worker's result lines on stdout (frameworks print their own lines)


def model_name(source: str) -> str:
    """A MODELS entry's name: the built-in model's, or the spec file's stem."""
    return Path(source).stem


# ---- plain loops: build(spec, graph, precision) -> run(batches, warmup) -> ms per step ----------------------
def per_step(batches, warmup: int, prepare, step) -> dict:
    """Each batch made ready by prepare(i, x, y) outside the clock, then step(*it) timed: the median and mean ms of
    the steps after the first `warmup`."""
    times = []
    for i, (x, y) in enumerate(batches):
        ready = prepare(i, x, y)
        t0 = time.perf_counter_ns()
        step(*ready)
        if i >= warmup:
            times.append((time.perf_counter_ns() - t0) / 1e6)
    return {"median_ms": statistics.median(times), "mean_ms": statistics.mean(times)}


# Each framework's loop builds one of two networks (_plain_network): a stack of layers, or a transformer
@dataclass(frozen=True)
class Transformer:
    """What the plain transformer networks build: token ids [T] in [0, vocab), an embedding of width dim plus a
    learned position table, `blocks` pre-norm blocks (x + attention(layernorm(x)), then
    x + dense(gelu(dense_hidden(layernorm(x))))), a final layernorm and a dense head of `outputs` logits per token."""

    vocab: int
    length: int
    dim: int
    heads: int
    causal: bool
    hidden: int
    epsilon: float  # every layernorm's (torch's nn.TransformerEncoderLayer takes one for both of its norms)
    blocks: int
    outputs: int


def _has_attention(layers) -> bool:
    return any(layer.type == "attention" or (layer.type == "residual" and _has_attention(layer.layers))
               for layer in layers)


def _transformer(spec) -> Transformer:
    """The spec as a Transformer, or exit naming the first layer the plain transformer networks do not build."""
    def refuse(where: str, what: str):
        raise SystemExit(f"{spec.name}: layers{where}: the plain transformer loops here need {what}")

    layers = spec.layers
    if not spec.tokens or [layer.type for layer in layers[:2]] != ["embedding", "position_embedding"] \
            or layers[1].max_length not in (None, spec.input.shape[0]):
        refuse("[0:2]", "token ids, an embedding and a position_embedding of the sequence's length")
    if [layer.type for layer in layers[-2:]] != ["layernorm", "dense"] or not layers[-1].use_bias:
        refuse(f"[{len(layers) - 2}:]", "a final layernorm and a dense head with a bias")
    body, epsilon = layers[2:-2], layers[-2].epsilon
    if not body or len(body) % 2:
        refuse(f"[2:{len(layers) - 2}]", "pre-norm blocks: pairs of residual blocks, attention then MLP")
    attention, hidden = None, None
    for at in range(2, len(layers) - 2, 2):
        mixer, mlp = (layers[at].layers, layers[at + 1].layers) \
            if layers[at].type == layers[at + 1].type == "residual" else ((), ())
        types = [layer.type for layer in mixer], [layer.type for layer in mlp]
        if types != (["layernorm", "attention"], ["layernorm", "dense", "gelu", "dense"]) \
                or layers[at].projection or layers[at + 1].projection:
            refuse(f"[{at}:{at + 2}]", "residual[layernorm, attention], residual[layernorm, dense, gelu, dense]")
        if mixer[1].dropout or not mixer[1].use_bias or mlp[2].approximate \
                or not (mlp[1].use_bias and mlp[3].use_bias) or {mixer[0].epsilon, mlp[0].epsilon} != {epsilon}:
            refuse(f"[{at}:{at + 2}]", "attention without dropout, biases everywhere, the erf gelu and every "
                                       "layernorm's epsilon the same")
        if (attention or mixer[1]) != mixer[1] or hidden not in (None, mlp[1].units):
            refuse(f"[{at}:{at + 2}]", "every block alike")
        attention, hidden = mixer[1], mlp[1].units
    return Transformer(spec.input.vocab, spec.input.shape[0], layers[0].dim, attention.heads, attention.causal,
                       hidden, epsilon, len(body) // 2, layers[-1].units)


def _plain_network(spec, graph, stack, transformer):
    """The framework's plain network for the spec: `transformer(Transformer)` where it has attention, else
    `stack(spec, graph)`, a stack of the layers the plain loops know."""
    if _has_attention(spec.layers):
        return transformer(_transformer(spec))
    have = {"dense", "conv2d", "maxpool2d", "avgpool2d", "flatten", "relu", "sigmoid", "tanh"}
    for layer in spec.layers:
        if layer.type not in have or getattr(layer, "padding", "valid") != "valid":
            raise SystemExit(f"{spec.name}: the plain loops here have no {layer.type!r} layer with these settings")
    return stack(spec, graph)


def _torch_stack(spec, graph):
    from torch import nn

    modules = []
    for info in graph.layers:
        layer, t = info.spec, info.spec.type
        if t == "dense":
            modules.append(nn.Linear(info.in_shape[-1], layer.units, bias=layer.use_bias))
        elif t == "conv2d":
            modules.append(nn.Conv2d(info.in_shape[-1], layer.filters, layer.kernel_size, layer.strides,
                                     bias=layer.use_bias))
        elif t == "maxpool2d":
            modules.append(nn.MaxPool2d(layer.pool_size, layer.strides or layer.pool_size))
        elif t == "avgpool2d":
            modules.append(nn.AvgPool2d(layer.pool_size, layer.strides or layer.pool_size))
        elif t == "flatten":
            modules.append(nn.Flatten())
        else:
            modules.append({"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}[t]())
    return nn.Sequential(*modules)


def _torch_transformer(shape: Transformer):
    import torch
    from torch import nn

    class TokenTransformer(nn.Module):
        """torch's own pre-norm block, nn.TransformerEncoderLayer (norm_first), with a causal mask: the
        documented way to build a GPT-style decoder-only stack from torch.nn."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(shape.vocab, shape.dim)
            self.position = nn.Parameter(torch.randn(shape.length, shape.dim) * 0.02)  # GPT-2's init
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(shape.dim, shape.heads, shape.hidden, dropout=0.0, activation="gelu",
                                           layer_norm_eps=shape.epsilon, batch_first=True, norm_first=True)
                for _ in range(shape.blocks))
            self.norm = nn.LayerNorm(shape.dim, shape.epsilon)
            self.head = nn.Linear(shape.dim, shape.outputs)
            mask = nn.Transformer.generate_square_subsequent_mask(shape.length) if shape.causal else None
            self.register_buffer("mask", mask, persistent=False)

        def forward(self, ids):
            x = self.embed(ids) + self.position
            for block in self.blocks:  # is_causal with the mask: MHA then calls SDPA with is_causal, no mask
                x = block(x, src_mask=self.mask, is_causal=shape.causal)
            return self.head(self.norm(x))

    return TokenTransformer()


def plain_torch(spec, graph, precision):
    import contextlib

    import torch
    import torch.nn.functional as F

    net = _plain_network(spec, graph, _torch_stack, _torch_transformer).train()
    opt = spec.optimizer
    if opt.type == "adam":
        optimizer = torch.optim.Adam(net.parameters(), opt.learning_rate, (opt.beta_1, opt.beta_2), opt.epsilon)
    elif opt.type == "rmsprop":
        optimizer = torch.optim.RMSprop(net.parameters(), opt.learning_rate, alpha=opt.rho, eps=opt.epsilon)
    else:
        optimizer = torch.optim.SGD(net.parameters(), opt.learning_rate, opt.momentum, nesterov=opt.nesterov)
    categorical = spec.loss.type == "sparse_categorical_crossentropy"

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if precision.mixed else contextlib.nullcontext()

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            out = net(x)
        out = out.float()
        if categorical:  # next-token logits [B, T, V]: the mean over every token
            loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
        else:
            loss = F.binary_cross_entropy(out[:, 0], y) if not spec.loss.from_logits \
                else F.binary_cross_entropy_with_logits(out[:, 0], y)
        loss.backward()
        optimizer.step()
        return loss.item()

    def prepare(i, x, y):
        x = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous() if x.ndim == 4 else torch.from_numpy(x)
        return x, torch.from_numpy(y) if categorical else torch.from_numpy(y).float()

    return lambda batches, warmup: per_step(batches, warmup, prepare, step)


def _keras_stack(spec, graph):
    import keras

    layers = [keras.Input(tuple(spec.input.shape))]
    for layer in spec.layers:
        t = layer.type
        if t == "dense":
            layers.append(keras.layers.Dense(layer.units, use_bias=layer.use_bias))
        elif t == "conv2d":
            layers.append(keras.layers.Conv2D(layer.filters, layer.kernel_size, layer.strides, use_bias=layer.use_bias))
        elif t == "maxpool2d":
            layers.append(keras.layers.MaxPooling2D(layer.pool_size, layer.strides))
        elif t == "avgpool2d":
            layers.append(keras.layers.AveragePooling2D(layer.pool_size, layer.strides))
        elif t == "flatten":
            layers.append(keras.layers.Flatten())
        else:
            layers.append(keras.layers.Activation(t))
    return keras.Sequential(layers)


def _keras_transformer(shape: Transformer):
    import keras

    class PositionEmbedding(keras.layers.Layer):
        """A learned [T, D] table added to the token embeddings (keras_hub's PositionEmbedding, which is not in
        this env, written out as Keras' guide to custom layers writes one)."""

        def build(self, input_shape):
            self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="glorot_uniform",
                                         name="embeddings")

        def call(self, x):
            return x + self.table  # the float32 variable autocast to the compute dtype under a mixed policy

    ids = keras.Input((shape.length,), dtype="int32")
    x = PositionEmbedding()(keras.layers.Embedding(shape.vocab, shape.dim)(ids))
    for _ in range(shape.blocks):
        h = keras.layers.LayerNormalization(epsilon=shape.epsilon)(x)
        h = keras.layers.MultiHeadAttention(shape.heads, shape.dim // shape.heads)(h, h, use_causal_mask=shape.causal)
        x = keras.layers.Add()([x, h])
        h = keras.layers.LayerNormalization(epsilon=shape.epsilon)(x)
        h = keras.layers.Activation("gelu")(keras.layers.Dense(shape.hidden)(h))  # Keras' gelu: the erf form
        x = keras.layers.Add()([x, keras.layers.Dense(shape.dim)(h)])
    x = keras.layers.LayerNormalization(epsilon=shape.epsilon)(x)
    return keras.Model(ids, keras.layers.Dense(shape.outputs)(x))


def plain_tensorflow(spec, graph, precision):
    import keras
    import numpy as np

    # the policy before the first layer is built: layers take it when they are created
    keras.mixed_precision.set_global_policy(f"mixed_{precision.compute_dtype}" if precision.mixed else "float32")
    model = _plain_network(spec, graph, _keras_stack, _keras_transformer)
    opt = spec.optimizer
    if opt.type == "adam":
        optimizer = keras.optimizers.Adam(opt.learning_rate, opt.beta_1, opt.beta_2, opt.epsilon)
    elif opt.type == "rmsprop":
        optimizer = keras.optimizers.RMSprop(opt.learning_rate, opt.rho, epsilon=opt.epsilon)
    else:
        optimizer = keras.optimizers.SGD(opt.learning_rate, opt.momentum, opt.nesterov)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=spec.loss.from_logits) \
        if spec.loss.type == "sparse_categorical_crossentropy" \
        else keras.losses.BinaryCrossentropy(from_logits=spec.loss.from_logits)
    model.compile(optimizer=optimizer, loss=loss)

    class EpochClock(keras.callbacks.Callback):
        """fit's steps, from the first one's start to the epoch's end (after fit's sync); not fit's per-call and
        per-epoch setup (data adapter, callback list, iterator), which a real fit pays once. No batch-end hook:
        fit's batch-end dispatch stays asynchronous, as without a callback."""

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.start = time.perf_counter_ns()

        def on_epoch_end(self, epoch, logs=None):
            self.end = time.perf_counter_ns()

    clock = EpochClock()

    def run(batches, warmup):
        x = np.concatenate([b[0] for b in batches])
        y = np.concatenate([b[1] for b in batches])
        n, size = len(batches) - warmup, len(batches[0][1])
        model.fit(x[:warmup * size], y[:warmup * size], batch_size=size, epochs=1, shuffle=False, verbose=0)
        t0 = time.perf_counter_ns()
        model.fit(x[warmup * size:], y[warmup * size:], batch_size=size, epochs=1, shuffle=False, verbose=0,
                  callbacks=[clock])
        wall = (time.perf_counter_ns() - t0) / 1e6 / n
        return {"mean_ms": (clock.end - clock.start) / 1e6 / n, "fit_wall_ms": wall}  # fit times no single step

    return run


def _gluon_stack(spec, graph):
    from mxnet import gluon

    net = gluon.nn.HybridSequential()
    for layer in spec.layers:
        t = layer.type
        if t == "dense":
            net.add(gluon.nn.Dense(layer.units, use_bias=layer.use_bias))
        elif t == "conv2d":
            net.add(gluon.nn.Conv2D(layer.filters, layer.kernel_size, layer.strides, use_bias=layer.use_bias))
        elif t == "maxpool2d":
            net.add(gluon.nn.MaxPool2D(layer.pool_size, layer.strides))
        elif t == "avgpool2d":
            net.add(gluon.nn.AvgPool2D(layer.pool_size, layer.strides))
        elif t == "flatten":
            net.add(gluon.nn.Flatten())
        else:
            net.add(gluon.nn.Activation(t))
    return net


def _gluon_transformer(shape: Transformer):
    import math

    import numpy as np
    from mxnet import gluon

    nn = gluon.nn

    class PositionEmbedding(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.table = self.params.get("embeddings", shape=(shape.length, shape.dim))

        def hybrid_forward(self, F, x, table):
            return F.broadcast_add(x, F.expand_dims(table, 0))

    class SelfAttention(gluon.HybridBlock):
        """Multi-head self-attention from batch_dot, the heads folded into the batch axis ([B*H, T, Dh]); the
        causal mask a constant added to the scores (-inf above the diagonal)."""

        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.query, self.key, self.value, self.out = (nn.Dense(shape.dim, flatten=False) for _ in range(4))
                if shape.causal:
                    self.mask = self.params.get_constant(
                        "causal_mask", np.triu(np.full((shape.length, shape.length), -np.inf, np.float32), 1))

        def hybrid_forward(self, F, x, mask=None):
            def split(t):  # [B, T, D] -> [B, T, H, Dh] -> [B, H, T, Dh] -> [B*H, T, Dh]
                return t.reshape((0, 0, shape.heads, -1)).transpose((0, 2, 1, 3)).reshape((-3, 0, 0))

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            scores = F.batch_dot(q, k, transpose_b=True) / math.sqrt(shape.dim // shape.heads)
            if mask is not None:
                scores = F.broadcast_add(scores, F.expand_dims(mask, 0))
            heads = F.batch_dot(F.softmax(scores, axis=-1), v)  # [B*H, T, Dh] -> [B, T, D], heads in order
            return self.out(heads.reshape((-4, -1, shape.heads, 0, 0)).transpose((0, 2, 1, 3)).reshape((0, 0, -3)))

    class Residual(gluon.HybridBlock):
        def __init__(self, *layers):
            super().__init__()
            with self.name_scope():
                self.body = nn.HybridSequential()
                self.body.add(*layers)

        def hybrid_forward(self, F, x):
            return x + self.body(x)

    net = nn.HybridSequential()
    with net.name_scope():
        net.add(nn.Embedding(shape.vocab, shape.dim), PositionEmbedding())
        for _ in range(shape.blocks):
            net.add(Residual(nn.LayerNorm(epsilon=shape.epsilon), SelfAttention()),
                    Residual(nn.LayerNorm(epsilon=shape.epsilon), nn.Dense(shape.hidden, flatten=False), nn.GELU(),
                             nn.Dense(shape.dim, flatten=False)))
        net.add(nn.LayerNorm(epsilon=shape.epsilon), nn.Dense(shape.outputs, flatten=False))
    return net


def plain_mxnet(spec, graph, precision):
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.contrib import amp

    if precision.mixed:
        amp.init(target_dtype=precision.compute_dtype)  # before the network is built; once per process
    net = _plain_network(spec, graph, _gluon_stack, _gluon_transformer)
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    opt = spec.optimizer
    if opt.type == "adam":
        trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": opt.learning_rate,
                                "beta1": opt.beta_1, "beta2": opt.beta_2, "epsilon": opt.epsilon})
    elif opt.type == "rmsprop":
        trainer = gluon.Trainer(net.collect_params(), "rmsprop", {"learning_rate": opt.learning_rate,
                                "gamma1": opt.rho, "epsilon": opt.epsilon})
    else:
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": opt.learning_rate,
                                "momentum": opt.momentum})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss(from_logits=False) \
        if spec.loss.type == "sparse_categorical_crossentropy" \
        else gluon.loss.SigmoidBinaryCrossEntropyLoss(from_sigmoid=not spec.loss.from_logits)

    def step(x, y):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        mx.nd.waitall()
        return loss.mean().asscalar()  # the batch loss read back each step, as the harness step and torch's loop do

    def prepare(i, x, y):
        x, y = mx.nd.array(x.transpose(0, 3, 1, 2) if x.ndim == 4 else x), mx.nd.array(y)
        mx.nd.waitall()
        return x, y

    return lambda batches, warmup: per_step(batches, warmup, prepare, step)


def _jax_stack(spec, graph):
    """(params, apply): params as a pytree, one dict per layer, in JAX's own layouts (graph's shapes: [in, out]
    dense kernels, HWIO conv kernels), lecun_normal kernels and zero biases (Flax's defaults)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    init, keys = jax.nn.initializers.lecun_normal(), jax.random.split(jax.random.key(spec.seed), len(graph.layers))
    params = [{name: init(key, shape) if name == "kernel" else jnp.zeros(shape) for name, shape in info.params.items()}
              for info, key in zip(graph.layers, keys)]

    def apply(params, x):
        for layer, p in zip(spec.layers, params):
            t = layer.type
            if t == "dense":
                x = x @ p["kernel"] + p["bias"] if layer.use_bias else x @ p["kernel"]
            elif t == "conv2d":
                s = layer.strides
                x = lax.conv_general_dilated(x, p["kernel"], (s, s), "VALID",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
                x = x + p["bias"] if layer.use_bias else x
            elif t in ("maxpool2d", "avgpool2d"):
                k, s = layer.pool_size, layer.strides or layer.pool_size
                if t == "maxpool2d":
                    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, k, k, 1), (1, s, s, 1), "VALID")
                else:
                    x = lax.reduce_window(x, 0.0, lax.add, (1, k, k, 1), (1, s, s, 1), "VALID") / (k * k)
            elif t == "flatten":
                x = x.reshape(x.shape[0], -1)
            else:
                x = {"relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}[t](x)
        return x

    return params, apply


def _jax_transformer(shape: Transformer):
    """(params, apply): a params pytree of dicts, [in, out] kernels (lecun_normal, zero biases, Flax's defaults),
    embeddings normal(0.02); attention by jax.nn.dot_product_attention on [B, T, H, Dh]."""
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(jax.random.key(0), 4 + 6 * shape.blocks))
    kernel, embedding = jax.nn.initializers.lecun_normal(), jax.nn.initializers.normal(0.02)

    def dense(n_in, n_out):
        return {"kernel": kernel(next(keys), (n_in, n_out)), "bias": jnp.zeros(n_out)}

    def norm():
        return {"gamma": jnp.ones(shape.dim), "beta": jnp.zeros(shape.dim)}

    d = shape.dim
    params = {"embed": embedding(next(keys), (shape.vocab, d)), "position": embedding(next(keys), (shape.length, d)),
              "blocks": [{"norm1": norm(), "query": dense(d, d), "key": dense(d, d), "value": dense(d, d),
                          "out": dense(d, d), "norm2": norm(), "up": dense(d, shape.hidden),
                          "down": dense(shape.hidden, d)} for _ in range(shape.blocks)],
              "norm": norm(), "head": dense(d, shape.outputs)}

    def linear(p, x):
        return x @ p["kernel"] + p["bias"]

    def layer_norm(p, x):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + shape.epsilon) * p["gamma"] + p["beta"]

    def apply(params, ids):
        x = params["embed"][ids] + params["position"]
        b, t = ids.shape
        for p in params["blocks"]:
            h = layer_norm(p["norm1"], x)
            q, k, v = (linear(p[n], h).reshape(b, t, shape.heads, -1) for n in ("query", "key", "value"))
            x = x + linear(p["out"], jax.nn.dot_product_attention(q, k, v, is_causal=shape.causal).reshape(b, t, d))
            h = layer_norm(p["norm2"], x)
            x = x + linear(p["down"], jax.nn.gelu(linear(p["up"], h), approximate=False))
        return linear(params["head"], layer_norm(params["norm"], x))

    return params, apply


def plain_jax(spec, graph, precision):
    import jax
    import jax.numpy as jnp
    import numpy as np

    params, apply = _plain_network(spec, graph, _jax_stack, _jax_transformer)
    compute = jnp.dtype(precision.compute_dtype)

    def forward(params, x):
        if precision.mixed:  # float32 master weights; the forward in the compute dtype, params and inputs cast
            params = jax.tree.map(lambda w: w.astype(compute), params)
            x = x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x  # token ids stay ids
        return apply(params, x).astype(jnp.float32)  # the loss in float32

    def loss_of(params, x, y):
        out = forward(params, x)
        if spec.loss.type == "sparse_categorical_crossentropy":
            logp = jax.nn.log_softmax(out) if spec.loss.from_logits else jnp.log(jnp.clip(out, 1e-7, 1 - 1e-7))
            return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()  # every token's
        z, y = out[:, 0], y.astype(jnp.float32)
        if spec.loss.from_logits:
            return (jax.nn.relu(z) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))).mean()
        z = jnp.clip(z, 1e-7, 1 - 1e-7)
        return -(y * jnp.log(z) + (1 - y) * jnp.log(1 - z)).mean()

    # the spec's optimizer written out (optax is not in the jax env): (init, update) on pytrees
    opt, tree = spec.optimizer, jax.tree.map
    if opt.type == "adam":
        def update(grads, state, params):
            count = state["count"] + 1
            m = tree(lambda m, g: opt.beta_1 * m + (1 - opt.beta_1) * g, state["m"], grads)
            v = tree(lambda v, g: opt.beta_2 * v + (1 - opt.beta_2) * g * g, state["v"], grads)
            c1, c2 = 1 - opt.beta_1 ** count, 1 - opt.beta_2 ** count
            params = tree(lambda p, m, v: p - opt.learning_rate * (m / c1) / (jnp.sqrt(v / c2) + opt.epsilon),
                          params, m, v)
            return params, {"count": count, "m": m, "v": v}

        state = {"count": jnp.zeros((), jnp.int32), "m": tree(jnp.zeros_like, params),
                 "v": tree(jnp.zeros_like, params)}
    elif opt.type == "rmsprop":
        inside = opt.epsilon_placement == "inside"

        def update(grads, state, params):
            sq = tree(lambda v, g: opt.rho * v + (1 - opt.rho) * g * g, state, grads)
            denom = tree(lambda v: jnp.sqrt(v + opt.epsilon) if inside else jnp.sqrt(v) + opt.epsilon, sq)
            return tree(lambda p, g, d: p - opt.learning_rate * g / d, params, grads, denom), sq

        state = tree(jnp.zeros_like, params)
    else:
        def update(grads, state, params):
            if opt.momentum == 0:
                return tree(lambda p, g: p - opt.learning_rate * g, params, grads), state
            buf = tree(lambda b, g: opt.momentum * b + g, state, grads)
            step = tree(lambda g, b: g + opt.momentum * b, grads, buf) if opt.nesterov else buf
            return tree(lambda p, d: p - opt.learning_rate * d, params, step), buf

        state = tree(jnp.zeros_like, params)

    def train_step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_of)(params, x, y)
        params, state = update(grads, state, params)
        return params, state, loss

    # params and optimizer state donated, as the harness's step donates its own: JAX's documented idiom for a
    # step that replaces its state, and the same computation as the harness's, so the ratio is not a donation
    # difference (on this CPU the MLP's step without donation was within the noise of the loaded machine)
    step = jax.jit(train_step, donate_argnums=(0, 1))
    weights = [params, state]

    def stepped(x, y):
        weights[0], weights[1], loss = step(*weights, x, y)
        jax.block_until_ready(loss)

    return lambda batches, warmup: per_step(
        batches, warmup, lambda i, x, y: jax.block_until_ready((jax.device_put(x), jax.device_put(y.astype(np.int32)))),
        stepped)


PLAIN = {"torch": plain_torch, "tensorflow": plain_tensorflow, "mxnet": plain_mxnet, "jax": plain_jax}
# the harness's variant that runs what the plain loop runs: the same memory layout (torch's default variant,
# channels_last, is another layout than the plain NCHW loop's) and the same execution (a graph, a cached graph)
HARNESS_VARIANT = {"torch": "eager", "tensorflow": "graph", "mxnet": "hybridized", "jax": "jit"}
MAX_RATIO = 1.05  # the harness may cost at most 5% over the plain loop


def plain_native_torch(spec, precision):
    """The user's own module (a native spec's) in the loop its users write: torch.optim.AdamW (or the spec's
    optimizer's torch class), torch.autocast, GradScaler for float16, F.cross_entropy, `loss.item()` each step."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from amp_harness_torch.native import load, logits

    torch.manual_seed(spec.seed)
    net = load(spec).train()
    opt = spec.optimizer
    optimizer = torch.optim.AdamW(net.parameters(), opt.learning_rate, (opt.beta_1, opt.beta_2), opt.epsilon,
                                  opt.weight_decay)
    dtype = getattr(torch, precision.compute_dtype) if precision.mixed else None
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            out = logits(net(x))
        loss = F.cross_entropy(out.float().flatten(0, -2), y.flatten())
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.item()

    return lambda batches, warmup: per_step(batches, warmup, lambda i, x, y: (torch.from_numpy(x), torch.from_numpy(y)),
                                            step)


# ---- the harness side, as harness.run.worker builds and times it --------------------------------------------
def harness_loop(adapter, spec, graph, precision, masks):
    from harness.model.weights import initial_weights
    from harness.precision import LossScale, parse_loss_scale

    # a native spec's model (graph None) with the loss scale its precision has by default, as `run` gives it
    loss_scale = LossScale() if graph else parse_loss_scale(None, precision)
    trainer = adapter.build(spec, graph, initial_weights(graph, spec.seed) if graph else None, precision, loss_scale,
                            adapter.device("cpu"), HARNESS_VARIANT[adapter.name])

    return lambda batches, warmup: per_step(
        batches, warmup, lambda i, x, y: (trainer.to_device(x, y, masks.for_step(i, len(y))),), trainer.train_step)


def worker(framework: str, precision_name: str, rounds: int, steps: int, warmup: int, models: list[str]) -> None:
    """One (framework, precision): each model, harness and plain rounds alternating; one result line each."""
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # MXNet reads it when imported
    from harness.adapter import load_adapter
    from harness.model.data import Data
    from harness.model.dropout import DropoutMasks
    from harness.model.graph import infer
    from harness.model.spec import load_spec
    from harness.precision import parse_precision

    adapter = load_adapter(framework)
    adapter.set_threads(THREADS)
    precision = parse_precision(precision_name)
    for source, batch_size, input_size in (m for m in MODELS if model_name(m[0]) in models):
        model, spec = model_name(source), load_spec(source).with_overrides(batch_size, None, input_size)
        if spec.native is not None and (framework != "torch" or precision_name not in NATIVE_PRECISIONS):
            continue
        graph, data = (infer(spec) if spec.native is None else None), Data(spec)
        batches = [data.train_batch(step) for step in range(warmup + steps)]
        sides = {"harness": harness_loop(adapter, spec, graph, precision, DropoutMasks(graph, spec.seed)),
                 "plain": PLAIN[framework](spec, graph, precision) if graph else plain_native_torch(spec, precision)}
        for side in sides.values():  # first calls compile, trace and allocate: not part of any round
            side(batches[:2 * warmup], warmup)
        rounds_of = {name: [] for name in sides}
        for r in range(rounds):
            for name in (("harness", "plain") if r % 2 == 0 else ("plain", "harness")):
                rounds_of[name].append(sides[name](batches, warmup))
        print(RESULT + json.dumps({"model": model, "precision": precision_name, "batch_size": batch_size,
                                   "input_size": input_size, **rounds_of}), flush=True)
        del sides


def _row(values) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", required=True, choices=FRAMEWORKS)
    parser.add_argument("--precision", default=",".join(PRECISIONS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each side, alternating (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each round (default 3)")
    names = [model_name(m[0]) for m in MODELS]
    parser.add_argument("--model", default=",".join(names),
                        help="comma-separated, of these (default: %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.model.split(",")
    unknown = sorted(set(models) - set(names))
    if unknown:
        parser.error(f"--model: no {', '.join(unknown)} here (the models: {', '.join(names)})")
    if args.worker:
        worker(args.framework, args.precision, args.rounds, args.steps, args.warmup, models)
        return
    from harness.run.measure import cpu_info

    plain = {"torch": "eager torch.nn", "tensorflow": "model.fit", "mxnet": "plain Gluon",
             "jax": "plain jax.jit loop"}[args.framework]
    print(f"{args.framework}: harness step (variant {HARNESS_VARIANT[args.framework]}) vs {plain}, ms per step; "
          f"{args.rounds} rounds of {args.steps} steps after {args.warmup} warm-up, {THREADS} threads, "
          f"CPU {cpu_info()[0]}")
    print(f"{'model':<18} {'precision':<9} {'harness (per round)':<26} {'plain (per round)':<26} harness/plain")
    failed, over = False, []
    for precision in args.precision.split(","):
        cmd = [sys.executable, __file__, "--framework", args.framework, "--precision", precision, "--worker",
               "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--model", args.model]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        for line in proc.stdout:
            if not line.startswith(RESULT):
                continue
            r = json.loads(line[len(RESULT):])
            # a round's figure: the median step where both sides time single steps, else both sides' mean
            stat = "median_ms" if "median_ms" in r["plain"][0] else "mean_ms"
            harness, plain = ([round_[stat] for round_ in r[side]] for side in ("harness", "plain"))
            ratio = statistics.median(harness) / statistics.median(plain)
            print(f"{r['model']:<18} {r['precision']:<9} {_row(harness):<26} {_row(plain):<26} {ratio:.3f}"
                  f"{'' if stat == 'median_ms' else ' (means)'}", flush=True)
            if "fit_wall_ms" in r["plain"][0]:
                print(f"{'':<28} fit wall time / steps, setup included: "
                      f"{_row([x['fit_wall_ms'] for x in r['plain']])}", flush=True)
            if ratio > MAX_RATIO:
                over.append(f"{r['model']} {r['precision']} {ratio:.3f}")
        if proc.wait():
            print(f"{args.framework} {precision}: the worker exited with {proc.returncode}", file=sys.stderr)
            failed = True
    print(f"over {MAX_RATIO}: {', '.join(over)}" if over else f"every harness/plain ratio is at most {MAX_RATIO}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
