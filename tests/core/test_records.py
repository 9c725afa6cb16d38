"""Records files written by earlier versions still read (harness.records), a schema this version cannot read is
refused in one line, a broken field is named, and one identity (harness.identity) ties a request to its record for
--resume, the report and parity.

tests/core/data/schema4/ holds files written by amp-harness at schema 4, before the records were models: a torch
run of mnist_mlp (fp32 and amp_fp16 under a dynamic loss scale, `--steps 3 --warmup 1 --repeats 1`, variant auto)
and its fp32 fingerprint.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from harness import identity, results
from harness.cli import main
from harness.records import OLDEST_SCHEMA, SCHEMA_VERSION, RunRecord
from harness.run.plan import matrix, resolve_models
from harness.run.runner import pending
from tests.core.test_runner import amp

SCHEMA4 = Path(__file__).parent / "data" / "schema4"
ADDED_IN = {2: ("variant", "state_memory_mb", "device_peak_gflops", "efficiency", "study", "diagnosis"),
            3: ("num_classes",), 4: ("seed",), 5: ("task", "tokens_per_sample"),
            6: ("nonfinite",), 7: ("width", "matmul_curve"), 8: ("matmul_shapes",), 9: ("process", "auto_round"),
            10: ("matmul_weights",)}
# harness.records' docstring: what each schema added (7 also added fields inside nonfinite)


def _cli(*args) -> tuple[int, list[str], str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, err.getvalue().strip().splitlines(), out.getvalue()


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_files_of_schema_4_read_and_report(tmp_path):
    runs = results.read_records([SCHEMA4])
    fingerprints = results.read_records([SCHEMA4], results.FINGERPRINTS_FILE)
    assert [r["schema"] for r in runs + fingerprints] == [4, 4, 4]
    assert results.usable(runs) == (runs, [])
    assert results.usable(fingerprints, results.FINGERPRINTS_FILE) == (fingerprints, [])
    code, err, _ = _cli("report", str(SCHEMA4), "--parity", str(SCHEMA4), "-o", str(tmp_path / "index.html"))
    assert code == 0, err
    page = (tmp_path / "index.html").read_text()
    assert "mnist_mlp" in page and not re.search(r"records? skipped", page)


@pytest.mark.parametrize("schema", range(OLDEST_SCHEMA, SCHEMA_VERSION))
def test_records_of_every_older_schema_read(schema):
    """A record of schema S lacks the fields added after S: it still reads, and nothing is skipped."""
    runs = copy.deepcopy(results.read_records([SCHEMA4]))
    for r in runs:
        r["schema"] = schema
        for later in range(schema + 1, SCHEMA_VERSION + 1):
            for field in ADDED_IN[later]:
                r.pop(field, None)  # the files are schema 4's: later fields are not in them
    assert results.usable(runs) == (runs, [])


@pytest.mark.parametrize("schema, says", [(SCHEMA_VERSION + 1, "written by a newer amp-harness"), (0, "not a schema")])
@pytest.mark.parametrize("command", ["report", "parity", "run --resume"])
def test_a_schema_this_version_cannot_read_is_refused_in_one_line_naming_it_and_the_file(tmp_path, schema, says,
                                                                                         command):
    filename = results.FINGERPRINTS_FILE if command == "parity" else results.RESULTS_FILE
    records = results.read_records([SCHEMA4], filename)
    records[-1] = {**records[-1], "schema": schema}
    _write(tmp_path / filename, records)
    args = {"report": ["report", str(tmp_path), "-o", str(tmp_path / "r" / "index.html")],
            "parity": ["parity", str(tmp_path)],
            "run --resume": ["run", "--framework", "fake", "--model", "mnist_mlp", "--precision", "fp32", "--steps",
                             "3", "--repeats", "1", "--resume", "--no-progress", "--out", str(tmp_path)]}[command]
    if command == "run --resume":  # the fake adapter's entry point is on the path of a subprocess only
        out = amp(*args)
        code, err = out.returncode, out.stderr.strip().splitlines()
    else:
        code, err, _ = _cli(*args)
    assert code == 2 and len(err) == 1, err
    assert f"{tmp_path / filename}: line {len(records)}: schema {schema}: {says}" in err[0], err
    assert f"reads records of schemas {OLDEST_SCHEMA} to {SCHEMA_VERSION}" in err[0]


@pytest.mark.parametrize("change, why", [
    ({"framework": None}, "missing framework"),
    ({"model": None}, "ok but missing model"),
    ({"batch_size": 0}, "batch_size is not what a record holds there"),
    ({"step_times_ms": [1.0, "fast"]}, "step_times_ms is not what a record holds there"),
    ({"status": "fine"}, "status is not what a record holds there"),
    ({"schema": "4"}, "schema is not what a record holds there"),
    ({"eval_loss": float("nan")}, "eval_loss is not what a record holds there"),
    ({"loss_scale": {"settings": {"mode": "dynamic"}}}, "loss_scale.settings is not what a record holds there"),
    ({"env": {"threads": "2"}}, "env.threads is not what a record holds there"),
])
def test_a_broken_field_is_skipped_and_named(change, why):
    runs = results.read_records([SCHEMA4])
    broken = {**runs[0], "run_id": "broken", **change}
    assert results.usable(runs + [broken]) == (runs, [f"1 record skipped: {why}"])


def test_a_fingerprint_missing_its_outputs_is_named():
    (fingerprint,) = results.read_records([SCHEMA4], results.FINGERPRINTS_FILE)
    broken = copy.deepcopy(fingerprint)
    del broken["fingerprint"]["final_outputs"]
    kept, why = results.usable([fingerprint, {**broken, "run_id": "broken"}], results.FINGERPRINTS_FILE)
    assert kept == [fingerprint] and why == ["1 record skipped: missing fingerprint.final_outputs"]


def test_an_empty_record_holds_every_field_a_record_is_written_with():
    (run, _) = results.read_records([SCHEMA4])
    # same fields, in the order schema 4 wrote them, with those added since in their places
    added = {f for schema in ADDED_IN if schema > 4 for f in ADDED_IN[schema]}
    assert [f for f in results.empty_record() if f not in added] == list(run)
    RunRecord.model_validate({**results.empty_record(run_id="a", framework="f", precision="fp32", status="failed")})
    with pytest.raises(ValueError, match="unknown record fields"):
        results.empty_record(speed=1)


def test_the_requests_of_recorded_runs_are_not_run_again_by_resume(tmp_path):
    """--resume: the request of each recorded run has its record's identity (the loss scale as one string; the
    variant auto chose, as "auto"); another repeat or loss scale does not."""
    shutil.copy(SCHEMA4 / results.RESULTS_FILE, tmp_path)
    common = dict(warmup=1, device="auto", threads=1)
    recorded = matrix("torch", resolve_models([("mnist_mlp", {"steps": 3})]), ["fp32", "amp_fp16"], 1, ["auto"], ["dynamic"], **common)
    assert pending(recorded, tmp_path, results.RESULTS_FILE) == []
    others = matrix("torch", resolve_models([("mnist_mlp", {"steps": 3})]), ["amp_fp16"], 2, ["auto"], ["dynamic:1024", "dynamic"], **common)
    assert [(q.loss_scale, q.repeat) for q in pending(others, tmp_path, results.RESULTS_FILE)] == [
        ("dynamic:1024", 0), ("dynamic:1024", 1), ("dynamic", 1)]


def test_one_string_names_a_loss_scale_setting_for_resume_and_the_report():
    (run, _) = results.read_records([SCHEMA4])
    assert identity.loss_scale_setting(run) == "dynamic from 65536, growth every 2000"
    assert identity.run_key(run).loss_scale == identity.loss_scale_setting(run)
    assert identity.run_key(run).variant == identity.setting(run).variant == "auto"
    assert identity.loss_scale_label({"mode": "fixed", "initial": 16.0}) == "fixed 16"
    assert identity.loss_scale_label(None) == identity.loss_scale_label({"mode": "none"}) == "none"

