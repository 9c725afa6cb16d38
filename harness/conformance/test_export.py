"""`amp-harness export --framework F` (harness.export): the exported script's losses against the adapter's own
fingerprint of the same spec: in fp64, where rounding cannot hide a difference in the math (an epsilon's place, a
flatten order, a padding), within 1e-9 on every spec below; in fp32 within 1e-4; its mixed-precision scripts
finite and within 5e-2 of the fp32 fingerprint's. Skipped for a framework export has no template for.

The fp64 scripts are of the goldens' specs (harness.conformance.specs: every one at the identity matrix's batch),
so the fingerprint each is held to is the first STEPS steps of the one tox has just written (`fingerprinted`,
--amp-fingerprints) where it is there, instead of a run trained again here. A step's loss does not depend on how
many steps follow it where the learning rate has no schedule (none of MATH's specs has one). The fp32 scripts keep
the built-in models at their own batches, trained here: resnet8 at the goldens' batch of 16 differs by 6.9e-4 from
torch's channels-last fingerprint in fp32, past the bound."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harness.conformance.plugin import THREADS
from harness.conformance.specs import golden_request, spec_file
from harness.export import export, template_path
from harness.run.plan import resolve
from harness.run.worker import RunRequest, run

STEPS = 5
# built-in models by name; the kit's pitfall specs (harness.conformance.specs) written to files
MATH = ["mnist_mlp", "resnet8", "pitfall_same_padding", "pitfall_flatten_dense", "pitfall_rmsprop_epsilon",
        "pitfall_residual_projection", "pitfall_batchnorm"]
FP32 = ["mnist_mlp", "resnet8", "pitfall_flatten_dense", "pitfall_same_padding"]
MIXED = {"amp_bf16": "mnist_mlp", "amp_fp16": "pitfall_same_padding"}
# One Python process runs every script of a precision, each as `python SCRIPT --losses-json FILE` would (a fresh
# __main__ module): the framework is imported once per precision, not once per script (TensorFlow takes seconds).
RUNNER = """import runpy, sys
for script, losses in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = [script, "--losses-json", losses]
    runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture
def exporting(framework):
    if template_path(framework) is None:
        pytest.skip(f"export has no template for {framework}")
    return framework


def _spec(name: str, folder: Path, precision: str = "fp32") -> str:
    return spec_file(folder, name) if name.startswith("pitfall_") or precision == "fp64" else name


def script_losses(framework: str, names: list[str], precision: str, out: Path) -> dict[str, list[float]]:
    """Each named spec exported in `precision` and its script run (all of them by one process): losses by name."""
    args = []
    for name in names:
        folder = out / precision / name
        folder.mkdir(parents=True)
        script, _ = export(_spec(name, folder, precision), framework, precision, folder, steps=STEPS)
        args += [str(script), str(folder / f"{script.stem}.json")]
    done = subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True, timeout=600,
                          cwd=out)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: json.loads(Path(losses).read_text())["losses"] for name, losses in zip(names, args[1::2])}


def golden_losses(framework: str, name: str, fingerprinted) -> list[float]:
    """The first STEPS losses of the adapter's fp64 fingerprint of the goldens' spec `name`: tox's, else one
    trained here."""
    request = golden_request(framework, name, "fp64")
    assert request.resolved_spec().optimizer.schedule is None, f"{name}: a schedule's rates depend on the steps"
    record = fingerprinted(request)
    if record is None:
        record = run(replace(request, spec={**request.spec, "steps": STEPS}, measure_peak=False))
    assert record["status"] == "ok", record.get("reason")
    return record["loss"][:STEPS]


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


def _against_fingerprints(framework: str, precision: str, bound: float, folder: Path,
                          fingerprinted) -> dict[str, float]:
    """The specs whose exported `precision` script's losses differ from the fingerprint's by `bound` or more."""
    exported = script_losses(framework, MATH if precision == "fp64" else FP32, precision, folder)
    diffs = {name: max_relative(losses, golden_losses(framework, name, fingerprinted) if precision == "fp64" else
                                fingerprint_losses(framework, _spec(name, folder), precision))
             for name, losses in exported.items()}
    return {name: f"{diff:.2e}" for name, diff in diffs.items() if not diff < bound}


def test_the_fp64_scripts_compute_the_harness_s_math(exporting, fingerprinted, tmp_path):
    wrong = _against_fingerprints(exporting, "fp64", 1e-9, tmp_path, fingerprinted)
    assert not wrong, f"the exported fp64 scripts' losses differ from the fingerprints' by (relative): {wrong}"


def test_the_fp32_scripts_train_as_the_fingerprints(exporting, fingerprinted, tmp_path):
    wrong = _against_fingerprints(exporting, "fp32", 1e-4, tmp_path, fingerprinted)
    assert not wrong, f"the exported fp32 scripts' losses differ from the fingerprints' by (relative): {wrong}"


@pytest.mark.parametrize("precision", MIXED)
def test_a_mixed_precision_script_runs_close_to_fp32(exporting, precision, tmp_path):
    """Against the fp32 fingerprint, which the fp32 script matches within 1e-4 (the test above)."""
    name = MIXED[precision]
    (mixed,) = script_losses(exporting, [name], precision, tmp_path).values()
    fp32 = fingerprint_losses(exporting, _spec(name, tmp_path), "fp32")
    assert all(v is not None and math.isfinite(v) for v in mixed), mixed
    assert max_relative(mixed, fp32) < 5e-2, (mixed, fp32)
