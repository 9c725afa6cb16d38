"""One run in its own process: ``python -m harness.run.worker REQUEST.json RECORD.json``.

The runner starts this module once per (framework, model, precision, repeat) so that process-wide framework
state (mixed-precision policies, MXNet's AMP patching, allocator peaks) never leaks between runs. It writes
one result record as JSON; progress goes to stdout as ``progress STEP TOTAL`` lines.
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from harness.adapter import LossScaleState, load_adapter
from harness.errors import HarnessError
from harness.model.data import Data
from harness.model.dropout import DropoutMasks
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.model.weights import initial_weights
from harness.precision import LossScale, LossScaler, parse_loss_scale, parse_precision
from harness.results import empty_record
from harness.run import measure
from harness.run.metrics import loss_and_correct


@dataclass
class RunRequest:
    framework: str
    model: str  # built-in name or spec path
    precision: str
    run_id: str
    repeat: int = 0
    steps: int | None = None  # None: the spec's
    warmup: int = 5
    batch_size: int | None = None
    input_size: tuple[int, int] | None = None
    loss_scale: str | None = None  # None: the precision's default
    growth_interval: int = 2000
    device: str = "auto"
    threads: int = 1
    mode: str = "run"  # "run": timed training; "fingerprint": outputs and losses for the parity check

    def resolved_spec(self):
        return load_spec(self.model).with_overrides(self.batch_size, self.steps,
                                                    tuple(self.input_size) if self.input_size else None)


def run(req: RunRequest, progress=None) -> dict:
    started = time.time()
    record = empty_record(run_id=req.run_id, framework=req.framework, precision=req.precision, repeat=req.repeat,
                          started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          warmup_steps=req.warmup, env=measure.environment(req.threads))
    try:
        spec = req.resolved_spec()
        graph = infer(spec)
        precision = parse_precision(req.precision)
        loss_scale = parse_loss_scale(req.loss_scale, precision, req.growth_interval)
        record.update(model=spec.name, spec_hash=spec.spec_hash(), batch_size=spec.batch_size, steps=spec.steps,
                      flops_per_step=graph.train_step_flops(spec.batch_size), param_count=graph.param_count,
                      loss_scale={"settings": loss_scale.to_dict()})
        adapter = load_adapter(req.framework)
        adapter.set_threads(req.threads)
        device = adapter.device(req.device)
        record.update(framework_version=adapter.framework_version(), device=device.name)
        record["env"].update(device=asdict(device))
        reason = adapter.unsupported(precision, device)
        if reason:
            record.update(status="unsupported", reason=reason)
            return record
        data = Data(spec)
        trainer = adapter.build(spec, graph, initial_weights(graph, spec.seed), precision, loss_scale, device)
        record["options"] = dict(trainer.options)
        masks = DropoutMasks(graph, spec.seed)
        if req.mode == "fingerprint":
            _fingerprint(spec, data, masks, trainer, loss_scale, record)
        else:
            _train(req, spec, data, masks, trainer, loss_scale, record, progress)
    except HarnessError as exc:
        record.update(status="failed", reason=str(exc))
    except Exception as exc:  # a framework error: keep the run's record, with the cause
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        record.update(status="failed", reason=f"{_one_line(exc)}{where}")
        traceback.print_exc()
    finally:
        record["wall_s"] = round(time.time() - started, 3)
    return record


def _one_line(exc: Exception) -> str:
    """The telling line of an exception: frameworks (MXNet) put a C++ traceback before their message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^\w*(Error|Exception)\b", line)]
    return named[-1] if named else f"{type(exc).__name__}: {lines[0] if lines else ''}"


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


def _train(req, spec, data, masks, trainer, loss_scale, record, progress) -> None:
    total = req.warmup + spec.steps
    losses, times_ms, input_ms = [], [], []
    scales = LossScaleLog(loss_scale)
    baseline_kb = measure.reset_peak_rss()
    trainer.reset_memory_peak()
    status, reason = "ok", None
    for step in range(total):
        x, y = data.train_batch(step)
        dropout = masks.for_step(step, len(y))
        t0 = time.perf_counter_ns()
        batch = trainer.to_device(x, y, dropout)
        t1 = time.perf_counter_ns()
        loss = trainer.train_step(batch)  # returns once the device has finished the step
        t2 = time.perf_counter_ns()
        input_ms.append((t1 - t0) / 1e6)
        times_ms.append((t2 - t1) / 1e6)
        losses.append(loss)
        state = scales.after_step(trainer, step)
        if progress:
            progress(step + 1, total)
        if not math.isfinite(loss) and not (state and state.skipped):
            status, reason = "diverged", f"loss became {loss} at step {step}"
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
        record["achieved_gflops"] = record["flops_per_step"] / (stats["median"] / 1e3) / 1e9
    device_peak = trainer.memory_peak_mb()
    if device_peak is not None:
        record["peak_memory_mb"], record["memory_kind"] = device_peak
    elif baseline_kb is not None:
        record["peak_memory_mb"] = (measure.peak_rss_kb() - baseline_kb) / 1024
        record["memory_kind"] = "process peak RSS above the post-build baseline (VmHWM)"
    if scales.history:
        record["loss_scale"].update(initial=loss_scale.initial, final=scales.history[-1],
                                    skipped_steps=len(scales.skipped),
                                    first_overflow_step=scales.skipped[0] if scales.skipped else None,
                                    history=scales.history)
    if status == "ok":
        total_loss, correct, n = 0.0, 0, 0
        for x, y in data.eval_batches():
            batch_loss, batch_correct = loss_and_correct(spec.loss, trainer.predict(x), y)
            total_loss, correct, n = total_loss + batch_loss, correct + batch_correct, n + len(y)
        record.update(eval_loss=total_loss / n, eval_accuracy=correct / n)
        if not math.isfinite(record["eval_loss"]):
            record.update(eval_loss=None, status="diverged", reason="evaluation loss is not finite")


def _fingerprint(spec, data, masks, trainer, loss_scale, record) -> None:
    """What the parity check compares across frameworks: outputs on a fixed batch before and after
    `spec.steps` untimed training steps, and the loss (and loss scale) of every step."""
    x, _ = data.fixed_batch()
    initial = trainer.predict(x)
    losses, scales = [], LossScaleLog(loss_scale)
    for step in range(spec.steps):
        bx, by = data.train_batch(step)
        losses.append(trainer.train_step(trainer.to_device(bx, by, masks.for_step(step, len(by)))))
        scales.after_step(trainer, step)
    final = trainer.predict(x)
    finite = all(math.isfinite(v) for v in losses) and np.isfinite(final).all()
    record.update(status="ok" if finite else "diverged", reason=None if finite else "non-finite loss or outputs",
                  loss=[v if math.isfinite(v) else None for v in losses],
                  fingerprint={"initial_outputs": _listed(initial), "final_outputs": _listed(final),
                               "loss_scales": scales.history or None, "skipped_steps": scales.skipped})


def _listed(a: np.ndarray) -> list:
    return [[v if math.isfinite(v) else None for v in row] for row in a.astype(float).reshape(len(a), -1).tolist()]


def probe(framework: str, device: str = "auto") -> dict:
    """What `amp-harness adapters` shows for one adapter: version, device, which precisions can run."""
    from harness.precision import PRECISIONS

    adapter = load_adapter(framework)
    dev = adapter.device(device)
    return {"framework": framework, "version": adapter.framework_version(), "device": asdict(dev),
            "precisions": {name: adapter.unsupported(p, dev) for name, p in PRECISIONS.items()}}


def main(argv: list[str]) -> int:
    if argv[0] == "probe":
        try:
            print(json.dumps(probe(argv[1])))
        except HarnessError as exc:
            print(json.dumps({"framework": argv[1], "error": str(exc)}))
        return 0
    request_path, record_path = argv
    req = RunRequest(**json.loads(Path(request_path).read_text()))

    def progress(step: int, total: int) -> None:
        print(f"progress {step} {total}", flush=True)

    record = run(req, progress)
    tmp = Path(record_path + ".tmp")
    tmp.write_text(json.dumps(record, default=str))
    tmp.replace(record_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
