"""The FP8 rule written once (harness.fp8): the casts against hand-computed e4m3 and e5m2 values (saturation,
subnormals, rounding to nearest even), the written-once arithmetic against the reference bit for bit, the scaling
recipes' scales and amax history, and the underflow and saturation shares a diagnosis reports."""
from __future__ import annotations

import numpy as np
import pytest

from harness import fp8
from harness.errors import HarnessError
from harness.fp8 import E4M3, E5M2
from harness.rounding import NUMPY_OPS

INF, NAN = float("inf"), float("nan")

E4M3_CASES = [  # (x, its e4m3 value): the gap is 2^(max(e, -6) - 3) for |x| in [2^e, 2^(e+1))
    (1.0, 1.0), (1.0625, 1.0),  # 8.5 gaps of 1/8: the tie goes to the even 8
    (1.1875, 1.25),  # 9.5 gaps: to the even 10
    (1.2, 1.25), (-3.3, -3.25),  # gap 1/4 in [2, 4)
    (448.0, 448.0), (449.0, 448.0), (464.0, 448.0),  # 464 is 14.5 gaps of 32: the tie goes to 448 (14)
    (470.0, 448.0), (1e6, 448.0), (INF, 448.0), (-INF, -448.0),  # past the largest: saturated, not NaN
    (2.0**-6, 2.0**-6),  # the smallest normal
    (2.0**-9, 2.0**-9), (0.75 * 2.0**-9, 2.0**-9),  # the smallest subnormal, and a value rounding up to it
    (2.0**-10, 0.0),  # half the smallest subnormal: the tie goes to the even 0 (underflow)
    (1.5 * 2.0**-9, 2.0**-8),  # 1.5 subnormal gaps: to the even 2
    (5.5 * 2.0**-9, 6 * 2.0**-9),  # subnormal gaps are 2^-9 up to the smallest normal
    (1e-30, 0.0), (0.0, 0.0),
]
E5M2_CASES = [  # the gap is 2^(max(e, -14) - 2)
    (1.125, 1.0), (1.375, 1.5), (57344.0, 57344.0),
    (61440.0, 57344.0),  # 7.5 gaps of 8192: the tie rounds to 65536 (8), past the largest: saturated
    (2.0**-16, 2.0**-16), (2.0**-17, 0.0), (3 * 2.0**-17, 2.0**-15),  # subnormals; 1.5 gaps to the even 2
    (-INF, -57344.0),
]


@pytest.mark.parametrize("fmt, cases", [(E4M3, E4M3_CASES), (E5M2, E5M2_CASES)], ids=["e4m3", "e5m2"])
def test_casts_round_to_nearest_even_saturate_and_flush(fmt, cases):
    x = np.array([c[0] for c in cases], np.float32)
    expected = np.array([c[1] for c in cases], np.float32)
    assert fp8.quantize(x, fmt).tolist() == expected.tolist()
    assert np.isnan(fp8.quantize(np.array([NAN], np.float32), fmt)).all()
    assert np.signbit(fp8.quantize(np.array([-0.0, -1e-30], np.float32), fmt)).all()  # the sign is kept


def test_the_formats_hold_the_published_limits():
    assert (E4M3.max, 2.0**E4M3.min_normal_exp, 2.0**E4M3.min_subnormal_exp) == (448.0, 2.0**-6, 2.0**-9)
    assert (E5M2.max, 2.0**E5M2.min_normal_exp, 2.0**E5M2.min_subnormal_exp) == (57344.0, 2.0**-14, 2.0**-16)


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    exponents = rng.uniform(-40, 20, 200_000)
    x = (np.exp2(exponents) * rng.choice([-1, 1], exponents.size)).astype(np.float32)
    edges = [0.0, -0.0, INF, -INF, NAN, 1e-45, -1e-45, 3.4e38, 2.0**-10, 464.0, 61440.0]
    return np.concatenate([x, np.array(edges, np.float32)])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_the_written_once_arithmetic_is_the_reference_bit_for_bit(fmt):
    x = _values()
    with np.errstate(all="ignore"):
        got = np.asarray(fp8.quantize_with(NUMPY_OPS, x, fmt), np.float32)
    assert np.array_equal(got.view(np.uint32), fp8.quantize(x, fmt).view(np.uint32))


@pytest.mark.parametrize("fmt, name", [(E4M3, "float8_e4m3fn"), (E5M2, "float8_e5m2")])
def test_the_reference_agrees_with_ml_dtypes_inside_the_range(fmt, name):
    ml_dtypes = pytest.importorskip("ml_dtypes")  # not in the core env; jax brings it
    x = _values()
    inside = np.isfinite(x) & (np.abs(x) <= fmt.max)
    expected = x[inside].astype(getattr(ml_dtypes, name)).astype(np.float32)
    assert np.array_equal(fp8.quantize(x[inside], fmt).view(np.uint32), expected.view(np.uint32))


def test_the_scale_is_the_power_of_two_that_fits_the_amax_under_the_largest_value():
    assert fp8.scale_for(3.0, E4M3) == 128.0  # 448 / 3 = 149: 2^7
    assert fp8.scale_for(3.0, E4M3, margin=1) == 64.0
    assert fp8.scale_for(448.0, E4M3) == 1.0 and fp8.scale_for(500.0, E4M3) == 0.5
    assert fp8.scale_for(1e-3, E5M2) == 2.0**25  # 57344e3 = 2^25.8
    assert fp8.scale_for(0.0, E4M3) == 1.0 and fp8.scale_for(INF, E4M3) == 1.0
    x = np.array([3.0, 0.01, -2.5], np.float32)
    assert fp8.scaled_quantize(x, E4M3, 128.0).tolist() == [3.0, 0.009765625, -2.5]  # 1.28 -> 1.25 (gaps of 1/8)


def test_delayed_scaling_reads_the_largest_amax_of_the_last_n_steps():
    history = fp8.AmaxHistory(fp8.Recipe.parse("delayed:2"), E4M3)
    scales = []
    for amax in (1.0, 4.0, 0.5, 0.5, 0.5):
        scales.append(history.scale(amax))
        history.record(amax)
    # step 0: no history, its own amax (448 / 1: 2^8); step 1: step 0's 1 (its own 4 saturates at 2^8);
    # steps 2-3: the 4 of step 1 is within the last 2 (2^6); step 4: only 0.5s left (2^9)
    assert scales == [256.0, 256.0, 64.0, 64.0, 512.0]
    current = fp8.AmaxHistory(fp8.Recipe.parse("current"), E4M3)
    current.record(4.0)
    assert current.scale(1.0) == 256.0  # the current recipe ignores the history
    assert fp8.Recipe.parse("delayed").history == fp8.DEFAULT_HISTORY
    for bad in ("delayed:0", "delayed:x", "current:3", "late"):
        with pytest.raises(HarnessError, match="current, delayed or delayed:N"):
            fp8.Recipe.parse(bad)


def test_the_delayed_history_written_once_is_the_reference_s():
    """recipe_amax_with over a float32 vector (what each adapter keeps per matmul input) scales every step as
    AmaxHistory does: a first step and an all-zero history use the tensor's own amax, NaN and infinities are
    not recorded, the oldest amax drops out after N steps."""
    rng = np.random.default_rng(2)
    amaxes = list(rng.uniform(0.0, 1.0, 60) * 2.0 ** rng.integers(-30, 30, 60))
    amaxes[3:6] = [0.0, 0.0, 0.0]
    amaxes[10], amaxes[20], amaxes[30] = NAN, INF, 0.0
    for n in (1, 3, 16):
        for fmt in (E4M3, E5M2):
            reference, history = fp8.AmaxHistory(fp8.Recipe(n), fmt), np.zeros(n, np.float32)
            if n == 3:
                reference.record(0.0)  # a history holding only a 0: treated as empty, as a zero vector is
            for step, amax in enumerate(amaxes):
                x = np.array([amax, -amax / 3, 0.0], np.float32)
                used, history = fp8.recipe_amax_with(NUMPY_OPS, x, history)
                got = float(fp8.scale_with(NUMPY_OPS, np.float32(used), fmt))
                want = reference.scale(float(np.float32(amax)))
                reference.record(float(np.float32(amax)))
                assert got == want, (n, fmt.name, step, amax, got, want)
    used, none = fp8.recipe_amax_with(NUMPY_OPS, np.array([-3.0, 2.0], np.float32))
    assert (float(used), none) == (3.0, None)  # the current recipe: the tensor's own amax, no history


def test_cast_shares_count_underflow_subnormals_and_saturation():
    x = np.array([1e-6, 3e-3, 1.0, 1000.0, 0.0, NAN], np.float32)  # zeros and NaN are not counted
    shares = fp8.cast_shares(x, E4M3, 1.0)
    assert shares == {"underflow": 0.25, "subnormal": 0.25, "saturate": 0.25}  # 1e-6; 3e-3 < 2^-6; 1000
    assert fp8.cast_shares(x, E4M3, 2.0**-2)["saturate"] == 0.0  # 250 fits
    assert fp8.cast_shares(x, E5M2, 1.0) == {"underflow": 0.25, "subnormal": 0.0, "saturate": 0.0}  # 1e-6 < 2^-17


def test_the_diagnosis_names_a_gradient_the_delayed_recipe_underflows_and_says_safe_elsewhere():
    """Output gradients that shrink 2^-4 a step: the current recipe rescales each step, the delayed one keeps the
    scale step 0's amax gave (2^15: the largest amax of its last 16 steps), so from step 8 on, 2^-32 below it,
    they fall under e5m2's smallest subnormal; the layer whose gradients keep their size is safe under both."""
    rng = np.random.default_rng(0)
    stats = fp8.CastStatistics()
    for step in range(12):
        shrinking = rng.uniform(0.5, 1.0, 1000).astype(np.float32) * np.float32(2.0 ** (-4 * step))
        stats.add("3", "output_gradient", shrinking)
        stats.add("5", "output_gradient", rng.uniform(0.5, 1.0, 1000).astype(np.float32))
    said = fp8.verdicts(stats.result())
    assert said["fp8_hybrid:current"].startswith("fp8_hybrid:current: safe"), said
    assert said["fp8_hybrid:delayed:16"].startswith("fp8_hybrid:delayed:16: not safe: layer 3's output gradient "
                                                    "(e5m2) underflows in "), said
    assert "layer 5" not in said["fp8_hybrid:delayed:16"]
    counts = stats.result()["fp8_hybrid:delayed:16"]["3"]["output_gradient"]
    # scaled by 2^15, step s lies in [2^(14-4s), 2^(15-4s)]: step 7 at 2^-14..2^-13 is still normal; steps 8-11 at
    # or below 2^-17, half e5m2's smallest subnormal, round to 0
    assert (counts["underflow"], counts["subnormal"], counts["values"]) == (4000, 0, 12000), counts
    assert counts["format"] == "e5m2"
    # captured every 10th step, the history spans 160 training steps: the sentence says so, and only the delayed one
    sparse = fp8.verdicts(stats.result(), every=10)
    assert sparse["fp8_hybrid:delayed:16"].endswith("(judged with an amax history of the captured steps only, one in "
                                                    "10: its 16 entries span 160 training steps, not the 16 the "
                                                    "recipe names; `diagnose --every 1` judges the recipe as named)")
    assert sparse["fp8_hybrid:current"] == said["fp8_hybrid:current"]


def test_the_scale_written_once_is_the_reference_s_for_every_amax():
    rng = np.random.default_rng(1)
    amaxes = np.concatenate([np.exp2(rng.uniform(-140, 130, 20_000)).astype(np.float32),
                             np.array([0.0, INF, NAN, 2.0**-126, 2.0**-127, 448.0, 449.0, 1.75, 1.7500001, 57344.0,
                                       3.0e38, 1.0, 2.0**-120, 3.0], np.float32)])
    for fmt in (E4M3, E5M2):
        for margin in (0, 2):
            with np.errstate(all="ignore"):
                got = [float(fp8.scale_with(NUMPY_OPS, np.float32(a), fmt, margin)) for a in amaxes]
            expected = [fp8.scale_for(float(a), fmt, margin) for a in amaxes]
            assert got == expected, [(a, g, e) for a, g, e in zip(amaxes, got, expected) if g != e][:5]
    x = np.array([3.0, 0.01, -2.5], np.float32)
    assert fp8.fake_quantize_with(NUMPY_OPS, x, np.float32(3.0), E4M3).tolist() == \
        fp8.scaled_quantize(x, E4M3, 128.0).tolist()


def test_an_adapter_that_does_not_say_it_emulates_fp8_reports_the_fp8_precisions_unsupported():
    from harness.precision import parse_precision
    from harness.run import capability
    from tests.fake_adapter.fake_adapter import FakeAdapter

    adapter = FakeAdapter()  # whose own unsupported() knows nothing of FP8
    assert capability.unsupported(adapter, parse_precision("fp8_hybrid"), adapter.device("cpu")) == \
        "fake does not emulate FP8 (Capabilities.no_fp8: the matmul layers' casts of harness.fp8)"


def test_an_adapter_that_emulates_fp8_but_declares_no_native_matmuls_reports_the_native_variant_unsupported():
    from dataclasses import replace

    from harness.precision import parse_precision
    from harness.run import capability
    from tests.fake_adapter.fake_adapter import FakeAdapter

    adapter = FakeAdapter()
    adapter.capabilities = replace(adapter.capabilities, no_fp8=None)  # emulates FP8, says nothing of native
    adapter.rounding_ops = lambda: NUMPY_OPS
    assert capability.unsupported(adapter, parse_precision("fp8_hybrid:delayed:16:native"), adapter.device("cpu")) \
        == "fake has no native FP8 matmuls (Capabilities.no_fp8_native)"
