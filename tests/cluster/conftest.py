"""A local Ray cluster for the Ray executor's tests: several raylets on this host (ray.cluster_utils.Cluster).

Every test here must run in a network namespace that has only loopback (`tox -e ray` does: unshare --net), so
that Ray, which binds to the machine's primary address, can only talk over 127.0.0.1. Outside one, these tests
refuse to start rather than send traffic anywhere else."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.core.test_runner import FAKE_SITE

# the fake adapter's faults, fixed for the cluster's life (its workers inherit the environment of the nodes):
# pitfall_batchnorm sleeps (sleep-bound runs, for the speed-up and the node loss); the others give each status
FAULTS = "pitfall_batchnorm=slow,bf16=abort,amp_fp16=nan,amp_bf16=raise"
NODE = {"num_cpus": 1, "resources": {"amp_node": 1}, "object_store_memory": 80 * 1024 * 1024}


@pytest.fixture(scope="session")
def loopback_only():
    """Ray, or refuse: outside a loopback-only network namespace, Ray would listen on the machine's network."""
    pytest.importorskip("ray", reason="the Ray executor's tests need Ray: tox -e ray")
    others = sorted(name for _, name in socket.if_nameindex() if name != "lo")
    if others:
        pytest.fail(f"a Ray cluster here would listen on {', '.join(others)}: run tests/cluster in a loopback-only "
                    f"network namespace: tox -e ray (unshare --net)", pytrace=False)


@pytest.fixture(scope="session")
def cluster(loopback_only):
    from ray.cluster_utils import Cluster

    os.environ.update(PYTHONPATH=os.pathsep.join([str(FAKE_SITE), str(ROOT)]), AMP_FAKE_FAULTS=FAULTS,
                      RAY_DEDUP_LOGS="0")
    started = time.time()
    c = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
    c.wait_for_nodes()
    print(f"\nhead node up in {time.time() - started:.1f} s at {c.address}")
    yield c
    c.shutdown()


def grow(cluster, n: int) -> None:
    """Add nodes until the cluster has n."""
    while len(cluster.list_all_nodes()) < n:
        cluster.add_node(**NODE)
    cluster.wait_for_nodes()


def amp(*args, timeout=600, **popen):
    """The CLI as a user runs it, in its own process (the driver)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_SITE), str(ROOT)]), AMP_FAKE_FAULTS=FAULTS)
    if popen:
        return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=ROOT, env=env, text=True, **popen)
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
