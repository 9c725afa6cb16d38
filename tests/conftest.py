from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "tests" / "specs"


def pitfall_specs() -> list[Path]:
    return sorted(SPECS.glob("pitfall_*.yaml"))


@pytest.fixture(autouse=True)
def machine_cache(tmp_path_factory, monkeypatch) -> Path:
    """A cache of machine facts (peaks, capabilities, variant choices: harness.run.cache) of each test's own: the
    tests never read or write the user's ~/.cache/amp-harness nor a fact an earlier test or run left behind, and a
    fault one test injects never becomes what the next test's probe reads. adapters/*/tests import it too."""
    path = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("AMP_HARNESS_CACHE", str(path))
    return path


@pytest.fixture
def specs_dir() -> Path:
    return SPECS
