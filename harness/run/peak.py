"""This device's matrix-multiply peak per dtype: what a run's achieved FLOP/s is read against (its efficiency), and
its matmul curve: the rate per dtype across sizes, which a scaling study's section reads beside the model's.

The peak: measured through the run's own framework (Adapter.matmul) on square matrices grown until one product
takes at least MIN_PRODUCT_S, as the median of REPEATS products, and cached per machine (harness.run.cache,
"peaks"), keyed by framework and version, device, CPU, threads and TF32: the CPU model changes between machines,
and a figure from another one means nothing here; a float32 matmul with TF32 on is a different figure (measured
after the run's build, so in the math mode the run set), and a strict-fp32 run must not be read against it.

The curve (matmul_curves, cached as "matmul_curves" under the same key): GFLOP/s per dtype at n = CURVE_SIZES
(64 to 4096), square n x n products only: Adapter.matmul takes one n, so the (batch x positions, K, N) shapes of
the model's own layers are not measured; a layer's rate is read off the square curve at a similar amount of work.
Each size is timed after a warm-up product as the median of CURVE_REPEATS samples, a sample being as many products
in a row as make it last CURVE_MIN_SAMPLE_S (a 64 x 64 product takes microseconds, below what one clock read
resolves against the framework's dispatch). A dtype's curve stops at the first size whose first timed product takes
more than CURVE_CAP_S (that size is kept, from that one product; unless it is the last size, `stopped` says why the
curve ends there): emulated float16 on a CPU runs at ~0.3 GFLOP/s, where a 4096 x 4096 product would take minutes.
"""
from __future__ import annotations

import json
import math
import statistics
import time

from harness.run.cache import cached
from harness.run.measure import cpu_info

DTYPES = ("float32", "bfloat16", "float16")
MIN_PRODUCT_S = 0.05
MAX_N = 8192
REPEATS = 5

CURVE_SIZES = tuple(2**k for k in range(6, 13))  # 64, 128, ..., 4096
CURVE_REPEATS = 5
CURVE_MIN_SAMPLE_S = 0.002
CURVE_MAX_LOOPS = 1000
CURVE_CAP_S = 0.25  # a product slower than this ends its dtype's curve: the next size is 8 times the work


def _key(adapter, device, threads: int, tf32: bool) -> str:
    return json.dumps([adapter.name, adapter.framework_version(), device.name, device.description, cpu_info()[0],
                       threads, "tf32" if tf32 else "strict fp32"])


def device_peaks(adapter, device, threads: int, tf32: bool) -> dict[str, float | None]:
    """GFLOP/s of an n x n matmul per dtype (None where the framework has no kernel for it here), in the math
    mode the process is in: `tf32` says which (the run's precision.tf32)."""
    return cached("peaks", _key(adapter, device, threads, tf32),
                  lambda: {dtype: matmul_gflops(adapter, device, dtype) for dtype in DTYPES})


def matmul_curves(adapter, device, threads: int, tf32: bool) -> dict[str, dict | None]:
    """Per dtype its matmul_curve (None where the framework has no kernel for it here), in the process's math mode
    (`tf32`, as for device_peaks), cached per machine like the peaks."""
    return cached("matmul_curves", _key(adapter, device, threads, tf32),
                  lambda: {dtype: matmul_curve(adapter, device, dtype) for dtype in DTYPES})


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


def matmul_curve(adapter, device, dtype: str, sizes=CURVE_SIZES) -> dict | None:
    """{"n": [...], "gflops": [...], "stopped": None or why the larger sizes were not measured}: GFLOP/s of an
    n x n product of `dtype` at each size (see the module's docstring); None where there is no kernel at all."""
    ns: list[int] = []
    rates: list[float] = []
    stopped = None
    for n in sizes:
        run = adapter.matmul(n, dtype, device)
        if run is None:
            if not ns:
                return None
            stopped = f"no {dtype} kernel at n={n}"
            break
        run()  # warm-up: kernels chosen (or compiled), memory allocated
        first = _seconds(run)
        if first > CURVE_CAP_S:  # this size from that one product; no larger one
            ns.append(n)
            rates.append(2 * n**3 / first / 1e9)
            if n != sizes[-1]:
                stopped = f"one product took {first:.2g} s, over the {CURVE_CAP_S:g} s cap"
            break
        loops = max(1, min(CURVE_MAX_LOOPS, math.ceil(CURVE_MIN_SAMPLE_S / max(first, 1e-9))))

        def sample(run=run, loops=loops) -> float:
            t0 = time.perf_counter()
            for _ in range(loops):
                run()
            return (time.perf_counter() - t0) / loops

        ns.append(n)
        rates.append(2 * n**3 / statistics.median(sample() for _ in range(CURVE_REPEATS)) / 1e9)
    return {"n": ns, "gflops": rates, "stopped": stopped}
