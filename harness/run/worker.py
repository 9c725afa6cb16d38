"""Runs in their own process: ``python -m harness.run.worker REQUESTS.json RECORD.json``.

The runner starts this module once per timed run (framework, model, precision, repeat) so that process-wide
framework state (mixed-precision policies, MXNet's AMP patching, allocator peaks) never leaks between precisions;
untimed runs (fingerprints, diagnoses) of one framework and precision share a process, and so may the repeats of
one timed cell (`--repeats auto`: each builds its own trainer from its own seed; every record names its process). REQUESTS.json is a list;
the record of request i is written as JSON to RECORD.json.i, then ``record i`` goes to stdout; progress goes
there as ``progress STEP TOTAL`` lines.
"""
from __future__ import annotations

import json
import math
import sys
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from harness.adapter import LossScaleState, load_adapter
from harness.errors import HarnessError, one_line
from harness.model import memory
from harness.model.data import Data
from harness.model.dropout import DropoutMasks
from harness.model.graph import infer, state_memory_mb, step_matmuls
from harness.model.spec import ModelSpec, validate
from harness.model.weights import initial_weights
from harness.precision import LossScale, LossScaler, parse_loss_scale, parse_precision
from harness.results import empty_record, sequence_fields
from harness.rounding import RoundingNoise
from harness.run import capability, measure, nonfinite, peak, variants
from harness.run.diagnose import diagnose, gradient_fingerprint
from harness.run.metrics import loss_and_correct
from harness.run.profile import profile, refusal as profile_refusal

PROGRESS_INTERVAL_S = 0.25
SEED_LIMIT = 2**32  # numpy's generators take seeds below it (as ModelSpec.seed)


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
    mode: str = "run"  # "run": timed training; "fingerprint": for the parity check; "diagnose": numerics;
    # "profile": where the step's time goes, under the framework's profiler (harness.run.profile)
    every: int = 10  # diagnose: capture after every this many steps (and the last)
    study: str | None = None  # the id tying the runs of one study together
    nonfinite: bool = False  # diagnose --nonfinite: also locate the first step the loss scaler skipped
    force: bool = False  # run --force: past the memory guard, the worker's too
    shares_process: int | None = None  # timed runs of one cell with the same number run one after another in one
    # process (--repeats auto: harness.run.runner.UntilDecided); None: a timed run has a process of its own
    auto_round: int | None = None  # --repeats auto: the round of UntilDecided it belongs to (0: the first)

    def resolved_spec(self) -> ModelSpec:
        return validate(self.spec, self.model)


def run_seed(spec, repeat: int) -> int:
    """The seed of a timed run's repeat: the spec's seed plus the repeat, for its initial weights, batch order
    and dropout masks, so repeats are independent draws and repeat r is the same draw in every precision and
    framework (a pair). The dataset and its split keep the spec's seed; so does the spec hash."""
    seed = spec.seed + repeat
    if seed >= SEED_LIMIT:
        raise HarnessError(f"{spec.name}: seed {spec.seed} + repeat {repeat} = {seed}, past {SEED_LIMIT - 1}, the "
                           f"largest seed numpy's generators take; lower the spec's seed or the repeats")
    return seed


def run(req: RunRequest, progress=None) -> dict:
    started = time.time()
    record = empty_record(run_id=req.run_id, framework=req.framework, precision=req.precision, repeat=req.repeat,
                          started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          warmup_steps=req.warmup, env=measure.environment(req.threads), auto_round=req.auto_round)
    try:
        spec = req.resolved_spec()
        graph = infer(spec)
        precision = parse_precision(req.precision)
        loss_scale = parse_loss_scale(req.loss_scale, precision, req.growth_interval)
        # untimed runs (fingerprints, diagnoses, profiles) keep the spec's seed: parity and goldens compare it
        seed = run_seed(spec, req.repeat if req.mode == "run" else 0)
        record.update(model=spec.name, spec_hash=spec.spec_hash(), num_classes=spec.classes, seed=seed,
                      **sequence_fields(spec),
                      batch_size=spec.batch_size, width=spec.width, steps=spec.steps,
                      study=req.study,
                      flops_per_step=graph.train_step_flops(spec.batch_size), param_count=graph.param_count,
                      loss_scale={"settings": loss_scale.to_dict()})
        adapter = load_adapter(req.framework)
        adapter.set_threads(req.threads)
        device = adapter.device(req.device)
        record.update(framework_version=adapter.framework_version(), device=device.name)
        record["env"].update(device=asdict(device))
        if device.kind == "gpu" and not req.force:  # its free memory as the framework counts it, now
            memory.check_device_free(spec, graph, precision, adapter.free_memory_mb(device),
                                     f"{device.name}'s free memory ({req.framework})")
        variant = req.variant or next(iter(adapter.variants))
        if variant not in adapter.variants and variant != variants.AUTO:
            raise HarnessError(f"{req.framework} has no variant '{variant}' (its variants: "
                               f"{', '.join(adapter.variants)})")
        record.update(variant=variant, state_memory_mb=state_memory_mb(graph, spec.optimizer, precision))
        reason = capability.unsupported(adapter, precision, device, in_process=True, loss_scale=loss_scale) or \
            (profile_refusal(adapter, device) if req.mode == "profile" else None)
        if reason:
            record.update(status="unsupported", reason=reason)  # variant "auto": none was chosen
            return record
        if variant == variants.AUTO:
            record["variant_choice"] = variants.choose(adapter, req, spec, precision, device)
            variant = record["variant"] = record["variant_choice"]["chosen"]
        data, masks = Data(spec, order_seed=seed), DropoutMasks(graph, seed)
        weights = initial_weights(graph, seed)
        buffers = data.train_batch(0), masks.for_step(0, spec.batch_size)  # refilled in place by every step
        baseline_kb = measure.reset_peak_rss()  # before the build: the figure holds weights and optimizer state
        trainer = adapter.build(spec, graph, weights, precision, loss_scale, device, variant)
        record["options"] = dict(trainer.options)
        if req.mode == "fingerprint":
            noise = RoundingNoise(graph.trainable_shapes(), spec.seed) \
                if precision.rounding is not None and precision.rounding.stochastic else None
            _fingerprint(spec, data, masks, trainer, loss_scale, record, noise)
        elif req.mode == "diagnose":
            diagnose(spec, data, masks, trainer, record, req.every, progress)
        elif req.mode == "profile":
            profile(spec, graph, data, masks, trainer, record, req.warmup, progress)
        else:
            diverged_at = _train(req, spec, data, masks, buffers, trainer, loss_scale, record, progress, baseline_kb)
            skipped_at = record["loss_scale"].get("first_overflow_step") if req.nonfinite else None
            if diverged_at is not None or skipped_at is not None:
                del trainer  # the replay builds its own from the same weights
                at = diverged_at if diverged_at is not None else skipped_at
                history = record["loss_scale"].get("history") or []
                record["nonfinite"] = nonfinite.locate(  # (fresh weights: a framework may train the given arrays)
                    lambda: adapter.build(spec, graph, initial_weights(graph, seed), precision, loss_scale, device,
                                          variant), graph,
                    Data(spec, order_seed=seed), DropoutMasks(graph, seed), at,
                    scale=(history[at - 1] if at else loss_scale.initial) if history else None,
                    compute_dtype=precision.compute_dtype, weight_dtype=precision.param_dtype,
                    epsilon=nonfinite.lost_epsilon(spec.optimizer, precision))
            if record["status"] == "ok" and req.measure_peak:
                _efficiency(adapter, device, precision, req.threads, record, step_matmuls(graph, spec.batch_size))
    except HarnessError as exc:
        record.update(status="failed", reason=str(exc))
    except Exception as exc:  # a framework error: keep the run's record, with the cause
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        record.update(status="failed", reason=f"{one_line(exc)}{where}")
        traceback.print_exc()
    finally:
        record["wall_s"] = round(time.time() - started, 3)
    return record


RSS_KIND = ("process peak RSS (VmHWM) above its level before the model was built: weights, gradients, optimizer "
            "state, activations and the framework's workspace; not the input pipeline")


def _efficiency(adapter, device, precision, threads, record, matmuls=()) -> None:
    """The run's achieved FLOP/s as a share of this device's matmul peak in the run's compute dtype; a scaling
    study's run also holds the device's matmul curve per dtype (harness.run.peak.matmul_curves), which its
    section reads beside the model's rate at each size, and the rate of each of its step's own matmuls
    (`matmuls`: harness.model.graph.step_matmuls) in its compute dtype, timed alone: how long the step's matmuls
    take by themselves, against the step's time."""
    from harness.identity import scaling_study  # (only here: the rest of the worker has no use for it)

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


def _train(req, spec, data, masks, buffers, trainer, loss_scale, record, progress, baseline_kb) -> int | None:
    """The timed run; the step whose loss was not finite when it diverged, else None."""
    total = req.warmup + spec.steps
    losses, times_ms, input_ms = [], [], []
    scales = LossScaleLog(loss_scale)
    status, reason, diverged_at = "ok", None, None
    for step in range(total):
        x, y = data.train_batch(step, out=buffers[0])
        dropout = masks.for_step(step, len(y), out=buffers[1])
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
        if progress:
            progress(step + 1, total)
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
        record["achieved_gflops"] = record["flops_per_step"] / (stats["median"] / 1e3) / 1e9
    device_peak = trainer.memory_peak_mb()
    if device_peak is not None:
        record["peak_memory_mb"], record["memory_kind"] = device_peak
    elif baseline_kb is not None:
        record["peak_memory_mb"] = (measure.peak_rss_kb() - baseline_kb) / 1024
        record["memory_kind"] = RSS_KIND
    if scales.history:
        record["loss_scale"].update(initial=loss_scale.initial, final=scales.history[-1],
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


def _fingerprint(spec, data, masks, trainer, loss_scale, record, noise: RoundingNoise | None = None) -> None:
    """What the parity check compares across frameworks: outputs on a fixed batch before and after
    `spec.steps` untimed training steps, and the loss (and loss scale) of every step. With `noise`
    (stochastically rounding precisions), every step rounds with the core's bits, so frameworks round alike."""
    x, _ = data.fixed_batch()
    initial = trainer.predict(x)
    losses, scales, gradients = [], LossScaleLog(loss_scale), None
    # every step through the capturing twin where the adapter has one, so that a compiled step is built once, not
    # twice (the kit proves the twin trains as the plain step does); the first step's gradients are fingerprinted
    capturing = True
    for step in range(spec.steps):
        bx, by = data.train_batch(step)
        if noise is not None:
            trainer.set_rounding_noise(noise.for_step(step))
        batch = trainer.to_device(bx, by, masks.for_step(step, len(by)))
        captured = trainer.captured_step(batch) if capturing else None
        if captured is None:
            capturing = False
            losses.append(trainer.train_step(batch))
        else:
            losses.append(captured[0])
            if step == 0:
                gradients = gradient_fingerprint(captured[1], spec.seed)
        scales.after_step(trainer, step)
    final = trainer.predict(x)
    finite = all(math.isfinite(v) for v in losses) and np.isfinite(final).all()
    record.update(status="ok" if finite else "diverged", reason=None if finite else "non-finite loss or outputs",
                  loss=[v if math.isfinite(v) else None for v in losses],
                  fingerprint={"initial_outputs": _listed(initial), "final_outputs": _listed(final),
                               "loss_scales": scales.history or None, "skipped_steps": scales.skipped,
                               "gradients": gradients,
                               "spec": spec.model_dump(mode="json")})  # what the golden fingerprints embed


FINGERPRINT_POSITIONS = 4  # of a sequence's outputs: tiny_gpt's [16, 64, 256] whole would make a 5 MB record


def _listed(a: np.ndarray) -> list:
    """Outputs as a fingerprint holds them: a row per sample; of sequence outputs [N, T, C], the outputs at
    FINGERPRINT_POSITIONS positions spread evenly from the first to the last (the kit's reference checks compare
    every position; a causal mask shifted by one changes the output at each of these)."""
    if a.ndim == 3:
        a = a[:, np.unique(np.linspace(0, a.shape[1] - 1, FINGERPRINT_POSITIONS).round().astype(int))]
    return [[v if math.isfinite(v) else None for v in row] for row in a.astype(float).reshape(len(a), -1).tolist()]


def describe(framework: str, device: str = "auto") -> dict:
    """What `amp-harness adapters` shows for one adapter: version, device, which precisions can run here (each
    proved by the capability probe, in a process of its own, unless the cache knows)."""
    from harness.precision import NATIVE, PRECISIONS, parse_precision

    adapter = load_adapter(framework)
    dev = adapter.device(device)
    # the FP8 precisions' native variants too: whether this framework's own FP8 matmuls run here
    precisions = {**PRECISIONS, **{f"{name}:{NATIVE}": parse_precision(f"{name}:{NATIVE}")
                                   for name, p in PRECISIONS.items() if p.fp8 is not None}}
    return {"framework": framework, "version": adapter.framework_version(), "device": asdict(dev),
            "precisions": {name: capability.unsupported(adapter, p, dev) for name, p in precisions.items()},
            "variants": adapter.variants}


def main(argv: list[str]) -> int:
    if argv[0] in ("describe", "capability"):  # one line of JSON: the answer, or the error that stopped it
        try:
            answer = describe(*argv[1:]) if argv[0] == "describe" else capability.probe_here(*argv[1:])
        except HarnessError as exc:
            answer = {"framework": argv[1], "error": str(exc)}
        print(json.dumps(answer))
        return 0
    request_path, record_path = argv
    requests = json.loads(Path(request_path).read_text())  # a list: runs that share this process (process.py)

    last = [0.0]

    def progress(step: int, total: int) -> None:  # a few lines a second at most: the runner shares the CPUs
        now = time.monotonic()
        if step == total or now - last[0] >= PROGRESS_INTERVAL_S:
            last[0] = now
            print(f"progress {step} {total}", flush=True)

    process = uuid.uuid4().hex[:16]  # what the runs of this process share (harness.stats.per_process)
    try:  # the framework's import, once, before any run's clock: a record's wall_s is the run's own time
        load_adapter(requests[0]["framework"])
    except HarnessError:
        pass  # the first run says why, in its record
    for i, request in enumerate(requests):
        record = run(RunRequest(**request), progress)
        record["process"] = process
        tmp = Path(f"{record_path}.{i}.tmp")
        tmp.write_text(json.dumps(record, default=str))
        tmp.replace(f"{record_path}.{i}")
        print(f"record {i}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
