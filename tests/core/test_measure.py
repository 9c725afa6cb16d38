"""The process memory figure's baseline: free heap pages still resident before the build go back to the system
first, or a model that reuses them adds nothing to the RSS and its figure comes out too small."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# In a fresh process whose malloc takes a 64 MiB block from the heap (no mmap) and never trims on its own: the
# block is touched, freed below a live small block (so it stays resident), and the same size is taken again
# after the baseline. The peak above the baseline must hold the second block.
PROBE = """
import ctypes
from harness.run import measure
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
first = libc.malloc(size); ctypes.memset(first, 1, size)
guard = libc.malloc(16)
libc.free(ctypes.c_void_p(first))
baseline = measure.reset_peak_rss()
second = libc.malloc(size); ctypes.memset(second, 2, size)
print((measure.peak_rss_kb() - baseline) / 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and glibc's malloc_trim are Linux's")
def test_memory_freed_before_the_baseline_counts_when_it_is_reused():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    assert float(out.stdout) >= 60, f"the peak above the baseline was {out.stdout.strip()} MiB for a 64 MiB block"
