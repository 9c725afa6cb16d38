"""FP8 cast statistics in diagnose (harness.fp8.CastStatistics), from the adapter's captured layer outputs and
weights: a classifier whose logits' gradient spans more binades than e4m3 holds is called unsafe for fp8_e4m3,
naming that layer, and safe for fp8_hybrid, whose output gradients are e5m2; one whose gradients shrink every step
(pitfall_fp8_delayed) is called unsafe for fp8_hybrid's delayed recipe and safe for its current one. The figures
are strict-fp32 training's and the rule is the core's, so every framework that captures gives the same verdicts."""
from __future__ import annotations

from harness.conformance.specs import SPECS
from harness.conformance.test_attention_numerics import _diagnosis
from harness.fp8 import verdicts

# an easy synthetic task learnt in 30 steps: the wrong classes' probabilities, and with them the logits' gradient,
# fall to e^-10 and below while the right class's stays near 1/batch (measured in torch: e4m3 flushes 14.4% of that
# gradient at the current recipe's scale, e5m2 0.23%)
LOGITS = {
    "name": "fp8_logit_gradients",
    "description": "FP8: a classifier's logits' gradient outgrows e4m3's range as it learns; e5m2 holds it",
    "input": {"shape": [32]},
    "dataset": {"name": "synthetic", "num_classes": 10, "size": 1024},
    "layers": [{"type": "dense", "units": 64}, {"type": "relu"}, {"type": "dense", "units": 10}],
    "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
    "optimizer": {"type": "sgd", "learning_rate": 0.05, "momentum": 0.9, "nesterov": False},
    "batch_size": 32,
    "steps": 30,
    "seed": 0,
}


def test_fp8_e4m3_gradients_underflow_where_the_hybrid_recipe_s_e5m2_holds_them(framework):
    said = verdicts(_diagnosis(framework, LOGITS["name"], LOGITS).get("fp8") or {})
    assert said, "diagnose recorded no FP8 cast statistics (diagnosis.fp8): are the layer outputs captured?"
    for recipe in ("current", "delayed:16"):
        assert said[f"fp8_e4m3:{recipe}"].startswith(f"fp8_e4m3:{recipe}: not safe: layer 2's output gradient "
                                                     f"(e4m3) underflows in "), said[f"fp8_e4m3:{recipe}"]
        assert said[f"fp8_hybrid:{recipe}"].startswith(f"fp8_hybrid:{recipe}: safe"), said[f"fp8_hybrid:{recipe}"]


def test_gradients_shrinking_every_step_underflow_the_delayed_recipe_s_e5m2_only(framework):
    spec = SPECS["pitfall_fp8_delayed"]  # the golden's spec ran 20 steps; the hazard builds up over its 48
    said = verdicts(_diagnosis(framework, spec.name, spec.with_overrides(steps=48).model_dump(mode="json"))
                    .get("fp8") or {})
    assert said["fp8_hybrid:current"].startswith("fp8_hybrid:current: safe"), said["fp8_hybrid:current"]
    assert said["fp8_hybrid:delayed:16"].startswith("fp8_hybrid:delayed:16: not safe: layer 0's output gradient "
                                                    "(e5m2) underflows in "), said["fp8_hybrid:delayed:16"]
