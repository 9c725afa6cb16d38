"""The conformance kit's pytest plugin: the --amp-framework option and the fixtures the kit's tests take.

In a plugin author's own suite: `pytest -p harness.conformance.plugin --pyargs harness.conformance
--amp-framework NAME` (what `amp-harness conformance --framework NAME` runs), or `pytest_plugins =
["harness.conformance.plugin"]` in a conftest.py to use the fixtures in tests of one's own.
"""
from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--amp-framework", default=os.environ.get("AMP_HARNESS_FRAMEWORK"),
                     help="the adapter (its --framework name) that the conformance kit checks")


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
    adapter.set_threads(2)
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
