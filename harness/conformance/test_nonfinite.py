"""A diverged run names where its first non-finite value came from (harness.run.nonfinite): in pure float16, a
residual stream that nothing normalises grows past 65504, and the run's record must name the residual block
whose output first overflows, in the forward pass, as the numpy reference computes it in float64."""
from __future__ import annotations

import numpy as np
import pytest

from harness.conformance.specs import residual_stream
from harness.model import reference
from harness.model.data import Data
from harness.model.graph import infer
from harness.model.spec import validate
from harness.model.weights import initial_weights
from harness.numerics import FORMATS
from harness.run import worker
from harness.run.nonfinite import _forward_order

# 40 residual blocks: block 37's output is the first past float16's largest value (92091 against 65504; the block
# before it reaches 45422)
OVERFLOWING = residual_stream("overflowing_stream",
                              "a residual stream that nothing normalises, past float16's range from block 37 on",
                              40, [{"type": "sequence_pool", "mode": "mean"}, {"type": "dense", "units": 3}],
                              seed=26, steps=3)


def _first_overflow_in_float64() -> str:
    spec = validate(OVERFLOWING, "overflowing_stream")
    x, _ = Data(spec).train_batch(0)
    outputs = {}
    reference.forward(spec, initial_weights(infer(spec), spec.seed), x, layer_outputs=outputs)
    largest = FORMATS["float16"].max
    return next(p for p in sorted(outputs, key=_forward_order) if np.abs(outputs[p]).max() > largest)


def test_a_diverged_run_names_its_first_nonfinite_layer_and_pass(framework, unsupported):
    if unsupported("fp16"):
        pytest.skip(f"fp16 is unsupported here: {unsupported('fp16')}")
    record = worker.run(worker.RunRequest(framework=framework, model="overflowing_stream", spec=OVERFLOWING,
                                          precision="fp16", loss_scale="none", run_id="conformance-nonfinite",
                                          warmup=0, threads=2, device="cpu", measure_peak=False))
    assert record["status"] == "diverged", f"pure fp16 must overflow: {record['status']}, {record['reason']}"
    found = record["nonfinite"]
    if not found["found"] and "cannot capture" in found["why"]:
        pytest.skip(found["why"])
    expected = _first_overflow_in_float64()
    assert (found["found"], found["step"], found["layer"], found["pass"], found["tensor"]) == \
        (True, 0, expected, "forward", "output"), (
        f"the first non-finite value is layer {expected}'s output in the forward pass of step 0 (its float64 "
        f"values pass float16's largest); the record says {found}")
    assert found["input_range"] and max(map(abs, found["input_range"])) < FORMATS["float16"].max, found
