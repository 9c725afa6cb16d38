"""The runner end to end through the CLI, with a numpy test adapter that crashes, hangs and diverges on cue."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import results
from harness.records import Record
from tests.conftest import ROOT

FAKE_SITE = ROOT / "tests" / "fake_adapter"  # a dist-info registering the 'fake' adapter entry point


def amp(*args, faults="", timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_SITE), str(ROOT)]), AMP_FAKE_FAULTS=faults)
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_matrix_survives_abort_hang_error_and_nan(tmp_path):
    out = amp("run", "--repeats", "1", "--framework", "fake", "--model", "tests/specs/pitfall_rmsprop_epsilon.yaml",
              "--precision", "fp32,fp16,bf16,amp_bf16,amp_fp16,tf32", "--steps", "6", "--warmup", "1",
              "--timeout", "6", "--out", str(tmp_path),
              faults="fp16=abort,bf16=hang,amp_bf16=raise,amp_fp16=nan")
    assert out.returncode == 1, out.stderr  # runs that gave no result: a script must see it
    assert "3 of 6 runs failed or timed out" in out.stderr
    df = results.load([tmp_path])
    status = dict(zip(df.precision, df.status))
    assert status == {"fp32": "ok", "fp16": "failed", "bf16": "timeout", "amp_bf16": "failed",
                      "amp_fp16": "diverged", "tf32": "unsupported"}
    reason = dict(zip(df.precision, df.reason))
    assert reason["fp16"].startswith("worker killed by signal SIGABRT")
    assert "6 s timeout" in reason["bf16"]
    assert reason["amp_bf16"].startswith("RuntimeError: simulated framework error at fake_adapter.py:")
    assert reason["amp_fp16"] == "loss became nan at step 3"
    assert reason["tf32"] == "fake cannot do TF32"
    ok = df[df.precision == "fp32"].iloc[0]
    assert len(ok["step_times_ms"]) == 6 and len(ok["loss"]) == 7
    assert ok["step_time_ms.median"] > 0 and ok["first_step_ms"] > 0
    assert ok["spec_hash"] == df.spec_hash.dropna().iloc[0]
    diverged = df[df.precision == "amp_fp16"].iloc[0]
    assert diverged["loss_scale.skipped_steps"] == 1 and diverged["loss_scale.first_overflow_step"] == 1
    assert diverged["loss"][3] is None  # NaN is stored as null: the file stays valid JSON


def test_every_record_has_every_field(tmp_path):
    out = amp("run", "--repeats", "1", "--framework", "fake", "--model", "tests/specs/pitfall_batchnorm.yaml", "--steps", "3",
              "--warmup", "0", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert set(record) == set(Record.fields())
    assert record["status"] == "ok" and record["eval_accuracy"] is not None
    assert record["memory_kind"].startswith("process peak RSS") and record["peak_memory_mb"] >= 0
    assert record["env"]["threads"] >= 1 and "cpu_flags" in record["env"]


@pytest.mark.parametrize("args, message", [
    (["run", "--framework", "nosuch", "--model", "mnist_mlp"], "no adapter for framework 'nosuch' is installed"),
    (["run", "--framework", "fake", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["check", "tests/specs/missing.yaml"], "cannot read"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--steps", "0"], "argument --steps: '0' is not a positive"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--input-size", "big"], "'big' is not HEIGHTxWIDTH"),
    (["run", "--framework", "fake"], "--model (or, for run, --matrix) is required"),
    (["run", "--framework", "fake", "--matrix", "nope.yaml"], "nope.yaml: cannot read"),
    (["run", "--framework", "fake", "--matrix", "benchmarks/compare.yaml", "--precision", "fp32", "--steps", "3"],
     "--steps, --precision: the matrix file benchmarks/compare.yaml sets this; give it there"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--timeout", "-1"], "'-1' is not a positive number of seconds"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--loss-scale", "2^99999"], "--loss-scale '2^99999': expected"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--loss-scale", "dynamic:abc"], "--loss-scale 'dynamic:abc': expected"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--loss-scale", "none:5"], "--loss-scale 'none:5': expected"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--loss-scale", "-4"], "--loss-scale '-4': expected"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--timeout", "nan"], "'nan' is not a positive number of seconds"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--threads", "0"], "'0' is not a positive integer"),
    (["run", "--framework", "fake", "--model", "x" * 5000], "not a model name or spec file (File name too long)"),
    (["run", "--framework", "fake", "--model", "mnist_mlp", "--batch-size", "5000"], "batch_size 5000 exceeds the 1438"),
    (["report", "x", "--nosuch"], "unrecognized arguments: --nosuch"),
    (["parity", "tests"], "no fingerprints.jsonl in tests"),
])
def test_bad_cli_input_is_one_line_and_exit_2(args, message):
    out = amp(*args)
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_results_load_flattens_and_rejects_corrupt_files(tmp_path):
    results.append(tmp_path, results.empty_record(run_id="a", status="ok", step_time_ms={"median": 2.0}))
    df = results.load([tmp_path])
    assert df.loc[0, "step_time_ms.median"] == 2.0
    (tmp_path / "bad.jsonl").write_text('{"run_id": "x"}\n{not json\n')
    from harness.errors import HarnessError

    with pytest.raises(HarnessError, match="bad.jsonl: line 2: not a JSON record"):
        results.load([tmp_path / "bad.jsonl"])


def test_a_loss_scaler_that_breaks_the_core_rules_fails_the_run(tmp_path):
    amp("run", "--repeats", "1", "--framework", "fake", "--model", "tests/specs/pitfall_rmsprop_epsilon.yaml", "--precision",
        "amp_fp16", "--steps", "4", "--warmup", "0", "--out", str(tmp_path), faults="amp_fp16=stuckscale")
    (record,) = results.read_records([tmp_path])
    assert record["status"] == "failed"
    assert record["reason"] == ("the adapter's loss scaler broke the core's rules at step 1: it skipped the step "
                                "and reported a next scale of 65536, the rules give 32768 (harness.precision.LossScaler)")


def test_an_adapter_whose_scaler_skips_every_step_fails_parity(tmp_path):
    for framework in ("fake", "fake_skipping"):
        out = amp("fingerprint", "--framework", framework, "--model", "tests/specs/pitfall_rmsprop_epsilon.yaml",
                  "--precision", "amp_fp16", "--steps", "4", "--out", str(tmp_path / framework))
        assert out.returncode == 0, out.stderr
    out = amp("parity", str(tmp_path / "fake"), str(tmp_path / "fake_skipping"))
    assert out.returncode == 1
    assert "FAIL: the loss scalers skipped different steps (fake [1], fake_skipping [0, 1, 2, 3])" in out.stdout
    assert "parity FAILED for 1 of 1 comparisons" in out.stderr


def test_only_the_step_is_timed(tmp_path):
    """A step that sleeps 300 ms is timed as 300 ms (within 2%), whatever its batch conversion costs."""
    amp("run", "--repeats", "1", "--framework", "fake", "--model", "tests/specs/pitfall_rmsprop_epsilon.yaml", "--precision", "fp32",
        "--steps", "4", "--warmup", "1", "--out", str(tmp_path), faults="fp32=slow")
    (record,) = results.read_records([tmp_path])
    assert record["step_time_ms"]["median"] == pytest.approx(300, rel=0.02)
    assert record["input_ms"] == pytest.approx(100, rel=0.2)


def test_repeats_take_turns_across_precisions_and_variants():
    from harness.run.plan import matrix, resolve_models

    requests = matrix("fake", resolve_models([("mnist_mlp", {})]), ["fp32", "amp_bf16"], 2, ["a", "b"])
    assert [(q.repeat, q.variant, q.precision) for q in requests] == [
        (0, "a", "fp32"), (0, "a", "amp_bf16"), (0, "b", "fp32"), (0, "b", "amp_bf16"),
        (1, "a", "fp32"), (1, "a", "amp_bf16"), (1, "b", "fp32"), (1, "b", "amp_bf16")]


def test_a_matrix_models_own_loss_scales_apply_to_the_precisions_that_scale(tmp_path):
    from harness.run.plan import matrix, resolve_models

    requests = matrix("fake", resolve_models([("mnist_mlp", {"loss_scales": ["none", "dynamic"], "steps": 4})]),
                      ["fp32", "amp_fp16"], 1, ["a"])
    assert [(q.precision, q.loss_scale, q.spec["steps"]) for q in requests] == [
        ("fp32", None, 4), ("amp_fp16", "none", 4), ("amp_fp16", "dynamic", 4)]
    bad = tmp_path / "m.yaml"
    bad.write_text("precisions: [amp_fp16]\nmodels:\n  - {model: mnist_mlp, loss_scales: [none, abc]}\n")
    out = amp("run", "--framework", "fake", "--matrix", str(bad))
    assert out.returncode == 2 and "m.yaml: models.0.loss_scales: --loss-scale 'abc'" in out.stderr


def test_diagnose_says_not_available_for_an_adapter_that_cannot_capture(tmp_path):
    out = amp("diagnose", "--framework", "fake", "--model", "tests/specs/pitfall_rmsprop_epsilon.yaml", "--steps",
              "4", "--every", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "fake pitfall_rmsprop_epsilon: ok: fake cannot capture tensors (not available)" in out.stdout
    (record,) = results.read_records([tmp_path], results.DIAGNOSES_FILE)
    assert record["precision"] == "fp32" and record["diagnosis"]["available"] is False and len(record["loss"]) == 4


def test_repeats_default_to_three_in_matrix_files_and_studies():
    from harness.cli import build_parser
    from harness.run.matrix import Matrix

    assert Matrix(models=[{"model": "mnist_mlp"}], precisions=["fp32"]).repeats == 3
    study = build_parser().parse_args(["study", "loss-scale", "--framework", "fake", "--scales", "none"])
    assert study.repeats == 3
