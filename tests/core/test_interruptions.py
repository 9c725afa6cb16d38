"""Nothing lost: a runner killed mid-matrix, Ctrl-C, --resume, a worker that segfaults, torn writes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from harness import results
from tests.conftest import ROOT
from tests.core.test_runner import FAKE_SITE, amp

SPEC = "tests/specs/pitfall_rmsprop_epsilon.yaml"
MATRIX = ["run", "--framework", "fake", "--model", SPEC, "--precision", "fp32,amp_bf16,fp16", "--repeats", "2",
          "--steps", "6", "--warmup", "0", "--no-progress"]


def start(out, faults="fp32=slow,amp_bf16=slow,fp16=slow"):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_SITE), str(ROOT)]), AMP_FAKE_FAULTS=faults)
    return subprocess.Popen([sys.executable, "-m", "harness", *MATRIX, "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_records(out, n, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = out / results.RESULTS_FILE
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} records after {timeout} s")


def keys(out):
    return sorted((r["precision"], r["repeat"]) for r in results.read_records([out]))


def test_sigkill_mid_matrix_then_resume_runs_exactly_the_missing(tmp_path):
    proc = start(tmp_path)
    wait_for_records(tmp_path, 2)
    os.kill(proc.pid, signal.SIGKILL)  # the runner only, as the OOM killer would
    proc.wait()
    done = keys(tmp_path)
    assert 2 <= len(done) < 6
    resumed = amp(*MATRIX, "--out", str(tmp_path), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resume: {len(done)} of 6 runs already recorded" in resumed.stderr
    assert keys(tmp_path) == sorted((p, r) for p in ("fp32", "amp_bf16", "fp16") for r in (0, 1))
    again = amp(*MATRIX, "--out", str(tmp_path), "--resume")
    assert "running 0" in again.stderr and len(keys(tmp_path)) == 6


def test_ctrl_c_stops_after_the_current_run_and_says_how_to_resume(tmp_path):
    proc = start(tmp_path)
    wait_for_records(tmp_path, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "stopping after the current run" in err and "--resume" in err
    records = results.read_records([tmp_path])
    assert 1 <= len(records) < 6 and all(r["status"] == "ok" for r in records)  # the run in flight finished


def test_segfaulting_or_oom_killed_worker_is_recorded_and_the_matrix_goes_on(tmp_path):
    out = amp("run", "--repeats", "1", "--framework", "fake", "--model", SPEC, "--precision", "fp16,bf16,fp32", "--steps", "4",
              "--out", str(tmp_path), faults="fp16=segv,bf16=oom")
    assert out.returncode == 1, out.stderr
    status = {r["precision"]: (r["status"], r["reason"]) for r in results.read_records([tmp_path])}
    assert status["fp16"][0] == "failed" and status["fp16"][1].startswith("worker killed by signal SIGSEGV")
    assert status["bf16"][0] == "failed" and status["bf16"][1].startswith("worker killed by signal SIGKILL")
    assert status["fp32"] == ("ok", None)


def test_a_torn_last_line_is_skipped_and_appends_stay_whole(tmp_path):
    for i in range(3):
        results.append(tmp_path, results.empty_record(run_id=f"r{i}", status="ok"))
    with open(tmp_path / results.RESULTS_FILE, "a") as f:
        f.write('{"run_id": "torn", "sta')  # a crash in the middle of a write
    assert [r["run_id"] for r in results.read_records([tmp_path])] == ["r0", "r1", "r2"]


def test_two_runners_share_one_directory(tmp_path):
    a, b = start(tmp_path, faults=""), start(tmp_path, faults="")
    assert a.wait(timeout=120) == 0 and b.wait(timeout=120) == 0
    lines = (tmp_path / results.RESULTS_FILE).read_text().splitlines()
    assert len(lines) == 12 and all(json.loads(line)["status"] == "ok" for line in lines)


def test_untimed_runs_share_a_process_and_a_crash_there_loses_no_other_run(tmp_path):
    """Fingerprints of one precision run in one process; a segfault in the second run fails that run only: the
    ones after it run again, each in a process of its own."""
    out = amp("fingerprint", "--framework", "fake", "--precision", "fp32,amp_bf16", "--steps", "3", "--out",
              str(tmp_path), "--model", "mnist_mlp,tests/specs/pitfall_batchnorm.yaml,tests/specs/pitfall_dropout_adam.yaml",
              faults="pitfall_batchnorm=segv")
    assert out.returncode == 1, out.stderr
    records = {(r["model"], r["precision"]): r for r in results.read_records([tmp_path], results.FINGERPRINTS_FILE)}
    assert len(records) == 6
    for (model, precision), r in records.items():
        if model == "pitfall_batchnorm":
            assert r["status"] == "failed" and "SIGSEGV" in r["reason"], r["reason"]
        else:
            assert r["status"] == "ok", (model, precision, r["reason"])


def test_resume_runs_failed_runs_again_and_the_report_keeps_the_new_record(tmp_path):
    from harness.report.view import build_view

    args = ["run", "--repeats", "1", "--framework", "fake", "--model", SPEC, "--precision", "fp32,amp_bf16",
            "--steps", "3", "--warmup", "0", "--out", str(tmp_path)]
    first = amp(*args, faults="amp_bf16=raise")
    assert first.returncode == 1 and "1 of 2 runs failed or timed out" in first.stderr
    again = amp(*args, "--resume")
    assert again.returncode == 0 and "resume: 1 of 2 runs already recorded" in again.stderr, again.stderr
    assert sorted(r["status"] for r in results.read_records([tmp_path])) == ["failed", "ok", "ok"]
    view = build_view(results.read_records([tmp_path]))
    assert not view.not_run and "1 record skipped: failed, then run again by --resume" in view.skipped
