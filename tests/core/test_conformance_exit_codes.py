"""`amp-harness conformance` exits as the table in docs/commands.md ("Exit codes") says (0 passed, 1 a failure,
2 bad input), not with pytest's own statuses (5: no test collected, 4: a usage error)."""
from __future__ import annotations

from harness.conformance import HERE
from tests.core.test_runner import amp

KIT = ["conformance", "--framework", "fake", "--", "-q"]


def test_arguments_that_select_no_check_are_bad_input():
    out = amp(*KIT, "-k", "nosuch")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"amp-harness: error: no conformance check matches the pytest arguments '-q -k nosuch'; the checks are "
        f"the test names of {HERE}"]


def test_arguments_pytest_cannot_parse_are_bad_input():
    out = amp(*KIT, "--nosuchoption")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == ("amp-harness: error: pytest refused the arguments "
                                                   "'-q --nosuchoption' (its error is above)")


def test_a_failing_check_exits_1():
    # the fake adapter's outputs are uniform, not the network's
    out = amp(*KIT, "-k", "test_outputs_match_the_numpy_reference and mnist_mlp and fp32")
    assert out.returncode == 1
    assert "1 failed" in out.stdout and "conformance of fake: FAILED" in out.stdout
