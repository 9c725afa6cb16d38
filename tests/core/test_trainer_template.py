"""The core's Trainer template (harness.adapter.Trainer): the bookkeeping every adapter shares, written once and
read from the adapter's primitives (memory baseline and peak, the loss-scale state, outputs, the step)."""
from __future__ import annotations

import numpy as np

from harness.adapter import LossScaleState, Trainer, as_output
from harness.precision import LossScale


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
