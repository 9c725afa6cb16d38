"""The Ray executor: each batch of the matrix is one Ray task that starts the same `python -m harness.run.worker`
subprocess on its node as the local executor does (harness.run.process.run_group), so a framework's process-wide
state never leaks between runs, and returns the records; the driver appends them as they arrive (run ids
identify them, the order does not matter).

Timing stays honest: by default a run has one whole GPU (GPU nodes) or one whole node (CPU nodes: the custom
resource NODE_RESOURCE, one slot per node) to itself; `pack` lets runs whose timing does not matter share.
A task lost with its node or worker is tried again on another node up to `retries` times, then its runs are
recorded `failed` with the Ray error in one line. Only as many tasks as the cluster has slots are submitted at
a time, so that Ctrl-C, like the local executor's, lets the runs in flight finish and starts no other.

Ray is imported only in here, and only when this executor runs: the default install has no Ray."""
from __future__ import annotations

import os
import platform
import signal
import socket
import time
from collections import deque
from dataclasses import asdict

from harness.errors import HarnessError

NODE_RESOURCE = "amp_node"  # `ray start --resources='{"amp_node": 1}'`: one timed run at a time on that node
PACK_GPU_SHARE = 0.25  # --pack: four runs to a GPU
POLL_S = 0.5  # how often the driver looks at Ctrl-C and the cluster's size while it waits for records
NO_CAPACITY_S = 60.0  # a cluster with no slot left for this long (every node lost) ends the matrix
CONNECT_TIMEOUT_S = 10.0


def _run_batch(requests: list[dict], python: str, timeout_s: float) -> dict:
    """The Ray task, on its node: the batch in one worker subprocess of the framework's interpreter, exactly as
    the local executor runs it; returns the records and where they ran. Each request carries its resolved spec:
    no spec file need be on the node (an image_folder dataset's directory must, at the path the spec gives)."""
    import ray

    from harness.run.process import run_group
    from harness.run.request import RunRequest

    node_id = ray.get_runtime_context().get_node_id()
    where = {"node": f"{platform.node()} {ray.util.get_node_ip_address()} (ray node {node_id[:12]})",
             "gpus": [str(g) for g in ray.get_gpu_ids()]}
    if not os.access(python, os.X_OK):
        return {**where, "missing": f"no interpreter at {python} on node {where['node']} (the framework's "
                                    f"environment must be at the same path on every node; --python)"}
    return {**where, "records": run_group([RunRequest(**q) for q in requests], timeout_s, python=python)}


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """The exception's first line, cut after its last whole sentence within `limit` (Ray's errors go on with
    advice for several hundred characters)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    return text[:end + 1] if end > 0 else text[:limit - 3] + "..."


def _check_reachable(address: str) -> None:
    """A head that does not answer is one line now: Ray itself keeps trying to connect for minutes."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or not sep:
        return  # Ray finds the address of the cluster this machine joined; it says so at once when there is none
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except ValueError:
        raise HarnessError(f"--address {address}: expected HOST:PORT of the cluster's head, or auto") from None
    except OSError as exc:
        raise HarnessError(f"--address {address}: no Ray cluster answers there ({exc.strerror or exc})") from None


class RayExecutor:
    name = "ray"
    in_flight = "the runs in flight"  # what a first Ctrl-C waits for (runner's message)

    def __init__(self, address: str | None, python: str, pack: bool, retries: int):
        self.address, self.python, self.pack, self.retries = address, python, pack, retries

    def run_batches(self, batches, timeout_s, on_progress, on_record, stop, on_batch) -> None:
        import ray

        handler = signal.getsignal(signal.SIGINT)
        try:
            self._connect(ray)
        finally:
            signal.signal(signal.SIGINT, handler)  # Ctrl-C stays the runner's (stop after the runs in flight)
        try:
            self._run(ray, batches, timeout_s, on_record, stop, on_batch)
        finally:
            ray.shutdown()

    def _connect(self, ray) -> None:
        quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
        if self.address is None:  # a one-node cluster for this call: one run at a time, as the local executor;
            # "local": a new one even where RAY_ADDRESS or a `ray start` of this machine would be found otherwise;
            # it needs no network, so it listens on loopback only (Ray's ports have no authentication)
            ray.init(address="local", resources={NODE_RESOURCE: 1}, _node_ip_address="127.0.0.1", **quiet)
            return
        _check_reachable(self.address)
        try:
            ray.init(address=self.address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise HarnessError(f"--address {self.address}: cannot join a Ray cluster there: {_one_line(exc)}") from None

    def _placement(self, ray, device: str) -> tuple[dict, str, str]:
        """The task's resource request, what the record says of it, and the cluster resource that counts slots."""
        cluster = ray.cluster_resources()
        gpu = device != "cpu" and cluster.get("GPU", 0) > 0
        if device == "gpu" and not gpu:
            raise HarnessError("--device gpu: the Ray cluster has no GPU")
        if self.pack:
            if gpu:
                return {"num_cpus": 1, "num_gpus": PACK_GPU_SHARE}, f"packed: {PACK_GPU_SHARE:g} of a GPU", "GPU"
            return {"num_cpus": 1}, "packed: one CPU of a shared node", "CPU"
        if gpu:
            return {"num_cpus": 1, "num_gpus": 1}, "one whole GPU", "GPU"
        if cluster.get(NODE_RESOURCE, 0) < 1:
            raise HarnessError(f"the Ray cluster has no '{NODE_RESOURCE}' resource: start each node with "
                               f"ray start ... --resources='{{\"{NODE_RESOURCE}\": 1}}' so that a timed run has a "
                               f"node to itself, or give --pack if timing does not matter")
        return {"num_cpus": 0, "resources": {NODE_RESOURCE: 1}}, "whole node", NODE_RESOURCE

    def _slots(self, ray, resource: str) -> int:
        share = PACK_GPU_SHARE if self.pack and resource == "GPU" else 1
        return int(ray.cluster_resources().get(resource, 0) / share)

    def _run(self, ray, batches, timeout_s, on_record, stop, on_batch) -> None:
        from harness.run.process import failure_record

        if not batches:
            return
        options, placement, resource = self._placement(ray, batches[0][0].device)
        # max_retries=0: the driver retries itself, so that the record can say which attempt it is
        task = ray.remote(_run_batch).options(max_retries=0, **options)
        queue = deque((batch, 1, []) for batch in batches)  # (batch, attempt, errors of the earlier attempts)
        inflight: dict = {}
        no_capacity_since = None

        def placed(record: dict, node: str | None, gpus: list[str], attempt: int, errors: list[str]) -> None:
            where = placement + (f" (GPU {', '.join(gpus)})" if gpus else "")
            record["env"] = {**(record.get("env") or {}), "executor": self.name, "node": node, "placement": where,
                             "attempt": attempt, **({"earlier_attempts": errors} if errors else {})}
            on_record(record)

        try:
            while queue or inflight:
                slots = self._slots(ray, resource)
                no_capacity_since = None if slots else no_capacity_since or time.monotonic()
                if no_capacity_since and time.monotonic() - no_capacity_since > NO_CAPACITY_S:
                    raise HarnessError(f"the Ray cluster has had no node that can take a run ({resource}) for "
                                       f"{NO_CAPACITY_S:g} s; every finished run is recorded; add nodes and rerun "
                                       f"with --resume")
                while queue and not stop and len(inflight) < slots:
                    batch, attempt, errors = queue.popleft()
                    on_batch(batch)
                    ref = task.remote([asdict(q) for q in batch], self.python, timeout_s)
                    inflight[ref] = (batch, attempt, errors, time.time())
                if not inflight:
                    if stop:
                        return
                    time.sleep(POLL_S)
                    continue
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    batch, attempt, errors, started = inflight.pop(ref)
                    try:
                        out = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:  # our task's code failed: trying again cannot help
                        # (its first line names only the task: the cause is the exception raised on the node,
                        # e.g. No module named 'harness' where amp-harness is not installed beside Ray)
                        why = _one_line(getattr(exc, "cause", None) or exc)
                        for q in batch:
                            placed(failure_record(q, "failed", f"ray task: {why}", started), None, [], attempt, errors)
                        continue
                    except ray.exceptions.RayError as exc:  # the node or the worker was lost: try elsewhere
                        errors = [*errors, _one_line(exc)]
                        if stop:
                            continue  # Ctrl-C: no new attempt; unrecorded, so --resume runs it
                        if attempt <= self.retries:
                            queue.appendleft((batch, attempt + 1, errors))
                            continue
                        for q in batch:
                            placed(failure_record(q, "failed", f"ray: lost {attempt} time(s), last: {errors[-1]}",
                                                  started), None, [], attempt, errors)
                        continue
                    if "missing" in out:
                        for q in batch:
                            placed(failure_record(q, "failed", out["missing"], started), out["node"], out["gpus"],
                                   attempt, errors)
                        continue
                    for record in out["records"]:
                        placed(record, out["node"], out["gpus"], attempt, errors)
        except BaseException:  # Ctrl-C twice, or a record that cannot be written: abort the runs in flight
            for ref in inflight:
                ray.cancel(ref, force=True)
            raise
