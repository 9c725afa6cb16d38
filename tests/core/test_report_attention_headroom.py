"""The Numerics section's headroom line: at the largest loss scale a (model, framework)'s amp_fp16 runs reached,
how close its diagnosis's attention score gradients come to float16's largest value, computed from the
histograms' max_abs and the runs' loss-scale histories (constructed records)."""
from __future__ import annotations

import numpy as np

from harness import numerics
from harness.report import build_view, render
from tests.core.test_report_answer import record


def _diagnosed(framework: str, score_gradients: dict[str, float], batch_size: int = 32) -> dict:
    """A diagnosis record whose attention layers' score gradients reach the given largest magnitudes."""
    gradients = np.array([0.5, 2.0**-10])
    groups = {"gradients": {"0": numerics.histogram(gradients)}, "activation_gradients": {}, "weights": {},
              "updates": {}, "activations": {},
              "attention_score_gradients": {layer: numerics.histogram(np.array([-top, top / 8]))
                                            for layer, top in score_gradients.items()}}
    return {"run_id": f"d-{framework}", "framework": framework, "model": "m", "precision": "fp32", "status": "ok",
            "batch_size": batch_size,
            "diagnosis": {"groups": groups, "updates": {}, "optimizer": "adam", "captured_steps": [0, 2],
                          "available": True}}


def _headroom(records, diagnoses) -> dict[str, str | None]:
    return {n.framework: n.headroom for n in build_view(records, None, diagnoses).numerics}


def test_the_line_gives_the_closest_layer_and_the_doublings_left_at_the_largest_scale_reached():
    # torch's runs reach 2^16 (the second repeat grows to it); the closer of two layers reaches 2^-12.8 unscaled
    runs = [record("torch", "amp_fp16", 10.0, history=[2.0**15, 2.0**15, 2.0**14]),
            record("torch", "amp_fp16", 10.0, repeat=1, history=[2.0**15, 2.0**16, 2.0**16]),
            record("torch", "fp32", 12.0)]
    diagnosis = _diagnosed("torch", {"2.layers.1": 2.0**-12.8, "4.layers.1": 2.0**-20})
    line = _headroom(runs, [diagnosis])["torch"]
    assert line == ("at the largest scale torch's amp_fp16 runs reached (2^16), attention 2.layers.1's score "
                    "gradients reach 2^3.2 of float16's 2^16 (the closest of 2 attention layers): 12.8 doublings to "
                    "spare")
    page = render(build_view(runs, None, [diagnosis]))
    assert f'<li class="headroom">{line}</li>' in page.replace("&#39;", "'")


def test_scores_past_float16_at_that_scale_say_by_how_much_and_the_initial_scale_counts():
    # the initial scale 2^24 is the largest: the scaler backed off from it at once
    runs = [record("tensorflow", "amp_fp16", 10.0, history=[2.0**24, 2.0**23, 2.0**22])]
    runs[0]["loss_scale"]["history"] = [2.0**23, 2.0**22, 2.0**22]
    line = _headroom(runs, [_diagnosed("tensorflow", {"1": 2.0**-6.5})])["tensorflow"]
    assert line == ("at the largest scale tensorflow's amp_fp16 runs reached (2^24), attention 1's score gradients "
                    "reach 2^17.5 of float16's 2^16: they overflow by 2^1.5: the scaler must back off")


def test_no_line_without_both_a_diagnosis_with_score_gradients_and_the_frameworks_scaled_runs():
    runs = [record("torch", "amp_fp16", 10.0, history=[2.0**16]),  # another framework's runs
            record("jax", "amp_fp16", 10.0),  # no loss scale
            record("jax", "amp_bf16", 10.0, history=[2.0**16])]  # not float16
    never_ran = record("jax", "amp_fp16", 10.0, history=[2.0**30])  # unsupported: its settings alone
    never_ran.update(status="unsupported", reason="no", step_times_ms=None,
                     loss_scale={"settings": never_ran["loss_scale"]["settings"]})
    runs.append(never_ran)
    study = record("mxnet", "amp_fp16", 10.0, history=[2.0**30])
    study["study"] = "loss-scale-1"  # a study sweeps scales on purpose: not a scale a run reached
    found = _headroom(runs + [study], [_diagnosed("jax", {"1": 2.0**-10}), _diagnosed("mxnet", {"1": 2.0**-10}),
                                     _diagnosed("torch", {})])
    assert found == {"jax": None, "mxnet": None, "torch": None}


def test_a_diagnosis_at_another_batch_size_says_so():
    runs = [record("jax", "amp_fp16", 10.0, history=[2.0**10, 2.0**11])]  # batch 32
    line = _headroom(runs, [_diagnosed("jax", {"1": 2.0**-3}, batch_size=16)])["jax"]
    assert line.startswith("at the largest scale jax's amp_fp16 runs reached (2^11), attention 1's score gradients "
                           "reach 2^8.0 of float16's 2^16: 8.0 doublings to spare (diagnosed at batch 16, the runs at "
                           "batch 32")
