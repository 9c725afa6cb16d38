"""Records files: the only interface between the runner and the reporter.

One JSON object per run, one per line in ``results.jsonl`` (and in the fingerprints, diagnoses and profiles files).
What a record holds is harness.records' model of its kind; what identifies a run, harness.identity. ``load`` turns
any number of results files into a pandas DataFrame with nested fields flattened to dotted columns
(``step_time_ms.median``).
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable

from pydantic import ValidationError

from harness.errors import HarnessError
from harness.identity import run_key
from harness.records import (
    OLDEST_SCHEMA,
    SCHEMA_VERSION,
    DiagnosisRecord,
    FingerprintRecord,
    ProfileRecord,
    Record,
    RunRecord,
    problem,
)

MAX_RECORD_BYTES = 64 << 20  # a record with a diagnosis is at most a few MB; a longer line is not a record
RESULTS_FILE = "results.jsonl"
FINGERPRINTS_FILE = "fingerprints.jsonl"  # records of `amp-harness fingerprint`, for `amp-harness parity`
DIAGNOSES_FILE = "diagnoses.jsonl"  # records of `amp-harness diagnose`
PROFILES_FILE = "profiles.jsonl"  # records of `amp-harness profile`
NO_RESULT = ("failed", "timeout")  # a run that gave no result: --resume runs it again
#: the model of each records file's records
KINDS: dict[str, type[Record]] = {RESULTS_FILE: RunRecord, FINGERPRINTS_FILE: FingerprintRecord,
                                  DIAGNOSES_FILE: DiagnosisRecord, PROFILES_FILE: ProfileRecord}


def auto_timing(records: list[dict]) -> list[tuple[float, str | None, int]]:
    """A `--repeats auto` cell's timed repeats, each (median step ms, process, round), as its sequential test
    weighs them (harness.run.runner.UntilDecided, and the report replaying it): its ok runs, but for one whose own
    process measured the variants before its timed steps (`--variant auto` on a machine new to it: compiling and
    timing other ways to run the step leaves that process busier than a repeat's; tiny_gpt's fp32 step timed 38%
    slower there in torch), whose record keeps its figures."""
    return [(r["step_time_ms"]["median"], r.get("process"), r.get("auto_round") or 0) for r in records
            if r["status"] == "ok" and (r.get("variant_choice") or {}).get("cached", True)]


def sequence_fields(spec) -> dict:
    """What a record says of a spec's task and tokens (schema 5)."""
    return {"task": spec.task, "tokens_per_sample": spec.input.shape[0] if spec.tokens else None}


def empty_record(**known) -> dict:
    """A record with every field a record is written with (harness.records.Record) None but `known`."""
    record = dict.fromkeys(Record.fields())
    record.update(schema=SCHEMA_VERSION, **known)
    unknown = set(record) - set(Record.fields())
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
        version = record.get("schema")
        if isinstance(version, int) and not isinstance(version, bool) \
                and not OLDEST_SCHEMA <= version <= SCHEMA_VERSION:
            raise HarnessError(f"{file}: line {number}: schema {version}: "
                               + ("written by a newer amp-harness" if version > SCHEMA_VERSION else "not a schema")
                               + f"; this one reads records of schemas {OLDEST_SCHEMA} to {SCHEMA_VERSION}")
        records.append(record)


def usable(records: list[dict], filename: str = RESULTS_FILE) -> tuple[list[dict], list[str]]:
    """Records of `filename` (results, fingerprints, diagnoses or profiles) a report can use, as written, and why
    the others were skipped (typed says which)."""
    kept, notes = typed(records, filename)
    return [r.written for r in kept], notes


def typed(records: list[dict], filename: str = RESULTS_FILE) -> tuple[list[Record], list[str]]:
    """Records of `filename` (results, fingerprints, diagnoses or profiles) a report can use, as the model of the
    file's kind (harness.records: what the report reads), and why the others were skipped: records that are not
    what that kind of record holds (a missing field that identifies a run, an ok record missing what the report
    reads, a field of the wrong kind), duplicates (the same run_id twice, e.g. a file given twice), and failed runs
    that --resume ran again with a result (harness.identity.run_key)."""
    kind = KINDS[filename]
    kept, seen, skipped = [], set(), {}
    for r in records:
        try:
            model = kind.model_validate(r)
        except ValidationError as exc:
            why = problem(exc, kind)
        else:
            if model.run_id not in seen:
                seen.add(model.run_id)
                kept.append(model)
                continue
            why = "duplicate run_id"
        skipped[why] = skipped.get(why, 0) + 1
    retried = {run_key(r.written) for r in kept if r.status not in NO_RESULT}
    fresh = [r for r in kept if not (r.status in NO_RESULT and run_key(r.written) in retried)]
    if len(fresh) < len(kept):  # --resume ran them again and they gave a result
        skipped["failed, then run again by --resume"] = len(kept) - len(fresh)
    return fresh, [f"{n} record{'s' if n > 1 else ''} skipped: {why}" for why, n in skipped.items()]


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
