"""The block-scaled formats' quantizer on the adapter's primitives (harness.microscaling.quantize_with and
hadamard_transform_with over Adapter.rounding_ops, run through ops.on_device as the kit runs every rule: compiled by
XLA in JAX, eager in torch and TensorFlow): fed the same float32 tensors, it gives numpy's reference
(harness.microscaling.quantize) bit for bit, the dequantized values and the block scales alike (NaN equal to NaN),
so every framework quantizes identically.

The formats: every one (MXFP8 e4m3 and e5m2, MXFP6 e2m3 and e3m2, MXFP4, NVFP4 in 1 x 16 blocks and 16 x 16 tiles,
block FP8 1 x 128 and 128 x 128) with round-to-nearest; MX with ceil E8M0 scales too, and one format each with the
even and rceil ones; stochastic rounding by given bits in one format per kind of scale (NVFP4, MXFP8 e5m2, block
FP8 128 x 128: 2-d tiles of bits); NVFP4 with a kept tensor amax; NVFP4 (with either rounding) and MXFP4 after the
random Hadamard transform; blocks along axis 0 and along the other axes of a 3-d tensor. The tensors, the same for
every format: blocks with one large outlier; blocks and tiles of zeros (negative zeros too); values in the elements'
subnormal ranges and float32 subnormals among normal values; NaN and infinities; random normal data at magnitudes
from 2^-60 to 2^60 (a Hadamard block then spans more binades than float64 sums exactly); ties, values half way
between two neighbours of the element grid once scaled (a cast that rounds them away from zero, not to even, fails
on them in every format). No dimension is a multiple of the block (but the Hadamard transform's axis, a multiple of
16), so partial blocks are everywhere.

A framework that flushes float32 subnormals to zero (TensorFlow's and XLA's CPU code) cannot match the reference on
blocks whose values lie below 2^-126 (docs/microscaling.md); that case is checked only where the framework keeps
them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

from harness import microscaling as mx

SHAPE = (150, 300)  # 150 = 9 x 16 + 6 = 128 + 22 rows, 300 = 9 x 32 + 12 = 18 x 16 + 12 = 2 x 128 + 44 columns
HADAMARD_SHAPE = (150, 304)  # the transform's axis is a multiple of 16
CUBE = (9, 50, 100)  # SHAPE's values as a 3-d tensor
NOISE_SEED = 45


def _outlier(rng, shape):
    """Normal values with one value 10^4 times larger in many blocks: its block's scale is set by it."""
    x = rng.standard_normal(shape)
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, flat.size // 40, replace=False)] = 3e4 * rng.choice([-1.0, 1.0], flat.size // 40)
    return x


def _zeros(rng, shape):
    """Whole blocks and tiles of zeros, signed at random (a full 128 x 128 tile and a partial one among them)."""
    x = rng.standard_normal(shape)
    rows, cols = shape
    x[:130, :130] = 0.0
    x[128:, cols - cols % 128:] = 0.0
    x[rows // 2, :] = 0.0  # a whole row: every 1-d block in it
    return np.where(x == 0, np.copysign(0.0, rng.standard_normal(shape)), x)


def _subnormals(rng, shape):
    """Values spread over 12 binades below each block's largest (1): many land in the elements' subnormal ranges
    or below their smallest; and float32 subnormals (and 2^-126) among them, which every format casts to zero."""
    x = rng.choice([-1.0, 1.0], shape) * np.exp2(rng.uniform(-12, 0, shape))
    x[:, ::16] = 1.0
    flat = x.reshape(-1)
    tiny = np.array([1e-45, -1e-45, 1e-40, -3e-39, 2.0**-126, -(2.0**-127)])
    flat[rng.choice(flat.size, 600, replace=False)] = rng.choice(tiny, 600)
    return x


def _nonfinite(rng, shape):
    """NaN and infinities of both signs in some blocks (one in a partial block): the block turns NaN, its
    neighbours keep their scales, and NVFP4's tensor amax is the largest finite one."""
    x = rng.standard_normal(shape) * 4
    rows, cols = shape
    for (r, c), value in zip([(3, 5), (40, 200), (rows - 1, cols - 1), (77, 150), (100, 33)],
                             [np.nan, np.inf, -np.inf, np.nan, -np.inf]):
        x[r, c] = value
    return x


def _magnitudes(rng, shape):
    """Normal values, each row at a magnitude 2^-60..2^60 and each value spread over +-16 binades (a block of 16
    spans up to 40: the Hadamard transform's float64 sums round)."""
    rows = np.exp2(rng.integers(-60, 61, (shape[0], 1)))
    return rng.standard_normal(shape) * rows * np.exp2(rng.uniform(-16, 16, shape))


def _ties(rng, shape):
    """Values that land exactly half way between two neighbours of the element grid once scaled (the casts' ties,
    which random values never hit): dyadic values of 1 to 6 significant bits, each row at 2^j (j = -3..3), in
    blocks whose scales are powers of two in every format: each 16 values of a row led by 6 x 2^j (MX and NVFP4
    blocks), each 128 holding 448 x 2^j (block FP8), and the largest value 2688 x 8, so NVFP4's tensor scale is 8."""
    c = rng.integers(0, 32, shape) * 2 + 1
    e = np.floor(np.log2(c)).astype(int) - 1 + rng.integers(0, 9, shape)  # c 2^-e < 4
    j = np.exp2(rng.integers(-3, 4, (shape[0], 1)))
    x = rng.choice([-1.0, 1.0], shape) * c * np.exp2(-e.astype(float)) * j
    x[:, ::16] = 6.0 * j * rng.choice([-1.0, 1.0], (shape[0], 1))
    x[:, 5::128] = 448.0 * j
    x[0, 0] = 2688.0 * 8
    return x


CASES = {"outlier": _outlier, "zeros": _zeros, "subnormals": _subnormals, "nonfinite": _nonfinite,
         "magnitudes": _magnitudes, "ties": _ties}


def _cases(shape) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(45)
    cases = {name: make(rng, shape).astype(np.float32) for name, make in CASES.items()}
    assert not any(np.any((x != 0) & (np.abs(x) < 2.0**-126)) for name, x in cases.items() if name != "subnormals"), \
        "the test's own inputs: float32 subnormals only in the subnormals case"
    return cases


@dataclass(frozen=True)
class Variant:
    """One way of quantizing: the format, the element rounding, the blocked axes, the tensors' shape (CUBE: SHAPE's
    cases as a 3-d tensor), the Hadamard transform first, NVFP4's kept tensor amax."""
    fmt: mx.BlockFormat
    rounding: str = "nearest"
    axis: int = -1
    across: int | None = None
    shape: tuple[int, ...] = SHAPE
    hadamard: bool = False
    tensor_amax: float | None = None

    def cases(self) -> dict[str, np.ndarray]:
        if self.shape == CUBE:
            return {name: x.reshape(CUBE) for name, x in _cases(SHAPE).items()}
        return _cases(self.shape)

    def describe(self) -> str:
        scales = f" ({self.fmt.scale_mode} E8M0 scales)" if self.fmt.scale == "e8m0" else ""
        return (f"{self.fmt.name}{scales}, {self.rounding} rounding"
                f"{', after the Hadamard transform' if self.hadamard else ''}, along axis {self.axis}"
                f"{f' and across axis {self.across}' if self.across is not None else ''}"
                f"{f', a kept tensor amax of {self.tensor_amax}' if self.tensor_amax is not None else ''}")


VARIANTS = {
    **{name: Variant(fmt) for name, fmt in mx.FORMATS.items()},
    **{f"{name}:ceil": Variant(replace(fmt, scale_mode="ceil")) for name, fmt in mx.FORMATS.items()
       if fmt.scale == "e8m0"},
    "mxfp4:even": Variant(replace(mx.MXFP4, scale_mode="even")),
    "mxfp8_e4m3:rceil": Variant(replace(mx.MXFP8_E4M3, scale_mode="rceil")),
    # one format per kind of scale, and the bits of 2-d tiles
    **{f"{fmt.name}:stochastic": Variant(fmt, "stochastic") for fmt in (mx.NVFP4, mx.MXFP8_E5M2, mx.FP8_BLOCK_WEIGHT)},
    "nvfp4:kept_tensor_amax": Variant(mx.NVFP4, tensor_amax=2.0),
    "mxfp8_e4m3:axis0": Variant(mx.MXFP8_E4M3, axis=0),
    "fp8_block_128x128:axis0": Variant(mx.FP8_BLOCK_WEIGHT, axis=0),
    "mxfp4:3d_axis1": Variant(mx.MXFP4, axis=1, shape=CUBE),
    "nvfp4_16x16:3d_axis2_across0": Variant(mx.NVFP4_WEIGHT, axis=2, across=0, shape=CUBE),
    "nvfp4:hadamard": Variant(mx.NVFP4, shape=HADAMARD_SHAPE, hadamard=True),
    "nvfp4:hadamard:stochastic": Variant(mx.NVFP4, "stochastic", shape=HADAMARD_SHAPE, hadamard=True),
    "mxfp4:hadamard": Variant(mx.MXFP4, shape=HADAMARD_SHAPE, hadamard=True),
}


def _ops(adapter):
    ops = adapter.rounding_ops()
    if ops is None:
        pytest.skip(f"the {adapter.name} adapter has no rounding ops (Adapter.rounding_ops): no block-scaled formats")
    missing = mx.missing_block_ops(ops)
    if missing:
        pytest.skip(f"the {adapter.name} adapter's rounding ops lack the block-scaled formats' {', '.join(missing)}")
    return ops


def _differences(got: np.ndarray, want: np.ndarray, x: np.ndarray | None, what: str) -> str:
    """'' where got is want bit for bit (NaN equal to NaN), else how many differ and the first (with the value
    quantized there, `x`)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, the reference's {want.shape}"
    differ = ~((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want)))
    if not differ.any():
        return ""
    at = np.unravel_index(np.argmax(differ), differ.shape)
    of = f" (quantizing {x[at]!r})" if x is not None else ""
    return (f"{what}: {int(differ.sum())} of {differ.size} differ, e.g. at {tuple(int(i) for i in at)}{of} "
            f"{got[at]!r} where the reference has {want[at]!r}")


def mismatches(ops, device, variant: Variant, cases: dict[str, np.ndarray] | None = None) -> list[str]:
    """The variant's cases (default: its own) quantized through `ops` (by ops.on_device) and by the reference; one
    line per case that differs. Adapters' own tests call it with ops whose on_device compiles otherwise."""
    v = variant
    seed = 0

    def run(x, bits, kept):
        if v.hadamard:
            x = mx.hadamard_transform_with(ops, x, v.axis, seed)
        return mx.quantize_with(ops, x, v.fmt, v.axis, v.rounding, bits, v.across, kept)

    rng = np.random.default_rng(NOISE_SEED)
    quantize = ops.on_device(run, device)
    failures = []
    for name, x in (v.cases() if cases is None else cases).items():
        bits = rng.integers(0, mx.NOISE_RANGE, x.shape, dtype=np.int32) if v.rounding == "stochastic" else None
        kept = None if v.tensor_amax is None else ops.to_tensor(np.float32(v.tensor_amax), device)
        values, scales = quantize(ops.to_tensor(x, device), None if bits is None else ops.to_tensor(bits, device),
                                  kept)
        quantized = np.float32(mx.hadamard_transform(x, v.axis, seed)) if v.hadamard else x
        with np.errstate(invalid="ignore", over="ignore"):
            want = mx.quantize(quantized, v.fmt, v.axis, v.rounding, bits, v.across, v.tensor_amax)
        said = [s for s in (_differences(ops.to_numpy(values), want.values, quantized, "values"),
                            _differences(ops.to_numpy(scales), want.scales, None, "scales")) if s]
        if said:
            failures.append(f"case {name}: {'; '.join(said)}")
    return failures


def explain(variant: Variant, failures: list[str]) -> str:
    """The assertion message for a variant's mismatches."""
    return (f"{variant.describe()}: the adapter's quantizer (harness.microscaling.quantize_with on its rounding ops) "
            "differs from numpy's reference: " + " | ".join(failures) + ". The arithmetic is the core's, so a "
            "difference lies in a primitive of the adapter's RoundingOps (a cast that does not round half to even, a "
            "layout primitive that moves values) or in a compiler that rewrites the float operations")


@pytest.mark.parametrize("name", VARIANTS)
def test_the_quantizer_is_the_reference_bit_for_bit(adapter, name):
    ops, variant = _ops(adapter), VARIANTS[name]
    failures = mismatches(ops, adapter.device("cpu"), variant)
    assert not failures, explain(variant, failures)


def _flushes_subnormals(ops, device) -> bool:
    """Whether the framework flushes float32 subnormal results to zero where the kit runs (two inputs: nothing to
    fold at compile time)."""
    product = ops.on_device(lambda a, b: a * b, device)
    got = ops.to_numpy(product(ops.to_tensor(np.float32([2.0**-100]), device),
                               ops.to_tensor(np.float32([2.0**-30]), device)))
    return float(got[0]) == 0.0


@pytest.mark.parametrize("fmt", list(mx.FORMATS.values()), ids=list(mx.FORMATS))
def test_blocks_below_float32_s_normal_range_are_the_reference_where_subnormals_are_kept(adapter, fmt):
    """Blocks whose values all lie near or below 2^-126 (MX's scale is then the E8M0 2^-127, itself a float32
    subnormal, and the dequantized values are subnormals): the reference's where the framework keeps float32
    subnormals; a framework that flushes them reads these blocks as zeros (docs/microscaling.md)."""
    ops = _ops(adapter)
    device = adapter.device("cpu")
    if _flushes_subnormals(ops, device):
        pytest.skip(f"{adapter.name} flushes float32 subnormals to zero here: blocks below 2^-126 quantize to zero")
    rng = np.random.default_rng(46)
    largest = rng.uniform(-130, -110, (SHAPE[0], 1))  # each row's: most blocks' scales and values are subnormals
    x = rng.choice([-1.0, 1.0], SHAPE) * np.exp2(largest - rng.uniform(0, 24, SHAPE))
    variant = Variant(fmt)
    failures = mismatches(ops, device, variant, {"tiny": x.astype(np.float32)})
    assert not failures, explain(variant, failures)
