"""The executor seam on its default path (the local executor), its options, and a full disk: records are never
lost or torn, the runner stops with one line, and --resume completes the rest. (The Ray executor: tests/cluster.)"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys

import pytest

from harness import results
from harness.errors import HarnessError
from tests.conftest import ROOT
from tests.core.test_interruptions import keys
from tests.core.test_runner import FAKE_SITE, amp

SPEC = "tests/specs/pitfall_rmsprop_epsilon.yaml"
MATRIX = ["run", "--framework", "fake", "--model", SPEC, "--precision", "fp32,amp_bf16,bf16", "--repeats", "2",
          "--steps", "3", "--warmup", "0", "--no-progress"]
RECORD_BYTES = 2000  # about the size of one of MATRIX's records as a line of results.jsonl


def test_local_records_say_which_executor_and_node_ran_them(tmp_path):
    out = amp(*MATRIX[:5], "--precision", "fp32", "--repeats", "1", "--steps", "2", "--warmup", "0", "--out",
              str(tmp_path))
    assert out.returncode == 0, out.stderr
    (record,) = results.read_records([tmp_path])
    assert record["env"]["executor"] == "local" and record["env"]["node"] == platform.node()
    assert record["env"]["placement"] == "alone on this machine (one run at a time)"
    assert record["env"]["cpu_count"] >= 1  # the worker's own environment is kept beside them


def _limited(limit: int):
    def apply() -> None:  # in the runner's process (and its workers): files cannot grow past `limit` bytes
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_disk_stops_the_runner_with_one_line_keeps_every_record_and_resume_completes(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_SITE), str(ROOT)]), PYTHONDONTWRITEBYTECODE="1")
    full = subprocess.run([sys.executable, "-m", "harness", *MATRIX, "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=_limited(int(2.5 * RECORD_BYTES)))  # room for two records and half a third
    assert full.returncode == 2, full.stderr
    (line,) = [line for line in full.stderr.splitlines() if line.startswith("amp-harness: error:")]
    path = tmp_path / results.RESULTS_FILE
    assert f"{path}: cannot append the record of run fake-pitfall_rmsprop_epsilon-bf16-" in line
    assert "File too large; every record before it is intact; free space" in line and "--resume" in line
    assert "Traceback" not in full.stderr
    text = path.read_text()
    assert text.endswith("\n") and len(text.splitlines()) == 2  # the third line was cut back, not left torn
    assert all(json.loads(lines)["status"] == "ok" for lines in text.splitlines())
    assert len(keys(tmp_path)) == 2  # and the runner stopped there: no later record slipped past the error

    resumed = amp(*MATRIX, "--out", str(tmp_path), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resume: 2 of 6 runs already recorded" in resumed.stderr and "running 4" in resumed.stderr
    assert keys(tmp_path) == sorted((p, r) for p in ("fp32", "amp_bf16", "bf16") for r in (0, 1))


def test_an_unwritable_output_directory_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "out").write_text("a file where the output directory should be")
    out = amp(*MATRIX, "--out", str(tmp_path / "out"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [  # before the first run (results.prove_writable), not after it
        f"amp-harness: error: {tmp_path / 'out' / results.RESULTS_FILE}: cannot write there: {tmp_path / 'out'} is "
        f"a file, not a directory; give --out a place this user can write"]


def test_append_cuts_back_a_torn_last_line_and_keeps_a_whole_one(tmp_path):
    path = tmp_path / results.RESULTS_FILE
    results.append(tmp_path, results.empty_record(run_id="r0", status="ok"))
    with open(path, "a") as f:
        f.write('{"run_id": "torn", "sta')  # a crash in the middle of a write
    results.append(tmp_path, results.empty_record(run_id="r1", status="ok"))
    assert [json.loads(line)["run_id"] for line in path.read_text().splitlines()] == ["r0", "r1"]
    with open(path, "a") as f:
        f.write('{"run_id": "edited", "status": "ok"}')  # whole, but its line end was lost (a hand edit)
    results.append(tmp_path, results.empty_record(run_id="r2", status="ok"))
    assert [json.loads(line)["run_id"] for line in path.read_text().splitlines()] == ["r0", "r1", "edited", "r2"]


def test_a_record_that_cannot_be_kept_stops_the_group_and_its_worker(tmp_path):
    """on_record runs in the progress reader's thread: its exception must reach the caller, not die there."""
    from harness.run.process import run_group
    from harness.run.plan import matrix, resolve_models

    requests = matrix("fake", resolve_models([(SPEC, {"steps": 2})]), ["fp32"], 3, ["default"], warmup=0, mode="fingerprint")
    seen = []

    def on_record(record):
        seen.append(record["run_id"])
        raise HarnessError("disk full")

    env = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(FAKE_SITE), str(ROOT)])
    try:
        with pytest.raises(HarnessError, match="disk full"):
            run_group(requests, 60, on_record=on_record)
    finally:
        os.environ.pop("PYTHONPATH") if env is None else os.environ.update(PYTHONPATH=env)
    assert seen == [requests[0].run_id]  # the worker was stopped: no more records, no reruns of the others


@pytest.mark.parametrize("args, message", [
    (["--address", "auto"], "--address: only with --executor ray"),
    (["--pack", "--retries", "0"], "--pack, --retries: only with --executor ray"),
    (["--executor", "ray", "--python", "fake"], "argument --python: 'fake' is not FRAMEWORK=PATH"),
    (["--executor", "ray", "--retries", "99"], "argument --retries: '99' is not a number of retries from 0 to 10"),
    (["--executor", "slurm"], "argument --executor: invalid choice: 'slurm'"),
    (["--jobs", "2"], "--jobs 2: only for fingerprint and diagnose with the local executor"),
    (["--jobs", "0"], "argument --jobs: '0' is not a number of processes from 1 to 64"),
])
def test_executor_options_are_checked_before_any_run(tmp_path, args, message):
    out = amp(*MATRIX, "--out", str(tmp_path), *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / results.RESULTS_FILE).exists()


def test_the_ray_executor_without_ray_installed_is_one_line(tmp_path):
    """The default install has no Ray (the core env's): asking for it says how to get it."""
    if importlib.util.find_spec("ray") is not None:
        pytest.skip("Ray is installed in this environment")
    out = amp(*MATRIX, "--out", str(tmp_path), "--executor", "ray")
    assert out.returncode == 2
    assert "--executor ray: Ray is not installed in this environment (pip install -e '.[ray]'" in out.stderr


def test_untimed_runs_take_jobs_processes_at_a_time_and_every_record_is_kept(monkeypatch):
    """--jobs 2: two batches run at once (each waits at a barrier that only two at once pass) and every record
    reaches the runner, saying where it ran."""
    import threading
    import types

    from harness.run import process
    from harness.run.executors import LocalExecutor

    barrier, seen, pinned = threading.Barrier(2, timeout=30), [], []

    def run_group(batch, timeout_s, on_progress, on_record, cpus):
        pinned.append(cpus)
        barrier.wait()  # BrokenBarrierError after 30 s where the batches run one after another
        for q in batch:
            on_record({"run_id": q.run_id})

    monkeypatch.setattr(process, "run_group", run_group)
    runs = [types.SimpleNamespace(run_id=i, threads=1) for i in range(6)]
    LocalExecutor(jobs=2).run_batches([runs[:2], runs[2:3], runs[3:4], runs[4:]], 60, None, seen.append, [],
                                      lambda batch: None)
    if len(os.sched_getaffinity(0)) >= 2:  # the two jobs on CPUs of their own
        assert pinned[0] != pinned[1] and all(len(cpus) == 1 for cpus in pinned), pinned
    assert sorted(r["run_id"] for r in seen) == list(range(6))
    assert {r["env"]["placement"] for r in seen} == {"2 untimed runs at a time on this machine"}


def test_fingerprints_with_jobs_are_those_of_one_process_at_a_time(tmp_path):
    common = ["fingerprint", "--framework", "fake", "--model", SPEC, "--precision", "fp64,fp32,amp_bf16", "--steps",
              "3", "--threads", "1", "--no-progress"]
    alone, jobs = amp(*common, "--out", str(tmp_path / "alone")), amp(*common, "--jobs", "2", "--out",
                                                                      str(tmp_path / "jobs"))
    assert alone.returncode == 0 and jobs.returncode == 0, (alone.stderr, jobs.stderr)
    by = {name: {r["precision"]: r for r in results.read_records([tmp_path / name], results.FINGERPRINTS_FILE)}
          for name in ("alone", "jobs")}
    assert sorted(by["jobs"]) == ["amp_bf16", "fp32", "fp64"]
    assert all(by["jobs"][p]["loss"] == by["alone"][p]["loss"] for p in by["alone"])
    assert {r["env"]["placement"] for r in by["jobs"].values()} == {"2 untimed runs at a time on this machine"}


def test_with_jobs_the_largest_batches_go_first_and_a_lone_one_is_split_so_that_no_job_idles():
    from harness.run.executors.local import shared

    assert shared([list(range(5))], 2) == [[0, 1], [2, 3, 4]]
    assert shared([[9], list(range(5))], 2) == [list(range(5)), [9]]  # the largest first
    assert shared([[1]], 2) == [[1]]
    assert shared([list(range(8))], 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
