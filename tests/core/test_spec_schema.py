"""Specs generated from the schema itself (ModelSpec's JSON schema: every field, nesting through residual blocks,
valid values at and past their bounds, and now and then a value of the wrong kind or a missing or unknown key).
Whatever comes out, `check` and `run` either accept the spec with its graph, data and memory checks passing, or
refuse it with the harness's own error in one line: never a traceback, never a hang."""
from __future__ import annotations

import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cli import main
from harness.errors import HarnessError
from harness.model import data, memory
from harness.model.graph import infer
from harness.model.spec import SEQUENCE_LAYERS, ModelSpec, validate
from harness.precision import parse_precision

SCHEMA = ModelSpec.model_json_schema()
HEAD = ({"type": "flatten"},)  # then a dense layer of num_classes units: the network ends as the loss needs
# what a sequence of token embeddings takes before it is pooled
SEQUENCE_BODY = ("position_embedding", "attention", "rmsnorm", "layernorm", "dense", "relu", "gelu", "dropout")
WRONG = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8) \
    | st.lists(st.integers(), max_size=3) | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)


def _bounds(node: dict, integer: bool) -> tuple[float, float, list]:
    """The valid range of a number, and the values just past it."""
    low = node.get("minimum", node.get("exclusiveMinimum", -10))
    high = node.get("maximum", node.get("exclusiveMaximum", 64 if integer else 10))
    if integer:
        return low + ("exclusiveMinimum" in node), high - ("exclusiveMaximum" in node), [low - 1, high + 1]
    inside = (math.nextafter(low, 2) if "exclusiveMinimum" in node else low,
              math.nextafter(high, -1) if "exclusiveMaximum" in node else high)
    return (*inside, [math.nextafter(low, -1), math.nextafter(high, 2), float("inf"), float("nan")])


def _from(node: dict, depth: int):
    """Valid values of a schema node: every field drawn, optional ones often left out, bounds included."""
    if "$ref" in node:
        return _from(SCHEMA["$defs"][node["$ref"].split("/")[-1]], depth)
    for key in ("anyOf", "oneOf"):
        if key in node:
            return st.one_of([_from(n, depth) for n in node[key]])
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "object":
        return _object(node, depth)
    if kind == "array":
        items = node["items"]
        if depth > 2 and "oneOf" in str(items):
            items = {"$ref": "#/$defs/Activation"}  # nesting stops at three residual levels
        return st.lists(_from(items, depth + 1), min_size=node.get("minItems", 0),
                        max_size=min(node.get("maxItems", 4), 4))
    if kind in ("integer", "number"):
        low, high, _ = _bounds(node, kind == "integer")
        inside = st.integers(int(low), min(int(high), 64)) if kind == "integer" else st.floats(low, high)
        return inside | st.sampled_from([low, high])
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=node.get("minLength", 0),
                       max_size=min(node.get("maxLength", 12), 12))
    if kind == "null":
        return st.none()
    raise AssertionError(f"the schema has a node this generator does not know: {node}")


def _object(node: dict, depth: int):
    @st.composite
    def build(draw):
        return {name: draw(_from(sub, depth)) for name, sub in node["properties"].items()
                if name in node.get("required", ()) or draw(st.booleans())}

    return build()


def _places(doc, path=()):
    yield path
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in children:
        yield from _places(value, path + (key,))


@st.composite
def specs(draw):
    """A valid document from the schema, made coherent half the time (the network ends in a dense layer of
    num_classes units, as the loss needs, so that whole specs pass and what follows is checked), then, half the
    time, one fault: a value of the wrong kind, a number past its bound, a key removed or an unknown key."""
    doc = draw(_from(SCHEMA, 0))
    if draw(st.booleans()):
        doc.pop("native", None)  # a spec's layers (a native spec's model is the user's code: tests/core/test_native_spec)
        doc["layers"] = doc.get("layers") or []
        # fresh copies: a fault below may change a value in place, and a shared HEAD would break every later doc
        doc["dataset"]["num_classes"] = min(doc["dataset"].get("num_classes") or 2, 64)
        for key in ("path", "task", "corpus_hash"):
            doc["dataset"].pop(key, None)
        if draw(st.booleans()):  # images or vectors: digits and image folders have constraints of their own
            doc["layers"] = [layer for layer in doc["layers"] if layer["type"] not in SEQUENCE_LAYERS][:3] + [
                dict(layer) for layer in HEAD]
            doc["input"]["shape"] = doc["input"]["shape"][:1] if draw(st.booleans()) else \
                (doc["input"]["shape"] * 3)[:3]
            doc["input"].pop("vocab", None)
            doc["dataset"]["name"] = "synthetic"
        else:  # a token sequence classified: the layers a sequence takes between an embedding and a pool
            doc["layers"] = [{"type": "embedding", "dim": draw(st.sampled_from([4, 6, 8]))}] + [
                layer for layer in doc["layers"] if layer["type"] in SEQUENCE_BODY][:3] + [
                {"type": "sequence_pool", "mode": draw(st.sampled_from(["mean", "first", "last"]))}]
            doc["input"] = {"shape": doc["input"]["shape"][:1], "vocab": draw(st.integers(2, 300))}
            doc["dataset"].update(name="synthetic_tokens", task="classification")
        doc["layers"].append({"type": "dense", "units": doc["dataset"]["num_classes"]})
        doc["loss"] = {"type": "sparse_categorical_crossentropy", "from_logits": True}
        doc["layers"][-1]["units"] = doc["dataset"]["num_classes"]
    if draw(st.booleans()):
        *parent, key = draw(st.sampled_from([p for p in _places(doc) if p]))
        holder = doc
        for part in parent:
            holder = holder[part]
        fault = draw(st.sampled_from(["wrong", "past", "remove", "unknown"]))
        if fault == "remove":
            del holder[key]
        elif fault == "unknown" and isinstance(holder, dict):
            holder[draw(st.text(min_size=1, max_size=6))] = 1
        elif fault == "past" and isinstance(holder[key], (int, float)) and not isinstance(holder[key], bool):
            holder[key] = draw(st.sampled_from([-1, 0, 2**40, 1e300, float("inf"), float("nan"), 1.0 + 1e-9]))
        else:
            holder[key] = draw(WRONG)
    return doc


def _one_line(exc: Exception) -> None:
    assert isinstance(exc, HarnessError) and "\n" not in str(exc), repr(exc)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                                    HealthCheck.data_too_large])
@given(specs())
def test_generated_specs_load_and_check_or_raise_one_line(doc):
    try:  # what resolving a spec asks (harness.run.plan.resolve): the schema, then the shapes
        spec = validate(doc, "generated")
        graph = infer(spec, "generated")
    except Exception as exc:  # noqa: BLE001 - anything but a one-line HarnessError fails the test
        _one_line(exc)
        return
    try:
        data.check(spec, "generated")
        memory.check_fits(spec, graph, [parse_precision("fp32")], "cpu", "generated")
    except Exception as exc:  # noqa: BLE001
        _one_line(exc)


def test_the_generator_reaches_accepted_and_refused_specs():
    """The property above means something only if both outcomes occur often."""
    accepted = refused = 0

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(specs())
    def count(doc):
        nonlocal accepted, refused
        try:
            infer(validate(doc, "generated"), "generated")
            accepted += 1
        except HarnessError:
            refused += 1

    count()
    assert accepted >= 10 and refused >= 100, (accepted, refused)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs())
def test_generated_specs_through_the_cli_exit_0_or_2_with_one_line(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("gen") / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["check", str(path)])
    assert code in (0, 2)
    if code == 2:
        assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()


def test_a_native_spec_with_a_list_for_its_optimizer_type_is_one_line():
    """Hypothesis found it: the native optimizer defaults looked the type up before validation, and a list is
    unhashable (a TypeError's traceback instead of the spec's one-line error)."""
    import pytest

    from harness.errors import SpecError
    from harness.model.spec import validate

    doc = {"name": "n", "input": {"shape": [1]}, "dataset": {"name": "synthetic"}, "native": {},
           "loss": {"type": "sparse_categorical_crossentropy"}, "optimizer": {"learning_rate": 1.0, "type": []},
           "batch_size": 1, "steps": 1}
    with pytest.raises(SpecError):
        validate(doc, "n")
