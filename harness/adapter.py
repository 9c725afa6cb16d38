"""The adapter plugin API: how a framework plugs into amp-harness.

An adapter is a class registered under the entry-point group ``amp_harness.adapters``; the built-in adapters
(``adapters/*``) load exactly as a third-party one does. In the plugin's pyproject.toml::

    [project.entry-points."amp_harness.adapters"]
    myframework = "amp_harness_myframework.adapter:MyFrameworkAdapter"

Rules:
- Importing the adapter module must not import the framework: import it inside methods. The core lists
  adapters without loading any framework, and runs each (framework, precision) in its own process.
- ``build`` loads the core's canonical weights (``harness.model.weights``) and reproduces the spec's math exactly
  (see ``harness.model.spec``): never use the framework's own initialisers or a loss/optimizer whose math differs.
- A precision the framework or device cannot run is reported by ``unsupported`` with a one-line reason where the
  adapter knows it without running anything; every other precision is proved on the device by the core's probe
  (``harness.run.capability``: one step of a small network through dense, conv, pooling and norm kernels, cached
  per machine), whose framework errors make it unsupported too (``explain_probe_failure`` may say what they
  mean). The core records an ``unsupported`` result instead of running it.
- ``Trainer.train_step`` returns the loss as a float *after the device has finished the step* (synchronise:
  the core reads the clock right after it returns).
- The core owns every rule that is not framework-specific, and adapters use it rather than restate it:
  padding and pooling geometry (``harness.model.graph.window_padding``, ``avgpool_divisors``), the precision
  policy (``Precision.compute_dtype`` / ``param_dtype``), the loss-scale rules (``harness.precision.LossScaler``;
  a framework's own scaler is checked against them after every step) and dropout masks
  (``harness.model.dropout``: applied as given, ``x * mask / (1 - rate)``, never drawn by the framework).
- A float64 (``fp64``) run computes entirely in float64, constants and hyper-parameters included: the parity
  check holds float64 fingerprints to 1e-9.
- ``build`` creates every piece of optimizer state (Adam's moments, momentum buffers) before it returns: no
  timed step allocates state lazily, and the memory figure holds the same things in every framework.
- Nothing but the step runs in ``train_step``: conversions belong in ``to_device``, bookkeeping in
  ``after_step``, imports in ``build``.
- A precision with a ``rounding`` (``bf16_sr``, ``fp16_sr``, ``bf16_kahan``, ``fixed16_sr``, ``fixed16_rn``)
  computes the optimizer's update in float32 and writes the weights by the core's rule (``harness.rounding``),
  drawing stochastic rounding's bits on the device in timed runs and taking the core's bits in fingerprint runs
  (``Trainer.set_rounding_noise``); ``Adapter.write_weights`` exposes the same rounding code to the kit's
  statistical test. A framework that cannot bit-cast reports these precisions ``unsupported``.
- ``Trainer.profile`` (optional) runs the core's steps under the framework's own profiler and returns every op that
  ran (``OpTime``), with the scopes it ran in. The network names a scope per layer with ``layer_scope(path)``
  (torch ``record_function``, ``tf.name_scope``, ...) and wraps the loss, the optimizer's update and the loss
  scaler's work in ``LOSS_SCOPE``, ``UPDATE_SCOPE`` and ``LOSS_SCALE_SCOPE``; a backward op carries the scope of
  the forward op it differentiates; the runtime's own per-step work, where the profiler times it, is in
  ``RUNTIME_SCOPE``. The core (``harness.run.profile``) maps scopes to layers, never the adapter.
- ``variants`` names the framework's own idioms for running a step (eager or compiled, memory layouts...);
  ``build`` gets one of them, and the record keeps it. The first is the default.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable

import numpy as np

from harness.errors import HarnessError
from harness.model.graph import Graph
from harness.model.spec import ModelSpec
from harness.precision import LossScale, Precision

ENTRY_POINT_GROUP = "amp_harness.adapters"
BLOCK_ENV = "AMP_HARNESS_BLOCK_ADAPTERS"  # comma-separated adapter names to ignore


@dataclass(frozen=True)
class Device:
    name: str  # "cpu", "cuda:0"
    kind: str  # "cpu" or "gpu"
    description: str  # "NVIDIA H200", or the CPU model
    details: dict = field(default_factory=dict)  # CUDA version, driver, compute capability, ...


@dataclass(frozen=True)
class LossScaleState:
    scale: float  # the scale that will be applied to the next step
    skipped: bool  # the step just taken was skipped (gradients overflowed)


LOSS_SCOPE = "part.loss"  # the loss (and its gradient) in a profile
UPDATE_SCOPE = "part.update"  # the optimizer's update of the weights
LOSS_SCALE_SCOPE = "part.loss_scale"  # scaling the loss, unscaling and checking gradients, updating the scale
STEP_SCOPE = "amp-harness.step"  # one whole training step, where a profiler needs the steps' bounds (MXNet's)
RUNTIME_SCOPE = "part.runtime"  # the framework's per-step dispatch outside every op (launching a compiled step,
# handing back its outputs), where its profiler measures it


def layer_scope(path: str) -> str:
    """The scope name a network gives the layer at canonical path `path` ("3", "5.layers.0") in a profile: valid
    as a TensorFlow name scope, a torch record_function and an MXNet profiler name."""
    return f"layer.{path}"


@dataclass(frozen=True)
class OpTime:
    """One op of a profile as the framework's profiler saw it, summed over the profiled steps."""

    op: str  # the framework's name for it: "aten::convolution", "Conv2DBackpropFilter", "_backward_Convolution"
    scope: str  # the scopes it ran in, outermost first, joined by "/" (layer_scope, LOSS_SCOPE...; "" for none)
    seconds: float  # self time (time in ops it called excluded), summed over the profiled steps
    backward: bool = False  # computed for the backward pass (scope: the forward op's)
    cast: bool = False  # a dtype conversion (autocast's, a Keras policy's, MXNet AMP's amp_cast)
    calls: int = 1
    inputs: tuple[str, ...] = ()  # its floating-point inputs' dtypes as it ran: "float32", "float16", "bfloat16"
    outputs: tuple[str, ...] = ()  # its floating-point outputs' dtypes, where the profiler knows them


@dataclass(frozen=True)
class ProfiledOps:
    tool: str  # what measured, e.g. "torch.profiler (torch 2.13.0, CPU activities)"
    ops: list[OpTime]
    note: str = ""  # how this framework's profile differs from its timed runs, if it does


class Trainer(ABC):
    """One network, built for one precision on one device."""

    #: settings that change what is measured (memory format, compilation, TF32...), recorded in the result
    options: dict[str, Any]

    @abstractmethod
    def to_device(self, x: np.ndarray, y: np.ndarray, masks: dict[str, np.ndarray]) -> Any:
        """Convert a numpy batch for train_step: inputs, labels and the step's dropout masks by layer path
        (float32 0/1 in the canonical layout of each dropout layer's output; {} without dropout). The core
        keeps this out of the timed region."""

    @abstractmethod
    def train_step(self, batch: Any) -> float:
        """One optimizer step; return the (unscaled, float32) loss once the device has finished."""

    def loss_scale_state(self) -> LossScaleState | None:
        """After a step: the loss scaler's state, or None when the run uses no loss scaling."""
        return None

    @abstractmethod
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Inference-mode outputs (batchnorm running statistics, no dropout) as numpy: float32, or float64 in a
        float64 run (the parity check compares float64 fingerprints at 1e-10)."""

    @abstractmethod
    def get_weights(self) -> dict[str, np.ndarray]:
        """Current weights in the core's canonical names and layouts, as numpy: float32, or float64 in a
        float64 run."""

    @abstractmethod
    def param_count(self) -> int:
        """Trainable parameters as the framework itself counts them (checked against the spec's count)."""

    def captured_step(self, batch: Any) -> tuple[float, dict[str, np.ndarray]] | None:
        """Diagnose mode only (optional): one train_step that also returns the weight gradients it applied,
        unscaled and before the update, by canonical weight name in canonical layouts (trainable weights only).
        None: this adapter cannot capture (the report then says "not available")."""
        return None

    def layer_outputs(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
        """Diagnose mode only (optional): on this batch, in inference mode and changing no state, each layer's
        output and the gradient of the loss with respect to it, by canonical layer path, in canonical layouts
        (NHWC). None: this adapter cannot capture."""
        return None

    def set_rounding_noise(self, bits: dict[str, np.ndarray]) -> None:
        """Fingerprint runs of a stochastically rounding precision only: the core's random bits (int32 0..2^16-1
        per trainable weight, canonical names and layouts, harness.rounding.RoundingNoise) that the next
        train_step must round with instead of drawing its own. Called outside the timed region."""
        raise HarnessError(f"{type(self).__name__} cannot take the core's rounding noise (set_rounding_noise): "
                           f"stochastically rounded fingerprints would differ between frameworks")

    def profile(self, run_steps: Callable[[], None]) -> ProfiledOps | None:
        """Profile mode only (optional): start the framework's own profiler, call run_steps() (the core's loop
        of train_steps on batches already on the device), stop the profiler and return every op that ran in
        between. None: this adapter cannot profile (the record says "not available")."""
        return None

    def after_step(self) -> None:
        """Called after every step, outside the timed region (MXNet samples GPU memory here: it has no peak
        counter)."""

    def memory_peak_mb(self) -> tuple[float, str] | None:
        """(peak MB the device allocator held above its level when build() began, what kind of figure); None
        on a CPU, where the core measures the process's resident memory the same way for every framework."""
        return None


class Adapter(ABC):
    name: str  # the --framework name
    #: the framework's idioms for running a training step (name -> what it is), swept by `run --variant`;
    #: the first is the default
    variants: dict[str, str] = {"default": "the adapter's one way to run a step"}

    @abstractmethod
    def framework_version(self) -> str: ...

    @abstractmethod
    def device(self, requested: str) -> Device:
        """Resolve "auto", "cpu" or "gpu" to a device this framework can use here."""

    def unsupported(self, precision: Precision, device: Device) -> str | None:
        """A one-line reason why this precision cannot run on this device, or None. The default knows the
        limits that hold for every framework (device_limits); override to add the framework's own."""
        if precision.rounding is not None and type(self).write_weights is Adapter.write_weights:
            # an adapter that knows nothing of harness.rounding would train these as plain bf16/fp16/fp32
            return (f"{precision.name} writes weights by harness.rounding ({precision.rounding.describe()}), which "
                    f"this adapter does not implement")
        return device_limits(precision, device)

    def explain_probe_failure(self, precision: Precision, device: Device, error: str) -> str | None:
        """Optional: what the framework's error (one line) from the capability probe's step means on this device
        ("oneDNN has no bfloat16 primitives for this CPU"), or None. The core adds the CPU's flags and the error."""
        return None

    def free_memory_mb(self, device: Device) -> float | None:
        """MiB the framework can still allocate on `device` (a GPU) now, other processes' use counted: the
        worker's memory guard holds a run's estimate to it before building the network. None where the
        framework cannot tell (the guard before the runs asked nvidia-smi)."""
        return None

    @abstractmethod
    def set_threads(self, threads: int) -> None:
        """Set intra-op threads before any op runs."""

    @abstractmethod
    def build(self, spec: ModelSpec, graph: Graph, weights: dict[str, np.ndarray], precision: Precision,
              loss_scale: LossScale, device: Device, variant: str) -> Trainer: ...

    def write_weights(self, precision: Precision, x: np.ndarray, bits: np.ndarray | None,
                      device: Device) -> np.ndarray | None:
        """The rounding self-test (the conformance kit's): float32 values `x` written to a rounding precision's
        weight format (nearest or stochastic, harness.rounding) by the code the adapter's optimizer runs, with
        the given bits (int32 0..2^16-1, x's shape) or, when `bits` is None, bits the adapter draws on the device
        as a timed run does (seeded by harness.rounding.device_seed: each call draws afresh); returned as float32
        numpy. None: the adapter has no rounding precisions."""
        return None

    def matmul(self, n: int, dtype: str, device: Device) -> Callable[[], None] | None:
        """A function that multiplies two n x n matrices of `dtype` on `device` and waits for the result: the
        core times it to know the device's peak (harness.run.peak). None where the framework cannot."""
        return None


def device_limits(precision: Precision, device: Device) -> str | None:
    """Reasons that hold whatever the framework: GPU-only math modes on a CPU, and the compute capability a
    dtype's tensor cores need (from device.details["compute_capability"], when the adapter knows it)."""
    if device.kind == "cpu":
        if precision.gpu_only:
            return f"{precision.name} is a GPU math mode (TensorFloat-32 tensor cores); this device is a CPU"
        return None
    cc = device.details.get("compute_capability")
    if not cc:
        return None
    major = int(str(cc).split(".")[0])
    if major < 8 and (precision.tf32 or "bfloat16" in (precision.compute_dtype, precision.param_dtype)):
        what = "TF32" if precision.tf32 else "bfloat16"
        return f"{what} needs compute capability 8.0 (Ampere) or newer; {device.description} has {cc}"
    return None


def discover() -> dict[str, EntryPoint]:
    """Installed adapters by name, without importing them."""
    blocked = {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in blocked:
            continue
        if ep.name in found and found[ep.name].value != ep.value:
            raise HarnessError(f"two adapters are registered as '{ep.name}': {found[ep.name].value} and {ep.value}")
        found[ep.name] = ep
    return found


def load_adapter(name: str) -> Adapter:
    found = discover()
    if name not in found:
        have = ", ".join(sorted(found)) or "none"
        raise HarnessError(f"no adapter for framework '{name}' is installed (installed: {have}); "
                           f"install adapters/{name} (pip install -e adapters/{name}) or use its tox env")
    try:
        cls = found[name].load()
    except ImportError as exc:
        raise HarnessError(f"adapter '{name}' ({found[name].value}) cannot be imported: {exc}") from None
    adapter = cls()
    if not isinstance(adapter, Adapter):
        raise HarnessError(f"adapter '{name}' ({found[name].value}) is not a harness.adapter.Adapter")
    return adapter
