"""The report over 10,000 records (benchmarks/report_scale.py generates them; run it to time the report): the
page stays under 5 MB and neither the page nor the CSV embeds the per-step lists."""
from __future__ import annotations

import importlib.util

from harness.report import write_report
from tests.conftest import ROOT


def _benchmark():
    spec = importlib.util.spec_from_file_location("report_scale", ROOT / "benchmarks" / "report_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_report_over_10000_records_stays_small(tmp_path):
    records = _benchmark().records(10_000)
    page, csv = write_report(records, tmp_path / "index.html")
    size = page.stat().st_size
    print(f"page {size / 2**20:.2f} MiB, CSV {csv.stat().st_size / 2**20:.2f} MiB")
    assert size < 5 * 10**6
    assert page.read_text().count("<svg") >= 100  # every model's charts are there
    header = csv.read_text().splitlines()[0].split(",")
    assert len(csv.read_text().splitlines()) == 10_001
    assert "step_times_ms" not in header and "loss" not in header and "step_time_ms.median" in header
    one_run = records[0]["step_times_ms"]
    assert f"{one_run[17]}" not in page.read_text()  # raw step times are aggregated, not embedded
