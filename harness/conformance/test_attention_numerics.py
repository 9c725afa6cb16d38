"""Attention numerics in diagnose (harness.numerics.attention_verdicts), from the adapter's captured layer outputs:
a layer whose scores outgrow float16 is called unsafe for float16, and for bfloat16 too, which holds their range
but spaces them 512 apart (harness.numerics.SCORE_SPACING); one with small scores safe. The large-score network is ill-conditioned on purpose (a softmax saturated by scores near 2^17), so
it proves no identity (its fp64 gradients differ by 1e-9 between frameworks) and is not in the parity set."""
from __future__ import annotations

import pytest

from harness import numerics
from harness.conformance.plugin import THREADS
from harness.conformance.specs import SPECS, residual_stream
from harness.run import worker

# after 24 residual blocks q k^T / sqrt(Dh) passes 65504 while every layer's output stays far inside it
LARGE_SCORES = residual_stream("large_attention_scores", "attention after a residual stream that nothing normalises",
                               24, [{"type": "attention", "heads": 2}, {"type": "sequence_pool", "mode": "mean"},
                                    {"type": "dense", "units": 3}], seed=25, steps=2)


def _diagnosis(framework, name, spec) -> dict:
    record = worker.run(worker.RunRequest(framework=framework, model=name, spec=spec, precision="fp32",
                                          run_id=f"conformance-{name}", warmup=0, mode="diagnose", every=1,
                                          threads=THREADS, device="cpu"))
    assert record["status"] == "ok", f"{name}: the diagnose run is {record['status']}: {record['reason']}"
    diagnosis = record["diagnosis"]
    if not diagnosis["available"]:
        pytest.skip("this adapter cannot capture tensors")
    return diagnosis


def _attention_verdicts(framework, name, spec) -> tuple[dict[str, str], dict[str, str]]:
    diagnosis = _diagnosis(framework, name, spec)
    return diagnosis["attention"], diagnosis["verdicts"]


def test_scores_beyond_float16_overflow_it_and_are_too_coarse_in_bfloat16(framework):
    """Scores near 2^17 overflow float16; bfloat16 holds them, 512 apart: rounding alone moves a softmax weight by
    far more than e, so mixed bfloat16 is unsafe there too."""
    attention, verdicts = _attention_verdicts(framework, LARGE_SCORES["name"], LARGE_SCORES)
    assert list(attention) == ["25"], f"one attention layer, 25: {attention}"
    assert "float16 overflows in the forward pass" in attention["25"] and "bfloat16 holds them but" in attention["25"], (
        f"its scores reach about 2^17 in every framework: {attention['25']}")
    assert verdicts["amp_fp16"].startswith("amp_fp16: unsafe: layer 25's attention scores reach"), verdicts["amp_fp16"]
    assert verdicts["amp_bf16"].startswith("amp_bf16: unsafe: attention 25's scores reach"), verdicts["amp_bf16"]


def test_small_scores_are_safe(framework):
    spec = SPECS["pitfall_pre_norm"]  # pre-norm: layernorm before the attention keeps its scores near 2^2
    resolved = spec.with_overrides(steps=2).model_dump(mode="json")
    attention, verdicts = _attention_verdicts(framework, spec.name, resolved)
    assert list(attention) == ["2.layers.1"], attention
    assert "float16 holds them" in attention["2.layers.1"] and "bfloat16 is safe" in attention["2.layers.1"], attention
    assert "attention scores" not in verdicts["amp_fp16"], verdicts["amp_fp16"]


def test_a_causal_layer_states_what_its_mask_leaves_in_each_16_bit_precision(framework):
    """The network's declaration (its attention_mask, Trainer.declare_attention_masks) for the causal layer only,
    in every 16-bit precision, and the verdict saying what a fully masked row would give with it."""
    spec = SPECS["pitfall_causal_mask"]
    diagnosis = _diagnosis(framework, spec.name, spec.with_overrides(steps=1).model_dump(mode="json"))
    masks = diagnosis.get("attention_masks")
    if not masks:
        pytest.skip("this adapter does not declare what its attention masks leave (Trainer.declare_attention_masks)")
    assert list(masks) == ["1"] and list(masks["1"]) == list(numerics.MASK_PRECISIONS), masks
    for precision, found in masks["1"].items():
        mask = numerics.AttentionMask.from_record(found)  # a value, dtypes and a rule the core knows
        assert mask.value < -1e4 and {mask.dtype, mask.softmax} <= {"float16", "bfloat16", "float32"}, (precision, mask)
    assert diagnosis["attention"]["1"].endswith(numerics.mask_clause(masks["1"])), diagnosis["attention"]["1"]
