"""Results files are input too: `report` and `parity` read them safely (wrong encoding, binary, deep nesting,
huge lines, records whose fields have the wrong kind) and answer with one line and exit 2, or skip the record
and say so; never a traceback."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cli import main
from tests.core.test_report_scale import _benchmark

TEMPLATE = _benchmark().records(40)  # 2 frameworks x 2 precisions x 10 repeats of one model


def _cli(*args) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue().strip().splitlines()


@pytest.mark.parametrize("name, content, expected", [
    ("latin-1", '{"run_id": "caf\xe9"}\n'.encode("latin-1"), "line 1: byte 15: not UTF-8 text"),
    ("binary", bytes(range(256)) * 4, "line 1: "),
    ("deep", b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 1: nested too deeply"),
    ("huge-line", b'{"run_id": "' + b"x" * (65 << 20) + b'"}\n', "line 1: longer than 64 MiB"),
    ("not-records", b"[1, 2]\n", "line 1: not a result record (no run_id)"),
    ("text", b"hello\n{}\n", "line 1: not a JSON record"),
])
@pytest.mark.parametrize("command", ["report", "parity"])
def test_bad_results_files_are_one_line_and_exit_2(tmp_path, name, content, expected, command):
    filename = "results.jsonl" if command == "report" else "fingerprints.jsonl"
    (tmp_path / filename).write_bytes(content)
    args = [command, str(tmp_path)] + (["-o", str(tmp_path / "r" / "index.html")] if command == "report" else [])
    code, err = _cli(*args)
    assert code == 2 and len(err) == 1 and expected in err[0] and str(tmp_path) in err[0], err


WRONG = st.none() | st.booleans() | st.integers(-5, 5) | st.floats() | st.text(max_size=5) \
    | st.lists(st.integers(), max_size=3) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)


def _places(doc, path=()):
    if path:
        yield path
    children = doc.items() if isinstance(doc, dict) else enumerate(doc[:3]) if isinstance(doc, list) else ()
    for key, value in children:
        yield from _places(value, path + (key,))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_records_with_damaged_fields_render_or_are_skipped(tmp_path, data):
    records = copy.deepcopy(TEMPLATE)
    for _ in range(data.draw(st.integers(1, 4))):
        record = records[data.draw(st.integers(0, len(records) - 1))]
        *parent, key = data.draw(st.sampled_from(list(_places(record))))
        holder = record
        for part in parent:
            holder = holder[part]
        holder[key] = data.draw(WRONG)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, err = _cli("report", str(tmp_path), "-o", str(tmp_path / "r" / "index.html"))
    assert code in (0, 2), err
    if code == 2:
        assert len(err) == 1, err


# ---- every records file the report reads: results, profiles, diagnoses, fingerprints ----------------------------
HOSTILE = "<script>alert(1)</script>"


def _diagnosis_record(framework: str) -> dict:
    import numpy as np

    from harness import numerics

    gradients = np.concatenate([np.full(90, 1.5 * 2.0**-28), np.full(10, 0.5)])
    diagnosis = {"available": True, "every": 10, "captured_steps": [0, 10], "optimizer": "adam",
                 "groups": {"gradients": {"0": numerics.histogram(gradients)}, "activation_gradients": {},
                            "weights": {}, "activations": {"0": numerics.histogram(gradients)}},
                 "updates": {"0": numerics.update_counts(np.ones(100), np.full(100, 1e-3), gradients)}}
    diagnosis.update(verdicts=numerics.verdicts(diagnosis),
                     loss_scale_window=list(numerics.loss_scale_window(numerics.histogram(gradients))))
    return json.loads(json.dumps({"run_id": f"d-{framework}", "framework": framework, "model": "m", "spec_hash": "h",
                                  "precision": "fp32", "status": "ok", "reason": None, "loss": [1.0, 0.9],
                                  "device": "cpu", "diagnosis": diagnosis}))


def _kinds() -> dict[str, list[dict]]:
    """One small, well-formed file of each kind, as amp-harness writes them (JSON: string keys)."""
    from tests.core.test_parity import fp
    from tests.core.test_report_profile import PROFILES

    return {"results.jsonl": copy.deepcopy(TEMPLATE[:8]), "profiles.jsonl": json.loads(json.dumps(PROFILES)),
            "diagnoses.jsonl": [_diagnosis_record("torch"), _diagnosis_record("tensorflow")],
            "fingerprints.jsonl": [fp("torch"), fp("tensorflow", final=(1.5, 2.5000001)), fp("torch", "amp_bf16")]}


def _report(tmp_path, kinds: dict[str, list[dict]]) -> tuple[int, list[str], str]:
    for filename, records in kinds.items():
        (tmp_path / filename).write_text("".join(json.dumps(r) + "\n" for r in records))
    page = tmp_path / "r" / "index.html"
    code, err = _cli("report", str(tmp_path), "--parity", str(tmp_path), "-o", str(page))
    return code, err, page.read_text() if code == 0 else ""


def _hostile(value, key=None):
    """Every string made to carry raw HTML, but the two a record must hold as written to be read: its status and
    its loss scale's mode (harness.records)."""
    if isinstance(value, str) and key not in ("status", "mode"):
        return value + HOSTILE
    if isinstance(value, list):
        return [_hostile(v) for v in value]
    if isinstance(value, dict):
        return {k: _hostile(v, k) for k, v in value.items()}
    return value


@pytest.mark.parametrize("filename", ["results.jsonl", "profiles.jsonl", "diagnoses.jsonl", "fingerprints.jsonl"])
def test_hostile_strings_in_any_records_file_reach_the_page_escaped(tmp_path, filename):
    kinds = _kinds()
    kinds[filename] = [_hostile(r) for r in kinds[filename]]
    code, err, page = _report(tmp_path, kinds)
    assert code == 0, err
    assert "<script>alert" not in page.lower() and "&lt;script&gt;alert(1)" in page  # shown, as text only


def _leaves(doc, path=()):
    """The paths of a record's strings and numbers, the first two items of a list only."""
    children = doc.items() if isinstance(doc, dict) else enumerate(doc[:2]) if isinstance(doc, list) else None
    if children is None:
        if isinstance(doc, (str, int, float)) and not isinstance(doc, bool):
            yield path
        return
    for key, value in children:
        yield from _leaves(value, path + (key,))


@pytest.mark.parametrize("filename", ["results.jsonl", "profiles.jsonl", "diagnoses.jsonl", "fingerprints.jsonl"])
def test_raw_html_in_place_of_any_value_is_skipped_or_escaped(tmp_path, filename):
    """One copy of a record per value in it (a number, a name, a layer's figure, a histogram's count), that value
    replaced by raw HTML, each copy a model of its own so that each is drawn: none reaches the page raw."""
    kinds = _kinds()
    base = kinds[filename][0]
    copies = []
    for i, path in enumerate(p for p in _leaves(base) if p not in (("run_id",), ("status",))):
        r = copy.deepcopy(base)
        r.update(run_id=f"{base['run_id']}-{i}", model=f"{base.get('model')}-{i}")
        holder = r
        for part in path[:-1]:
            holder = holder[part]
        holder[path[-1]] = HOSTILE
        copies.append(r)
    kinds[filename] += copies
    code, err, page = _report(tmp_path, kinds)
    assert code == 0, err
    assert "<script>alert" not in page.lower(), page[page.lower().index("<script>alert") - 300:][:400]


def _payload(filename: str) -> str | None:
    return {"profiles.jsonl": "profile", "diagnoses.jsonl": "diagnosis", "fingerprints.jsonl": "fingerprint",
            "results.jsonl": "step_time_ms"}[filename]


@pytest.mark.parametrize("filename", ["results.jsonl", "profiles.jsonl", "diagnoses.jsonl", "fingerprints.jsonl"])
def test_a_record_missing_any_field_is_skipped_or_read_never_a_traceback(tmp_path, filename):
    """Each field of a record (and of what it carries: its profile, diagnosis, fingerprint), left out of one copy
    of it: the report is written, and says what it skipped."""
    kinds = _kinds()
    records, payload = kinds[filename], _payload(filename)
    damaged = []
    for i, base in enumerate(records):
        # without run_id a line is not a record: the file is refused (test_bad_results_files_are_one_line_and_exit_2)
        for field in [k for k in base if k != "run_id"] + [f"{payload}.{k}" for k in base.get(payload) or {}]:
            r = copy.deepcopy(base)
            holder, _, name = (r[payload], None, field.split(".", 1)[1]) if "." in field else (r, None, field)
            del holder[name]
            r["run_id"] = f"{base['run_id']}-without-{field}"
            damaged.append(r)
    kinds[filename] = records + damaged
    code, err, page = _report(tmp_path, kinds)
    assert code == 0, err
    assert re.search(r"\d+ records? skipped: ", page) and (filename == "results.jsonl" or f"{filename}: " in page)
