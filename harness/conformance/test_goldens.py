"""The adapter's float64 fingerprints against the golden ones: the same network, weights, data, dropout masks
and optimizer give the same outputs, losses, outputs after K steps and first-step gradients as the reference
framework, at the parity check's strict float64 tolerances. An adapter that cannot compute in float64 is
compared in float32 at the fp32 tolerances (and the test says so)."""
from __future__ import annotations

import warnings

import pytest

from harness.conformance.goldens import load
from harness.conformance.specs import OTHER_CORPUS, SPECS, golden_request, hint
from harness.parity import compare
from harness.run import worker

GOLDENS = {g["model"]: g for g in load()} if SPECS else {}
# a loss scale that changes nothing in float64 (a power of two, far from overflow): the scaled gradients are the
# unscaled ones times it, exactly
EXACT_SCALE = "1024"
WHERE = {"logits_error": "initial outputs (the forward pass)", "gradient_error": "first-step gradients "
         "(the backward pass)", "loss_error": "losses (training: loss, optimizer, batchnorm statistics)",
         "final_error": "outputs after training"}


def test_goldens_are_shipped():
    assert GOLDENS, "harness/conformance/goldens.json is missing or empty: `tox -e goldens` writes it"


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_float64_fingerprint_matches_the_golden(unsupported, fingerprinted, framework, name):
    precision, comparison = _against_the_golden(unsupported, fingerprinted, framework, name)
    note = " (float64 unsupported: compared in float32)" if precision == "fp32" else ""
    assert comparison.verdict.startswith("pass"), hint(
        SPECS[name], f"{comparison.verdict}{note}: relative errors against the golden fingerprint: "
                     f"{_errors(comparison)}")


@pytest.mark.parametrize("name", sorted(n for n in GOLDENS if SPECS[n].optimizer.clip_norm is not None))
def test_clipping_takes_the_norm_of_the_unscaled_gradients(unsupported, fingerprinted, framework, name):
    """The same run under a fixed loss scale of 1024 must still match the golden: clipping the scaled gradients
    (1024 times the norm) or before the scaler's check would not."""
    precision, comparison = _against_the_golden(unsupported, fingerprinted, framework, name, loss_scale=EXACT_SCALE)
    assert comparison.verdict.startswith("pass"), hint(
        SPECS[name], f"clipping: under a fixed loss scale of {EXACT_SCALE} the {precision} run no longer matches "
                     f"the golden ({comparison.verdict}: {_errors(comparison)}): clip_norm must act on the unscaled "
                     f"gradients' global norm, after the loss scaler's finite check (harness.model.spec)")


def _against_the_golden(unsupported, fingerprinted, framework, name, loss_scale=None):
    """(the precision it ran in, its fingerprint compared with the golden): float64, or float32 where the adapter
    cannot compute in float64. The run is the one `amp-harness fingerprint` recorded where --amp-fingerprints has it
    (tox fingerprints every golden's spec just before the kit), else run here."""
    golden, spec = GOLDENS[name], SPECS[name]
    if name in OTHER_CORPUS:
        pytest.skip(f"{name}: {OTHER_CORPUS[name]} (another Python's standard library): no golden to compare")
    precision = "fp64"
    if unsupported("fp64"):
        precision = "fp32"  # compared at the fp32 tolerances: a float32-only adapter cannot meet float64's
        warnings.warn(f"{framework} cannot compute in float64: {name} is compared in float32, at the fp32 "
                      f"tolerances, against the float64 golden")
    request = golden_request(framework, name, precision, loss_scale)
    record = fingerprinted(request) or worker.run(request)
    assert record["status"] == "ok", hint(spec, f"the {precision} fingerprint run is {record['status']}: "
                                                f"{record['reason']}")
    (comparison,) = compare([{**golden, "precision": precision}, record])
    return precision, comparison


def _errors(comparison) -> str:
    return ", ".join(f"{what} {getattr(comparison, key):.1e}" for key, what in WHERE.items()
                     if getattr(comparison, key) is not None)
