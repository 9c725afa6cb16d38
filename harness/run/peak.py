"""This device's matrix-multiply peak per dtype: what a run's achieved FLOP/s is read against (its efficiency).

Measured through the run's own framework (Adapter.matmul) on square matrices grown until one product takes
at least MIN_PRODUCT_S, as the median of REPEATS products, and cached per machine (harness.run.cache, "peaks"),
keyed by framework and version, device, CPU, threads and TF32: the CPU model changes between machines, and a
figure from another one means nothing here; a float32 matmul with TF32 on is a different figure (measured after
the run's build, so in the math mode the run set), and a strict-fp32 run must not be read against it.
"""
from __future__ import annotations

import json
import statistics
import time

from harness.run.cache import cached
from harness.run.measure import cpu_info

DTYPES = ("float32", "bfloat16", "float16")
MIN_PRODUCT_S = 0.05
MAX_N = 8192
REPEATS = 5


def device_peaks(adapter, device, threads: int, tf32: bool) -> dict[str, float | None]:
    """GFLOP/s of an n x n matmul per dtype (None where the framework has no kernel for it here), in the math
    mode the process is in: `tf32` says which (the run's precision.tf32)."""
    key = json.dumps([adapter.name, adapter.framework_version(), device.name, device.description, cpu_info()[0],
                      threads, "tf32" if tf32 else "strict fp32"])
    return cached("peaks", key, lambda: {dtype: matmul_gflops(adapter, device, dtype) for dtype in DTYPES})


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
