"""The rounding rules of the pure-16-bit precisions (harness.rounding), on the numpy reference every adapter is
held to bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from harness.errors import HarnessError
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.precision import PRECISIONS, parse_precision
from harness.rounding import (
    NOISE_RANGE,
    NUMPY_OPS,
    Rounding,
    RoundingNoise,
    gap,
    kahan_update,
    round_nearest,
    round_stochastic,
    round_stochastic_arithmetic,
    sample_values,
    unbiasedness,
)

BF16, FP16 = Rounding("stochastic", "bfloat16"), Rounding("stochastic", "float16")
FIXED = Rounding("stochastic", "fixed16")


def _draws(values, rounding, draws=100_000, seed=0):
    bits = np.random.default_rng(seed).integers(0, NOISE_RANGE, (draws, values.size))
    return round_stochastic(np.broadcast_to(values, (draws, values.size)), bits, rounding)


@pytest.mark.parametrize("rounding", [BF16, FP16, FIXED, Rounding("stochastic", "fixed16", 8)],
                         ids=["bfloat16", "float16", "fixed16", "fixed16:8"])
def test_the_reference_is_unbiased_and_the_check_catches_nearest_rounding(rounding):
    values = sample_values(rounding)
    assert unbiasedness(values, _draws(values, rounding), rounding) == []
    nearest = np.broadcast_to(round_nearest(values, rounding), (100_000, values.size))
    assert len(unbiasedness(values, nearest, rounding)) == values.size  # round-to-nearest is biased everywhere
    # a rule that always rounds toward zero lands on a neighbour but is biased: caught
    toward_zero = np.broadcast_to(round_stochastic(values, np.zeros(values.shape, int), rounding), (100_000, values.size))
    assert len(unbiasedness(values, toward_zero, rounding)) == values.size


def test_sample_values_cover_subnormals_and_powers_of_two_and_are_off_the_grid():
    for rounding, smallest_normal in ((BF16, 2.0**-126), (FP16, 2.0**-14)):
        values = sample_values(rounding)
        magnitude = np.abs(values.astype(np.float64))
        assert (magnitude < smallest_normal).sum() >= 3, "subnormals"
        near = np.abs(magnitude / 2.0 ** np.round(np.log2(magnitude)) - 1)
        assert (near < 2.0**-6).sum() >= 6, "values next to powers of two"
        assert (values < 0).any() and (values > 0).any()
        assert (round_nearest(values, rounding) != values).all()


def test_bfloat16_bit_pattern_rule_equals_the_arithmetic_rule():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(20000) * np.ldexp(1.0, rng.integers(-140, 100, 20000)),
                        np.ldexp(rng.uniform(0, 1, 2000), -126)]).astype(np.float32)  # float32 subnormals too
    bits = rng.integers(0, NOISE_RANGE, x.shape)
    np.testing.assert_array_equal(round_stochastic(x, bits, BF16), round_stochastic_arithmetic(x, bits, BF16))


def test_stochastic_rounding_lands_on_the_format_and_its_two_neighbours():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(50000) * 3).astype(np.float32)
    bits = rng.integers(0, NOISE_RANGE, x.shape)
    half = round_stochastic(x, bits, FP16)
    np.testing.assert_array_equal(half, half.astype(np.float16).astype(np.float32))  # representable in float16
    assert np.all(np.abs(half - x) < gap(x, FP16) * (1 + 1e-6))
    bf = round_stochastic(x, bits, BF16)
    assert np.all(bf.view(np.uint32) & 0xFFFF == 0)
    fixed = round_stochastic(x, bits, FIXED)
    lo, hi = FIXED.fixed_range
    assert fixed.min() >= lo and fixed.max() <= hi  # saturates (|x| reaches 3 * 4 sigma here)
    np.testing.assert_array_equal(fixed * 2.0**14, np.round(fixed * 2.0**14))  # on the grid


def test_nearest_rules():
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, -(1 + 2.0**-8)], np.float32)
    # ties to even, and a hair above the tie rounds up
    np.testing.assert_array_equal(round_nearest(x, BF16), [1.0, 1 + 2.0**-6, 1 + 2.0**-7, -1.0])
    assert round_nearest(np.float32([70000.0]), FP16)[0] == np.inf
    fixed = Rounding("nearest", "fixed16")
    np.testing.assert_array_equal(round_nearest(np.float32([2.0**-15, 3 * 2.0**-15, 5.0, -5.0]), fixed),
                                  [0.0, 2.0**-13, 2 - 2.0**-14, -2.0])
    # an update below half the fixed-point gap is lost with nearest rounding, kept on average with stochastic
    w = np.full(100_000, 0.5, np.float32)
    assert (round_nearest(w + np.float32(1e-5), fixed) == w).all()
    bits = np.random.default_rng(3).integers(0, NOISE_RANGE, w.shape)
    assert abs(round_stochastic(w + np.float32(1e-5), bits, FIXED).mean() - (0.5 + 1e-5)) < 1e-6


def test_non_finite_values_and_float16_overflow():
    x = np.float32([np.inf, -np.inf, np.nan, 65519.0, 65535.0])
    bits = np.full(x.shape, NOISE_RANGE - 1)
    out = round_stochastic(x, bits, FP16)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])
    assert out[3] == 65504.0 or out[3] == np.inf
    assert out[4] == np.inf  # past the largest finite value, rounding away is infinity
    with pytest.raises(HarnessError, match="one integer"):
        round_stochastic(x, np.full(x.shape, NOISE_RANGE), FP16)


def test_kahan_keeps_what_nearest_rounding_loses():
    w = np.ones(1000, np.float32)
    c = np.zeros_like(w)
    nearest = w.copy()
    for _ in range(1000):  # 1000 updates of 1e-4, each far below half of bfloat16's gap at 1 (2^-8)
        w, c = kahan_update(w, w + np.float32(1e-4), c)
        nearest = round_nearest(nearest + np.float32(1e-4), BF16)
    assert (nearest == 1).all()
    # the weights moved by the sum of the updates; weight minus compensation is the true sum up to the
    # compensation's own bfloat16 rounding
    assert np.all(np.abs(w - 1.1) <= 2.0**-7) and np.allclose(w.astype(np.float64) - c, 1.1, atol=5e-3)
    assert np.all(w.view(np.uint32) & 0xFFFF == 0)  # and the weights stay bfloat16


def test_core_noise_is_counter_based_per_weight_and_step():
    graph = infer(load_spec("mnist_mlp"))
    shapes = graph.trainable_shapes()
    assert sorted(shapes) == ["1.bias", "1.kernel", "3.bias", "3.kernel"]
    noise = RoundingNoise(shapes, seed=0)
    a, b = noise.for_step(5), RoundingNoise(shapes, seed=0).for_step(5)
    for name in shapes:
        np.testing.assert_array_equal(a[name], b[name])  # any step, without replaying the ones before
        assert a[name].shape == shapes[name] and a[name].dtype == np.int32
        assert 0 <= a[name].min() and a[name].max() < NOISE_RANGE
    assert not np.array_equal(a["1.kernel"], noise.for_step(6)["1.kernel"])
    assert not np.array_equal(a["1.bias"][:10], a["3.bias"][:10])
    assert not np.array_equal(a["1.kernel"], RoundingNoise(shapes, seed=1).for_step(5)["1.kernel"])
    assert abs(a["1.kernel"].mean() / NOISE_RANGE - 0.5) < 0.01


def test_the_precisions_and_their_fractional_bits():
    for name in ("bf16_sr", "fp16_sr", "bf16_kahan", "fixed16_sr", "fixed16_rn"):
        assert PRECISIONS[name].rounding is not None and not PRECISIONS[name].mixed
    assert PRECISIONS["bf16_sr"].param_dtype == "bfloat16" and PRECISIONS["fp16_sr"].param_dtype == "float16"
    twelve = parse_precision("fixed16_sr:12")
    assert twelve.name == "fixed16_sr:12" and twelve.rounding.frac_bits == 12
    assert twelve.rounding.fixed_range == (-8.0, 8 - 2.0**-12)
    assert PRECISIONS["fixed16_rn"].rounding.frac_bits == 14
    for bad in ("bf16_sr:12", "fixed16_sr:16", "fixed16_sr:x", "fp32:3"):
        with pytest.raises(HarnessError, match="fractional bits"):
            parse_precision(bad)
    with pytest.raises(HarnessError, match="Kahan"):
        Rounding("kahan", "float16")


def test_an_adapter_that_does_not_write_weights_by_the_rules_reports_the_precisions_unsupported():
    from harness.adapter import Adapter, Device

    class Plain(Adapter):  # a third-party adapter written before harness.rounding
        name = "plain"
        framework_version = device = set_threads = build = None

    class Rounding16(Plain):  # supplies the primitives the core's rules are written with
        def rounding_ops(self):
            return NUMPY_OPS

    cpu = Device("cpu", "cpu", "test CPU")
    reason = Plain().unsupported(PRECISIONS["bf16_sr"], cpu)
    assert "does not implement" in reason and "\n" not in reason
    assert Plain().unsupported(PRECISIONS["bf16"], cpu) is None
    assert Rounding16().unsupported(PRECISIONS["bf16_sr"], cpu) is None


def test_the_adapters_reasons_come_from_their_declared_capabilities():
    """A framework without a bit-cast (Capabilities.no_bitcast) has the floating-point rounding precisions
    unsupported in the core's words; a refusal found by experiment (Capabilities.refused) holds on its device
    kind only."""
    from harness.adapter import Adapter, Capabilities, Device, Refusal

    class NoBitcast(Adapter):
        name = "nobitcast"
        framework_version = device = set_threads = build = None
        capabilities = Capabilities(no_bitcast="no bitcast operator",
                                    refused=(Refusal("bf16", "cpu", "bfloat16 crashes on this CPU"),))

        def rounding_ops(self):
            return NUMPY_OPS

    cpu, gpu = Device("cpu", "cpu", "test CPU"), Device("gpu:0", "gpu", "test GPU")
    reason = NoBitcast().unsupported(PRECISIONS["bf16_sr"], cpu)
    assert reason.startswith("nobitcast cannot bit-cast (no bitcast operator)") and "\n" not in reason
    assert NoBitcast().unsupported(PRECISIONS["fixed16_sr"], cpu) is None  # fixed point needs no bit-cast
    assert NoBitcast().unsupported(PRECISIONS["bf16"], cpu) == "bfloat16 crashes on this CPU"
    assert NoBitcast().unsupported(PRECISIONS["bf16"], gpu) is None


@pytest.mark.parametrize("name", [n for n, p in PRECISIONS.items() if p.rounding and p.rounding.mode != "kahan"])
def test_the_rules_written_once_on_numpys_primitives_are_the_reference_bit_for_bit(name):
    """harness.rounding's rules written once against RoundingOps (what every adapter runs on its framework's
    primitives), run on numpy's entry and through the core's Adapter.write_weights, write exactly what the
    numpy reference does: whole range, subnormals, next to powers of two, signed zeros, non-finite values."""
    from harness.adapter import Adapter, Device
    from harness.rounding import write

    class NumpyRounding(Adapter):
        name = "numpy"
        framework_version = device = set_threads = build = None

        def rounding_ops(self):
            return NUMPY_OPS

    rounding = PRECISIONS[name].rounding
    rng = np.random.default_rng(11)
    scales = np.ldexp(1.0, rng.integers(-30, 12, 4000)) if rounding.format != "fixed16" else 1.0
    x = np.concatenate([sample_values(rounding), rng.standard_normal(4000) * scales,
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 7e4, -7e4, 3.0, -3.0]]).astype(np.float32)
    bits = rng.integers(0, NOISE_RANGE, x.shape, dtype=np.int32)
    got = NumpyRounding().write_weights(PRECISIONS[name], x, bits, Device("cpu", "cpu", "test CPU"))
    expected = write(x, rounding, bits)
    same = (got.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(got) & np.isnan(expected))
    assert same.all(), f"{name}: {x[~same][:5]} -> {got[~same][:5]}, the reference gives {expected[~same][:5]}"


def test_kahan_written_once_on_numpys_primitives_is_the_reference():
    from harness.rounding import kahan_with

    rng = np.random.default_rng(3)
    bf16 = Rounding("nearest", "bfloat16")
    w = round_nearest(rng.standard_normal(1000).astype(np.float32), bf16)
    x = (w + rng.standard_normal(1000).astype(np.float32) * np.float32(1e-3)).astype(np.float32)
    c = round_nearest(rng.standard_normal(1000).astype(np.float32) * np.float32(1e-4), bf16)
    got, expected = kahan_with(NUMPY_OPS, w, x, c), kahan_update(w, x, c)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g.view(np.uint32), e.view(np.uint32))
