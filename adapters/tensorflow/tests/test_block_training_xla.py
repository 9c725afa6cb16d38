"""The block-scaled matmul (network.block_product: the dense layers' and attention projections' product under a
block recipe) and its custom gradient compiled as the adapter's variants compile a training step (tf.function,
with and without jit_compile), on the conformance kit's tensors: within the kit's bound of the core's reference,
as the kit's eager run (Adapter.block_linear) is. XLA rewrites divisions by constants and the quantizer guards
them (harness.microscaling.divide_with); a sequence's rows are its samples x positions. The conv2d and patches
layers' product of their windows (Fp8Conv2D.blocked: network.block_conv2d), compiled the same ways, is the core's
block_conv2d on the kit's convolutions (Adapter.block_conv2d runs it eagerly), its windows' gradient folded back
onto the pixels by the strided slices' own gradients."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from pydantic import TypeAdapter  # noqa: E402

from amp_harness_tensorflow.network import BlockNoise, Fp8Conv2D, Network, Patches, block_product  # noqa: E402
from harness import microscaling as mx  # noqa: E402
from harness.conformance.test_block_training import BLOCKED, BOUND, CONVS, _tensors  # noqa: E402
from harness.model.data import Data  # noqa: E402
from harness.model.graph import infer  # noqa: E402
from harness.model.reference import windows  # noqa: E402
from harness.model.spec import Layer, load_spec  # noqa: E402
from harness.model.weights import initial_weights  # noqa: E402
from harness.precision import parse_precision  # noqa: E402


def _compiled(recipe, xla: bool, noise=None):
    @tf.function(jit_compile=xla, autograph=False)
    def run(x, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = block_product(x, w, recipe, noise)
            total = tf.reduce_sum(y * dy)
        return (y, *tape.gradient(total, [x, w]))
    return run


def _errors(got, want) -> dict[str, float]:
    return {what: float(np.abs(g.numpy() - r).max() / np.abs(r).max())
            for what, g, r in zip(("y", "dx", "dw"), got, want)}


@pytest.mark.parametrize("xla", [True, False], ids=["xla", "graph"])
@pytest.mark.parametrize("name", BLOCKED)
def test_the_compiled_block_product_is_the_core_rule(name, xla):
    recipe = parse_precision(name).blocks
    x, w, dy = _tensors()
    got = _compiled(recipe, xla)(*(tf.constant(a) for a in (x, w, dy)))
    errors = _errors(got, mx.block_linear(x, w, dy, recipe))
    assert max(errors.values()) <= BOUND, f"{name} ({'xla' if xla else 'graph'}): {errors}"


def test_a_sequence_is_blocked_as_its_rows():
    """x [N, T, K]: the product of its [N*T, K] rows, shaped back (an MX block along M spans positions)."""
    recipe = parse_precision("mxfp8").blocks
    x, w, dy = _tensors()  # 144 rows: 9 sequences of 16 positions
    got = _compiled(recipe, False)(tf.constant(x.reshape(9, 16, -1)), tf.constant(w),
                                   tf.constant(dy.reshape(9, 16, -1)))
    want = mx.block_linear(x, w, dy, recipe)
    assert got[0].shape == (9, 16, w.shape[1]) and got[1].shape == (9, 16, w.shape[0])
    errors = _errors([tf.reshape(got[0], want[0].shape), tf.reshape(got[1], want[1].shape), got[2]], want)
    assert max(errors.values()) <= BOUND, errors


@pytest.mark.parametrize("xla", [True, False], ids=["xla", "graph"])
def test_the_compiled_stochastic_gradients_take_the_given_bits(xla):
    """:sr compiled: block_product's backward rounds dy's two casts with the bits its noise gives (the kit's eager
    test_stochastically_rounded_gradients_take_the_given_bits, as the step's tf.function runs it)."""
    recipe = parse_precision("nvfp4:rht:sr").blocks
    x, w, dy = _tensors()
    bits = tuple(np.random.default_rng(seed).integers(0, 2**16, dy.shape, dtype=np.int32) for seed in (1, 2))
    noise = BlockNoise(None, tuple(tf.constant(b) for b in bits))
    got = _compiled(recipe, xla, noise)(*(tf.constant(a) for a in (x, w, dy)))
    errors = _errors(got, mx.block_linear(x, w, dy, recipe, bits))
    assert max(errors.values()) <= BOUND, f"nvfp4:rht:sr ({'xla' if xla else 'graph'}): {errors}"


def test_the_compiled_generator_draws_fresh_bits_every_call():
    """:sr under XLA: the backward draws from the generator (a stateful op in the compiled step), fresh each call."""
    recipe = parse_precision("mxfp8:sr").blocks
    x, w, dy = _tensors()
    run = _compiled(recipe, True, BlockNoise(7))
    first, second = (run(*(tf.constant(a) for a in (x, w, dy)))[1].numpy() for _ in range(2))
    nearest = mx.block_linear(x, w, dy, parse_precision("mxfp8").blocks)[1]
    scale = np.abs(nearest).max()
    assert np.abs(first - second).max() > 1e-3 * scale, "two calls drew the same bits"
    assert min(np.abs(got - nearest).max() for got in (first, second)) > 1e-3 * scale


def test_a_stochastic_network_draws_fresh_bits_every_step():
    """:sr in a network: its training step (a tf.function, as the graph variant's) draws the products' bits from
    the network's generator, so two steps' gradients on the same batch and weights differ, and both differ from
    round-to-nearest's (under XLA: test_the_compiled_generator_draws_fresh_bits_every_call)."""
    xla = False
    spec = load_spec("mnist_mlp").model_copy(update={"batch_size": 16})  # flatten, dense 512, relu, dense 10
    graph = infer(spec)
    weights = initial_weights(graph, spec.seed)
    x, y = Data(spec).train_batch(0)

    def gradients(name, steps):
        net = Network(spec, graph, weights, "float32", blocks=parse_precision(name).blocks, noise_seed=7)
        kernel = net.variables["1.kernel"]

        @tf.function(jit_compile=xla)
        def step(x, y):
            with tf.GradientTape() as tape:
                out = net.train_model(x, training=True)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, out))
            return tape.gradient(loss, kernel)
        return [step(tf.constant(x), tf.constant(y)).numpy() for _ in range(steps)]

    first, second = gradients("nvfp4:sr", 2)
    (nearest,) = gradients("nvfp4", 1)
    scale = np.abs(nearest).max()
    assert np.abs(first - second).max() > 1e-3 * scale, "two steps drew the same bits"
    for got in (first, second):
        assert np.abs(got - nearest).max() > 1e-3 * scale, ":sr's gradients are round-to-nearest's"
        assert np.abs(got - nearest).max() < 0.5 * scale, ":sr's gradients are far from round-to-nearest's"


def _conv_layer(spec: dict, recipe):
    """The Keras layer the network builds for a conv2d or patches spec (matmul_layer's arguments), without a bias."""
    if spec["type"] == "patches":
        return Patches(spec["dim"], spec["size"], strides=spec["size"], padding="valid", use_bias=False,
                       blocks=recipe)
    return Fp8Conv2D(spec["filters"], spec["kernel_size"], strides=spec.get("strides", 1),
                     padding=spec.get("padding", "valid"), dilation_rate=spec.get("dilation", 1), use_bias=False,
                     blocks=recipe)


# each convolution compiled once, as the xla and graph variants compile a step (the kit runs every recipe on each,
# eagerly): the recipes whose scales divide (nvfp4, fp8_block) under XLA's rewrite, one power-of-two MX in graph mode
@pytest.mark.parametrize("name, conv, xla", [("nvfp4:rht", 0, True), ("fp8_block", 1, True), ("nvfp4:rht", 2, True),
                                             ("mxfp8", 0, False)],
                         ids=["nvfp4_same_stride2_xla", "fp8_block_dilated_xla", "nvfp4_patches_xla",
                              "mxfp8_same_stride2_graph"])
def test_the_compiled_convolution_layers_are_the_product_of_their_windows(name, conv, xla):
    spec, shape = CONVS[conv]
    recipe = parse_precision(name).blocks
    layer = TypeAdapter(Layer).validate_python(spec)
    rng = np.random.default_rng(conv)  # the kit's tensors (test_a_block_scaled_convolution_is_the_product_...)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 1] *= 100.0
    k, f = spec.get("kernel_size", spec.get("size")), spec.get("filters", spec.get("dim"))
    kernel = (rng.standard_normal((k, k, shape[-1], f)) * 0.1).astype(np.float32)
    n, ho, wo = windows(layer, x).shape[:3]
    dy = rng.standard_normal((n, ho, wo, f) if layer.type == "conv2d" else (n, ho * wo, f)).astype(np.float32)
    keras_layer = _conv_layer(spec, recipe)
    keras_layer.build(shape)
    keras_layer.kernel.assign(kernel)

    @tf.function(jit_compile=xla, autograph=False)
    def run(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = keras_layer(x)
            total = tf.reduce_sum(y * dy)
        return (y, *tape.gradient(total, [x, keras_layer.kernel]))

    errors = _errors(run(tf.constant(x), tf.constant(dy)), mx.block_conv2d(layer, x, kernel, dy, recipe))
    assert max(errors.values()) <= BOUND, f"{name} {spec['type']} ({'xla' if xla else 'graph'}): {errors}"
