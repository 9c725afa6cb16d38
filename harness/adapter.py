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
  (``harness.model.dropout``: applied as given, ``x * mask / (1 - rate)``, never drawn by the framework) and the
  optimizer's rules (``harness.model.optimizer``: the step's scheduled rate from ``Trainer.learning_rate``,
  AdamW's decay per weight; clipping of the unscaled gradients after the scaler's finite check, as the spec's
  docstring says).
- A float64 (``fp64``) run computes entirely in float64, constants and hyper-parameters included: the parity
  check holds float64 fingerprints to 1e-9.
- The build creates every piece of optimizer state (Adam's moments, momentum buffers) before it returns: no
  timed step allocates state lazily, and the memory figure holds the same things in every framework.
- Nothing but the step runs in ``train_step``: conversions belong in ``to_device``, bookkeeping in
  ``after_step``, imports in ``build``.
- A precision with a ``rounding`` (``bf16_sr``, ``fp16_sr``, ``bf16_kahan``, ``fixed16_sr``, ``fixed16_rn``)
  computes the optimizer's update in float32 and writes the weights by the core's rule (``harness.rounding``:
  ``rounded_update`` in the trainer's ``build_rounded_optimizer``),
  drawing stochastic rounding's bits on the device in timed runs and taking the core's bits in fingerprint runs
  (``Trainer.set_rounding_noise``). The rules are written once in the core against a table of the framework's
  primitives, which the adapter supplies (``Adapter.rounding_ops``, a ``harness.rounding.RoundingOps``); the
  core's ``Adapter.write_weights`` runs the same rules on them for the kit's statistical test. An adapter
  without the table, or a framework that cannot bit-cast (``Capabilities.no_bitcast``), has these precisions
  ``unsupported`` with the core's reason.
- What an adapter cannot do is data (``Adapter.capabilities``), and the core words the reasons; a loss-scale setting
  the framework's own scaler cannot follow too (``Capabilities.dynamic_scale_factors``,
  ``dynamic_scale_needs_mixed``; ``Adapter.unsupported_loss_scale``): never raise from a build hook for it.
- What a causal attention's mask leaves in the scores it masks is data too: the network module's
  ``attention_mask(info, precision, device_kind)`` returns a ``harness.numerics.AttentionMask`` (the value, the
  dtype the masked scores are in, the softmax's dtype and rule), or None where it is not known on that kind of
  device, and the trainer's ``attention_mask`` hook returns it; diagnose records the table and the core says what
  a fully masked row gives.
- The core's ``Trainer`` is the build sequence's template (``Trainer.__init__``): the framework's switches, the
  memory baseline, the network, the attention masks' table, the rounding and FP8 policy, the plain or rounded
  optimizer, the schedule, the loss scale, the step and the options every record carries, in that order; the
  adapter's trainer supplies the hooks it calls (``configure``, ``build_network``, ``attention_mask``,
  ``build_optimizer``, ``build_rounded_optimizer``, ``build_step``, ``framework_options``). It also does the
  bookkeeping every framework shares: the memory peak (the adapter supplies ``_memory_in_use`` /
  ``_memory_peak``), the loss-scale state (``loss_scale_state`` from the adapter's ``_loss_scale_now``) and
  outputs as float32 unless float64 (``output``, from the adapter's ``_numpy``).
- The losses and global-norm clipping are written once too (``harness.model.training``, against the adapter's
  ``LossOps`` and ``ClipOps``), as the rounded update is (``harness.rounding.rounded_update``).
- ``Trainer.profile`` (optional) runs the core's steps under the framework's own profiler and returns every op that
  ran (``OpTime``), with the scopes it ran in. The network names a scope per layer with ``layer_scope(path)``
  (torch ``record_function``, ``tf.name_scope``, ...) and wraps the loss, the optimizer's update and the loss
  scaler's work in ``LOSS_SCOPE``, ``UPDATE_SCOPE`` and ``LOSS_SCALE_SCOPE``; a backward op carries the scope of
  the forward op it differentiates; the runtime's own per-step work, where the profiler times it, is in
  ``RUNTIME_SCOPE``. The core (``harness.run.profile``) maps scopes to layers, never the adapter.
- ``variants`` names the framework's own idioms for running a step (eager or compiled, memory layouts...);
  ``build`` gets one of them, and the record keeps it. The first is the default.
- ``import_model`` (optional) turns a model written in the framework into a spec (``amp-harness import NAME
  TARGET --input-shape ...``, docs/import.md), for frameworks whose models can only be read by running the
  framework (a PyTorch module is Python code). It returns a ``harness.model.importers.Imported`` and reuses that
  package's pieces (defaults, the residual chain walk, the final check); everything the spec cannot express is
  an ``ImportProblems``, one line per problem naming the framework's layer and field. The default has none.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from harness.errors import HarnessError
from harness.model.graph import Graph
from harness.model.optimizer import learning_rate
from harness.model.spec import ModelSpec
from harness.precision import LossScale, Precision
from harness.rounding import RoundingOps, device_seed, round_nearest_with, round_stochastic_with

if TYPE_CHECKING:
    from harness.model.importers import ImportOptions, Imported

ENTRY_POINT_GROUP = "amp_harness.adapters"
BLOCK_ENV = "AMP_HARNESS_BLOCK_ADAPTERS"  # comma-separated adapter names to ignore


@dataclass(frozen=True)
class Device:
    name: str  # "cpu", "cuda:0"
    kind: str  # "cpu" or "gpu"
    description: str  # "NVIDIA H200", or the CPU model
    details: dict = field(default_factory=dict)  # CUDA version, driver, compute capability, ...

    @staticmethod
    def cpu() -> "Device":
        """This machine's CPU (its model, from /proc/cpuinfo), for an adapter's device() without a GPU."""
        from harness.run.measure import cpu_info

        return Device("cpu", "cpu", cpu_info()[0])


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
PART_SCOPES = frozenset({LOSS_SCOPE, UPDATE_SCOPE, LOSS_SCALE_SCOPE, RUNTIME_SCOPE})  # a step's parts, not its layers


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


def as_output(value: np.ndarray) -> np.ndarray:
    """A numpy copy in the core's output dtype: float64 in a float64 run, float32 for every other dtype. A copy,
    never a view of a framework's buffer (which a later step may reuse or donate)."""
    value = np.asarray(value)
    return np.array(value, dtype=np.float64 if value.dtype == np.float64 else np.float32, copy=True)


@dataclass
class NativeFp8:
    """What an FP8 precision made of a native model's matmul modules, by their own names: the adapter fills it when
    it converts them, and `ran` in the first training step, since a converted module whose weights other code
    multiplies (nn.MultiheadAttention's out_proj) computes nothing in FP8."""
    converted: dict[str, str]  # module -> its class: its forward now casts its matmul's operands
    not_converted: dict[str, str]  # module -> "Class: why" (a matmul's weights the adapter cannot convert)
    ran: set[str] = field(default_factory=set)  # the converted modules whose forward ran in the first step
    counted: bool = False  # the first training step has run (until then, which forwards run is not known)

    def summary(self) -> dict[str, Any]:
        """The record's options.native.fp8: {converted: how many modules computed in FP8, not_converted: each
        other matmul module, "name (Class: why)"}."""
        never = {name: f"{kind}: converted, but its forward never ran in the first training step: other code "
                       f"multiplies its weights" for name, kind in self.converted.items()
                 if self.counted and name not in self.ran}
        missed = {**self.not_converted, **never}
        return {"converted": len(self.converted) - len(never),
                "not_converted": [f"{name} ({missed[name]})" for name in sorted(missed)]}


@dataclass(frozen=True)
class NativeInfo:
    """A native model (a spec's `native:`, the user's own network object) as its adapter built it."""
    trainable: int  # trainable parameters
    weights: int  # every weight the model keeps (buffers included)
    modules: dict[str, str]  # its modules (layers) by their own names, which numerics name them by: their classes
    digest: str  # of its initial weights (harness.run.native.weights_digest): equal in every precision
    fp8: NativeFp8 | None = None  # an FP8 precision's conversion of its matmul modules


class Trainer(ABC):
    """One network, built for one precision on one device.

    The build sequence every framework shares is here, written once (``__init__``, the template): the adapter's
    trainer supplies the hooks it calls (``configure``, ``build_network``, ``attention_mask``, ``build_optimizer``,
    ``build_rounded_optimizer``, ``build_step``, ``framework_options``) and the primitives the core's bookkeeping
    reads (``_memory_in_use``, ``_loss_scale_now``, ``_numpy``...); no adapter writes the sequence, so none can
    skip a step of it."""

    #: settings that change what is measured (memory format, compilation, TF32...), recorded in the result
    options: dict[str, Any]
    #: what memory_peak_mb's figure is on a GPU ("torch CUDA allocator peak above ..."), by the adapter
    memory_kind: str = ""
    #: the allocator has a peak counter (_memory_peak); False: the core samples _memory_in_use after each step
    memory_peak_counter: bool = True
    loss_scale: LossScale | None = None  # the run's settings (start_loss_scale)
    optimizer_spec = None  # the spec's optimizer (start_optimizer)
    schedule_steps: int = 0  # the spec's steps, which a schedule spans (start_optimizer)
    steps_taken: int = 0  # train_step and captured_step calls so far: the schedule's step index
    rounding = None  # the precision's harness.rounding.Rounding, or None (start_rounding)
    rounding_seed: int | None = None  # the seed of the on-device rounding noise (start_rounding)
    #: per causal attention layer and 16-bit precision, what its mask leaves in the masked scores
    #: (harness.numerics.mask_table, set by declare_attention_masks); None: not declared
    attention_masks: dict[str, dict[str, dict[str, str]]] | None = None
    _memory_start: int | None = None  # bytes in use when the build began (a GPU only)
    _memory_sampled: int = 0

    # -- the build sequence (the template) -----------------------------------------------------------------
    def __init__(self, spec: ModelSpec, graph: Graph, weights: dict[str, np.ndarray], precision: Precision,
                 loss_scale: LossScale, device: Device, variant: str):
        """Build the network for one run, in the order every adapter follows: the framework's process-wide
        switches, the memory baseline, the rounding (and FP8 and block-scaled) policy, the network, its attention
        masks' table, the spec's optimizer (plain, or computing its update in float32 and writing the weights by the
        rounding's rule) with all its state, the schedule, the loss scale, the step, and the options every
        record carries."""
        self.spec = spec
        self.configure(spec, precision, device, variant)
        self.start_memory(device.kind == "gpu")
        self.start_rounding(precision)
        self.build_network(spec, graph, weights, precision, device, variant)
        if graph is not None:  # a native model's attention is its own
            self.declare_attention_masks(graph, self.attention_mask, device.kind)
        if self.rounding is None:
            self.build_optimizer(spec.optimizer)
        else:
            self.build_rounded_optimizer(spec.optimizer)
        self.start_optimizer(spec)
        self.start_loss_scale(loss_scale)
        self.build_step(spec, precision, loss_scale, variant)
        self.options = {**self.framework_options(precision, variant), **self.rounding_options()}

    # -- the adapter's hooks for it --------------------------------------------------------------------------
    def configure(self, spec: ModelSpec, precision: Precision, device: Device, variant: str) -> None:
        """First: the framework's process-wide switches for this precision (TF32, a dtype policy, float64, the
        seed) and its handle on `device`, before anything is allocated there."""

    @abstractmethod
    def build_network(self, spec: ModelSpec, graph: Graph, weights: dict[str, np.ndarray], precision: Precision,
                      device: Device, variant: str) -> None:
        """The network, holding the core's `weights` in the precision's dtypes on the device."""

    #: the adapter's network module (an import path), whose attention_mask(info, precision, device_kind) says what
    #: a causal attention layer's mask leaves in the scores it masks; None: not declared
    network_module: str | None = None

    def attention_mask(self, info, precision: Precision, device_kind: str):
        """What a causal attention layer's mask leaves in the scores it masks (the network module's
        attention_mask: a harness.numerics.AttentionMask, or None where it is not known on that kind of device);
        declare_attention_masks asks it for every causal layer and 16-bit precision. None: not declared."""
        if self.network_module is None:
            return None
        return import_module(self.network_module).attention_mask(info, precision, device_kind)

    @abstractmethod
    def build_optimizer(self, optimizer) -> None:
        """The spec's optimizer (`optimizer`, the spec's section) over the trainable weights, all its state created
        now."""

    def build_rounded_optimizer(self, optimizer) -> None:
        """A precision with a rounding (self.rounding, self.rounding_seed): the spec's optimizer computing its
        update in float32 and writing the weights by the core's rule (harness.rounding), all its state created now.
        Only adapters with rounding ops (Adapter.rounding_ops) are given these precisions."""
        raise HarnessError(f"{type(self).__name__} has no rounded optimizer (build_rounded_optimizer)")

    @abstractmethod
    def build_step(self, spec: ModelSpec, precision: Precision, loss_scale: LossScale, variant: str) -> None:
        """Last: the framework's loss scaler (or the core's rules, harness.precision.LossScaler) and the training
        step, compiled where the variant compiles it."""

    @abstractmethod
    def framework_options(self, precision: Precision, variant: str) -> dict[str, Any]:
        """The settings that change what is measured (memory format, compilation, TF32, the loss scaler...), for
        the record's `options`; the core adds the rounding's and FP8's."""

    # -- the core's bookkeeping, written once --------------------------------------------------------------
    def start_memory(self, on_gpu: bool) -> None:
        """The memory baseline, before anything of the network is allocated: on a GPU, the allocator's peak is reset
        and its use now is the level the peak is measured above (on a CPU the core measures resident memory
        itself)."""
        if on_gpu:
            self._reset_memory_peak()
            self._memory_start = self._memory_sampled = self._memory_in_use()

    def memory_peak_mb(self) -> tuple[float, str] | None:
        """(peak MB the device allocator held above its level when build() began, what kind of figure); None
        on a CPU, where the core measures the process's resident memory the same way for every framework."""
        if self._memory_start is None:
            return None
        peak = self._memory_peak() if self.memory_peak_counter else self._memory_sampled
        return (peak - self._memory_start) / 2**20, self.memory_kind

    def after_step(self) -> None:
        """Called after every step, outside the timed region: without a peak counter the core samples the
        device's memory in use here."""
        if self._memory_start is not None and not self.memory_peak_counter:
            self._memory_sampled = max(self._memory_sampled, self._memory_in_use())

    def start_loss_scale(self, loss_scale: LossScale) -> None:
        self.loss_scale = loss_scale

    def start_optimizer(self, spec: ModelSpec) -> None:
        """Before the first step: the optimizer whose schedule learning_rate follows."""
        self.optimizer_spec, self.schedule_steps = spec.optimizer, spec.steps

    def learning_rate(self) -> float:
        """The learning rate of the step about to run (the spec's schedule, harness.model.optimizer)."""
        return learning_rate(self.optimizer_spec, self.steps_taken, self.schedule_steps)

    def loss_scale_state(self) -> LossScaleState | None:
        """After a step: the loss scaler's state, or None when the run uses no loss scaling."""
        if self.loss_scale is None or self.loss_scale.mode == "none":
            return None
        return LossScaleState(*self._loss_scale_now())

    def start_rounding(self, precision: Precision) -> None:
        """Before the network is built: the precision's rounding and, with one (or a block-scaled recipe's
        stochastically rounded gradients), the seed of the on-device noise (fresh per process,
        harness.rounding.device_seed)."""
        self.rounding = precision.rounding
        stochastic = precision.blocks is not None and precision.blocks.stochastic
        self.rounding_seed = device_seed() if self.rounding is not None or stochastic else None
        self.fp8 = precision.fp8
        self.blocks = precision.blocks

    def declare_attention_masks(self, graph: Graph, declare: Callable, device_kind: str) -> None:
        """In build: `declare(info, precision, device_kind)`, the network module's attention_mask, asked for every
        causal attention layer in every 16-bit precision on this kind of device ("cpu", "gpu";
        harness.numerics.mask_table); diagnose records the table."""
        from harness.numerics import mask_table

        self.attention_masks = mask_table(graph, declare, device_kind)

    #: how an FP8 precision's matmuls ran (options["fp8"]): an adapter with real FP8 kernels says so here
    fp8_matmuls = "emulated: inputs cast by harness.fp8's rule, multiplied and accumulated in float32"
    #: how a block-scaled precision's matmuls ran (options["blocks"])
    block_matmuls = "emulated: operands quantized by harness.microscaling's rule, multiplied and accumulated in float32"

    def rounding_options(self) -> dict[str, Any]:
        """The rounding's entries of `options`, and an FP8 precision's (its scaling recipe, how its matmuls ran)."""
        fp8 = {"fp8": {"scaling": self.fp8.recipe.name, "matmuls": self.fp8_matmuls}} if self.fp8 else {}
        blocks = {"blocks": {"recipe": self.blocks.name, "formats": self.blocks.describe(),
                             "matmuls": self.block_matmuls}} if getattr(self, "blocks", None) else {}
        return {"weight_update": self.rounding.describe() if self.rounding else None,
                "rounding_seed": self.rounding_seed, **fp8, **blocks}

    def output(self, tensor) -> np.ndarray:
        """A framework tensor as the core's outputs are: numpy, float32 unless float64 (as_output)."""
        return as_output(self._numpy(tensor))

    # -- the adapter's primitives for them -----------------------------------------------------------------
    def _numpy(self, tensor) -> np.ndarray:
        """A tensor as numpy, in any dtype numpy holds."""
        return np.asarray(tensor)

    def _loss_scale_now(self) -> tuple[float, bool]:
        """(the scale the next step applies, whether the step just taken was skipped), with loss scaling on."""
        raise NotImplementedError(f"{type(self).__name__} scales the loss but does not say its state")

    def _memory_in_use(self) -> int:
        """Bytes the device allocator holds now (a GPU only)."""
        raise NotImplementedError

    def _memory_peak(self) -> int:
        """The device allocator's peak bytes since _reset_memory_peak (a GPU with a peak counter only)."""
        raise NotImplementedError

    def _reset_memory_peak(self) -> None:
        """Reset the allocator's peak counter, where it has one."""

    @abstractmethod
    def to_device(self, x: np.ndarray, y: np.ndarray, masks: dict[str, np.ndarray]) -> Any:
        """Convert a numpy batch for train_step: inputs, labels and the step's dropout masks by layer path
        (float32 0/1 in the canonical layout of each dropout layer's output; {} without dropout). The core
        keeps this out of the timed region."""

    def train_step(self, batch: Any) -> float:
        """One optimizer step; return the (unscaled, float32) loss once the device has finished."""
        loss = self.run_step(batch, None)
        self.steps_taken += 1
        return loss

    @abstractmethod
    def run_step(self, batch: Any, capture: dict[str, np.ndarray] | None) -> float:
        """The step train_step and captured_step share: one optimizer step, returning the loss once the device
        has finished; with `capture` (diagnose and fingerprint runs), the weight gradients it applied are put into
        it (unscaled, before the update, by canonical weight name in canonical layouts). A compiled step and its
        capturing twin are both built once, in build; the step only picks one."""

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
        """Diagnose and fingerprint runs: one train_step that also returns the weight gradients it applied,
        unscaled and before the update, by canonical weight name in canonical layouts (trainable weights only); it
        must train as train_step does (the kit checks). None, taking no step: this adapter cannot capture (the
        report then says "not available"; override to return None)."""
        gradients: dict[str, np.ndarray] = {}
        loss = self.run_step(batch, gradients)
        self.steps_taken += 1
        return loss, gradients

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

    def native_info(self) -> NativeInfo:
        """A native spec's model as built (a spec with `native:` for this adapter's framework: build got graph and
        weights None, and built the user's model under spec.seed, the run's)."""
        raise HarnessError(f"{type(self).__name__} builds no native models")

    #: the adapter's profile module (an import path), whose profile_steps(trainer, run_steps) is `profile`; None:
    #: this adapter cannot profile
    profile_module: str | None = None

    def profile(self, run_steps: Callable[[], None]) -> ProfiledOps | None:
        """Profile mode only (optional): start the framework's own profiler, call run_steps() (the core's loop
        of train_steps on batches already on the device), stop the profiler and return every op that ran in
        between: the profile module's profile_steps(self, run_steps). None: this adapter cannot profile. An adapter
        that profiles on a CPU only declares it (Capabilities.no_gpu_profile): the core then refuses a GPU profile
        before building anything."""
        if self.profile_module is None:
            return None
        return import_module(self.profile_module).profile_steps(self, run_steps)


@dataclass(frozen=True)
class Refusal:
    """A precision an adapter refuses on a kind of device, found by experiment (the probe cannot catch it: the
    framework crashes in native code, say)."""

    precision: str
    device_kind: str  # "cpu" or "gpu"
    reason: str


@dataclass(frozen=True)
class Capabilities:
    """What an adapter cannot do, as data: the core reads it and words the reasons (Adapter.unsupported)."""

    #: None where the framework can reinterpret float32 bits as int32; else what it lacks ("no bitcast
    #: operator..."): the floating-point rounding precisions need it (harness.rounding)
    no_bitcast: str | None = None
    refused: tuple[Refusal, ...] = ()
    #: None where Trainer.profile profiles on a GPU too; else why it cannot there (the core then records a GPU
    #: profile as unsupported with this reason, before building anything)
    no_gpu_profile: str | None = None
    #: None where the adapter's networks emulate the FP8 precisions by the core's rule (harness.fp8: each matmul
    #: layer's inputs through fake_quantize_with, its output's gradient too); else why not. An adapter that says
    #: nothing does not: it would train them as plain float32
    no_fp8: str | None = "does not emulate FP8 (Capabilities.no_fp8: the matmul layers' casts of harness.fp8)"
    #: None where the adapter's networks train the block-scaled precisions by the core's rule (harness.microscaling:
    #: each dense, attention, conv2d and patches matmul's operands through block_operands_with, its backward's
    #: through block_gradient_operands_with, a convolution's as the product of its windows); else why not. An adapter that says nothing does not: it would train them as
    #: plain float32
    no_block_scaling: str | None = ("does not emulate block-scaled formats (Capabilities.no_block_scaling: the "
                                    "matmuls' casts of harness.microscaling)")
    #: None where its block-scaled products round the gradient's casts stochastically under a recipe with :sr (bits
    #: drawn on the device for every product, the kit's given through block_linear's `bits`); else why not
    no_block_stochastic: str | None = ("does not round block-scaled gradients stochastically "
                                       "(Capabilities.no_block_stochastic)")
    #: None where the block-scaled precisions' :native variants multiply with the framework's own block-scaled
    #: matmuls; else why not. No adapter has them: on a CPU none exists, and torch._scaled_mm's MX scales need a
    #: GPU of compute capability 10.0 (Blackwell), which none of this project's machines has had to prove one on
    no_block_native: str | None = ("has no native block-scaled matmuls (Capabilities.no_block_native): none on a "
                                   "CPU; on a GPU they need compute capability 10.0 (Blackwell), not implemented")
    #: None where the FP8 precisions' :native variants multiply the cast values with the framework's own FP8
    #: matmuls (the adapter's unsupported() says where its kernels cannot run); else why not
    no_fp8_native: str | None = "has no native FP8 matmuls (Capabilities.no_fp8_native)"
    #: None where the adapter converts a native model's matmul modules to FP8 (NativeInfo.fp8 says which); else
    #: why not: the core then records a native model's FP8 runs unsupported with it
    no_fp8_for_native_models: str | None = ("does not convert a native model's matmuls to FP8 "
                                            "(Capabilities.no_fp8_for_native_models)")
    #: None where the framework's dynamic loss scaler follows any growth and back-off factor of the core's rules
    #: (harness.precision.LossScale); else the (growth, back-off) pair it is fixed to, and what fixes it
    dynamic_scale_factors: tuple[float, float, str] | None = None
    #: None where dynamic loss scaling runs in every precision; else why it needs a mixed one (AMP)
    dynamic_scale_needs_mixed: str | None = None


class Adapter(ABC):
    name: str  # the --framework name
    #: the framework's idioms for running a training step (name -> what it is), swept by `run --variant`;
    #: the first is the default
    variants: dict[str, str] = {"default": "the adapter's one way to run a step"}
    capabilities: Capabilities = Capabilities()

    @abstractmethod
    def framework_version(self) -> str: ...

    @abstractmethod
    def device(self, requested: str) -> Device:
        """Resolve "auto", "cpu" or "gpu" to a device this framework can use here."""

    def unsupported(self, precision: Precision, device: Device) -> str | None:
        """A one-line reason why this precision cannot run on this device, or None. The default knows the
        limits that hold for every framework (device_limits) and the adapter's capabilities."""
        rounding, capabilities = precision.rounding, self.capabilities
        if rounding is not None and rounding.format != "fixed16" and capabilities.no_bitcast:
            return f"{self.name} cannot bit-cast ({capabilities.no_bitcast}) to write {rounding.describe()}"
        if rounding is not None and self.rounding_ops() is None:
            # an adapter that knows nothing of harness.rounding would train these as plain bf16/fp16/fp32
            return (f"{precision.name} writes weights by harness.rounding ({rounding.describe()}), which the "
                    f"{self.name} adapter does not implement (Adapter.rounding_ops)")
        for refusal in capabilities.refused:
            if (refusal.precision, refusal.device_kind) == (precision.name, device.kind):
                return refusal.reason
        return device_limits(precision, device)

    def unsupported_loss_scale(self, precision: Precision, loss_scale: LossScale) -> str | None:
        """A one-line reason why this adapter's loss scaler cannot follow the run's loss-scale settings, or None:
        the core reads it from the adapter's capabilities (an adapter does not override it)."""
        capabilities = self.capabilities
        if loss_scale.mode != "dynamic":
            return None
        if capabilities.dynamic_scale_needs_mixed and not precision.mixed:
            return f"{self.name} {capabilities.dynamic_scale_needs_mixed}"
        factors = capabilities.dynamic_scale_factors
        if factors and (loss_scale.growth_factor, loss_scale.backoff_factor) != factors[:2]:
            return (f"{self.name}: {factors[2]} grows the loss scale by {factors[0]:g} and backs off by "
                    f"{factors[1]:g} only (asked: {loss_scale.growth_factor:g} and {loss_scale.backoff_factor:g})")
        return None

    def explain_probe_failure(self, precision: Precision, device: Device, error: str) -> str | None:
        """Optional: what the framework's error (one line) from the capability probe's step means on this device
        ("oneDNN has no bfloat16 primitives for this CPU"), or None. The core adds the CPU's flags and the error."""
        return None

    def free_memory_mb(self, device: Device) -> float | None:
        """MiB the framework can still allocate on `device` (a GPU: the core asks of no other) now, other
        processes' use counted: the worker's memory guard holds a run's estimate to it before building the
        network. None where the framework cannot tell (the guard before the runs asked nvidia-smi)."""
        return None

    @abstractmethod
    def set_threads(self, threads: int) -> None:
        """Set intra-op threads before any op runs."""

    @abstractmethod
    def build(self, spec: ModelSpec, graph: Graph, weights: dict[str, np.ndarray], precision: Precision,
              loss_scale: LossScale, device: Device, variant: str) -> Trainer: ...

    #: the adapter's rounding module (an import path), whose OPS is rounding_ops'; None: none
    rounding_module: str | None = None

    def rounding_ops(self) -> RoundingOps | None:
        """The framework's primitives that harness.rounding's rules are written with (the rounding module's OPS,
        `rounding_module`: the built-in adapters' rounding.py fills them). None: the adapter has no rounding
        precisions."""
        return None if self.rounding_module is None else import_module(self.rounding_module).OPS

    def write_weights(self, precision: Precision, x: np.ndarray, bits: np.ndarray | None,
                      device: Device) -> np.ndarray | None:
        """The rounding self-test (the conformance kit's): float32 values `x` written to a rounding precision's
        weight format (nearest or stochastic, harness.rounding) by the rules the adapter's optimizer runs, on its
        primitives, with the given bits (int32 0..2^16-1, x's shape) or, when `bits` is None, bits drawn on the
        device as a timed run does (seeded by harness.rounding.device_seed: each call draws afresh); returned as
        float32 numpy. None: the adapter has no rounding precisions."""
        ops = self.rounding_ops()
        if ops is None:
            return None
        rounding = precision.rounding
        values = ops.to_tensor(np.ascontiguousarray(x, dtype=np.float32), device)
        if rounding.mode == "nearest":
            out = ops.on_device(lambda v: ops.to_float32(round_nearest_with(ops, v, rounding)), device)(values)
        else:
            bits = ops.draw_bits(np.shape(x), device_seed(), device) if bits is None else \
                ops.to_tensor(np.asarray(bits, dtype=np.int32), device)
            out = ops.on_device(lambda v, b: ops.to_float32(round_stochastic_with(ops, v, b, rounding)),
                                device)(values, bits)
        return np.asarray(ops.to_numpy(out), dtype=np.float32)

    def block_linear(self, precision: Precision, x: np.ndarray, w: np.ndarray, dy: np.ndarray, device: Device,
                     bits: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, ...] | None:
        """The block-scaled self-test (the conformance kit's): y = x @ w, x [M, K] and w [K, N] float32, through the
        matmul the adapter's dense layers run under the block-scaled `precision` (harness.microscaling.BlockRecipe),
        and the gradients of sum(y * dy) with respect to x and w through its backward; (y, dx, dw) as float32 numpy.
        `bits`: a stochastic recipe's (block_gradient_operands_with), given in place of the device's draws. None:
        the adapter has no block-scaled precisions."""
        return None

    def block_conv2d(self, precision: Precision, layer, x: np.ndarray, kernel: np.ndarray, dy: np.ndarray,
                     device: Device) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The block-scaled self-test of a convolution (the conformance kit's): the product of `layer` (a conv2d or
        patches layer's spec, groups 1, no bias) on x [N, H, W, C] float32 and its canonical kernel [k, k, C, F],
        through what the adapter's conv2d and patches layers run under the block-scaled `precision`, and the
        gradients of sum(y * dy) with respect to x and the kernel; (y, dx, dw) as float32 numpy in those layouts
        (y [N, Ho, Wo, F], a patches layer's [N, T, F]). None: the adapter has no block-scaled precisions."""
        return None

    def import_model(self, target: str, input_shape: tuple[int, ...], options: ImportOptions) -> Imported:
        """Optional: the framework's model named by `target` (the adapter says what it takes: "MODULE:ATTR" in
        PyTorch) as a spec, its input of `input_shape` without the batch axis in the framework's own layout;
        `options` a harness.model.importers.ImportOptions. Returns a harness.model.importers.Imported; raises
        ImportProblems (one line per problem) or HarnessError (one line). The default has no importer."""
        raise HarnessError(f"the {self.name} adapter has no importer (Adapter.import_model): `amp-harness import "
                           f"{self.name}` is not available")

    def matmul(self, shape: tuple[int, int, int], dtype: str, device: Device) -> Callable[[], None] | None:
        """A function that multiplies an m x k matrix by a k x n one (`shape` = (m, k, n)), both of `dtype`, on
        `device`, and waits for the result: the core times it for the device's peak, its matmul curve and the
        model's own matmul shapes (harness.run.peak). None where the framework cannot."""
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
