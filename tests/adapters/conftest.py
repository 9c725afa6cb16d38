"""Adapter contract tests run against the framework named by AMP_HARNESS_FRAMEWORK (each tox env sets it),
so every adapter passes the same tests. In an env that names a framework, a missing adapter is a failure."""
from __future__ import annotations

import os

import pytest

from harness.adapter import load_adapter


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("AMP_HARNESS_FRAMEWORK"):
        skip = pytest.mark.skip(reason="set AMP_HARNESS_FRAMEWORK to the adapter to test (the tox envs do)")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def framework() -> str:
    return os.environ["AMP_HARNESS_FRAMEWORK"]


@pytest.fixture(scope="session")
def adapter(framework):
    adapter = load_adapter(framework)
    adapter.set_threads(2)
    return adapter
