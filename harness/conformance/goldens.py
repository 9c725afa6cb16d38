"""Golden fingerprints: the float64 fingerprints (initial outputs, every step's loss, outputs after K steps,
first-step gradients) of every built-in model and pitfall spec, so that a plugin's numbers can be checked
without any other framework installed.

Each golden embeds its spec (with the CPU-sized overrides tox fingerprints at), so the kit needs no spec file.
`tox -e goldens` regenerates goldens.json from the torch env's fingerprints, after checking them against the
tensorflow env's at the parity check's strict float64 tolerances:

    python -m harness.conformance.goldens REFERENCE_DIR CHECK_DIR [CHECK_DIR ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.errors import HarnessError

GOLDENS_FILE = Path(__file__).resolve().parent / "goldens.json"
PRECISION = "fp64"


def load() -> list[dict]:
    """The goldens as fingerprint records of the framework "golden" (what harness.parity.compare takes)."""
    if not GOLDENS_FILE.exists():
        raise HarnessError(f"{GOLDENS_FILE}: missing; `tox -e goldens` writes it")
    return json.loads(GOLDENS_FILE.read_text())["goldens"]


def write(reference_dir: str, check_dirs: list[str]) -> Path:
    from harness.parity import compare
    from harness.results import FINGERPRINTS_FILE, read_records

    reference = [r for r in read_records([reference_dir], FINGERPRINTS_FILE) if r["precision"] == PRECISION]
    checks = [r for r in read_records(check_dirs, FINGERPRINTS_FILE) if r["precision"] == PRECISION]
    if not reference or not checks:
        raise HarnessError(f"no {PRECISION} fingerprints in {reference_dir} or {check_dirs}: run the framework envs")
    failed = [c for c in compare(reference + checks) if not c.verdict.startswith("pass")]
    if failed:
        raise HarnessError("goldens not written: " + "; ".join(f"{c.model} {c.framework}: {c.verdict}" for c in failed))
    goldens = []
    for r in sorted(reference, key=lambda r: r["model"]):
        if r["status"] != "ok":
            raise HarnessError(f"{r['model']}: the reference run is {r['status']}: {r.get('reason')}")
        keep = ("model", "spec_hash", "precision", "status", "loss", "framework_version")
        goldens.append({**{k: r[k] for k in keep}, "framework": "golden", "run_id": f"golden-{r['model']}",
                        "source": r["framework"], "fingerprint": r["fingerprint"]})
    checked = sorted({f"{r['framework']} {r['framework_version']}" for r in checks})
    GOLDENS_FILE.write_text(json.dumps({
        "about": f"float64 fingerprints from {reference[0]['framework']} {reference[0]['framework_version']}, "
                 f"checked against {', '.join(checked)} (`tox -e goldens`)",
        "goldens": goldens}, separators=(",", ":")) + "\n")
    return GOLDENS_FILE


if __name__ == "__main__":
    try:
        path = write(sys.argv[1], sys.argv[2:])
    except (HarnessError, IndexError) as exc:
        print(f"goldens: {exc or 'usage: python -m harness.conformance.goldens REFERENCE_DIR CHECK_DIR...'}",
              file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
