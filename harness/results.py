"""The result record: the only interface between the runner and the reporter.

One JSON object per run, one per line in ``results.jsonl``. ``load`` turns any number of such files into a
pandas DataFrame with nested fields flattened to dotted columns (``step_time_ms.median``).
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterable

from harness.errors import HarnessError

MAX_RECORD_BYTES = 64 << 20  # a record with a diagnosis is at most a few MB; a longer line is not a record
RESULTS_FILE = "results.jsonl"
FINGERPRINTS_FILE = "fingerprints.jsonl"  # records of `amp-harness fingerprint`, for `amp-harness parity`
DIAGNOSES_FILE = "diagnoses.jsonl"  # records of `amp-harness diagnose`
PROFILES_FILE = "profiles.jsonl"  # records of `amp-harness profile`
SCHEMA_VERSION = 4  # 2: variant, state_memory_mb, device_peak_gflops, efficiency, study, diagnosis; 3: num_classes;
# 4: seed (a timed run's repeat r trains from the spec's seed + r)
STATUSES = ("ok", "unsupported", "failed", "diverged", "timeout")
NO_RESULT = ("failed", "timeout")  # a run that gave no result: --resume runs it again

#: every record carries these keys (None where a figure does not apply or was not reached)
FIELDS = (
    "schema", "run_id", "framework", "framework_version", "model", "spec_hash", "num_classes", "precision",
    "variant", "device",
    "status", "reason", "batch_size", "steps", "warmup_steps", "repeat", "seed", "step_time_ms", "step_times_ms",
    "samples_per_s", "first_step_ms", "input_ms", "peak_memory_mb", "memory_kind", "state_memory_mb", "loss",
    "final_train_loss", "eval_loss", "eval_accuracy", "loss_scale", "flops_per_step", "achieved_gflops",
    "device_peak_gflops", "efficiency", "param_count", "options", "env", "started_at", "wall_s", "study",
    "fingerprint", "diagnosis",
    "variant_choice",  # --variant auto: which variant was chosen and why (harness.run.variants)
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
    readers and other runners never see a half-written line.

    A line that cannot be written whole (a full disk, a file-size limit) is cut back off, so every record
    before it stays intact and the next append starts on a fresh line; the error says so in one line. A torn
    last line left by a crash in an earlier write is cut off the same way before appending: it held no
    complete record (read_records skips it), and `--resume` runs that run again."""
    path = out_dir / filename
    line = (json.dumps(record, allow_nan=False, default=str) + "\n").encode()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _unwritable(path, record, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = _whole_lines(fd)
        except OSError as exc:
            raise _unwritable(path, record, exc) from None
        try:
            written = os.write(fd, line)
            if written != len(line):  # a short write: the disk filled up mid-line
                os.write(fd, line[written:])  # raises the reason (ENOSPC, EFBIG); a success completes the line
            os.fsync(fd)
        except OSError as exc:
            os.ftruncate(fd, size)
            raise _unwritable(path, record, exc) from None
    finally:
        os.close(fd)


def prove_writable(out_dir: Path, filename: str = RESULTS_FILE, option: str = "--out") -> None:
    """HarnessError unless `filename` can be appended to in `out_dir` (made if missing): checked before the first
    run, so that a run is never trained only to find it has nowhere to go. An existing file is opened for
    appending (writing nothing); otherwise a nameless file is made in the directory and dropped, so no empty
    records file is left behind for a reader, or another runner sharing the directory, to find."""
    path = out_dir / filename
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise HarnessError(f"{path}: cannot write there: {out_dir} is a file, not a directory; give {option} "
                               f"a place this user can write")
        out_dir.mkdir(parents=True, exist_ok=True)
        if path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        else:
            tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as exc:
        raise HarnessError(f"{path}: cannot write there: {exc.strerror or exc}; give {option} a place this user "
                           f"can write") from None


def _whole_lines(fd: int) -> int:
    """The file's size without a torn last line (cut off here), under the caller's lock."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))  # a record line is far under 1 MiB
    keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
    if keep == 0 and size > len(tail):
        return size  # no line end in the last MiB: not our torn write; leave the file as it is
    try:
        json.loads(tail[tail.rfind(b"\n") + 1:])
    except ValueError:  # torn: drop it
        os.ftruncate(fd, keep)
        return keep
    os.write(fd, b"\n")  # a whole record without its line end (an edited file): keep it
    return size + 1


def _unwritable(path: Path, record: dict, exc: OSError) -> HarnessError:
    return HarnessError(f"{path}: cannot append the record of run {record.get('run_id')}: {exc.strerror or exc}; "
                        f"every record before it is intact; free space (or make the directory writable) and "
                        f"rerun with --resume")


def read_records(paths: Iterable[Path | str], filename: str = RESULTS_FILE) -> list[dict]:
    """Records from .jsonl files, or from directories holding `filename`: read line by line with a bound on a
    line's length, so a huge, binary, wrongly encoded or deeply nested file is one HarnessError naming the file
    and the line, in bounded memory."""
    records = []
    for path in map(Path, paths):
        file = path / filename if path.is_dir() else path
        if not file.exists():
            raise HarnessError(f"{file}: no such file" + (f" (no {filename} in {path})" if path.is_dir() else ""))
        try:
            with open(file, "rb") as f:
                records += _records(f, file)
        except OSError as exc:
            raise HarnessError(f"{file}: cannot read: {exc.strerror}") from None
    return records


def _records(f, file: Path) -> list[dict]:
    records, number = [], 0
    while True:
        raw = f.readline(MAX_RECORD_BYTES + 1)
        if not raw:
            return records
        number += 1
        if len(raw) > MAX_RECORD_BYTES:
            raise HarnessError(f"{file}: line {number}: longer than {MAX_RECORD_BYTES >> 20} MiB: not a record")
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise HarnessError(f"{file}: line {number}: byte {exc.start}: not UTF-8 text") from None
        except RecursionError:
            raise HarnessError(f"{file}: line {number}: nested too deeply: not a record") from None
        except json.JSONDecodeError as exc:
            if not raw.endswith(b"\n") and not f.read(1):  # a write cut short by a crash
                print(f"note: {file}: skipped a partial last line (an interrupted write)", file=sys.stderr)
                continue
            raise HarnessError(f"{file}: line {number}: not a JSON record ({exc.msg})") from None
        if not isinstance(record, dict) or "run_id" not in record:
            raise HarnessError(f"{file}: line {number}: not a result record (no run_id)")
        records.append(record)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _text(v) -> bool:
    return isinstance(v, str)


def _maybe(check):
    return lambda v: v is None or check(v)


def _listed(check, v) -> bool:
    return isinstance(v, list) and all(check(x) for x in v)


def _mapped(check, v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and check(x) for k, x in v.items())


def _rows(v) -> bool:
    """Outputs as a fingerprint holds them: a row of numbers (None where not finite) per sample."""
    return _listed(lambda row: _listed(_maybe(_number), row), v)


def _histogram(h) -> bool:
    """harness.numerics.histogram: counts per power-of-two exponent (JSON keys are strings), zeros, ..."""
    bins = h.get("bins") if isinstance(h, dict) else None
    return isinstance(bins, dict) and all(_exponent(e) and _count(c) for e, c in bins.items()) \
        and all(_count(h.get(k)) for k in ("zeros", "nonfinite", "count")) and _number(h.get("max_abs"))


def _exponent(e) -> bool:
    """A histogram's bin: a float's power-of-two exponent, an int in memory and a string once in JSON."""
    return isinstance(e, int) and not isinstance(e, bool) and abs(e) < 100_000 \
        or isinstance(e, str) and re.fullmatch(r"-?[0-9]{1,5}", e) is not None


def _diagnosis(d) -> bool:
    """What harness.run.diagnose writes and the report and `parity` read (harness.numerics.judge)."""
    if not isinstance(d, dict) or not isinstance(d.get("available"), bool):
        return False
    if not d["available"]:
        return True
    window = d.get("loss_scale_window")
    return _listed(_count, d.get("captured_steps")) and bool(d["captured_steps"]) and _maybe(_count)(d.get("every")) \
        and _mapped(lambda group: _mapped(_histogram, group), d.get("groups")) \
        and _maybe(lambda u: _mapped(lambda c: _mapped(_number, c), u))(d.get("updates")) \
        and _maybe(_text)(d.get("optimizer")) and _maybe(lambda v: _mapped(_text, v))(d.get("verdicts")) \
        and (window is None or isinstance(window, list) and len(window) == 2
             and all(_maybe(_number)(x) for x in window))


def _fingerprint(f) -> bool:
    """What a fingerprint run writes (harness.run.worker._fingerprint) and `parity` compares."""
    return isinstance(f, dict) and _rows(f.get("initial_outputs")) and _rows(f.get("final_outputs")) \
        and _maybe(lambda v: _listed(_count, v))(f.get("skipped_steps")) \
        and _maybe(lambda v: _listed(_number, v))(f.get("loss_scales")) \
        and _maybe(lambda g: _mapped(lambda v: _listed(_number, v), g))(f.get("gradients")) \
        and _maybe(lambda v: isinstance(v, dict))(f.get("spec"))


def _profile(p) -> bool:
    """A profile as harness.run.profile writes it and the report's "Where the time goes" reads it."""
    return isinstance(p, dict) and _number(p.get("step_mean_ms")) and p["step_mean_ms"] > 0 \
        and _count(p.get("steps")) and all(_maybe(_text)(p.get(k)) for k in ("tool", "note")) \
        and _maybe(_number)(p.get("coverage")) \
        and _mapped(_number, p.get("parts")) and all(k in p["parts"] for k in ("casts", "other")) \
        and _listed(_profiled_layer, p.get("layers"))


def _profiled_layer(layer) -> bool:
    return isinstance(layer, dict) and all(_text(layer.get(k)) for k in ("path", "label", "type")) \
        and _number(layer.get("forward_ms")) and _number(layer.get("backward_ms")) \
        and _maybe(_text)(layer.get("compute"))


#: what a field must be when present (not None) for a report to read it; a record breaking one is skipped
SHAPES = {
    "run_id": lambda v: isinstance(v, str), "framework": lambda v: isinstance(v, str),
    "precision": lambda v: isinstance(v, str), "status": lambda v: v in STATUSES,
    "model": lambda v: isinstance(v, str), "spec_hash": lambda v: isinstance(v, str),
    "variant": lambda v: isinstance(v, str), "device": lambda v: isinstance(v, str),
    "reason": lambda v: isinstance(v, str), "study": lambda v: isinstance(v, str),
    "schema": lambda v: isinstance(v, int), "repeat": lambda v: isinstance(v, int),
    "seed": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "batch_size": lambda v: isinstance(v, int) and v > 0, "steps": lambda v: isinstance(v, int),
    "num_classes": lambda v: isinstance(v, int),
    "step_times_ms": lambda v: isinstance(v, list) and all(_number(t) and t > 0 for t in v),
    "loss": lambda v: isinstance(v, list) and all(t is None or _number(t) for t in v),
    **{k: _number for k in ("first_step_ms", "peak_memory_mb", "eval_accuracy", "eval_loss", "flops_per_step",
                            "efficiency", "samples_per_s", "achieved_gflops", "final_train_loss", "input_ms",
                            "param_count", "wall_s")},
    **{k: lambda v: isinstance(v, dict) for k in ("options", "step_time_ms")},
    "fingerprint": _fingerprint, "diagnosis": _diagnosis, "profile": _profile,  # the records of the other files
    **{k: lambda v: isinstance(v, dict) and all(x is None or _number(x) for x in v.values())
       for k in ("state_memory_mb", "device_peak_gflops")},
    "env": lambda v: isinstance(v, dict) and isinstance(v.get("device") or {}, dict)
    and (v.get("threads") is None or isinstance(v["threads"], int)),
    "loss_scale": lambda v: isinstance(v, dict) and _loss_scale_settings(v.get("settings")),
}


def _loss_scale_settings(s) -> bool:
    return s is None or isinstance(s, dict) and s.get("mode") in (None, "none", "fixed", "dynamic") \
        and all(s.get(k) is None or _number(s[k]) for k in ("initial", "growth_interval", "growth_factor",
                                                               "backoff_factor"))


def _malformed(r: dict) -> str | None:
    """The first field a report cannot read, or None."""
    return next((k for k, ok in SHAPES.items() if r.get(k) is not None and not ok(r[k])), None)


def record_key(r: dict) -> tuple:
    """What identifies a run across attempts (--resume): framework, spec hash, precision, variant, loss-scale
    setting (harness.precision.loss_scale_key) and repeat."""
    from harness.precision import loss_scale_key

    return (r["framework"], r.get("spec_hash"), r["precision"], r.get("variant"),
            loss_scale_key((r.get("loss_scale") or {}).get("settings")), r.get("repeat"))


#: per records file, what its ok records hold besides what identifies a run: what the report and `parity` read
OK_HOLDS = {RESULTS_FILE: ("model", "batch_size"), FINGERPRINTS_FILE: ("model", "fingerprint", "loss"),
            DIAGNOSES_FILE: ("model", "diagnosis"), PROFILES_FILE: ("model", "profile")}


def usable(records: list[dict], filename: str = RESULTS_FILE) -> tuple[list[dict], list[str]]:
    """Records of `filename` (results, fingerprints, diagnoses or profiles) a report can use, and why the others
    were skipped: duplicates (the same run_id twice, e.g. a file given twice), records of a newer schema, records
    missing the fields that identify a run (or, when ok, what such a file's ok record holds: OK_HOLDS), and
    records whose fields are not of the kind a record holds (SHAPES)."""
    kept, seen, skipped = [], set(), {}
    for r in records:
        if any(r.get(k) is None for k in ("run_id", "framework", "precision", "status")):
            why = "missing run_id, framework, precision or status"
        elif r["status"] == "ok" and (missing := [k for k in OK_HOLDS[filename] if r.get(k) is None]):
            why = f"ok but missing {', '.join(missing)}"
        elif field := _malformed(r):
            why = f"{field} is not what a record holds there"
        elif (r.get("schema") or SCHEMA_VERSION) > SCHEMA_VERSION:
            why = f"written by a newer amp-harness (schema {r.get('schema')})"
        elif r["run_id"] in seen:
            why = "duplicate run_id"
        else:
            seen.add(r["run_id"])
            kept.append(r)
            continue
        skipped[why] = skipped.get(why, 0) + 1
    retried = {record_key(r) for r in kept if r["status"] not in NO_RESULT}
    fresh = [r for r in kept if not (r["status"] in NO_RESULT and record_key(r) in retried)]
    if len(fresh) < len(kept):  # --resume ran them again and they gave a result
        skipped["failed, then run again by --resume"] = len(kept) - len(fresh)
    kept = fresh
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
