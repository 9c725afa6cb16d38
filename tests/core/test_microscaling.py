"""The microscaling rules written once (harness.microscaling): the element casts against ml_dtypes bit for bit on
every representable value, every midpoint and random values, with saturation and NaN explicit; E8M0 against
ml_dtypes' float8_e8m0fnu; hand-computed blocks (one large outlier, zeros, subnormals, NaN and infinity, a partial
last block) in MX, NVFP4 and block FP8; MX end to end against a scale from math.frexp and ml_dtypes' casts; the
written-once arithmetic, quantizer (quantize_with: the layout too) and Hadamard transform against the reference
through numpy's table, and divide_with's premise; stochastic rounding's bits and mean; the Hadamard transform; the
storage sizes."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from harness import microscaling as mx
from harness.errors import HarnessError
from harness.microscaling import E2M1, E2M3, E3M2, E4M3, E5M2
from harness.rounding import NUMPY_OPS

ml_dtypes = pytest.importorskip("ml_dtypes")  # in the core env (tox.ini)

INF, NAN = float("inf"), float("nan")
ML = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e2m3": "float6_e2m3fn", "e3m2": "float6_e3m2fn",
      "e2m1": "float4_e2m1fn"}
ELEMENTS = [E4M3, E5M2, E2M3, E3M2, E2M1]
IDS = [f.name for f in ELEMENTS]


def _ml(fmt) -> type:
    return getattr(ml_dtypes, ML[fmt.name])


def _ml_cast(x, fmt) -> np.ndarray:
    return np.asarray(x, np.float32).astype(_ml(fmt)).astype(np.float32)


def _same(a, b) -> bool:
    """Bit for bit (-0 apart from 0), NaN equal to NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


def _grid(fmt) -> np.ndarray:
    """Every finite value of the format, from ml_dtypes' codes, sorted (both zeros)."""
    codes = np.arange(1 << mx.ELEMENT_BITS[fmt.name], dtype=np.uint8).view(_ml(fmt)).astype(np.float32)
    return np.unique(codes[np.isfinite(codes)])


# ---- the element casts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ELEMENTS, ids=IDS)
def test_the_formats_hold_ml_dtypes_limits(fmt):
    info = ml_dtypes.finfo(_ml(fmt))
    assert (fmt.max, 2.0**fmt.min_normal_exp, 2.0**fmt.min_subnormal_exp) == \
        (float(info.max), float(info.smallest_normal), float(info.smallest_subnormal))
    assert fmt.max_exp == {"e4m3": 8, "e5m2": 15, "e2m3": 2, "e3m2": 4, "e2m1": 2}[fmt.name]  # torchao's *_MAX_POW2


@pytest.mark.parametrize("fmt", ELEMENTS, ids=IDS)
def test_every_value_and_every_midpoint_casts_as_ml_dtypes_does(fmt):
    grid = _grid(fmt)
    assert _same(mx.cast(grid, fmt), grid)  # every representable value is kept
    assert _same(mx.cast(grid, fmt), _ml_cast(grid, fmt))
    nonneg = np.unique(np.abs(grid))
    mids = ((nonneg[:-1].astype(np.float64) + nonneg[1:]) / 2).astype(np.float32)  # exact: one bit more
    assert np.array_equal(mids.astype(np.float64), (nonneg[:-1].astype(np.float64) + nonneg[1:]) / 2)
    ties = np.concatenate([mids, -mids])
    assert _same(mx.cast(ties, fmt), _ml_cast(ties, fmt))  # ties to the even neighbour, as ml_dtypes
    below = np.nextafter(mids, np.float32(0))
    above = np.nextafter(mids, np.float32(np.inf))
    assert _same(mx.cast(below, fmt), nonneg[:-1]) and _same(mx.cast(above, fmt), nonneg[1:])


@pytest.mark.parametrize("fmt", ELEMENTS, ids=IDS)
def test_random_values_inside_the_range_cast_as_ml_dtypes_does(fmt):
    rng = np.random.default_rng(7)
    exponents = rng.uniform(fmt.min_subnormal_exp - 3, math.log2(fmt.max), 20_000)
    x = np.clip(np.exp2(exponents) * rng.choice([-1, 1], exponents.size), -fmt.max, fmt.max).astype(np.float32)
    x = np.concatenate([x, np.array([0.0, -0.0, 1e-45, -1e-45, 1e-30], np.float32)])  # float32 subnormals too
    assert _same(mx.cast(x, fmt), _ml_cast(x, fmt))
    with np.errstate(all="ignore"):
        assert _same(mx.cast_with(NUMPY_OPS, x, fmt), mx.cast(x, fmt))  # the written-once cast, harness.fp8's


@pytest.mark.parametrize("fmt", ELEMENTS, ids=IDS)
def test_the_cast_saturates_where_ml_dtypes_may_give_nan_or_infinity_and_keeps_nan(fmt):
    top = _grid(fmt)[-1]
    gap = top - _grid(fmt)[-2]
    x = np.array([top + gap / 2, top + gap, 2 * top, 1e30, INF, -INF, -(top + gap / 2)], np.float32)
    expected = np.array([top, top, top, top, top, -top, -top], np.float32)
    assert _same(mx.cast(x, fmt), expected)
    assert _same(mx.cast_stochastic(x, fmt, np.full(x.shape, 65535)), expected)
    assert np.isnan(mx.cast(np.array([NAN], np.float32), fmt)).all()  # ml_dtypes writes FP6/FP4 NaN as -0
    assert np.isnan(mx.cast_stochastic(np.array([NAN], np.float32), fmt, [7])).all()
    assert np.signbit(mx.cast(np.array([-0.0, -1e-30], np.float32), fmt)).all()


def test_e2m1_hand_values():
    x = np.array([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, 7.0, -2.6], np.float32)
    assert mx.cast(x, E2M1).tolist() == [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -3.0]


# ---- E8M0 ---------------------------------------------------------------------------------------------------
def test_e8m0_values_are_ml_dtypes_float8_e8m0fnu():
    codes = np.arange(256, dtype=np.uint8)
    assert _same(mx.e8m0_values(codes), codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    assert mx.e8m0_values([0, 127, 254]).tolist() == [2.0**-127, 1.0, 2.0**127] and np.isnan(mx.e8m0_values(255))


def _amaxes() -> np.ndarray:
    rng = np.random.default_rng(3)
    wide = np.exp2(rng.uniform(-149, 128, 5000)).astype(np.float32)
    edges = [0.0, 1e-45, 2.0**-127, 2.0**-126, 2.0**-125, 1.0, 1.5, 1.75, 1.8, 1.9375, 1.97, 2.0, 6.0, 7.0, 7.5,
             28.0, 448.0, 449.0, 480.0, 500.0, 57344.0, 3.0e38, 3.4028235e38, INF, NAN]
    return np.concatenate([wide, np.array(edges, np.float32)])


@pytest.mark.parametrize("mode", mx.SCALE_MODES)
@pytest.mark.parametrize("fmt", ELEMENTS, ids=IDS)
def test_e8m0_scales_cast_to_ml_dtypes_e8m0_as_their_codes_and_the_written_once_rule_agrees(fmt, mode):
    amax = _amaxes()
    codes = mx.e8m0_codes(amax, fmt, mode)
    scales = mx.e8m0_values(codes)
    assert np.array_equal(scales.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8), codes)
    assert ((codes == 255) == ~np.isfinite(amax)).all()
    with np.errstate(all="ignore"):
        scale, inverse = mx.e8m0_scale_with(NUMPY_OPS, amax, fmt, mode)
    assert _same(scale, scales)
    finite = np.isfinite(amax)
    assert np.array_equal(scale[finite].astype(np.float64) * inverse[finite], np.ones(finite.sum()))


def test_e8m0_rounding_modes_by_hand():
    codes = lambda amax, fmt, mode: (mx.e8m0_codes(np.array(amax, np.float32), fmt, mode).astype(int) - 127).tolist()
    # floor: floor(log2 amax) - emax (OCP, torchao's default); the clamp at 2^-127 (zeros, tiny blocks), NaN at 255
    assert codes([1.0, 448.0, 500.0, 511.0, 512.0, 0.0, 2.0**-140, 3.0e38], E4M3, "floor") == \
        [-8, 0, 0, 0, 1, -127, -127, 127 - 8]
    # ceil: ceil(log2 amax) - emax, so amax / scale <= 2^emax: 448 gets 2^1 (224 fits), 6 in e2m1 gets 2^1
    assert codes([1.0, 448.0], E4M3, "ceil") == [-8, 1]
    assert codes([6.0, 4.0, 0.0], E2M1, "ceil") == [1, 0, -127]
    # even (torchao's EVEN): floor, one up where amax rounded half up to the element's mantissa bits reaches the
    # next power of two: e2m1 (1 bit) from 1.75 x 2^k, e4m3 (3 bits) from 1.9375 x 2^k
    assert codes([6.5, 7.0, 7.9], E2M1, "even") == [0, 1, 1]
    assert codes([480.0, 496.0], E4M3, "even") == [0, 1]
    # rceil: the smallest 2^E >= amax x fl32(1 / max): amax 6 in e2m1 gives 2^0, 7 gives 2^1, 448 in e4m3 2^0
    assert codes([6.0, 7.0, 12.0, 12.5], E2M1, "rceil") == [0, 1, 1, 2]
    assert codes([448.0, 449.0, 0.0], E4M3, "rceil") == [0, 1, -127]
    for mode in mx.SCALE_MODES:
        assert mx.e8m0_codes(np.array([INF, NAN], np.float32), E2M1, mode).tolist() == [255, 255]
    with pytest.raises(HarnessError, match="floor, ceil, even, rceil"):
        mx.e8m0_codes(np.float32(1), E2M1, "nearest")


# ---- hand-computed blocks -------------------------------------------------------------------------------
def test_an_outlier_takes_the_block_scale_and_the_others_underflow():
    x = np.full(32, 1e-3, np.float32)
    x[5] = 1000.0  # floor(log2 1000) = 9
    q = mx.quantize(x, mx.MXFP4)  # scale 2^(9-2) = 128: 1000/128 = 7.8 saturates to 6; 1e-3/128 flushes
    expected = np.zeros(32, np.float32)
    expected[5] = 768.0
    assert q.values.tolist() == expected.tolist() and q.scales.tolist() == [128.0]
    ceil = mx.quantize(x, replace(mx.MXFP4, scale_mode="ceil"))  # 2^(10-2) = 256: 3.9 rounds to 4, no saturation
    assert ceil.values[5] == 1024.0 and ceil.scales.tolist() == [256.0]
    q8 = mx.quantize(x, mx.MXFP8_E4M3)  # scale 2^(9-8) = 2: 500 saturates to 448; 5e-4 is below 2^-10
    assert q8.values[5] == 896.0 and (np.delete(q8.values, 5) == 0).all()
    assert mx.quantize(x, replace(mx.MXFP8_E4M3, scale_mode="ceil")).values[5] == 1024.0  # 250 -> 256 (gap 16)


@pytest.mark.parametrize("fmt", list(mx.FORMATS.values()), ids=list(mx.FORMATS))
def test_a_block_of_zeros_quantizes_to_zeros_keeping_their_signs(fmt):
    x = np.zeros((fmt.rows, 2 * fmt.block), np.float32)
    x[0, 1] = -0.0
    x[:, fmt.block:] = 1.5
    q = mx.quantize(x, fmt, axis=-1)
    assert (q.values[:, :fmt.block] == 0).all() and np.signbit(q.values[0, 1]) and not np.signbit(q.values[0, 0])
    assert np.allclose(q.values[:, fmt.block:], 1.5, rtol=1e-6, atol=0)  # NVFP4's float32 scales round
    zero_scale = {"e8m0": 2.0**-127, "e4m3": 2.0**-6, "float32": 2.0**-126}[fmt.scale]
    assert q.scales.ravel()[0] == zero_scale
    zeros = mx.quantize(np.zeros((fmt.rows, fmt.block), np.float32), fmt)
    assert (zeros.values == 0).all() and zeros.tensor_scale == (2.0**-119 if fmt.scale == "e4m3" else 1.0)


def test_subnormal_elements_and_float32_subnormals_in_mx():
    # amax 1: scale 2^-8; x / scale lands on e4m3's subnormals (gap 2^-9 below 2^-6)
    x = np.zeros(32, np.float32)
    x[:6] = [1.0, 2.0**-14, 2.0**-16, 2.0**-17, 2.0**-18, 3 * 2.0**-18]
    q = mx.quantize(x, mx.MXFP8_E4M3)
    # 2^-6 normal, 2^-8 and 2^-9 subnormal, 2^-10 ties to 0, 1.5 x 2^-9 ties to 2^-8
    assert q.values[:6].tolist() == [1.0, 2.0**-14, 2.0**-16, 2.0**-17, 0.0, 2.0**-16]
    # a block of float32 subnormals: floor(log2 2^-120) - 8 = -128, clamped to E8M0's 2^-127
    tiny = np.zeros(32, np.float32)
    tiny[:3] = [2.0**-120, 2.0**-130, 2.0**-133]
    q = mx.quantize(tiny, mx.MXFP8_E4M3)
    assert q.scales.tolist() == [2.0**-127]
    assert q.values[:3].tolist() == [2.0**-120, 2.0**-130, 2.0**-133]  # 2^7, 2^-3, 2^-6: exact, dequantized exactly
    assert mx.quantize(tiny, mx.MXFP4).values[:3].tolist() == [2.0**-120, 0.0, 0.0]  # scale 2^-122: 4, 2^-8, 2^-11


@pytest.mark.parametrize("fmt", list(mx.FORMATS.values()), ids=list(mx.FORMATS))
@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_a_block_holding_nan_or_infinity_is_nan_and_its_neighbours_are_untouched(fmt, bad):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((fmt.rows, 2 * fmt.block)).astype(np.float32)
    x[-1, 3] = bad
    q = mx.quantize(x, fmt)
    assert np.isnan(q.values[:, :fmt.block]).all() and np.isnan(q.scales.ravel()[0])
    alone = mx.quantize(x[:, fmt.block:], fmt)  # NVFP4's tensor amax: the largest finite block amax
    assert _same(q.values[:, fmt.block:], alone.values) and q.tensor_scale == alone.tensor_scale
    if fmt.scale == "e8m0":
        assert q.scales.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8).ravel()[0] == 0xFF


@pytest.mark.parametrize("fmt", [mx.MXFP8_E4M3, mx.MXFP4, mx.NVFP4, mx.FP8_BLOCK], ids=lambda f: f.name)
def test_a_partial_last_block_is_scaled_by_its_own_values(fmt):
    rng = np.random.default_rng(11)
    n = 2 * fmt.block + 7
    x = (rng.standard_normal((3, n)) * np.array([[1.0], [1e-3], [50.0]])).astype(np.float32)
    x[:, -7:] *= np.float32(1e-2)  # the tail far smaller than the rest: a shared scale would flush it
    q = mx.quantize(x, fmt, tensor_amax_value=np.abs(x).max())
    assert q.scales.shape == (3, 3)
    fixed = np.abs(x).max()
    for start, stop in ((0, fmt.block), (fmt.block, 2 * fmt.block), (2 * fmt.block, n)):
        alone = mx.quantize(x[:, start:stop], fmt, tensor_amax_value=fixed)
        assert _same(q.values[:, start:stop], alone.values)
        assert _same(q.scales[:, start // fmt.block], alone.scales[:, 0])
    assert (q.values[:, -7:] != 0).mean() > 0.6
    # the same along axis 0 (a right operand's K)
    qt = mx.quantize(x.T.copy(), fmt, axis=0, tensor_amax_value=fixed)
    assert _same(qt.values, q.values.T) and _same(qt.scales, q.scales.T)


def test_a_partial_2d_tile():
    rng = np.random.default_rng(12)
    w = rng.standard_normal((150, 40)).astype(np.float32)
    w[128:, :] *= np.float32(1e-3)
    q = mx.quantize(w, mx.FP8_BLOCK_WEIGHT, axis=0)  # 128 x 128 tiles: rows 0-127 and 128-149
    assert q.scales.shape == (2, 1)
    assert _same(q.values[128:], mx.quantize(w[128:], mx.FP8_BLOCK_WEIGHT, axis=0).values)
    assert q.scales[1, 0] == np.float32(np.abs(w[128:]).max()) / np.float32(448)
    n = mx.quantize(w, mx.NVFP4_WEIGHT, axis=0, tensor_amax_value=np.abs(w).max())  # 16 x 16 tiles along K and N
    assert n.scales.shape == (10, 3)
    tile = mx.quantize(w[144:, 32:], mx.NVFP4_WEIGHT, axis=0, tensor_amax_value=np.abs(w).max())
    assert _same(n.values[144:, 32:], tile.values)


def test_nvfp4_by_hand():
    # one tensor: the tensor amax 2688 gives g = 1; block 1's scale e4m3(2688 / 6) = 448, block 2's e4m3(30 / 6) = 5
    x = np.zeros(32, np.float32)
    x[:3] = [2688.0, 100.0, -1000.0]  # 100 / 448 = 0.22 flushes; 1000 / 448 = 2.23 -> 2
    x[16:20] = [30.0, 13.0, 12.5, -1.0]  # / 5: 6, 2.6 -> 3, 2.5 ties to 2, 0.2 flushes
    q = mx.quantize(x, mx.NVFP4)
    assert q.tensor_scale == 1.0 and q.scales.tolist() == [448.0, 5.0]
    assert q.values[:3].tolist() == [2688.0, 0.0, -896.0] and q.values[16:20].tolist() == [30.0, 15.0, 10.0, -0.0]
    # the block scale rounds to e4m3: 31 / 6 = 5.17 -> 5, so 31 / 5 = 6.2 saturates to 6
    y = np.array([2688.0] + [0.0] * 15 + [31.0] + [0.0] * 15, np.float32)
    assert mx.quantize(y, mx.NVFP4).values[16] == 30.0
    # g = amax / 2688 in float32 (torchao's per_tensor_amax_to_scale), at least 2^-119; the block scale at least 2^-6
    assert mx.nvfp4_tensor_scale(1.0) == np.float32(1.0) / np.float32(2688.0)
    assert mx.nvfp4_tensor_scale(0.0) == 2.0**-119
    small = np.array([1.0] + [0.0] * 15 + [1e-6] + [0.0] * 15, np.float32)
    assert mx.quantize(small, mx.NVFP4).scales[1] == 2.0**-6
    with pytest.raises(HarnessError, match="largest finite"):
        mx.nvfp4_tensor_scale(INF)


def test_nvfp4_block_scales_follow_torchaos_float32_order():
    """(amax / 6) / g, as torchao's nvfp4_quantize: for a tensor amax of 1000 and a block amax of 11.718751 it
    lands exactly on 5.25, e4m3's tie between 5 and 5.5, which goes to the even 5; amax / (6 g), or Transformer
    Engine's amax (S_enc / 6), give 5.2500005 and round to 5.5."""
    x = np.zeros(32, np.float32)
    x[0], x[16] = 1000.0, np.float32(11.718751)
    g = mx.nvfp4_tensor_scale(1000.0)
    assert (np.float32(11.718751) / np.float32(6)) / g == np.float32(5.25)
    assert np.float32(11.718751) / (np.float32(6) * g) > np.float32(5.25)
    assert mx.quantize(x, mx.NVFP4).scales.tolist() == [448.0, 5.0]
    blocks = mx.to_blocks(x, mx.NVFP4)
    amax = mx.block_amax(blocks)
    _, scales = mx.block_quantize_with(NUMPY_OPS, blocks, amax, mx.NVFP4, mx.nvfp4_tensor_scale_with(
        NUMPY_OPS, mx.tensor_amax(amax)))
    assert np.ravel(scales).tolist() == [448.0, 5.0]


def test_block_fp8_by_hand():
    x = np.zeros(128, np.float32)
    x[:4] = [1344.0, 100.0, 1e-3, -3.0]  # s = 1344 / 448 = 3: 448; 33.3 -> 32 (gap 4); 3.3e-4 flushes; -1
    q = mx.quantize(x, mx.FP8_BLOCK)
    assert q.scales.tolist() == [3.0] and q.values[:4].tolist() == [1344.0, 96.0, 0.0, -3.0]
    odd = np.zeros(128, np.float32)
    odd[0] = 1000.0  # s = 1000 / 448 in float32, not a power of two: 1000 / s rounds to 448 exactly
    assert mx.quantize(odd, mx.FP8_BLOCK).values[0] == np.float32(448) * (np.float32(1000) / np.float32(448))


# ---- MX end to end, against ml_dtypes ------------------------------------------------------------------------
def _mx_expected(x: np.ndarray, fmt: mx.BlockFormat) -> np.ndarray:
    """An independent MX: blocks along the last axis; the exponent from math.frexp, the cast ml_dtypes' after a clip."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        for start in range(0, x.shape[1], fmt.block):
            block = x[i, start:start + fmt.block].astype(np.float64)
            amax = float(np.abs(block).max())
            mantissa, exponent = math.frexp(amax)  # amax = mantissa 2^exponent, mantissa in [0.5, 1)
            e = exponent - 1 if amax else -127
            if fmt.scale_mode == "ceil" and amax and mantissa != 0.5:
                e += 1
            scale = 2.0 ** max(-127, min(127, e - fmt.element.max_exp))
            elements = np.clip(block / scale, -fmt.element.max, fmt.element.max).astype(_ml(fmt.element))
            out[i, start:start + fmt.block] = elements.astype(np.float64) * scale
    return out


@pytest.mark.parametrize("mode", ["floor", "ceil"])
@pytest.mark.parametrize("fmt", [mx.MXFP8_E4M3, mx.MXFP8_E5M2, mx.MXFP6_E2M3, mx.MXFP6_E3M2, mx.MXFP4],
                         ids=lambda f: f.name)
def test_mx_agrees_with_a_frexp_scale_and_ml_dtypes_casts_bit_for_bit(fmt, mode):
    fmt = replace(fmt, scale_mode=mode)
    rng = np.random.default_rng(13)
    rows = np.exp2(rng.uniform(-135, 120, (40, 1)))  # every block its own range, float32 subnormals included
    x = (rng.standard_normal((40, 75)) * rows * np.exp2(rng.uniform(-12, 0, (40, 75)))).astype(np.float32)
    x[3, :32] = 0.0
    assert _same(mx.quantize(x, fmt).values, _mx_expected(x, fmt))


# ---- the written-once arithmetic -------------------------------------------------------------------------
def _hard_tensor(rng, shape) -> np.ndarray:
    scales = np.exp2(rng.uniform(-125, 110, shape[:-1] + (1,)))
    x = (rng.standard_normal(shape) * scales * np.exp2(rng.uniform(-20, 0, shape))).astype(np.float32)
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, 6, replace=False)] = [NAN, INF, -INF, 0.0, -0.0, 1e-45]
    x[0, :128] = 0.0
    return x


@pytest.mark.parametrize("mode", mx.SCALE_MODES)
def test_the_written_once_block_arithmetic_is_the_reference_bit_for_bit(mode):
    rng = np.random.default_rng(17)
    for fmt in mx.FORMATS.values():
        fmt = replace(fmt, scale_mode=mode)
        x = _hard_tensor(rng, (fmt.rows * 2 + 3, 300))
        bits = rng.integers(0, mx.NOISE_RANGE, x.shape, dtype=np.int32)
        for rounding, b in (("nearest", None), ("stochastic", bits)):
            ref = mx.quantize(x, fmt, rounding=rounding, bits=b)
            blocks = mx.to_blocks(x, fmt)
            amax = mx.block_amax(blocks)
            g = mx.nvfp4_tensor_scale_with(NUMPY_OPS, mx.tensor_amax(amax)) if fmt.scale == "e4m3" else None
            with np.errstate(all="ignore"):
                values, scales = mx.block_quantize_with(NUMPY_OPS, blocks, amax, fmt, g,
                                                        None if b is None else mx.to_blocks(b, fmt))
            got = mx.from_blocks(np.asarray(values, np.float32), x.shape, fmt)
            assert _same(got, ref.values), (fmt.name, rounding)
            grid = mx._scale_grid(np.broadcast_to(scales, amax.shape), x.ndim, fmt, -1, None)
            assert _same(grid, ref.scales), (fmt.name, rounding)
            assert np.isnan(ref.values).any() and (ref.values == 0).any() and np.isfinite(ref.values).any()


# (fmt, axis, across, shape): 1-d blocks along the last, the first and a middle axis, 2-d tiles either way round
QUANTIZE_WITH_LAYOUTS = [(fmt, -1, None, (fmt.rows * 2 + 3, 300)) for fmt in mx.FORMATS.values()] + [
    (mx.MXFP8_E4M3, 0, None, (70, 9)), (mx.NVFP4, 1, None, (3, 37, 5)), (mx.FP8_BLOCK_WEIGHT, 0, None, (150, 130)),
    (mx.NVFP4_WEIGHT, 2, 0, (20, 3, 40)), (mx.NVFP4_WEIGHT, 0, 2, (37, 2, 18))]


@pytest.mark.parametrize("mode", mx.SCALE_MODES)
def test_the_written_once_quantizer_is_the_reference_bit_for_bit(mode):
    """quantize_with through numpy's table: the layout (to_blocks_with: transposes, padding, crops), the block amax,
    NVFP4's tensor amax and divide_with, against quantize(), values and scales, in every layout."""
    rng = np.random.default_rng(41)
    for fmt, axis, across, shape in QUANTIZE_WITH_LAYOUTS:
        fmt = replace(fmt, scale_mode=mode)
        x = _hard_tensor(rng, shape)
        bits = rng.integers(0, mx.NOISE_RANGE, x.shape, dtype=np.int32)
        for rounding, b, kept in (("nearest", None, None), ("stochastic", bits, None), ("nearest", None, 3.5)):
            if kept is not None and fmt.scale != "e4m3":
                continue
            ref = mx.quantize(x, fmt, axis, rounding, b, across, kept)
            with np.errstate(all="ignore"):
                values, scales = mx.quantize_with(NUMPY_OPS, x, fmt, axis, rounding, b, across,
                                                  None if kept is None else np.float32(kept))
            where = (fmt.name, axis, across, rounding, kept)
            assert _same(values, ref.values) and _same(scales, ref.scales), where
    with pytest.raises(HarnessError, match="stochastic rounding needs its bits"):
        mx.quantize_with(NUMPY_OPS, np.zeros((2, 32), np.float32), mx.MXFP4, rounding="stochastic")
    with pytest.raises(HarnessError, match="nearest or stochastic"):
        mx.quantize_with(NUMPY_OPS, np.zeros((2, 32), np.float32), mx.MXFP4, rounding="up")


@pytest.mark.parametrize("divisor", [mx.E2M1.max, E4M3.max, mx.NVFP4_TENSOR_DIVISOR])
def test_a_float64_division_rounds_to_the_float32_quotient_even_as_a_product_with_the_reciprocal(divisor):
    """divide_with's premise, over every float32 significand: the float32 quotient by 6, 448 and 2688 equals the
    float64 quotient rounded to float32, and so does the float64 product with the reciprocal that XLA puts in place
    of a division by a constant; the float32 product is an ulp off for a fifth to a half of them. Two binades: one
    of normal quotients, one whose quotients are float32 subnormals (numpy keeps them)."""
    significands = np.arange(1 << 23, dtype=np.uint32)
    for exponent_field in (127, 1):  # [1, 2); [2^-126, 2^-125), whose quotients are subnormals
        a = (significands | np.uint32(exponent_field << 23)).view(np.float32)
        quotient = a / np.float32(divisor)
        assert _same(mx.divide_with(NUMPY_OPS, a, divisor), quotient)
        assert _same((a.astype(np.float64) * (1.0 / divisor)).astype(np.float32), quotient)
        if exponent_field == 127:
            assert 0.2 < np.mean(a * np.float32(1.0 / divisor) != quotient) < 0.6


def test_the_written_once_hadamard_transform_is_the_reference_rounded_once():
    """hadamard_transform_with through numpy's table is float32(hadamard_transform) bit for bit: along either axis,
    for blocks within 25 binades (exact) and far wider (the float64 sums round, in the same order), with NaN and
    infinities; a dimension not a multiple of 16 is refused."""
    rng = np.random.default_rng(43)
    x = (rng.standard_normal((6, 64)) * np.exp2(rng.uniform(-100, 100, (6, 64)))).astype(np.float32)
    x[0, :16] = rng.standard_normal(16)
    x[1, 3], x[2, 20], x[3, 40] = NAN, INF, -INF
    for axis, v in ((-1, x), (0, x.T.copy())):
        want = mx.hadamard_transform(v, axis, seed=7).astype(np.float32)
        with np.errstate(all="ignore"):
            assert _same(mx.hadamard_transform_with(NUMPY_OPS, v, axis, seed=7), want)
    with pytest.raises(HarnessError, match="multiple of 16"):
        mx.hadamard_transform_with(NUMPY_OPS, np.zeros((2, 24), np.float32))


def test_an_adapter_without_the_layout_primitives_has_no_block_scaled_quantizer():
    assert mx.missing_block_ops(NUMPY_OPS) == []
    assert mx.missing_block_ops(None) == list(mx.BLOCK_OPS)
    assert mx.missing_block_ops(replace(NUMPY_OPS, flip=None, float64=None)) == ["flip", "float64"]


def test_blocks_round_trip_and_the_layout_errors():
    x = np.arange(2 * 3 * 37, dtype=np.float32).reshape(2, 3, 37)
    for axis in (0, 1, 2, -1):
        assert _same(mx.from_blocks(mx.to_blocks(x, mx.MXFP4, axis), x.shape, mx.MXFP4, axis), x)
    assert _same(mx.from_blocks(mx.to_blocks(x, mx.NVFP4_WEIGHT, 2, 0), x.shape, mx.NVFP4_WEIGHT, 2, 0), x)
    with pytest.raises(HarnessError, match="16 x 16 tiles need a 2-d tensor"):
        mx.quantize(x, mx.NVFP4_WEIGHT)
    with pytest.raises(HarnessError, match="axis 3 of a 3-d tensor"):
        mx.quantize(x, mx.MXFP4, axis=3)
    with pytest.raises(HarnessError, match="nearest or stochastic"):
        mx.quantize(x, mx.MXFP4, rounding="up")
    with pytest.raises(HarnessError, match=r"one integer in \[0, 2\^16\) per value"):
        mx.quantize(x, mx.MXFP4, rounding="stochastic", bits=np.zeros(3, np.int32))
    with pytest.raises(HarnessError, match="scale_mode"):
        replace(mx.MXFP4, scale_mode="round")


# ---- stochastic rounding -------------------------------------------------------------------------------------
def test_the_stochastic_cast_uses_the_bits_as_given():
    x = np.full(4, 1.25, np.float32)  # e2m1: between 1 and 1.5, half way: away iff r >= 2^15
    assert mx.cast_stochastic(x, E2M1, [0, 32767, 32768, 65535]).tolist() == [1.0, 1.0, 1.5, 1.5]
    y = np.array([1.01, -1.01, 2.9, 0.3, -0.74], np.float32)
    assert mx.cast_stochastic(y, E2M1, np.zeros(5, int)).tolist() == [1.0, -1.0, 2.0, 0.0, -0.5]  # r = 0: toward 0
    assert mx.cast_stochastic(y, E2M1, np.full(5, 65535)).tolist() == [1.5, -1.5, 3.0, 0.5, -1.0]  # any fraction up
    on_grid = np.array([1.5, -4.0, 0.0], np.float32)
    assert mx.cast_stochastic(on_grid, E2M1, np.full(3, 65535)).tolist() == on_grid.tolist()  # no fraction: kept
    # in quantize, value i takes bits[i]: changing one value's bits moves that value only
    rng = np.random.default_rng(19)
    v = rng.standard_normal((2, 64)).astype(np.float32)
    bits = rng.integers(0, mx.NOISE_RANGE, v.shape)
    a = mx.quantize(v, mx.MXFP4, rounding="stochastic", bits=bits).values
    flipped = bits.copy()
    flipped[1, 40] = mx.NOISE_RANGE - 1 - flipped[1, 40]
    b = mx.quantize(v, mx.MXFP4, rounding="stochastic", bits=flipped).values
    assert (a != b).sum() <= 1 and _same(np.delete(a, 64 + 40), np.delete(b, 64 + 40))
    with pytest.raises(HarnessError, match="one integer"):
        mx.cast_stochastic(x, E2M1, [0, 1, 2, 65536])


@pytest.mark.parametrize("fmt", [E2M1, E2M3, E3M2, E4M3, E5M2], ids=lambda f: f.name)
def test_the_stochastic_cast_is_unbiased_over_every_bit_pattern(fmt):
    """Over all 2^16 bit patterns the mean is the value within 2^-15 of its gap (the threshold is compared in
    float32: one pattern more or fewer than the exact fraction), and every draw is one of the two neighbours."""
    rng = np.random.default_rng(23)
    grid = _grid(fmt)
    lo = grid[(grid > 0) & (grid < fmt.max)]
    x = (rng.choice(lo, 12) * rng.uniform(1.0, 1.4, 12) * rng.choice([-1, 1], 12)).astype(np.float32)
    x = np.clip(x, -fmt.max, fmt.max)
    x = np.concatenate([x, np.array([2.0**fmt.min_subnormal_exp * 0.3, -2.0**fmt.min_subnormal_exp * 0.77],
                                    np.float32)])
    bits = np.arange(mx.NOISE_RANGE, dtype=np.int32)[:, None]
    shape = (mx.NOISE_RANGE, x.size)
    draws = mx.cast_stochastic(np.broadcast_to(x, shape), fmt, np.broadcast_to(bits, shape))
    down, up = mx.cast_stochastic(x, fmt, np.zeros(x.size, int)), mx.cast_stochastic(x, fmt, np.full(x.size, 65535))
    assert ((draws == down) | (draws == up)).all()
    gap = np.abs(up.astype(np.float64) - down)
    error = np.abs(draws.astype(np.float64).mean(axis=0) - x)
    assert (error <= gap * 2.0**-15).all(), (x, error / gap)


# ---- the Hadamard transform ------------------------------------------------------------------------------
def test_the_hadamard_matrix_is_orthogonal_exactly_and_signed_by_the_seed():
    q = mx.hadamard_matrix(seed=1)
    assert set(np.abs(q).ravel().tolist()) == {0.25}
    assert np.array_equal(q @ q.T, np.eye(16)) and np.array_equal(q.T @ q, np.eye(16))
    assert np.array_equal(mx.hadamard_signs(1), mx.hadamard_signs(1))
    assert not np.array_equal(mx.hadamard_signs(1), mx.hadamard_signs(2))
    assert set(mx.hadamard_signs(1).tolist()) == {-1.0, 1.0}


def test_the_hadamard_transform_is_exact_and_invertible():
    rng = np.random.default_rng(29)
    x = (rng.uniform(1, 2, (8, 64)) * np.exp2(rng.integers(-12, 12, (8, 64))) * rng.choice([-1, 1], (8, 64)))
    x = x.astype(np.float32)  # each block spans under 25 binades: the float64 sums are exact
    y = mx.hadamard_transform(x, axis=-1, seed=3)
    q = mx.hadamard_matrix(seed=3)
    assert np.array_equal(y, (x.astype(np.float64).reshape(8, 4, 16) @ q).reshape(8, 64))  # the butterfly is x Q
    assert np.array_equal(mx.inverse_hadamard_transform(y, axis=-1, seed=3), x)  # back exactly, in float64
    assert np.allclose((y.reshape(-1, 16) ** 2).sum(-1), (x.astype(np.float64).reshape(-1, 16) ** 2).sum(-1),
                       rtol=1e-14)  # each block's norm is kept
    along0 = mx.hadamard_transform(x.T, axis=0, seed=3)
    assert np.array_equal(along0, y.T)
    wide = rng.standard_normal((4, 32)) * np.exp2(rng.uniform(-100, 100, (4, 32)))  # past 25 binades: rounding
    back = mx.inverse_hadamard_transform(mx.hadamard_transform(wide, seed=5), seed=5)
    assert np.allclose(back, wide, rtol=0, atol=1e-15 * np.abs(wide).max())
    with pytest.raises(HarnessError, match="multiple of 16"):
        mx.hadamard_transform(np.zeros((2, 24)))


# ---- storage and matmuls ---------------------------------------------------------------------------------
def test_storage_sizes_count_elements_block_scales_and_the_tensor_scale():
    per = {name: mx.bits_per_value(f) for name, f in mx.FORMATS.items()}
    assert per == {"mxfp8_e4m3": 8.25, "mxfp8_e5m2": 8.25, "mxfp6_e2m3": 6.25, "mxfp6_e3m2": 6.25, "mxfp4": 4.25,
                   "nvfp4": 4.5, "nvfp4_16x16": 4 + 8 / 256, "fp8_block_1x128": 8.25,
                   "fp8_block_128x128": 8 + 32 / 16384}
    assert mx.storage_bits((3, 40), mx.MXFP4) == 120 * 4 + 3 * 2 * 8  # a partial block has its scale
    assert mx.storage_bits((4, 16), mx.NVFP4) == 64 * 4 + 4 * 8 + 32  # and NVFP4 its float32 tensor scale
    assert mx.storage_bits((150, 40), mx.FP8_BLOCK_WEIGHT, axis=0) == 6000 * 8 + 2 * 32
    assert mx.storage_bits((64, 4096), mx.MXFP8_E4M3, axis=0) == 64 * 4096 * 8 + 2 * 4096 * 8


def test_a_matmul_blocks_both_operands_along_k():
    rng = np.random.default_rng(31)
    a = rng.standard_normal((4, 64)).astype(np.float32)
    b = rng.standard_normal((64, 3)).astype(np.float32)
    b[:, 1] *= np.float32(1e4)  # one column of the right operand 10^4 larger: blocks along K keep the others
    qb = mx.quantize(b, mx.MXFP4, axis=0)
    assert qb.scales.shape == (2, 3)
    assert _same(mx.matmul(a, b, mx.MXFP4), mx.quantize(a, mx.MXFP4).values @ qb.values)
    along_n = mx.quantize(b, mx.MXFP4, axis=1).values  # blocked along N, the large column flushes the others
    assert (qb.values[:, 0] != 0).sum() > 50 and (along_n[:, 0] != 0).sum() < 5


def test_check_states_what_each_block_format_would_store_from_sizes(capsys):
    """mnist_mlp's kernels [784, 512] and [512, 10] in MXFP8: a byte per weight and an E8M0 byte per 32 along K (784
    rows end in a partial block: 25 per column); NVFP4 16x16 tiles: half a byte each, an E4M3 byte per tile and a
    float32 tensor scale per kernel."""
    from harness.cli import main
    from harness.model.graph import infer
    from harness.model.spec import load_spec

    graph = infer(load_spec("mnist_mlp"))
    assert mx.weight_storage_bits(graph, mx.RECIPES["mxfp8"]) == (8 * (406_528 + 25 * 512 + 16 * 10), 406_528)
    assert mx.weight_storage_bits(graph, mx.RECIPES["nvfp4"])[0] == \
        4 * 406_528 + 8 * (49 * 32 + 32 * 1) + 2 * 32
    assert main(["check", "mnist_mlp"]) == 0
    assert "its 406,528 matmul weights, stored block-scaled (scales included): mxfp8 409.7 KiB" in \
        capsys.readouterr().out


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4", "fp8_block"])
@pytest.mark.parametrize("hadamard", [False, True])
def test_block_linear_quantizes_each_product_along_its_reduction_axis(name, hadamard):
    """The training rule (BlockRecipe) from quantize(), the numpy reference, written out: y from x and w along K,
    dx from dy and w along N, dw from x and dy along M (Hadamard-transformed first with :rht)."""
    recipe = replace(mx.RECIPES[name], hadamard=hadamard)
    rng = np.random.default_rng(3)
    x, w, dy = (rng.standard_normal(shape).astype(np.float32) for shape in ((48, 160), (160, 40), (48, 40)))
    tile = {"across": 1} if recipe.weight.rows > 1 else {}
    q = lambda t, fmt, axis, **kw: mx.quantize(t, fmt, axis=axis, **kw).values.astype(np.float64)  # noqa: E731
    x_m, dy_m = (mx.hadamard_transform(t, axis=0) if hadamard else t for t in (x, dy))
    want = (q(x, recipe.activation, 1) @ q(w, recipe.weight, 0, **tile),
            q(dy, recipe.gradient, 1) @ q(w, recipe.weight, 1, **({"across": 0} if tile else {})).T,
            q(x_m, recipe.activation, 0).T @ q(dy_m, recipe.gradient, 0))
    for got, expected in zip(mx.block_linear(x, w, dy, recipe), want):
        np.testing.assert_allclose(got, expected.astype(np.float32), rtol=0, atol=1e-6 * np.abs(expected).max())


CONV_LAYERS = [{"type": "conv2d", "filters": 6, "kernel_size": 3, "strides": 2, "padding": "same"},
               {"type": "conv2d", "filters": 4, "kernel_size": 3, "dilation": 2},
               {"type": "patches", "size": 4, "dim": 5}]


@pytest.mark.parametrize("spec", CONV_LAYERS, ids=["same_stride2", "dilated", "patches"])
def test_a_convolution_is_its_windows_times_its_kernel_and_folding_is_their_adjoint(spec):
    """windows() in the kernel's (i, j, c) order times the kernel [k*k*C, F] is the reference's convolution, and
    fold_windows is windows' adjoint (<windows(x), r> = <x, fold(r)>): the gradient block_conv2d gives x."""
    from pydantic import TypeAdapter

    from harness.model import reference
    from harness.model.spec import Layer

    layer = TypeAdapter(Layer).validate_python(spec)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 9, 8, 3))
    k, f = spec.get("kernel_size", spec.get("size")), spec.get("filters", spec.get("dim"))
    kernel = rng.standard_normal((k, k, 3, f))
    rows = reference.windows(layer, x[:, :8])
    w = {"l.kernel": kernel, "l.bias": np.zeros(f)}
    want = reference._conv2d(layer, "l", w, x[:, :8]) if layer.type == "conv2d" else \
        reference._layer(layer, "l", w, x[:, :8], False, None, None).reshape(rows.shape[:3] + (f,))
    np.testing.assert_allclose(rows @ kernel.reshape(-1, f), want, rtol=1e-12, atol=1e-12)
    if layer.type == "conv2d":  # an odd height: 'same' pads its odd pixel after, like TensorFlow
        rows = reference.windows(layer, x)
        r = rng.standard_normal(rows.shape)
        assert math.isclose(float((rows * r).sum()), float((x * reference.fold_windows(layer, r, x.shape)).sum()),
                            rel_tol=1e-12)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_a_block_scaled_convolution_is_block_linear_of_its_windows(name):
    """block_conv2d is the dense rule on the windows: y and dw block_linear's, dx its rows' gradient folded back."""
    from pydantic import TypeAdapter

    from harness.model import reference
    from harness.model.spec import Layer

    layer = TypeAdapter(Layer).validate_python(CONV_LAYERS[0])
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 7, 8, 5)).astype(np.float32)
    kernel = rng.standard_normal((3, 3, 5, 6)).astype(np.float32)
    dy = rng.standard_normal((4, 4, 4, 6)).astype(np.float32)
    y, dx, dw = mx.block_conv2d(layer, x, kernel, dy, mx.RECIPES[name])
    rows = reference.windows(layer, x)
    want_y, want_rows, want_dw = mx.block_linear(rows.reshape(64, 45), kernel.reshape(45, 6), dy.reshape(64, 6),
                                                 mx.RECIPES[name])
    np.testing.assert_array_equal(y, want_y.reshape(4, 4, 4, 6))
    np.testing.assert_array_equal(dw, want_dw.reshape(3, 3, 5, 6))
    np.testing.assert_allclose(dx, reference.fold_windows(layer, want_rows.reshape(rows.shape), x.shape), atol=1e-5)
    # and it quantizes: not the float32 product
    assert np.abs(y - (rows @ kernel.reshape(45, 6)).reshape(y.shape)).max() > 1e-3


def test_a_grouped_convolution_is_refused_in_a_block_scaled_precision():
    from harness.model.graph import infer
    from harness.model.spec import load_spec

    refusal = mx.block_refusal(mx.RECIPES["mxfp8"], infer(load_spec("tests/specs/pitfall_mobile_graph.yaml")), 16)
    assert "groups), which is not covered yet" in refusal
    assert mx.block_refusal(mx.RECIPES["mxfp8"], infer(load_spec("resnet8")), 16) is None
    assert mx.block_refusal(mx.RECIPES["nvfp4"], infer(load_spec("vit_tiny")), 16) is None


def test_an_adapter_that_block_scales_says_whether_it_rounds_stochastically_and_has_native_kernels():
    """:sr and :native are unsupported, with the capability's reason, in an adapter that block-scales but does not
    declare them."""
    from harness.precision import parse_precision
    from harness.run import capability
    from tests.fake_adapter.fake_adapter import FakeAdapter

    adapter = FakeAdapter()
    adapter.capabilities = replace(adapter.capabilities, no_block_scaling=None)
    adapter.rounding_ops = lambda: NUMPY_OPS
    cpu = adapter.device("cpu")
    assert "does not round block-scaled gradients stochastically" in \
        capability.unsupported(adapter, parse_precision("nvfp4:rht:sr"), cpu)
    assert "has no native block-scaled matmuls" in capability.unsupported(adapter, parse_precision("mxfp8:native"), cpu)
