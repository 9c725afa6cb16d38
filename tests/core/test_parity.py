"""The parity verdicts, on hand-made fingerprints."""
from __future__ import annotations

import pytest

from harness.parity import compare, compare_diagnoses, histogram_distance


def fp(framework, precision="fp32", losses=(1.0, 0.9, 0.8), initial=(1.0, 2.0), final=(1.5, 2.5), skipped=(),
       status="ok"):
    return {"run_id": f"{framework}-{precision}-{losses}-{initial}", "framework": framework, "model": "m", "spec_hash": "h", "precision": precision, "status": status,
            "reason": None if status == "ok" else "why", "loss": list(losses),
            "fingerprint": {"initial_outputs": [list(initial)], "final_outputs": [list(final)],
                            "skipped_steps": list(skipped)}}


def verdicts(records):
    return {(c.precision, c.framework): c.verdict for c in compare(records)}


def test_identical_and_rounding_level_fingerprints_pass():
    records = [fp("torch"), fp("tensorflow", losses=(1.0, 0.90000001, 0.8), initial=(1.0, 2.0000001))]
    assert verdicts(records) == {("fp32", "tensorflow"): "pass"}


def test_a_different_network_fails():
    assert verdicts([fp("torch"), fp("tensorflow", initial=(1.0, 2.1))])[("fp32", "tensorflow")] == "FAIL"
    assert verdicts([fp("torch"), fp("mxnet", losses=(1.0, 0.95, 0.8))])[("fp32", "mxnet")] == "FAIL"


def test_trajectory_drift_within_the_references_own_noise_passes_only_with_fp64():
    drifted = [fp("torch", losses=(1.0, 0.9, 0.801)), fp("tensorflow", losses=(1.0, 0.9, 0.799))]
    assert verdicts(drifted)[("fp32", "tensorflow")] == "FAIL"  # no float64 reference: no excuse
    with_fp64 = drifted + [fp("torch", "fp64", losses=(1.0, 0.9, 0.8)), fp("tensorflow", "fp64")]
    v = verdicts(with_fp64)
    assert v[("fp32", "tensorflow")].startswith("pass (within noise")
    assert v[("fp64", "tensorflow")] == "pass"
    far = drifted[:1] + [fp("tensorflow", losses=(1.0, 0.9, 0.75))] + with_fp64[2:]
    assert verdicts(far)[("fp32", "tensorflow")] == "FAIL"


def test_only_unsupported_is_a_legitimate_not_compared():
    v = verdicts([fp("torch", "amp_fp16", skipped=()), fp("tensorflow", "amp_fp16", skipped=(0, 1)),
                  fp("torch", "bf16"), fp("mxnet", "bf16", status="unsupported"), fp("torch", "fp16"),
                  fp("torch", "fp64"), fp("tensorflow", "fp64", status="diverged")])
    assert v[("bf16", "mxnet")] == "n/a: mxnet unsupported (why)"
    assert v[("amp_fp16", "tensorflow")] == ("FAIL: the loss scalers skipped different steps "
                                             "(torch [], tensorflow [0, 1])")
    assert v[("fp16", "torch")] == "FAIL: only torch has a fp16 fingerprint"
    assert v[("fp64", "tensorflow")] == "FAIL: tensorflow diverged (why)"


def test_every_variant_is_held_to_the_reference():
    """A variant (a compiled step, another memory layout) is the same network run another way: compared with the
    reference framework's default variant (the variant of its first record), it passes or fails like a framework."""
    def variant(framework, name, **kw):
        return {**fp(framework, **kw), "variant": name}

    records = [variant("torch", "channels_last"), variant("tensorflow", "graph"),
               variant("torch", "eager", initial=(1.0, 2.0000001)), variant("torch", "compile", initial=(1.0, 2.1)),
               variant("tensorflow", "xla", losses=(1.0, 0.95, 0.8))]
    assert verdicts(records) == {("fp32", "tensorflow"): "pass", ("fp32", "torch [eager]"): "pass",
                                 ("fp32", "torch [compile]"): "FAIL", ("fp32", "tensorflow [xla]"): "FAIL"}
    assert {c.reference for c in compare(records)} == {"torch"}


def test_float64_rows_are_strict():
    # 1e-8 in the losses is float32 rounding of a constant: it passes fp32, and fails fp64
    near = (1.0, 0.9 * (1 + 1e-8), 0.8)
    assert verdicts([fp("torch"), fp("tensorflow", losses=near)])[("fp32", "tensorflow")] == "pass"
    v = verdicts([fp("torch", "fp64"), fp("tensorflow", "fp64", losses=near)])
    assert v[("fp64", "tensorflow")] == "FAIL"
    v = verdicts([fp("torch", "fp64"), fp("tensorflow", "fp64", losses=(1.0, 0.9 * (1 + 1e-12), 0.8))])
    assert v[("fp64", "tensorflow")] == "pass"


def test_first_step_gradients_are_compared_when_both_frameworks_captured_them():
    import numpy as np

    from harness.run.diagnose import gradient_fingerprint

    g = {"0.kernel": np.arange(6.0).reshape(2, 3), "0.bias": np.array([0.5, -1.0])}
    same, off = gradient_fingerprint(g, 1), gradient_fingerprint({**g, "0.bias": np.array([0.5, -1.0 + 1e-6])}, 1)
    assert gradient_fingerprint({**g, "0.bias": np.array([np.inf, 0.0])}, 1) is None  # a skipped step
    base = fp("torch", "fp64")
    v = verdicts([{**base, "fingerprint": {**base["fingerprint"], "gradients": same}},
                  {**fp("tensorflow", "fp64"), "fingerprint": {**base["fingerprint"], "gradients": off}},
                  {**fp("mxnet", "fp64"), "fingerprint": {**base["fingerprint"], "gradients": same}}])
    assert v[("fp64", "tensorflow")] == "FAIL: first-step gradients differ" and v[("fp64", "mxnet")] == "pass"


# ---- diagnoses: the frameworks' captured tensors, compared as histograms --------------------------------
def hist(bins, zeros=0, nonfinite=0):
    return {"bins": {str(e): c for e, c in bins.items()}, "zeros": zeros, "nonfinite": nonfinite,
            "count": sum(bins.values()) + zeros + nonfinite, "max_abs": 0.0}


def diagnosis(framework, groups, updates=None, status="ok", available=True):
    return {"run_id": framework, "framework": framework, "model": "m", "spec_hash": "h", "precision": "fp32",
            "status": status, "reason": None, "loss": [1.0],
            "diagnosis": {"available": available, "groups": groups, "captured_steps": [0], "every": 1,
                          "updates": updates or {"0": {"updates": 10, "float16": 1, "bfloat16": 5}}}}


def test_histograms_may_differ_by_rounding_only():
    base = hist({-4: 50, -6: 40, -30: 10}, zeros=100)
    assert histogram_distance(base, base) == 0
    # a value on a power of two may round either way: one bin of slack
    assert histogram_distance(base, hist({-5: 50, -6: 40, -30: 10}, zeros=100)) == 0
    # noise far below the largest values (a gradient that is zero in exact arithmetic) counts as zero
    assert histogram_distance(base, hist({-4: 50, -6: 40, -27: 10}, zeros=100)) == 0
    # two bins away, or zeros that became values, is a difference
    assert histogram_distance(base, hist({-4: 40, -8: 10, -6: 40, -30: 10}, zeros=100)) == pytest.approx(0.05)
    assert histogram_distance(base, hist({-4: 50, -6: 140, -30: 10})) == pytest.approx(0.5)
    assert histogram_distance(base, hist({-4: 50, -6: 40, -30: 10}, nonfinite=100)) == pytest.approx(0.5)


def test_diagnoses_that_differ_or_cannot_be_compared_fail():
    groups = {"gradients": {"0": hist({-10: 90, -26: 10})}, "activations": {"0": hist({0: 5}), "1": hist({1: 5})}}
    ref = diagnosis("torch", groups)
    same = diagnosis("tensorflow", groups)
    assert [c.verdict for c in compare_diagnoses([ref, same])] == ["pass"]
    missing_layer = diagnosis("tensorflow", {**groups, "activations": {"0": hist({0: 5})}})
    assert "captured by one framework only" in compare_diagnoses([ref, missing_layer])[0].verdict
    no_updates = diagnosis("tensorflow", groups, {"0": {"updates": 10, "float16": 10, "bfloat16": 10}})
    assert compare_diagnoses([ref, no_updates])[0].verdict == "FAIL: the share of updates lost to rounding in float16 differs"
    flushed = diagnosis("mxnet", {**groups, "gradients": {"0": hist({-10: 60, -26: 10}, zeros=30)}})
    assert compare_diagnoses([ref, flushed])[0].verdict == "FAIL: gradients of 0 differs"
    assert compare_diagnoses([ref, diagnosis("mxnet", groups, available=False)])[0].failed
    assert compare_diagnoses([ref, diagnosis("mxnet", groups, status="failed")])[0].failed


def test_float64_first_step_gradients_must_agree():
    def with_gradients(framework, kernel, bias):
        r = fp(framework, "fp64")
        r["fingerprint"]["gradients"] = {"0.kernel": list(kernel), "0.bias": list(bias)}
        return r
    ref = with_gradients("torch", (2.0, 1.0, -1.0), (1e-15, 1e-15, 0.0))
    # the bias's gradient is rounding noise (zero in exact arithmetic): judged against the whole gradient
    same = with_gradients("tensorflow", (2.0, 1.0 + 1e-12, -1.0), (3e-15, -2e-15, 1e-15))
    assert verdicts([ref, same])[("fp64", "tensorflow")] == "pass"
    off = with_gradients("tensorflow", (2.0, 1.0 + 1e-6, -1.0), (1e-15, 1e-15, 0.0))
    assert verdicts([ref, off])[("fp64", "tensorflow")] == "FAIL: first-step gradients differ"
