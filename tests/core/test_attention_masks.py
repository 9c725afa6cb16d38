"""What a causal attention's mask leaves in 16 bits: each adapter declares the value its masked scores hold, their
dtype and the softmax's (harness.numerics.AttentionMask); the core computes, in numpy, what a fully masked row
then gives, and the diagnosis's attention verdict says it per precision."""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness import numerics
from harness.model.graph import infer
from harness.model.spec import validate
from harness.records import Diagnosis
from tests.core.test_attention_numerics import SPEC, _histograms

F32_MAX = float(np.finfo(np.float32).max)
BF16_MIN = -3.3895313892515355e38  # jnp.finfo(bfloat16).min


@pytest.mark.parametrize("mask, outcome", [
    (numerics.AttentionMask(-math.inf, "float16", "float16"), "NaN"),  # -inf - (-inf) is NaN
    (numerics.AttentionMask(-math.inf, "float32", "float32"), "NaN"),
    (numerics.AttentionMask(-65504.0, "float16", "float16"), "uniform"),  # jnp.finfo(float16).min
    (numerics.AttentionMask(BF16_MIN, "bfloat16", "bfloat16"), "uniform"),
    (numerics.AttentionMask(-0.7 * F32_MAX, "float32", "float32"), "uniform"),  # Keras' fused attention
    (numerics.AttentionMask(-1e9, "float16", "float16"), "NaN"),  # -1e9 is -inf in float16 (transformers#17306)
    (numerics.AttentionMask(-1e9, "bfloat16", "bfloat16"), "uniform"),
    (numerics.AttentionMask(-F32_MAX, "bfloat16", "bfloat16"), "NaN"),  # float32's min rounds to -inf in bfloat16
    (numerics.AttentionMask(-65504.0, "float16", "float32"), "uniform"),
    (numerics.AttentionMask(-math.inf, "float32", "float32", "safe"), "zero"),  # torch's SDPA kernels
    (numerics.AttentionMask(-65504.0, "float16", "float16", "safe"), "uniform"),  # safe only changes all -inf rows
])
def test_a_fully_masked_row_gives_what_the_value_in_that_dtype_gives(mask, outcome):
    weights = numerics.fully_masked_row(mask, length=5)
    expected = {"NaN": np.full(5, np.nan), "uniform": np.full(5, 0.2), "zero": np.zeros(5)}[outcome]
    np.testing.assert_array_equal(weights if outcome != "uniform" else weights.round(3), expected)
    assert numerics.masked_row_outcome(mask).startswith({"NaN": "NaN", "uniform": "uniform weights",
                                                         "zero": "zero weights"}[outcome])


def test_a_mask_goes_into_a_record_as_strings_and_back():
    for mask in (numerics.AttentionMask(-math.inf, "float32", "float32", "safe"),
                 numerics.AttentionMask(-0.7 * F32_MAX, "float32", "float32"),
                 numerics.AttentionMask(BF16_MIN, "bfloat16", "bfloat16")):
        found = mask.to_record()
        assert all(isinstance(v, str) for v in found.values())
        assert numerics.AttentionMask.from_record(found) == mask
    with pytest.raises(ValueError, match="softmax rule"):
        numerics.AttentionMask(-math.inf, "float32", "float32", "lenient")


def _declared(value_16, value_bf16, dtype=None, softmax=None, rule="plain"):
    def declare(precision):
        compute = "float16" if "fp16" in precision else "bfloat16"
        return numerics.AttentionMask(value_16 if compute == "float16" else value_bf16, dtype or compute,
                                      softmax or compute, rule).to_record()
    return {precision: declare(precision) for precision in numerics.MASK_PRECISIONS}


def test_the_clause_groups_the_precisions_that_mask_alike_and_says_what_a_full_row_gives():
    flax = numerics.mask_clause(_declared(-65504.0, BF16_MIN))
    assert flax == ("masked scores: amp_fp16, fp16: -65504 in float16, softmax in float16, so a fully masked row would "
                    "give uniform weights (the mean of the values); amp_bf16, bf16: -3.38953e+38 in bfloat16, softmax "
                    "in bfloat16, so a fully masked row would give uniform weights (the mean of the values) (causal "
                    "attention never masks a whole row)")
    inf = numerics.mask_clause(_declared(-math.inf, -math.inf))
    assert "amp_fp16, fp16: -inf in float16" in inf and inf.count("would give NaN") == 2
    sdpa = numerics.mask_clause(_declared(-math.inf, -math.inf, "float32", "float32", "safe"))
    assert sdpa.startswith("masked scores: amp_fp16, fp16, amp_bf16, bf16: -inf in float32, softmax in float32, all "
                           "-inf rows give 0, so a fully masked row would give zero weights")
    rounded = numerics.mask_clause(_declared(-1e9, -1e9))  # the value as the scores' dtype holds it
    assert "amp_fp16, fp16: -inf (from -1e+09) in float16" in rounded and "-9.98244e+08 (from -1e+09) in bfloat16" \
        in rounded


def test_the_attention_verdict_states_the_declared_masks_of_its_layer():
    diagnosis = _histograms(6.0, 2.0, 2.0, 2.0**-10)
    plain = numerics.attention_verdicts(diagnosis)["3.layers.1"]
    assert "masked scores" not in plain  # nothing declared: nothing said
    diagnosis["attention_masks"] = {"3.layers.1": _declared(-math.inf, -math.inf)}
    said = numerics.attention_verdicts(diagnosis)["3.layers.1"]
    assert said == plain + "; " + numerics.mask_clause(diagnosis["attention_masks"]["3.layers.1"])
    Diagnosis.model_validate({"available": True, "captured_steps": [0], "groups": {}, **diagnosis})


def test_the_table_asks_the_network_for_every_causal_layer_in_every_16_bit_precision():
    spec = validate({**SPEC, "layers": [SPEC["layers"][0], {"type": "attention", "heads": 2},
                                        {"type": "attention", "heads": 2, "causal": True}, *SPEC["layers"][2:]]}, "a")
    asked = []

    def declare(info, precision, device_kind):
        asked.append((info.path, precision.name, device_kind))
        if device_kind == "gpu":  # a kernel the network cannot vouch for there: nothing declared
            return None if precision.mixed else numerics.AttentionMask(-math.inf, precision.compute_dtype, "float32")
        return numerics.AttentionMask(-math.inf, precision.compute_dtype, "float32")

    table = numerics.mask_table(infer(spec), declare, "cpu")
    assert list(table) == ["2"] and list(table["2"]) == list(numerics.MASK_PRECISIONS)  # layer 1 masks nothing
    assert asked == [("2", p, "cpu") for p in numerics.MASK_PRECISIONS]
    assert table["2"]["amp_bf16"] == {"value": "-inf", "dtype": "bfloat16", "softmax": "float32", "rule": "plain"}
    assert list(numerics.mask_table(infer(spec), declare, "gpu")["2"]) == ["fp16", "bf16"]  # None: left out
    assert numerics.mask_table(infer(spec), lambda info, precision, kind: None, "gpu") == {}
