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

from harness.errors import HarnessError

HERE = Path(__file__).resolve().parent


class _CtrlC:
    """Tells a Ctrl-C from a collection error: pytest exits INTERRUPTED for both."""

    pressed = False

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        self.pressed = True


def run(framework: str, pytest_args: list[str]) -> int:
    """Run the kit against one adapter; amp-harness's exit code (docs/commands.md, "Exit codes"): 0 every check passed,
    1 a check failed or the kit could not run (a collection error, pytest's internal error), 130 Ctrl-C. Arguments that
    select no check, or that pytest cannot parse, are bad input: a HarnessError (exit 2)."""
    import pytest

    ctrl_c = _CtrlC()
    status = pytest.main(["-p", "harness.conformance.plugin", "--amp-framework", framework, "--rootdir", str(HERE),
                          "-p", "no:cacheprovider", *pytest_args, str(HERE)], plugins=[ctrl_c])
    if status == pytest.ExitCode.NO_TESTS_COLLECTED:
        raise HarnessError(f"no conformance check matches the pytest arguments {' '.join(pytest_args)!r}; the "
                           f"checks are the test names of {HERE}")
    if status == pytest.ExitCode.USAGE_ERROR:
        raise HarnessError(f"pytest refused the arguments {' '.join(pytest_args)!r} (its error is above)")
    if status == pytest.ExitCode.INTERRUPTED and ctrl_c.pressed:
        return 130
    return 0 if status == pytest.ExitCode.OK else 1


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1], sys.argv[2:]))
