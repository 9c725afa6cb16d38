"""The block-scaled precisions' wiring in the network (the kit's test_block_training checks the matmul itself,
through Adapter.block_linear): a dense layer and an attention layer's four projections run block_linear on their
input's rows (a sequence's samples x positions), forward and back, the bias added after it; a convolution the
core's block_conv2d (the product of its windows); the record says how the matmuls ran."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from amp_harness_torch.network import Attention, Conv2D, Dense, Network  # noqa: E402
from harness import microscaling as mx  # noqa: E402
from harness.model.graph import infer  # noqa: E402
from harness.model.spec import validate  # noqa: E402
from harness.model.weights import initial_weights  # noqa: E402
from harness.precision import parse_precision  # noqa: E402

BASE = {"dataset": {"name": "synthetic", "num_classes": 3, "size": 64},
        "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
        "optimizer": {"type": "sgd", "learning_rate": 0.05, "momentum": 0.9, "nesterov": False},
        "batch_size": 8, "steps": 2, "seed": 3}
# 16 positions of 48 channels: with 2 samples, 32 rows per product (whole Hadamard blocks); 48 channels are a
# partial MX block along K
SEQUENCE = {**BASE, "name": "blocks_sequence", "description": "attention and dense under a block-scaled recipe",
            "dataset": {"name": "synthetic_tokens", "num_classes": 3, "size": 64},
            "input": {"shape": [16], "vocab": 20},
            "layers": [{"type": "embedding", "dim": 48}, {"type": "attention", "heads": 2},
                       {"type": "dense", "units": 40}, {"type": "sequence_pool", "mode": "mean"},
                       {"type": "dense", "units": 3}]}
# 8 samples of 4 x 4 output pixels: 128 rows (whole Hadamard blocks); K = 3 x 3 x 2 = 18, a partial MX block
IMAGE = {**BASE, "name": "blocks_image", "description": "a convolution under a block-scaled recipe",
         "input": {"shape": [6, 6, 2]},
         "layers": [{"type": "conv2d", "filters": 3, "kernel_size": 3}, {"type": "flatten"},
                    {"type": "dense", "units": 3}]}
BOUND = 2e-6  # of the largest magnitude, as the kit's: float32 sums in another order


def _network(spec: dict, precision: str) -> Network:
    spec = validate(spec, "test")
    graph = infer(spec)
    return Network(spec.layers, graph, initial_weights(graph, spec.seed), blocks=parse_precision(precision).blocks)


def _close(got, want, what):
    got = got.detach().numpy()
    error = float(np.abs(got - want).max() / np.abs(want).max())
    assert error <= BOUND, f"{what}: {error:.2e} of its largest magnitude from the core's rule"


def _check_product(layer, recipe, forward, x, kernel, bias):
    """forward(x) (x [..., K]) is block_linear's y + bias, and its gradients with a random dy are the rule's dx and
    dw (the kernel's, in F.linear's layout) and dy's sum (the bias's)."""
    x = x.detach().requires_grad_()
    y = forward(x)
    dy = torch.from_numpy(np.random.default_rng(1).standard_normal(tuple(y.shape)).astype(np.float32))
    dx, dkernel, dbias = torch.autograd.grad(y, (x, kernel, bias), dy)
    rows = lambda t: t.detach().reshape(-1, t.shape[-1]).numpy()  # noqa: E731
    want_y, want_dx, want_dw = mx.block_linear(rows(x), kernel.detach().numpy().T, rows(dy), recipe)
    _close(y.reshape(-1, y.shape[-1]), want_y + bias.detach().numpy(), f"{layer} y")
    _close(dx.reshape(-1, dx.shape[-1]), want_dx, f"{layer} dx")
    _close(dkernel.t(), want_dw, f"{layer} dw")
    _close(dbias, rows(dy).sum(0, dtype=np.float64), f"{layer} bias gradient")


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4:rht", "fp8_block"])
def test_dense_and_attention_products_are_block_linear_s(name):
    net, recipe = _network(SEQUENCE, name), parse_precision(name).blocks
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 16, 48)).astype(np.float32))
    attention, dense = (m for m in net.modules() if isinstance(m, (Attention, Dense)) and m.info.path in ("1", "2"))
    for projection in ("query", "key", "value", "output"):
        _check_product(f"attention {projection}", recipe, lambda t: attention._project(projection, t), x,
                       getattr(attention, f"{projection}_kernel"), getattr(attention, f"{projection}_bias"))
    _check_product("dense", recipe, dense, torch.randn(2, 16, 48), dense.kernel, dense.bias)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4:rht"])
def test_a_convolution_layer_is_the_product_of_its_windows(name):
    """The network's Conv2D (its explicit 'same' padding, its layout) runs the core's block_conv2d: y (less the
    bias), dx and dw (the kernel's gradient in torch's [F, C, k, k]) the rule's, NHWC to NCHW and back."""
    from pydantic import TypeAdapter

    from harness.model.spec import Layer

    net, recipe = _network(IMAGE, name), parse_precision(name).blocks
    conv = next(m for m in net.modules() if isinstance(m, Conv2D))
    assert conv.blocks == recipe
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal((8, 2, 6, 6)).astype(np.float32)).requires_grad_()
    y = conv(x)
    dy = torch.from_numpy(rng.standard_normal(tuple(y.shape)).astype(np.float32))
    dx, dkernel = torch.autograd.grad(y, (x, conv.kernel), dy)
    nhwc = lambda t: t.detach().permute(0, 2, 3, 1).numpy()  # noqa: E731
    layer = TypeAdapter(Layer).validate_python(IMAGE["layers"][0])
    kernel = conv.kernel.detach().permute(2, 3, 1, 0).numpy()  # [k, k, C, F]
    want_y, want_dx, want_dw = mx.block_conv2d(layer, nhwc(x), kernel, nhwc(dy), recipe)
    _close(y.permute(0, 2, 3, 1), want_y + conv.bias.detach().numpy(), "conv2d y")
    _close(dx.permute(0, 2, 3, 1), want_dx, "conv2d dx")
    _close(dkernel.permute(2, 3, 1, 0), want_dw, "conv2d dw")
