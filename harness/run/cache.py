"""Facts measured once per machine and kept: the device's matmul peaks (harness.run.peak) and what each precision
can run (harness.run.capability).

Each kind is one JSON file in ``$AMP_HARNESS_CACHE`` (default ``~/.cache/amp-harness``), mapping a key that names
everything the fact depends on (framework and version, device, CPU model and flags, ...) to the fact. Processes on
one machine compute a missing fact one at a time, and once: the file's lock is held while it is computed.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any, Callable

MISSING = object()


def cache_file(kind: str) -> Path:
    return Path(os.environ.get("AMP_HARNESS_CACHE") or Path.home() / ".cache" / "amp-harness") / f"{kind}.json"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def lookup(kind: str, key: str) -> Any:
    """The cached fact, or MISSING. Writes replace the file whole, so reading needs no lock."""
    return _read(cache_file(kind)).get(key, MISSING)


def cached(kind: str, key: str, compute: Callable[[], Any]) -> Any:
    """The fact under `key`, computed by `compute()` (JSON-serialisable) and stored if it is not there yet."""
    path = cache_file(kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = _read(path)
        if key not in cache:
            cache[key] = compute()
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        return cache[key]
