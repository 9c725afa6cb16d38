"""This device's matrix-multiply peak per dtype: what a run's achieved FLOP/s is read against (its efficiency), and
its matmul curve: the rate per dtype across sizes, which a scaling study's section reads beside the model's.

The peak: measured through the run's own framework (Adapter.matmul) on square matrices grown until one product
takes at least MIN_PRODUCT_S, as the median of REPEATS products, and cached per machine (harness.run.cache,
"peaks"), keyed by framework and version, device, CPU, threads and TF32: the CPU model changes between machines,
and a figure from another one means nothing here; a float32 matmul with TF32 on is a different figure (measured
after the run's build, so in the math mode the run set), and a strict-fp32 run must not be read against it.

The curve (matmul_curves, cached as "matmul_curves" under the same key): GFLOP/s per dtype at n = CURVE_SIZES
(64 to 4096), square n x n products. Each size is timed after a warm-up product as the median of CURVE_REPEATS
samples, a sample being as many products in a row as make it last CURVE_MIN_SAMPLE_S (a 64 x 64 product takes
microseconds, below what one clock read resolves against the framework's dispatch). A dtype's curve stops at the
first size whose first timed product takes more than CURVE_CAP_S (that size is kept, from that one product; unless
it is the last size, `stopped` says why the curve ends there): emulated float16 on a CPU runs at ~0.3 GFLOP/s,
where a 4096 x 4096 product would take minutes.

The model's own shapes (shape_rates, cached per shape as "matmul_shapes"): the 2D products of its training step
(harness.model.graph.step_matmuls: m x k times k x n, forward and backward), each timed like a curve size. A shape
is not timed where its operands and product would take more than MAX_SHAPE_MB, or where the dtype's curve says one
product would take more than MAX_SHAPE_S (from the curve's rate at the size of nearest work): the record says so.
"""
from __future__ import annotations

import json
import math
import statistics
import time

from harness.model.graph import DTYPE_BYTES
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
MAX_SHAPE_MB = 1024  # a layer's product whose operands and result take more is not timed (the memory it holds)
MAX_SHAPE_S = 2.0  # nor one the curve says would take longer (emulated 16-bit on a CPU: ~0.3 GFLOP/s)


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


def shape_rates(adapter, device, threads: int, tf32: bool, dtype: str, shapes, curve: dict | None) -> list[dict]:
    """Per distinct (m, k, n) of `shapes` (harness.model.graph.Matmul, in order of first appearance): {"m", "k",
    "n", "gflops"} or, where it was not timed, {"m", "k", "n", "skipped": why}; `curve` is the dtype's
    matmul_curve (None: no kernel, and no shape is timed)."""
    out = []
    for m, k, n in dict.fromkeys((mm.m, mm.k, mm.n) for mm in shapes):
        why = _not_timed(m, k, n, dtype, curve)
        if why:
            out.append({"m": m, "k": k, "n": n, "skipped": why})
            continue
        rate = cached("matmul_shapes", json.dumps([_key(adapter, device, threads, tf32), dtype, m, k, n]),
                      lambda: _rate(adapter.matmul((m, k, n), dtype, device), 2 * m * k * n)[0])
        out.append({"m": m, "k": k, "n": n, "gflops": rate} if rate else
                   {"m": m, "k": k, "n": n, "skipped": f"no {dtype} kernel for this shape"})
    return out


def _not_timed(m: int, k: int, n: int, dtype: str, curve: dict | None) -> str | None:
    if not curve:
        return f"no {dtype} matmul kernel here"
    mb = (m * k + k * n + m * n) * DTYPE_BYTES[dtype] / 2**20
    if mb > MAX_SHAPE_MB:
        return f"its operands and product take {mb:.0f} MB, over the {MAX_SHAPE_MB} MB this check allows"
    flops = 2 * m * k * n
    near = min(zip(curve["n"], curve["gflops"]), key=lambda p: abs(math.log(2 * p[0]**3 / flops)))
    seconds = flops / (near[1] * 1e9)
    if seconds > MAX_SHAPE_S:
        return (f"one product would take about {seconds:.2g} s at the {dtype} curve's rate at n={near[0]}, over "
                f"the {MAX_SHAPE_S:g} s this check allows")
    return None


def _rate(run, flops: float) -> tuple[float | None, float]:
    """(GFLOP/s of `run`, a product of `flops`, the seconds its first timed product took); (None, 0) where
    `run` is None. Timed after a warm-up product: over CURVE_CAP_S, that one product; else the median of
    CURVE_REPEATS samples of as many products in a row as last CURVE_MIN_SAMPLE_S."""
    if run is None:
        return None, 0.0
    run()  # warm-up: kernels chosen (or compiled), memory allocated
    first = _seconds(run)
    if first > CURVE_CAP_S:
        return flops / first / 1e9, first
    loops = max(1, min(CURVE_MAX_LOOPS, math.ceil(CURVE_MIN_SAMPLE_S / max(first, 1e-9))))

    def sample() -> float:
        t0 = time.perf_counter()
        for _ in range(loops):
            run()
        return (time.perf_counter() - t0) / loops

    return flops / statistics.median(sample() for _ in range(CURVE_REPEATS)) / 1e9, first


def _seconds(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def matmul_gflops(adapter, device, dtype: str) -> float | None:
    n = 256
    while True:
        run = adapter.matmul((n, n, n), dtype, device)
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
        rate, first = _rate(adapter.matmul((n, n, n), dtype, device), 2 * n**3)
        if rate is None:
            if not ns:
                return None
            stopped = f"no {dtype} kernel at n={n}"
            break
        ns.append(n)
        rates.append(rate)
        if first > CURVE_CAP_S:  # this size from that one product; no larger one
            if n != sizes[-1]:
                stopped = f"one product took {first:.2g} s, over the {CURVE_CAP_S:g} s cap"
            break
    return {"n": ns, "gflops": rates, "stopped": stopped}
