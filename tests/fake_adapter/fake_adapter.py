"""A test double registered as the adapter 'fake' (see tests/core/test_runner.py): numpy only, with a
fault per precision or model chosen by AMP_FAKE_FAULTS, e.g. "fp16=abort,bf16=hang,mnist_mlp=segv" (abort,
segv, oom, hang, slow, raise, nan, stuckscale: report the initial loss scale after an overflow, against the core's
rules; bug: the adapter's own Python fails (a TypeError) on every step; nokernel: every step fails as a framework without a kernel for the precision does, so the capability
probe's step fails too, where hang and raise come from the second step on, past the probe's one step; noisy:
from its second step on, each run's steps sleep NOISY_STEP_S[0] or [1], switching every two runs (a counter in the
file $AMP_FAKE_NOISE_FILE), so two noisy precisions interleaved by the runner get the same times, a speed-up
near 1 whose interval stays wide; jitter: from its second step on, each step sleeps JITTER_STEP_S times a factor
drawn once per process (log-normal, JITTER_PROCESS) and one drawn per step (JITTER_STEP), the same in every
precision: two jittery precisions differ in nothing but noise); AMP_FAKE_NO_PROFILE=1 makes it an adapter that
cannot profile; AMP_FAKE_VARIANTS=1 gives it two variants, "slowed" (first) sleeping VARIANT_STEP_S in every step, and "plain"."""
from __future__ import annotations

import fcntl
import os
import time

import numpy as np

from harness.adapter import (
    LOSS_SCOPE,
    UPDATE_SCOPE,
    Adapter,
    Device,
    OpTime,
    ProfiledOps,
    Trainer,
    layer_scope,
)
from harness.precision import LossScaler

SLOW_STEP_S, SLOW_INPUT_S, PROFILED_STEP_S, VARIANT_STEP_S = 0.3, 0.1, 0.02, 0.02
NOISY_STEP_S = (0.002, 0.02)
JITTER_STEP_S, JITTER_PROCESS, JITTER_STEP = 0.01, 0.08, 0.05  # as a shared 2-core machine spreads a CPU step
_jitter = np.random.default_rng()  # seeded from the OS: every process draws its own
_process_factor = float(np.exp(_jitter.normal(0, JITTER_PROCESS)))


def _noise_ticket() -> int:
    """The number of noisy runs before this one, counted in $AMP_FAKE_NOISE_FILE (runs follow each other)."""
    with open(os.environ["AMP_FAKE_NOISE_FILE"], "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        ticket = len(f.read())
        f.write("x")
    return ticket


def _fault(precision: str, model: str) -> str:
    faults = dict(item.split("=") for item in os.environ.get("AMP_FAKE_FAULTS", "").split(",") if item)
    return faults.get(model, faults.get(precision, "none"))


class FakeTrainer(Trainer):
    """The smallest trainer on the core's template (docs/plugins.md): its hooks build a "network" that outputs
    a uniform distribution and keeps the core's weights as given, no optimizer, and the core's loss-scale rules
    as its scaler."""
    overflows = (2,)  # the steps (counted from 1) whose gradients overflow

    def build_network(self, spec, graph, weights, precision, device, variant):
        self.graph, self.weights, self.out_shape = graph, weights, graph.output_shape
        self.fault, self.steps = _fault(precision.name, spec.name), 0
        self.variant_s, self.noisy_s = VARIANT_STEP_S if variant == "slowed" else 0.0, 0.0

    def build_optimizer(self, optimizer):
        pass  # the fake's weights never change: an optimizer without state

    build_rounded_optimizer = build_optimizer

    def build_step(self, spec, precision, loss_scale, variant):
        self.scaler = LossScaler(loss_scale) if loss_scale.mode != "none" else None
        self.skipped, self.profiling = False, False

    def framework_options(self, precision, variant):
        return {"fake": True}

    def to_device(self, x, y, masks):
        if self.fault == "slow":
            time.sleep(SLOW_INPUT_S)  # must not count in the step time
        return x, y

    def run_step(self, batch, capture):
        self.steps += 1
        if self.fault == "abort" and self.steps == 3:
            os.abort()
        if self.fault == "segv" and self.steps == 2:
            import ctypes

            ctypes.string_at(0)  # a real segmentation fault in native code
        if self.fault == "oom" and self.steps == 2:
            os.kill(os.getpid(), 9)  # what the out-of-memory killer does
        if self.fault == "slow":
            time.sleep(SLOW_STEP_S)
        if self.fault == "noisy" and self.steps == 2:  # past the capability probe's one step
            self.noisy_s = NOISY_STEP_S[_noise_ticket() // 2 % 2]
        if self.variant_s or self.noisy_s:
            time.sleep(self.variant_s + self.noisy_s)
        if self.fault == "jitter" and self.steps >= 2:
            time.sleep(JITTER_STEP_S * _process_factor * np.exp(_jitter.normal(0, JITTER_STEP)))
        if self.profiling:
            time.sleep(PROFILED_STEP_S)
        if self.fault == "hang" and self.steps >= 2:
            time.sleep(3600)
        if self.fault == "raise" and self.steps >= 2:
            raise RuntimeError("simulated framework error\nsecond line")
        if self.fault == "bug":
            raise TypeError("simulated bug in the adapter's own code")
        if self.fault == "nokernel":
            raise RuntimeError("simulated C++ traceback\nFakeError: no kernel for this dtype on this device")
        if self.scaler:
            self.skipped = self.scaler.update(finite=self.steps not in self.overflows)
        if self.fault == "nan" and self.steps == 4:
            return float("nan")
        return 1.0 / self.steps

    def captured_step(self, batch):
        return None  # the fake has no gradients to capture

    def _loss_scale_now(self):
        return self.scaler.settings.initial if self.fault == "stuckscale" else self.scaler.scale, self.skipped

    def profile(self, run_steps):
        """Ops named as a framework's profiler names them: scopes nested by residual blocks, a layer scope made
        unique by a suffix ("layer.3_1", as TensorFlow does), a cast, backward ops, the loss and the update; 90% of
        the measured time is given to them, the rest is "other"."""
        if os.environ.get("AMP_FAKE_NO_PROFILE"):
            return super().profile(run_steps)
        self.profiling = True  # steps of a measurable length
        start = time.perf_counter()
        run_steps()
        share = 0.9 * (time.perf_counter() - start) / (4 * len(self.graph.layers) + 2)
        ops = []
        for info in self.graph.layers:
            parts = info.path.split(".")
            nested = "/".join(layer_scope(".".join(parts[:i])) for i in range(1, len(parts) + 1, 2))
            scope = f"model/{nested}" + ("_1" if info.path == "1" else "")
            ops += [OpTime(f"{info.type}_op", scope, 2 * share, inputs=("float32", "float32"), outputs=("float32",)),
                    OpTime(f"{info.type}_grad", scope, share, backward=True),
                    OpTime("Cast", scope, share, cast=True)]
        ops += [OpTime("loss_op", LOSS_SCOPE, share), OpTime("update_op", f"optimizer/{UPDATE_SCOPE}", share)]
        return ProfiledOps("the fake adapter's invented ops", ops)

    def predict(self, x):
        return np.full((len(x), *self.out_shape), 1.0 / self.out_shape[-1], np.float32)  # uniform

    def param_count(self):
        return 0

    def get_weights(self):
        return dict(self.weights)


class FakeAdapter(Adapter):
    name = "fake"
    if os.environ.get("AMP_FAKE_VARIANTS"):
        variants = {"slowed": f"sleeps {VARIANT_STEP_S} s in every step", "plain": "no sleep"}

    def framework_version(self):
        return "0.0-test"

    def device(self, requested):
        return Device("cpu", "cpu", "test cpu")

    def unsupported(self, precision, device):
        return "fake cannot do TF32" if precision.tf32 else None

    def set_threads(self, threads):
        pass

    def build(self, spec, graph, weights, precision, loss_scale, device, variant):
        return FakeTrainer(spec, graph, weights, precision, loss_scale, device, variant)


class SkippingTrainer(FakeTrainer):
    overflows = range(1, 10**6)


class SkippingAdapter(FakeAdapter):
    """A broken adapter: its loss scaler skips every step (by the rules: it backs off each time), so it never
    trains. The parity check must fail it."""

    name = "fake_skipping"

    def build(self, spec, graph, weights, precision, loss_scale, device, variant):
        return SkippingTrainer(spec, graph, weights, precision, loss_scale, device, variant)
