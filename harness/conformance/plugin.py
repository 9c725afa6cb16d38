"""The conformance kit's pytest plugin: the --amp-framework option and the fixtures the kit's tests take.

In a plugin author's own suite: `pytest -p harness.conformance.plugin --pyargs harness.conformance
--amp-framework NAME` (what `amp-harness conformance --framework NAME` runs), or `pytest_plugins =
["harness.conformance.plugin"]` in a conftest.py to use the fixtures in tests of one's own.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from harness.limits import default_threads, slot_cpus

#: the intra-op threads of every run the kit makes: one number per process, since TensorFlow sets its threads once
#: per process; 2, or $AMP_HARNESS_THREADS where it is smaller (tox sets 1 and runs the kit in two workers)
THREADS = min(2, default_threads())


def pytest_configure(config) -> None:
    """Under pytest-xdist (`amp-harness conformance --framework NAME -- -n 2`), each worker, and every process it
    starts, runs on CPUs of its own: two workers never share a core while another idles."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cpus = slot_cpus(int(worker[2:]), THREADS) if worker.startswith("gw") and worker[2:].isdigit() else set()
    if cpus:
        os.sched_setaffinity(0, cpus)


def pytest_addoption(parser):
    parser.addoption("--amp-framework", default=os.environ.get("AMP_HARNESS_FRAMEWORK"),
                     help="the adapter (its --framework name) that the conformance kit checks")
    parser.addoption("--amp-fingerprints", metavar="DIR",
                     help="fingerprints `amp-harness fingerprint` wrote for this adapter (tox's identity matrix): a "
                          "golden check whose run is there, same framework version, spec and precision, takes its "
                          "record instead of running it again")


@pytest.fixture(scope="session")
def framework(request) -> str:
    name = request.config.getoption("--amp-framework")
    if not name:
        pytest.skip("no adapter named: give --amp-framework NAME (or set AMP_HARNESS_FRAMEWORK)")
    return name


@pytest.fixture(scope="session")
def adapter(framework):
    from harness.adapter import load_adapter

    adapter = load_adapter(framework)
    adapter.set_threads(THREADS)
    return adapter


@pytest.fixture(scope="session")
def unsupported(adapter):
    """unsupported("amp_bf16"): why the precision cannot run on this CPU (the adapter's own limits, then the
    capability probe, harness.run.capability), or None. A check that needs a precision skips where this says so,
    and a record may be `unsupported` only with exactly this reason."""
    from harness.precision import parse_precision
    from harness.run import capability

    device = adapter.device("cpu")
    return lambda precision: capability.unsupported(adapter, parse_precision(precision), device)


@pytest.fixture(scope="session")
def fingerprinted(request, adapter):
    """fingerprinted(request): the ok record, in --amp-fingerprints, of the run a harness.run.worker.RunRequest asks
    for (this adapter and version, its first variant, the same spec, precision and loss-scale settings), or None."""
    from harness.identity import request_key, run_key
    from harness.results import FINGERPRINTS_FILE, read_records

    where = request.config.getoption("--amp-fingerprints")
    version, first = adapter.framework_version(), next(iter(adapter.variants))
    found = {run_key(r): r for r in (read_records([where], FINGERPRINTS_FILE) if where else [])
             if r.get("status") == "ok" and r.get("framework_version") == version}
    return lambda req: found.get(request_key(replace(req, variant=req.variant or first)))
