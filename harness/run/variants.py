"""`--variant auto`: the fastest of the framework's variants (Adapter.variants) for a run, measured on this machine.

Which variant is fastest depends on the machine (torch's channels_last is slower than NCHW for a convnet in
amp_bf16 on a CPU without AVX-512), so no fixed default can be the best everywhere. Each variant takes
WARMUP_STEPS untimed and TIMED_STEPS timed steps of the run's own training step (its model, precision, batch
size, loss scale, device and threads: the worker's own loop), each in a process of its own, since a variant may
change a framework's process-wide state (MXNet's AMP, torch.compile); the lowest median step time wins. The
choice is measured once per machine and kept (harness.run.cache, "variants"), keyed by framework and version,
spec hash, precision, threads, CPU model and device, as the device's peaks (harness.run.peak) and capabilities
(harness.run.capability) are.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

from harness.errors import clip
from harness.run.cache import cached
from harness.run.measure import cpu_info

AUTO = "auto"
KIND = "variants"
WARMUP_STEPS, TIMED_STEPS = 3, 10  # TorchBench times 10 steps after 3
SUBPROCESS_TIMEOUT_S = 1200  # a compiling variant's first steps take minutes on a slow CPU


def key(adapter, spec, precision, device, threads: int) -> str:
    """The spec as measured (TIMED_STEPS steps), so runs of any length share the measurement."""
    measured = spec.with_overrides(None, TIMED_STEPS, None)
    return json.dumps([adapter.name, adapter.framework_version(), measured.spec_hash(), precision.name, threads,
                       cpu_info()[0], device.name, device.description])


def choose(adapter, req, spec, precision, device) -> dict:
    """The record's `variant_choice`: {"chosen", "ms_per_step" (None: the variant failed, see "failed"), "how",
    "measured_at", "cached", "measure_s"} for the run `req` (a worker.RunRequest), from the cache or measured now;
    "measure_s": the seconds this run spent measuring (0 when cached), which `--repeats auto` leaves out of its
    estimate of the next run's time."""
    measured = []

    def measure() -> dict:
        measured.append(True)
        return measure_variants(adapter, req)

    started = time.monotonic()
    choice = cached(KIND, key(adapter, spec, precision, device, req.threads), measure)
    return {**choice, "cached": not measured, "measure_s": round(time.monotonic() - started, 3) if measured else 0.0}


def measure_variants(adapter, req) -> dict:
    ms, failed = {}, {}
    for variant in adapter.variants:
        ms[variant], why = _time_in_child(req, variant)
        if why:
            failed[variant] = why
    timed = {v: t for v, t in ms.items() if t is not None}
    how = (f"measured once on this machine: {WARMUP_STEPS} warm-up and {TIMED_STEPS} timed training steps of the "
           f"run's model with each variant, each in a process of its own; the lowest median step time wins")
    if not timed:
        how += "; every variant failed, so the adapter's first"
    return {"chosen": min(timed, key=timed.get) if timed else next(iter(adapter.variants)), "ms_per_step": ms,
            "failed": failed or None, "how": how,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _time_in_child(req, variant: str) -> tuple[float | None, str | None]:
    """The median ms per step of `variant` in a worker process of its own, or None and why it gave none."""
    short = replace(req, variant=variant, spec={**req.spec, "steps": TIMED_STEPS}, warmup=WARMUP_STEPS, mode="run",
                    measure_peak=False, run_id=f"{req.run_id}-variant-{variant}")
    with tempfile.TemporaryDirectory(prefix="amp-harness-variant-") as tmp:
        request_file, record_file = Path(tmp) / "request.json", Path(tmp) / "record.json"
        request_file.write_text(json.dumps([asdict(short)]))
        try:
            out = subprocess.run([sys.executable, "-m", "harness.run.worker", str(request_file), str(record_file)],
                                 capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None, f"no answer within {SUBPROCESS_TIMEOUT_S} s"
        try:
            record = json.loads(Path(f"{record_file}.0").read_text())
        except (OSError, ValueError):
            last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
            return None, f"the worker ended without a record: {clip(last, 200)}"
    if record["status"] != "ok":
        return None, f"{record['status']}: {record.get('reason')}"
    return record["step_time_ms"]["median"], None
