"""The core's Trainer template (harness.adapter.Trainer): the bookkeeping every adapter shares, written once and
read from the adapter's primitives (memory baseline and peak, the loss-scale state, outputs, the step)."""
from __future__ import annotations

import numpy as np

from harness.adapter import LossScaleState, Trainer, as_output
from harness.precision import LossScale, parse_precision


class Primitives(Trainer):
    """A trainer whose device memory and loss scaler are scripted."""

    def __init__(self, memory=(), peak_counter=True, loss_scale=LossScale(), on_gpu=True):
        self.memory, self.peak, self.resets = list(memory), 0, 0
        self.memory_peak_counter = peak_counter
        self.memory_kind = "scripted"
        self.start_memory(on_gpu)
        self.start_loss_scale(loss_scale)
        self.steps, self.options = [], {}

    def _reset_memory_peak(self):
        self.resets += 1

    def _memory_in_use(self):
        return self.memory.pop(0)

    def _memory_peak(self):
        return self.peak

    def _loss_scale_now(self):
        return 1024.0, True

    def run_step(self, batch, capture):
        self.steps.append(batch)
        if capture is not None:
            capture["0.kernel"] = np.ones(2, np.float32)
        return 0.5

    to_device = predict = get_weights = param_count = None
    build_network = build_optimizer = build_step = framework_options = None  # it builds nothing


def test_the_peak_is_measured_above_the_level_when_the_build_began():
    trainer = Primitives(memory=[3 * 2**20])
    trainer.peak = 10 * 2**20
    assert trainer.resets == 1  # the counter reset before the baseline was read
    assert trainer.memory_peak_mb() == (7.0, "scripted")


def test_without_a_peak_counter_the_core_samples_after_each_step():
    trainer = Primitives(memory=[2 * 2**20, 5 * 2**20, 4 * 2**20], peak_counter=False)
    trainer.after_step()
    trainer.after_step()
    assert trainer.memory_peak_mb() == (3.0, "scripted")  # the highest sample, above the baseline


def test_on_a_cpu_there_is_no_device_figure():
    trainer = Primitives(on_gpu=False)
    trainer.after_step()  # samples nothing
    assert trainer.memory_peak_mb() is None


def test_the_loss_scale_state_is_none_without_scaling_and_the_adapters_otherwise():
    assert Primitives(on_gpu=False).loss_scale_state() is None
    scaled = Primitives(on_gpu=False, loss_scale=LossScale(mode="fixed", initial=1024.0))
    assert scaled.loss_scale_state() == LossScaleState(1024.0, True)


def test_train_step_and_captured_step_share_the_step():
    trainer = Primitives(on_gpu=False)
    assert trainer.train_step("a") == 0.5
    loss, gradients = trainer.captured_step("b")
    assert (loss, list(gradients)) == (0.5, ["0.kernel"]) and trainer.steps == ["a", "b"]


def test_outputs_are_float32_unless_float64_and_never_a_view():
    half = np.arange(4, dtype=np.float16)
    assert as_output(half).dtype == np.float32
    double = np.arange(4, dtype=np.float64)
    out = as_output(double)
    assert out.dtype == np.float64 and not np.shares_memory(out, double)
    single = np.arange(4, dtype=np.float32)
    assert not np.shares_memory(as_output(single), single)


class Sequence(Trainer):
    """A trainer whose hooks write down the order the template calls them in."""

    def __init__(self, *args):
        self.calls = []
        super().__init__(*args)

    def configure(self, spec, precision, device, variant):
        self.calls.append("configure")

    def _reset_memory_peak(self):
        self.calls.append("memory")

    def _memory_in_use(self):
        return 0

    def build_network(self, spec, graph, weights, precision, device, variant):
        self.calls.append("network")

    def attention_mask(self, info, precision, device_kind):
        self.calls.append(f"mask {info.path} {precision.name}")
        return None

    def build_optimizer(self, optimizer):
        self.calls.append(f"optimizer rounding={self.rounding is not None}")

    def build_rounded_optimizer(self, optimizer):
        self.calls.append(f"rounded optimizer {self.rounding.describe()} seed={self.rounding_seed is not None}")

    def build_step(self, spec, precision, loss_scale, variant):
        self.calls.append(f"step lr={self.learning_rate()} scale={self.loss_scale.mode}")

    def framework_options(self, precision, variant):
        return {"variant": variant}

    to_device = run_step = predict = get_weights = param_count = None


def _build(precision: str, model: str = "mnist_mlp", kind: str = "gpu") -> Sequence:
    from harness.adapter import Device
    from harness.model.graph import infer
    from harness.model.spec import load_spec
    from harness.precision import parse_loss_scale, parse_precision

    spec = load_spec(model)
    p = parse_precision(precision)
    return Sequence(spec, infer(spec), {}, p, parse_loss_scale(None, p), Device("gpu:0", kind, "test"), "v")


def test_the_template_runs_the_whole_build_sequence_in_order():
    trainer = _build("amp_fp16")
    assert trainer.calls == ["configure", "memory", "network", "optimizer rounding=False",
                             "step lr=0.001 scale=dynamic"]
    # every record carries the rounding's entries, whatever the adapter's own options
    assert trainer.options == {"variant": "v", "weight_update": None, "rounding_seed": None}


def test_a_rounding_precision_gets_the_rounded_optimizer_and_its_entries_in_the_options():
    trainer = _build("bf16_sr", kind="cpu")  # on a CPU: no memory baseline
    assert trainer.calls[:2] == ["configure", "network"]
    assert trainer.calls[2].startswith("rounded optimizer ") and trainer.calls[2].endswith("seed=True")
    assert trainer.options["weight_update"] == parse_precision("bf16_sr").rounding.describe()
    assert isinstance(trainer.options["rounding_seed"], int)


def test_the_attention_masks_are_declared_for_every_causal_layer_and_16_bit_precision():
    trainer = _build("fp32", model="tiny_gpt", kind="cpu")
    masks = [call for call in trainer.calls if call.startswith("mask ")]
    assert masks and trainer.calls.index(masks[0]) == 2  # after the network, before the optimizer
    assert trainer.attention_masks is not None
