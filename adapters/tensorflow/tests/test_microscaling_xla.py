"""The block-scaled quantizer compiled as the adapter's `xla` variant compiles a training step (tf.function with
jit_compile=True) and as its `graph` variant does: still the reference's bits. The conformance kit runs the rule
eagerly here (OPS.on_device), and XLA rewrites float arithmetic (a division by a constant becomes a product with
the rounded reciprocal: harness.microscaling.divide_with), so the kit's variants that divide run compiled too."""
from __future__ import annotations

from dataclasses import replace

import pytest

tf = pytest.importorskip("tensorflow")

from amp_harness_tensorflow.rounding import OPS  # noqa: E402
from harness.adapter import Device  # noqa: E402
from harness.conformance.test_microscaling import VARIANTS, explain, mismatches  # noqa: E402

# the scales that are not powers of two (NVFP4's, block FP8's), the float64 Hadamard transform, and an MX format
COMPILED = ["nvfp4", "nvfp4_16x16", "nvfp4:stochastic", "nvfp4:hadamard", "fp8_block_1x128", "fp8_block_128x128",
            "mxfp4"]


@pytest.mark.parametrize("xla", [True, False], ids=["xla", "graph"])
@pytest.mark.parametrize("name", COMPILED)
def test_the_compiled_quantizer_is_the_reference_bit_for_bit(name, xla):
    ops = replace(OPS, on_device=lambda fn, device: tf.function(fn, jit_compile=xla, autograph=False))
    failures = mismatches(ops, Device.cpu(), VARIANTS[name])
    assert not failures, explain(VARIANTS[name], failures)
