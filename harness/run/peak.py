"""This device's matrix-multiply peak per dtype: what a run's achieved FLOP/s is read against (its efficiency).

Measured through the run's own framework (Adapter.matmul) on square matrices grown until one product takes
at least MIN_PRODUCT_S, as the median of REPEATS products, and cached per machine in
``$AMP_HARNESS_CACHE/peaks.json`` (default ``~/.cache/amp-harness``), keyed by framework and version, device,
CPU and threads: the CPU model changes between machines, and a figure from another one means nothing here.
"""
from __future__ import annotations

import fcntl
import json
import os
import statistics
import time
from pathlib import Path

from harness.run.measure import cpu_info

DTYPES = ("float32", "bfloat16", "float16")
MIN_PRODUCT_S = 0.05
MAX_N = 8192
REPEATS = 5


def cache_file() -> Path:
    return Path(os.environ.get("AMP_HARNESS_CACHE") or Path.home() / ".cache" / "amp-harness") / "peaks.json"


def device_peaks(adapter, device, threads: int) -> dict[str, float | None]:
    """GFLOP/s of an n x n matmul per dtype (None where the framework has no kernel for it here)."""
    key = json.dumps([adapter.name, adapter.framework_version(), device.name, device.description, cpu_info()[0],
                      threads])
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # runs on one machine measure one at a time, and once
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        if key not in cache:
            cache[key] = {dtype: matmul_gflops(adapter, device, dtype) for dtype in DTYPES}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        return cache[key]


def _seconds(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def matmul_gflops(adapter, device, dtype: str) -> float | None:
    n = 256
    while True:
        run = adapter.matmul(n, dtype, device)
        if run is None:
            return None
        run()  # warm-up: kernels chosen, memory allocated
        if _seconds(run) >= MIN_PRODUCT_S or n >= MAX_N:
            break
        n *= 2
    return 2 * n**3 / statistics.median(_seconds(run) for _ in range(REPEATS)) / 1e9
