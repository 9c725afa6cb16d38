from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "tests" / "specs"


def pitfall_specs() -> list[Path]:
    return sorted(SPECS.glob("pitfall_*.yaml"))


@pytest.fixture
def specs_dir() -> Path:
    return SPECS
