"""Precision policies: each name is parsed once here, in the core, and handed to adapters as data."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from harness.errors import HarnessError
from harness.fp8 import E4M3, E5M2, Fp8Policy, Recipe
from harness.microscaling import RECIPES, BlockRecipe
from harness.rounding import DEFAULT_FRAC_BITS, Rounding


@dataclass(frozen=True)
class Precision:
    name: str
    compute_dtype: str  # dtype of matmuls/convolutions
    param_dtype: str  # dtype the weights (and optimizer state) are stored in
    tf32: bool  # TensorFloat-32 math for float32 matmuls (GPU only)
    gpu_only: bool
    default_loss_scale: str  # "dynamic" or "none"; see LossScale
    description: str
    #: how the optimizer writes updated weights (harness.rounding): None for the framework's own optimizer step
    #: in the weights' dtype; else the update is computed in float32 and written by this rule
    rounding: Rounding | None = None
    #: FP8 training (harness.fp8): every matmul's inputs cast to FP8 and back by the core's rule, emulated in
    #: float32 (compute_dtype), products accumulated in float32; None for every other precision
    fp8: Fp8Policy | None = None
    #: block-scaled training (harness.microscaling.BlockRecipe): every dense, attention and convolution matmul's
    #: three products take their operands quantized in blocks along the axis each sums over, emulated in float32
    blocks: BlockRecipe | None = None
    #: how the report's charts draw this precision, the same in every chart (harness.report.charts): a colour
    #: and a marker (matplotlib's letters, harness.report.svg.marker_path) of its own, asked of every entry
    colour: str = field(kw_only=True)
    marker: str = field(kw_only=True)

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.param_dtype


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", "float32", "float32", False, False, "none", "strict float32 (TF32 off)",
                  colour="#4c72b0", marker="o"),
        Precision("tf32", "float32", "float32", True, True, "none", "float32 with TensorFloat-32 matmuls",
                  colour="#64b5cd", marker="D"),
        Precision("amp_fp16", "float16", "float32", False, False, "dynamic",
                  "mixed float16: fp32 weights, fp16 compute, dynamic loss scaling", colour="#dd8452", marker="s"),
        Precision("amp_bf16", "bfloat16", "float32", False, False, "none",
                  "mixed bfloat16: fp32 weights, bf16 compute", colour="#55a868", marker="^"),
        Precision("fp16", "float16", "float16", False, False, "none",
                  "pure float16 weights and compute (the old floatx=float16 setup)", colour="#c44e52", marker="v"),
        Precision("bf16", "bfloat16", "bfloat16", False, False, "none", "pure bfloat16 weights and compute",
                  colour="#8172b3", marker="P"),
        # not a training choice: the parity check's reference, where rounding cannot hide a math difference
        Precision("fp64", "float64", "float64", False, False, "none", "float64 weights and compute",
                  colour="#937860", marker="X"),
        # pure 16-bit training that converges without float32 master weights (harness.rounding,
        # docs/stochastic-rounding.md): the update in float32, written back by the rounding rule
        Precision("bf16_sr", "bfloat16", "bfloat16", False, False, "none",
                  "pure bfloat16; float32 update written back with stochastic rounding",
                  Rounding("stochastic", "bfloat16"), colour="#da8bc3", marker="<"),
        Precision("fp16_sr", "float16", "float16", False, False, "none",
                  "pure float16; float32 update written back with stochastic rounding",
                  Rounding("stochastic", "float16"), colour="#ccb974", marker=">"),
        Precision("bf16_kahan", "bfloat16", "bfloat16", False, False, "none",
                  "pure bfloat16; float32 update added with Kahan summation (bfloat16 compensation buffer)",
                  Rounding("kahan", "bfloat16"), colour="#1b7f79", marker="d"),
        # Gupta et al.'s setting: float32 compute and storage holding values of the fixed-point grid only
        Precision("fixed16_sr", "float32", "float32", False, False, "none",
                  f"weights on a 16-bit fixed-point grid ({DEFAULT_FRAC_BITS} fractional bits; fixed16_sr:F for F), "
                  "float32 compute, stochastic rounding", Rounding("stochastic", "fixed16"),
                  colour="#a6761d", marker="p"),
        Precision("fixed16_rn", "float32", "float32", False, False, "none",
                  f"weights on a 16-bit fixed-point grid ({DEFAULT_FRAC_BITS} fractional bits; fixed16_rn:F for F), "
                  "float32 compute, round-to-nearest", Rounding("nearest", "fixed16"),
                  colour="#555555", marker="h"),
        # FP8 (harness.fp8, docs/fp8.md): float32 weights and optimizer, every matmul's inputs cast by the core's
        # rule; NAME:current (the default) scales each tensor by its own amax
        Precision("fp8_e4m3", "float32", "float32", False, False, "none",
                  "FP8 e4m3 matmul inputs and gradients (emulated), float32 weights and accumulation",
                  fp8=Fp8Policy(E4M3, E4M3), colour="#e377c2", marker="*"),
        Precision("fp8_hybrid", "float32", "float32", False, False, "none",
                  "FP8 e4m3 forward, e5m2 gradients (emulated), float32 weights and accumulation",
                  fp8=Fp8Policy(E4M3, E5M2), colour="#17becf", marker="8"),
        # block-scaled formats (harness.microscaling, docs/microscaling.md): float32 weights and optimizer, every
        # matmul's operands (dense, attention, convolution) quantized in blocks along each product's reduction axis
        *(Precision(name, "float32", "float32", False, False, "none",
                    f"{recipe.describe()} (emulated), float32 weights and accumulation",
                    blocks=recipe, colour=colour, marker=marker)
          for (name, recipe), (colour, marker) in zip(RECIPES.items(), (
              ("#7f7f7f", "H"), ("#bcbd22", "+"), ("#ff7f0e", "x"), ("#2ca02c", "1"), ("#d62728", "2")))),
    )
}


NATIVE = "native"  # an FP8 precision's suffix: the framework's own FP8 matmuls, not the emulation
HADAMARD = "rht"  # a block-scaled precision's suffix: NVFP4's random Hadamard transform of dw's operands
STOCHASTIC = "sr"  # and another: its gradients' casts rounded stochastically (NVFP4's recipe)
#: a block-scaled precision's suffixes, in the order its canonical name gives them: nvfp4:rht:sr:native
BLOCK_SUFFIXES = {HADAMARD: ("hadamard", "Hadamard-transformed weight-gradient inputs"),
                  STOCHASTIC: ("stochastic", "stochastically rounded gradients"),
                  NATIVE: ("native", "native block-scaled matmuls")}


def parse_precision(name: str) -> Precision:
    """A precision by name; the fixed-point ones also as NAME:F, F the fractional bits (0..15); the FP8 ones as
    NAME:current (what NAME alone means), NAME:delayed or NAME:delayed:N (harness.fp8.Recipe), each with :native
    after it for the framework's own FP8 matmuls (NAME:native, NAME:delayed:16:native); the block-scaled ones with
    any of :rht (the random Hadamard transform), :sr (stochastically rounded gradients) and :native (the
    framework's block-scaled matmuls), named in that order (nvfp4:rht:sr)."""
    base, colon, bits = name.partition(":")
    try:
        precision = PRECISIONS[base]
    except KeyError:
        raise HarnessError(f"unknown precision '{name}'; valid: {', '.join(PRECISIONS)}") from None
    if not colon:
        return precision
    if precision.blocks is not None:
        suffixes = bits.split(":")
        if any(s not in BLOCK_SUFFIXES for s in suffixes) or len(set(suffixes)) < len(suffixes):
            raise HarnessError(f"precision '{name}': a block-scaled precision takes any of :{HADAMARD} (the random "
                               f"Hadamard transform of the weight gradient's inputs), :{STOCHASTIC} (stochastically "
                               f"rounded gradients) and :{NATIVE} (the framework's block-scaled matmuls), each once")
        chosen = [s for s in BLOCK_SUFFIXES if s in suffixes]
        canonical = ":".join([base, *chosen])
        blocks = replace(precision.blocks, name=canonical, **{BLOCK_SUFFIXES[s][0]: True for s in chosen})
        described = precision.description.replace(" (emulated)", "" if NATIVE in chosen else " (emulated)")
        return replace(precision, name=canonical, blocks=blocks, description=described.replace(
            " blocks", " blocks, " + ", ".join(BLOCK_SUFFIXES[s][1] for s in chosen), 1))
    if precision.fp8 is not None:
        native = bits == NATIVE or bits.endswith(f":{NATIVE}")
        try:
            recipe = Recipe.parse(bits[:-len(NATIVE)].removesuffix(":") or "current" if native else bits)
        except HarnessError as exc:
            raise HarnessError(f"precision '{name}': {exc}, optionally followed by :{NATIVE}") from None
        description = precision.description.replace("(emulated)", "(native FP8 matmuls)" if native else "(emulated)")
        return replace(precision, name=name, fp8=replace(precision.fp8, recipe=recipe, native=native),
                       description=f"{description}, {recipe.name} scaling")
    if precision.rounding is None or precision.rounding.format != "fixed16" or not bits.isdigit() \
            or not 0 <= int(bits) <= 15:
        raise HarnessError(f"precision '{name}': only the fixed-point precisions take ':F', F the fractional bits "
                           f"0..15 (e.g. fixed16_sr:12)")
    rounding = replace(precision.rounding, frac_bits=int(bits))
    return replace(precision, name=name, rounding=rounding,
                   description=precision.description.replace(f"{DEFAULT_FRAC_BITS} fractional", f"{bits} fractional"))


@dataclass(frozen=True)
class LossScale:
    """Loss-scale settings, explicit and equal for every adapter, recorded with each result.

    mode "dynamic": start at `initial`, multiply by `growth_factor` after `growth_interval` clean steps,
    by `backoff_factor` on an overflow (and skip that step). "fixed": always `initial`, overflowing steps
    skipped. "none": no scaling.
    """

    mode: str = "none"
    initial: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in ("dynamic", "fixed", "none"):
            raise HarnessError(f"loss scale mode '{self.mode}' is not one of dynamic, fixed, none")
        if self.initial <= 0 or self.growth_interval < 1:
            raise HarnessError("loss scale: initial must be > 0 and growth_interval >= 1")

    def to_dict(self) -> dict:
        return asdict(self)


class LossScaler:
    """The loss-scale rules, once: what every adapter's scaler must do, step by step (PyTorch's GradScaler
    semantics). After a step whose unscaled gradients were not all finite, the step is skipped and a dynamic
    scale is multiplied by `backoff_factor`; after `growth_interval` consecutive finite steps it is
    multiplied by `growth_factor`. `scale` is always the scale the *next* step will use, which is what
    Trainer.loss_scale_state reports. Adapters without a framework scaler use this class; adapters with one
    are checked against it after every step (harness.run.worker)."""

    def __init__(self, settings: LossScale):
        self.settings = settings
        self.scale = settings.initial
        self.clean_steps = 0

    def update(self, finite: bool) -> bool:
        """Account for one step; return True when that step must be skipped."""
        s = self.settings
        if s.mode != "dynamic":
            return not finite
        if not finite:
            self.scale *= s.backoff_factor
            self.clean_steps = 0
            return True
        self.clean_steps += 1
        if self.clean_steps == s.growth_interval:
            self.scale *= s.growth_factor
            self.clean_steps = 0
        return False


def _number(text: str) -> float:
    """A positive finite number, also written as a power of two: '65536', '1e4', '2^16'."""
    base, caret, exponent = text.partition("^")
    try:
        value = float(base) ** float(exponent) if caret else float(text)
    except OverflowError:
        raise ValueError(text) from None
    if not (value > 0 and value != float("inf")):
        raise ValueError(text)
    return value


def parse_loss_scale(text: str | None, precision: Precision, growth_interval: int = 2000) -> LossScale:
    """`None` -> the precision's default; 'dynamic', 'dynamic:INITIAL', 'none', or a number (fixed); numbers
    may be powers of two written as 2^K."""
    if text is None:
        text = precision.default_loss_scale
    mode, _, value = text.partition(":")
    try:
        if mode in ("dynamic", "none"):
            if mode == "none" and value:
                raise ValueError(text)
            return LossScale(mode=mode, initial=_number(value) if value else 2.0**16, growth_interval=growth_interval)
        return LossScale(mode="fixed", initial=_number(text), growth_interval=growth_interval)
    except ValueError:
        raise HarnessError(f"--loss-scale '{text}': expected dynamic, dynamic:INITIAL, none or a positive number "
                           f"(2^K works too)") from None

