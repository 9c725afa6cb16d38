"""Results files are input too: `report` and `parity` read them safely (wrong encoding, binary, deep nesting,
huge lines, records whose fields have the wrong kind) and answer with one line and exit 2, or skip the record
and say so; never a traceback."""
from __future__ import annotations

import contextlib
import copy
import io
import json

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
