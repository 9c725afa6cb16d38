"""Matrix files: a campaign in YAML (models with their own size overrides, precisions, loss scales, variants,
repeats), for `amp-harness run|fingerprint|diagnose|profile --matrix FILE`. See benchmarks/compare.yaml, and
tests/identity.yaml (what `tox` fingerprints and diagnoses in every framework)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
)

from harness.errors import HarnessError
from harness.limits import MAX_MODELS, MAX_REPEATS, MAX_SECONDS, MAX_STEPS
from harness.model.yaml_file import read_yaml
from harness.precision import parse_loss_scale, parse_precision


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MatrixModel(_Strict):
    model: str
    batch_size: Optional[PositiveInt] = None
    input_size: Optional[tuple[PositiveInt, PositiveInt]] = None
    steps: Optional[PositiveInt] = Field(None, le=MAX_STEPS)
    # loss scales to run for the precisions that scale by default (amp_fp16), e.g. [none, dynamic]
    loss_scales: Optional[list[str]] = Field(None, min_length=1)
    # this model's precisions instead of the matrix's (e.g. the pure 16-bit arms of swamped_mlp)
    precisions: Optional[list[str]] = Field(None, min_length=1)
    # this model's variants (the adapter's names, or [all]) instead of the command's --variant: a framework's other
    # ways to run a step, fingerprinted on the specs that hold every kind of layer
    variants: Optional[list[str]] = Field(None, min_length=1)
    # the commands that take this model from the file (`amp-harness run|fingerprint|diagnose|profile --matrix`): a
    # model whose runs would take too long for the campaign's time can still be diagnosed
    commands: list[Literal["run", "fingerprint", "diagnose", "profile"]] = Field(
        ("run", "fingerprint", "diagnose", "profile"), min_length=1)

    def overrides(self) -> dict:
        return {"batch_size": self.batch_size, "input_size": self.input_size, "steps": self.steps,
                "loss_scales": self.loss_scales, "precisions": self.precisions, "variants": self.variants}


class Matrix(_Strict):
    models: list[MatrixModel] = Field(min_length=1, max_length=MAX_MODELS)
    precisions: list[str] = Field(min_length=1)
    # as `run --repeats`: 3, the fewest that give a 95% interval (harness.stats.MIN_REPEATS); auto: until each
    # comparison with fp32 is decided
    repeats: Union[Annotated[PositiveInt, Field(le=MAX_REPEATS)], Literal["auto"]] = 3
    budget: Optional[float] = Field(None, gt=0, le=MAX_SECONDS, allow_inf_nan=False)  # seconds, for repeats: auto
    warmup: NonNegativeInt = Field(5, le=MAX_STEPS)
    steps: Optional[PositiveInt] = Field(None, le=MAX_STEPS)  # for models that give none


def load_matrix(path: str) -> Matrix:
    data = read_yaml(Path(path), HarnessError)
    try:
        matrix = Matrix.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise HarnessError(f"{path}: {where}: {err['msg']}") from None
    if matrix.budget is not None and matrix.repeats != "auto":
        raise HarnessError(f"{path}: budget: only with repeats: auto (it bounds the repeats that auto adds)")
    for name in matrix.precisions:
        parse_precision(name)
    for i, model in enumerate(matrix.models):
        for name in model.precisions or []:
            try:
                parse_precision(name)
            except HarnessError as exc:
                raise HarnessError(f"{path}: models.{i}.precisions: {exc}") from None
        for scale in model.loss_scales or []:
            try:
                parse_loss_scale(scale, parse_precision("amp_fp16"))
            except HarnessError as exc:
                raise HarnessError(f"{path}: models.{i}.loss_scales: {exc}") from None
    return matrix
