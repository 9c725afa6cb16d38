"""The kit's specs: the goldens' (every built-in model and pitfall spec at CPU-sized batches, embedded in
goldens.json), and failure messages that quote what a spec isolates."""
from __future__ import annotations

from pathlib import Path

import yaml

from harness.conformance.goldens import load
from harness.errors import HarnessError
from harness.model.spec import ModelSpec, validate


def _specs() -> dict[str, ModelSpec]:
    try:
        return {g["model"]: validate(g["fingerprint"]["spec"], f"goldens.json: {g['model']}") for g in load()}
    except HarnessError:  # no goldens yet: test_goldens_are_shipped reports it
        return {}


SPECS = _specs()


def hint(spec: ModelSpec, message: str) -> str:
    """A failure message that names the spec and quotes what it isolates."""
    about = " ".join((spec.description or "").split())
    return f"{spec.name}: {message}" + (f". {spec.name} checks: {about}" if about else "")


def spec_file(folder: Path, name: str) -> str:
    """The kit's spec `name` written to a YAML file in `folder` (for the CLI, which takes spec paths)."""
    path = Path(folder) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(SPECS[name].model_dump(mode="json")))
    return str(path)
