"""The Ray executor on a local cluster of up to 3 nodes (tests/cluster/conftest.py): the same records as the local
executor, a speed-up with nodes, and nothing lost when a node goes away in the middle of a matrix."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from harness import identity, results
from tests.cluster.conftest import amp, grow

SLOW = "tests/specs/pitfall_batchnorm.yaml"  # each step sleeps 0.4 s (the fake adapter's `slow`)
FAKE = "tests/specs/pitfall_rmsprop_epsilon.yaml"  # each precision has its fault: every status comes out


def ray_args(cluster, *extra):
    return ["--executor", "ray", "--address", cluster.address, "--python", f"fake={sys.executable}",
            "--python", f"torch={sys.executable}", "--no-progress", *extra]


def outcomes(out_dir, filename=results.RESULTS_FILE) -> dict:
    """run key -> status: what identifies a run across executors (run ids carry a timestamp and a uuid)."""
    found = {}
    for r in results.read_records([out_dir], filename):
        key = identity.run_key(r)
        assert key not in found, f"{key} recorded twice"
        found[key] = r["status"]
    return found


def test_three_nodes_take_at_most_half_the_wall_time_of_one(cluster, tmp_path, capsys):
    matrix = ["run", "--framework", "fake", "--model", SLOW, "--precision", "fp32,amp_bf16,bf16", "--repeats", "3",
              "--steps", "10", "--warmup", "0"]
    wall = {}
    for nodes in (1, 3):
        grow(cluster, nodes)
        started = time.monotonic()
        out = amp(*matrix, "--out", str(tmp_path / str(nodes)), *ray_args(cluster))
        wall[nodes] = time.monotonic() - started
        assert out.returncode == 0, out.stderr
        records = results.read_records([tmp_path / str(nodes)])
        assert len(records) == 9 and {r["status"] for r in records} == {"ok"}
        assert len({r["env"]["node"] for r in records}) == nodes
    ratio = wall[3] / wall[1]
    with capsys.disabled():  # the figure is the point: shown without -s
        print(f"\n9 sleep-bound runs: 1 node {wall[1]:.1f} s, 3 nodes {wall[3]:.1f} s, ratio {ratio:.2f}")
    assert ratio <= 0.5


def test_the_same_records_as_the_local_executor(cluster, tmp_path):
    """15 fake runs (ok, failed by a crash and by an exception, diverged, unsupported) and 2 torch runs give the
    same runs with the same statuses on 3 nodes as one after another here."""
    grow(cluster, 3)
    commands = [
        ["run", "--framework", "fake", "--model", FAKE, "--precision", "fp32,bf16,amp_fp16,amp_bf16,tf32",
         "--repeats", "3", "--steps", "4", "--warmup", "0"],
        ["run", "--framework", "torch", "--model", "mnist_mlp", "--precision", "fp32,amp_bf16", "--repeats", "1",
         "--steps", "3", "--warmup", "1", "--batch-size", "16", "--threads", "1"],
    ]
    local, ray = {}, {}
    for command in commands:
        for executor, found, extra in (("local", local, ["--no-progress"]), ("ray", ray, ray_args(cluster))):
            out_dir = tmp_path / executor
            out = amp(*command, "--out", str(out_dir), *extra)
            assert out.returncode in (0, 1), out.stderr  # 1: some runs failed, as the faults ask
            found.update(outcomes(out_dir))
    assert len(ray) == 17 and ray == local
    assert sorted(set(ray.values())) == ["diverged", "failed", "ok", "unsupported"]
    records = results.read_records([tmp_path / "ray"])
    assert {r["env"]["executor"] for r in records} == {"ray"}
    assert {r["env"]["placement"] for r in records} == {"whole node"}
    assert len({r["env"]["node"] for r in records}) >= 2  # spread over the nodes
    assert {r["env"]["executor"] for r in results.read_records([tmp_path / "local"])} == {"local"}


def test_a_node_without_the_framework_interpreter_gives_failed_records(cluster, tmp_path):
    grow(cluster, 3)
    out = amp("run", "--framework", "fake", "--model", FAKE, "--precision", "fp32", "--repeats", "2", "--steps",
              "2", "--out", str(tmp_path), *ray_args(cluster, "--python", "fake=/nonexistent/env/bin/python"))
    assert out.returncode in (0, 1), out.stderr
    records = results.read_records([tmp_path])
    assert len(records) == 2 and {r["status"] for r in records} == {"failed"}
    assert all(r["reason"].startswith("no interpreter at /nonexistent/env/bin/python on node ") for r in records)


def test_packed_fingerprints_share_nodes_and_match_the_local_executor(cluster, tmp_path):
    """Untimed runs may share a node (--pack); runs of one precision still share one worker process."""
    grow(cluster, 3)
    command = ["fingerprint", "--framework", "fake", "--model", f"mnist_mlp,{FAKE}", "--precision", "fp32,fp64",
               "--steps", "2"]
    local = amp(*command, "--out", str(tmp_path / "local"), "--no-progress")
    packed = amp(*command, "--out", str(tmp_path / "ray"), *ray_args(cluster, "--pack"))
    assert local.returncode == 0 and packed.returncode == 0, packed.stderr
    found = outcomes(tmp_path / "ray", results.FINGERPRINTS_FILE)
    assert len(found) == 4 and found == outcomes(tmp_path / "local", results.FINGERPRINTS_FILE)
    records = results.read_records([tmp_path / "ray"], results.FINGERPRINTS_FILE)
    assert {r["env"]["placement"] for r in records} == {"packed: one CPU of a shared node"}
    fingerprints = {(r["model"], r["precision"]): r["fingerprint"]["final_outputs"] for r in records}
    for r in results.read_records([tmp_path / "local"], results.FINGERPRINTS_FILE):
        assert fingerprints[r["model"], r["precision"]] == r["fingerprint"]["final_outputs"]


def test_without_an_address_a_one_node_ray_is_started_for_the_call(loopback_only, tmp_path):
    """No --address: a new local Ray (not the test's cluster), one run at a time, stopped afterwards."""
    out = amp("run", "--framework", "fake", "--model", FAKE, "--precision", "fp32", "--repeats", "2", "--steps", "2",
              "--out", str(tmp_path), "--executor", "ray", "--python", f"fake={sys.executable}", "--no-progress")
    assert out.returncode == 0, out.stderr
    records = results.read_records([tmp_path])
    assert len(records) == 2 and {r["env"]["placement"] for r in records} == {"whole node"}
    assert len({r["env"]["node"] for r in records}) == 1


def _wait(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {timeout} s")


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_a_node_lost_mid_matrix_loses_no_finished_record_and_resume_completes_the_rest(cluster, tmp_path, capsys):
    grow(cluster, 3)
    matrix = ["run", "--framework", "fake", "--model", SLOW, "--precision", "fp32,amp_bf16,bf16", "--repeats", "6",
              "--steps", "8", "--warmup", "0", "--out", str(tmp_path), *ray_args(cluster, "--retries", "1")]
    path = tmp_path / results.RESULTS_FILE
    driver = amp(*matrix, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    workers = {node.node_id[:12]: node for node in cluster.worker_nodes}  # the head cannot go

    # remove a worker node while it runs something: the one that gave the last record 1 to 3 s ago has started its
    # next run since (the queue is not empty) and is far from done with it
    def busy_worker():
        lines = _lines(path)
        if not lines or not 1.0 <= time.time() - path.stat().st_mtime <= 3.0:
            return None
        return workers.get(json.loads(lines[-1])["env"]["node"].split("ray node ")[1].rstrip(")"))

    victim = _wait(busy_worker, 120, "record from a worker node")
    before = _lines(path)
    cluster.remove_node(victim, allow_graceful=False)
    lost_at = time.monotonic()

    retried = _wait(lambda: [r for r in map(json.loads, _lines(path)) if r["env"].get("attempt", 1) > 1], 120,
                    "record of a run tried again after the node was lost")
    with capsys.disabled():
        print(f"\nnode lost; its run recorded again after {time.monotonic() - lost_at:.1f} s: "
              f"{retried[0]['env']['earlier_attempts']}")
    driver.send_signal(signal.SIGINT)  # Ctrl-C: the runs in flight finish, no other starts
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 130, err
    assert "stopping after the runs in flight" in err and "--resume" in err

    after = _lines(path)
    assert after[:len(before)] == before  # nothing finished was lost or rewritten
    done = outcomes(tmp_path)
    assert len(done) < 18 and set(done.values()) == {"ok"}
    assert retried[0]["env"]["earlier_attempts"][0].split(":")[0].endswith("Error")  # the Ray error, one line

    resumed = amp(*matrix, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resume: {len(done)} of 18 runs already recorded" in resumed.stderr
    assert f"running {18 - len(done)}" in resumed.stderr
    final = outcomes(tmp_path)  # each run exactly once (outcomes asserts it)
    assert len(final) == 18 and set(final.values()) == {"ok"} and all(final[k] == v for k, v in done.items())
    grow(cluster, 3)


def _ours(pid: int) -> bool:
    """Whether a process descends from this test process (the cluster's raylets do): never touch another's."""
    while pid > 1:
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == os.getpid():
            return True
    return False


def _harness_workers() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if b"harness.run.worker" in cmdline and _ours(int(entry)):
                found.append(int(entry))
    return found


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def test_a_killed_task_without_retries_left_is_recorded_failed_with_the_ray_error(cluster, tmp_path):
    grow(cluster, 3)
    driver = amp("run", "--framework", "fake", "--model", SLOW, "--precision", "fp32,amp_bf16,bf16", "--repeats",
                 "1", "--steps", "8", "--warmup", "0", "--out", str(tmp_path), *ray_args(cluster, "--retries", "0"),
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    worker = _wait(lambda: (_harness_workers() or [None])[0], 60, "harness worker on the cluster")
    task = _parent(worker)  # the Ray worker process running the task
    os.kill(task, signal.SIGKILL)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode in (0, 1), err
    records = results.read_records([tmp_path])
    assert len(records) == 3 and sorted(r["status"] for r in records) == ["failed", "ok", "ok"]
    (failed,) = [r for r in records if r["status"] == "failed"]
    assert failed["reason"].startswith("ray: lost 1 time(s), last: ") and "Error: " in failed["reason"]
    assert "\n" not in failed["reason"] and failed["env"]["attempt"] == 1
    time.sleep(1)
    assert not os.path.exists(f"/proc/{worker}") or b"harness.run.worker" not in open(
        f"/proc/{worker}/cmdline", "rb").read()  # the run's own process died with its task: no orphan


def test_an_address_where_no_cluster_answers_is_one_line_and_exit_2(loopback_only, tmp_path):
    """Ray would keep trying to connect for minutes: the executor asks the port first."""
    out = amp("run", "--framework", "fake", "--model", FAKE, "--precision", "fp32", "--repeats", "1", "--out",
              str(tmp_path), "--executor", "ray", "--address", "127.0.0.1:1", "--python", f"fake={sys.executable}",
              timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "amp-harness: error: --address 127.0.0.1:1: no Ray cluster answers there (Connection refused)"]
    assert not (tmp_path / results.RESULTS_FILE).exists()
