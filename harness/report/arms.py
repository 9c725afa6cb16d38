"""An arm: one precision's runs in a section's entry beside fp32 (the pure 16-bit and the FP8 sections), its
figures computed from the records as numbers (None: no ok run gave one) and judged against the entry's fp32 runs by
the report's one accuracy rule (harness.report.accuracy.compare). Each section shows the figures it needs and words
them its own way; what an arm is and how its figures are computed is said once, here.

    arm = Arm("bf16_sr", records, fp32_ok, classes, metric)
    arm.figure, arm.seeds, arm.check          # judged by the entry's metric (accuracy, a next-token model's loss)
    arm.loss, arm.loss_check, arm.accuracy   # the FP8 section shows both, its loss judged as a loss
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from typing import Callable

from harness import stats
from harness.identity import arms_by_setting
from harness.precision import PRECISIONS
from harness.records import RunRecord
from harness.report import accuracy
from harness.report.accuracy import Check, Metric
from harness.run import nonfinite

NATIVE = "native"  # how options["fp8"]["matmuls"] starts for real FP8 kernels ("native (torch._scaled_mm)")
UNRECORDED = "emulated (not recorded: a run from before options[\"fp8\"])"
UNRECORDED_BLOCKS = "emulated (not recorded in options[\"blocks\"])"


def base_precision(precision: str) -> str:
    """The registry name an arm's name starts with: "fp8_e4m3:current (loss scale fixed 16)" is an fp8_e4m3 arm,
    "fixed16_sr:12" a fixed16_sr one."""
    return precision.partition(":")[0].partition(" ")[0]


def is_fp8(precision: str) -> bool:
    """An FP8 precision by its registry entry (harness.precision): fp8_hybrid, fp8_hybrid:delayed:16, ...:native,
    and an arm's name with its loss scale ("fp8_e4m3 (loss scale fixed 16)")."""
    found = PRECISIONS.get(base_precision(precision))
    return found is not None and found.fp8 is not None


def is_blocks(precision: str) -> bool:
    """A block-scaled precision by its registry entry (harness.precision: Precision.blocks): mxfp8, nvfp4:rht, ..."""
    found = PRECISIONS.get(base_precision(precision))
    return found is not None and found.blocks is not None


def is_scaled(precision: str) -> bool:
    """FP8 or block-scaled: a precision whose matmuls take scaled low-precision operands, emulated or native."""
    return is_fp8(precision) or is_blocks(precision)


def matmuls(r: RunRecord) -> str:
    """How an FP8 or block-scaled run's matmuls ran, as its record says."""
    if is_blocks(r.precision):
        return r.block_matmuls or UNRECORDED_BLOCKS
    return r.fp8_matmuls or UNRECORDED


def emulated(records: list[RunRecord]) -> bool:
    """Runs of an FP8 or block-scaled precision whose matmuls were not all native: their step times measure the
    emulation."""
    return bool(records) and is_scaled(records[0].precision) and \
        not all(matmuls(r).startswith(NATIVE) for r in records)


def failure(r: RunRecord) -> str:
    """A run that did not end ok, and where its first non-finite value came from when the record says."""
    located = f"; {nonfinite.describe(r.nonfinite.written)}" if r.nonfinite else ""
    return f"{r.status}: {r.reason}{located}"


def process_ms(records: list[RunRecord]) -> list[float]:
    """One step time per process, its repeats' median steps pooled (as verdicts.PooledRuns': processes are the
    independent samples, stats.per_process)."""
    timed = [r for r in records if r.step_times_ms]
    return stats.per_process([float(np.median(r.step_times_ms)) for r in timed], [r.process for r in timed])


def by_setting(records: list[RunRecord], keep: Callable[[RunRecord], bool]) -> dict[tuple, dict[str, list[RunRecord]]]:
    """The runs `keep` accepts, per (model, framework, Setting), by arm (harness.identity.arms_by_setting, which
    reads them as written)."""
    found = {id(r.written): r for r in records}
    return {key: {name: [found[id(w)] for w in rs] for name, rs in named.items()}
            for key, named in arms_by_setting([r.written for r in records], lambda w: keep(found[id(w)])).items()}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Scaler:
    """A dynamically scaled arm's loss scale over its runs: the scales they ended at, the steps they skipped."""
    final: list[float]
    skipped: list[int]


@dataclass(frozen=True)
class Arm:
    """One precision's runs in an entry (its name with a loss-scale suffix where the entry ran it under several),
    with fp32's ok runs of the same entry; its figures are computed once, when first read."""
    precision: str
    records: tuple[RunRecord, ...]  # every run of it, ok or not
    fp32: tuple[RunRecord, ...]  # the entry's ok fp32 runs, what it is judged against
    classes: int | None  # the model's class count (a next-token model's: its vocabulary), for chance level
    metric: Metric  # what the entry is judged by (accuracy.metric)

    @property
    def runs(self) -> int:
        return len(self.records)

    @cached_property
    def ok(self) -> list[RunRecord]:
        return [r for r in self.records if r.status == "ok"]

    @cached_property
    def failed(self) -> tuple[str, ...]:
        return tuple(failure(r) for r in self.records if r.status != "ok")

    @property
    def compared(self) -> bool:
        """Judged against fp32: not fp32's own arm, and fp32 has an ok run."""
        return self.precision != "fp32" and bool(self.fp32)

    # ---- judged figures: means over seeds (accuracy.over_seeds), and their range over two seeds or more
    @cached_property
    def _figure(self) -> tuple[float | None, tuple[float, float] | None]:
        return accuracy.over_seeds(self.ok, self.metric)

    @property
    def figure(self) -> float | None:
        """What the entry is judged by (eval accuracy, or a next-token model's eval loss), mean over seeds."""
        return self._figure[0]

    @property
    def seeds(self) -> tuple[float, float] | None:
        return self._figure[1]

    @cached_property
    def check(self) -> Check | None:
        """The judged figure against fp32, paired by seed (None: fp32's own arm, or no fp32 run to judge by)."""
        return accuracy.compare(self.ok, list(self.fp32), self.classes) if self.compared else None

    @cached_property
    def _loss(self) -> tuple[float | None, tuple[float, float] | None]:
        return accuracy.over_seeds(self.ok, accuracy.TOKEN_LOSS)

    @property
    def loss(self) -> float | None:
        """Eval loss, mean over seeds."""
        return self._loss[0]

    @property
    def loss_seeds(self) -> tuple[float, float] | None:
        return self._loss[1]

    @cached_property
    def loss_check(self) -> Check | None:
        """Eval loss against fp32, paired by seed: a classifier's eval loss is a cross-entropy in nats too, its
        chance level ln(classes), judged as accuracy.TokenLoss judges a next-token model's."""
        return accuracy.compare(self.ok, list(self.fp32), self.classes, accuracy.TOKEN_LOSS) if self.compared \
            else None

    @cached_property
    def _accuracy(self) -> tuple[float | None, tuple[float, float] | None]:
        return accuracy.over_seeds(self.ok, accuracy.ACCURACY)

    @property
    def accuracy(self) -> float | None:
        """Eval accuracy, mean over seeds."""
        return self._accuracy[0]

    @property
    def accuracy_seeds(self) -> tuple[float, float] | None:
        return self._accuracy[1]

    @property
    def accuracy_check(self) -> Check | None:
        """A classifier's accuracy against fp32, as the Accuracy section judges it (a next-token model's: None)."""
        return self.check if self.metric is accuracy.ACCURACY else None

    # ---- what its runs did besides
    @cached_property
    def scaler(self) -> Scaler | None:
        scales = [r.loss_scale for r in self.records if r.loss_scale and r.loss_scale.final is not None]
        if not scales:
            return None
        return Scaler(sorted({ls.final for ls in scales}), [ls.skipped_steps or 0 for ls in scales])

    @property
    def final_loss(self) -> float | None:
        """Final training loss, mean over its ok runs."""
        return _mean(r.final_train_loss for r in self.ok)

    @property
    def weights_mb(self) -> float | None:
        """What keeps the weights: Kahan's compensation buffer counts with them."""
        state = (self.ok or self.records)[0].state_memory_mb
        if state is None or state.weights is None:
            return None
        return state.weights + (state.compensation or 0.0)

    @property
    def peak_mb(self) -> float | None:
        return _mean(r.peak_memory_mb for r in self.ok)

    @cached_property
    def curve(self) -> list[float | None]:
        """The mean training loss per step over its ok runs, as long as the shortest."""
        curves = [r.loss for r in self.ok if r.loss]
        length = min((len(c) for c in curves), default=0)
        return [_mean([c[i] for c in curves]) for i in range(length)]

    # ---- FP8 and block-scaled formats
    @property
    def fp8(self) -> bool:
        return is_fp8(self.precision)

    @property
    def blocks(self) -> bool:
        return is_blocks(self.precision)

    @cached_property
    def matmuls(self) -> tuple[str, ...]:
        """An FP8 or block-scaled arm's: how its matmuls ran, as its records say."""
        return tuple(sorted({matmuls(r) for r in self.ok or self.records})) if self.fp8 or self.blocks else ()

    @property
    def native(self) -> bool:
        """Every run of it said its FP8 matmuls ran natively; an emulated or unrecorded one makes it emulated."""
        return bool(self.matmuls) and all(m.startswith(NATIVE) for m in self.matmuls)

    @cached_property
    def speed(self) -> stats.Ratio | None:
        """fp32's step time over this arm's: natively run FP8 or block formats only (emulated ones' step times
        measure the emulation)."""
        if self.native and process_ms(self.ok) and process_ms(list(self.fp32)):
            return stats.ratio(process_ms(list(self.fp32)), process_ms(self.ok))
        return None
