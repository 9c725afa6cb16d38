"""The block-scaled precisions in the network (harness.microscaling.BlockRecipe): every dense, attention, conv2d and
patches product runs through block_matmul, the function the kit's block_linear test holds to the rule, and a
network's dense layers train by the rule on the tensors they are fed, in the jitted step's compilation, on real data
(the digits: pixels of few significant bits, whose blocks land on the element grid's ties far more often than the
kit's random values); so do a convnet's convolutions (block_conv2d: the product of their windows)."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from amp_harness_jax import network  # noqa: E402
from harness import microscaling as mx  # noqa: E402
from harness.model.data import Data  # noqa: E402
from harness.model.graph import infer  # noqa: E402
from harness.model.spec import load_spec  # noqa: E402
from harness.model.weights import initial_weights  # noqa: E402
from harness.precision import PRECISIONS, parse_precision  # noqa: E402

BLOCKED = [name for name, p in PRECISIONS.items() if p.blocks is not None] + ["nvfp4:rht"]
BOUND = 2e-6  # the kit's (test_block_training): float32 sums in another order than the reference's float64 ones
BATCH = 16  # whole Hadamard blocks of rows (nvfp4:rht)


def _network(name: str, precision: str):
    spec = load_spec(name).model_copy(update={"batch_size": BATCH})
    graph = infer(spec)
    net = network.Network(spec, graph, "float32", None, parse_precision(precision).blocks, noise_seed=7)
    params = {n: jnp.asarray(w, jnp.float32) for n, w in initial_weights(graph, spec.seed).items()
              if n in net.trainable}
    return spec, net, params


@pytest.mark.parametrize("model", ["mnist_mlp", "tiny_gpt", "resnet8", "vit_tiny"])
def test_every_matmul_product_runs_through_block_matmul(model, monkeypatch):
    calls = []
    monkeypatch.setattr(network, "block_matmul", lambda x, w, recipe, noise=None: calls.append(recipe) or x @ w)
    for precision, expected in (("fp32", 0), ("mxfp8", None)):
        spec, net, params = _network(model, precision)
        x, _ = Data(spec).train_batch(0)
        calls.clear()
        jax.eval_shape(lambda p, x: net.apply(p, _statistics(net, spec), x, None, False)[0], params, x)
        # the products: each dense, conv2d and patches layer's, each attention layer's four projections (net.products)
        assert len(calls) == (len(net.products) if expected is None else expected)
        assert all(recipe is net.blocks for recipe in calls)


@pytest.mark.parametrize("name", BLOCKED)
def test_the_dense_layers_train_by_the_rule_on_the_tensors_they_are_fed(name):
    spec, net, params = _network("mnist_mlp", name)  # flatten, dense 512, relu, dense 10
    recipe = net.blocks
    x, y = Data(spec).train_batch(0)

    @jax.jit
    def step(params, taps):
        def loss(params, taps):
            record = {}
            out, _ = net.apply(params, {}, x, None, True, taps, record)
            return jnp.mean(jax.nn.logsumexp(out, 1) - out[jnp.arange(len(y)), y]), record

        grads, record = jax.grad(loss, (0, 1), has_aux=True)(params, taps)
        return record, grads

    taps = {path: jnp.zeros((BATCH, *info.out_shape)) for path, info in net.infos.items()}
    record, (grads, output_grads) = step(params, taps)
    for layer, previous in (("1", "0"), ("3", "2")):  # each dense layer's input is the previous layer's output
        kernel = np.asarray(params[f"{layer}.kernel"])
        want_y, _, want_dw = mx.block_linear(np.asarray(record[previous]), kernel, np.asarray(output_grads[layer]),
                                             recipe)
        for what, got, want in (("y", np.asarray(record[layer] - params[f"{layer}.bias"]), want_y),
                                ("dw", np.asarray(grads[f"{layer}.kernel"]), want_dw)):
            error = float(np.abs(got - want).max() / np.abs(want).max())
            assert error <= BOUND, f"{name}: layer {layer}'s {what} is {error:.1e} of its largest from the rule's"


def test_a_stochastic_network_draws_fresh_bits_every_step():
    """:sr: the step's key (Network.noise of the step count, which apply folds in per product) draws fresh bits in
    the jitted backward, so two steps' gradients on the same batch and weights differ, and both differ from
    round-to-nearest's."""
    x, y = Data(load_spec("mnist_mlp").model_copy(update={"batch_size": BATCH})).train_batch(0)

    def gradients(name, counts):
        spec, net, params = _network("mnist_mlp", name)

        @jax.jit
        def step(params, count):
            def loss(params):
                out, _ = net.apply(params, {}, x, None, True, noise=net.noise(count))
                return jnp.mean(jax.nn.logsumexp(out, 1) - out[jnp.arange(len(y)), y])
            return jax.grad(loss)(params)["1.kernel"]
        return [np.asarray(step(params, jnp.int32(count))) for count in counts]

    first, second = gradients("nvfp4:sr", (1, 2))
    (nearest,) = gradients("nvfp4", (1,))
    scale = np.abs(nearest).max()
    assert np.abs(first - second).max() > 1e-3 * scale, "two steps drew the same bits"
    for got in (first, second):
        assert np.abs(got - nearest).max() > 1e-3 * scale, ":sr's gradients are round-to-nearest's"
        assert np.abs(got - nearest).max() < 0.5 * scale, ":sr's gradients are far from round-to-nearest's"


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4:rht"])
def test_a_convnet_s_convolutions_train_by_the_rule_on_the_tensors_they_are_fed(name):
    """resnet8's stem (a 'same' conv2d on the images) and its first residual block's first conv2d (a 'same' conv2d
    after batchnorm and relu): y and dw those of the core's block_conv2d on the recorded input and output gradient."""
    from pydantic import TypeAdapter

    from harness.model.spec import Layer

    spec, net, params = _network("resnet8", name)
    x, y = Data(spec).train_batch(0)

    @jax.jit
    def step(params, taps, x, state):  # x and the state as arguments: XLA would constant-fold their windows
        def loss(params, taps):
            record = {}
            out, _ = net.apply(params, state, x, None, True, taps, record)
            return jnp.mean(jax.nn.logsumexp(out, 1) - out[jnp.arange(len(y)), y]), record

        grads, record = jax.grad(loss, (0, 1), has_aux=True)(params, taps)
        return record, grads

    taps = {path: jnp.zeros((BATCH, *info.out_shape)) for path, info in net.infos.items()}
    record, (grads, output_grads) = step(params, taps, jnp.asarray(x), _statistics(net, spec))
    convs = [info for info in net.infos.values() if info.type == "conv2d"][:2]
    for info in convs:
        inputs = np.asarray(record[_previous(net, info.path)]) if info.path != "0" else np.asarray(x, np.float32)
        layer = TypeAdapter(Layer).validate_python(info.spec.model_dump())
        kernel = np.asarray(params[f"{info.path}.kernel"])
        want_y, _, want_dw = mx.block_conv2d(layer, inputs, kernel, np.asarray(output_grads[info.path]), net.blocks)
        got_y = np.asarray(record[info.path]) - (np.asarray(params[f"{info.path}.bias"]) if info.spec.use_bias else 0)
        for what, got, want in (("y", got_y, want_y), ("dw", np.asarray(grads[f"{info.path}.kernel"]), want_dw)):
            error = float(np.abs(got - want).max() / np.abs(want).max())
            assert error <= BOUND, f"{name}: conv2d {info.path}'s {what} is {error:.1e} of its largest from the rule's"


def _statistics(net, spec) -> dict:
    """The batchnorm statistics' initial values: the state a convnet's apply reads."""
    return {n: jnp.asarray(w, jnp.float32) for n, w in initial_weights(infer(spec), spec.seed).items()
            if n in net.statistics}


def _previous(net, path: str) -> str:
    """The path of the layer whose output a layer reads: the one before it in its list, or its block's input."""
    head, dot, index = path.rpartition(".")
    return f"{head}{dot}{int(index) - 1}" if int(index) else _previous(net, head.rpartition(".")[0])
