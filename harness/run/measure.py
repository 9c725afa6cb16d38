"""Measurement helpers: step-time statistics, the process memory high-water mark, environment facts."""
from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

import numpy as np

# CPU features that decide whether 16-bit arithmetic is native on x86 (and Arm's counterparts).
CPU_FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                         "amx_bf16", "amx_fp16", "amx_tile", "fphp", "asimdhp", "bf16", "sve")


def step_stats(times_ms: list[float]) -> dict[str, float]:
    """Median, 10th/90th percentile and the (unscaled) median absolute deviation."""
    t = np.asarray(times_ms, dtype=np.float64)
    if t.size == 0:
        return {"median": None, "p10": None, "p90": None, "mad": None}
    median = float(np.median(t))
    return {"median": median, "p10": float(np.percentile(t, 10)), "p90": float(np.percentile(t, 90)),
            "mad": float(np.median(np.abs(t - median)))}


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> int | None:
    """Reset the high-water mark to the current RSS (Linux) and return it in KiB. Heap pages that are free but
    still resident go back to the system first (glibc's malloc_trim): otherwise a model that reuses them adds
    nothing to the RSS, and the figure depends on what the process happened to free before the build."""
    _release_free_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_kb("VmHWM")


def _release_free_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the baseline keeps whatever the allocator holds
        pass


def peak_rss_kb() -> int | None:
    return _status_kb("VmHWM")


def cpu_info(every_flag: bool = False) -> tuple[str, list[str]]:
    """The CPU model and its flags: those that decide 16-bit arithmetic (CPU_FLAGS_OF_INTEREST), or all."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value.split()
    except OSError:
        pass
    return model, sorted(f for f in flags if every_flag or f in CPU_FLAGS_OF_INTEREST)


def environment(threads: int) -> dict:
    cpu, flags = cpu_info()
    return {
        "python": sys.version.split()[0],
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_flags": flags,
        "threads": threads,
        "hostname": platform.node(),
    }
