"""Microscaling (block-scaled) formats, the rules written once: MXFP8, MXFP6 and MXFP4 (OCP MX v1.0), NVFP4, and
DeepSeek-V3's block-scaled FP8, as a numpy reference, and as the same arithmetic written against the primitives
of harness.rounding.RoundingOps (an adapter fills the table for its framework, as it does for harness.fp8), held to
the reference bit for bit through numpy's table. The quantizer a framework runs is `quantize_with(ops, x, fmt,
axis, rounding, bits, across, tensor_amax)`, quantize()'s signature: the layout (to_blocks_with: the blocked axes
moved last, a partial block padded with zeros, split into blocks; from_blocks_with back), the block amax,
block_quantize_with's arithmetic; `hadamard_transform_with` is the Hadamard transform's. The layout primitives they
need beyond the elementwise ones are BLOCK_OPS (an adapter without them has no block-scaled formats), and numpy's
to_blocks and from_blocks are to_blocks_with and from_blocks_with through numpy's table: one layout everywhere.

The elements (Fp8Format, the grid of harness.fp8): e4m3 (max 448) and e5m2 (57344) as in FP8; e2m3 (FP6: max 7.5,
smallest normal 1, smallest subnormal 2^-3), e3m2 (FP6: max 28, 2^-2, 2^-4), e2m1 (FP4: max 6, 1, 2^-1; its grid
0, 0.5, 1, 1.5, 2, 3, 4, 6). None of the FP6/FP4 formats has an infinity or a NaN. Every cast is harness.fp8's:
nearest, ties to even, saturating to the largest finite value (ml_dtypes 0.7 casts e4m3fn overflow to NaN and e5m2's
to infinity, while it saturates the FP6/FP4 types and writes NaN as -0); NaN stays NaN in the float32 emulation.
Stochastic rounding (`rounding="stochastic"`) takes 16 caller-supplied bits r per value, harness.rounding's rule on
the element's grid: with g the gap at |x| (2^(max(e, emin) - mantissa bits)) and m = |x| / g, the magnitude rounds
away from zero iff r + (m - floor(m)) 2^16 >= 2^16, computed in float32; then it saturates.

A block is `block` consecutive values along one axis (`rows` x `block` tiles for 2-D weight tiles: `rows` along a
second axis). In a matmul the blocks run along the reduction axis: a left operand [M, K] blocks along its axis -1,
a right operand [K, N] along its axis 0 (`matmul`). A dimension that is not a multiple of the block ends in a
partial block, scaled by its own values (as if padded with zeros, which change no amax). Each block has its amax,
the largest magnitude of its values; a block holding a NaN or an infinity gets a NaN scale and all its values
become NaN (OCP MX: a NaN scale makes every element of its block NaN; torchao's to_mx gives such a block the NaN
scale; the same here for every format, so saturation never hides a non-finite value). The formats, value =
element x block scale (x tensor scale):

- MX (OCP Microscaling Formats v1.0, section 6.3; torchao.prototype.mx_formats.mx_tensor.to_mx): blocks of 32,
  a shared E8M0 scale 2^E, E = floor(log2 amax) - emax_elem, emax_elem = floor(log2 max_elem) (8, 15, 2, 4, 2),
  clamped to [-127, 127]; E8M0 holds 2^-127..2^127 and NaN (0xFF), no zero: an all-zero block has 2^-127. Other
  modes (torchao's ScaleCalculationMode): "ceil" E = ceil(log2 amax) - emax_elem (amax / scale <= 2^emax_elem:
  never saturates, and underflows more); "even" E = floor(log2 of amax rounded half up to the element's mantissa
  bits) - emax_elem; "rceil" (cuBLAS's, Transformer Engine's MXFP8) the smallest 2^E >= amax x fl32(1 / max_elem),
  E >= -127. "floor" (the spec's and torchao's default) puts amax / scale in [2^emax, 2^(emax+1)): above max_elem
  (448 of 512, 6 of 8) values saturate. The elements: x x 2^-E (exact) cast.
- NVFP4 (two levels; torchao.prototype.mx_formats.nvfp4_tensor.nvfp4_quantize with per_tensor_amax_to_scale, whose
  float32 operations are followed one for one): e2m1 in blocks of 16; a per-tensor float32 scale
  g = max(amax_tensor / 2688, 2^-119) (2688 = 448 x 6; amax_tensor the largest finite block amax; the floor is ours:
  torchao divides by zero for an all-zero tensor; it keeps every scale, reciprocal and non-zero value a normal
  float32); the block scale s = e4m3(clip((amax / 6) / g, 2^-6, 448)), an E4M3 number (torchao clamps at
  e4m3's smallest normal); the elements e2m1(clip(x ((1 / g) / s), -6, 6)); the value q (g s). Transformer Engine's
  reference (pytorch/custom_recipes/quantization_ref_nvfp4.py) computes the same quantities in another float32
  order (amax (S_enc / 6), S_enc = 2688 / amax_tensor; no lower clamp on s), so a block scale can differ from it
  in the last e4m3 bit (a core test shows one: 5 here, 5.5 there).
- Block FP8 (DeepSeek-V3's inference/kernel.py act_quant / weight_quant): e4m3 with a float32 scale per 1 x 128
  block (activations) or 128 x 128 tile (weights): s = max(amax / 448, 2^-126) (the floor is ours: DeepSeek's kernel
  divides by zero for an all-zero block), the elements e4m3(x / s) (a division, as DeepSeek's), the value q s.

Every value is float32. MX's scales are powers of two: its scaling and dequantizing are exact and only the casts
round (but a dequantized MX value under 2^-126, in a block whose amax is below about 2^-110, is a float32
subnormal, which a framework that flushes subnormals reads as 0: TensorFlow's and XLA's CPU code do, and read the
E8M0 scale 2^-127 as 0 too). NVFP4's and block FP8's scales are not: their divisions and products round in
float32, so the order of the operations above is part of the rule, and a compiler must not rewrite them (XLA and
TensorFlow's graph optimizer turn a division by a constant into a product with its reciprocal: `divide_with` keeps
the quotient correctly rounded anyway).

The 16 x 16 random Hadamard transform (NVFP4's pretraining recipe, on the weight-gradient GEMM's inputs): along an
axis in blocks of 16, y = x diag(s) H / 4, H Sylvester's Hadamard matrix (entries +-1, H H = 16 I) and s a sign
vector drawn from a seed (Transformer Engine's reference hard-codes one), so Q = diag(s) H / 4 is orthogonal,
exactly (Q Q^T = I in float64), and y Q^T = x. It is computed in float64 by the fast Walsh-Hadamard butterfly in a
fixed order (4 stages of a + b, a - b), so any framework that follows the order gets the same bits; it is exact,
equal to x @ Q, whenever a block's float32 values span at most 25 binades (16 float32 significands fit float64's
53 bits). A dimension that is not a multiple of 16 is refused (as Transformer Engine does).

Storage (`bits_per_value`, `storage_bits`): element bits plus the block scale's share (E8M0 and E4M3: 8 bits;
float32: 32) plus NVFP4's 32-bit tensor scale; packed, without the padding and swizzled layouts kernels use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.errors import HarnessError
from harness.fp8 import E4M3, E5M2, Fp8Format
# the element casts are harness.fp8's (nearest, ties to even, saturating), on every element format here
from harness.fp8 import quantize as cast  # noqa: F401  (x, fmt) -> float32
from harness.fp8 import quantize_with as cast_with  # noqa: F401  (ops, x, fmt): the written-once cast
from harness.rounding import NUMPY_OPS

E2M3 = Fp8Format("e2m3", 7.5, 0, 3)
E3M2 = Fp8Format("e3m2", 28.0, -2, 2)
E2M1 = Fp8Format("e2m1", 6.0, 0, 1)
ELEMENTS = {f.name: f for f in (E4M3, E5M2, E2M3, E3M2, E2M1)}
ELEMENT_BITS = {"e4m3": 8, "e5m2": 8, "e2m3": 6, "e3m2": 6, "e2m1": 4}

NOISE_BITS = 16  # harness.rounding's random bits per value
NOISE_RANGE = 1 << NOISE_BITS
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_MODES = ("floor", "ceil", "even", "rceil")
NVFP4_TENSOR_DIVISOR = 448.0 * 6.0  # torchao's per_tensor_amax_to_scale: amax / (F8E4M3_MAX * F4_E2M1_MAX)
NVFP4_MIN_TENSOR_SCALE = 2.0**-119
NVFP4_MIN_BLOCK_SCALE = 2.0**-6  # e4m3's smallest normal (torchao's E4M3_EPS)
FP8_BLOCK_MIN_SCALE = 2.0**-126
HADAMARD_SIZE = 16
_SIGN_STREAM = 0x4AD4  # keeps the Hadamard signs apart from every other use of a seed


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: `element` values in blocks of `block` along the quantized axis (x `rows` along a
    second axis for 2-D tiles), each block with a scale of kind `scale` ("e8m0", "e4m3": NVFP4's two levels,
    "float32"), E8M0 scales rounded by `scale_mode` (SCALE_MODES)."""
    name: str
    element: Fp8Format
    block: int
    scale: str
    rows: int = 1
    scale_mode: str = "floor"

    def __post_init__(self) -> None:
        if self.scale not in ("e8m0", "e4m3", "float32") or self.scale_mode not in SCALE_MODES:
            raise HarnessError(f"{self.name}: scale must be e8m0, e4m3 or float32, scale_mode one of {SCALE_MODES}")
        if self.block < 1 or self.rows < 1:
            raise HarnessError(f"{self.name}: blocks of at least 1 value")


MXFP8_E4M3 = BlockFormat("mxfp8_e4m3", E4M3, 32, "e8m0")
MXFP8_E5M2 = BlockFormat("mxfp8_e5m2", E5M2, 32, "e8m0")
MXFP6_E2M3 = BlockFormat("mxfp6_e2m3", E2M3, 32, "e8m0")
MXFP6_E3M2 = BlockFormat("mxfp6_e3m2", E3M2, 32, "e8m0")
MXFP4 = BlockFormat("mxfp4", E2M1, 32, "e8m0")
NVFP4 = BlockFormat("nvfp4", E2M1, 16, "e4m3")
NVFP4_WEIGHT = BlockFormat("nvfp4_16x16", E2M1, 16, "e4m3", rows=16)  # the recipe's 2-D weight tiles
FP8_BLOCK = BlockFormat("fp8_block_1x128", E4M3, 128, "float32")  # activations and gradients
FP8_BLOCK_WEIGHT = BlockFormat("fp8_block_128x128", E4M3, 128, "float32", rows=128)
FORMATS = {f.name: f for f in (MXFP8_E4M3, MXFP8_E5M2, MXFP6_E2M3, MXFP6_E3M2, MXFP4, NVFP4, NVFP4_WEIGHT,
                               FP8_BLOCK, FP8_BLOCK_WEIGHT)}


@dataclass(frozen=True)
class Quantized:
    """A quantized tensor as its matmul sees it: `values` the dequantized float32 array (x's shape); `scales` the
    float32 block scales (x's shape with each blocked axis shortened to its number of blocks: the E8M0 power of
    two, NVFP4's E4M3 block scale, or the float32 scale; NaN for a block holding a non-finite value);
    `tensor_scale` NVFP4's per-tensor float32 scale g (1 for the others)."""
    values: np.ndarray
    scales: np.ndarray
    tensor_scale: float = 1.0


# ---- the reference (numpy) --------------------------------------------------------------------------------
def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_bits(bits, shape) -> np.ndarray:
    r = np.asarray(bits)
    if r.shape != tuple(shape) or not np.issubdtype(r.dtype, np.integer) or \
            (r.size and (r.min() < 0 or r.max() >= NOISE_RANGE)):
        raise HarnessError(f"stochastic rounding needs one integer in [0, 2^16) per value; got {r.dtype} "
                           f"{r.shape} for {tuple(shape)}")
    return r.astype(np.int32)


def cast_stochastic(x, fmt: Fp8Format, bits) -> np.ndarray:
    """float32 x cast to the element format with stochastic rounding by `bits` (integers 0..2^16-1, x's shape),
    saturating, back to float32; NaN stays NaN, infinities saturate."""
    x = _f32(x)
    r = _check_bits(bits, x.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        magnitude = np.abs(x)
        finite = np.isfinite(x)
        exponent = np.frexp(np.where(finite, magnitude, 1.0).astype(np.float64))[1] - 1  # floor(log2 |x|)
        gap = np.exp2(np.maximum(exponent, fmt.min_normal_exp) - fmt.mantissa).astype(np.float32)
        m = magnitude / gap  # exact: a power of two
        low = np.floor(m)
        away = r.astype(np.float32) + (m - low) * np.float32(NOISE_RANGE) >= np.float32(NOISE_RANGE)
        rounded = np.minimum((low + away) * gap, np.float32(fmt.max))
    rounded = np.where(np.isinf(x), np.float32(fmt.max), rounded)
    return np.where(np.isnan(x), x, np.copysign(rounded, x)).astype(np.float32)


def e8m0_codes(amax, element: Fp8Format, mode: str = "floor") -> np.ndarray:
    """The biased E8M0 code (uint8: the scale is 2^(code - 127), 255 NaN) of blocks whose largest magnitude is
    `amax` (float32, >= 0; infinite or NaN for a block holding a non-finite value), by the rounding mode."""
    if mode not in SCALE_MODES:
        raise HarnessError(f"E8M0 scale mode '{mode}': one of {', '.join(SCALE_MODES)}")
    amax = _f32(amax).astype(np.float64)
    finite = np.isfinite(amax)
    a = np.where(finite, amax, 1.0)
    if mode == "rceil":  # the smallest 2^E >= amax x fl32(1 / max), E >= -127
        d = (_f32(a) * np.float32(1.0 / element.max)).astype(np.float64)
        sig, e = np.frexp(np.where(d > 0, d, 1.0))  # d = sig 2^e, sig in [0.5, 1)
        exponent = np.where(d > 0, e - (sig == 0.5), -127)  # ceil(log2 d)
    else:
        sig, e = np.frexp(np.where(a > 0, a, 1.0))
        exponent = np.where(a > 0, e - 1, -127)  # floor(log2 amax); amax = 0: the clamp's end
        if mode == "ceil":
            exponent = exponent + ((sig != 0.5) & (a > 0))
        elif mode == "even":  # amax rounded half up to the element's mantissa bits reaches the next power of two
            exponent = exponent + ((2 * sig >= 2 - 2.0 ** -(element.mantissa + 1)) & (a > 0))
        exponent = exponent - element.max_exp
    code = np.clip(exponent, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    return np.where(finite, code, E8M0_NAN).astype(np.uint8)


def e8m0_values(codes) -> np.ndarray:
    """The float32 value of E8M0 codes: 2^(code - 127) (code 0: the float32 subnormal 2^-127), 255 NaN."""
    codes = np.asarray(codes, np.int64)
    return np.where(codes == E8M0_NAN, np.nan, np.ldexp(1.0, codes - E8M0_BIAS)).astype(np.float32)


def nvfp4_tensor_scale(tensor_amax: float) -> np.float32:
    """NVFP4's per-tensor float32 scale g = max(amax / 2688, 2^-119) of the tensor's largest finite magnitude."""
    amax = np.float32(tensor_amax)
    if not np.isfinite(amax):
        raise HarnessError("nvfp4: the tensor amax is the largest finite magnitude, not an infinity or NaN")
    return np.maximum(amax / np.float32(NVFP4_TENSOR_DIVISOR), np.float32(NVFP4_MIN_TENSOR_SCALE))


def nvfp4_block_scales(amax, g) -> np.ndarray:
    """NVFP4's E4M3 block scales (as float32) of blocks with largest magnitude `amax`, under tensor scale g."""
    amax, g = _f32(amax), np.float32(g)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.clip((amax / np.float32(6.0)) / g, np.float32(NVFP4_MIN_BLOCK_SCALE), np.float32(E4M3.max))
    return np.where(np.isfinite(amax), cast(s, E4M3), np.float32(np.nan)).astype(np.float32)


def fp8_block_scales(amax) -> np.ndarray:
    """Block FP8's float32 scales: max(amax / 448, 2^-126); NaN for a block holding a non-finite value."""
    amax = _f32(amax)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.maximum(amax / np.float32(E4M3.max), np.float32(FP8_BLOCK_MIN_SCALE))
    return np.where(np.isfinite(amax), s, np.float32(np.nan)).astype(np.float32)


def _axes(ndim: int, fmt: BlockFormat, axis: int, across: int | None) -> tuple[int, int | None]:
    if ndim < 1:
        raise HarnessError(f"{fmt.name}: a tensor of at least one dimension")
    if not -ndim <= axis < ndim:
        raise HarnessError(f"{fmt.name}: axis {axis} of a {ndim}-d tensor")
    axis %= ndim
    if fmt.rows == 1:
        return axis, None
    if across is None:
        if ndim != 2:
            raise HarnessError(f"{fmt.name}: {fmt.rows} x {fmt.block} tiles need a 2-d tensor or `across`")
        across = 1 - axis
    if not -ndim <= across < ndim or across % ndim == axis:
        raise HarnessError(f"{fmt.name}: across {across} must be another axis than {axis}")
    return axis, across % ndim


def to_blocks(x, fmt: BlockFormat, axis: int = -1, across: int | None = None) -> np.ndarray:
    """x arranged as [..., M, rows, N, block]: the quantized axis last and split into blocks, `across` (or a new
    axis of 1 for 1-D blocks) before it, split into `rows`; a partial last block padded with zeros (to_blocks_with
    through numpy's table: one layout for the reference and every framework)."""
    return to_blocks_with(NUMPY_OPS, np.asarray(x), fmt, axis, across)


def from_blocks(blocks: np.ndarray, shape: tuple[int, ...], fmt: BlockFormat, axis: int = -1,
                across: int | None = None) -> np.ndarray:
    """to_blocks' inverse: the array of x's `shape` (the padding dropped)."""
    return from_blocks_with(NUMPY_OPS, blocks, tuple(shape), fmt, axis, across)


def _scale_grid(scales: np.ndarray, ndim: int, fmt: BlockFormat, axis: int, across: int | None) -> np.ndarray:
    """Block scales [..., M, 1, N, 1] laid out as x is, each blocked axis holding its blocks."""
    return scale_grid_with(NUMPY_OPS, scales, ndim, fmt, axis, across)


def block_amax(blocks) -> np.ndarray:
    """Each block's largest magnitude, [..., M, 1, N, 1] float32, a non-finite value counting as infinity (the
    reduction an adapter runs: block_amax_with)."""
    return block_amax_with(NUMPY_OPS, _f32(blocks))


def tensor_amax(amax) -> np.float32:
    """NVFP4's tensor amax from the block amaxes: the largest finite one (0 where none is)."""
    amax = _f32(amax)
    return np.float32(np.max(np.where(np.isfinite(amax), amax, 0), initial=0))


def quantize(x, fmt: BlockFormat, axis: int = -1, rounding: str = "nearest", bits=None, across: int | None = None,
             tensor_amax_value: float | None = None) -> Quantized:
    """x (float32) quantized to the block format along `axis` (and `across`, for 2-D tiles) and dequantized: the
    emulation a matmul multiplies. `rounding`: the element cast's, "nearest" (to even) or "stochastic" with `bits`
    (integers 0..2^16-1, x's shape). `tensor_amax_value`: NVFP4's tensor amax when the caller keeps one (None: x's)."""
    if rounding not in ("nearest", "stochastic"):
        raise HarnessError(f"element rounding '{rounding}': nearest or stochastic")
    x = _f32(x)
    blocks = to_blocks(x, fmt, axis, across)
    amax = block_amax(blocks)
    g = np.float32(1.0)
    with np.errstate(invalid="ignore", over="ignore"):
        if fmt.scale == "e8m0":
            codes = e8m0_codes(amax, fmt.element, fmt.scale_mode)
            scales = e8m0_values(codes)
            inverse = e8m0_values(np.where(codes == E8M0_NAN, E8M0_NAN, 2 * E8M0_BIAS - codes.astype(np.int64)))
            scaled, multiplier = blocks * inverse, scales
        elif fmt.scale == "e4m3":
            g = nvfp4_tensor_scale(tensor_amax(amax) if tensor_amax_value is None else tensor_amax_value)
            scales = nvfp4_block_scales(amax, g)
            scaled = np.clip(blocks * ((np.float32(1.0) / g) / scales), -np.float32(E2M1.max), np.float32(E2M1.max))
            multiplier = g * scales
        else:
            scales = fp8_block_scales(amax)
            scaled, multiplier = blocks / scales, scales
        scaled = scaled.astype(np.float32)
        if rounding == "stochastic":
            r = to_blocks(_check_bits(bits, x.shape), fmt, axis, across)
            q = cast_stochastic(scaled, fmt.element, r)
        else:
            q = cast(scaled, fmt.element)
        values = (q * multiplier).astype(np.float32)
    return Quantized(from_blocks(values, x.shape, fmt, axis, across),
                     _scale_grid(scales, x.ndim, fmt, axis, across), float(g))


def matmul(a, b, fmt_a: BlockFormat, fmt_b: BlockFormat | None = None, rounding: str = "nearest",
           bits_a=None, bits_b=None) -> np.ndarray:
    """a [M, K] @ b [K, N] with both quantized along K (a's axis -1, b's axis 0; a 2-D tile format blocks b
    across N too), the products summed in float32 (numpy's order: the emulation's rounding, not a kernel's)."""
    qa = quantize(a, fmt_a, axis=-1, rounding=rounding, bits=bits_a).values
    qb = quantize(b, fmt_b or fmt_a, axis=0, rounding=rounding, bits=bits_b).values
    return np.matmul(qa, qb).astype(np.float32)


# ---- storage ------------------------------------------------------------------------------------------------
SCALE_BITS = {"e8m0": 8, "e4m3": 8, "float32": 32}
TENSOR_SCALE_BITS = {"e8m0": 0, "e4m3": 32, "float32": 0}


def bits_per_value(fmt: BlockFormat) -> float:
    """Bits per value of a large tensor: the element's plus its share of the block scale (MXFP8 8.25, MXFP6 6.25,
    MXFP4 4.25, NVFP4 4.5, block FP8 8.25 (1 x 128) and 8.002 (128 x 128)); float32 is 32, bfloat16 16."""
    return ELEMENT_BITS[fmt.element.name] + SCALE_BITS[fmt.scale] / (fmt.block * fmt.rows)


def storage_bits(shape, fmt: BlockFormat, axis: int = -1, across: int | None = None) -> int:
    """The bits a tensor of `shape` takes in the format, packed: every element, one scale per block (a partial
    block too), and NVFP4's tensor scale."""
    shape = tuple(int(n) for n in shape)
    axis, across = _axes(len(shape), fmt, axis, across)
    values = math.prod(shape)
    blocks = values // shape[axis] * -(-shape[axis] // fmt.block) if shape[axis] else 0
    if across is not None and shape[across]:
        blocks = blocks // shape[across] * -(-shape[across] // fmt.rows)
    return values * ELEMENT_BITS[fmt.element.name] + blocks * SCALE_BITS[fmt.scale] + TENSOR_SCALE_BITS[fmt.scale]


# ---- the random Hadamard transform ----------------------------------------------------------------------
def _splitmix64(z: int) -> int:
    """SplitMix64's output for state z (Steele, Lea and Flood, 2014), in Python integers."""
    mask = 2**64 - 1
    z = (z + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def hadamard_signs(seed: int = 0) -> np.ndarray:
    """The transform's 16 signs (+-1.0), the low 16 bits of SplitMix64 of the seed and a stream of their own: Python
    integers, so a framework's compiler (torch.compile) takes them as constants where it traces the transform."""
    word = _splitmix64((seed * 2**16 + _SIGN_STREAM) % 2**64)
    return np.array([1.0 - 2.0 * ((word >> i) & 1) for i in range(HADAMARD_SIZE)])


def hadamard_matrix(seed: int = 0) -> np.ndarray:
    """Q = diag(signs) H / 4, float64: the transform is y = x Q per block of 16, its inverse x = y Q^T."""
    h = np.ones((1, 1))
    while h.shape[0] < HADAMARD_SIZE:
        h = np.block([[h, h], [h, -h]])
    return hadamard_signs(seed)[:, None] * h / math.sqrt(HADAMARD_SIZE)


def _butterfly(v: np.ndarray) -> np.ndarray:
    """v [..., 16] @ H (Sylvester's), by 4 fixed stages of pairs (a + b, a - b) at strides 1, 2, 4, 8
    (_butterfly_with through numpy's table: the order every framework follows)."""
    return _butterfly_with(NUMPY_OPS, np.asarray(v))


def _check_hadamard(shape: tuple[int, ...], axis: int) -> None:
    if not shape or not -len(shape) <= axis < len(shape) or shape[axis] % HADAMARD_SIZE:
        raise HarnessError(f"the Hadamard transform runs along a dimension that is a multiple of {HADAMARD_SIZE}; "
                           f"got shape {shape} along axis {axis}")


def _hadamard_blocks(x, axis: int) -> tuple[np.ndarray, tuple]:
    x = np.asarray(x, np.float64)
    _check_hadamard(x.shape, axis)
    y = np.moveaxis(x, axis, -1)
    return y.reshape(*y.shape[:-1], -1, HADAMARD_SIZE), y.shape


def hadamard_transform(x, axis: int = -1, seed: int = 0) -> np.ndarray:
    """The 16 x 16 random Hadamard transform of x along `axis` (a multiple of 16), in float64: x diag(s) H / 4
    per block (the butterfly's fixed order; exactly x @ hadamard_matrix(seed) where the block spans at most 25
    binades). The caller rounds it once to float32 before quantizing."""
    blocks, shape = _hadamard_blocks(x, axis)
    y = _butterfly(blocks * hadamard_signs(seed)) * (1.0 / math.sqrt(HADAMARD_SIZE))
    return np.moveaxis(y.reshape(shape), -1, axis)


def inverse_hadamard_transform(y, axis: int = -1, seed: int = 0) -> np.ndarray:
    """hadamard_transform's inverse: y H / 4 diag(s) per block, float64."""
    blocks, shape = _hadamard_blocks(y, axis)
    x = _butterfly(blocks) * (1.0 / math.sqrt(HADAMARD_SIZE)) * hadamard_signs(seed)
    return np.moveaxis(x.reshape(shape), -1, axis)


# ---- written once against an adapter's primitives (harness.rounding.RoundingOps) ---------------------------
def _clamp_int(ops, v, lo: int, hi: int):
    """An int32 tensor clamped to [lo, hi] with maximum alone (ops.clip is float32's)."""
    return 0 - ops.maximum(0 - ops.maximum(v, lo), -hi)


def _positive(ops, v):
    """1 where the int32 tensor v (>= 0) is above 0, else 0: -((-v) >> 31) (an arithmetic shift)."""
    return 0 - ops.shift_right(0 - v, 31)


def _power_of_two(ops, biased):
    """float32 2^(biased - 127) of int32 `biased` in [0, 254]: 0 is the subnormal 2^-127."""
    normal = ops.as_float32(ops.shift_left(ops.maximum(biased, 1), 23))
    return ops.where(biased > 0, normal, ops.full_like(normal, 2.0**-127))


def cast_stochastic_with(ops, x, bits, fmt: Fp8Format):
    """cast_stochastic() on a framework's float32 tensors through its RoundingOps, `bits` int32 0..2^16-1: the gap
    from the float32 exponent field (as harness.fp8.quantize_with), the comparison in float32, the same values as
    the reference bit for bit."""
    magnitude = ops.abs(x)
    biased = ops.bit_and(ops.shift_right(ops.as_int32(magnitude), 23), 0xFF)
    exponent = ops.maximum(biased - 127, fmt.min_normal_exp)
    gap = ops.as_float32(ops.shift_left(exponent + (127 - fmt.mantissa), 23))
    m = magnitude / gap
    low = ops.floor(m)
    away = ops.to_float32(bits) + (m - low) * float(NOISE_RANGE) >= float(NOISE_RANGE)
    rounded = ops.copysign(ops.clip(ops.add_mask(low, away) * gap, 0.0, fmt.max), x)
    saturated = ops.where(ops.abs(x) > fmt.max, ops.copysign(ops.full_like(x, fmt.max), x), x)
    return ops.where(ops.isfinite(x), rounded, saturated)


def e8m0_scale_with(ops, amax, element: Fp8Format, mode: str = "floor"):
    """(scale, its inverse), float32 tensors, of float32 block amaxes (>= 0, infinite for a block holding a
    non-finite value) by e8m0_codes' rule, in integers from the float32 fields; NaN for a non-finite amax."""
    if mode not in SCALE_MODES:
        raise HarnessError(f"E8M0 scale mode '{mode}': one of {', '.join(SCALE_MODES)}")
    if mode == "rceil":
        bits = ops.as_int32(amax * float(np.float32(1.0 / element.max)))
        field = ops.bit_and(ops.shift_right(bits, 23), 0xFF)
        mantissa = ops.bit_and(bits, 0x7FFFFF)
        # a subnormal d (field 0) rounds up to 2^-126 only above 2^-127 (mantissa 2^22)
        up = ops.where(field > 0, _positive(ops, mantissa), _positive(ops, mantissa - 0x400000))
        code = _clamp_int(ops, field + up, 0, 254)
    else:
        bits = ops.as_int32(amax)
        if mode == "even":  # half an element ulp added to the float32 pattern: a carry reaches the exponent
            bits = bits + (1 << (22 - element.mantissa))
        field = ops.bit_and(ops.shift_right(bits, 23), 0xFF)
        exponent = field - 127  # an amax of 0 or a float32 subnormal: -127, the clamp's end anyway
        if mode == "ceil":
            exponent = exponent + _positive(ops, ops.bit_and(bits, 0x7FFFFF))
        code = _clamp_int(ops, exponent - element.max_exp, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    finite = ops.isfinite(amax)
    nan = ops.full_like(amax, math.nan)
    return (ops.where(finite, _power_of_two(ops, code), nan),
            ops.where(finite, _power_of_two(ops, _clamp_int(ops, 2 * E8M0_BIAS - code, 0, 254)), nan))


def divide_with(ops, x, divisor):
    """float32 x / divisor (a Python float, or a float32 tensor that broadcasts against x), correctly rounded as
    numpy's float32 division is, whatever a compiler makes of the division. XLA (JAX, TensorFlow's jit_compile) and
    TensorFlow's graph optimizer turn a division into a product with the rounded reciprocal (by a constant, and by
    a broadcast tensor: XLA did so in jit and op by op), which in float32 is an ulp off for a fifth to a half of the
    quotients, and an ulp moves a value on an FP8 rounding midpoint to the other neighbour (a digits pixel 27/28 of
    its block's largest, times 448: 432, between 416 and 448). So the division runs in float64 and is rounded to
    float32 once more, which gives the correctly rounded float32 quotient either way: a quotient of two float32
    values is either exact (a power-of-two divisor) or lies more than about 2^-49 of its size from a float32
    rounding midpoint (an exact midpoint needs 25 significant bits, which an odd divisor's product cannot give), and
    the float64 product with the reciprocal errs by under 2^-51 (a core test checks every float32 significand for
    the constants). Needs ops.float64 (BLOCK_OPS)."""
    if isinstance(divisor, (int, float)):
        return ops.float64(lambda v: ops.to_float32(ops.cast(v, "float64") / divisor))(x)
    return ops.float64(lambda v, d: ops.to_float32(ops.cast(v, "float64") / ops.cast(d, "float64")))(x, divisor)


def nvfp4_tensor_scale_with(ops, tensor_amax):
    """nvfp4_tensor_scale() of a float32 scalar tensor (the largest finite block amax)."""
    return ops.maximum(divide_with(ops, tensor_amax, NVFP4_TENSOR_DIVISOR),
                       ops.full_like(tensor_amax, NVFP4_MIN_TENSOR_SCALE))


def block_quantize_with(ops, blocks, amax, fmt: BlockFormat, tensor_scale=None, bits=None):
    """quantize()'s arithmetic on a framework's float32 `blocks` ([..., M, rows, N, block], to_blocks' layout)
    through its RoundingOps: `amax` their block_amax ([..., M, 1, N, 1]: the framework's reduction), NVFP4's
    `tensor_scale` g (nvfp4_tensor_scale_with of the largest finite block amax, or of a kept one), `bits` the
    stochastic rounding's (int32, the blocks' shape; None: nearest). Returns (the dequantized blocks, the block
    scales): the reference's values bit for bit (a core test holds NUMPY_OPS to it)."""
    element = fmt.element
    if fmt.scale == "e8m0":
        scale, inverse = e8m0_scale_with(ops, amax, element, fmt.scale_mode)
        scaled, multiplier = blocks * inverse, scale
    elif fmt.scale == "e4m3":
        g = tensor_scale
        raw = ops.clip(divide_with(ops, divide_with(ops, amax, E2M1.max), g), NVFP4_MIN_BLOCK_SCALE, E4M3.max)
        scale = ops.where(ops.isfinite(amax), cast_with(ops, raw, E4M3), ops.full_like(amax, math.nan))
        inverse = divide_with(ops, divide_with(ops, ops.full_like(g, 1.0), g), scale)
        scaled = ops.clip(blocks * inverse, -element.max, element.max)
        multiplier = g * scale
    else:
        scale = ops.maximum(divide_with(ops, amax, E4M3.max), ops.full_like(amax, FP8_BLOCK_MIN_SCALE))
        scale = ops.where(ops.isfinite(amax), scale, ops.full_like(amax, math.nan))
        scaled, multiplier = divide_with(ops, blocks, scale), scale
    q = cast_with(ops, scaled, element) if bits is None else cast_stochastic_with(ops, scaled, bits, element)
    return q * multiplier, scale


# ---- the layout, the quantizer and the Hadamard transform, written once (RoundingOps' layout primitives) -------
BLOCK_OPS = ("shape", "reshape", "transpose", "pad", "crop", "max_over", "flip", "constant", "float64")
_PAIR_SIGNS = np.array([[1.0], [-1.0]])  # a butterfly stage's (a + b, a - b) as flip(v) + v x (1, -1)


def missing_block_ops(ops) -> list[str]:
    """The layout primitives (BLOCK_OPS) that an adapter's RoundingOps (or None) lacks: while any is missing, its
    block-scaled formats are unsupported; with none missing, quantize_with runs there."""
    return [name for name in BLOCK_OPS if ops is None or getattr(ops, name) is None]


def _arranged(ndim: int, axis: int, across: int | None) -> list[int]:
    """x's axes as to_blocks arranges them: the others in their order, then `across`, then `axis`."""
    return [i for i in range(ndim) if i not in (axis, across)] + ([] if across is None else [across]) + [axis]


def _restore(ops, y, ndim: int, axis: int, across: int | None, m: int, n: int):
    """[..., M, N] in to_blocks' arrangement (M 1 for 1-D blocks) back to x's axis order, cropped to m x n."""
    *lead, big_m, big_n = ops.shape(y)
    if (big_m, big_n) != (m, n):
        y = ops.crop(y, (*lead, m, n))
    if across is None:
        y = ops.reshape(y, (*lead, n))
    order = _arranged(ndim, axis, across)
    return ops.transpose(y, [order.index(i) for i in range(ndim)])


def to_blocks_with(ops, x, fmt: BlockFormat, axis: int = -1, across: int | None = None):
    """to_blocks() of a framework's tensor (any dtype: the stochastic rounding's int32 bits too)."""
    shape = tuple(ops.shape(x))
    axis, across = _axes(len(shape), fmt, axis, across)
    order = _arranged(len(shape), axis, across)
    lead = tuple(shape[i] for i in order[:len(shape) - (1 if across is None else 2)])
    m, n = (1 if across is None else shape[across]), shape[axis]
    y = ops.reshape(ops.transpose(x, order), (*lead, m, n))
    pad_m, pad_n = -m % fmt.rows, -n % fmt.block
    if pad_m or pad_n:
        y = ops.pad(y, [(0, 0)] * len(lead) + [(0, pad_m), (0, pad_n)])
    return ops.reshape(y, (*lead, (m + pad_m) // fmt.rows, fmt.rows, (n + pad_n) // fmt.block, fmt.block))


def from_blocks_with(ops, blocks, shape: tuple[int, ...], fmt: BlockFormat, axis: int = -1,
                     across: int | None = None):
    """from_blocks() of a framework's tensor: the tensor of x's `shape`, the padding dropped."""
    axis, across = _axes(len(shape), fmt, axis, across)
    *lead, big_m, rows, big_n, block = ops.shape(blocks)
    y = ops.reshape(blocks, (*lead, big_m * rows, big_n * block))
    return _restore(ops, y, len(shape), axis, across, 1 if across is None else shape[across], shape[axis])


def scale_grid_with(ops, scales, ndim: int, fmt: BlockFormat, axis: int = -1, across: int | None = None):
    """Block scales [..., M, 1, N, 1] laid out as x is (Quantized.scales), each blocked axis holding its blocks."""
    axis, across = _axes(ndim, fmt, axis, across)
    *lead, big_m, _, big_n, _ = ops.shape(scales)
    return _restore(ops, ops.reshape(scales, (*lead, big_m, big_n)), ndim, axis, across, big_m, big_n)


def block_amax_with(ops, blocks):
    """Each block's largest magnitude, [..., M, 1, N, 1] float32, a non-finite value counting as infinity."""
    magnitude = ops.where(ops.isfinite(blocks), ops.abs(blocks), ops.full_like(blocks, math.inf))
    return ops.max_over(magnitude, (-3, -1))


def tensor_amax_with(ops, amax):
    """tensor_amax() of block amaxes: the largest finite one (0 where none is), a float32 scalar tensor."""
    return ops.amax(ops.where(ops.isfinite(amax), amax, ops.full_like(amax, 0.0)))


def quantize_with(ops, x, fmt: BlockFormat, axis: int = -1, rounding: str = "nearest", bits=None,
                  across: int | None = None, tensor_amax=None):
    """quantize() on a framework's float32 tensor through its RoundingOps: (the dequantized values, x's shape; the
    block scales, laid out as Quantized.scales), the reference's bit for bit. `bits` the stochastic rounding's
    (int32 0..2^16-1, x's shape); `tensor_amax` NVFP4's kept tensor amax (a float32 scalar tensor; None: x's).
    The layout is to_blocks', the arithmetic block_quantize_with's."""
    if rounding not in ("nearest", "stochastic"):
        raise HarnessError(f"element rounding '{rounding}': nearest or stochastic")
    if rounding == "stochastic" and bits is None:
        raise HarnessError("stochastic rounding needs its bits: one integer in [0, 2^16) per value")
    shape = tuple(ops.shape(x))
    blocks = to_blocks_with(ops, x, fmt, axis, across)
    amax = block_amax_with(ops, blocks)
    g = None
    if fmt.scale == "e4m3":
        g = nvfp4_tensor_scale_with(ops, tensor_amax_with(ops, amax) if tensor_amax is None else tensor_amax)
    noise = to_blocks_with(ops, bits, fmt, axis, across) if rounding == "stochastic" else None
    values, scales = block_quantize_with(ops, blocks, amax, fmt, g, noise)
    return (from_blocks_with(ops, values, shape, fmt, axis, across),
            scale_grid_with(ops, scales, len(shape), fmt, axis, across))


def _butterfly_with(ops, v):
    """v [..., 16] (float64) @ H: each stage's pairs (a, b) become (b + a, a + (-b)), which are a + b and a - b
    exactly, at strides 1, 2, 4, 8."""
    *lead, _ = ops.shape(v)
    h = 1
    while h < HADAMARD_SIZE:
        v = ops.reshape(v, (*lead, HADAMARD_SIZE // (2 * h), 2, h))
        v = ops.flip(v, -2) + v * ops.constant(_PAIR_SIGNS, v)
        h *= 2
    return ops.reshape(v, (*lead, HADAMARD_SIZE))


def hadamard_transform_with(ops, x, axis: int = -1, seed: int = 0):
    """hadamard_transform() of a framework's float32 tensor, rounded once to float32 (what is quantized next): the
    same float64 operations in the same order, so the reference's values bit for bit, also where a block spans
    more than 25 binades and the float64 sums round."""
    shape = tuple(ops.shape(x))
    _check_hadamard(shape, axis)
    axis %= len(shape)
    order = _arranged(len(shape), axis, None)
    lead = tuple(shape[i] for i in order[:-1])

    def transform(x):
        v = ops.reshape(ops.transpose(x, order), (*lead, shape[axis] // HADAMARD_SIZE, HADAMARD_SIZE))
        v = ops.cast(v, "float64") * ops.constant(hadamard_signs(seed), x)
        v = _butterfly_with(ops, v) * (1.0 / math.sqrt(HADAMARD_SIZE))
        y = ops.to_float32(ops.reshape(v, (*lead, shape[axis])))
        return ops.transpose(y, [order.index(i) for i in range(len(order))])

    return ops.float64(transform)(x)


# ---- training: each product's operands blocked along the axis it sums over ----------------------------------
@dataclass(frozen=True)
class BlockRecipe:
    """A block-scaled training precision (harness.precision): the casts of every dense layer's and attention
    projection's matmul y = x @ w, x [M, K] (the batch's rows: samples x positions), w [K, N], float32 weights,
    optimizer and accumulation. Each of the step's three products takes its operands quantized in blocks along the
    axis that product sums over (torchao's MXLinear; Transformer Engine's MXFP8 and NVFP4 recipes), so x, w and dy
    are each quantized twice, once per product they enter:

        y  = Q_a(x along K) @ Q_w(w along K)
        dx = Q_g(dy along N) @ Q_w(w along N)^T
        dw = Q_a(x along M)^T @ Q_g(dy along M)     (with `hadamard`: x and dy transformed along M first)

    Q_a is `activation`'s quantizer, Q_w `weight`'s (a square 2-D tile format tiles w alike for both of its
    products, so it is quantized once), Q_g `gradient`'s; every cast rounds to nearest even, but with `stochastic`
    Q_g's two casts of dy round stochastically (NVFP4's recipe), each with bits of its own (the adapter's, drawn on
    the device for every product; the kit's, given). The bias is added after
    the product and its gradient is dy's sum, uncast (as FP8's, harness.fp8). The Hadamard transform of dw's
    operands (NVFP4's recipe) leaves their product unchanged before quantization (Q Q^T = I) and spreads an outlier
    over its block of 16 rows."""
    name: str
    activation: BlockFormat
    weight: BlockFormat
    gradient: BlockFormat
    hadamard: bool = False
    stochastic: bool = False
    native: bool = False  # the framework's own block-scaled matmuls instead of the emulation (no adapter has them)

    @property
    def tiled_weight(self) -> bool:
        return self.weight.rows > 1

    def describe(self) -> str:
        formats = dict.fromkeys(f.name for f in (self.activation, self.weight, self.gradient))
        return (f"{' / '.join(formats)} blocks{', Hadamard-transformed weight-gradient inputs' if self.hadamard else ''}"
                f"{', stochastically rounded gradients' if self.stochastic else ''}")


# The OCP MX paper's training recipes (Rouhani et al., 2023: E4M3 forward, E5M2 gradients in MXFP8; E2M3 forward,
# E3M2 gradients in MXFP6), MXFP4 and NVFP4 throughout (NVIDIA's NVFP4 pretraining recipe: 16x16 weight tiles,
# :rht its random Hadamard transform), DeepSeek-V3's block FP8 (e4m3 everywhere, 128x128 weight tiles).
RECIPES = {r.name: r for r in (
    BlockRecipe("mxfp8", MXFP8_E4M3, MXFP8_E4M3, MXFP8_E5M2),
    BlockRecipe("mxfp6", MXFP6_E2M3, MXFP6_E2M3, MXFP6_E3M2),
    BlockRecipe("mxfp4", MXFP4, MXFP4, MXFP4),
    BlockRecipe("nvfp4", NVFP4, NVFP4_WEIGHT, NVFP4),
    BlockRecipe("fp8_block", FP8_BLOCK, FP8_BLOCK_WEIGHT, FP8_BLOCK),
)}
BLOCK_LAYERS = ("dense", "attention", "conv2d", "patches")  # the layers whose matmuls a block recipe quantizes


def _along(ops, t, fmt: BlockFormat, axis: int, bits=None):
    """t's dequantized values in blocks along `axis` of a 2-D operand (a tile format: across the other axis too),
    rounded stochastically with `bits` (t's shape) where given."""
    return quantize_with(ops, t, fmt, axis=axis, across=(1 - axis) if fmt.rows > 1 else None,
                         rounding="nearest" if bits is None else "stochastic", bits=bits)[0]


def block_operands_with(ops, x, w, recipe: BlockRecipe):
    """The forward product's operands: (Q_a(x along K), Q_w(w along K)), x [M, K] and w [K, N] float32."""
    return _along(ops, x, recipe.activation, 1), _along(ops, w, recipe.weight, 0)


def block_gradient_operands_with(ops, x, w, dy, recipe: BlockRecipe, quantized_w=None, bits=None):
    """The backward products' operands: (Q_g(dy along N), Q_w(w along N)) for dx = first @ second^T, and
    (Q_a(x along M), Q_g(dy along M)) for dw = third^T @ fourth. `quantized_w`: the forward's Q_w, which a square
    tile format gives both products. `bits`: a stochastic recipe's, (for dx's cast, for dw's), each int32 0..2^16-1
    of dy's shape."""
    if recipe.stochastic and bits is None:
        raise HarnessError(f"{recipe.name} rounds its gradients stochastically: give the bits of both casts of dy")
    bits_n, bits_m = bits if recipe.stochastic else (None, None)
    w_n = quantized_w if recipe.tiled_weight and quantized_w is not None else _along(ops, w, recipe.weight, 1)
    x_m, dy_m = x, dy
    if recipe.hadamard:
        x_m, dy_m = hadamard_transform_with(ops, x, axis=0), hadamard_transform_with(ops, dy, axis=0)
    return (_along(ops, dy, recipe.gradient, 1, bits_n), w_n, _along(ops, x_m, recipe.activation, 0),
            _along(ops, dy_m, recipe.gradient, 0, bits_m))


def block_linear(x, w, dy, recipe: BlockRecipe, bits=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference: (y, dx, dw) of y = x @ w under `recipe`, x [M, K], w [K, N], dy [M, N], float32 in, the
    products summed in float64 and rounded once (the adapters' float32 sums differ from it by their order only);
    `bits` a stochastic recipe's (block_gradient_operands_with)."""
    qx, qw = block_operands_with(NUMPY_OPS, _f32(x), _f32(w), recipe)
    g_n, w_n, x_m, g_m = block_gradient_operands_with(NUMPY_OPS, _f32(x), _f32(w), _f32(dy), recipe, qw, bits)
    product = lambda a, b: (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)  # noqa: E731
    return product(qx, qw), product(g_n, w_n.T), product(x_m.T, g_m)


def block_conv2d(layer, x, kernel, dy, recipe: BlockRecipe, bits=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference of a conv2d or patches layer (its spec: `layer`) under `recipe`: (y, dx, dw) of its product
    without the bias, x [N, H, W, C], kernel [k, k, C, F], dy the output's gradient ([N, Ho, Wo, F]; a patches
    layer's [N, T, F]). The layer's product is a dense one (block_linear) of its windows (im2col: rows
    [N*Ho*Wo, k*k*C], each window's taps in the kernel's (i, j, c) order, c fastest, the padding's zeros included;
    harness.model.reference.windows) by the kernel as [k*k*C, F]: blocks along K run through a window in that order,
    along M through the output pixels of the batch; dx is the windows' gradient added back to the pixels each read
    (fold_windows). `bits`: a stochastic recipe's, each of the rows' gradient's shape [N*Ho*Wo, F]."""
    from harness.model.reference import fold_windows, windows

    rows = windows(layer, _f32(x))
    k = rows.shape[-1]
    dy = _f32(dy).reshape(-1, kernel.shape[-1])
    y, d_rows, dw = block_linear(rows.reshape(-1, k), _f32(kernel).reshape(k, -1), dy, recipe, bits)
    out_shape = (*rows.shape[:3], -1) if layer.type == "conv2d" else (rows.shape[0], -1, y.shape[-1])
    dx = fold_windows(layer, d_rows.reshape(rows.shape), np.shape(x)).astype(np.float32)
    return y.reshape(out_shape), dx, dw.reshape(np.shape(kernel))


def weight_storage_bits(graph, recipe: BlockRecipe) -> tuple[int, int]:
    """(the bits the matmul weights that `recipe` quantizes take in its weight format, packed with their scales;
    the count of those weights): what a block-scaled kernel reads, from sizes alone (the emulation keeps them in
    float32). A kernel [K, N] is blocked along K (and tiled across N); a convolution's along its window's taps."""
    bits = count = 0
    for info in graph.layers:
        if info.type in BLOCK_LAYERS:
            for name, shape in info.params.items():
                if name.endswith("kernel"):  # a convolution's [k, k, C, F] as its product's [k*k*C, F]
                    shape = (math.prod(shape[:-1]), shape[-1])
                    bits += storage_bits(shape, recipe.weight, axis=0, across=1 if recipe.tiled_weight else None)
                    count += math.prod(shape)
    return bits, count


def block_refusal(recipe: BlockRecipe, graph, batch_size: int) -> str | None:
    """Why a spec cannot train under `recipe` (one line), or None: a grouped convolution's product is one per group
    (not block-scaled yet), and the Hadamard transform needs the rows of every product (batch x positions; a
    convolution's output pixels) in whole blocks of 16. `graph` None: a native model's."""
    if graph is None:
        return f"{recipe.name} trains spec networks only: a native model's matmuls are not block-scaled yet"
    for info in graph.layers:
        if info.type == "conv2d" and info.spec.groups > 1:
            return (f"{recipe.name} block-scales a convolution as one product of its windows; layer {info.path} is "
                    f"grouped ({info.spec.groups} groups), which is not covered yet")
        if recipe.hadamard and info.type in BLOCK_LAYERS:
            rows = batch_size * math.prod(info.out_shape[:-1])
            if rows % HADAMARD_SIZE:
                return (f"{recipe.name}:rht transforms the weight gradient's inputs in blocks of {HADAMARD_SIZE} "
                        f"rows: layer {info.path} has {rows} (batch x positions)")
    return None


# ---- what a diagnosis says of each block recipe ---------------------------------------------------------------
# diagnose (harness.run.diagnose) trains in strict float32 and hands this section each matmul layer's captured
# operands: BlockStatistics quantizes them as each recipe's training would (x along K, w along K, dy along N: the
# forward product's operands and the dx product's gradient operand) and keeps, per recipe, layer and matmul input,
# the non-zero values that underflow to 0 within their block and those that saturate, and per layer the relative
# error of the quantized forward product. A block format's error is mostly its element's rounding, which every
# layer pays: what makes a layer one to keep in higher precision is an error, or an underflow, that stands out
# against what the same recipe does to values without outliers. So each figure is judged against the recipe's
# figures on Gaussian operands (gaussian_reference), measured here, not against a fixed number.
BLOCK_ROLES = ("input", "weight", "output_gradient")
REFERENCE_SHAPE = (256, 512, 256)  # M, K, N of gaussian_reference's product: 16 x 512 / 32 blocks per row
REFERENCE_SEED = 0xB10C
#: a layer stands out when its forward product is off by more than this times the recipe's error on Gaussian
#: operands. Measured (benchmarks/RESULTS.md, "Block formats in diagnose"): ordinary layers sit at 0.76 to 1.6 times
#: it, the classifiers highest (resnet8's last dense layer 2.0x in mxfp8, 2.5x in nvfp4: its sums cancel, which
#: magnifies any rounding, the 16-bit formats' too); 3 leaves them a margin and still flags a product that loses
#: what the format's rounding alone would not. The outlier spec is named by its underflow, not by this.
ERROR_FACTOR = 3.0
#: an operand stands out when the share of its magnitude (the sum of |x| over its values) that underflows to 0
#: within its blocks is more than this times the format's on Gaussian values, and more than MIN_LOST. By magnitude,
#: not by count: a value far below its block's largest is lost either way and matters little (a trained
#: classifier's logit gradients hold probabilities of 1e-13 beside -1: e5m2's blocks flush 8% of them, which moves
#: no product), while a 100x channel flushes the ordinary values of its block, each as large as the operand's
#: typical one (17% of a 64-wide input's magnitude, against MXFP4's 0.6% on Gaussian values). The counts are kept
#: and shown. Clipping is counted but not judged on its own: under these scales a clipped value loses at most
#: 1 - max / 2^(emax + 1) of itself (12.5% in e4m3, e5m2 and e3m2, 6.25% in e2m3, 25% in e2m1; an NVFP4 or block
#: FP8 scale's rounding less), about one rounding step at its size, and the forward product's error holds it. It
#: is not rare: the floor rule clips 0.5-3% of Gaussian values, and up to 12.5% of a Glorot-uniform kernel's in
#: e4m3 when its limit sits just under a power of two (every block's amax then does).
SHARE_FACTOR = 3.0
MIN_LOST = 0.01  # harness.fp8's MAX_UNDERFLOW, here of the magnitude: the 8-bit formats lose none of Gaussian values


def judged_recipes() -> dict[str, BlockRecipe]:
    """The recipes a diagnosis judges: RECIPES (nvfp4:rht is nvfp4 with the Hadamard transform of dw's operands,
    which diagnose does not multiply: its forward and dx operands are nvfp4's)."""
    return dict(RECIPES)


def role_format(recipe: BlockRecipe, role: str) -> BlockFormat:
    """The format of a matmul input (BLOCK_ROLES) under `recipe`."""
    return {"input": recipe.activation, "weight": recipe.weight, "output_gradient": recipe.gradient}[role]


def _operand(t, fmt: BlockFormat, axis: int) -> Quantized:
    """A 2-D operand quantized along `axis` as training quantizes it (_along: a tile format across the other axis)."""
    return quantize(t, fmt, axis=axis, across=(1 - axis) if fmt.rows > 1 else None)


def _block_multipliers(q: Quantized, shape: tuple[int, ...], fmt: BlockFormat, axis: int) -> np.ndarray:
    """Each value's dequantizing multiplier (its block scale, times NVFP4's tensor scale), laid out as x: the scale
    grid repeated over each block (and tile) and cropped to x's shape."""
    grid = np.repeat(q.scales.astype(np.float64), fmt.block, axis=axis)
    if fmt.rows > 1:
        grid = np.repeat(grid, fmt.rows, axis=1 - axis)
    return grid[tuple(slice(0, n) for n in shape)] * q.tensor_scale


def operand_counts(t, fmt: BlockFormat, axis: int, q: Quantized | None = None) -> dict[str, int]:
    """Of a 2-D operand's non-zero finite values (`values`), how many underflow (their block's scale makes them 0)
    and how many saturate (above the element's largest value times their block's multiplier: clipped; under MX's
    floor rule a block's largest can be), quantized along `axis`; and their summed magnitude (`magnitude`: the sum
    of |x|) and that of the underflowing ones (`lost`). `q`: its quantization, where already made."""
    t = _f32(t)
    q = _operand(t, fmt, axis) if q is None else q
    counted = np.isfinite(t) & (t != 0)
    multiplier = _block_multipliers(q, t.shape, fmt, axis)
    magnitude = np.where(counted, np.abs(t.astype(np.float64)), 0.0)
    underflow = counted & (q.values == 0)
    with np.errstate(invalid="ignore"):
        saturate = counted & (magnitude > fmt.element.max * multiplier)
    return {"values": int(counted.sum()), "underflow": int(underflow.sum()), "saturate": int(saturate.sum()),
            "magnitude": float(magnitude.sum()), "lost": float(magnitude[underflow].sum())}


def product_error(lhs, rhs, recipe: BlockRecipe, quantized=None) -> float | None:
    """||Q_a(lhs along K) @ Q_w(rhs along K) - lhs @ rhs||_F / ||lhs @ rhs||_F, both products in float64 (the
    operands block_operands_with gives training); None where the product is 0 or not finite. `quantized`: the two
    dequantized operands, where already made."""
    qx, qw = quantized if quantized is not None else (_operand(lhs, recipe.activation, 1).values,
                                                      _operand(rhs, recipe.weight, 0).values)
    exact = np.asarray(lhs, np.float64) @ np.asarray(rhs, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        error = float(np.linalg.norm(qx.astype(np.float64) @ qw.astype(np.float64) - exact))
    norm = float(np.linalg.norm(exact))
    return error / norm if norm > 0 and math.isfinite(norm) and math.isfinite(error) else None


class BlockStatistics:
    """Per block recipe (judged_recipes), layer and matmul input (BLOCK_ROLES), the underflow and saturation counts
    of the operands a diagnosis captured, and per layer the largest relative error of its quantized forward
    products (over its products and the captured steps). add_product takes a forward product's operands (lhs
    [M, K], rhs [K, N]: harness.model.reference.matmuls), add_gradient a layer's output gradient ([..., N])."""

    def __init__(self, recipes: dict[str, BlockRecipe] | None = None):
        self.recipes = judged_recipes() if recipes is None else recipes
        self.layers: dict[str, dict[str, dict]] = {name: {} for name in self.recipes}

    def _entry(self, recipe: str, layer: str) -> dict:
        return self.layers[recipe].setdefault(layer, {"error": None, "operands": {}})

    def _count(self, recipe: str, layer: str, role: str, fmt: BlockFormat, found: dict[str, int]) -> None:
        total = self._entry(recipe, layer)["operands"].setdefault(role, {"format": fmt.name, "values": 0,
                                                                         "underflow": 0, "saturate": 0,
                                                                         "magnitude": 0.0, "lost": 0.0})
        for key, value in found.items():
            total[key] += value

    def add_product(self, layer: str, lhs, rhs, count_input: bool = True) -> None:
        """One forward product; `count_input` False where its lhs was counted already (attention's query, key
        and value projections share their input)."""
        lhs, rhs = _f32(lhs), _f32(rhs)
        for name, recipe in self.recipes.items():
            qx, qw = _operand(lhs, recipe.activation, 1), _operand(rhs, recipe.weight, 0)
            if count_input:
                self._count(name, layer, "input", recipe.activation, operand_counts(lhs, recipe.activation, 1, qx))
            self._count(name, layer, "weight", recipe.weight, operand_counts(rhs, recipe.weight, 0, qw))
            error = product_error(lhs, rhs, recipe, (qx.values, qw.values))
            entry = self._entry(name, layer)
            if error is not None:
                entry["error"] = max(entry["error"] or 0.0, error)

    def add_gradient(self, layer: str, dy) -> None:
        """A layer's output gradient, as the dx product quantizes it: along N (its last axis)."""
        dy = _f32(dy)
        dy = dy.reshape(-1, dy.shape[-1]) if dy.ndim else dy.reshape(1, 1)
        for name, recipe in self.recipes.items():
            self._count(name, layer, "output_gradient", recipe.gradient, operand_counts(dy, recipe.gradient, 1))

    def result(self) -> dict:
        """{recipe: {layer: {"error": float or None, "operands": {role: {format, values, underflow, saturate,
        magnitude, lost}}}}},
        the record's diagnosis.blocks; empty where nothing was added."""
        return {name: layers for name, layers in self.layers.items() if layers}


def _gaussian_operands() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m, k, n = REFERENCE_SHAPE
    rng = np.random.default_rng(REFERENCE_SEED)
    return tuple(rng.standard_normal(shape).astype(np.float32) for shape in ((m, k), (k, n), (m, n)))


_REFERENCES: dict[str, dict] = {}


def gaussian_reference(recipe: BlockRecipe) -> dict:
    """What `recipe` does to values without outliers: standard normal operands ([256, 512] @ [512, 256], an output
    gradient [256, 256]) quantized as BlockStatistics quantizes a layer's: {"error": the forward product's relative
    error, role: {"underflow", "saturate": shares of the values; "lost": share of the magnitude}}. Computed once
    per recipe and kept (a fixed seed)."""
    key = repr(recipe)
    if key not in _REFERENCES:
        stats = BlockStatistics({"r": recipe})
        lhs, rhs, dy = _gaussian_operands()
        stats.add_product("g", lhs, rhs)
        stats.add_gradient("g", dy)
        entry = stats.result()["r"]["g"]
        _REFERENCES[key] = {"error": entry["error"],
                            **{role: {"underflow": c["underflow"] / c["values"],
                                      "saturate": c["saturate"] / c["values"], "lost": c["lost"] / c["magnitude"]}
                               for role, c in entry["operands"].items()}}
    return _REFERENCES[key]


def lost_limit(reference: dict, role: str) -> float:
    """The share of a matmul input's magnitude past which its underflow stands out (SHARE_FACTOR, MIN_LOST)."""
    return max(MIN_LOST, SHARE_FACTOR * reference[role]["lost"])


def block_problems(recipe: BlockRecipe, layers: dict) -> list[tuple[str, str, str, float, float]]:
    """(layer, "product" or a matmul input, "error" or "underflow", the figure, its limit) past the limits
    (ERROR_FACTOR times the Gaussian error; lost_limit: the share of its magnitude that underflows), worst
    first: by how far past its limit."""
    reference = gaussian_reference(recipe)
    found = []
    for layer, entry in layers.items():
        error = entry.get("error")
        if error is not None and reference["error"] and error > ERROR_FACTOR * reference["error"]:
            found.append((layer, "product", "error", error, ERROR_FACTOR * reference["error"]))
        for role, c in entry.get("operands", {}).items():
            if not c.get("magnitude") or role not in reference:
                continue
            share, limit = c["lost"] / c["magnitude"], lost_limit(reference, role)
            if share > limit:
                found.append((layer, role, "underflow", share, limit))
    return sorted(found, key=lambda p: (-p[3] / p[4], p[0], p[1]))


def keep_in_higher_precision(recipe: BlockRecipe, layers: dict) -> list[str]:
    """The layers whose product error or operands stand out under `recipe` (block_problems), worst first: the ones
    to leave in higher precision, as NVIDIA's NVFP4 recipe leaves some."""
    return list(dict.fromkeys(p[0] for p in block_problems(recipe, layers)))


def _pct(value: float) -> str:
    return f"{100 * value:.3g}%"


def _named(layer: str, layer_types: dict | None) -> str:
    kind = (layer_types or {}).get(layer)
    return f"{layer} ({kind})" if kind else layer


def block_verdicts(blocks: dict, layer_types: dict | None = None) -> dict[str, str]:
    """One sentence per recipe of a diagnosis's block statistics (BlockStatistics.result()): "safe" where no layer
    stands out, else the layers to keep in higher precision and why, worst first."""
    out = {}
    for name, layers in blocks.items():
        recipe = RECIPES.get(name)
        if recipe is None or not layers:
            continue
        reference = gaussian_reference(recipe)
        found = block_problems(recipe, layers)
        if not found:
            worst = max((e["error"] for e in layers.values() if e.get("error") is not None), default=None)
            product = (f"forward products at most {_pct(worst)} off ({_pct(reference['error'])} on Gaussian values, a "
                       f"layer stands out past {ERROR_FACTOR:g}x)" if worst is not None else "no product measured")
            out[name] = (f"{name}: safe: no layer stands out against what {recipe.describe()} do to Gaussian values: "
                         f"{product}; no matmul input loses more than {SHARE_FACTOR:g}x their share of its "
                         f"magnitude to underflow (and {MIN_LOST:.0%})")
            continue
        keep = ", ".join(_named(layer, layer_types) for layer in dict.fromkeys(p[0] for p in found))
        reasons = []
        for layer, role, kind, value, limit in found[:4]:
            if kind == "error":
                times = value / reference["error"]
                reasons.append(f"layer {layer}'s forward product is {_pct(value)} off ({times:.1f}x the "
                               f"{_pct(reference['error'])} of Gaussian values)")
            else:
                c = layers[layer]["operands"][role]
                reasons.append(f"layer {layer}'s {role.replace('_', ' ')} ({c['format']}) loses {_pct(value)} of its "
                               f"magnitude to underflow, {_pct(c['underflow'] / c['values'])} of its values "
                               f"(Gaussian values: {_pct(reference[role]['lost'])}, "
                               f"{_pct(reference[role]['underflow'])})")
        more = f" (and {len(found) - 4} more)" if len(found) > 4 else ""
        out[name] = f"{name}: not safe: keep layer{'s' if ',' in keep else ''} {keep} in higher precision: " \
                    f"{'; '.join(reasons)}{more}"
    return out


# ---- what the matmul weights would take ---------------------------------------------------------------------
PLAIN_WEIGHT_BITS = {"fp32": 32, "bf16": 16, "fp8": 8}  # bits per value where a kernel is stored unscaled


def matmul_weights(graph) -> dict:
    """The record's matmul_weights: the count of the kernels a block recipe quantizes (BLOCK_LAYERS), and per recipe
    (RECIPES) the bits they take in its weight format with its scales (weight_storage_bits): from sizes alone."""
    sizes = {name: weight_storage_bits(graph, recipe) for name, recipe in RECIPES.items()}
    count = next(iter(sizes.values()))[1] if sizes else 0
    return {"count": count, "bits": {name: bits for name, (bits, _) in sizes.items()}}
