"""The work of a timed run (`run`, the studies, `diagnose --nonfinite`): warm-up and timed training steps, then
the evaluation; a divergence located to its first non-finite value (harness.run.nonfinite); the run's share of the
device's matmul peak. Also the loss-scale log every training loop checks its adapter's scaler with."""
from __future__ import annotations

import math
import time

from harness.adapter import LossScaleState
from harness.errors import HarnessError
from harness.model.data import Data
from harness.model.dropout import DropoutMasks
from harness.model.graph import step_matmuls
from harness.precision import LossScale, LossScaler
from harness.run import measure, nonfinite, peak
from harness.run.metrics import loss_and_correct
from harness.run.request import BuiltRun

RSS_KIND = ("process peak RSS (VmHWM) above its level before the model was built: weights, gradients, optimizer "
            "state, activations and the framework's workspace; not the input pipeline")


def train(run: BuiltRun) -> None:
    """Train and evaluate (timed_steps); where the loss diverged, or (--nonfinite) where the scaler first skipped a
    step, replay from the same weights to name the first non-finite value; an ok run's efficiency."""
    req, spec, graph, precision, record = run.request, run.spec, run.graph, run.precision, run.record
    diverged_at = timed_steps(run)
    skipped_at = record["loss_scale"].get("first_overflow_step") if req.nonfinite else None
    if diverged_at is not None or skipped_at is not None:
        run.trainer = None  # the replay builds its own from the same weights
        at = diverged_at if diverged_at is not None else skipped_at
        history = record["loss_scale"].get("history") or []
        record["nonfinite"] = nonfinite.locate(  # (fresh weights: a framework may train the given arrays)
            run.fresh_trainer, run.layers, Data(spec, order_seed=run.seed), DropoutMasks(graph, run.seed), at,
            scale=(history[at - 1] if at else run.loss_scale.initial) if history else None,
            compute_dtype=precision.compute_dtype, weight_dtype=precision.param_dtype,
            epsilon=nonfinite.lost_epsilon(spec.optimizer, precision))
    if record["status"] == "ok" and req.measure_peak:
        efficiency(run.adapter, run.device, precision, req.threads, record,
                   step_matmuls(graph, spec.batch_size) if graph else ())


def efficiency(adapter, device, precision, threads, record, matmuls=()) -> None:
    """The run's achieved FLOP/s as a share of this device's matmul peak in the run's compute dtype; a scaling
    study's run also holds the device's matmul curve per dtype (harness.run.peak.matmul_curves), which its
    section reads beside the model's rate at each size, and the rate of each of its step's own matmuls
    (`matmuls`: harness.model.graph.step_matmuls) in its compute dtype, timed alone: how long the step's matmuls
    take by themselves, against the step's time."""
    from harness.identity import scaling_study  # (only here: the rest of the run has no use for it)

    peaks = peak.device_peaks(adapter, device, threads, precision.tf32)
    record["device_peak_gflops"] = peaks
    compute = precision.compute_dtype
    if peaks.get(compute) and record.get("achieved_gflops"):
        record["efficiency"] = record["achieved_gflops"] / peaks[compute]
    if scaling_study(record):
        curves = record["matmul_curve"] = peak.matmul_curves(adapter, device, threads, precision.tf32)
        if matmuls:
            rates = {(s["m"], s["k"], s["n"]): s for s in peak.shape_rates(
                adapter, device, threads, precision.tf32, compute, matmuls, curves.get(compute))}
            record["matmul_shapes"] = {"dtype": compute, "products": [
                {"layer": mm.path, "type": mm.type, "pass": mm.pass_, **rates[(mm.m, mm.k, mm.n)]}
                for mm in matmuls]}


class LossScaleLog:
    """The loss-scale state an adapter reports after each step, checked against the core's rules
    (harness.precision.LossScaler): a scaler that skips, backs off or grows differently stops the run."""

    def __init__(self, settings: LossScale):
        self.rules = LossScaler(settings) if settings.mode != "none" else None
        self.history: list[float] = []
        self.skipped: list[int] = []

    def after_step(self, trainer, step: int) -> LossScaleState | None:
        if self.rules is None:
            return None
        state = trainer.loss_scale_state()
        if state is None:
            raise HarnessError(f"loss scaling is {self.rules.settings.mode} but the adapter reported no "
                               f"loss-scale state after step {step}")
        self.rules.update(finite=not state.skipped)
        if not math.isclose(state.scale, self.rules.scale, rel_tol=1e-9):
            raise HarnessError(f"the adapter's loss scaler broke the core's rules at step {step}: it "
                               f"{'skipped' if state.skipped else 'applied'} the step and reported a next scale of "
                               f"{state.scale:g}, the rules give {self.rules.scale:g} (harness.precision.LossScaler)")
        self.history.append(state.scale)
        if state.skipped:
            self.skipped.append(step)
        return state


def timed_steps(run: BuiltRun) -> int | None:
    """The timed run; the step whose loss was not finite when it diverged, else None."""
    req, spec, data, masks, trainer, record = run.request, run.spec, run.data, run.masks, run.trainer, run.record
    total = req.warmup + spec.steps
    losses, times_ms, input_ms = [], [], []
    scales = LossScaleLog(run.loss_scale)
    status, reason, diverged_at = "ok", None, None
    for step in range(total):
        x, y = data.train_batch(step, out=run.buffers[0])
        dropout = masks.for_step(step, len(y), out=run.buffers[1])
        t0 = time.perf_counter_ns()
        batch = trainer.to_device(x, y, dropout)
        t1 = time.perf_counter_ns()
        loss = trainer.train_step(batch)  # returns once the device has finished the step
        t2 = time.perf_counter_ns()
        input_ms.append((t1 - t0) / 1e6)
        times_ms.append((t2 - t1) / 1e6)
        losses.append(loss)
        trainer.after_step()
        state = scales.after_step(trainer, step)
        if run.progress:
            run.progress(step + 1, total)
        if not math.isfinite(loss) and not (state and state.skipped):
            status, reason, diverged_at = "diverged", f"loss became {loss} at step {step}", step
            break
    timed = times_ms[req.warmup:]
    stats = measure.step_stats(timed)
    record.update(
        status=status, reason=reason, first_step_ms=times_ms[0], step_time_ms=stats, step_times_ms=timed,
        input_ms=measure.step_stats(input_ms)["median"],
        loss=[l if math.isfinite(l) else None for l in losses],
        final_train_loss=losses[-1] if math.isfinite(losses[-1]) else None,
    )
    if stats["median"]:
        record["samples_per_s"] = spec.batch_size / (stats["median"] / 1e3)
        if record["flops_per_step"]:  # a native model's are not counted
            record["achieved_gflops"] = record["flops_per_step"] / (stats["median"] / 1e3) / 1e9
    device_peak = trainer.memory_peak_mb()
    if device_peak is not None:
        record["peak_memory_mb"], record["memory_kind"] = device_peak
    elif run.baseline_kb is not None:
        record["peak_memory_mb"] = (measure.peak_rss_kb() - run.baseline_kb) / 1024
        record["memory_kind"] = RSS_KIND
    if scales.history:
        record["loss_scale"].update(initial=run.loss_scale.initial, final=scales.history[-1],
                                    skipped_steps=len(scales.skipped),
                                    first_overflow_step=scales.skipped[0] if scales.skipped else None,
                                    history=scales.history)
    if status == "ok":
        total_loss, correct, n = 0.0, 0, 0
        for x, y in data.eval_batches():
            batch_loss, batch_correct = loss_and_correct(spec.loss, trainer.predict(x), y)
            total_loss, correct, n = total_loss + batch_loss, correct + batch_correct, n + y.size
        record.update(eval_loss=total_loss / n, eval_accuracy=correct / n)
        if not math.isfinite(record["eval_loss"]):
            record.update(eval_loss=None, status="diverged", reason="evaluation loss is not finite")
    return diverged_at
