"""The result record: the only interface between the runner and the reporter.

One JSON object per run, one per line in ``results.jsonl``. ``load`` turns any number of such files into a
pandas DataFrame with nested fields flattened to dotted columns (``step_time_ms.median``).
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Iterable

from harness.errors import HarnessError

RESULTS_FILE = "results.jsonl"
FINGERPRINTS_FILE = "fingerprints.jsonl"  # records of `amp-harness fingerprint`, for `amp-harness parity`
DIAGNOSES_FILE = "diagnoses.jsonl"  # records of `amp-harness diagnose`
SCHEMA_VERSION = 3  # 2: variant, state_memory_mb, device_peak_gflops, efficiency, study, diagnosis; 3: num_classes
STATUSES = ("ok", "unsupported", "failed", "diverged", "timeout")

#: every record carries these keys (None where a figure does not apply or was not reached)
FIELDS = (
    "schema", "run_id", "framework", "framework_version", "model", "spec_hash", "num_classes", "precision",
    "variant", "device",
    "status", "reason", "batch_size", "steps", "warmup_steps", "repeat", "step_time_ms", "step_times_ms",
    "samples_per_s", "first_step_ms", "input_ms", "peak_memory_mb", "memory_kind", "state_memory_mb", "loss",
    "final_train_loss", "eval_loss", "eval_accuracy", "loss_scale", "flops_per_step", "achieved_gflops",
    "device_peak_gflops", "efficiency", "param_count", "options", "env", "started_at", "wall_s", "study",
    "fingerprint", "diagnosis",
)


def empty_record(**known) -> dict:
    record = dict.fromkeys(FIELDS)
    record.update(schema=SCHEMA_VERSION, **known)
    unknown = set(record) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown record fields: {sorted(unknown)}")
    return record


def append(out_dir: Path, record: dict, filename: str = RESULTS_FILE) -> None:
    """Append one record as one line, under an exclusive lock, with a single write and fsync, so that
    readers and other runners never see a half-written line."""
    out_dir.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, allow_nan=False, default=str) + "\n").encode()
    fd = os.open(out_dir / filename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(paths: Iterable[Path | str], filename: str = RESULTS_FILE) -> list[dict]:
    """Records from .jsonl files, or from directories holding `filename`."""
    records = []
    for path in map(Path, paths):
        file = path / filename if path.is_dir() else path
        if not file.exists():
            raise HarnessError(f"{file}: no such file" + (f" (no {filename} in {path})" if path.is_dir() else ""))
        text = file.read_text()
        lines = text.splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if number == len(lines) and not text.endswith("\n"):  # a write cut short by a crash
                    print(f"note: {file}: skipped a partial last line (an interrupted write)", file=sys.stderr)
                    continue
                raise HarnessError(f"{file}: line {number}: not a JSON record ({exc.msg})") from None
            if not isinstance(record, dict) or "run_id" not in record:
                raise HarnessError(f"{file}: line {number}: not a result record (no run_id)")
            records.append(record)
    return records


def usable(records: list[dict]) -> tuple[list[dict], list[str]]:
    """Records a report can use, and why the others were skipped: duplicates (the same run_id twice, e.g. a
    file given twice), records of a newer schema, and records missing the fields that identify a run."""
    kept, seen, skipped = [], set(), {}
    for r in records:
        if r.get("schema", SCHEMA_VERSION) > SCHEMA_VERSION:
            why = f"written by a newer amp-harness (schema {r.get('schema')})"
        elif any(r.get(k) is None for k in ("run_id", "framework", "precision", "status")):
            why = "missing run_id, framework, precision or status"
        elif r["run_id"] in seen:
            why = "duplicate run_id"
        else:
            seen.add(r["run_id"])
            kept.append(r)
            continue
        skipped[why] = skipped.get(why, 0) + 1
    return kept, [f"{n} record{'s' if n > 1 else ''} skipped: {why}" for why, n in skipped.items()]


def _flatten(record: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("options",):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def to_frame(records: list[dict]):
    """A DataFrame of records, one row per run, nested fields flattened to dotted column names."""
    import pandas as pd

    return pd.DataFrame([_flatten(r) for r in records])


def load(paths: Iterable[Path | str]):
    """The records of results.jsonl files (or directories holding one) as a DataFrame (see to_frame)."""
    return to_frame(read_records(paths))
