"""The block-scaled training precisions' matmul (harness.microscaling.BlockRecipe): the adapter's dense product and
its backward, on the same float32 tensors, against the core's reference block_linear. The quantized operands must be
the reference's bit for bit (the quantizer is the kit's test_microscaling's), so what may differ is only the
order in which the framework sums the products of each row and column: a product that quantizes an operand along
the wrong axis, once where it takes two, with the wrong format or not at all is off by whole quantization steps
(several percent of the output)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pydantic import TypeAdapter

from harness import microscaling as mx
from harness.model.reference import windows
from harness.model.spec import Layer
from harness.precision import PRECISIONS, parse_precision

BLOCKED = [name for name, p in PRECISIONS.items() if p.blocks is not None] + ["nvfp4:rht"]
# M: 144 rows (whole Hadamard blocks of 16, four and a half MX blocks of 32 along M); K and N not multiples of 128
# (block FP8's partial blocks and tiles) nor of 32 in N
M, K, N = 144, 160, 200
BOUND = 2e-6  # of each output's largest magnitude: float32 sums of at most 200 products in another order


def _tensors() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[:, 7] *= 100.0  # an outlier channel: its blocks along K scale small, its blocks along M do not
    # digits' pixels (k / 28, a block's largest 1): under a float32 scale 1 / 448, 27 / 28 lands on 432, an e4m3
    # midpoint, where a product with the scale's reciprocal instead of the division tips it (XLA's rewrite)
    x[:16] = rng.integers(0, 29, (16, K)) / 28.0
    x[:16, :4] = 1.0
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    dy = (rng.standard_normal((M, N)) * np.exp2(rng.integers(-8, 4, (M, 1)))).astype(np.float32)
    return x, w, dy


def _assert_the_rule(what: str, got, want, rule: str) -> None:
    """Each of got's (y, dx, dw) has the rule's shape and is within BOUND of its largest magnitude."""
    for part, value, expected in zip(("y", "dx", "dw"), got, want):
        value = np.asarray(value, dtype=np.float32)
        assert value.shape == expected.shape, f"{what}: {part} has shape {value.shape}, the rule's {expected.shape}"
        error = float(np.abs(value - expected).max() / np.abs(expected).max())
        assert error <= BOUND, f"{what}: {part} is {error:.2e} of its largest magnitude from {rule}"


@pytest.mark.parametrize("name", BLOCKED)
def test_the_block_scaled_matmul_and_its_gradients_are_the_core_rule(adapter, unsupported, name):
    if unsupported(name):
        pytest.skip(f"{name} unsupported here: {unsupported(name)}")
    precision = parse_precision(name)
    x, w, dy = _tensors()
    got = adapter.block_linear(precision, x, w, dy, adapter.device("cpu"))
    assert got is not None, (f"{name} runs here, so block_linear must expose the matmul its dense layers run "
                             f"(harness.adapter.Adapter.block_linear)")
    _assert_the_rule(name, got, mx.block_linear(x, w, dy, precision.blocks),
                     "harness.microscaling.block_linear's (read BlockRecipe's docstring: each product's operands "
                     "blocked along the axis it sums over)")


@pytest.mark.parametrize("name", ["nvfp4:rht:sr"])  # one precision, one probe: the bits' path is every recipe's
def test_stochastically_rounded_gradients_take_the_given_bits(adapter, unsupported, name):
    """With :sr, both casts of dy round stochastically; given the core's bits, the adapter's product and gradients
    are the rule's (y untouched: the forward rounds to nearest), and they are not round-to-nearest's."""
    if unsupported(name):
        pytest.skip(f"{name} unsupported here: {unsupported(name)}")
    recipe = parse_precision(name).blocks
    x, w, dy = _tensors()
    bits = tuple(np.random.default_rng(seed).integers(0, 2**16, (M, N), dtype=np.int32) for seed in (1, 2))
    got = adapter.block_linear(parse_precision(name), x, w, dy, adapter.device("cpu"), bits)
    want = mx.block_linear(x, w, dy, recipe, bits)
    _assert_the_rule(name, got, want, "the rule's with the same bits (block_gradient_operands_with: dx's cast of "
                                      "dy takes the first, dw's the second)")
    nearest = mx.block_linear(x, w, dy, replace(recipe, stochastic=False))
    assert np.abs(want[1] - nearest[1]).max() > 1e-3 * np.abs(nearest[1]).max()


# Convolutions as products of their windows (harness.microscaling.block_conv2d): 'same' strides with an odd pixel
# after, a dilated window, and a patch embedding; K = k*k*C (180, 90 and 48) not a multiple of 32 or 128, and the
# rows (output pixels of the batch: 80, 64 and 32) in whole Hadamard blocks of 16.
CONVS = [({"type": "conv2d", "filters": 24, "kernel_size": 3, "strides": 2, "padding": "same"}, (5, 7, 8, 20)),
         ({"type": "conv2d", "filters": 16, "kernel_size": 3, "dilation": 2}, (4, 8, 8, 10)),
         ({"type": "patches", "size": 4, "dim": 40}, (2, 16, 16, 3))]


@pytest.mark.parametrize("conv", range(len(CONVS)), ids=["conv_same_stride2", "conv_dilated", "patches"])
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4:rht", "fp8_block"])  # each kind of scale (the dense test: all)
def test_a_block_scaled_convolution_is_the_product_of_its_windows(adapter, unsupported, name, conv):
    if unsupported(name):
        pytest.skip(f"{name} unsupported here: {unsupported(name)}")
    spec, shape = CONVS[conv]
    layer = TypeAdapter(Layer).validate_python(spec)
    rng = np.random.default_rng(conv)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 1] *= 100.0  # an outlier channel
    k, f = spec.get("kernel_size", spec.get("size")), spec.get("filters", spec.get("dim"))
    kernel = (rng.standard_normal((k, k, shape[-1], f)) * 0.1).astype(np.float32)
    n, ho, wo = windows(layer, x).shape[:3]
    dy = rng.standard_normal((n, ho, wo, f) if layer.type == "conv2d" else (n, ho * wo, f)).astype(np.float32)
    got = adapter.block_conv2d(parse_precision(name), layer, x, kernel, dy, adapter.device("cpu"))
    assert got is not None, (f"{name} runs here, so block_conv2d must expose the product its conv2d and patches "
                             f"layers run (harness.adapter.Adapter.block_conv2d)")
    _assert_the_rule(f"{name} {layer.type}", got, mx.block_conv2d(layer, x, kernel, dy, parse_precision(name).blocks),
                     "harness.microscaling.block_conv2d's (its windows in (i, j, c) order, blocked as a dense "
                     "layer's rows)")
