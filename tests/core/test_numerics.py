"""The numerics reductions and verdicts, on tensors whose answers are known."""
from __future__ import annotations

import numpy as np
import pytest

from harness.numerics import (
    FORMATS,
    MATMUL_ERROR,
    histogram,
    judge,
    kahan_lost,
    loss_scale_window,
    matmul_error,
    merge,
    outcomes,
    round_bfloat16,
    score_spacing,
    shares,
    update_counts,
    verdicts,
)
from harness.rounding import NOISE_RANGE, Rounding, kahan_update, round_stochastic


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
                      "bfloat16_squares": 0, "float16_sr": 0.0, "bfloat16_sr": 0.0, "bfloat16_kahan": 0.0,
                      "magnitude": pytest.approx(0.5101)}


def diagnosis(gradients, weights=1.0, updates=1e-3, optimizer="sgd", activations=None, matmul_error=None):
    """A diagnosis of one dense layer "0" (and, given `activations`, {layer: outputs}) as diagnose writes it;
    `matmul_error` {layer: {format: error}} where it measured them (diagnoses made before it did not)."""
    w = np.full(len(gradients), weights, np.float32)
    found = {"groups": {"gradients": {"0": histogram(gradients)}, "activation_gradients": {},
                        "weights": {"0": histogram(w)},
                        "activations": {layer: histogram(np.asarray(v, np.float32)) for layer, v in
                                        (activations or {}).items()}}, "optimizer": optimizer,
             "updates": {"0": update_counts(w, np.full(len(gradients), updates, np.float32), gradients)}}
    if matmul_error is not None:
        found["matmul_error"] = matmul_error
    return found


FINE = {"0": {"float16": 3e-4, "bfloat16": 2.4e-3}}  # a well-conditioned dense layer's matmul errors


def test_verdict_for_underflowing_gradients_names_the_window():
    text = verdicts(diagnosis(np.concatenate([np.full(90, 1.5 * 2.0**-28), np.full(10, 0.5)])))
    assert text["amp_fp16"] == ("amp_fp16: safe with a loss scale in 2^3..2^16; without scaling 90.0% of non-zero "
                                "gradients flush to zero, 90.0% of layer 0's weight gradients; layer outputs were "
                                "not captured, so not checked")


def test_verdict_without_underflow_says_safe_without_scaling():
    text = verdicts(diagnosis(np.full(100, 0.01), activations={"1": np.full(10, 3.0)}, matmul_error=FINE))
    assert text["amp_fp16"].startswith("amp_fp16: safe without loss scaling: 0.0% of non-zero gradients flush")
    assert text["amp_fp16"].endswith("; every layer's outputs fit its range; its matmuls are off by at most 0.03% of "
                                     "fp32's (in layer 0)")


def test_bf16_is_safe_only_when_its_figures_say_so():
    fine = outcomes(diagnosis(np.full(100, 0.01), activations={"1": np.full(10, 3.0)}, matmul_error=FINE))
    assert fine["amp_bf16"] == "safe"
    assert outcomes(diagnosis(np.full(100, 0.01)))["amp_bf16"] == "safe (layer outputs not checked)"
    # a diagnosis made before matmul errors were measured says so
    assert outcomes(diagnosis(np.full(100, 0.01), activations={"1": [1.0]}))["amp_bf16"] == \
        "safe (matmuls not checked)"
    # float32 subnormals below bfloat16's smallest subnormal (2^-133) flush to zero in it
    tiny = judge(diagnosis(np.concatenate([np.full(50, 2.0**-140), np.full(50, 0.01)]), activations={"1": [1.0]}))
    assert tiny["amp_bf16"][0] == "gradients flush"
    assert tiny["amp_bf16"][1].startswith("amp_bf16: 50.0% of non-zero gradients flush to zero in bfloat16 (below "
                                          "2^-133); scale the loss or keep those layers in float32")
    # 3.4e38 is a float32 but above bfloat16's largest value (3.39e38)
    huge = judge(diagnosis(np.full(100, 0.01), activations={"1": [1.0], "4 dense": [3.4e38, 1.0]},
                           matmul_error=FINE))
    assert huge["amp_bf16"][0] == "unsafe: layer 4 dense's outputs overflow bfloat16"
    assert huge["amp_bf16"][1].startswith("amp_bf16: unsafe: layer 4 dense's outputs reach 3.4e+38, above "
                                          "bfloat16's largest value 3.38953e+38, so they become inf in bfloat16")


def test_an_activation_above_65504_makes_fp16_unsafe_naming_the_layer():
    text = judge(diagnosis(np.full(100, 0.01), updates=1e-2,
                           activations={"1 relu": [3.0, 7.0e4], "3 dense": [1.0, 66000.0], "5 softmax": [0.5]},
                           matmul_error=FINE))
    outcome, sentence = text["amp_fp16"]
    assert outcome == "unsafe: layer 1 relu's outputs overflow float16"  # the largest first
    assert sentence.startswith("amp_fp16: unsafe: layer 1 relu's outputs reach 7e+04, above float16's largest value "
                               "65504 (and 1 more layer), so they become inf in float16; keep those layers in float32 "
                               "or use amp_bf16 (apart from that: safe without loss scaling")
    assert text["fp16"][0] == "unsafe: layer 1 relu's outputs overflow float16"
    assert text["amp_bf16"][0] == text["bf16"][0] == "safe"  # within bfloat16's range
    assert judge(diagnosis(np.full(100, 0.01), activations={"1 relu": [65504.0]}, matmul_error=FINE))[
        "amp_fp16"][0] == "safe without loss scaling"  # float16's largest value is still finite


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


# ---- what the significand does: per layer, and under each way of writing 16-bit weights ------------------------
def test_stochastic_rounding_loses_in_expectation_only_what_its_float32_sum_cannot_hold():
    """The expectation of stochastic rounding (harness.rounding's reference, over all 2^16 draws of its bits) is the
    float32 sum w16 + u: an update is lost in expectation exactly where that sum is w16, as update_counts counts."""
    w = np.float32(1.0)
    updates = np.array([1e-4, -1e-4, 2.0**-25, 2.0**-23, -3e-8, -2.0**-26], np.float32)
    bits = np.arange(NOISE_RANGE)
    for u in updates:
        written = round_stochastic(np.full(NOISE_RANGE, w + u, np.float32), bits, Rounding("stochastic", "bfloat16"))
        assert written.astype(np.float64).mean() == pytest.approx(float(np.float32(w + u)), abs=1e-12)
    kept = np.float32(w) + updates != w  # 2^-25 and -2^-26 are below half a float32 ulp of 1.0 (2^-24, 2^-25 below)
    assert kept.tolist() == [True, True, False, True, True, False]
    counts = update_counts(np.full(len(updates), w), updates, np.ones(len(updates)))
    assert counts["bfloat16_sr"] == pytest.approx(float(np.abs(updates[~kept].astype(np.float64)).sum()))
    assert counts["bfloat16"] == 6  # nearest rounding loses every one of them (half an ulp of 1.0 is 2^-8)


def test_kahan_loses_an_update_as_often_as_its_buffer_is_too_large_to_hold_it():
    """kahan_lost's probabilities against harness.rounding.kahan_update with its compensation buffer spread evenly
    over half the weight's ulp either side: an update is lost where the new weight and buffer are the old ones."""
    w, half = np.float32(1.5), 2.0**-8  # 1.5's bfloat16 ulp is 2^-7
    buffer = round_bfloat16(np.random.default_rng(0).uniform(-half, half, 100_000).astype(np.float32))
    weights = np.full(buffer.shape, w, np.float32)
    for exponent, expected in ((-16, 0.0), (-17, 0.0), (-18, 0.5), (-19, 0.75), (-20, 0.875)):
        u = np.float32(1.3 * 2.0**exponent)
        new, compensation = kahan_update(weights, weights + u, buffer)
        lost = ((new == weights) & (compensation == buffer)).mean()
        assert kahan_lost(np.array([w]), np.array([u]))[0] == expected
        assert lost == pytest.approx(expected, abs=0.01), exponent


def _layers(**layers):
    """A diagnosis of dense layers {name: (weights, updates)} (one value each, repeated), typed by their name."""
    counts = {name: update_counts(np.full(n, w, np.float32), np.full(n, u, np.float32), np.full(n, 0.01))
              for name, (n, w, u) in layers.items()}
    return {"groups": {"gradients": {name: histogram(np.full(n, 0.01)) for name, (n, _, _) in layers.items()}},
            "updates": counts, "optimizer": "sgd", "layer_types": {"0": "dense", "1": "rmsnorm", "2": "dense"}}


def test_a_layer_whose_updates_all_vanish_stalls_bf16_even_when_the_network_s_share_is_small():
    """A norm's 32 scales at 1.0 get updates of 1e-4, below half a bfloat16 ulp of 1.0 (2^-8), among 2000 dense
    weights that move: 1.6% of all updates vanish, 100% of the norm's; stochastic rounding and Kahan keep them."""
    found = judge(_layers(**{"0": (1000, 0.1, 1e-2), "1": (32, 1.0, 1e-4), "2": (1000, 0.1, 1e-2)}))
    assert found["bf16"][0] == "stalls: 100.0% of layer 1 (rmsnorm)'s updates vanish in bfloat16 (fix: bf16_sr or " \
                               "bf16_kahan)"
    assert found["bf16"][1].startswith("bf16: 1.6% of weight updates are below half an ulp of their weights in "
                                       "bfloat16, so nearest rounding drops them (by layer, the most: layer 1 "
                                       "(rmsnorm) 100.0%, layer 0 (dense) 0.0%, layer 2 (dense) 0.0%): training "
                                       "stalls; keep fp32 master weights (amp_bf16), or write the updates with "
                                       "stochastic rounding (bf16_sr: 0.0% of their magnitude lost) or Kahan")
    assert found["bf16_sr"][0] == found["bf16_kahan"][0] == "safe"
    assert found["bf16_kahan"][1].startswith("bf16_kahan: 0.0% of the weight updates' magnitude lost to Kahan "
                                             "summation, in expectation, at most 0.0% in layer 0 (dense);")
    assert found["fp16"][0] == "stalls: 100.0% of layer 1 (rmsnorm)'s updates vanish in float16 (fix: fp16_sr)"
    assert outcomes(_layers(**{"0": (1000, 0.1, 1e-2), "1": (32, 1.0, 1e-2)}))["bf16"] == "safe"


def test_each_rounding_rule_stalls_where_its_own_rule_loses_the_updates():
    """Updates of 1.3 * 2^-20 on weights of 1.5 are kept by stochastic rounding (float32 holds them) and lost 7/8
    of the time by Kahan's buffer (kahan_lost); below half a float32 ulp stochastic rounding loses them too."""
    middle = judge(_layers(**{"1": (32, 1.5, 1.3 * 2.0**-20)}))
    assert middle["bf16"][0] == "stalls: 100.0% of layer 1 (rmsnorm)'s updates vanish in bfloat16 (fix: bf16_sr)"
    assert middle["bf16_sr"][0] == "safe"
    assert middle["bf16_kahan"][0] == "stalls: 87.5% of layer 1 (rmsnorm)'s update magnitude vanishes in bfloat16 " \
                                      "(fix: amp_bf16)"
    tiny = judge(_layers(**{"1": (32, 1.5, 2.0**-26)}))
    assert tiny["bf16"][0].endswith("(fix: amp_bf16)")
    assert tiny["bf16_sr"][0] == "stalls: 100.0% of layer 1 (rmsnorm)'s update magnitude vanishes in bfloat16 " \
                                 "(fix: amp_bf16)"
    assert tiny["bf16_sr"][1].startswith("bf16_sr: 100.0% of the weight updates' magnitude is below half a float32 "
                                         "ulp of the weights")
    assert tiny["fp16_sr"][0].startswith("stalls") and tiny["fp16"][0].endswith("(fix: amp_fp16)")


def test_a_diagnosis_made_before_the_rounding_rules_were_counted_judges_nearest_rounding_only():
    old = _layers(**{"1": (32, 1.0, 1e-4)})
    for counts in old["updates"].values():
        for key in ("magnitude", "float16_sr", "bfloat16_sr", "bfloat16_kahan"):
            del counts[key]
    found = judge(old)
    assert set(found) == {"amp_fp16", "fp16", "bf16", "amp_bf16"}
    assert found["bf16"][0] == "stalls: 100.0% of layer 1 (rmsnorm)'s updates vanish in bfloat16 (fix: bf16_sr or " \
                               "bf16_kahan)"  # untested here, so not ruled out
    assert "(bf16_sr) or Kahan summation (bf16_kahan)" in found["bf16"][1]


def test_matmul_error_is_zero_for_16_bit_inputs_small_when_well_conditioned_and_large_when_terms_cancel():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((64, 32)).astype(np.float32), (rng.standard_normal((32, 16)) / 6).astype(np.float32)
    bf16, fp16 = FORMATS["bfloat16"], FORMATS["float16"]
    exact = (np.round(x * 8) / 8).astype(np.float32), (np.round(w * 16) / 16).astype(np.float32)
    assert matmul_error(*exact, bf16) == matmul_error(*exact, fp16) == 0.0  # exact products, exact float32 sums
    assert matmul_error(exact[0], w, bf16) > 2.0**-10 and matmul_error(x, exact[1], bf16) > 2.0**-10  # each rounded
    assert 2.0**-10 < matmul_error(x, w, bf16) < 2.0**-7 and 2.0**-13 < matmul_error(x, w, fp16) < 2.0**-10
    # inputs near 64 (bfloat16's ulp there: 0.5) times columns that sum to 0: the product keeps only the noise
    offset, centred = (64 + x).astype(np.float32), (w - w.mean(0)).astype(np.float32)
    assert matmul_error(offset, centred, bf16) > MATMUL_ERROR > matmul_error(offset, centred, fp16)
    assert matmul_error(np.zeros((2, 2), np.float32), w[:2], bf16) is None


def test_a_matmul_that_rounding_spoils_makes_the_precision_unsafe_naming_the_layer():
    errors = {"0": {"float16": 3e-4, "bfloat16": 2.4e-3}, "2": {"float16": 0.019, "bfloat16": 0.15}}
    found = _layers(**{"0": (100, 0.1, 1e-2), "2": (100, 0.1, 1e-2)})
    found.update(matmul_error=errors)
    found["groups"].update(activations={"0": histogram(np.ones(4))})
    said = judge(found)
    assert said["amp_bf16"][0] == "unsafe: layer 2 (dense)'s matmul is off by 15% in bfloat16"
    assert said["amp_bf16"][1].startswith("amp_bf16: unsafe: layer 2 (dense)'s matmul with its inputs rounded to "
                                          "bfloat16 is off by 15% of its fp32 product (above 3.1%); keep those layers "
                                          "in float32 (apart from that: safe: ")
    assert said["bf16"][0] == said["bf16_sr"][0] == said["amp_bf16"][0]  # pure bfloat16 computes in it too
    assert said["amp_fp16"][0] == "safe without loss scaling"
    assert said["amp_fp16"][1].endswith("its matmuls are off by at most 1.9% of fp32's (in layer 2 (dense))")


@pytest.mark.parametrize("top, bf16_spacing, fp16_spacing", [(2.0**16.5, 512, None), (200.0, 1, None),
                                                             (100.0, None, None), (2000.0, 8, 1)])
def test_attention_scores_spaced_an_ulp_of_1_or_more_apart_are_unsafe(top, bf16_spacing, fp16_spacing):
    """Scores near 2^16 are 512 apart in bfloat16; from 128 (bfloat16) or 1024 (float16) they are 1 apart, past
    what softmax can bear (SCORE_SPACING); scores past float16's range are its range problem instead. The spacings
    given are where a precision is unsafe, None where it is not for that reason."""
    found = _layers(**{"0": (100, 0.1, 1e-2)})
    found.update(matmul_error=FINE)
    found["groups"].update(activations={"0": histogram(np.ones(4))},
                           attention_scores={"3.layers.1": histogram(np.array([top, -top / 3]))})
    said = judge(found)
    for precision, spacing in (("amp_bf16", bf16_spacing), ("amp_fp16", fp16_spacing)):
        if spacing:
            assert said[precision][0] == f"unsafe: attention 3.layers.1's scores are {spacing:g} apart in " \
                                         f"{'bfloat16' if precision == 'amp_bf16' else 'float16'}", said[precision]
            assert f"rounding alone moves a score by up to {spacing / 2:g}, its softmax weight by up to a factor " \
                   f"e^{spacing / 2:g}" in said[precision][1]
        else:
            assert not said[precision][0].startswith("unsafe: attention"), said[precision]
    if top > FORMATS["float16"].max:
        assert said["amp_fp16"][0] == "unsafe: layer 3.layers.1's attention scores overflow float16"
    assert score_spacing(top, FORMATS["bfloat16"]) == 2.0 ** (np.floor(np.log2(top)) - 7)


def test_a_fix_is_named_only_where_its_own_verdict_is_safe():
    """With Adam and gradients of 1e-5, whose squares flush in float16: fp16_sr keeps the updates fp16 drops, but
    its second moment (in float16, as in every pure float16 precision) underflows, so fp16's fix is amp_fp16."""
    found = diagnosis(np.full(64, 1e-5), weights=1.0, updates=1e-4, optimizer="adam")
    said = outcomes(found)
    assert said["fp16"] == "stalls: 100.0% of layer 0's updates vanish in float16 (fix: amp_fp16)"
    assert said["fp16_sr"] == "the optimizer's second moment underflows"
    assert said["bf16"] == "stalls: 100.0% of layer 0's updates vanish in bfloat16 (fix: bf16_sr or bf16_kahan)"
    assert "or write the updates" not in verdicts(found)["fp16"]
