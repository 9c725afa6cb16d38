"""The conformance kit: the adapter contract as a test suite that runs against any installed adapter.

    amp-harness conformance --framework NAME [-- PYTEST_ARGS...]

It holds a plugin to everything the built-in adapters are held to (test_contract.py: packaging, the network's
math against the numpy reference, loss scaling, timing, records, tensor capture; test_memory.py; and
test_goldens.py: float64 fingerprints against the golden ones shipped here, so no other framework needs to be
installed). Every failure says what to fix; a failure on a pitfall spec quotes what that spec isolates.

The kit's specs are the goldens' (goldens.json): every built-in model and pitfall spec at the CPU-sized batches
tox fingerprints at.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(framework: str, pytest_args: list[str]) -> int:
    """Run the kit against one adapter; pytest's exit status."""
    import pytest

    return pytest.main(["-p", "harness.conformance.plugin", "--amp-framework", framework, "--rootdir", str(HERE),
                        "-p", "no:cacheprovider", *pytest_args, str(HERE)])


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1], sys.argv[2:]))
