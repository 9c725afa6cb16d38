"""The numerics reductions and verdicts, on tensors whose answers are known."""
from __future__ import annotations

import numpy as np
import pytest

from harness.numerics import (
    FORMATS,
    histogram,
    judge,
    loss_scale_window,
    merge,
    outcomes,
    round_bfloat16,
    shares,
    update_counts,
    verdicts,
)


def test_bfloat16_rounding_is_round_to_nearest_even():
    x = np.array([1 + 2**-8, 1 + 2**-7 + 2**-8, 1 + 3 * 2**-9, 2**-134, 2**-133, 3.4e38, -2.5], np.float32)
    np.testing.assert_array_equal(round_bfloat16(x), np.array([1, 1 + 2**-6, 1 + 2**-7, 0, 2**-133, np.inf, -2.5],
                                                             np.float32))


def test_shares_are_exact_at_powers_of_two():
    fp16 = FORMATS["float16"]
    h = histogram(np.array([0.0, 2**-26, 2**-25 * 1.5, 2**-20, 1.0, 65536.0, np.inf]))
    assert (h["zeros"], h["nonfinite"], h["count"]) == (1, 1, 7)
    assert shares(h, fp16) == {"flushed": 0.2, "subnormal": 0.4, "overflow": 0.2}
    # the same values after a loss scale of 2^2: the smallest now lands in the subnormal range
    assert shares(h, fp16, 2) == {"flushed": 0.0, "subnormal": 0.6, "overflow": 0.2}
    # casting agrees with the bins
    with np.errstate(over="ignore"):
        cast = np.array([2**-26, 2**-25 * 1.5, 2**-20, 1.0, 65536.0]).astype(np.float16)
    assert (cast == 0).sum() == 1 and np.isinf(cast).sum() == 1
    assert merge([h, h])["bins"] == {e: 2 * c for e, c in h["bins"].items()}


def test_loss_scale_window():
    small = np.concatenate([np.full(99, 2.0**-30), [1.0]])
    assert loss_scale_window(histogram(small)) == (5, 15)
    crossing = np.concatenate([np.full(50, 2.0**-40), np.full(50, 2.0**10)])
    low, high = loss_scale_window(histogram(crossing))
    assert low > high


def test_swamped_updates_are_those_below_half_an_ulp():
    counts = update_counts(np.array([1.0, 1.0, 1000.0, 5.0]), np.array([1e-4, 1e-2, 0.5, 0.0]),
                           np.array([1e-3, 1e-5, 0.0, 1.0]))
    assert counts == {"updates": 3, "gradients": 3, "float16": 1, "bfloat16": 2, "float16_squares": 1,
                      "bfloat16_squares": 0}


def diagnosis(gradients, weights=1.0, updates=1e-3, optimizer="sgd", activations=None):
    """A diagnosis of one dense layer "0" (and, given `activations`, {layer: outputs}) as diagnose writes it."""
    w = np.full(len(gradients), weights, np.float32)
    return {"groups": {"gradients": {"0": histogram(gradients)}, "activation_gradients": {},
                       "weights": {"0": histogram(w)},
                       "activations": {layer: histogram(np.asarray(v, np.float32)) for layer, v in
                                       (activations or {}).items()}}, "optimizer": optimizer,
            "updates": {"0": update_counts(w, np.full(len(gradients), updates, np.float32), gradients)}}


def test_verdict_for_underflowing_gradients_names_the_window():
    text = verdicts(diagnosis(np.concatenate([np.full(90, 1.5 * 2.0**-28), np.full(10, 0.5)])))
    assert text["amp_fp16"] == ("amp_fp16: safe with a loss scale in 2^3..2^16; without scaling 90.0% of non-zero "
                                "gradients flush to zero, 90.0% of layer 0's weight gradients; layer outputs were "
                                "not captured, so not checked")


def test_verdict_without_underflow_says_safe_without_scaling():
    text = verdicts(diagnosis(np.full(100, 0.01), activations={"1": np.full(10, 3.0)}))
    assert text["amp_fp16"].startswith("amp_fp16: safe without loss scaling: 0.0% of non-zero gradients flush")
    assert text["amp_fp16"].endswith("; every layer's outputs fit its range")


def test_bf16_is_safe_only_when_its_figures_say_so():
    fine = outcomes(diagnosis(np.full(100, 0.01), activations={"1": np.full(10, 3.0)}))
    assert fine["amp_bf16"] == "safe"
    assert outcomes(diagnosis(np.full(100, 0.01)))["amp_bf16"] == "safe (layer outputs not checked)"
    # float32 subnormals below bfloat16's smallest subnormal (2^-133) flush to zero in it
    tiny = judge(diagnosis(np.concatenate([np.full(50, 2.0**-140), np.full(50, 0.01)]), activations={"1": [1.0]}))
    assert tiny["amp_bf16"][0] == "gradients flush"
    assert tiny["amp_bf16"][1].startswith("amp_bf16: 50.0% of non-zero gradients flush to zero in bfloat16 (below "
                                          "2^-133); scale the loss or keep those layers in float32")
    # 3.4e38 is a float32 but above bfloat16's largest value (3.39e38)
    huge = judge(diagnosis(np.full(100, 0.01), activations={"1": [1.0], "4 dense": [3.4e38, 1.0]}))
    assert huge["amp_bf16"][0] == "unsafe: layer 4 dense's outputs overflow bfloat16"
    assert huge["amp_bf16"][1].startswith("amp_bf16: unsafe: layer 4 dense's outputs reach 3.4e+38, above "
                                          "bfloat16's largest value 3.38953e+38, so they become inf in bfloat16")


def test_an_activation_above_65504_makes_fp16_unsafe_naming_the_layer():
    text = judge(diagnosis(np.full(100, 0.01), updates=1e-2,
                           activations={"1 relu": [3.0, 7.0e4], "3 dense": [1.0, 66000.0], "5 softmax": [0.5]}))
    outcome, sentence = text["amp_fp16"]
    assert outcome == "unsafe: layer 1 relu's outputs overflow float16"  # the largest first
    assert sentence.startswith("amp_fp16: unsafe: layer 1 relu's outputs reach 7e+04, above float16's largest value "
                               "65504 (and 1 more layer), so they become inf in float16; keep those layers in float32 "
                               "or use amp_bf16 (apart from that: safe without loss scaling")
    assert text["fp16"][0] == "unsafe: layer 1 relu's outputs overflow float16"
    assert text["amp_bf16"][0] == text["bf16"][0] == "safe"  # within bfloat16's range
    assert judge(diagnosis(np.full(100, 0.01), activations={"1 relu": [65504.0]}))["amp_fp16"][0] == \
        "safe without loss scaling"  # float16's largest value is still finite


def test_verdict_for_pure_16_bit_updates_that_vanish():
    text = verdicts(diagnosis(np.full(100, 0.01), weights=1.0, updates=1e-4))
    assert text["fp16"].startswith("fp16: 100.0% of weight updates are below half an ulp")
    assert "keep fp32 master weights (amp_fp16)" in text["fp16"]
    assert verdicts(diagnosis(np.full(100, 0.01), updates=1e-2))["fp16"].endswith("safe here")


def test_verdict_for_a_second_moment_that_underflows():
    text = verdicts(diagnosis(np.full(100, 1e-5), updates=1e-2, optimizer="adam"))
    assert text["fp16"].startswith("fp16: 100.0% of squared gradients flush to zero in float16, so adam's second")
    assert verdicts(diagnosis(np.full(100, 1e-8), updates=1e-2, optimizer="sgd"))["fp16"].startswith(
        "fp16: 100.0% of non-zero gradients flush")  # no second moment: the gradients themselves flush


@pytest.mark.parametrize("values", [np.array([]), np.zeros(5)])
def test_no_gradients_no_window(values):
    assert loss_scale_window(histogram(values)) == (None, None)
