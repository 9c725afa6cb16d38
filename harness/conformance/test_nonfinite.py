"""A diverged run names where its first non-finite value came from (harness.run.nonfinite): in pure float16, a
residual stream that nothing normalises grows past 65504, and the run's record must name the residual block
whose output first overflows, in the forward pass, as the numpy reference computes it in float64; and Adam in
pure float16, whose epsilon of 1e-8 is 0 there, must be caught making the embedding rows that the first batch
never reads NaN (their gradients and moments are 0: 0/0) at the first update, a step before the loss shows it."""
from __future__ import annotations

import numpy as np
import pytest

from harness.conformance.plugin import THREADS
from harness.conformance.specs import residual_stream
from harness.model import reference
from harness.model.data import Data
from harness.model.graph import infer
from harness.model.spec import validate
from harness.model.weights import initial_weights
from harness.numerics import FORMATS
from harness.run import worker
from harness.model.graph import Graph

# 40 residual blocks: block 37's output is the first past float16's largest value (92091 against 65504; the block
# before it reaches 45422)
# a vocabulary of 256 of which the first batch reads few: most embedding rows get a zero gradient at step 0
UNREAD_ROWS = {**residual_stream("unread_rows", "Adam in pure float16 on an embedding whose rows the first batch "
                                 "mostly does not read", 1, [{"type": "sequence_pool", "mode": "mean"},
                                                             {"type": "dense", "units": 3}], seed=3, steps=4),
               "input": {"shape": [12], "vocab": 256},
               "optimizer": {"type": "adam", "learning_rate": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8}}
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
    return next(p for p in Graph.forward_order(outputs) if np.abs(outputs[p]).max() > largest)


def test_a_diverged_run_names_its_first_nonfinite_layer_and_pass(framework, unsupported):
    if unsupported("fp16"):
        pytest.skip(f"fp16 is unsupported here: {unsupported('fp16')}")
    record = worker.run(worker.RunRequest(framework=framework, model="overflowing_stream", spec=OVERFLOWING,
                                          precision="fp16", loss_scale="none", run_id="conformance-nonfinite",
                                          warmup=0, threads=THREADS, device="cpu", measure_peak=False))
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


def test_an_update_that_makes_weights_nonfinite_is_named_at_that_step(framework, unsupported):
    if unsupported("fp16"):
        pytest.skip(f"fp16 is unsupported here: {unsupported('fp16')}")
    spec = validate(UNREAD_ROWS, "unread_rows")
    x, _ = Data(spec).train_batch(0)
    unread = 1 - len(np.unique(x)) / spec.input.vocab  # rows step 0's gradient leaves exactly 0
    record = worker.run(worker.RunRequest(framework=framework, model="unread_rows", spec=UNREAD_ROWS,
                                          precision="fp16", loss_scale="none", run_id="conformance-nonfinite-update",
                                          warmup=0, threads=THREADS, device="cpu", measure_peak=False))
    found = record.get("nonfinite") or {}
    if not found.get("found") and "cannot capture" in (found.get("why") or ""):
        pytest.skip(found["why"])
    assert record["status"] == "diverged" and found.get("found"), (
        f"Adam's epsilon 1e-8 is 0 in float16, so the first update makes the {unread:.0%} of embedding rows that step "
        f"0 does not read 0/0 = NaN and a later batch reads them; the run says {record['status']}, {found}")
    assert (found["step"], found["pass"], found["weight"], found["values"], found["epsilon"]) == \
        (0, "update", "0.embeddings", "nan", 1e-8), (
        f"the first non-finite values are made by step 0's update of 0.embeddings (the rows step 0 does not read: "
        f"0/0); the record says {found}")
    assert found["share"] >= unread and found["gradient_finite"], found
