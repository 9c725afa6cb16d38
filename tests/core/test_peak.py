"""The matmul peak a run's efficiency is read against is measured in the run's own math mode: a TF32 run is
never read against the strict-fp32 peak, nor the other way round."""
from __future__ import annotations

from harness.precision import PRECISIONS
from harness.run import peak, train
from tests.fake_adapter.fake_adapter import FakeAdapter


class ModeAdapter(FakeAdapter):
    """Its build sets TF32 process-wide, as the real adapters do; its matmul logs the mode it ran in."""

    def __init__(self):
        self.tf32, self.ran = False, []

    def build(self, spec, graph, weights, precision, loss_scale, device, variant):
        self.tf32 = precision.tf32  # the trainer itself plays no part here

    def matmul(self, shape, dtype, device):
        return lambda: self.ran.append("tf32" if self.tf32 else "strict")


def efficiency_peak(adapter, precision: str) -> dict:
    """What the worker reads a timed run's efficiency against, right after building that run."""
    adapter.ran.clear()
    adapter.build(None, None, None, PRECISIONS[precision], None, None, None)
    record = {"achieved_gflops": 1.0}
    train.efficiency(adapter, adapter.device("cpu"), PRECISIONS[precision], 1, record)
    return record["device_peak_gflops"]


def test_a_tf32_run_is_read_against_a_peak_measured_with_tf32(monkeypatch):
    monkeypatch.setattr(peak, "MIN_PRODUCT_S", 0.0)  # one size: the fake's product takes no time
    adapter = ModeAdapter()
    efficiency_peak(adapter, "fp32")
    assert adapter.ran and set(adapter.ran) == {"strict"}
    efficiency_peak(adapter, "tf32")  # another run's process, the same machine cache
    assert adapter.ran and set(adapter.ran) == {"tf32"}, "the tf32 run read the strict-fp32 peak from the cache"
    efficiency_peak(adapter, "fp32")
    assert adapter.ran == [], "a strict-fp32 run measured again instead of reading its cached peak"
