"""The golden fingerprints shipped with the conformance kit cover every built-in model and pitfall spec, and
each still matches its spec: a spec changed without `tox -e goldens` fails here."""
from __future__ import annotations

from harness.conformance.goldens import load
from harness.model.spec import builtin_models, load_spec
from tests.conftest import SPECS, pitfall_specs


def source(name: str):
    return load_spec(name) if name in builtin_models() else load_spec(str(SPECS / f"{name}.yaml"))


def test_every_built_in_model_and_pitfall_spec_has_a_golden():
    assert {g["model"] for g in load()} == set(builtin_models()) | {p.stem for p in pitfall_specs()}


def test_each_golden_matches_its_spec_today():
    for golden in load():
        embedded = golden["fingerprint"]["spec"]
        shape = embedded["input"]["shape"]
        spec = source(golden["model"]).with_overrides(
            embedded["batch_size"], embedded["steps"], tuple(shape[:2]) if len(shape) == 3 else None)
        if embedded["dataset"].get("corpus_hash"):  # the corpus is the kit's to check (conformance/specs.py)
            spec = spec.with_corpus_hash(embedded["dataset"]["corpus_hash"])
        assert spec.spec_hash() == golden["spec_hash"], (
            f"{golden['model']}: the spec changed since its golden fingerprint was made: run `tox -e goldens`")


def test_each_golden_is_a_run_the_identity_matrix_fingerprints_in_fp64():
    """The kit's golden and first-step checks take tox's float64 fingerprint of the golden's run
    (--amp-fingerprints) instead of training it again in every framework env: a golden made at other settings
    than its identity row (pitfall_rotary's at batch 8 once) costs each env that run twice."""
    from harness.run.matrix import load_matrix
    from harness.run.modes import FINGERPRINT
    from harness.run.plan import resolve
    from tests.conftest import ROOT

    matrix = load_matrix(str(ROOT / "tests" / "identity.yaml"))
    fingerprinted = {resolve(str(ROOT / m.model) if m.model.endswith(".yaml") else m.model, m.batch_size,
                             m.steps or FINGERPRINT.steps, m.input_size)[0].spec_hash()
                     for m in matrix.models
                     if "fingerprint" in m.commands and "fp64" in (m.precisions or matrix.precisions)}
    missing = [g["model"] for g in load() if g["spec_hash"] not in fingerprinted]
    assert not missing, (f"{missing}: no fp64 fingerprint of tests/identity.yaml is the golden's run; make the "
                         f"golden from the identity row's (`tox -e goldens`)")
