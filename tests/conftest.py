from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "tests" / "specs"


def pitfall_specs() -> list[Path]:
    return sorted(SPECS.glob("pitfall_*.yaml"))


@pytest.fixture(autouse=True)
def machine_cache(tmp_path_factory, monkeypatch) -> Path:
    """A cache of machine facts (peaks, capabilities: harness.run.cache) of each test's own: a fault one test
    injects must not become what the next test's probe reads."""
    path = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("AMP_HARNESS_CACHE", str(path))
    return path


@pytest.fixture
def specs_dir() -> Path:
    return SPECS
