"""The records amp-harness writes, one pydantic model per kind: a timed run (results.jsonl), a fingerprint
(fingerprints.jsonl), a diagnosis (diagnoses.jsonl) and a profile (profiles.jsonl). Every kind carries what
`Record` holds (what ran, how it ended, where), its `schema_version` (written as "schema") and its own payload.

The models say what a report or `parity` can read: a record that breaks one (an edited file, a foreign tool's
line) is skipped with a note naming the field (harness.results.usable), never a traceback. They validate strictly
(no coercion: a number written as a string is not a number). The runner writes records as plain JSON dicts and
`parity` reads them so; the report reads them as these models (harness.results.typed), and each model keeps the
JSON it was read from (`written`) for the rules that take a record as written (harness.identity, harness.numerics).

Schemas: 1; 2 added variant, state_memory_mb, device_peak_gflops, efficiency, study, diagnosis; 3 num_classes;
4 seed (a timed run's repeat r trains from the spec's seed + r); 5 task and tokens_per_sample (token sequences:
"next_token" or "classification", and the T tokens each sample holds, for tokens/s); 6 nonfinite (where a
diverged run's first inf or NaN came from); 7 width (a scaling study's width factor) and matmul_curve (its runs'
device matmul curve per dtype), and nonfinite names an update too, and a skipped step's scale; 8 matmul_shapes (a
scaling study's run: its step's own matmuls, each timed alone) and diagnosis.fp8 (FP8 cast statistics); 9 process
(the worker process a run ran in: repeats that shared one are one unit of a timing interval) and auto_round (the
round of `--repeats auto` it ran in, from which the report replays the sequential test), and diagnosis.matmul_error
and diagnosis.layer_types (each matmul's error with its inputs in 16 bits; the layers' types, to name them); 10
diagnosis.blocks (the block recipes' underflow, clipping and product errors) and matmul_weights (the matmul weights'
size in each block format). Every field added
since 1 is optional, so a record of any schema from 1 to SCHEMA_VERSION reads; a newer one is refused
(harness.results.read_records).
"""
from __future__ import annotations

import re
import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError

SCHEMA_VERSION = 10
OLDEST_SCHEMA = 1
STATUSES = ("ok", "unsupported", "failed", "diverged", "timeout")

# strict: an int is a number too, and stays an int (a report prints 2^3 where the record says 3); a bool is not
Number = int | Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]
Positive = Annotated[Number, Field(gt=0)]
Rows = list[list[Number | None]]  # outputs as a fingerprint holds them: a row per sample, None where not finite


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)
    _written: dict | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_written(cls, data: Any, handler) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, _Strict):
            model._written = data
        return model

    @property
    def written(self) -> dict:
        """What this was validated from, as written (ints stay ints, fields no model names stay), for the rules
        that take a record as written: the JSON read, or the keyword arguments it was made with."""
        return self._written if self._written is not None else self.model_dump(by_alias=True)

    def replaced(self, **fields) -> typing.Self:
        """A copy with `fields` (by their names here) changed, in the model and in what it was read from alike."""
        copy = self.model_copy(update=fields)
        copy._written = {**self.written, **{type(self).model_fields[k].alias or k: v for k, v in fields.items()}}
        return copy


def _exponent(e: int | str) -> int | str:
    """A histogram's bin: a float's power-of-two exponent, an int in memory and a string once in JSON."""
    if isinstance(e, int) and abs(e) < 100_000 or isinstance(e, str) and re.fullmatch(r"-?[0-9]{1,5}", e):
        return e
    raise ValueError("not a power-of-two exponent")


class Histogram(_Strict):
    """harness.numerics.histogram: counts per power-of-two exponent, zeros, non-finite values, their count."""
    bins: dict[Annotated[int | str, AfterValidator(_exponent)], Count]
    zeros: Count
    nonfinite: Count
    count: Count
    max_abs: Number


Range = Annotated[list[Number], Field(min_length=2, max_length=2)]


class NonFinite(_Strict):
    """Where a run's first inf or NaN came from (harness.run.nonfinite.locate): a layer's output or output gradient
    in a step, or (schema 7) an update that made a weight non-finite."""
    found: bool
    why: str | None = None  # not found: why not
    step: Count | None = None
    layer: str | None = None
    layer_type: str | None = None
    pass_: Literal["forward", "backward", "update"] | None = Field(None, alias="pass")
    tensor: Literal["output", "output gradient", "weights"] | None = None
    values: Literal["inf", "nan"] | None = None
    input_range: Range | None = None
    loss_scale: Positive | None = None  # a skipped step's scale, which the gradients were multiplied by
    weight: str | None = None  # an update's: the weight, the share of its values it made non-finite, its gradient
    share: Number | None = None
    gradient_finite: bool | None = None
    zero_square_share: Number | None = None  # of the values it made non-finite: where the gradient's square is 0
    gradient_range: Range | None = None
    epsilon: Number | None = None  # the optimizer's epsilon where the weights' dtype rounds it to 0
    epsilon_format: str | None = None


class UpdateCounts(_Strict):
    """One layer's weight updates over the captured steps, counted against each 16-bit format
    (harness.numerics.update_counts): how many moved, and per format (its name, and its name with a suffix:
    "bfloat16", "bfloat16_sr", "float16_squares") what writing the weights in it would lose."""
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Number] = Field(init=False)
    updates: Number = 0  # the non-zero updates
    gradients: Number = 0  # the non-zero gradients
    magnitude: Number = 0.0  # the updates' summed size

    def lost(self, fmt: str) -> Number:
        """The updates nearest rounding to `fmt` ("bfloat16", "float16") loses: below half a weight's gap."""
        return (self.__pydantic_extra__ or {}).get(fmt, 0)


class BlockOperand(_Strict):
    """One matmul input of a layer under a block recipe, over the captured steps (harness.microscaling.
    BlockStatistics): its format, its non-zero finite values, those that underflow to 0 within their block, and
    those that saturate (clip); the sum of their magnitudes and of the underflowing ones' (what the verdict judges)."""
    format: str
    values: Count
    underflow: Count
    saturate: Count
    magnitude: Number = 0.0
    lost: Number = 0.0


class BlockLayer(_Strict):
    """One matmul layer under a block recipe: the largest relative error of its quantized forward products (None:
    no product measured), and its inputs' counts by role ("input", "weight", "output_gradient")."""
    error: Number | None = None
    operands: dict[str, BlockOperand] = {}


class MatmulWeights(_Strict):
    """Schema 10: the spec's block-scalable matmul weights (dense, attention and convolution kernels; harness.microscaling.
    weight_storage_bits): their count, and per block recipe the bits they take in its weight format, scales
    included, from their sizes alone."""
    count: Count
    bits: dict[str, Count]


class Diagnosis(_Strict):
    """What harness.run.diagnose writes and the report and `parity` read (harness.numerics.judge); a diagnosis
    that could not capture holds nothing else to read."""
    available: bool
    captured_steps: Annotated[list[Count], Field(min_length=1)] | None = None
    every: Count | None = None
    groups: dict[str, dict[str, Histogram]] | None = None
    updates: dict[str, UpdateCounts] | None = None  # per layer
    optimizer: str | None = None
    verdicts: dict[str, str] | None = None
    attention: dict[str, str] | None = None  # per attention layer (harness.numerics.attention_verdicts)
    #: per causal attention layer and 16-bit precision, what its mask leaves (harness.numerics.AttentionMask)
    attention_masks: dict[str, dict[str, dict[str, str]]] | None = None
    loss_scale_window: Annotated[list[Number | None], Field(min_length=2, max_length=2)] | None = None
    #: per FP8 precision and scaling recipe, layer and matmul input: its cast counts (harness.fp8.CastStatistics)
    fp8: dict[str, dict[str, dict[str, dict[str, str | Count]]]] | None = None
    #: schema 9: per matmul layer and 16-bit format, the largest relative error of its product with its captured
    #: inputs rounded to the format (harness.numerics.matmul_error), and each layer's type, to name it
    matmul_error: dict[str, dict[str, Number]] | None = None
    layer_types: dict[str, str] | None = None
    #: schema 10: per block recipe and matmul layer, its operands' underflow and clipping counts and its forward
    #: product's error (harness.microscaling.BlockStatistics), which harness.microscaling.block_verdicts judges
    blocks: dict[str, dict[str, BlockLayer]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nothing_to_read_unless_available(cls, data: Any) -> Any:
        return {"available": False} if isinstance(data, dict) and data.get("available") is False else data

    @model_validator(mode="after")
    def _captured(self) -> Diagnosis:
        if self.available and (self.captured_steps is None or self.groups is None):
            raise PydanticCustomError("diagnosis", "an available diagnosis holds captured_steps and groups")
        return self


class Fingerprint(_Strict):
    """What a fingerprint run writes (harness.run.fingerprint.fingerprint) and `parity` compares."""
    initial_outputs: Rows
    final_outputs: Rows
    skipped_steps: list[Count] | None = None
    loss_scales: list[Number] | None = None
    gradients: dict[str, list[Number]] | None = None
    spec: dict | None = None


class ProfiledLayer(_Strict):
    path: str
    label: str
    type: str
    forward_ms: Number
    backward_ms: Number
    compute: str | None = None


class Profile(_Strict):
    """A profile as harness.run.profile writes it and the report's "Where the time goes" reads it."""
    step_mean_ms: Positive
    steps: Count
    tool: str | None = None
    note: str | None = None
    coverage: Number | None = None
    parts: dict[str, Number]
    layers: list[ProfiledLayer]

    @property
    def casts_ms(self) -> float:
        """Time per step in casts between dtypes."""
        return self.parts["casts"]

    @property
    def other_ms(self) -> float:
        """Time per step no op accounts for (negative where ops overlapped in time)."""
        return self.parts["other"]

    @model_validator(mode="after")
    def _parts(self) -> Profile:
        if not {"casts", "other"} <= set(self.parts):
            raise PydanticCustomError("profile", "a profile's parts hold casts and other")
        return self


class LossScaleSettings(_Strict):
    """harness.precision.LossScale as written: a scaled run states where its scale starts."""
    mode: Literal["none", "fixed", "dynamic"] | None = None
    initial: Number | None = None
    growth_interval: Number | None = None
    growth_factor: Number | None = None
    backoff_factor: Number | None = None

    @model_validator(mode="after")
    def _scaled_from(self) -> LossScaleSettings:
        if self.mode in ("fixed", "dynamic") and self.initial is None:
            raise PydanticCustomError("loss_scale", "a fixed or dynamic loss scale has an initial scale")
        return self


class LossScale(_Strict):
    """The settings a run asked for, and what its scaler did (harness.run.train.train)."""
    settings: LossScaleSettings | None = None
    initial: Number | None = None
    final: Number | None = None
    skipped_steps: Count | None = None
    first_overflow_step: Count | None = None
    history: list[Number] | None = None


class Device(_Strict):
    """The device a run measured, as its adapter described it (harness.adapter.DeviceInfo)."""
    name: str | None = None
    kind: str | None = None
    description: str | None = None
    details: dict | None = None  # the adapter's own: what its framework tells of the device

    @property
    def compute_capability(self) -> str:
        """A GPU's compute capability where the adapter knows it ("8.0"), else ""."""
        return str((self.details or {}).get("compute_capability") or "")


class Env(_Strict):
    """Where a run ran (harness.run.measure.environment; the executor adds node and placement)."""
    threads: int | None = None
    device: Device | None = None
    hostname: str | None = None
    node: str | None = None
    cpu: str | None = None
    cpu_flags: list[str] | None = None
    python: str | None = None
    os: str | None = None


class MatmulCurve(_Strict):
    """One dtype's matmul curve (harness.run.peak.matmul_curve): GFLOP/s of an n x n product at each n measured."""
    n: list[Annotated[int, Field(gt=0)]]
    gflops: list[Positive]
    stopped: str | None = None  # why the larger sizes were not measured (a product over the time cap)

    @model_validator(mode="after")
    def _paired(self) -> MatmulCurve:
        if len(self.n) != len(self.gflops):
            raise PydanticCustomError("paired", "{n} sizes but {g} rates", {"n": len(self.n), "g": len(self.gflops)})
        return self


class MatmulProduct(_Strict):
    """One of a step's 2D matmuls (harness.model.graph.step_matmuls: m x k times k x n) and its rate timed alone
    (harness.run.peak.shape_rates), or why it was not timed."""
    layer: str
    type: str
    pass_: Literal["forward", "input gradient", "weight gradient"] = Field(alias="pass")
    m: Annotated[int, Field(gt=0)]
    k: Annotated[int, Field(gt=0)]
    n: Annotated[int, Field(gt=0)]
    gflops: Positive | None = None
    skipped: str | None = None


class MatmulShapes(_Strict):
    dtype: str  # the run's compute dtype
    products: list[MatmulProduct]


class StateMemory(_Strict):
    """What a run's state takes, in MB, by part (harness.model.graph: the weights, their gradients, the optimizer's
    slots, and a Kahan-compensated run's compensation buffer); a part it does not name is held too, as a number."""
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Number | None] = Field(init=False)
    weights: Number | None = None
    gradients: Number | None = None
    optimizer_state: Number | None = None
    compensation: Number | None = None

    @property
    def total(self) -> float:
        """Every part the record states, summed (a part this model does not name counts too)."""
        return sum(self.written.values())

    def __bool__(self) -> bool:
        return bool(self.written)  # a record that states no part has no state figure


class Record(_Strict):
    """What every record holds, in the order it is written (None where a figure does not apply or was not
    reached): what ran, how it ended, what it measured and where."""
    schema_version: int | None = Field(None, alias="schema")
    run_id: str
    framework: str
    framework_version: str | None = None
    model: str | None = None
    spec_hash: str | None = None
    num_classes: int | None = None
    task: Literal["classification", "next_token"] | None = None
    tokens_per_sample: Annotated[int, Field(gt=0)] | None = None
    precision: str
    variant: str | None = None
    device: str | None = None
    status: Literal[STATUSES]
    reason: str | None = None
    batch_size: Annotated[int, Field(gt=0)] | None = None
    width: Positive | None = None  # schema 7: the spec's width factor (a scaling study's --widths); None: 1
    steps: int | None = None
    warmup_steps: Count | None = None
    repeat: int | None = None
    seed: Count | None = None
    step_time_ms: dict[str, Number | None] | None = None
    step_times_ms: list[Positive] | None = None
    samples_per_s: Number | None = None
    first_step_ms: Number | None = None
    input_ms: Number | None = None
    peak_memory_mb: Number | None = None
    memory_kind: str | None = None
    state_memory_mb: StateMemory | None = None
    loss: list[Number | None] | None = None
    final_train_loss: Number | None = None
    eval_loss: Number | None = None
    eval_accuracy: Number | None = None
    loss_scale: LossScale | None = None
    flops_per_step: Number | None = None
    achieved_gflops: Number | None = None
    device_peak_gflops: dict[str, Number | None] | None = None
    efficiency: Number | None = None
    matmul_curve: dict[str, MatmulCurve | None] | None = None  # a scaling study's run: per dtype (None: no kernel)
    matmul_shapes: MatmulShapes | None = None  # schema 8: a scaling study's run: its step's matmuls, timed alone
    param_count: Number | None = None
    matmul_weights: MatmulWeights | None = None  # schema 10: what its matmul weights take in each block format
    options: dict | None = None
    env: Env | None = None
    started_at: str | None = None
    wall_s: Number | None = None
    process: str | None = None  # schema 9: the worker process it ran in; a timing interval's unit (harness.stats)
    auto_round: Count | None = None  # schema 9: --repeats auto's round it ran in (harness.stats.sequential replays)
    study: str | None = None
    fingerprint: Fingerprint | None = None
    diagnosis: Diagnosis | None = None
    variant_choice: dict | None = None  # --variant auto: which variant was chosen and why (harness.run.variants)
    nonfinite: NonFinite | None = None  # a diverged run: where its first inf or NaN came from

    #: what an ok record of this kind holds besides what identifies a run: what the report and `parity` read
    OK_HOLDS: ClassVar[tuple[str, ...]] = ("model",)

    @model_validator(mode="after")
    def _ok_holds(self) -> Record:
        if self.status == "ok" and (missing := [k for k in self.OK_HOLDS if getattr(self, k) is None]):
            raise PydanticCustomError("ok_holds", "ok but missing {missing}", {"missing": ", ".join(missing)})
        return self

    @property
    def fp8_matmuls(self) -> str | None:
        """How an FP8 run's matmuls ran, as its options say (options["fp8"]["matmuls"], e.g. "native
        (torch._scaled_mm)"); None where they do not (a run from before the option, or not FP8)."""
        return ((self.options or {}).get("fp8") or {}).get("matmuls")

    @property
    def block_matmuls(self) -> str | None:
        """How a block-scaled run's matmuls ran, as its options say (options["blocks"]["matmuls"]); None where they
        do not."""
        return ((self.options or {}).get("blocks") or {}).get("matmuls")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The keys every record is written with, as written."""
        return tuple(f.alias or name for name, f in Record.model_fields.items())


class RunRecord(Record):
    """A timed run's record (`amp-harness run`, results.jsonl)."""
    OK_HOLDS: ClassVar = ("model", "batch_size")


class FingerprintRecord(Record):
    """An `amp-harness fingerprint` record (fingerprints.jsonl), for `parity`."""
    OK_HOLDS: ClassVar = ("model", "fingerprint", "loss")


class DiagnosisRecord(Record):
    """An `amp-harness diagnose` record (diagnoses.jsonl)."""
    OK_HOLDS: ClassVar = ("model", "diagnosis")


class ProfileRecord(Record):
    """An `amp-harness profile` record (profiles.jsonl)."""
    profile: Profile | None = None
    OK_HOLDS: ClassVar = ("model", "profile")


def problem(exc: ValidationError, kind: type[Record]) -> str:
    """What is wrong with a record, in a few words naming the field: "missing framework", "loss_scale.settings
    is not what a record holds there", "ok but missing model"."""
    error = exc.errors(include_url=False)[0]
    if error["type"] == "ok_holds":
        return error["msg"]
    where = ".".join(_field_path(kind, error["loc"])) or "the record"
    if error["type"] == "missing" or error.get("input", 0) is None and len(error["loc"]) == 1:
        return f"missing {where}"
    return f"{where} is not what a record holds there"


def _field_path(model: type[BaseModel], loc: tuple) -> list[str]:
    """The model fields along an error's location, down to the first part that is not one (a list index, a
    dict key: what a record holds, not what it is called)."""
    path = []
    for part in loc:
        fields = {f.alias or name: f for name, f in model.model_fields.items()} if model else {}
        if part not in fields:
            break
        path.append(part)
        annotation = fields[part].annotation
        model = next((a for a in (annotation, *typing.get_args(annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return path


def is_profile(p) -> bool:
    """Whether `p` is a profile as harness.run.profile writes it."""
    try:
        Profile.model_validate(p)
    except ValidationError:
        return False
    return True
