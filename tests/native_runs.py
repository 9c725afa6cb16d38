"""What the adapters' native-model tests (adapters/*/tests/test_native.py) share: a run of a native spec in the
test's process, and `check` of one, for the framework they test."""
from __future__ import annotations

import json

import pytest

from harness.run import native, worker

SKIPPABLE = ("amp_bf16", "amp_fp16", "bf16", "fp16", "bf16_sr")  # a CPU may lack their kernels


def run_native(framework: str, spec: dict, precision: str, **request) -> dict:
    """A run in this process; skipped where the capability probe finds the precision unsupported on this CPU."""
    record = worker.run(worker.RunRequest(framework=framework, model=spec["name"], spec=spec, precision=precision,
                                          run_id=f"native-{precision}", device="cpu",
                                          **{"warmup": 0, "measure_peak": False, **request}))
    if record["status"] == "unsupported" and precision in SKIPPABLE:
        pytest.skip(f"{precision} here: {record['reason']}")
    return record


def check_native(framework: str, spec: dict, tmp_path) -> dict:
    """What the framework's worker answers for `check` of the spec (its parameters and output, or the error)."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return native.check_here(framework, str(path))
