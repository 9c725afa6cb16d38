"""The block-scaled matmul (network.block_product: the dense layers' and attention projections' product under a
block recipe) and its custom gradient compiled as the adapter's variants compile a training step (tf.function,
with and without jit_compile), on the conformance kit's tensors: within the kit's bound of the core's reference,
as the kit's eager run (Adapter.block_linear) is. XLA rewrites divisions by constants and the quantizer guards
them (harness.microscaling.divide_with); a sequence's rows are its samples x positions."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from amp_harness_tensorflow.network import block_product  # noqa: E402
from harness import microscaling as mx  # noqa: E402
from harness.conformance.test_block_training import BLOCKED, BOUND, _tensors  # noqa: E402
from harness.precision import parse_precision  # noqa: E402


def _compiled(recipe, xla: bool):
    @tf.function(jit_compile=xla, autograph=False)
    def run(x, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = block_product(x, w, recipe)
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
