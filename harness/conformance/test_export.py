"""`amp-harness export --framework F` (harness.export): the exported script's losses against the adapter's own
fingerprint of the same spec: in fp64, where rounding cannot hide a difference in the math (an epsilon's place, a
flatten order, a padding), within 1e-9 on every spec below; in fp32 within 1e-4; its mixed-precision scripts
finite and within 5e-2 of its fp32 script's. Skipped for a framework export has no template for."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness.conformance.plugin import THREADS
from harness.conformance.specs import spec_file
from harness.export import export, template_path
from harness.run.plan import resolve
from harness.run.worker import RunRequest, run

STEPS = 5
# built-in models by name; the kit's pitfall specs (harness.conformance.specs) written to files
MATH = ["mnist_mlp", "resnet8", "pitfall_same_padding", "pitfall_flatten_dense", "pitfall_rmsprop_epsilon",
        "pitfall_residual_projection", "pitfall_batchnorm"]
FP32 = ["mnist_mlp", "resnet8", "pitfall_flatten_dense"]
MIXED = [("mnist_mlp", "amp_bf16"), ("pitfall_same_padding", "amp_fp16")]


@pytest.fixture
def exporting(framework):
    if template_path(framework) is None:
        pytest.skip(f"export has no template for {framework}")
    return framework


def _spec(name: str, folder: Path) -> str:
    return spec_file(folder, name) if name.startswith("pitfall_") else name


def script_losses(framework: str, spec: str, precision: str, out: Path) -> list[float]:
    script, _ = export(spec, framework, precision, out, steps=STEPS)
    losses = out / f"{script.stem}.json"
    done = subprocess.run([sys.executable, str(script), "--losses-json", str(losses)], capture_output=True, text=True,
                          timeout=600, cwd=out)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(losses.read_text())["losses"]


def fingerprint_losses(framework: str, spec: str, precision: str) -> list[float]:
    resolved, _ = resolve(spec, steps=STEPS)
    record = run(RunRequest(framework=framework, model=resolved.name, spec=resolved.model_dump(mode="json"),
                            precision=precision, run_id="export-test", mode="fingerprint", threads=THREADS, device="cpu",
                            measure_peak=False))  # the kit's threads: TensorFlow's are set once per process
    assert record["status"] == "ok", record.get("reason")
    return record["loss"]


def max_relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize("name", MATH)
def test_the_fp64_script_computes_the_harness_s_math(exporting, name, tmp_path):
    spec = _spec(name, tmp_path)
    exported = script_losses(exporting, spec, "fp64", tmp_path)
    diff = max_relative(exported, fingerprint_losses(exporting, spec, "fp64"))
    assert diff < 1e-9, f"{name}: the exported fp64 script's losses differ by {diff:.2e} from the fingerprint's"


@pytest.mark.parametrize("name", FP32)
def test_the_fp32_script_trains_as_the_fingerprint(exporting, name, tmp_path):
    spec = _spec(name, tmp_path)
    diff = max_relative(script_losses(exporting, spec, "fp32", tmp_path), fingerprint_losses(exporting, spec, "fp32"))
    assert diff < 1e-4, f"{name}: the exported fp32 script's losses differ by {diff:.2e} from the fingerprint's"


@pytest.mark.parametrize("name, precision", MIXED)
def test_a_mixed_precision_script_runs_close_to_fp32(exporting, name, precision, tmp_path):
    spec = _spec(name, tmp_path)
    fp32 = script_losses(exporting, spec, "fp32", tmp_path / "fp32")
    mixed = script_losses(exporting, spec, precision, tmp_path / precision)
    assert all(v is not None and math.isfinite(v) for v in mixed), mixed
    assert max_relative(mixed, fp32) < 5e-2, (mixed, fp32)
