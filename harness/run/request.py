"""One run, as it crosses into a worker process and as the worker holds it once built.

A RunRequest is plain data: the plan (harness.run.plan) makes it, an executor ships it as JSON, the worker
(harness.run.worker) reads it back. A BuiltRun is what the worker made of it, the trainer built: what the function
of the run's mode (harness.run.modes.Work) reads and writes its record into."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from harness.model.spec import ModelSpec, validate

if TYPE_CHECKING:  # for annotations only
    import numpy as np

    from harness.adapter import Adapter, Device, Trainer
    from harness.model.data import Data
    from harness.model.dropout import DropoutMasks
    from harness.model.graph import Graph
    from harness.model.native import Modules
    from harness.precision import LossScale, Precision


@dataclass
class RunRequest:
    """One run, as planned (harness.run.plan): the spec travels resolved, so no process and no node reads a spec
    file after the plan did."""
    framework: str
    model: str  # the built-in name or spec path the user gave: run ids and progress lines name it
    spec: dict  # the resolved spec (harness.run.plan.resolve: overrides applied, shapes checked), as JSON data
    precision: str
    run_id: str
    repeat: int = 0
    warmup: int = 5
    loss_scale: str | None = None  # None: the precision's default
    growth_interval: int = 2000
    device: str = "auto"
    threads: int = 1
    variant: str | None = None  # one of the adapter's variants; None: its first; "auto": the fastest here
    measure_peak: bool = True  # measure (or read from the cache) the device's matmul peak for `efficiency`
    mode: str = "run"  # what the worker does: a harness.run.modes.WORKS name (run, fingerprint, diagnose, profile)
    every: int = 10  # diagnose: capture after every this many steps (and the last)
    study: str | None = None  # the id tying the runs of one study together
    nonfinite: bool = False  # diagnose --nonfinite: also locate the first step the loss scaler skipped
    force: bool = False  # run --force: past the memory guard, the worker's too
    shares_process: int | None = None  # timed runs of one cell with the same number run one after another in one
    # process (--repeats auto: harness.run.runner.UntilDecided); None: a timed run has a process of its own
    auto_round: int | None = None  # --repeats auto: the round of UntilDecided it belongs to (0: the first)

    def resolved_spec(self) -> ModelSpec:
        return validate(self.spec, self.model)


@dataclass
class BuiltRun:
    """A run whose trainer the worker has built (harness.run.worker.run), with everything that went into it: the
    request, its spec resolved, the seed of its weights, batches and masks, and the record being written."""
    request: RunRequest
    spec: ModelSpec
    graph: Graph
    precision: Precision
    loss_scale: LossScale
    seed: int
    adapter: Adapter
    device: Device
    variant: str  # the one that runs (--variant auto's choice made)
    data: Data
    masks: DropoutMasks
    buffers: tuple[tuple[np.ndarray, np.ndarray], dict[str, np.ndarray]]  # a batch and its masks, refilled by each step
    baseline_kb: int | None  # the process's peak RSS before the build (harness.run.measure.reset_peak_rss)
    trainer: Trainer | None  # None once released (a replay builds its own: fresh_trainer)
    record: dict
    progress: Callable[[int, int], None] | None = None
    #: the layers numerics and the first-inf locator name: the spec's graph, or a native model's modules
    layers: Graph | Modules | None = None

    def fresh_trainer(self) -> Trainer:
        """A trainer of this run from its initial weights (the run's own, or a replay's): the spec's network with
        the weights the run's seed draws, or a native model built again under the run's seed."""
        from harness.model.weights import initial_weights

        if self.graph is None:
            return self.adapter.build(self.spec.model_copy(update={"seed": self.seed}), None, None, self.precision,
                                      self.loss_scale, self.device, self.variant)
        return self.adapter.build(self.spec, self.graph, initial_weights(self.graph, self.seed), self.precision,
                                  self.loss_scale, self.device, self.variant)
