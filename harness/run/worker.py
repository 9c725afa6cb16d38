"""Runs in their own process: ``python -m harness.run.worker REQUESTS.json RECORD.json``.

The runner starts this module once per timed run (framework, model, precision, repeat) so that process-wide
framework state (mixed-precision policies, MXNet's AMP patching, allocator peaks) never leaks between precisions;
untimed runs (fingerprints, diagnoses) of one framework and precision share a process, and so may the repeats of
one timed cell (`--repeats auto`: each builds its own trainer from its own seed; every record names its process).
REQUESTS.json is a list; the record of request i is written as JSON to RECORD.json.i, then ``record i`` goes to
stdout; progress goes there as ``progress STEP TOTAL`` lines.

Every run is built here the same way (its spec, precision, loss scale, seed, adapter, device, variant, data,
masks, weights and trainer); what it then does is its mode's Work (harness.run.modes).
"""
from __future__ import annotations

import json
import sys
import time
import traceback
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from harness.adapter import load_adapter
from harness.errors import HarnessError, one_line
from harness.microscaling import block_refusal, matmul_weights
from harness.model import memory
from harness.model.data import Data
from harness.model.dropout import DropoutMasks
from harness.model.graph import infer, state_memory_mb
from harness.precision import parse_loss_scale, parse_precision
from harness.results import empty_record, sequence_fields
from harness.run import capability, measure, modes, native, variants
from harness.run.request import BuiltRun, RunRequest

PROGRESS_INTERVAL_S = 0.25
SEED_LIMIT = 2**32  # numpy's generators take seeds below it (as ModelSpec.seed)


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
    """The run's record: built here, then filled by its mode's Work; a failure is a record too, with its reason."""
    started = time.time()
    record = empty_record(run_id=req.run_id, framework=req.framework, precision=req.precision, repeat=req.repeat,
                          started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          warmup_steps=req.warmup, env=measure.environment(req.threads), auto_round=req.auto_round)
    try:
        work = modes.work(req.mode)
        spec = req.resolved_spec()
        graph = infer(spec) if spec.native is None else None  # a native model's is known once built
        precision = parse_precision(req.precision)
        loss_scale = parse_loss_scale(req.loss_scale, precision, req.growth_interval)
        seed = run_seed(spec, req.repeat if work.seed_per_repeat else 0)
        record.update(model=spec.name, spec_hash=spec.spec_hash(), num_classes=spec.classes, seed=seed,
                      **sequence_fields(spec),
                      batch_size=spec.batch_size, width=spec.width, steps=spec.steps,
                      study=req.study,
                      flops_per_step=graph.train_step_flops(spec.batch_size) if graph else None,
                      param_count=graph.param_count if graph else None,
                      matmul_weights=matmul_weights(graph) if graph else None,
                      loss_scale={"settings": loss_scale.to_dict()})
        adapter = load_adapter(req.framework)
        adapter.set_threads(req.threads)
        device = adapter.device(req.device)
        record.update(framework_version=adapter.framework_version(), device=device.name)
        record["env"].update(device=asdict(device))
        if device.kind == "gpu" and not req.force and graph:  # its free memory as the framework counts it, now
            memory.check_device_free(spec, graph, precision, adapter.free_memory_mb(device),
                                     f"{device.name}'s free memory ({req.framework})")
        variant = req.variant or next(iter(adapter.variants))
        if variant not in adapter.variants and variant != variants.AUTO:
            raise HarnessError(f"{req.framework} has no variant '{variant}' (its variants: "
                               f"{', '.join(adapter.variants)})")
        record.update(variant=variant,
                      state_memory_mb=state_memory_mb(graph, spec.optimizer, precision) if graph else None)
        reason = capability.unsupported(adapter, precision, device, in_process=True, loss_scale=loss_scale) or \
            (work.refusal(adapter, device) if work.refusal is not None else None) or \
            (native.refusal(adapter, precision) if graph is None else None) or \
            (block_refusal(precision.blocks, graph, spec.batch_size) if precision.blocks else None)
        if reason:
            record.update(status="unsupported", reason=reason)  # variant "auto": none was chosen
            return record
        if variant == variants.AUTO:
            record["variant_choice"] = variants.choose(adapter, req, spec, precision, device)
            variant = record["variant"] = record["variant_choice"]["chosen"]
        data, masks = Data(spec, order_seed=seed), DropoutMasks(graph, seed)
        buffers = data.train_batch(0), masks.for_step(0, spec.batch_size)  # refilled in place by every step
        baseline_kb = measure.reset_peak_rss()  # before the build: the figure holds weights and optimizer state
        built = BuiltRun(req, spec, graph, precision, loss_scale, seed, adapter, device, variant, data, masks, buffers,
                         baseline_kb, None, record, progress, layers=graph)
        # the trainer is held by the BuiltRun alone, so that a Work can release it (a replay builds its own)
        built.trainer = built.fresh_trainer()
        record["options"] = dict(built.trainer.options)
        native_info = built.trainer.native_info() if graph is None else None  # outlives a released trainer
        if native_info is not None:
            built.layers = native.describe_built(native_info, spec, precision, record)
        work.run(built)
        if native_info is not None:
            native.describe_trained(native_info, record)
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


def adapter_info(framework: str, device: str = "auto") -> dict:
    """What `amp-harness adapters` shows for one adapter: version, device, which precisions can run here (each
    proved by the capability probe, in a process of its own, unless the cache knows)."""
    from harness.precision import NATIVE, PRECISIONS

    adapter = load_adapter(framework)
    dev = adapter.device(device)
    # the FP8 precisions' native variants too: whether this framework's own FP8 matmuls run here
    precisions = {**PRECISIONS, **{f"{name}:{NATIVE}": parse_precision(f"{name}:{NATIVE}")
                                   for name, p in PRECISIONS.items() if p.fp8 is not None}}
    return {"framework": framework, "version": adapter.framework_version(), "device": asdict(dev),
            "precisions": {name: capability.unsupported(adapter, p, dev) for name, p in precisions.items()},
            "variants": adapter.variants}


ANSWERS = {"adapter": adapter_info, "capability": capability.probe_here, "native": native.check_here}


def main(argv: list[str]) -> int:
    if argv[0] in ANSWERS:  # one line of JSON: the answer, or the error that stopped it
        try:
            answer = ANSWERS[argv[0]](*argv[1:])
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
